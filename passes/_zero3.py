"""ZeRO-3 parameter gather: one all-gather per layer (FSDP2-style copy-in / copy-out).

[Note: ZeRO-3 gather layout]
Each parameter ``i`` of a layer is stored as its ``torch.chunk`` shard over
dp_shard (n ranks) on tensor dim 0: ``(c_i', *rest_i)`` with ``c_i' <= c_i =
ceil(d_i / n)``. Forward, per layer:

    copy-in:   flat_local = cat_i( pad(shard_i to (c_i, *rest_i)).flatten() )   # (L,)  L = Σ c_i·|rest_i|
    gather:    flat = autoshard::all_gather(flat_local, 0, dp_shard, "avg")     # (n·L,)  rank-major
    copy-out:  full_i = flat.view(n, L).split(c_i·|rest_i|, 1)[i].reshape(n·c_i, *rest_i)[:d_i]

Every step is differentiable: the all-gather's backward is ONE reduce-scatter
(``avg``: the mean over dp_shard of the per-rank losses) per layer, and the
pad/split/narrow backward routes each parameter's gradient to its own shard.
``regather`` (installed by the ``recompute`` pass) is told about every copy-out
tensor so that backward can re-gather instead of keeping it (``passes/recompute.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.runtime import collectives


@dataclass(frozen=True)
class GatherSpec:
    """Static description of one layer's ZeRO-3 gather (see the note above)."""

    layer: str
    fqns: tuple[str, ...]
    group_name: str
    num_ranks: int
    global_dim0: tuple[int, ...]  # d_i
    rest_shapes: tuple[tuple[int, ...], ...]  # rest_i
    grad_op: str = "avg"

    def padded_dim0(self, i: int) -> int:
        return -(-self.global_dim0[i] // self.num_ranks)  # c_i

    def flat_sizes(self) -> list[int]:
        return [self.padded_dim0(i) * math.prod(self.rest_shapes[i]) for i in range(len(self.fqns))]


class Zero3Gather(nn.Module):
    """Graph module: local shards of one layer's parameters → full parameters (one all-gather)."""

    def __init__(self, spec: GatherSpec, on_gather: Callable | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.on_gather = on_gather

    def gather_roots(self, shards: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Padded full tensors (n·c_i, *rest_i), fresh storage each: one all-gather."""
        spec = self.spec
        pieces = []
        for i, shard in enumerate(shards):
            pad_rows = spec.padded_dim0(i) - shard.shape[0]
            flat = shard.reshape(-1)
            pieces.append(F.pad(flat, (0, pad_rows * math.prod(spec.rest_shapes[i]))) if pad_rows else flat)
        flat_local = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # (L,)
        flat = collectives.all_gather(flat_local, 0, spec.group_name, spec.grad_op)  # (n·L,)
        per_param = flat.view(spec.num_ranks, -1).split(spec.flat_sizes(), dim=1)
        return [
            p.reshape(spec.num_ranks * spec.padded_dim0(i), *spec.rest_shapes[i]).contiguous()
            for i, p in enumerate(per_param)
        ]

    def forward(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        roots = self.gather_roots(shards)
        if self.on_gather is not None:
            self.on_gather(self, shards, roots)
        return tuple(root.narrow(0, 0, d) for root, d in zip(roots, self.spec.global_dim0))
