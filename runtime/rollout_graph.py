"""One decode step of the rollout replica, captured as a CUDA graph and replayed per token.

Eager decoding at a rollout's batch sizes is bound by kernel launches and Python
dispatch, not by the GPU: every token re-issues a thousand small kernels. As
vLLM and SGLang do, the step is captured once and replayed. The captured step is
the model's own ``forward(tokens [B, 1], cache=, start_pos=POS)`` with ``POS`` a
0-d device tensor: RoPE and positions are computed from it, the KV cache is
written with ``index_copy_`` at ``POS`` and attention reads the whole cache
buffer under a causal mask (``models/layers.py``: ``KVCache.update``), so no
shape or Python branch depends on the position. Parameters and the cache are
read at fixed addresses: the reshard copies into the same tensors, and the
engine keeps one cache per (batch, length), so a graph serves every later RL
step of that shape.

Capture runs a warm-up on a side stream and the capture itself at position
``max_len − 1``: the garbage they write there is masked from every earlier
position and overwritten by the real step at that position. A tensor-parallel
replica's all-reduces and all-gathers are captured with the step (NCCL); every
rank of the group captures at the same decode step. Where capture fails, the
engine says so once and decodes eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DecodeGraph:
    """The captured decode step of ``replica`` for ``cache`` (batch and length fixed)."""

    def __init__(self, replica: nn.Module, cache: Any, batch: int, device: torch.device | str) -> None:
        self.cache = cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.full((), cache.max_len - 1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                replica(self.tokens, cache=cache, start_pos=self.pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits, self.values = replica(self.tokens, cache=cache, start_pos=self.pos)

    def run(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, 1, V], values [B, 1]) of ``tokens`` [B, 1] at ``start_pos``: views of the graph's outputs,
        valid until the next replay."""
        self.tokens.copy_(tokens)
        self.pos.fill_(start_pos)
        self.graph.replay()
        return self.logits, self.values


__all__ = ["DecodeGraph"]
