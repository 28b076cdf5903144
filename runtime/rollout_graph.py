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

Before capture the step is ``torch.compile``d (inductor, static shapes), which
fuses the step's elementwise kernels: on an H200 the captured step of llama:1.3b
at 32 sequences falls from 1,370 kernels in 4.71 ms to 389 in 2.29 ms, llama:7b's
from 1,947 in 9.93 ms to 646 in 6.36 ms, for 23–27 s of compilation once per
(batch, length) (``benchmarks/results/rl_step_h200x2_2026-11-28``). Where
compiling fails, the eager step is captured (said once);
``AUTOSHARD_ROLLOUT_COMPILE=0`` captures the eager step always (the rollout
price assumes the compiled step on GPUs: ``search/rollout.py``).

Capture runs a warm-up on a side stream and the capture itself at position
``max_len − 1``: the garbage they write there is masked from every earlier
position and overwritten by the real step at that position. A tensor-parallel
replica's all-reduces and all-gathers are captured with the step (NCCL); every
rank of the group captures at the same decode step. Where capture fails, the
engine says so once and decodes eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def compile_wanted() -> bool:
    """Whether decode steps are compiled before capture (module docstring; ``AUTOSHARD_ROLLOUT_COMPILE=0``: no)."""
    return os.environ.get("AUTOSHARD_ROLLOUT_COMPILE", "1") != "0"


def decode_step(replica: nn.Module, cache: Any, backend: str | None) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """``step(tokens, pos)``: the replica's one-token forward at a 0-d tensor position over ``cache``;
    ``torch.compile``d with ``backend`` (static shapes) unless it is None."""

    def step(tokens: torch.Tensor, pos: torch.Tensor) -> Any:
        return replica(tokens, cache=cache, start_pos=pos)

    return step if backend is None else torch.compile(step, backend=backend, dynamic=False)


def warmed_step(replica: nn.Module, cache: Any, tokens: torch.Tensor, pos: torch.Tensor, backend: str | None,
                runs: int = 2) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """``decode_step`` run ``runs`` times at (``tokens``, ``pos``), compiling it on the first; where compiling
    fails, the eager step (said once)."""
    step = decode_step(replica, cache, backend)
    try:
        for _ in range(runs):
            step(tokens, pos)
    except Exception as err:  # noqa: BLE001 - any compile failure: the eager step is captured instead
        if backend is None:
            raise
        log.warning("rollout: capturing the eager decode step, compiling it failed: %s", str(err).splitlines()[0])
        step = decode_step(replica, cache, None)
        for _ in range(runs):
            step(tokens, pos)
    return step


class DecodeGraph:
    """The captured decode step of ``replica`` for ``cache`` (batch and length fixed), compiled first unless
    ``compile`` is False (default: ``compile_wanted()``)."""

    def __init__(self, replica: nn.Module, cache: Any, batch: int, device: torch.device | str,
                 compile: bool | None = None) -> None:
        self.cache = cache
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.full((), cache.max_len - 1, dtype=torch.long, device=device)
        backend = "inductor" if (compile_wanted() if compile is None else compile) else None
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            step = warmed_step(replica, cache, self.tokens, self.pos, backend)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits, self.values = step(self.tokens, self.pos)

    def run(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, 1, V], values [B, 1]) of ``tokens`` [B, 1] at ``start_pos``: views of the graph's outputs,
        valid until the next replay."""
        self.tokens.copy_(tokens)
        self.pos.fill_(start_pos)
        self.graph.replay()
        return self.logits, self.values


__all__ = ["DecodeGraph", "compile_wanted", "decode_step", "warmed_step"]
