"""Asynchronous all-gather: ``autoshard::all_gather_start`` + ``autoshard::all_gather_wait``.

The blocking ``autoshard::all_gather`` (``kernels/collectives.py``) returns only
when the data has arrived, so nothing can run beside it. These two ops split it
so that a graph can issue the collective early and wait only where the result
is first used (the ``schedule_overlap`` pass does so for ZeRO-3 gathers):

    pending = autoshard::all_gather_start(x, group_name, grad_op)   # (n·s0, ...) buffer, filling
    ...  compute that does not read ``pending``  ...
    pieces  = autoshard::all_gather_wait(pending, n, split_sizes)    # [(n, s_i)] fresh tensors

| op | forward | backward |
| --- | --- | --- |
| ``all_gather_start(x, g, grad_op)`` | launch ``all_gather_into_tensor(out, x)`` (CUDA: on a side stream, note "streams"; gloo: ``async_op=True``), return ``out`` (rank-major along dim 0) | blocking ``reduce_scatter(grad, 0, g, grad_op)``: per-rank-losses convention, as ``autoshard::all_gather`` (``"avg"`` = FSDP's mean) |
| ``all_gather_wait(pending, n, split_sizes)`` | wait for ``pending``'s collective, then ``pending.view(n, -1).split(split_sizes, 1)``, each piece copied contiguous ``(n, s_i)`` | ``cat(grads, 1).reshape(pending.shape)`` (an absent grad is zeros) |

The wait does the split-and-copy itself because a custom op may not return
an alias of its input: returning the waited buffer would need a full copy, and
the ZeRO-3 copy-out (``passes/_zero3.py``) copies each parameter's rank-major
pieces anyway. ``split_sizes=[s]`` with ``s = numel / n`` is a plain
"wait and copy" of the whole buffer, shape ``(n, s)``.

[Note: streams]
On CUDA the start does not use ``async_op=True``. It launches the all-gather
on one side stream per device owned by this module: the side stream first
waits for the current (compute) stream (so the copy-in ``x`` is complete),
the collective is issued *blocking* inside ``torch.cuda.stream(side)`` (torch
>= 2.7 runs an ``async_op=False`` NCCL collective on the current stream, here
the side stream), and a CUDA event is recorded after it. The wait makes the
compute stream wait for that event: a device-side dependency, no host wait,
no ``Work`` object. Kernels the compute stream runs between start and wait
overlap the all-gather. ``out`` is allocated on the compute stream and ``x``
is held by the pending table until the wait, so the caching allocator cannot
hand either block to the compute stream before the side stream is done with
it (the FSDP2 discipline). Why not ``async_op=True``: that path runs on the
process group's internal stream, hands tensor lifetime to the group's stash
and watchdog, and its ``Work.wait()`` semantics changed across releases; the
first H100 run of ``benchmarks/overlap_bench.py`` (docs/runtime.md, "Overlap")
measured no overlap and a slower step with it. On gloo (CPU) the start uses
``async_op=True`` (gloo's worker thread) and the wait blocks the caller: the
same values, with whatever overlap two CPU threads give.

[Note: pending collectives]
A custom op's schema carries only tensors and scalars, so the ``Work`` handle
of a started collective cannot travel in the graph. It is kept in one
process-wide table keyed by the storage of the output buffer (the StorageImpl
address: unique while the table holds the buffer alive, including for empty
buffers); ``all_gather_wait`` removes it. PyTorch's own functional collectives
keep the same kind of table in C++. An un-waited collective makes processes
abort at exit (docs: PLATFORM_NOTES), so: waiting twice or waiting a tensor
that was never started raises ``CollectiveError``; ``pending_count()`` tells
how many are in flight (tests assert 0 after every step); ``wait_all()``
drains the table (for error paths, before a process group is destroyed).

Under ``FakeTensorMode`` (``torch.export``, ``make_fx``) only the fake kernels
run: shapes propagate, nothing is registered. Under ``LocalTensorMode`` (one
process simulating every rank) ``start`` runs the blocking gather and
registers a finished entry, so the ``wait`` works unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard.kernels import collectives as _collectives
from autoshard.kernels.collectives import CollectiveError, group_name_of

_all_gather_single = _collectives._all_gather_single


class _PendingTable:
    """Process-wide table of started, not yet waited collectives (module note "pending collectives").

    An entry is ``(out, work, event, keep)``: ``work`` the gloo/NCCL ``Work``
    (``None`` on the CUDA side-stream path and under ``LocalTensorMode``),
    ``event`` the CUDA event recorded on the side stream after the collective
    (``None`` off CUDA), ``keep`` the input buffer, held until the wait so the
    caching allocator cannot recycle it while the side stream still reads it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # gloo completion runs on other threads; the table is touched only here
        self._entries: dict[int, tuple] = {}
        self._streams: dict[object, object] = {}  # device index → all_gather_start's stream; ("rs", index) → reduce-scatters

    @staticmethod
    def key(t: Tensor) -> int:
        return t.untyped_storage()._cdata  # StorageImpl address: unique while the entry holds ``t``

    def comm_stream(self, device: torch.device):
        """The one side stream of ``device`` that runs every started all-gather (module note "streams")."""
        with self._lock:
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device=device)
            return self._streams[device.index]

    def rs_stream(self, device: torch.device):
        """The side stream of ``device`` that runs reduce-scatters issued from backward (``reduce_scatter_start``)."""
        with self._lock:
            key = ("rs", device.index)
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device=device)
            return self._streams[key]

    def add(self, out: Tensor, work, event=None, keep: Tensor | None = None) -> None:
        with self._lock:
            assert self.key(out) not in self._entries, "a buffer was registered twice"
            self._entries[self.key(out)] = (out, work, event, keep)

    def pop(self, t: Tensor) -> tuple:
        """``(work, event)`` of ``t``'s collective, forgotten here."""
        with self._lock:
            entry = self._entries.pop(self.key(t), None)
        if entry is None:
            raise CollectiveError(
                "all_gather_wait: this tensor has no pending collective (it was already waited, or it was not "
                "produced by all_gather_start); wait exactly once on each all_gather_start output"
            )
        return entry[1], entry[2]

    def __len__(self) -> int:
        return len(self._entries)

    def drain(self) -> int:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for out, work, event, _keep in entries:
            _complete(work, event, out.device)
        return len(entries)


def _complete(work, event, device: torch.device) -> None:
    """Order the caller after a started collective: ``device``'s current stream waits (CUDA) or the host blocks."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)  # a device-side dependency; the host goes on
    elif work is not None:
        work.wait()


_PENDING = _PendingTable()


def pending_count() -> int:
    """How many ``all_gather_start`` collectives of this process have not been waited yet."""
    return len(_PENDING)


def wait_all() -> int:
    """Wait for every pending collective and forget them (error paths); returns how many there were."""
    return _PENDING.drain()


# --------------------------------------------------------------------------- op definitions


def _check_grad_op(grad_op: str) -> None:
    _collectives._check_reduce_op(grad_op, "all_gather_start grad_op")


def _check_splits(pending: Tensor, num_ranks: int, split_sizes: Sequence[int]) -> None:
    if num_ranks < 1 or pending.numel() % num_ranks:
        raise CollectiveError(
            f"all_gather_wait: num_ranks={num_ranks} must be >= 1 and divide the buffer's {pending.numel()} "
            "elements; pass the group size the start used"
        )
    if any(s < 0 for s in split_sizes) or sum(split_sizes) != pending.numel() // num_ranks:
        raise CollectiveError(
            f"all_gather_wait: split_sizes={list(split_sizes)} must be non-negative and sum to "
            f"{pending.numel() // num_ranks} (one rank's share); split one rank's row exactly"
        )


def _start_kernel(x: Tensor, group_name: str, grad_op: str = "sum") -> Tensor:
    _collectives._normalize_dim(0, x.dim(), "all_gather_start")
    _check_grad_op(grad_op)
    pg = _collectives._group(group_name)
    x = x.contiguous()
    out = x.new_empty((pg.size() * x.shape[0], *x.shape[1:]))  # rank-major along dim 0, allocated on the compute stream
    if x.is_cuda:
        _start_on_side_stream(out, x, pg)
    else:
        _PENDING.add(out, _all_gather_single(out, x, group=pg, async_op=True))
    return out


def _on_side_stream(side, device: torch.device, launch):
    """CUDA: ``launch()`` on ``side`` after the compute stream's pending work; ``(its result, an event after it)``.

    ``async_op=False`` collectives inside: torch >= 2.7 launches them on the current (= side) stream;
    older versions launch on the group's stream and their implicit Work.wait() joins it into the side
    stream. No host wait.
    """
    side.wait_stream(torch.cuda.current_stream(device))  # the inputs are complete before the collective reads them
    with torch.cuda.stream(side):
        result = launch()
        event = torch.cuda.Event()
        event.record(side)
    return result, event


def _start_on_side_stream(out: Tensor, x: Tensor, pg) -> None:
    """CUDA: the all-gather on this module's side stream, after the compute stream's pending work (note "streams")."""
    _, event = _on_side_stream(_PENDING.comm_stream(x.device), x.device,
                               lambda: _all_gather_single(out, x, group=pg, async_op=False))
    _PENDING.add(out, None, event, keep=x)


_start_op = torch.library.custom_op("autoshard::all_gather_start", _start_kernel, mutates_args=())


@_start_op.register_fake
def _(x, group_name, grad_op="sum"):
    _collectives._normalize_dim(0, x.dim(), "all_gather_start")
    _check_grad_op(grad_op)
    n = _collectives._group(group_name).size()
    return x.new_empty((n * x.shape[0], *x.shape[1:]))


def split_rows(flat: Tensor, num_ranks: int, split_sizes: Sequence[int]) -> list[Tensor]:
    """Rank-major ``(n·L,)`` → fresh ``(n, s_i)`` pieces, all written by ONE ``split_with_sizes_copy``.

    FSDP2's copy-out kernel on CUDA (one launch for a whole layer instead of a
    clone per piece); fresh storage, since a custom op may not alias its input.
    """
    outs = [flat.new_empty((num_ranks, s)) for s in split_sizes]
    torch.split_with_sizes_copy(flat.view(num_ranks, -1), list(split_sizes), dim=1, out=outs)
    return outs


def join_rows(grads: Sequence[Tensor | None], num_ranks: int, split_sizes: Sequence[int]) -> Tensor | None:
    """Inverse of ``split_rows`` for gradients: ``(n, s_i)`` pieces (None = zeros) → ``(n, L)``; None if all are None."""
    like = next((g for g in grads if g is not None), None)
    if like is None:
        return None
    return torch.cat([g if g is not None else like.new_zeros((num_ranks, s)) for g, s in zip(grads, split_sizes)], dim=1)


def _wait_kernel(pending: Tensor, num_ranks: int, split_sizes: list[int]) -> list[Tensor]:
    _check_splits(pending, num_ranks, split_sizes)
    work, event = _PENDING.pop(pending)
    _complete(work, event, pending.device)  # CUDA: the current stream waits for the side stream's event; gloo: blocks
    return split_rows(pending, num_ranks, split_sizes)


_wait_op = torch.library.custom_op("autoshard::all_gather_wait", _wait_kernel, mutates_args=())


@_wait_op.register_fake
def _(pending, num_ranks, split_sizes):
    _check_splits(pending, num_ranks, split_sizes)
    return [pending.new_empty((num_ranks, s)) for s in split_sizes]


# --------------------------------------------------------------------------- autograd


def _start_setup(ctx, inputs, output):
    _x, ctx.group_name, ctx.grad_op = inputs


def _start_bwd(ctx, grad):
    # The same convention as autoshard::all_gather: d(Σ_r L_r)/dx_j = Σ_r (dL_r/dy)[chunk j] ("avg": ÷ n).
    return _collectives.call("reduce_scatter", grad, 0, ctx.group_name, ctx.grad_op), None, None


def _wait_setup(ctx, inputs, output):
    pending, ctx.num_ranks, ctx.split_sizes = inputs
    ctx.shape = pending.shape


def _wait_bwd(ctx, grads):
    # grads: one (n, s_i) gradient per piece, None where a piece was unused.
    return join_rows(grads, ctx.num_ranks, ctx.split_sizes).reshape(ctx.shape), None, None  # (n, L) -> pending's shape


torch.library.register_autograd("autoshard::all_gather_start", _start_bwd, setup_context=_start_setup)
torch.library.register_autograd("autoshard::all_gather_wait", _wait_bwd, setup_context=_wait_setup)
_collectives.register_direct("all_gather_start", _start_kernel, _start_setup, _start_bwd)
_collectives.register_direct("all_gather_wait", _wait_kernel, _wait_setup, _wait_bwd, list_output=True)


# --------------------------------------------------------------------------- one-process simulation


def _register_local_tensor_rules() -> None:
    """``LocalTensorMode``: start = the blocking gather, registered as already finished (module docstring)."""
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError:  # pragma: no cover - a torch without LocalTensorMode
        return

    def start_rule(mode, func, types, args, kwargs):
        x, group_name, *rest = args
        with LocalTensorMode(mode.ranks):
            out = _collectives._all_gather_kernel(x, 0, group_name, *rest)
        _PENDING.add(out, None)
        return out

    def wait_rule(mode, func, types, args, kwargs):
        with LocalTensorMode(mode.ranks):
            return _wait_kernel(*args, **(kwargs or {}))

    torch.library.register_torch_dispatch("autoshard::all_gather_start", LocalTensorMode, start_rule)
    torch.library.register_torch_dispatch("autoshard::all_gather_wait", LocalTensorMode, wait_rule)


_register_local_tensor_rules()


# --------------------------------------------------------------------------- reduce-scatter from backward

# [Note: async reduce-scatter]
# ``reduce_scatter_start(x, group_name, op)`` launches the reduce-scatter of a
# ``(n·c,)`` gradient and returns a handle at once; ``finish``
# orders the caller after it and returns this rank's ``(c,)`` chunk. CUDA: on a
# second side stream owned by this module (after the compute stream's pending
# work, so ``x`` is complete), the chunk allocated there and handed to the
# compute stream with ``record_stream`` at the finish; ``x`` is held until the
# finish. gloo: ``async_op=True`` and the finish waits. Not an op: it runs
# inside backward formulas of eager autograd Functions
# (``passes/_zero3.py``, note "async reduce-scatter in backward"), where no
# graph is traced.


def reduce_scatter_start(x: Tensor, group_name: str, op: str = "avg") -> tuple:
    """Launch the reduce-scatter of a 1-D ``(n·c,)`` tensor (note "async reduce-scatter"); a handle."""
    _collectives._check_reduce_op(op, "reduce_scatter_start")
    pg = _collectives._group(group_name)
    n = pg.size()
    if x.is_cuda:  # the blocking kernel (÷ n included) on the reduce-scatter side stream
        out, event = _on_side_stream(_PENDING.rs_stream(x.device), x.device,
                                     lambda: _collectives._scatter_reduce(x, 0, op, pg))
        return out, None, event, x, n, op
    c = _collectives._chunk_len(x.shape[0], n, 0, "reduce_scatter_start")
    out = x.new_empty((c,))
    work = _collectives._reduce_scatter_single(out, x.contiguous(), op=_collectives._DIST_OPS.get(op, dist.ReduceOp.SUM),
                                               group=pg, async_op=True)
    return out, work, None, x, n, op


def all_reduce_start(x: Tensor, group_name: str, op: str = "avg") -> tuple:
    """Launch the all-reduce of ``x`` into a new tensor, as ``reduce_scatter_start`` does its
    reduce-scatter (same side stream on CUDA, ``async_op=True`` on gloo); complete it with ``finish``.

    The optimizer's gradient buckets use it to reduce during backward (``runtime/optimizer.py``,
    "Overlapped gradient sync")."""
    _collectives._check_reduce_op(op, "all_reduce_start")
    pg = _collectives._group(group_name)
    if x.is_cuda:  # the blocking kernel (÷ n included) on the reduce-scatter side stream
        out, event = _on_side_stream(_PENDING.rs_stream(x.device), x.device, lambda: _collectives._reduce(x, op, pg))
        return out, None, event, x, pg.size(), op
    out = x.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(out, op=_collectives._DIST_OPS.get(op, dist.ReduceOp.SUM), group=pg, async_op=True)
    return out, work, None, x, pg.size(), op


def finish(handle: tuple) -> Tensor:
    """The result of a ``reduce_scatter_start`` or ``all_reduce_start``, ready for the caller's (current) stream."""
    out, work, event, _keep, n, op = handle
    if event is not None:
        current = torch.cuda.current_stream(out.device)
        current.wait_event(event)
        out.record_stream(current)  # allocated on the side stream, used and freed on this one
        return out
    work.wait()
    if op == "avg":
        out.div_(n)
    return out


# --------------------------------------------------------------------------- public wrappers


def all_gather_start(x: Tensor, group: str | dist.ProcessGroup | None = None, grad_op: str = "sum") -> Tensor:
    """Launch an all-gather of ``x`` along dim 0 and return its output buffer (n·s0, ...) at once.

    The buffer must not be read before ``all_gather_wait`` on it (module
    docstring). Backward: blocking reduce-scatter of the gradient with ``grad_op``.
    """
    return _collectives.call("all_gather_start", x, group_name_of(group), grad_op)  # note "eager fast path"


def all_gather_wait(pending: Tensor, num_ranks: int, split_sizes: Sequence[int]) -> list[Tensor]:
    """Wait for ``pending``'s all-gather; return its rank-major rows split into ``(num_ranks, s_i)`` copies."""
    return _collectives.call("all_gather_wait", pending, num_ranks, list(split_sizes))


__all__ = ["all_gather_start", "all_gather_wait", "all_reduce_start", "finish", "join_rows", "pending_count",
           "reduce_scatter_start", "split_rows", "wait_all"]
