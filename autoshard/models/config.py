"""Configurations of the reference policy models, one frozen dataclass per family.

Each config validates itself in ``__post_init__`` (raising ``ModelError``) and
counts its parameters by closed-form formula, so the search can price a 70B
model without building it. With h = hidden, f = ffn_hidden, L = num_layers,
V = vocab_size, s = max_seq_len, d = head dim, g = num_kv_heads, E = experts:

    GPT   per block: 4h² + 4h (q, k, v, o with biases) + 2hf + f + h (up, down
          with biases) + 4h (two LayerNorms)
          total: L·block + Vh (embed) + sh (pos_embed) + 2h (final norm)
                 + [Vh if untied] + h + 1 (value head)
          With f = 4h this is 12Lh²·(1 + 13/(12h) + (V+s)/(12Lh)) + 2h + h + 1,
          the count of Narayanan et al. 2021 plus final norm and value head.
    Llama per block: 2h² + 2h·g·d (q, o; k, v) + 3hf (gate, up, down) + 2h
          total: L·block + Vh + h + [Vh if untied] + h + 1
    MoE   per block: 2h² + 2h·g·d + hE (router) + 3Ehf (experts) + 2h
          total: as Llama.

``param_count()`` equals ``sum(p.numel() for p in model.parameters())`` of the
built model exactly (tied weights counted once); the tests check both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoshard.errors import ModelError

ATTN_IMPLS = ("math", "sdpa")


def _check_positive_int(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(
            f"{type(config).__name__}.{name}={value!r}: must be a positive integer; "
            "fix the override or the size table"
        )


def _check_divides(config: object, small: str, big: str) -> None:
    a, b = getattr(config, small), getattr(config, big)
    if b % a:
        raise ModelError(
            f"{type(config).__name__}: {big}={b} is not divisible by {small}={a}; "
            f"choose {small} among the divisors of {b}"
        )


@dataclass(frozen=True, kw_only=True)
class _CommonConfig:
    """Fields every family shares (not a family itself)."""

    vocab_size: int
    """Vocabulary size V (rows of ``embed`` and ``head``)."""
    max_seq_len: int
    """Longest sequence the model is built for (``pos_embed`` rows for GPT; KV-cache bound)."""
    hidden: int
    """Model width h."""
    num_layers: int
    """Number of transformer blocks L."""
    num_heads: int
    """Attention (query) heads a; ``hidden`` must be divisible by it."""
    ffn_hidden: int | None = None
    """MLP inner width f; ``None`` picks the family default (see the family)."""
    dropout: float = 0.0
    """Dropout probability of the residual, attention-probability and MLP dropouts."""
    tie_embeddings: bool = False
    """Share ``head.weight`` with ``embed.weight``."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    attn_impl: str = "sdpa"
    """``"math"``: explicit QKᵀ → mask → softmax → dropout → ·V (activations as in
    Korthikanti et al.); ``"sdpa"``: ``F.scaled_dot_product_attention``."""

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", self._default_ffn_hidden())
        for name in ("vocab_size", "max_seq_len", "hidden", "num_layers", "num_heads", "ffn_hidden"):
            _check_positive_int(self, name)
        _check_divides(self, "num_heads", "hidden")
        if self.attn_impl not in ATTN_IMPLS:
            raise ModelError(
                f"{type(self).__name__}.attn_impl={self.attn_impl!r}: allowed {ATTN_IMPLS}"
            )
        p = self.dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ModelError(f"{type(self).__name__}.dropout={self.dropout!r}: must be a float in [0, 1)")
        if not isinstance(self.norm_eps, (int, float)) or self.norm_eps <= 0:
            raise ModelError(f"{type(self).__name__}.norm_eps={self.norm_eps!r}: must be a positive float")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelError(f"{type(self).__name__}.tie_embeddings={self.tie_embeddings!r}: must be True or False")

    def _default_ffn_hidden(self) -> int:
        raise NotImplementedError

    @property
    def head_dim(self) -> int:
        """Width d of one attention head (hidden / num_heads)."""
        return self.hidden // self.num_heads

    def _outer_params(self, final_norm: int) -> int:
        """Embedding, final norm, untied head and value head."""
        h, v = self.hidden, self.vocab_size
        head = 0 if self.tie_embeddings else v * h
        return v * h + final_norm + head + h + 1

    @classmethod
    def from_fields(cls, fields: dict[str, object]):
        """Build from a field dict; unknown names raise ``ModelError`` naming the allowed ones.

        ``None``-defaulted fields (``ffn_hidden``, ``num_kv_heads``) absent from
        ``fields`` are derived from the others, so overriding ``hidden`` also
        rescales a default ``ffn_hidden``.
        """
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(allowed))
        if unknown:
            raise ModelError(
                f"unknown {cls.__name__} field(s) {unknown}; allowed: {', '.join(allowed)}; fix the override name"
            )
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class GPTConfig(_CommonConfig):
    """GPT-2 / GPT-3 style: learned positions, pre-LayerNorm, GELU MLP, biases.

    ``ffn_hidden`` defaults to 4·hidden; embeddings are tied by default and
    attention is the explicit ``math`` path by default so that captured
    activation memory matches Korthikanti et al.
    """

    tie_embeddings: bool = True
    """Share ``head.weight`` with ``embed.weight`` (GPT-2 does)."""
    attn_impl: str = "math"
    """``"math"`` (default, explicit path) or ``"sdpa"``."""

    def _default_ffn_hidden(self) -> int:
        return 4 * self.hidden

    def param_count(self) -> int:
        """Exact parameter count of the built model (module docstring formula)."""
        h, f, s = self.hidden, self.ffn_hidden, self.max_seq_len
        block = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 4 * h
        return self.num_layers * block + s * h + self._outer_params(final_norm=2 * h)


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(_CommonConfig):
    """Llama style: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, no biases.

    ``ffn_hidden`` defaults to 8/3·hidden rounded up to a multiple of 256 (the
    Llama rule with ``multiple_of=256``).
    """

    num_kv_heads: int | None = None
    """Key/value heads g (grouped-query attention); ``None`` means ``num_heads`` (MHA)."""
    rope_theta: float = 10000.0
    """RoPE base θ: rotation frequency of pair i is θ^(-2i/d)."""

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        super().__post_init__()
        _check_positive_int(self, "num_kv_heads")
        _check_divides(self, "num_kv_heads", "num_heads")
        if self.head_dim % 2:
            raise ModelError(
                f"{type(self).__name__}: head dim hidden/num_heads={self.head_dim} is odd; "
                "RoPE rotates pairs, choose hidden and num_heads with an even quotient"
            )
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ModelError(f"{type(self).__name__}.rope_theta={self.rope_theta!r}: must be positive")

    def _default_ffn_hidden(self) -> int:
        return -(-(8 * self.hidden // 3) // 256) * 256

    def _attention_params(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * h * self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        """Exact parameter count of the built model (module docstring formula)."""
        h, f = self.hidden, self.ffn_hidden
        block = self._attention_params() + 3 * h * f + 2 * h
        return self.num_layers * block + self._outer_params(final_norm=h)


@dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Llama-style blocks whose MLP is a top-k Mixture of Experts (Mixtral style).

    ``ffn_hidden`` is the inner width of one expert.
    """

    num_experts: int = 8
    """Experts E per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to (k ≤ E)."""
    capacity_factor: float | None = None
    """``None``: dropless. Else each expert takes at most C = ⌈factor·k·T/E⌉ of
    the T tokens of a forward call; assignments beyond C are dropped."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int(self, "num_experts")
        _check_positive_int(self, "top_k")
        if self.top_k > self.num_experts:
            raise ModelError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                f"choose top_k in 1..{self.num_experts}"
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
            raise ModelError(
                f"MoEConfig.capacity_factor={cf!r}: must be a positive float, or None for dropless routing"
            )

    def _expert_block_params(self, experts: int) -> int:
        h, f = self.hidden, self.ffn_hidden
        return self._attention_params() + h * self.num_experts + experts * 3 * h * f + 2 * h

    def param_count(self) -> int:
        """Exact parameter count of the built model (module docstring formula)."""
        blocks = self.num_layers * self._expert_block_params(self.num_experts)
        return blocks + self._outer_params(final_norm=self.hidden)

    def active_param_count(self) -> int:
        """Parameters one token touches: only ``top_k`` of the experts per layer."""
        blocks = self.num_layers * self._expert_block_params(self.top_k)
        return blocks + self._outer_params(final_norm=self.hidden)


ModelConfig = GPTConfig | LlamaConfig | MoEConfig
