"""The per-rank contract shared by every pass and the runtime: ``RankContext`` and ``ParamPlacement``.

A ``Plan`` is data for all ranks; a pass needs to know *which* rank it builds
for. ``RankContext`` is that rank's view of the plan's mesh: its coordinate
on every mesh axis and the name of the process group of every axis (group
names are strings, as PyTorch's functional collectives use them, so a context
holds no live objects and pickles). ``runtime/mesh.py`` builds it from a live
``torch.distributed.DeviceMesh``; tests may build one by hand.

Rank layout (decision, as torchtitan): the device mesh has the axes, outermost
to innermost, ``pp, dp_replicate, dp_shard, cp, tp``; tp is innermost so a tp
group is a run of contiguous ranks (one node). ``rank = ((((pp·R + r)·S + s)·C
+ c)·T + t)`` for degrees ``R, S, C, T`` of dp_replicate, dp_shard, cp, tp.
The combined data-parallel group ``"dp"`` is dp_replicate × dp_shard (ranks
that differ only in those two coordinates). Expert parallelism reuses dp ranks
(``plan.Mesh``): an ep group is a run of ``ep`` consecutive dp ranks inside one
dp group (``coord("ep") = dp mod ep``; ``"edp"``: the dp ranks holding the same
experts, ``coord("edp") = dp div ep``; groups built by ``runtime/mesh.py``).

``ParamPlacement`` says how one parameter is laid out on this rank, in
DTensor's vocabulary over the device mesh above: one placement per mesh axis
(``Shard(tensor_dim)``, ``_StridedShard`` or ``Replicate()``), the global and
local shapes, and the ZeRO ``state`` of its layer. Local shards follow
DTensor's ``torch.chunk`` rule (chunk ``i`` of ``torch.chunk(t, n, dim)``,
empty when ``torch.chunk`` returns fewer than ``n`` chunks), so
``DTensor.from_local(local, device_mesh, placements, shape=global_shape,
stride=global_stride)`` rebuilds the global tensor; checkpoints rely on this.

Sharding order when both apply: tp first (Megatron: column → tensor dim 0,
row → tensor dim 1, vocab → tensor dim 0; a weight stored ``[in, out]``, as
transformers' ``Conv1D``, swaps the two: ``TpLayout``), then ZeRO-3 on tensor
dim 0 of the tp-local piece over dp_shard. When both split tensor dim 0 the
dp_shard placement is ``_StridedShard(0, split_factor=tp)``, FSDP2's form for
"tp then fsdp on the same dim".

Fused projections (``TpLayout.parts > 1``: GPT-2's ``c_attn`` = [q | k | v], a
fused gate/up): the tp dim holds ``parts`` equal blocks and each rank holds its
chunk of *every* block, concatenated (``[q_r | k_r | v_r]``), so its q, k and v
heads stay together; in DTensor's words ``_StridedShard(tp_dim,
split_factor=parts)`` on the tp axis. The rank's shard is then ``parts``
rectangular blocks (``ParamPlacement.regions``), not one. Decision: such a
parameter is never split over dp_shard on the same dim (its tp-local piece is
not one block of the global tensor, and ZeRO-3 chunks of it would not be
either): where ZeRO-3 (or a compiled ZeRO-1/2 gather) would split it, it stays
whole over dp and its gradient is all-reduced over dp as in DDP. In practice
this is the 1-d bias of a fused ``Conv1D``; its weight splits tp on dim 1 and
ZeRO-3 on dim 0 as usual.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None

from autoshard.errors import PlanError
from autoshard.data_parallel import data_parallel_form
from autoshard.plan import LayerStrategy, Mesh

# Device-mesh axes, outermost → innermost (module docstring: rank layout).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Tensor dim split by Megatron tp, per tp role (autoshard.graph.TP_ROLES), for nn.Linear's [out, in] weights.
TP_ROLE_DIM = {"column": 0, "row": 1, "vocab": 0}


@dataclass(frozen=True)
class TpLayout:
    """How a tp-split parameter lies in its global tensor (module docstring; ``shard_parameters`` reads it
    from the op that uses the parameter).

    transposed: a 2-d weight stored ``[in, out]`` (``addmm`` / ``mm``: transformers' ``Conv1D``):
        column splits tensor dim 1, row tensor dim 0.
    parts: equal blocks of a fused projection along the split dim (1: not fused).
    """

    transposed: bool = False
    parts: int = 1

    def tp_dim(self, tp_role: str, ndim: int) -> int | None:
        """Tensor dim split by tp for ``tp_role`` (``None``: not split)."""
        dim = TP_ROLE_DIM.get(tp_role)
        return 1 - dim if dim is not None and self.transposed and ndim == 2 else dim


@dataclass(frozen=True)
class RankContext:
    """One rank's view of the plan's mesh (module docstring: layout).

    rank / world_size: global rank and world size.
    mesh: the plan's mesh degrees.
    coords: this rank's coordinate on every axis of ``MESH_ORDER``.
    group_names: process-group name per axis of ``MESH_ORDER`` plus ``"dp"``
        (dp_replicate × dp_shard) and ``"world"``.
    device: where compute runs ("cpu", "cuda:0").
    compute_dtype: dtype of the compute copies of parameters and activations.
    compiled: the runtime will run the program through ``torch.compile``; passes emit the forms it
        traces as one joint graph (``passes/_zero3.py`` note "compiled gather") instead of the eager
        runtime's hooks and side-stream collectives.
    """

    rank: int
    world_size: int
    mesh: Mesh
    coords: dict[str, int]
    group_names: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    compute_dtype: torch.dtype = torch.float32
    compiled: bool = False

    def size(self, axis: str) -> int:
        """Degree of mesh axis ``axis`` (``"dp"`` = dp_replicate × dp_shard; ``"edp"`` = dp / ep)."""
        if axis == "edp":  # expert data parallel: dp ranks holding the same experts
            return self.mesh.dp // self.mesh.ep
        return self.mesh.dp if axis == "dp" else getattr(self.mesh, axis)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (``"dp"``: index inside the combined dp group).

        ``"ep"`` / ``"edp"``: an ep group is a run of ``ep`` consecutive dp
        coordinates, so ep = dp mod ep and edp = dp div ep.
        """
        if axis == "dp":
            return self.coords["dp_replicate"] * self.mesh.dp_shard + self.coords["dp_shard"]
        if axis == "ep":
            return self.coord("dp") % self.mesh.ep
        if axis == "edp":
            return self.coord("dp") // self.mesh.ep
        return self.coords[axis]

    def group(self, axis: str) -> str:
        """Process-group name of ``axis`` (``"dp"``, ``"world"`` or one of ``MESH_ORDER``)."""
        return self.group_names[axis]


def coords_of(rank: int, mesh: Mesh) -> dict[str, int]:
    """Coordinates of global ``rank`` on every axis of ``MESH_ORDER`` (row-major, tp innermost)."""
    coords = {}
    for axis in reversed(MESH_ORDER):
        degree = getattr(mesh, axis)
        coords[axis] = rank % degree
        rank //= degree
    return {axis: coords[axis] for axis in MESH_ORDER}


@dataclass(frozen=True)
class ParamPlacement:
    """How one parameter is laid out on one rank (module docstring).

    fqn / layer: parameter name and the plan layer that owns it.
    state: the owner layer's ZeRO state.
    global_shape / local_shape: logical shape and this rank's shard shape.
    placements: one DTensor placement per axis of ``MESH_ORDER``.
    tp_dim: tensor dim split over tp (``None``: replicated over tp).
    dp_dim: tensor dim split over dp_shard by ZeRO-3 (``None``: not split).
    tp_parts: equal blocks of a fused projection along ``tp_dim`` (module docstring); the rank holds
        its chunk of each, concatenated (``regions``).
    """

    fqn: str
    layer: str
    state: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: tuple
    tp_dim: int | None = None
    dp_dim: int | None = None
    ep_dim: int | None = None  # expert dim split over the ep group (EP); Shard on dp_shard when ep == dp_shard
    tp_parts: int = 1

    @property
    def global_stride(self) -> tuple[int, ...]:
        """Contiguous strides of the global shape (for ``DTensor.from_local``)."""
        return tuple(torch.empty(self.global_shape, device="meta").stride())

    def region(self, ctx: RankContext) -> tuple[slice, ...]:
        """The block of the global tensor this rank holds: one ``slice(start, stop)`` per tensor dim.

        Every sharding here (tp, then ZeRO-3 over dp_shard, then ep) chunks a contiguous range of
        one dim, so the local shard is one rectangular block: materialisation reads or initialises
        exactly it (``runtime/materialize.py``), never the whole tensor. A fused parameter
        (``tp_parts > 1``) holds one such block per part: this is the first part's, ``regions``
        gives them all.
        """
        bounds = [(0, n) for n in self.global_shape]
        for tensor_dim, axis, empty_ok in ((self.tp_dim, "tp", False), (self.dp_dim, "dp_shard", True),
                                           (self.ep_dim, "ep", False)):
            if tensor_dim is None:
                continue
            start, stop = bounds[tensor_dim]
            size, parts, index = stop - start, ctx.size(axis), ctx.coord(axis)
            if axis == "tp":
                size //= self.tp_parts
            length = _chunk_len(size, parts, index) if empty_ok else size // parts
            first = min(size, index * chunk_size(size, parts)) if empty_ok else index * length
            bounds[tensor_dim] = (start + first, start + first + length)
        region = tuple(slice(a, b) for a, b in bounds)
        block = list(self.local_shape)
        if self.tp_dim is not None:
            block[self.tp_dim] //= self.tp_parts
        assert [b - a for a, b in bounds] == block, (bounds, self.local_shape, self.tp_parts)
        return region

    def part_regions(self, region: tuple[slice, ...]) -> tuple[tuple[slice, ...], ...]:
        """All blocks of the local shard from ``region`` (the first part's), in the order they are
        concatenated along ``tp_dim``: each part's block lies ``global/tp_parts`` further on."""
        if self.tp_parts == 1:
            return (region,)
        step = self.global_shape[self.tp_dim] // self.tp_parts
        here = region[self.tp_dim]
        return tuple(region[:self.tp_dim] + (slice(here.start + k * step, here.stop + k * step),)
                     + region[self.tp_dim + 1:] for k in range(self.tp_parts))

    def regions(self, ctx: RankContext) -> tuple[tuple[slice, ...], ...]:
        """The blocks of the global tensor this rank holds, concatenated along ``tp_dim`` (one unless fused)."""
        return self.part_regions(self.region(ctx))

    def shard(self, full: torch.Tensor, ctx: RankContext) -> torch.Tensor:
        """This rank's local shard of the global tensor ``full`` (a new contiguous tensor)."""
        assert tuple(full.shape) == self.global_shape, (full.shape, self.global_shape)
        blocks = [full[region] for region in self.regions(ctx)]
        return (torch.cat(blocks, self.tp_dim) if len(blocks) > 1 else blocks[0]).contiguous().clone()


def chunk_or_empty(t: torch.Tensor, num_chunks: int, index: int, tensor_dim: int) -> torch.Tensor:
    """Chunk ``index`` of ``torch.chunk(t, num_chunks, tensor_dim)``, or an empty slice past the last chunk."""
    chunks = t.chunk(num_chunks, tensor_dim)
    if index < len(chunks):
        return chunks[index]
    return t.narrow(tensor_dim, t.shape[tensor_dim], 0)


def chunk_size(size: int, num_chunks: int) -> int:
    """Size of the first (largest) ``torch.chunk`` piece: ceil(size / num_chunks)."""
    return -(-size // num_chunks)


def _chunk_len(size: int, num_chunks: int, index: int) -> int:
    """Length of chunk ``index`` under the ``torch.chunk`` rule."""
    c = chunk_size(size, num_chunks)
    return max(0, min(c, size - index * c))


def placement_for(
    fqn: str, global_shape: tuple[int, ...], tp_role: str, strategy: LayerStrategy, ctx: RankContext,
    gathered_in_graph: bool = False, layout: TpLayout = TpLayout(),
) -> ParamPlacement:
    """The placement of parameter ``fqn`` under its layer's ``strategy`` on ``ctx``'s rank.

    ``gathered_in_graph`` (``gathers_in_graph``): a ZeRO-1/2 layer of a compiled program is held
    as ZeRO-3's dim-0 shard and gathered in the forward graph (``passes/_zero3.py`` note
    "compiled gather"). ``layout``: how the parameter is used (transposed weight, fused parts).

    Raises ``PlanError`` when tp does not divide the split dimension (uneven
    Megatron shards would change the model's head/vocab arithmetic).
    """
    tp = ctx.size("tp")
    tp_dim = layout.tp_dim(tp_role, len(global_shape)) if strategy.tp == "megatron" and tp > 1 else None
    parts = layout.parts if tp_dim is not None else 1
    local = list(global_shape)
    if tp_dim is not None:
        if global_shape[tp_dim] % (tp * parts):
            fused = f" ({parts} fused parts)" if parts > 1 else ""
            raise PlanError(
                f"layer {strategy.layer!r}: parameter {fqn!r} dim {tp_dim} has size {global_shape[tp_dim]}{fused}, "
                f"not divisible by tp={tp}; choose a tp degree that divides it or tp='none' for this layer"
            )
        local[tp_dim] //= tp
    if parts > 1 and _StridedShard is None:  # pragma: no cover - older torch
        raise PlanError(f"layer {strategy.layer!r}: {fqn!r} is a fused projection; splitting it over tp needs "
                        "torch's _StridedShard (torch >= 2.5); upgrade torch or use tp='none' for this layer")
    sharded = strategy.state == "zero3" or gathered_in_graph
    fused_dim0 = parts > 1 and tp_dim == 0  # stays whole over dp (module docstring: fused projections)
    dp_dim = 0 if sharded and ctx.size("dp_shard") > 1 and global_shape and not fused_dim0 else None
    if dp_dim is not None:
        local[0] = _chunk_len(local[0], ctx.size("dp_shard"), ctx.coord("dp_shard"))
    ep_dim = _expert_dim(fqn, global_shape, tp_role, strategy, ctx)
    if ep_dim is not None:
        local[ep_dim] //= ctx.size("ep")
    placements = {axis: Replicate() for axis in MESH_ORDER}
    if tp_dim is not None:
        placements["tp"] = _StridedShard(tp_dim, split_factor=parts) if parts > 1 else Shard(tp_dim)
    if ep_dim is not None and ctx.size("ep") == ctx.size("dp_shard"):
        placements["dp_shard"] = Shard(ep_dim)  # ep coordinate = dp_shard coordinate: expressible in DTensor
    if dp_dim is not None:
        strided = tp_dim == 0 and _StridedShard is not None
        placements["dp_shard"] = _StridedShard(0, split_factor=tp) if strided else Shard(0)
    return ParamPlacement(
        fqn=fqn,
        layer=strategy.layer,
        state=strategy.state,
        global_shape=tuple(global_shape),
        local_shape=tuple(local),
        placements=tuple(placements[axis] for axis in MESH_ORDER),
        tp_dim=tp_dim,
        dp_dim=dp_dim,
        ep_dim=ep_dim,
        tp_parts=parts,
    )


def gathers_in_graph(strategy: LayerStrategy, ctx: RankContext, num_micro_batches: int) -> bool:
    """Whether a ZeRO-1/2 layer runs as a gather in the compiled forward graph, kept for backward.

    [Note: compiled ZeRO-1/2]
    Eager, ZeRO-1/2 hold the full parameter, reduce-scatter its gradient after the backward and
    all-gather the updated chunks after the optimizer step: both collectives sit outside any
    graph, and the post-step gather is exposed (measured: ~190 ms of a 470 ms 7B step on 4 GPUs,
    ``benchmarks/results/sharded_h200x4_2026-11-27``). A compiled program with one micro-batch on
    one stage holds such a layer as ZeRO-3's shard instead and gathers it in the forward graph
    *without* resharding (``Zero3Gather.reshard_after_forward`` off): the gathered weights are kept
    for the backward, whose graph reduce-scatters the gradient (FSDP's
    ``reshard_after_forward=False``). The same bytes move — one all-gather, one reduce-scatter
    per step — but both are graph nodes inductor overlaps with compute, as the cost model prices
    ZeRO-2 (gradient reduction under the backward, parameter gather under the next forward). The
    optimizer state stays sharded over dp; parameters are whole only from forward to backward.
    Only where the shard group is the whole dp group (dp_replicate = 1) and the wire is unquantized:
    the declared form (``autoshard/data_parallel.py``), which the cost model prices too.
    """
    form = data_parallel_form(strategy, ctx.mesh, num_micro_batches, ctx.compiled)
    return form.gathered == "kept"


def _expert_dim(fqn: str, global_shape: tuple[int, ...], tp_role: str, strategy: LayerStrategy, ctx: RankContext) -> int | None:
    """Tensor dim 0 of an expert weight [E, ...] under EP (``strategy.ep`` and mesh ep > 1), else None."""
    ep = ctx.size("ep")
    if not (strategy.ep and ep > 1 and tp_role == "expert"):
        return None
    if strategy.state != "replicate" or strategy.tp != "none":
        raise PlanError(
            f"layer {strategy.layer!r}: expert parallelism with state={strategy.state!r}, tp={strategy.tp!r} is not "
            "implemented by the runtime yet (allowed with ep=True: state='replicate', tp='none'); change the layer's strategy"
        )
    if global_shape[0] % ep:
        raise PlanError(
            f"layer {strategy.layer!r}: {global_shape[0]} experts of {fqn!r} are not divisible by ep={ep}; "
            "choose an ep degree dividing the expert count"
        )
    return 0


@dataclass
class PassState:
    """What the passes hand each other and the runtime, one typed field per fact (``gm.meta["autoshard"]``
    of a program's graph module; ``pass_state``). Each pass returns a new module with a copy of its
    input's state (``_graph_utils.rebuild``) and sets the fields it owns:

    | field | set by | read by |
    | --- | --- | --- |
    | ``params``: fqn → (layer, tp role) | the export (``runtime/program._export``) | ``shard_parameters``, ``insert_collectives`` |
    | ``placements``: fqn → ``ParamPlacement`` | ``shard_parameters`` (a pipeline rank's own: ``split_pipeline``) | ``insert_collectives``, ``quantize_comm``, the runtime |
    | ``grads_reduced_in_graph``: fqns | ``insert_collectives`` | the optimizer (no second reduction) |
    | ``regather``: submodule name | ``recompute`` (eager ZeRO-3 re-gathers) | ``schedule_overlap``, ``split_pipeline``, the runtime |
    | ``compile_options``: inductor options | ``schedule_overlap`` | the runtime's ``torch.compile`` |
    | ``grad_comm``: fqn → wire dtype | ``quantize_comm`` | the optimizer's gradient syncs |
    | ``pipeline``: ``PipelineLayout`` | ``split_pipeline`` | ``runtime/pipeline.py`` |
    """

    params: dict[str, tuple[str, str]] = field(default_factory=dict)
    placements: dict[str, ParamPlacement] | None = None
    grads_reduced_in_graph: tuple[str, ...] = ()
    regather: str | None = None
    compile_options: dict | None = None
    grad_comm: dict[str, str] | None = None
    pipeline: Any = None  # passes/split_pipeline.PipelineLayout (that module imports this one)

    def copy(self) -> PassState:
        """A shallow copy for a pass's output module (the mappings are replaced, never mutated in place)."""
        return dataclasses.replace(self)


def pass_state(gm: torch.nn.Module) -> PassState:
    """The ``PassState`` of a program's module (``gm.meta["autoshard"]``); a module the export did not make
    (a pipeline stage, a bare graph in a test) has an empty one."""
    meta = getattr(gm, "meta", None)
    state = meta.get("autoshard") if isinstance(meta, dict) else None
    if isinstance(state, PassState):
        return state
    if isinstance(meta, dict) and state is None:  # attached, so that a pass's writes are kept
        state = meta["autoshard"] = PassState()
        return state
    return PassState()


def autoshard_meta(pass_name: str, why: str, **extra) -> dict:
    """The ``node.meta["autoshard"]`` record of a node a pass inserted or moved."""
    return {"pass": pass_name, "why": why, **extra}


__all__ = [
    "MESH_ORDER",
    "TP_ROLE_DIM",
    "ParamPlacement",
    "PassState",
    "RankContext",
    "TpLayout",
    "autoshard_meta",
    "chunk_or_empty",
    "chunk_size",
    "coords_of",
    "pass_state",
    "placement_for",
]
