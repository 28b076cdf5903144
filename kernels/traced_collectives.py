"""Collectives for programs that ``torch.compile`` traces jointly (forward and backward in one graph).

[Note: why PyTorch's functional collectives here]
Inductor schedules only its own collective ops, ``torch.ops._c10d_functional.*``:
it issues them asynchronously, waits at first use, and its passes bucket and
reorder them for overlap (``passes/schedule_overlap.py`` turns those on from
the plan). The ``autoshard::`` ops (``kernels/collectives.py``) are opaque
blocking calls to it. So a compiled program (``RankContext.compiled``) traces
its ZeRO-3 gathers through ``traced_all_gather`` below: forward an
``all_gather_into_tensor`` + ``wait_tensor``, backward a
``reduce_scatter_tensor`` + ``wait_tensor``, both graph nodes. The gradient
convention is that of ``autoshard::all_gather`` (per-rank losses; ``grad_op``
"avg" differentiates their mean). gloo has no AVG: there the sum is divided.

[Note: gradient sync]
``traced_grad_sync`` puts the data-parallel gradient reduction of a replicated
(DDP) or ZeRO-1/2 parameter into the backward graph: identity forward, an
``all_reduce`` (mean over dp) of the parameter's gradient in backward, issued
as soon as autograd has the gradient, so inductor overlaps it with the rest of
the backward instead of the optimizer running it after the step's backward
(``passes/insert_collectives.py``, ``_insert_grad_syncs``: compiled programs
with one micro-batch; with several the gradient is accumulated first).

[Note: HSDP in the graph]
A ZeRO-3 layer on a mesh with dp_replicate > 1 (HSDP) reduces its gradient in two levels: a
reduce-scatter over dp_shard, then an all-reduce (avg) of the shard over dp_replicate. Compiled
with one micro-batch on one stage and unquantized wires, both are nodes of the gather's backward
(``traced_all_gather(..., replicate_group=)``; ``passes/insert_collectives.py`` lists the
parameters in ``grads_reduced_in_graph``), so inductor overlaps the replica all-reduce with the
rest of the backward; otherwise the optimizer runs it after the backward.

[Note: re-gather in backward without hooks]
``recompute_in_backward(fn, *args)`` runs ``fn`` under selective activation
checkpointing with every op marked ``MUST_RECOMPUTE``. Under ``torch.compile``
the partitioner then never saves ``fn``'s outputs for backward: whatever
backward needs of them (a linear's full weight) is recomputed there from
``fn``'s inputs (the local shards, graph inputs that cost nothing to keep), so
the backward graph holds the re-gather as ordinary nodes (SimpleFSDP's
construction, arXiv 2411.00284). Eager, the same call runs ``fn`` once and the
consumers keep its outputs alive (no memory saving): the eager runtime uses
the saved-tensor hooks of ``passes/recompute.py`` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dataclasses import dataclass

from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard.kernels.collectives import _group

_functional = torch.ops._c10d_functional


def _backend_reduce(group_name: str, op: str) -> tuple[str, bool]:
    """(op the backend runs, whether to divide by the group size after it): gloo has no AVG."""
    if op == "avg" and dist.get_backend(_group(group_name)) == "gloo":
        return "sum", True
    return op, False


class _AllGather(torch.autograd.Function):
    """(L,) → (n·L,) rank-major; backward reduce-scatters with the gather's reduction (module note)."""

    @staticmethod
    def forward(ctx, x: Tensor, gather: "TracedAllGather") -> Tensor:
        ctx.gather = gather
        out = _functional.all_gather_into_tensor(x.contiguous(), gather.num_ranks, gather.group_name)
        return _functional.wait_tensor(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = ctx.gather
        out = _functional.wait_tensor(
            _functional.reduce_scatter_tensor(grad.contiguous(), g.reduce_op, g.num_ranks, g.group_name))
        out = out / g.num_ranks if g.divide else out
        if g.replicate is not None:  # HSDP: the shard's gradient, averaged over the replicas too
            out = g.replicate(out)
        return out, None


@dataclass(frozen=True)
class TracedAllGather:
    """An all-gather over one group as graph nodes, dim 0, with ``autoshard::all_gather``'s gradient.

    Built outside tracing (``traced_all_gather``): the backend is looked up once, since dynamo cannot
    trace the process-group lookup (a graph break per layer).
    """

    group_name: str
    num_ranks: int
    reduce_op: str  # what the backward's reduce-scatter runs
    divide: bool  # "avg" on a backend without AVG: sum, then divide
    replicate: "TracedAllReduce | None" = None  # HSDP: then all-reduce (avg) the shard's gradient over replicas

    def __call__(self, x: Tensor) -> Tensor:
        return _AllGather.apply(x, self)


@dataclass(frozen=True)
class TracedAllReduce:
    """An all-reduce over one group as graph nodes (a plain function of a tensor, for a backward)."""

    group_name: str
    num_ranks: int
    reduce_op: str
    divide: bool

    def __call__(self, x: Tensor) -> Tensor:
        out = _functional.wait_tensor(_functional.all_reduce(x.contiguous(), self.reduce_op, self.group_name))
        return out / self.num_ranks if self.divide else out


def traced_all_gather(group_name: str, num_ranks: int, grad_op: str = "avg",
                      replicate_group: str | None = None, replicate_ranks: int = 1) -> TracedAllGather:
    """The all-gather of ``group_name`` as compiled programs trace it (module note). With
    ``replicate_group`` (HSDP, note "HSDP in the graph") the backward's reduce-scatter is followed by
    an all-reduce (avg) of the shard's gradient over that group."""
    if grad_op not in ("sum", "avg"):
        raise ValueError(f"traced all_gather: grad_op={grad_op!r}; allowed 'sum', 'avg'")
    replicate = None
    if replicate_group is not None and replicate_ranks > 1:
        replicate = TracedAllReduce(replicate_group, replicate_ranks, *_backend_reduce(replicate_group, "avg"))
    return TracedAllGather(group_name, num_ranks, *_backend_reduce(group_name, grad_op), replicate)


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (module note "gradient sync")."""

    @staticmethod
    def forward(ctx, x: Tensor, sync: "TracedGradSync") -> Tensor:
        ctx.sync = sync
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        s = ctx.sync
        out = _functional.wait_tensor(_functional.all_reduce(grad.contiguous(), s.reduce_op, s.group_name))
        return (out / s.num_ranks if s.divide else out), None


@dataclass(frozen=True)
class TracedGradSync:
    """A parameter's data-parallel gradient all-reduce (avg) as a backward graph node (module note)."""

    group_name: str
    num_ranks: int
    reduce_op: str
    divide: bool

    def __call__(self, param: Tensor) -> Tensor:
        return _GradAllReduce.apply(param, self)


def traced_grad_sync(group_name: str, num_ranks: int) -> TracedGradSync:
    """The gradient all-reduce (mean over ``group_name``) a compiled program traces (module note)."""
    return TracedGradSync(group_name, num_ranks, *_backend_reduce(group_name, "avg"))


def _must_recompute(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_contexts():
    return create_selective_checkpoint_contexts(_must_recompute)


def recompute_in_backward(fn, *args):
    """``fn(*args)`` whose outputs backward recomputes instead of keeping (module note)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_recompute_contexts, preserve_rng_state=False)


__all__ = ["TracedAllGather", "TracedAllReduce", "TracedGradSync", "recompute_in_backward", "traced_all_gather", "traced_grad_sync"]
