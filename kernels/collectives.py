"""The ``autoshard::`` collectives: custom ops with fake kernels and explicit autograd.

Graph passes insert these ops (``torch.ops.autoshard.*``) into per-rank
programs; they run in eager, trace through FX and ``torch.export`` (each op has
a fake kernel, so shapes propagate without communicating), and carry the
gradient convention the pass chose, stated per op below.

[Note: gradient conventions]
Two conventions exist and a collective's backward depends on which one holds:

* **per-rank losses** (data parallel, ZeRO, EP): every rank computes its own
  loss ``L_r`` on its own data and the quantity differentiated is
  ``L = sum_r L_r`` (or the mean, where stated). A tensor's gradient on rank r
  is ``dL/dx_r``, which collects contributions from every rank's loss.
* **replicated loss** (Megatron TP/SP): every rank of the tp group computes the
  *same* loss ``L`` once; it must be counted once, not ``tp`` times.

PyTorch's built-in functional collectives use the first convention for every
op (``all_reduce`` backward = ``all_reduce``), which is silently wrong for TP:
the row-parallel weight gradients come out ``tp`` times too large. Hence the
separate Megatron ``f``/``g`` ops below.

| op | forward | backward | convention, typical use |
| --- | --- | --- | --- |
| ``all_gather(x, dim, g, grad_op)`` | concat shards along ``dim`` | reduce-scatter(``grad_op``) | per-rank losses: ZeRO-3/FSDP parameter gather. ``grad_op="avg"`` differentiates the mean of the per-rank losses |
| ``reduce_scatter(x, dim, g, op)`` | reduce, keep own chunk of ``dim`` | all-gather (÷ n for ``avg``) | both: ZeRO-2 gradient reduction; Megatron SP after row-parallel |
| ``all_reduce(x, g, op)`` | reduce, all ranks get it | all-reduce(``op``) | per-rank losses: DDP-style reductions of values that feed each rank's loss |
| ``copy_to_tp(x, g)`` (Megatron f) | identity | all-reduce(sum) | replicated loss: before a column-parallel layer |
| ``reduce_from_tp(x, g)`` (Megatron g) | all-reduce(sum) | identity | replicated loss: after a row-parallel layer |
| ``scatter_to_sp(x, dim, g)`` | keep own chunk of ``dim`` | all-gather | replicated loss: replicated activation enters the SP region |
| ``gather_from_sp(x, dim, g, grad_is_partial)`` | all-gather | reduce-scatter(sum) if ``grad_is_partial`` else keep own chunk | replicated loss: SP region before a column-parallel layer (partial) / before a replicated consumer (not partial) |
| ``all_to_all(x, split_sizes_out, split_sizes_in, g)`` | all-to-all on dim 0 | the reverse all-to-all | both (a permutation): EP dispatch and combine |

``all_gather`` and ``gather_from_sp(grad_is_partial=True)`` compute the same
thing; they are distinct ops so that a graph says what it gathers (a parameter
or an activation) and the overlap pass can treat them differently.

Reductions: ``op`` in {"sum", "avg", "max", "min"}. ``avg`` is a sum followed by
a division on every backend (gloo has no AVG); ``max``/``min`` have no gradient
here and raise in backward. The group size ``n`` divides every split dimension.

[Note: synchronous kernels]
The eager kernels call plain, blocking ``torch.distributed`` collectives: simple
and correct on gloo and NCCL. Overlap uses separate ops: the asynchronous
``autoshard::all_gather_start`` / ``autoshard::all_gather_wait`` pair
(``kernels/async_collectives.py``), which the ``schedule_overlap`` pass puts in
place of ZeRO-3 forward gathers; the ops here keep their signatures. Every op returns a new
tensor (custom ops may not alias their inputs), so ``copy_to_tp`` copies.

Point-to-point ``send``/``recv`` are not here: pipeline stages communicate
through ``torch.distributed.pipelining``, which owns its own P2P schedule.

Verified against single-process references (tests/test_collectives.py): gloo
at world 2 and 4 (torch 2.13, CPU), one-process ``LocalTensorMode`` at world 4,
and NCCL at world 2 and 4 (torch 2.11, H200; tests/test_collectives_gpu.py).

Groups are identified by their name string (``ProcessGroup.group_name``), as
PyTorch's functional collectives do, so a graph holds no live objects. The
public wrappers also accept a ``ProcessGroup`` or ``None`` (the world group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard.errors import AutoshardError

try:
    from torch.distributed.distributed_c10d import _resolve_process_group
except ImportError:  # pragma: no cover - older layouts keep it only in the C module
    from torch._C._distributed_c10d import _resolve_process_group


# torch 2.13 renamed the tensor-in/tensor-out collectives (old names deprecated); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(AutoshardError):
    """A collective was called with arguments that cannot work (shape, group, op)."""


REDUCE_OPS = ("sum", "avg", "max", "min")
DIFFERENTIABLE_REDUCE_OPS = ("sum", "avg")
_DIST_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# --------------------------------------------------------------------------- groups and checks


def group_name_of(group: str | dist.ProcessGroup | None) -> str:
    """The name string that identifies ``group`` in a graph (``None`` = the world group)."""
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_initialized():
            raise CollectiveError(
                "group=None needs a default process group, and none is initialised: "
                "call torch.distributed.init_process_group first or pass a group"
            )
        group = dist.group.WORLD
    return group.group_name


def _group(group_name: str) -> dist.ProcessGroup:
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError) as exc:
        raise CollectiveError(
            f"no process group named {group_name!r} exists in this process; pass the name "
            "of a live group (ProcessGroup.group_name) or create the group first"
        ) from exc


def _normalize_dim(dim: int, ndim: int, op: str) -> int:
    if ndim == 0:
        raise CollectiveError(f"{op}: got a 0-d tensor; it has no dim to split or concatenate: reshape it to 1-d")
    if not -ndim <= dim < ndim:
        raise CollectiveError(
            f"{op}: dim={dim} is out of range for a {ndim}-d tensor; allowed [{-ndim}, {ndim - 1}]"
        )
    return dim % ndim


def _chunk_len(size, num_ranks: int, dim: int, op: str):
    """Length of one rank's chunk of a dimension of ``size`` split over ``num_ranks``."""
    if size % num_ranks != 0:
        raise CollectiveError(
            f"{op}: tensor dim {dim} has size {size}, not divisible by the group size "
            f"{num_ranks}; pad the tensor or choose a degree that divides it"
        )
    return size // num_ranks


def _check_reduce_op(op: str, where: str) -> None:
    if op not in REDUCE_OPS:
        raise CollectiveError(f"{where}: op={op!r} is not one of {REDUCE_OPS}")


def _check_differentiable(op: str, where: str) -> None:
    if op not in DIFFERENTIABLE_REDUCE_OPS:
        raise CollectiveError(
            f"{where}: op={op!r} has no gradient; differentiable ops are "
            f"{DIFFERENTIABLE_REDUCE_OPS}: detach the input or reduce with one of them"
        )


def _check_splits(splits: Sequence[int], num_ranks: int, total, what: str) -> None:
    if len(splits) != num_ranks or any(s < 0 for s in splits):
        raise CollectiveError(
            f"all_to_all: {what}={list(splits)} must hold {num_ranks} non-negative sizes, one per rank"
        )
    if total is not None and sum(splits) != total:
        raise CollectiveError(
            f"all_to_all: {what}={list(splits)} sums to {sum(splits)} but the input has "
            f"{total} rows on dim 0; the input splits must cover dim 0 exactly"
        )


def _check_all_to_all(x: Tensor, split_sizes_out, split_sizes_in, num_ranks: int) -> None:
    _normalize_dim(0, x.dim(), "all_to_all")
    _check_splits(split_sizes_in, num_ranks, x.shape[0], "split_sizes_in")
    _check_splits(split_sizes_out, num_ranks, None, "split_sizes_out")


def _with_dim(shape: Sequence, dim: int, size) -> list:
    out = list(shape)
    out[dim] = size
    return out


# --------------------------------------------------------------------------- eager kernels


def _gather(x: Tensor, dim: int, pg: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim``: (..., s, ...) -> (..., n*s, ...)."""
    n = pg.size()
    x = x.contiguous()
    flat = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank-major along dim 0
    _all_gather_single(flat, x, group=pg)
    if dim == 0:
        return flat
    stacked = flat.view(n, *x.shape)
    return stacked.movedim(0, dim).flatten(dim, dim + 1)  # copies into (..., n*s, ...)


def _reduce(x: Tensor, op: str, pg: dist.ProcessGroup) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=_DIST_OPS.get(op, dist.ReduceOp.SUM), group=pg)
    if op == "avg":
        out.div_(pg.size())
    return out


def _scatter_reduce(x: Tensor, dim: int, op: str, pg: dist.ProcessGroup) -> Tensor:
    """Reduce over ranks and keep this rank's chunk of ``dim``: (..., n*c, ...) -> (..., c, ...)."""
    n = pg.size()
    c = _chunk_len(x.shape[dim], n, dim, "reduce_scatter")
    chunks = x.unflatten(dim, (n, c)).movedim(dim, 0)  # (n, ..., c, ...): rank r's chunk at [r]
    out = x.new_empty(chunks.shape[1:])
    _reduce_scatter_single(out, chunks.flatten(0, 1).contiguous(), op=_DIST_OPS.get(op, dist.ReduceOp.SUM), group=pg)
    if op == "avg":
        out.div_(n)
    return out


def _own_chunk(x: Tensor, dim: int, pg: dist.ProcessGroup) -> Tensor:
    """This rank's chunk of ``dim`` as a new tensor: (..., n*c, ...) -> (..., c, ...)."""
    c = _chunk_len(x.shape[dim], pg.size(), dim, "scatter_to_sp")
    return x.narrow(dim, pg.rank() * c, c).clone(memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------- op definitions


def _all_gather_kernel(x: Tensor, dim: int, group_name: str, grad_op: str = "sum") -> Tensor:
    dim = _normalize_dim(dim, x.dim(), "all_gather")
    _check_reduce_op(grad_op, "all_gather grad_op")
    return _gather(x, dim, _group(group_name))


_all_gather_op = torch.library.custom_op("autoshard::all_gather", _all_gather_kernel, mutates_args=())


@_all_gather_op.register_fake
def _(x, dim, group_name, grad_op="sum"):
    dim = _normalize_dim(dim, x.dim(), "all_gather")
    _check_reduce_op(grad_op, "all_gather grad_op")
    n = _group(group_name).size()
    return x.new_empty(_with_dim(x.shape, dim, x.shape[dim] * n))


def _reduce_scatter_kernel(x: Tensor, dim: int, group_name: str, op: str = "sum") -> Tensor:
    dim = _normalize_dim(dim, x.dim(), "reduce_scatter")
    _check_reduce_op(op, "reduce_scatter")
    return _scatter_reduce(x, dim, op, _group(group_name))


_reduce_scatter_op = torch.library.custom_op("autoshard::reduce_scatter", _reduce_scatter_kernel, mutates_args=())


@_reduce_scatter_op.register_fake
def _(x, dim, group_name, op="sum"):
    dim = _normalize_dim(dim, x.dim(), "reduce_scatter")
    _check_reduce_op(op, "reduce_scatter")
    c = _chunk_len(x.shape[dim], _group(group_name).size(), dim, "reduce_scatter")
    return x.new_empty(_with_dim(x.shape, dim, c))


def _all_reduce_kernel(x: Tensor, group_name: str, op: str = "sum") -> Tensor:
    _check_reduce_op(op, "all_reduce")
    return _reduce(x, op, _group(group_name))


_all_reduce_op = torch.library.custom_op("autoshard::all_reduce", _all_reduce_kernel, mutates_args=())


@_all_reduce_op.register_fake
def _(x, group_name, op="sum"):
    _check_reduce_op(op, "all_reduce")
    _group(group_name)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _copy_to_tp_kernel(x: Tensor, group_name: str) -> Tensor:
    _group(group_name)
    return x.clone(memory_format=torch.contiguous_format)


_copy_to_tp_op = torch.library.custom_op("autoshard::copy_to_tp", _copy_to_tp_kernel, mutates_args=())


@_copy_to_tp_op.register_fake
def _(x, group_name):
    _group(group_name)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _reduce_from_tp_kernel(x: Tensor, group_name: str) -> Tensor:
    return _reduce(x, "sum", _group(group_name))


_reduce_from_tp_op = torch.library.custom_op("autoshard::reduce_from_tp", _reduce_from_tp_kernel, mutates_args=())


@_reduce_from_tp_op.register_fake
def _(x, group_name):
    _group(group_name)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _scatter_to_sp_kernel(x: Tensor, dim: int, group_name: str) -> Tensor:
    dim = _normalize_dim(dim, x.dim(), "scatter_to_sp")
    return _own_chunk(x, dim, _group(group_name))


_scatter_to_sp_op = torch.library.custom_op("autoshard::scatter_to_sp", _scatter_to_sp_kernel, mutates_args=())


@_scatter_to_sp_op.register_fake
def _(x, dim, group_name):
    dim = _normalize_dim(dim, x.dim(), "scatter_to_sp")
    c = _chunk_len(x.shape[dim], _group(group_name).size(), dim, "scatter_to_sp")
    return x.new_empty(_with_dim(x.shape, dim, c))


def _gather_from_sp_kernel(x: Tensor, dim: int, group_name: str, grad_is_partial: bool = True) -> Tensor:
    dim = _normalize_dim(dim, x.dim(), "gather_from_sp")
    return _gather(x, dim, _group(group_name))


_gather_from_sp_op = torch.library.custom_op("autoshard::gather_from_sp", _gather_from_sp_kernel, mutates_args=())


@_gather_from_sp_op.register_fake
def _(x, dim, group_name, grad_is_partial=True):
    dim = _normalize_dim(dim, x.dim(), "gather_from_sp")
    n = _group(group_name).size()
    return x.new_empty(_with_dim(x.shape, dim, x.shape[dim] * n))


def _all_to_all_kernel(x: Tensor, split_sizes_out: list[int], split_sizes_in: list[int], group_name: str) -> Tensor:
    pg = _group(group_name)
    _check_all_to_all(x, split_sizes_out, split_sizes_in, pg.size())
    out = x.new_empty((sum(split_sizes_out), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(split_sizes_out), list(split_sizes_in), group=pg)
    return out


_all_to_all_op = torch.library.custom_op("autoshard::all_to_all", _all_to_all_kernel, mutates_args=())


@_all_to_all_op.register_fake
def _(x, split_sizes_out, split_sizes_in, group_name):
    _check_all_to_all(x, split_sizes_out, split_sizes_in, _group(group_name).size())
    return x.new_empty((sum(split_sizes_out), *x.shape[1:]))


# --------------------------------------------------------------------------- autograd

_ops = torch.ops.autoshard


def _save_args(names: Sequence[str]):
    """A ``setup_context`` that stores the non-tensor inputs (all but the first) on ``ctx``."""

    def setup_context(ctx, inputs, output):
        for name, value in zip(names, inputs[1:]):
            setattr(ctx, name, value)

    return setup_context


def _all_gather_bwd(ctx, grad):
    # d(sum_r L_r)/dx_j = sum_r (dL_r/dy)[chunk j]; "avg" divides by n.
    return call("reduce_scatter", grad, ctx.dim, ctx.group_name, ctx.grad_op), None, None, None


def _reduce_scatter_bwd(ctx, grad):
    _check_differentiable(ctx.op, "reduce_scatter backward")
    full = call("all_gather", grad, ctx.dim, ctx.group_name, "sum")
    if ctx.op == "avg":
        full = full / _group(ctx.group_name).size()
    return full, None, None, None


def _all_reduce_bwd(ctx, grad):
    _check_differentiable(ctx.op, "all_reduce backward")
    return _ops.all_reduce(grad, ctx.group_name, ctx.op), None, None


def _copy_to_tp_bwd(ctx, grad):
    return _ops.all_reduce(grad, ctx.group_name, "sum"), None


def _reduce_from_tp_bwd(ctx, grad):
    return grad, None


def _scatter_to_sp_bwd(ctx, grad):
    return _ops.all_gather(grad, ctx.dim, ctx.group_name), None, None


def _gather_from_sp_bwd(ctx, grad):
    if ctx.grad_is_partial:
        return _ops.reduce_scatter(grad, ctx.dim, ctx.group_name, "sum"), None, None, None
    return _ops.scatter_to_sp(grad, ctx.dim, ctx.group_name), None, None, None


def _all_to_all_bwd(ctx, grad):
    reverse = _ops.all_to_all(grad, ctx.split_sizes_in, ctx.split_sizes_out, ctx.group_name)
    return reverse, None, None, None


# op name -> (backward, names of the non-tensor inputs it reads from ctx)
_AUTOGRAD = {
    "all_gather": (_all_gather_bwd, ("dim", "group_name", "grad_op")),
    "reduce_scatter": (_reduce_scatter_bwd, ("dim", "group_name", "op")),
    "all_reduce": (_all_reduce_bwd, ("group_name", "op")),
    "copy_to_tp": (_copy_to_tp_bwd, ("group_name",)),
    "reduce_from_tp": (_reduce_from_tp_bwd, ("group_name",)),
    "scatter_to_sp": (_scatter_to_sp_bwd, ("dim", "group_name")),
    "gather_from_sp": (_gather_from_sp_bwd, ("dim", "group_name", "grad_is_partial")),
    "all_to_all": (_all_to_all_bwd, ("split_sizes_out", "split_sizes_in", "group_name")),
}
for _name, (_backward, _saved) in _AUTOGRAD.items():
    torch.library.register_autograd(f"autoshard::{_name}", _backward, setup_context=_save_args(_saved))


# --------------------------------------------------------------------------- eager fast path

# [Note: eager fast path]
# A ``torch.library.custom_op`` call costs tens of microseconds of Python on the host
# (schema defaults, pytree, the autograd wrapper, dynamo's disable frame): with
# ~500 collective calls per ZeRO-3 step that host time was as large as a 1.3B
# model's GPU compute on H100s, so the step became host-bound and prefetching
# (more calls) made it slower (docs/runtime.md, "Overlap"). When nothing traces or
# intercepts the call — a plain ``torch.Tensor`` input, no dispatch mode on the
# stack (fake tensors, ``torch.export``, ``LocalTensorMode``, counting modes),
# not compiling — the public wrappers run the SAME kernel and the SAME
# registered backward through one ``torch.autograd.Function``. Values, gradients
# and the order of collectives are identical; graphs captured for export or
# ``torch.compile`` still hold the ``autoshard::`` ops.

_DIRECT: dict[str, tuple] = {}  # op name → (kernel, setup_context, backward, list output)


def register_direct(name: str, kernel, setup_context, backward, list_output: bool = False) -> None:
    """Make ``autoshard::name`` callable through ``call`` (note "eager fast path")."""
    _DIRECT[name] = (kernel, setup_context, backward, list_output)


class _Direct(torch.autograd.Function):
    """One ``autoshard::`` op without the torch.library dispatch (note "eager fast path")."""

    @staticmethod
    def forward(ctx, name: str, x: Tensor, *rest):
        kernel, setup, _backward, list_output = _DIRECT[name]
        out = kernel(x, *rest)
        setup(ctx, (x, *rest), out)
        ctx.op_name = name
        ctx.set_materialize_grads(False)
        return tuple(out) if list_output else out

    @staticmethod
    def backward(ctx, *grads):
        _kernel, _setup, backward, list_output = _DIRECT[ctx.op_name]
        if not list_output and grads[0] is None:
            return (None,) * len(ctx.needs_input_grad)
        return (None, *backward(ctx, list(grads) if list_output else grads[0]))


def eager_context() -> bool:
    """No dispatch mode on the stack and not compiling (note "eager fast path")."""
    # is_compiling() first: dynamo cannot trace the dispatch-stack query (a graph break per collective)
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _eager(x: Tensor) -> bool:
    return type(x) is Tensor and eager_context()


def call(name: str, x: Tensor, *rest):
    """``torch.ops.autoshard.<name>(x, *rest)``, directly when nothing traces or intercepts (note)."""
    if name in _DIRECT and _eager(x):
        if torch.autograd.profiler._is_profiler_enabled:  # keep the op's name in traces (benchmarks read it)
            with torch.profiler.record_function(f"autoshard::{name}"):
                out = _Direct.apply(name, x, *rest)
        else:
            out = _Direct.apply(name, x, *rest)
        return list(out) if _DIRECT[name][3] else out
    return getattr(_ops, name)(x, *rest)


for _name, (_backward, _saved) in _AUTOGRAD.items():
    register_direct(_name, globals()[f"_{_name}_kernel"], _save_args(_saved), _backward)


# --------------------------------------------------------------------------- one-process simulation

# [Note: LocalTensorMode]
# Under ``torch.distributed._local_tensor.LocalTensorMode`` (private; in torch 2.11 and 2.13; the
# test harness's ``local_ranks``) one process holds every rank's tensor. The
# mode runs an unknown op once per rank with plain tensors, where our blocking
# collectives would hit the fake process group and return garbage. These rules
# instead run each kernel on the per-rank tensors under the mode, whose own
# c10d handlers then combine the ranks. ``scatter_to_sp`` is the one
# rank-dependent kernel: it picks each rank's chunk explicitly. ``all_to_all``
# works when every rank uses the same split sizes (Python ints are not per rank).
# Where torch lacks LocalTensorMode nothing is registered.


def _register_local_tensor_rules() -> None:
    try:
        from torch.distributed._local_tensor import LocalTensorMode
    except ImportError:  # pragma: no cover - a torch without LocalTensorMode
        return

    def run_kernel_under_mode(kernel):
        def rule(mode, func, types, args, kwargs):
            with LocalTensorMode(mode.ranks):
                return kernel(*args, **kwargs)

        return rule

    def scatter_rule(mode, func, types, args, kwargs):
        x, dim, group_name = args
        dim = _normalize_dim(dim, x.dim(), "scatter_to_sp")
        group_ranks = dist.get_process_group_ranks(_group(group_name))
        c = _chunk_len(x.shape[dim], len(group_ranks), dim, "scatter_to_sp")

        def take(rank, t):  # rank is a global rank; the chunk index is its rank in the group
            return t.narrow(dim, group_ranks.index(rank) * c, c).clone(memory_format=torch.contiguous_format)

        return mode.tensor_map(x, take)

    kernels = {
        "all_gather": _all_gather_kernel,
        "reduce_scatter": _reduce_scatter_kernel,
        "all_reduce": _all_reduce_kernel,
        "copy_to_tp": _copy_to_tp_kernel,
        "reduce_from_tp": _reduce_from_tp_kernel,
        "gather_from_sp": _gather_from_sp_kernel,
        "all_to_all": _all_to_all_kernel,
    }
    for name, kernel in kernels.items():
        torch.library.register_torch_dispatch(f"autoshard::{name}", LocalTensorMode, run_kernel_under_mode(kernel))
    torch.library.register_torch_dispatch("autoshard::scatter_to_sp", LocalTensorMode, scatter_rule)


_register_local_tensor_rules()


# --------------------------------------------------------------------------- public wrappers


def all_gather(x: Tensor, dim: int, group: str | dist.ProcessGroup | None = None, grad_op: str = "sum") -> Tensor:
    """Concatenate every rank's ``x`` along tensor dim ``dim``: (..., s, ...) -> (..., n*s, ...).

    Backward: reduce-scatter of the gradient with ``grad_op`` ("sum": the sum of
    the per-rank losses is differentiated; "avg": their mean, as FSDP averages).
    """
    return call("all_gather", x, dim, group_name_of(group), grad_op)


def reduce_scatter(x: Tensor, dim: int, group: str | dist.ProcessGroup | None = None, op: str = "sum") -> Tensor:
    """Reduce ``x`` over ranks with ``op`` and keep this rank's chunk of ``dim``: (..., n*c, ...) -> (..., c, ...).

    Backward: all-gather of the gradient (divided by n for ``op="avg"``).
    """
    return call("reduce_scatter", x, dim, group_name_of(group), op)


def all_reduce(x: Tensor, group: str | dist.ProcessGroup | None = None, op: str = "sum") -> Tensor:
    """Reduce ``x`` over ranks with ``op``; every rank gets the result.

    Backward (per-rank losses): all-reduce of the gradient with the same ``op``.
    For Megatron TP with a replicated loss use ``reduce_from_tp`` instead.
    """
    return call("all_reduce", x, group_name_of(group), op)


def copy_to_tp(x: Tensor, group: str | dist.ProcessGroup | None = None) -> Tensor:
    """Megatron ``f``: identity forward, all-reduce(sum) of the gradient backward.

    Put before a column-parallel layer whose input is replicated over the tp group.
    """
    return _ops.copy_to_tp(x, group_name_of(group))


def reduce_from_tp(x: Tensor, group: str | dist.ProcessGroup | None = None) -> Tensor:
    """Megatron ``g``: all-reduce(sum) forward, identity backward.

    Put after a row-parallel layer; the loss downstream is replicated over tp.
    """
    return _ops.reduce_from_tp(x, group_name_of(group))


def scatter_to_sp(x: Tensor, dim: int, group: str | dist.ProcessGroup | None = None) -> Tensor:
    """Keep this rank's chunk of the replicated ``x`` along ``dim`` (sequence); backward all-gathers."""
    return _ops.scatter_to_sp(x, dim, group_name_of(group))


def gather_from_sp(
    x: Tensor, dim: int, group: str | dist.ProcessGroup | None = None, grad_is_partial: bool = True
) -> Tensor:
    """All-gather sequence shards along ``dim``.

    Backward: reduce-scatter(sum) when each rank's gradient is a partial sum
    (the consumer is column-parallel: Megatron SP), else keep this rank's chunk
    (the consumer is replicated, so every rank already holds the full gradient).
    """
    return _ops.gather_from_sp(x, dim, group_name_of(group), grad_is_partial)


def all_to_all(
    x: Tensor,
    split_sizes_out: Sequence[int],
    split_sizes_in: Sequence[int],
    group: str | dist.ProcessGroup | None = None,
) -> Tensor:
    """Exchange rows of dim 0: send ``split_sizes_in[j]`` rows to rank j, receive ``split_sizes_out[j]`` from it.

    (sum(split_sizes_in), ...) -> (sum(split_sizes_out), ...). Backward: the
    reverse exchange (the two split lists swapped). Split sizes are static ints:
    a data-dependent EP dispatch exchanges its counts first, outside this op.
    """
    return _ops.all_to_all(x, list(split_sizes_out), list(split_sizes_in), group_name_of(group))


__all__ = [
    "DIFFERENTIABLE_REDUCE_OPS",
    "REDUCE_OPS",
    "CollectiveError",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "copy_to_tp",
    "gather_from_sp",
    "group_name_of",
    "reduce_from_tp",
    "reduce_scatter",
    "scatter_to_sp",
]
