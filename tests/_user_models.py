"""Models written outside the project, as a user would bring them to the CLI (``package.module:factory``).

``nano_policy``: a nanoGPT-style actor-critic (learned positions, fused qkv ``nn.Linear``, SDPA, GELU MLP,
a value head), built on whatever device and dtype the caller asks. ``cpu_only_policy`` takes no
arguments (built on the CPU; the CLI moves it to meta). ``llama_style_policy``: a Llama-style block
written by hand (separate ``wq``/``wk``/``wv``/``wo`` with grouped-query heads and RoPE, SwiGLU
``w1``/``w2``/``w3``, ``nn.RMSNorm``): no module name says attention or MLP; ``mqa_policy`` is it with one
key/value head. The others are bad inputs.
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


class LlamaStyleBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, positions: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk, self.wv = (nn.Linear(dim, kv_heads * self.head_dim, bias=False) for _ in range(2))
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = (nn.Linear(dim, ffn, bias=False) for _ in range(2))
        self.w2 = nn.Linear(ffn, dim, bias=False)
        inv_freq = 10000.0 ** (-torch.arange(0, self.head_dim, 2) / self.head_dim)
        angles = torch.outer(torch.arange(positions).float(), inv_freq)  # (P, hs/2)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)  # [P, hd]
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:  # (B, nh, T, hs)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        s = x.shape[2]
        return x * self.cos[:s] + rotated * self.sin[:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaStylePolicy(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 128, positions: int = 256) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaStyleBlock(dim, heads, kv_heads, ffn, positions) for _ in range(layers))
        self.ln = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.critic = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        return self.lm_head(x), self.critic(x).squeeze(-1)


def llama_style_policy(device="cpu", dtype=torch.float32, **sizes) -> LlamaStylePolicy:
    with torch.device(device):
        return LlamaStylePolicy(**sizes).to(dtype)


def mqa_policy(device="cpu", dtype=torch.float32) -> LlamaStylePolicy:
    """``llama_style_policy`` with one key/value head (multi-query attention): tp cannot split it."""
    return llama_style_policy(device, dtype, kv_heads=1)


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
