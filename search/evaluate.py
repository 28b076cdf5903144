"""Cost tables and the plan-level aggregation the solver optimises.

The CP-SAT model in ``solver.py`` and this module compute the same quantity;
this one in floating point, for one fixed assignment. It is the oracle of the
solver tests (brute force over small models), the evaluator behind
``explain`` (alternatives re-costed with everything else fixed), and the
fallback for ``Predictions`` while ``cost_model.predict`` is unavailable.

Per layer ``l`` with strategy ``s`` (``LayerCost`` of the cost function):

    t_l    = fwd_s + bwd_s                       per micro-batch, seconds
    tail_l = comm_exposed_s + optimizer_s        per optimizer step, seconds
    S_l    = params + grads + optimizer          bytes, static
    G_l    = buffers                             bytes, buffers of the layer's backward
    H_l    = gathered                            bytes, the layer's gathered parameters in forward
    R_l    = params + optimizer                  bytes, what the build leaves resident
    X_l    = build_transient                     bytes, largest parameter region being built
    O_l    = S_l + step_grads                    bytes, what the optimizer step holds (``memory.py``)
    Y_l    = step_transient                      bytes, copies of the gradient bucket being packed
    K_l    = step_bucketed                       bytes, pack × its bucketed gradients (N_l: without the pack)
    A_l    = activations                         bytes, one micro-batch; A'_l when the layer
                                                 continues a checkpoint region (below)
    P_l    = send/recv of the layer's output     seconds per micro-batch, paid when a stage
                                                 boundary follows l (``cost_model.boundary_send_s``)

Per pipeline rank ``r`` (layers of every virtual stage on ``r``), with ``m``
micro-batches, ``v`` virtual stages and ``f_r = pipeline.in_flight(r)``:

    T_r   = Σ t_l + Σ_{l: boundary after l} P_l        tail_r = Σ tail_l
    M_r   = forward/backward peak (``memory.step_peak_bytes``): pp = 1, the timeline of the layers in
            order; pp > 1, the order-free bound Σ S_l + max(max G_l, (2 + prefetch)·max H_l) + f_r·Σ A_l,
            ≥ ``predict``'s schedule timeline (the search is conservative for pipelines), + m·Σ Q_l
            over the boundaries r's stages cross, each way (Q_l = ``boundary_bytes``: receive buffers)
    B_r   = Σ R_l + max_{l on r} X_l                                   (build peak; ``memory.build_peak_bytes``)
    O_r   = Σ O_l + max(max_{l on r} Y_l, [Σ N_l ≤ bucket] · Σ_{l on r} K_l)
                                                        (optimizer step; ``memory.optimizer_step_peak_bytes``)
    peak_r = max(M_r, O_r, B_r)
    step  = max_r [ (m + (p − 1)/v) · max_r' T_r' + tail_r ]

exactly ``cost_model.predict`` (stage-boundary send/recv, the per-rank buffer
maximum, and checkpoint regions included), so the solver's objective and
``predict`` agree to rounding; so does memory on one stage (on several, M_r is an upper bound).

Checkpoint regions: a layer under full recompute whose predecessor is in the
same block and also under full recompute keeps no input (``A'_l = 0`` for the
real cost model, ``search/memory.py``); ``Option.chain_activation_bytes``
holds that value (equal to ``A_l`` for other cost functions, which know
nothing of regions), and ``chain_flags(graph)`` marks the layers that
continue their block.

Layers outside any block (embedding, final norm, heads) ride with the nearest
block before them (the first block for those before every block): that is
the block whose stage they share.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from autoshard.cluster import Cluster
from autoshard.graph import LayerInfo, ModelGraph
from autoshard.plan import LayerStrategy, Mesh, Predictions, Schedule
from autoshard.search import cost_model
from autoshard.search.cost_model import LayerCost
from autoshard.search.memory import LayerLive, live_buffers, rank_bucket_bytes, step_peak_bytes
from autoshard.search.pipeline import in_flight, virtual_stages
from autoshard.search.space import strategy_key
from autoshard.train import TrainSpec

CostFn = Callable[[LayerInfo, LayerStrategy, Mesh, Cluster, TrainSpec, Schedule], LayerCost]


@dataclass(frozen=True)
class Option:
    """One admissible strategy of a solver class with the numbers the objective reads."""

    strategy: LayerStrategy
    cost: LayerCost
    chain_activation_bytes: float | None = None  # A' (module docstring); None: same as activation_bytes
    p2p_s: float = 0.0  # per micro-batch: send/recv of the output when a stage boundary follows
    boundary_bytes: float = 0.0  # one micro-batch's receive buffer on each side of a boundary that follows

    @property
    def time_s(self) -> float:
        return self.cost.fwd_s + self.cost.bwd_s

    @property
    def tail_s(self) -> float:
        return self.cost.comm_exposed_s + self.cost.optimizer_s

    @property
    def static_bytes(self) -> float:
        mem = self.cost.memory
        return mem.params + mem.grads + mem.optimizer

    @property
    def buffer_bytes(self) -> float:
        return self.cost.memory.buffers

    @property
    def gathered_bytes(self) -> float:
        return self.cost.memory.gathered

    def static_floor(self, grads_apart: bool) -> float:
        """What of ``static_bytes`` a memory lower bound may add to the activations: all of it, or
        without the gradients when they are not live beside the activations (one micro-batch on one
        stage, ``memory.step_peak_bytes`` ≥ ``S − Gr + A``)."""
        return self.static_bytes - self.cost.memory.grads if grads_apart else self.static_bytes

    @property
    def build_resident_bytes(self) -> float:
        """R: params + optimizer on the device (what the build leaves resident)."""
        return self.cost.memory.build_resident

    @property
    def build_transient_bytes(self) -> float:
        """X: the largest parameter region being built, read + fp32 copy."""
        return self.cost.memory.build_transient

    @property
    def optimizer_step_bytes(self) -> float:
        """O: params + grads + optimizer + the fp32 gradients the optimizer step holds."""
        return self.cost.memory.optimizer_step_resident

    @property
    def step_transient_bytes(self) -> float:
        """Y: copies of the gradient bucket being packed in the optimizer step."""
        return self.cost.memory.step_transient

    @property
    def activation_bytes(self) -> float:
        return self.cost.memory.activations

    @property
    def chain_bytes(self) -> float:
        """Activation bytes when this layer continues a checkpoint region (A')."""
        return self.activation_bytes if self.chain_activation_bytes is None else self.chain_activation_bytes

    @property
    def full_recompute(self) -> bool:
        return self.strategy.recompute == "full"

    def vector(self, build: bool = True) -> tuple[float, ...]:
        """The numbers the objective and the memory rows read (``build``: the build rows' too)."""
        step = (self.time_s, self.tail_s, self.static_bytes, self.buffer_bytes, self.activation_bytes,
                self.chain_bytes, self.p2p_s, self.optimizer_step_bytes, self.step_transient_bytes,
                self.gathered_bytes, self.boundary_bytes)
        build_numbers = (self.build_resident_bytes, self.build_transient_bytes) if build else ()
        return step + build_numbers + (float(self.full_recompute),)


@dataclass(frozen=True)
class Evaluation:
    """Aggregated cost of one full assignment (module docstring)."""

    step_s: float
    rank_time_s: tuple[float, ...]  # T_r, per micro-batch
    rank_tail_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]  # max(M_r, O_r, B_r): the rank's peak, step, optimizer step or build
    bubble_s: float
    compute_s: float  # m · max T_r
    critical_rank: int
    rank_build_bytes: tuple[float, ...] = ()  # B_r

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)


def prune_dominated(options: Sequence[Option], *, build: bool = True) -> list[Option]:
    """Drop options that another option of the same ``sp`` beats or ties on every number it reads.

    ``o`` is dropped when some ``o'`` has every number of ``Option.vector`` ≤
    and either one number < or (all equal) comes first in the canonical
    order. The objective and the memory rows are monotone in these numbers, so
    no optimum is lost; ``sp`` is kept apart because it is coupled across
    classes, and full recompute only dominates full recompute (a successor's
    checkpoint region depends on it: the last entry of the vector). ``build=False`` leaves the build
    rows' numbers out: the pruning of a model without them (the solver's relaxation).
    """
    if len(options) <= 1:
        return list(options)
    values = np.array([o.vector(build) for o in options])  # (n, 11 or 13)
    sps = np.array([(o.strategy.sp, o.full_recompute) for o in options])  # (n, 2)
    le = (values[:, None, :] <= values[None, :, :]).all(axis=2)  # le[j, i]: j ≤ i everywhere
    lt = (values[:, None, :] < values[None, :, :]).any(axis=2)
    earlier = np.arange(len(options))[:, None] < np.arange(len(options))[None, :]
    same_sp = (sps[:, None, :] == sps[None, :, :]).all(axis=2)
    dominated = (same_sp & le & (lt | earlier)).any(axis=0)
    return [o for o, d in zip(options, dominated) if not d]


def anchor_blocks(graph: ModelGraph) -> list[int]:
    """Per layer, the index (0..B−1) of the block whose stage it shares (module docstring)."""
    block_ids = sorted({layer.block for layer in graph.layers if layer.block is not None})
    position = {b: i for i, b in enumerate(block_ids)}
    out, current = [], None
    for layer in graph.layers:
        if layer.block is not None:
            current = position[layer.block]
        out.append(current)
    first = next((a for a in out if a is not None), 0)
    return [first if a is None else a for a in out]


def num_anchor_blocks(graph: ModelGraph) -> int:
    return max(anchor_blocks(graph)) + 1


def interleaved_block_stages(num_blocks: int, pp: int, v: int) -> list[int]:
    """Virtual stage per block for interleaving: p·v equal chunks in order."""
    per_chunk = num_blocks // (pp * v)
    return [b // per_chunk for b in range(num_blocks)]


def layer_stages(graph: ModelGraph, block_stage: Sequence[int]) -> list[int]:
    """Per-layer (virtual) stage from the per-block stage."""
    return [block_stage[a] for a in anchor_blocks(graph)]


def rank_of(stage: int, pp: int, schedule: Schedule) -> int:
    return stage % pp if virtual_stages(schedule) > 1 else stage


def chain_flags(graph: ModelGraph) -> list[bool]:
    """Per layer, whether it follows a layer of its own block (it may continue a checkpoint region)."""
    layers = graph.layers
    return [i > 0 and layer.block is not None and layer.block == layers[i - 1].block for i, layer in enumerate(layers)]


def layer_activation_bytes(layer_options: Sequence[Option], continues: Sequence[bool] | None) -> list[float]:
    """A_l or A'_l per layer (module docstring: checkpoint regions)."""
    out = []
    for i, option in enumerate(layer_options):
        chained = (continues is not None and continues[i] and option.full_recompute
                   and layer_options[i - 1].full_recompute)
        out.append(option.chain_bytes if chained else option.activation_bytes)
    return out


def evaluate(layer_options: Sequence[Option], stages: Sequence[int], mesh: Mesh, schedule: Schedule,
             continues: Sequence[bool] | None = None) -> Evaluation:
    """Aggregate per-layer options placed on ``stages`` (module docstring formulas).

    ``continues``: ``chain_flags(graph)``, or None to price every layer as its own checkpoint region.
    """
    pp = mesh.pp
    t, tail, static, resident, transient, opt, opt_transient, bucketed, members = ([0.0] * pp for _ in range(9))
    acts = layer_activation_bytes(layer_options, continues)
    ranks = [rank_of(stage, pp, schedule) for stage in stages]
    receive = [0.0] * pp  # m receive buffers per boundary a rank's stages cross, each way, + kept outputs (cost_model)
    for i, (option, r) in enumerate(zip(layer_options, ranks)):
        t[r] += option.time_s
        if i + 1 < len(stages) and stages[i + 1] != stages[i]:
            t[r] += option.p2p_s
            receive[r] += (schedule.num_micro_batches + in_flight(schedule, pp, r)) * option.boundary_bytes
            receive[ranks[i + 1]] += schedule.num_micro_batches * option.boundary_bytes
        tail[r] += option.tail_s
        static[r] += option.static_bytes
        resident[r] += option.build_resident_bytes
        transient[r] = max(transient[r], option.build_transient_bytes)
        opt[r] += option.optimizer_step_bytes
        opt_transient[r] = max(opt_transient[r], option.step_transient_bytes)
        bucketed[r] += option.cost.memory.step_bucketed
        members[r] += option.cost.memory.step_bucket_members
    build = tuple(resident[r] + transient[r] for r in range(pp))  # memory.build_peak_bytes, from the sums
    live = [[] for _ in range(pp)]
    for option, a, r in zip(layer_options, acts, ranks):
        live[r].append(LayerLive(a, option.cost.memory.grads, option.buffer_bytes, option.gathered_bytes))
    memory = tuple(max(step_peak_bytes(static[r], live[r], schedule.prefetch, in_flight(schedule, pp, r),
                                       schedule.num_micro_batches, order_free=pp > 1) + receive[r],
                       opt[r] + max(opt_transient[r], rank_bucket_bytes(bucketed[r], members[r], schedule.bucket_bytes)),
                       build[r]) for r in range(pp))
    t_max = max(t)
    slots = schedule.num_micro_batches + (pp - 1) / virtual_stages(schedule)
    per_rank = [slots * t_max + tail[r] for r in range(pp)]
    critical = int(np.argmax(per_rank))
    return Evaluation(
        step_s=per_rank[critical], rank_time_s=tuple(t), rank_tail_s=tuple(tail), rank_memory_bytes=memory,
        bubble_s=(pp - 1) / virtual_stages(schedule) * t_max, compute_s=schedule.num_micro_batches * t_max,
        critical_rank=critical, rank_build_bytes=build,
    )


def fallback_predictions(graph: ModelGraph, layer_options: Sequence[Option], stages: Sequence[int], mesh: Mesh,
                         schedule: Schedule, cluster: Cluster, train: TrainSpec) -> Predictions:
    """``Predictions`` from ``evaluate`` (used while ``cost_model.predict`` is unavailable)."""
    continues = chain_flags(graph)
    ev = evaluate(layer_options, stages, mesh, schedule, continues)
    acts = layer_activation_bytes(layer_options, continues)
    r = ev.critical_rank
    breakdown: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "buffers": 0,
                                 "build_transient": 0, "step_grads": 0, "step_transient": 0}
    peak_rank = int(np.argmax(ev.rank_memory_bytes))
    mine = [(o, a) for o, a, stage in zip(layer_options, acts, stages) if rank_of(stage, mesh.pp, schedule) == peak_rank]
    for option, act in mine:
        mem = option.cost.memory
        for key in ("params", "grads", "optimizer", "step_grads"):
            breakdown[key] += int(getattr(mem, key))
        breakdown["activations"] += int(in_flight(schedule, mesh.pp, peak_rank) * act)
    breakdown["buffers"] = int(live_buffers(max((o.buffer_bytes for o, _ in mine), default=0.0),
                                            max((o.gathered_bytes for o, _ in mine), default=0.0), schedule.prefetch))
    breakdown["build_transient"] = int(max((o.build_transient_bytes for o, _ in mine), default=0.0))
    breakdown["step_transient"] = int(max((o.step_transient_bytes for o, _ in mine), default=0.0))
    exposed = sum(o.cost.comm_exposed_s for o, s in zip(layer_options, stages) if rank_of(s, mesh.pp, schedule) == r)
    optimizer = sum(o.cost.optimizer_s for o, s in zip(layer_options, stages) if rank_of(s, mesh.pp, schedule) == r)
    tokens = train.global_batch * train.seq_len
    flops = 3.0 * sum(layer.forward_flops(train.global_batch, train.seq_len) for layer in graph.layers)
    peak = cluster.device.peak_flops.get(train.precision, 0.0) * cluster.world_size
    return Predictions(
        step_time_s=ev.step_s, compute_s=ev.compute_s, exposed_comm_s=exposed, bubble_s=ev.bubble_s,
        optimizer_s=optimizer, peak_memory_bytes=int(math.ceil(ev.peak_memory_bytes)),
        memory_by_stage=tuple(int(math.ceil(m)) for m in ev.rank_memory_bytes), memory_breakdown=breakdown,
        tokens_per_s=tokens / ev.step_s if ev.step_s > 0 else 0.0,
        mfu=flops / (ev.step_s * peak) if ev.step_s > 0 and peak > 0 else 0.0,
        build_peak_bytes=int(math.ceil(max(ev.rank_build_bytes))),
    )


class CostTable:
    """Memoised cost-function calls for one solve: (layer class, strategy, mesh, schedule) → ``Option``.

    Layers of one class have identical structure, so the class representative
    is costed once and the result reused for every member. With the real cost
    model (``cost_model.layer_cost``) options also carry the checkpoint-region
    activation ``A'`` (0 under full recompute, ``search/memory.py``) and the
    stage-boundary send/recv ``P`` (``cost_model.boundary_send_s``); other cost
    functions price neither.

    Sharing across schedules: the real cost model reads only ``micro_batch``,
    ``num_micro_batches`` and ``bucket_bytes`` of the schedule (``layer_terms``: tokens per
    micro-batch, gathers/reductions per step, the optimizer step's packed bucket), so its
    entries are keyed by those three and reused by every pipeline schedule (1F1B, GPipe,
    interleaved with any ``v``) of the same mesh and micro-batch; ``tests/test_cost_model.py``
    checks that premise. Other cost functions are keyed by the whole schedule.
    """

    def __init__(self, cost_fn: CostFn, cluster: Cluster, train: TrainSpec) -> None:
        self.cost_fn = cost_fn
        self.cluster = cluster
        self.train = train
        self.real = cost_fn is cost_model.layer_cost
        self._cache: dict[tuple, Option] = {}
        self.calls = 0

    def option(self, layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, schedule: Schedule) -> Option:
        return self.options(layer, (strategy,), mesh, schedule)[0]

    def options(self, layer: LayerInfo, strategies: Sequence[LayerStrategy], mesh: Mesh,
                schedule: Schedule) -> list[Option]:
        sched_key = self.schedule_key(schedule)
        keys = [(layer.class_id, strategy_key(s), mesh, sched_key) for s in strategies]
        missing = [s for s, key in zip(strategies, keys) if key not in self._cache]
        if missing:
            self._fill(layer, missing, mesh, schedule)
        out = []
        for s, key in zip(strategies, keys):
            option = self._cache[key]
            out.append(option if option.strategy == s else dataclasses.replace(option, strategy=s))
        return out

    def schedule_key(self, schedule: Schedule) -> tuple | Schedule:
        """The part of ``schedule`` the cost function reads (class docstring)."""
        return (schedule.micro_batch, schedule.num_micro_batches, schedule.bucket_bytes) if self.real else schedule

    def _fill(self, layer: LayerInfo, strategies: Sequence[LayerStrategy], mesh: Mesh, schedule: Schedule) -> None:
        self.calls += len(strategies)
        sched_key = self.schedule_key(schedule)
        if not self.real:
            for s in strategies:
                cost = self.cost_fn(layer, s, mesh, self.cluster, self.train, schedule)
                self._cache[(layer.class_id, strategy_key(s), mesh, sched_key)] = Option(s, cost)
            return
        costs = cost_model.layer_cost_table(layer, strategies, mesh, self.cluster, self.train, schedule)
        p2p = {sp: cost_model.boundary_send_s(layer, sp, mesh, self.cluster, schedule, self.train)
               for sp in {s.sp for s in strategies}}
        receive = {sp: cost_model.boundary_buffer_bytes(layer, sp, mesh, schedule, self.train)
                   for sp in {s.sp for s in strategies}}
        for s, cost in zip(strategies, costs):
            chain = 0.0 if s.recompute == "full" else None
            self._cache[(layer.class_id, strategy_key(s), mesh, sched_key)] = Option(s, cost, chain, p2p[s.sp],
                                                                                     receive[s.sp])
