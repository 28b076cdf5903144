"""ZeRO-3 parameter gather: one all-gather per layer (FSDP2-style copy-in / copy-out).

[Note: ZeRO-3 gather layout]
Each parameter ``i`` of a layer is stored as its ``torch.chunk`` shard over
dp_shard (n ranks) on tensor dim 0: ``(c_i', *rest_i)`` with ``c_i' <= c_i =
ceil(d_i / n)``. Forward, per layer:

    copy-in:   flat_local = cat_i( pad(shard_i to (c_i, *rest_i)).flatten() )   # (L,)  L = Σ c_i·|rest_i|
    gather:    flat = autoshard::all_gather(flat_local, 0, dp_shard, "avg")     # (n·L,)  rank-major
    copy-out:  full_i = flat.view(n, L).split(c_i·|rest_i|, 1)[i].reshape(n·c_i, *rest_i)[:d_i]
               (all pieces in one split_with_sizes_copy; no narrow when d_i = n·c_i)

Every step is differentiable: the all-gather's backward is ONE reduce-scatter
(``avg``: the mean over dp_shard of the per-rank losses) per layer, and the
pad/split/narrow backward routes each parameter's gradient to its own shard.

Quantized communication (set by the ``quantize_comm`` pass through
``GatherSpec.qdtype`` / ``grad_comm``; both "none" by default): the gather
becomes ``autoshard::quantized_all_gather`` of the same ``(L,)`` copy-in
(``runtime/quantized_collectives.py``): the local ``flat_local`` is quantized
(int8 / fp8) with one scale per ``block`` elements, the ``uint8`` rows (payload
and scales) are all-gathered once, and dequantization writes the compute dtype
directly. Its backward reduce-scatters the ``(n·L,)`` gradient per
``grad_comm`` (full precision, fp32, or qgZ int8/int4). The padded flat layout
is unchanged, so the copy-out and the gradient routing are the same code.
Since the re-gather in backward calls ``gather_roots`` again on the same
shards, it is quantized the same way and yields bit-identical weights (the
quantization is deterministic). The shards themselves (and the fp32 masters in
the optimizer) are never overwritten by dequantized values.
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

from autoshard.runtime import async_collectives, collectives, quantized_collectives


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
    qdtype: str = "none"  # parameter payload on the wire (quantized_collectives.QDTYPES)
    grad_comm: str = "none"  # gradient reduction in backward (quantized_collectives.GRAD_COMMS)

    @property
    def quantized(self) -> bool:
        """Whether the gather or its backward deviates from the plain compute-dtype collectives."""
        return self.qdtype != "none" or self.grad_comm != "none"

    def padded_dim0(self, i: int) -> int:
        return -(-self.global_dim0[i] // self.num_ranks)  # c_i

    def flat_sizes(self) -> list[int]:
        return [self.padded_dim0(i) * math.prod(self.rest_shapes[i]) for i in range(len(self.fqns))]


class _CopyOut(torch.autograd.Function):
    """(n·L,) rank-major → per-parameter ``(n, s_i)`` copies with ONE ``split_with_sizes_copy`` (FSDP2's copy-out).

    The ``out=`` form is a single kernel on CUDA for all of a layer's
    parameters (the per-parameter ``contiguous()`` it replaces launched one copy
    each); ``out=`` has no autograd formula, hence this Function. Backward:
    the pieces' gradients concatenated back along dim 1 (absent ones as zeros).
    """

    @staticmethod
    def forward(ctx, flat: torch.Tensor, num_ranks: int, sizes: list[int]):
        ctx.shape = flat.shape
        ctx.num_ranks, ctx.sizes = num_ranks, sizes
        outs = [flat.new_empty((num_ranks, size)) for size in sizes]
        torch.split_with_sizes_copy(flat.view(num_ranks, -1), sizes, dim=1, out=outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        rows = [g if g is not None else like.new_zeros((ctx.num_ranks, s)) for g, s in zip(grads, ctx.sizes)]
        return torch.cat(rows, dim=1).reshape(ctx.shape), None, None


class Zero3Gather(nn.Module):
    """Graph module: local shards of one layer's parameters → full parameters (one all-gather)."""

    def __init__(self, spec: GatherSpec, on_gather: Callable | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.on_gather = on_gather

    def gather_roots(self, shards: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Padded full tensors (n·c_i, *rest_i), fresh storage each: one all-gather."""
        spec = self.spec
        flat = self._all_gather(self.copy_in(shards))  # (L,) → (n·L,)
        per_param = _CopyOut.apply(flat, spec.num_ranks, spec.flat_sizes())  # (n, c_i·|rest_i|) each, fresh
        return [p.view(spec.num_ranks * spec.padded_dim0(i), *spec.rest_shapes[i]) for i, p in enumerate(per_param)]

    def copy_in(self, shards: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The padded, flattened local shards of the layer, ``(L,)`` (module note)."""
        spec = self.spec
        pieces = []
        for i, shard in enumerate(shards):  # pad shard_i (c_i', *rest_i) to (c_i, *rest_i), flatten
            pad_rows = spec.padded_dim0(i) - shard.shape[0]
            flat = shard.reshape(-1)
            pieces.append(F.pad(flat, (0, pad_rows * math.prod(spec.rest_shapes[i]))) if pad_rows else flat)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def start(self, shards: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Copy-in + asynchronous all-gather (``autoshard::all_gather_start``); returns the (n·L,) pending buffer.

        Unquantized layers only (the quantized gather has no asynchronous form).
        """
        assert not self.spec.quantized, "a quantized ZeRO-3 gather has no asynchronous form"
        return async_collectives.all_gather_start(self.copy_in(shards), self.spec.group_name, self.spec.grad_op)

    def finish(self, pending: torch.Tensor) -> list[torch.Tensor]:
        """Wait for ``start``'s buffer; the padded full tensors ``(n·c_i, *rest_i)`` as ``gather_roots`` returns."""
        spec = self.spec
        rows = async_collectives.all_gather_wait(pending, spec.num_ranks, spec.flat_sizes())  # (n, c_i·|rest_i|) each
        return [r.view(spec.num_ranks * spec.padded_dim0(i), *spec.rest_shapes[i]) for i, r in enumerate(rows)]

    def _all_gather(self, flat_local: torch.Tensor) -> torch.Tensor:
        """(L,) → (n·L,) rank-major; plain or quantized per the spec (module note)."""
        spec = self.spec
        if not spec.quantized:
            return collectives.all_gather(flat_local, 0, spec.group_name, spec.grad_op)
        return quantized_collectives.quantized_all_gather(
            flat_local, spec.group_name, spec.qdtype, spec.grad_comm, grad_op=spec.grad_op
        )

    def forward(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        roots = self.gather_roots(shards)
        if self.on_gather is not None:
            self.on_gather(self, shards, roots)
        # no narrow without padding: its backward (slice_backward) would allocate and copy a zero-padded grad
        return tuple(root if root.shape[0] == d else root.narrow(0, 0, d) for root, d in zip(roots, self.spec.global_dim0))
