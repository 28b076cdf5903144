"""The three reference actor-critic policies: ``GPTModel``, ``LlamaModel``, ``MoEModel``.

``forward(tokens [B, S]) -> (logits [B, S, V], values [B, S])``: a decoder
trunk, the LM head on the final normed hidden state, and a scalar value head
on the same state (shared trunk actor-critic, as in PPO for LLMs).

Module names are a contract with capture, the passes and TP sharding (see
``TP_ROLE_RULES``): ``embed``, ``pos_embed`` (GPT), ``blocks.i.{attn_norm,
attn.{q,k,v,o}, mlp_norm, mlp.{up,gate,down} | moe.{router,w_gate,w_up,w_down}}``,
``norm``, ``head``, ``value_head``.

Initialisation, GPT-2 style (``init_rule``): weights N(0, 0.02²); residual
projections (``attn.o``, ``mlp.down``, ``moe.w_down``) N(0, (0.02/√(2L))²);
biases 0; norm weights 1. Values come from ``autoshard.init``'s counter-based
generator, a function of (seed, parameter name, element index), so a sharded
build creates each rank's shards alone and they equal the single-device
``init_weights(seed)`` whatever the plan.

Plain ``forward(tokens)`` is the export path (no Python branches on data or
shapes). ``forward(tokens, cache=..., start_pos=p)`` is eager-only decoding.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from autoshard.errors import ModelError
from autoshard.graph import TP_ROLES
from autoshard.init import Constant, InitRule, Normal, init_tensor_
from autoshard.models.config import GPTConfig, LlamaConfig, MoEConfig
from autoshard.models.layers import Attention, GeluMLP, KVCache, RMSNorm, SwiGLUMLP, positions, rope_tables
from autoshard.models.moe import MoE

INIT_STD = 0.02
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [S, d]

# (FQN pattern, role); first match wins. Biases of column linears are split
# with their outputs; biases of row linears are added after the all-reduce.
TP_ROLE_RULES: tuple[tuple[str, str], ...] = (
    (r"embed\.weight", "vocab"),
    (r"head\.weight", "vocab"),
    (r"pos_embed\.weight", "replicate"),
    (r"blocks\.\d+\.attn\.[qkv]\.(weight|bias)", "column"),
    (r"blocks\.\d+\.attn\.o\.weight", "row"),
    (r"blocks\.\d+\.attn\.o\.bias", "replicate"),
    (r"blocks\.\d+\.mlp\.(up|gate)\.(weight|bias)", "column"),
    (r"blocks\.\d+\.mlp\.down\.weight", "row"),
    (r"blocks\.\d+\.mlp\.down\.bias", "replicate"),
    (r"blocks\.\d+\.moe\.w_(gate|up|down)", "expert"),
    (r"blocks\.\d+\.moe\.router\.weight", "replicate"),
    (r"(blocks\.\d+\.(attn|mlp)_norm|norm)\.(weight|bias)", "replicate"),
    (r"value_head\.(weight|bias)", "replicate"),
)
_RESIDUAL_PROJECTIONS = re.compile(r".*\.(attn\.o\.weight|mlp\.down\.weight|moe\.w_down)")
_NORM_WEIGHTS = re.compile(r"(.*\.)?(attn_norm|mlp_norm|norm)\.weight")


def tp_role(name: str) -> str:
    """The Megatron TP role of parameter ``name`` (see ``autoshard.graph.TP_ROLES``)."""
    for pattern, role in TP_ROLE_RULES:
        if re.fullmatch(pattern, name):
            assert role in TP_ROLES, role
            return role
    raise AssertionError(f"no TP role rule matches parameter {name!r}")


class Block(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)) or + moe(mlp_norm(x))."""

    def __init__(self, attn_norm: nn.Module, attn: Attention, mlp_norm: nn.Module, ffn: nn.Module) -> None:
        super().__init__()
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        if isinstance(ffn, MoE):
            self.moe = ffn
        else:
            self.mlp = ffn

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        cache: KVCache | None,
        start_pos: int,
        aux_losses: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        """x [B, S, h] → [B, S, h]; appends the MoE load-balancing loss to ``aux_losses`` if given."""
        x = x + self.attn(self.attn_norm(x), rope, cache, start_pos)
        if not hasattr(self, "moe"):
            return x + self.mlp(self.mlp_norm(x))
        if aux_losses is None:
            return x + self.moe(self.mlp_norm(x))
        out, aux = self.moe.forward_with_aux(self.mlp_norm(x))
        aux_losses.append(aux)
        return x + out


class PolicyModel(nn.Module):
    """Shared trunk, heads, cache, roles and init; families define ``_embed`` and their blocks."""

    config: GPTConfig | LlamaConfig | MoEConfig

    def _finish(self, config: GPTConfig | LlamaConfig | MoEConfig, norm: nn.Module) -> None:
        """Add the final norm, LM head (tied or not) and value head."""
        self.norm = norm
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.value_head = nn.Linear(config.hidden, 1)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Point ``head.weight`` at ``embed.weight`` when the config ties them (again after ``to_empty``)."""
        if self.config.tie_embeddings:
            self.head.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, Rope | None]:
        """tokens [B, S] → (x [B, S, h], RoPE tables or None)."""
        raise NotImplementedError

    def forward(
        self, tokens: torch.Tensor, *, cache: KVCache | None = None, start_pos: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] → (logits [B, S, V], values [B, S]).

        With ``cache``, tokens sit at positions start_pos.. and attend to the
        cached prefix; keys and values are appended to the cache.
        """
        return self._run(tokens, cache, start_pos, None)

    def _run(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None,
        start_pos: int,
        aux_losses: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is not None and not torch.is_tensor(start_pos):  # a tensor: the static decode step (no sync)
            self._check_positions(cache, start_pos, tokens.shape[1])
        x, rope = self._embed(tokens, start_pos)  # [B, S, h]
        for block in self.blocks:
            x = block(x, rope, cache, start_pos, aux_losses)
        x = self.norm(x)
        return self.head(x), self.value_head(x).squeeze(-1)  # [B, S, V], [B, S]

    def _check_positions(self, cache: KVCache, start_pos: int, seq_len: int) -> None:
        cache.check(start_pos, seq_len)
        if start_pos + seq_len > self.config.max_seq_len:
            raise ModelError(
                f"positions up to {start_pos + seq_len} exceed max_seq_len={self.config.max_seq_len}; "
                "build the model with a larger max_seq_len override"
            )

    def new_cache(
        self, batch: int, max_len: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens (default: the model's device/dtype)."""
        ref = self.embed.weight
        cfg = self.config
        return KVCache(
            num_layers=cfg.num_layers,
            batch=batch,
            num_kv_heads=getattr(cfg, "num_kv_heads", cfg.num_heads),
            max_len=max_len,
            head_dim=cfg.head_dim,
            device=ref.device if device is None else device,
            dtype=ref.dtype if dtype is None else dtype,
        )

    def tp_roles(self) -> dict[str, str]:
        """Parameter FQN (as in ``named_parameters()``, tied ones once) → TP role."""
        return {name: tp_role(name) for name, _ in self.named_parameters()}

    def init_rule(self, name: str) -> InitRule:
        """How parameter ``name`` is initialised (module docstring); ``autoshard.init`` draws the values."""
        if name.endswith("bias"):
            return Constant(0.0)
        if _NORM_WEIGHTS.fullmatch(name):
            return Constant(1.0)
        residual = _RESIDUAL_PROJECTIONS.fullmatch(name)
        return Normal(0.0, INIT_STD / math.sqrt(2 * self.config.num_layers) if residual else INIT_STD)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every materialised parameter with ``init_rule`` and ``seed`` (meta ones are skipped)."""
        for name, param in self.named_parameters():
            if not param.is_meta:
                init_tensor_(param, self.init_rule(name), seed, name)


class GPTModel(PolicyModel):
    """GPT-2 style actor-critic (learned positions, LayerNorm, GELU MLP, biases)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.embed = nn.Embedding(config.vocab_size, h)
        self.pos_embed = nn.Embedding(config.max_seq_len, h)
        self.embed_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(
                nn.LayerNorm(h, eps=config.norm_eps),
                _attention(config, i, num_kv_heads=config.num_heads, bias=True),
                nn.LayerNorm(h, eps=config.norm_eps),
                GeluMLP(hidden=h, ffn_hidden=config.ffn_hidden, dropout=config.dropout),
            )
            for i in range(config.num_layers)
        )
        self._finish(config, nn.LayerNorm(h, eps=config.norm_eps))

    def _embed(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, Rope | None]:
        x = self.embed(tokens) + self.pos_embed(positions(start_pos, tokens.shape[1], tokens.device))  # [B, S, h]
        return (self.embed_dropout(x) if self.embed_dropout.p > 0 else x), None


class LlamaModel(PolicyModel):
    """Llama style actor-critic (RMSNorm, RoPE, GQA, SwiGLU, no biases)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(
            Block(
                RMSNorm(config.hidden, config.norm_eps),
                _attention(config, i, num_kv_heads=config.num_kv_heads, bias=False),
                RMSNorm(config.hidden, config.norm_eps),
                self._ffn(config),
            )
            for i in range(config.num_layers)
        )
        self._finish(config, RMSNorm(config.hidden, config.norm_eps))

    def _ffn(self, config: LlamaConfig) -> nn.Module:
        return SwiGLUMLP(hidden=config.hidden, ffn_hidden=config.ffn_hidden, dropout=config.dropout)

    def _embed(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, Rope | None]:
        where = positions(start_pos, tokens.shape[1], tokens.device)  # [S]
        return self.embed(tokens), rope_tables(where, self.config.head_dim, self.config.rope_theta)


class MoEModel(LlamaModel):
    """Llama-style blocks with top-k Mixture-of-Experts MLPs (``blocks.i.moe``)."""

    config: MoEConfig

    def _ffn(self, config: MoEConfig) -> nn.Module:
        return MoE(
            hidden=config.hidden,
            ffn_hidden=config.ffn_hidden,
            num_experts=config.num_experts,
            top_k=config.top_k,
            capacity_factor=config.capacity_factor,
            dropout=config.dropout,
        )

    def forward_with_aux(
        self, tokens: torch.Tensor, *, cache: KVCache | None = None, start_pos: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` plus the mean over layers of the MoE load-balancing loss []."""
        aux_losses: list[torch.Tensor] = []
        logits, values = self._run(tokens, cache, start_pos, aux_losses)
        return logits, values, torch.stack(aux_losses).mean()


def _attention(config: GPTConfig | LlamaConfig, layer_idx: int, *, num_kv_heads: int, bias: bool) -> Attention:
    return Attention(
        hidden=config.hidden,
        num_heads=config.num_heads,
        num_kv_heads=num_kv_heads,
        bias=bias,
        dropout=config.dropout,
        attn_impl=config.attn_impl,
        layer_idx=layer_idx,
    )
