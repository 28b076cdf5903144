"""Building blocks shared by the reference models: norms, RoPE, KV cache, attention, MLPs.

Shapes: B batch, S query length, L key length (S, or cache prefix + S when
decoding), h hidden, a query heads, g key/value heads, d head dim, f MLP width.

Decisions:
- Head counts are never written into views (``view(B, S, -1, d)``): after
  Megatron TP shards q/k/v by heads, the captured graph stays valid with a
  local head count.
- GQA repeats each key/value head a/g times with ``expand`` + ``flatten``
  rather than ``enable_gqa`` so both attention paths see the same tensors and
  the ratio a/g is what survives TP sharding.
- RoPE tables are computed from positions in every forward (no buffers), so a
  model built on ``meta`` and materialised with ``to_empty`` needs nothing but
  ``init_weights``. Rotation is the "rotate half" form: pairs (i, i + d/2).
- ``attn_impl="math"`` is the explicit path of Korthikanti et al.: QKᵀ, causal
  mask, softmax (in the activation dtype), attention dropout, ·V. ``"sdpa"``
  calls ``F.scaled_dot_product_attention`` with ``is_causal=True`` (or an
  explicit offset mask when attending over a KV cache).
- Dropout modules always exist but are only called when p > 0, so a p = 0
  model's graph holds no dropout nodes (no masks to account for).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import ModelError


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · weight, in fp32 then cast back."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, each [S, d], for integer ``positions`` [S]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [d/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [S, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, d]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` [B, heads, S, d] by the angles of ``rope`` (rotate-half form)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def positions(start_pos: int | torch.Tensor, seq_len: int, device: torch.device) -> torch.Tensor:
    """Positions [S] of ``seq_len`` tokens from ``start_pos`` (an int, or a 0-d device tensor: the static decode
    step, whose shapes do not depend on the position, as a CUDA graph needs)."""
    if torch.is_tensor(start_pos):
        return torch.arange(seq_len, device=device) + start_pos
    return torch.arange(start_pos, start_pos + seq_len, device=device)


def causal_mask(q_len: int, kv_len: int, offset: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Boolean [S, L] mask, True where query i (at position offset + i) may see key j (j ≤ offset + i)."""
    q_pos = positions(offset, q_len, device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return k_pos <= q_pos


class KVCache:
    """Keys and values of past positions for incremental decoding.

    One buffer pair per block, each [B, g, max_len, d]. ``update`` writes the
    new positions at ``start_pos`` and returns the prefix [B, g, start_pos+S, d].
    Positions past what was written are garbage; callers pass a ``start_pos``
    equal to the number of tokens already fed.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.max_len = max_len
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    def check(self, start_pos: int, seq_len: int) -> None:
        """Raise ``ModelError`` if positions [start_pos, start_pos+seq_len) do not fit."""
        if start_pos < 0 or start_pos + seq_len > self.max_len:
            raise ModelError(
                f"KV cache of max_len={self.max_len} cannot hold positions [{start_pos}, {start_pos + seq_len}); "
                "allocate a longer cache with model.new_cache(batch, max_len)"
            )

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, g, S, d] at ``start_pos`` of block ``layer``; return keys, values [B, g, L, d].

        A tensor ``start_pos`` (the static decode step): written with ``index_copy_`` and the whole buffer
        returned (L = max_len; the causal mask hides what was not written yet)."""
        if torch.is_tensor(start_pos):
            index = positions(start_pos, k.shape[2], k.device)
            self.keys[layer].index_copy_(2, index, k)
            self.values[layer].index_copy_(2, index, v)
            return self.keys[layer], self.values[layer]
        end = start_pos + k.shape[2]
        self.keys[layer][:, :, start_pos:end] = k
        self.values[layer][:, :, start_pos:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    """Causal multi-head / grouped-query self-attention with projections q, k, v, o."""

    def __init__(
        self,
        *,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dropout: float,
        attn_impl: str,
        layer_idx: int,
    ) -> None:
        super().__init__()
        self.head_dim = hidden // num_heads
        self.kv_repeat = num_heads // num_kv_heads
        self.attn_impl = attn_impl
        self.layer_idx = layer_idx
        self.q = nn.Linear(hidden, num_heads * self.head_dim, bias=bias)
        self.k = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(hidden, num_kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(num_heads * self.head_dim, hidden, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # [B, heads, S, d]

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        if self.kv_repeat == 1:
            return t
        batch, groups, length, dim = t.shape
        return t[:, :, None].expand(batch, groups, self.kv_repeat, length, dim).flatten(1, 2)  # [B, a, L, d]

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: KVCache | None,
        start_pos: int | torch.Tensor,
    ) -> torch.Tensor:
        """x [B, S, h] → [B, S, h]; with ``cache``, attend over the cached prefix too (a tensor ``start_pos``:
        over the whole cache, masked: ``KVCache.update``)."""
        batch, seq, _ = x.shape
        q, k, v = self._heads(self.q, x), self._heads(self.k, x), self._heads(self.v, x)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        mask = None
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, start_pos)
            mask = causal_mask(seq, k.shape[2], start_pos, x.device)  # [S, L]
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if self.attn_impl == "math":
            out = self._math_attention(q, k, v, mask)
        else:
            out = self._sdpa_attention(q, k, v, mask)
        out = self.o(out.transpose(1, 2).reshape(batch, seq, -1))  # [B, S, h]
        return self.resid_dropout(out) if self.resid_dropout.p > 0 else out

    def _math_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [B, a, S, L]
        if mask is None:
            mask = causal_mask(q.shape[2], k.shape[2], 0, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1)
        if self.attn_dropout.p > 0:
            probs = self.attn_dropout(probs)
        return probs @ v  # [B, a, S, d]

    def _sdpa_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        dropout_p = self.attn_dropout.p if self.training else 0.0
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class GeluMLP(nn.Module):
    """GPT-2 MLP: up (h→f) → GELU (tanh approximation) → down (f→h) → dropout."""

    def __init__(self, *, hidden: int, ffn_hidden: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn_hidden)
        self.down = nn.Linear(ffn_hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(F.gelu(self.up(x), approximate="tanh"))  # [B, S, h]
        return self.dropout(out) if self.dropout.p > 0 else out


class SwiGLUMLP(nn.Module):
    """Llama MLP: down(silu(gate(x)) · up(x)), no biases, then dropout."""

    def __init__(self, *, hidden: int, ffn_hidden: int, dropout: float) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(F.silu(self.gate(x)) * self.up(x))  # [B, S, h]
        return self.dropout(out) if self.dropout.p > 0 else out
