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
(``kernels/quantized_collectives.py``): the local ``flat_local`` is quantized
(int8 / fp8) with one scale per ``block`` elements, the ``uint8`` rows (payload
and scales) are all-gathered once, and dequantization writes the compute dtype
directly. Its backward reduce-scatters the ``(n·L,)`` gradient per
``grad_comm`` (full precision, fp32, or qgZ int8/int4). The padded flat layout
is unchanged, so the copy-out and the gradient routing are the same code.
Since the re-gather in backward calls ``gather_roots`` again on the same
shards, it is quantized the same way and yields bit-identical weights (the
quantization is deterministic). The shards themselves (and the fp32 masters in
the optimizer) are never overwritten by dequantized values.
[Note: fused eager gather]
In eager execution (no tracing, no dispatch mode: ``collectives.eager_context``)
the unquantized gather runs as ONE autograd node (``_FusedGather``; with
prefetch, copy-in + start is ``_FusedStart``) calling the same kernels as the
op-by-op path: copy-in, the all-gather kernel, the copy-out; backward the
reduce-scatter kernel with ``grad_op`` and the split back to the shards. The
op-by-op path (cat, pad, ``autoshard::all_gather``, copy-out: five to ten
autograd nodes per layer) still runs under tracing, so exported graphs hold the
``autoshard::`` ops. Same values and gradients, bit for bit
(``tests/test_overlap.py`` trains both ways). Measured host time (CPU, fake
process group, 24-layer GPT of width 64, so the step is nearly all host work):
the fused nodes alone changed little (91 → 90 ms per ZeRO-3 step); caching the
spec's flat sizes (asked several times per layer) gave 90 → 84 ms; a DDP step
of the same model takes 47 ms.

[Note: async reduce-scatter in backward]
With a ``GradSink`` on the module (``grad_sink``, set by ``schedule_overlap``
when ``plan.schedule.prefetch > 0`` and pp = 1), the fused backward does not
return the shards' gradients: it launches the reduce-scatter on a side stream
(``async_collectives.reduce_scatter_start``) and hands it to the sink, which
completes it one layer later (the compute stream waits for it then) and
accumulates each shard's piece into ``shard.grad``, as AccumulateGrad would.
So layer k's reduce-scatter runs during layer k−1's backward instead of
blocking the compute stream, as FSDP2 does. The sink is drained after every
backward (``Regather.reset``), before clipping reads a gradient. Same values.

[Note: compiled gather]
Under ``torch.compile`` (the program is compiled: ``RankContext.compiled``)
``forward`` takes neither fused Function nor hook: it traces copy-in, the
functional all-gather of ``kernels/traced_collectives.py`` and the copy-out as
plain graph nodes, so AOT autograd puts the gather in the forward graph and its
reduce-scatter in the backward graph, where inductor schedules both. With
``reshard_after_forward`` (the default: ZeRO-3 keeps no full weight between
forward and backward) the gather runs under ``recompute_in_backward``: the
partitioner saves only the shards and the backward graph re-gathers what it
needs, as nodes inductor can prefetch. Off, the gathered weights are saved
(FSDP's ``reshard_after_forward=False``: no re-gather, more memory). Same
layout and values as the eager paths; quantized layers trace their
``autoshard::quantized_all_gather`` op (opaque to inductor) the same way.

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

from autoshard.kernels import async_collectives, collectives, quantized_collectives, traced_collectives


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
        return self._padded[i]  # c_i

    def flat_sizes(self) -> list[int]:
        return list(self._flat)

    def __post_init__(self) -> None:
        # computed once: the gathers ask for them several times per layer per step (host time); set here
        # rather than cached on first use, which dynamo cannot trace (the cache's lock breaks the graph)
        padded = tuple(-(-int(d) // self.num_ranks) for d in self.global_dim0)
        object.__setattr__(self, "_padded", padded)
        object.__setattr__(self, "_flat", tuple(c * math.prod(int(r) for r in rest)
                                                for c, rest in zip(padded, self.rest_shapes)))


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
        return tuple(async_collectives.split_rows(flat, num_ranks, sizes))

    @staticmethod
    def backward(ctx, *grads):
        return async_collectives.join_rows(grads, ctx.num_ranks, ctx.sizes).reshape(ctx.shape), None, None


def _eager(shards: tuple[torch.Tensor, ...]) -> bool:
    """No tracing or interception: the fused eager Functions below may run (note "fused eager gather")."""
    return all(type(s) in (torch.Tensor, nn.Parameter) for s in shards) and collectives.eager_context()


def _shard_grads(spec: GatherSpec, local: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """This rank's (L,) gradient → one gradient per shard: split, un-flatten, drop the padding rows."""
    out = []
    for i, piece in enumerate(local.split(spec.flat_sizes())):
        full = piece.view(spec.padded_dim0(i), *spec.rest_shapes[i])
        out.append(full if full.shape[0] == shapes[i][0] else full.narrow(0, 0, shapes[i][0]))
    return out


class GradSink:
    """Reduce-scatters launched from backward, completed one layer later (note "async reduce-scatter in backward").

    ``push`` takes a started reduce-scatter and the shards its chunk belongs to;
    it completes every earlier entry but the newest, so the reduce-scatter of layer
    k runs while layer k−1's backward computes. Completing one makes the current
    stream wait for it and accumulates each shard's piece into ``shard.grad``
    (what autograd's AccumulateGrad would have done). ``drain`` completes the
    rest: the runtime calls it after every backward (``Regather.reset``), before
    any gradient is read.
    """

    def __init__(self) -> None:
        self._pending: list[tuple] = []
        self.launched = 0

    def push(self, handle: tuple, spec: GatherSpec, shards: tuple[torch.Tensor, ...]) -> None:
        self._pending.append((handle, spec, shards))
        self.launched += 1
        while len(self._pending) > 1:
            self._complete(self._pending.pop(0))

    def drain(self) -> None:
        while self._pending:
            self._complete(self._pending.pop(0))

    def __len__(self) -> int:
        return len(self._pending)

    @staticmethod
    def _complete(entry: tuple) -> None:
        handle, spec, shards = entry
        local = async_collectives.finish(handle)
        with torch.no_grad():
            for shard, piece in zip(shards, _shard_grads(spec, local, [s.shape for s in shards])):
                if shard.grad is None:
                    shard.grad = piece
                else:
                    shard.grad += piece


def _backward_reduce_scatter(ctx, flat_grad: torch.Tensor):
    """The shards' gradients of one gather, or ``None`` for each when the sink takes the reduce-scatter (note)."""
    spec, sink = ctx.spec, ctx.sink
    if sink is not None:
        sink.push(async_collectives.reduce_scatter_start(flat_grad, spec.group_name, spec.grad_op), spec, ctx.shards)
        return (None,) * len(ctx.shapes)
    local = collectives._reduce_scatter_kernel(flat_grad, 0, spec.group_name, spec.grad_op)
    return tuple(_shard_grads(spec, local, ctx.shapes))


def _save(ctx, module: "Zero3Gather", shards: tuple[torch.Tensor, ...]) -> None:
    ctx.spec, ctx.shapes, ctx.sink = module.spec, [s.shape for s in shards], module.grad_sink
    # the sink writes ``shard.grad`` itself, so it needs the leaf parameters (only leaves: a non-leaf shard's
    # gradient must flow on through autograd)
    if ctx.sink is not None and not all(s.is_leaf and s.requires_grad for s in shards):
        ctx.sink = None
    ctx.shards = shards if ctx.sink is not None else None


class _FusedGather(torch.autograd.Function):
    """Blocking gather of one layer as ONE autograd node (note "fused eager gather").

    Forward: copy-in, ``autoshard::all_gather``'s kernel, the one-kernel copy-out;
    backward: the pieces' gradients concatenated, ``autoshard::reduce_scatter``'s
    kernel with ``grad_op``, split back to the shards (padding rows dropped).
    """

    @staticmethod
    def forward(ctx, module: "Zero3Gather", *shards: torch.Tensor):
        spec = module.spec
        _save(ctx, module, shards)
        flat = collectives._all_gather_kernel(module.copy_in(shards), 0, spec.group_name, spec.grad_op)
        ctx.set_materialize_grads(False)
        return tuple(async_collectives.split_rows(flat, spec.num_ranks, spec.flat_sizes()))

    @staticmethod
    def backward(ctx, *grads):
        rows = async_collectives.join_rows(grads, ctx.spec.num_ranks, ctx.spec.flat_sizes())
        if rows is None:
            return (None,) * (1 + len(ctx.shapes))
        return (None, *_backward_reduce_scatter(ctx, rows.reshape(-1)))


class _FusedStart(torch.autograd.Function):
    """Copy-in + ``autoshard::all_gather_start`` as ONE autograd node; backward: reduce-scatter, split to shards."""

    @staticmethod
    def forward(ctx, module: "Zero3Gather", *shards: torch.Tensor):
        spec = module.spec
        _save(ctx, module, shards)
        return async_collectives._start_kernel(module.copy_in(shards), spec.group_name, spec.grad_op)

    @staticmethod
    def backward(ctx, grad):
        return (None, *_backward_reduce_scatter(ctx, grad.contiguous()))


class Zero3Gather(nn.Module):
    """Graph module: local shards of one layer's parameters → full parameters (one all-gather)."""

    def __init__(self, spec: GatherSpec, on_gather: Callable | None = None,
                 replicate: tuple[str, int] | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.on_gather = on_gather
        # compiled HSDP: (group, ranks) whose all-reduce follows the backward's reduce-scatter in the graph
        # (kernels/traced_collectives.py note "HSDP in the graph"); eager and quantized ignore it
        self.replicate = replicate
        self.grad_sink: GradSink | None = None  # set by schedule_overlap: backward reduce-scatters go asynchronous
        self.reshard_after_forward = True  # compiled: re-gather in backward rather than keep (note "compiled gather")
        self._traced_gather: traced_collectives.TracedAllGather | None = None
        if torch.distributed.is_initialized():  # its group is live: look its backend up now, not while tracing
            try:
                self.traced_gather
            except collectives.CollectiveError:
                pass  # a group of a context built by hand (tests): looked up if a compiled program ever runs it

    @property
    def traced_gather(self) -> traced_collectives.TracedAllGather:
        """The functional all-gather a compiled program traces (built where the group is live, before tracing)."""
        if self._traced_gather is None:
            spec = self.spec
            group, ranks = self.replicate or (None, 1)
            self._traced_gather = traced_collectives.traced_all_gather(spec.group_name, spec.num_ranks, spec.grad_op,
                                                                       replicate_group=group, replicate_ranks=ranks)
        return self._traced_gather

    def gather_roots(self, shards: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Padded full tensors (n·c_i, *rest_i), fresh storage each: one all-gather."""
        spec = self.spec
        if not spec.quantized and _eager(shards):
            per_param = _FusedGather.apply(self, *shards)
        else:
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
        if _eager(shards):
            return _FusedStart.apply(self, *shards)
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
        if torch.compiler.is_compiling():  # note "compiled gather"
            if self.reshard_after_forward:
                return traced_collectives.recompute_in_backward(self._traced, *shards)
            return self._traced(*shards)
        roots = self.gather_roots(shards)
        if self.on_gather is not None:
            self.on_gather(self, shards, roots)
        return self._narrow(roots)

    def _narrow(self, roots: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # no narrow without padding: its backward (slice_backward) would allocate and copy a zero-padded grad
        return tuple(root if root.shape[0] == d else root.narrow(0, 0, d) for root, d in zip(roots, self.spec.global_dim0))

    def _traced(self, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The gather as ``torch.compile`` traces it: copy-in, functional all-gather, copy-out (note)."""
        spec = self.spec
        flat = self.copy_in(shards)
        if spec.quantized:
            assert self.replicate is None, "a quantized gather reduces over replicas in the optimizer"
            flat = self._all_gather(flat)
        else:
            flat = self.traced_gather(flat)
        rows = flat.view(spec.num_ranks, -1).split(spec.flat_sizes(), 1)
        return self._narrow([r.reshape(spec.num_ranks * spec.padded_dim0(i), *spec.rest_shapes[i])
                             for i, r in enumerate(rows)])
