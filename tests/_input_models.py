"""A user-written causal LM that takes the inputs a real training batch carries, for ``tests/test_model_inputs.py``.

``MaskedLM.forward(input_ids, attention_mask=None, position_ids=None, segment_ids=None)``:

* ``attention_mask`` [B, S]: 1 for a token, 0 for padding (left or right). A query attends to the
  earlier real tokens of its row and always to itself (a left-padded row's padding would otherwise
  attend to nothing: SDPA's NaN, which Hugging Face avoids the same way).
* ``position_ids`` [B, S]: learned positions (default ``0..S-1``); packed rows restart them per document.
* ``segment_ids`` [B, S]: the document of each token of a packed row; attention is block-diagonal
  causal (a token sees the earlier tokens of its own document only).

The blocks are written as users write them (``q_proj``/``k_proj``/``v_proj``/``o_proj``, SDPA with a
boolean ``[B, 1, S, S]`` mask, ``view``/``transpose`` head split), so capture's heuristics give them
tensor-parallel roles.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HEADS, LAYERS, MAX_POS = 64, 32, 4, 2, 32


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads), MLP(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask)
        return x + self.mlp(self.mlp_norm(x))


class MaskedLM(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, LM head and value head (module docstring)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, layers: int = LAYERS,
                 max_pos: int = MAX_POS) -> None:
        super().__init__()
        self.embed, self.pos_embed = nn.Embedding(vocab, dim), nn.Embedding(max_pos, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.value_head = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None):
        s = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)  # [1, S]
        idx = torch.arange(s, device=input_ids.device)
        mask = (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, S, S] causal: key j <= query i
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :]).unsqueeze(1)  # [B, 1, S, S]
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
            mask = mask & (keys | (idx[None, :] == idx[:, None]))  # a padding query still sees itself
        x = self.embed(input_ids) + self.pos_embed(position_ids)  # [B, S, h]
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        return self.head(x), self.value_head(x).squeeze(-1)


def masked_lm(seed: int = 0) -> MaskedLM:
    torch.manual_seed(seed)
    return MaskedLM()


def padded_batch(batch: int, seq: int, *, left: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random tokens with 1..seq real tokens per row (right padding, or ``left``); ``loss_mask`` marks the
    next-token targets that are real (position i predicts i + 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (batch, seq), generator=g)
    lengths = torch.randint(2, seq + 1, (batch,), generator=g)
    real = torch.arange(seq)[None, :] < lengths[:, None]  # [B, S] right padding
    if left:
        real = real.flip(1)
    tokens = torch.where(real, tokens, torch.zeros_like(tokens))
    positions = (real.long().cumsum(1) - 1).clamp(min=0)  # HF's left-padding positions: 0 at the first token
    loss_mask = (real[:, :-1] & real[:, 1:]).float()  # [B, S-1]
    return {"input_ids": tokens, "attention_mask": real.long(), "position_ids": positions,
            "loss_mask": torch.cat([loss_mask, torch.zeros(batch, 1)], 1)}


def packed_batch(batch: int, seq: int, *, seed: int = 2) -> dict[str, torch.Tensor]:
    """Rows of several documents packed end to end: ``segment_ids`` numbers them, ``position_ids`` restart
    at 0 per document; ``loss_mask`` drops the targets that cross a document boundary."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (batch, seq), generator=g)
    segments = torch.zeros(batch, seq, dtype=torch.long)
    positions = torch.zeros(batch, seq, dtype=torch.long)
    for row in range(batch):
        start, doc = 0, 0
        while start < seq:
            length = int(torch.randint(1, seq // 2 + 1, (1,), generator=g))
            segments[row, start:start + length] = doc
            positions[row, start:start + length] = torch.arange(min(length, seq - start))
            start, doc = start + length, doc + 1
    same = (segments[:, 1:] == segments[:, :-1]).float()
    return {"input_ids": tokens, "position_ids": positions, "segment_ids": segments,
            "loss_mask": torch.cat([same, torch.zeros(batch, 1)], 1)}


def token_loss_sum(outputs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ over the batch's loss tokens of next-token cross-entropy + 0.1·value² (a sum: the program normalises)."""
    logits, values = outputs
    mask = batch["loss_mask"][:, :-1]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1),
                          reduction="none").view_as(mask)
    return ((nll + 0.1 * values[:, :-1].pow(2)) * mask).sum()
