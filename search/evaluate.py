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
    G_l    = buffers                             bytes, gather buffer of the layer
    A_l    = activations                         bytes, one micro-batch

Per pipeline rank ``r`` (layers of every virtual stage on ``r``), with ``m``
micro-batches, ``v`` virtual stages and ``f_r = pipeline.in_flight(r)``:

    T_r   = Σ t_l        tail_r = Σ tail_l
    M_r   = Σ S_l + (1 + prefetch) · max_l G_l + f_r · Σ A_l
    step  = max_r [ (m + (p − 1)/v) · max_r' T_r' + tail_r ]

matching ``cost_model.predict`` (which adds the stage-boundary send/recv and
takes the buffer maximum per rank; the maximum here runs over all layers, a
conservative simplification that keeps the CP-SAT row linear).

Layers outside any block (embedding, final norm, heads) ride with the nearest
block before them (the first block for those before every block): that is
the block whose stage they share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from autoshard.cluster import Cluster
from autoshard.graph import LayerInfo, ModelGraph
from autoshard.plan import LayerStrategy, Mesh, Predictions, Schedule
from autoshard.search.cost_model import LayerCost
from autoshard.search.pipeline import in_flight, virtual_stages
from autoshard.search.space import strategy_key
from autoshard.train import TrainSpec

CostFn = Callable[[LayerInfo, LayerStrategy, Mesh, Cluster, TrainSpec, Schedule], LayerCost]


@dataclass(frozen=True)
class Option:
    """One admissible strategy of a solver class with the four numbers the objective reads."""

    strategy: LayerStrategy
    cost: LayerCost

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
    def activation_bytes(self) -> float:
        return self.cost.memory.activations

    def vector(self) -> tuple[float, float, float, float, float]:
        return (self.time_s, self.tail_s, self.static_bytes, self.buffer_bytes, self.activation_bytes)


@dataclass(frozen=True)
class Evaluation:
    """Aggregated cost of one full assignment (module docstring)."""

    step_s: float
    rank_time_s: tuple[float, ...]  # T_r, per micro-batch
    rank_tail_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]  # M_r
    bubble_s: float
    compute_s: float  # m · max T_r
    critical_rank: int

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.rank_memory_bytes)


def prune_dominated(options: Sequence[Option]) -> list[Option]:
    """Drop options that another option of the same ``sp`` beats or ties on all four numbers.

    ``o`` is dropped when some ``o'`` has every number ≤ and either one number
    < or (all equal) comes first in the canonical order. The objective and the
    memory rows are monotone in these numbers, so no optimum is lost; ``sp``
    is kept apart because it is coupled across classes.
    """
    if len(options) <= 1:
        return list(options)
    values = np.array([o.vector() for o in options])  # (n, 4)
    sps = np.array([o.strategy.sp for o in options])
    le = (values[:, None, :] <= values[None, :, :]).all(axis=2)  # le[j, i]: j ≤ i everywhere
    lt = (values[:, None, :] < values[None, :, :]).any(axis=2)
    earlier = np.arange(len(options))[:, None] < np.arange(len(options))[None, :]
    same_sp = sps[:, None] == sps[None, :]
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


def evaluate(layer_options: Sequence[Option], stages: Sequence[int], mesh: Mesh, schedule: Schedule) -> Evaluation:
    """Aggregate per-layer options placed on ``stages`` (module docstring formulas)."""
    pp = mesh.pp
    t, tail, static, act = ([0.0] * pp for _ in range(4))
    buffers = (1 + schedule.prefetch) * max((o.buffer_bytes for o in layer_options), default=0.0)
    for option, stage in zip(layer_options, stages):
        r = rank_of(stage, pp, schedule)
        t[r] += option.time_s
        tail[r] += option.tail_s
        static[r] += option.static_bytes
        act[r] += option.activation_bytes
    memory = tuple(static[r] + buffers + in_flight(schedule, pp, r) * act[r] for r in range(pp))
    t_max = max(t)
    slots = schedule.num_micro_batches + (pp - 1) / virtual_stages(schedule)
    per_rank = [slots * t_max + tail[r] for r in range(pp)]
    critical = int(np.argmax(per_rank))
    return Evaluation(
        step_s=per_rank[critical], rank_time_s=tuple(t), rank_tail_s=tuple(tail), rank_memory_bytes=memory,
        bubble_s=(pp - 1) / virtual_stages(schedule) * t_max, compute_s=schedule.num_micro_batches * t_max,
        critical_rank=critical,
    )


def fallback_predictions(graph: ModelGraph, layer_options: Sequence[Option], stages: Sequence[int], mesh: Mesh,
                         schedule: Schedule, cluster: Cluster, train: TrainSpec) -> Predictions:
    """``Predictions`` from ``evaluate`` (used while ``cost_model.predict`` is unavailable)."""
    ev = evaluate(layer_options, stages, mesh, schedule)
    r = ev.critical_rank
    breakdown: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "buffers": 0}
    peak_rank = int(np.argmax(ev.rank_memory_bytes))
    for option, stage in zip(layer_options, stages):
        if rank_of(stage, mesh.pp, schedule) == peak_rank:
            mem = option.cost.memory
            for key in ("params", "grads", "optimizer", "buffers"):
                breakdown[key] += int(getattr(mem, key))
            breakdown["activations"] += int(in_flight(schedule, mesh.pp, peak_rank) * mem.activations)
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
    )


class CostTable:
    """Memoised cost-function calls for one solve: (layer class, strategy, mesh, schedule) → ``LayerCost``.

    Layers of one class have identical structure, so the class representative
    is costed once and the result reused for every member.
    """

    def __init__(self, cost_fn: CostFn, cluster: Cluster, train: TrainSpec) -> None:
        self.cost_fn = cost_fn
        self.cluster = cluster
        self.train = train
        self._cache: dict[tuple, LayerCost] = {}
        self.calls = 0

    def option(self, layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, schedule: Schedule) -> Option:
        key = (layer.class_id, strategy_key(strategy), mesh, schedule)
        cost = self._cache.get(key)
        if cost is None:
            self.calls += 1
            cost = self.cost_fn(layer, strategy, mesh, self.cluster, self.train, schedule)
            self._cache[key] = cost
        return Option(strategy, cost)

    def options(self, layer: LayerInfo, strategies: Sequence[LayerStrategy], mesh: Mesh,
                schedule: Schedule) -> list[Option]:
        return [self.option(layer, s, mesh, schedule) for s in strategies]

