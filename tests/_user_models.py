"""Models written outside the project, as a user would bring them to the CLI (``package.module:factory``).

``nano_policy``: a nanoGPT-style actor-critic (learned positions, fused qkv ``nn.Linear``, SDPA, GELU MLP,
a value head), built on whatever device and dtype the caller asks. ``cpu_only_policy`` takes no
arguments (built on the CPU; the CLI moves it to meta). The others are bad inputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class NanoPolicy(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, positions: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.critic = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        return self.lm_head(x), self.critic(x).squeeze(-1)


def nano_policy(device="cpu", dtype=torch.float32) -> NanoPolicy:
    with torch.device(device):
        return NanoPolicy().to(dtype)


def cpu_only_policy() -> NanoPolicy:
    torch.manual_seed(0)
    return NanoPolicy(layers=3)


def not_a_module():
    return {"weights": 1}


def raises():
    raise RuntimeError("checkpoint missing")


NOT_CALLABLE = 3
