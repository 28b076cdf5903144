"""Which autoshard plans the benchmark measures: the search's best, or the best plus forced alternatives.

``--plans best``: one ``solve`` under ``autoshard_trainer.plan_constraints``
(what the runtime executes today).

``--plans forced``: the best plan, then one ``solve`` per forced variant,
each fixing part of the answer so the cost model is tested away from its own
optimum (predicted-vs-measured needs plans it did not choose):

    state  ∈ {replicate, zero1, zero2, zero3, offload}      (pinned on every layer class)
    mesh   ∈ {dp only; tp = t for each t > 1 dividing the world (one node); HSDP dp_replicate=2}
    micro  ∈ {one micro-batch per rank; two}                 (TrainSpec.micro_batch)

Variants the solver refuses (infeasible, indivisible) are skipped; plans are
de-duplicated by their decisions (mesh, per-layer state and tp, micro-batching)
and capped at ``max_plans``. Rank 0 searches and broadcasts the plans as JSON,
so every rank runs the same plans even when a search hits its time limit.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch.distributed as dist

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.graph import ModelGraph
from autoshard.plan import Plan
from benchmarks.baselines.autoshard_trainer import plan_constraints, train_spec
from benchmarks.baselines.common import RunSpec

log = logging.getLogger(__name__)

STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
MODES = ("best", "forced")
SOLVE_TIME_LIMIT_S = 30.0


@dataclass(frozen=True)
class NamedPlan:
    """A plan and the config name it is reported under (``autoshard`` for the search's best)."""

    name: str
    plan: Plan


def decision_key(plan: Plan) -> tuple:
    """What makes two plans different runs: mesh, per-layer state/tp, micro-batching."""
    layers = tuple((s.layer, s.state, s.tp) for s in plan.layers)
    return (plan.mesh, layers, plan.schedule.micro_batch, plan.schedule.num_micro_batches)


def _meshes(world: int, devices_per_node: int) -> list[dict[str, int]]:
    meshes = [{"tp": 1, "dp_replicate": 1}]
    meshes += [{"tp": t} for t in range(2, min(world, devices_per_node) + 1) if world % t == 0]
    if world >= 4 and world % 2 == 0:
        meshes.append({"tp": 1, "dp_replicate": 2})
    return meshes


def _micro_batches(spec: RunSpec, world: int) -> list[int | None]:
    per_rank = spec.global_batch // world
    return [None] + ([per_rank // 2] if per_rank >= 2 and per_rank % 2 == 0 else [])


def _solve(graph: ModelGraph, cluster: Cluster, spec: RunSpec, *, micro_batch: int | None = None,
           mesh: dict[str, int] | None = None, **pin) -> Plan | None:
    from autoshard.search import solve

    constraints = plan_constraints(graph, spec.precision, mesh=mesh, **pin)
    try:
        return solve(graph, cluster, train_spec(spec, micro_batch=micro_batch), constraints=constraints,
                     time_limit_s=SOLVE_TIME_LIMIT_S)
    except AutoshardError as err:  # infeasible or contradictory variant: not a plan to measure
        log.info("variant mesh=%s micro_batch=%s pin=%s skipped: %s", mesh, micro_batch, pin, err)
        return None


def search_plans(graph: ModelGraph, cluster: Cluster, spec: RunSpec, mode: str, *, max_plans: int = 12,
                 world: int = 1) -> list[NamedPlan]:
    """The plans of ``mode`` (module docstring), best first; raises when even the best cannot be found."""
    if mode not in MODES:
        raise AutoshardError(f"--plans {mode!r}: allowed {MODES}")
    best = _solve(graph, cluster, spec)
    if best is None:
        raise AutoshardError(
            f"no runnable plan for {spec.model} at batch {spec.global_batch} x seq {spec.seq_len} on {cluster.name}; "
            "lower --batch or --seq, or use a smaller model"
        )
    plans, seen = [NamedPlan("autoshard", best)], {decision_key(best)}
    if mode == "best":
        return plans
    variants = itertools.product(STATES, _meshes(world, cluster.devices_per_node), _micro_batches(spec, world))
    for state, mesh, micro in variants:
        if len(plans) >= max_plans:
            break
        plan = _solve(graph, cluster, spec, micro_batch=micro, mesh=mesh, state=state)
        if plan is not None and decision_key(plan) not in seen:
            seen.add(decision_key(plan))
            tag = "".join(f"-{axis.replace('dp_replicate', 'rep')}{degree}" for axis, degree in mesh.items() if degree > 1)
            plans.append(NamedPlan(f"autoshard-{state}{tag}" + (f"-mb{micro}" if micro else ""), plan))
    return plans


def broadcast_plans(plans: list[NamedPlan] | AutoshardError | None) -> list[NamedPlan]:
    """Rank 0's plans on every rank, as JSON (other ranks pass ``None``).

    Rank 0 passes the ``AutoshardError`` its search raised instead: every rank
    then raises it, rather than waiting for plans that never come.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        if isinstance(plans, list):
            payload: list = [[(p.name, p.plan.to_json()) for p in plans]]
        else:
            payload = [None if plans is None else str(plans)]
        dist.broadcast_object_list(payload, src=0)
        if isinstance(payload[0], str):
            raise AutoshardError(payload[0])
        return [NamedPlan(name, Plan.from_json(text)) for name, text in payload[0]]
    if isinstance(plans, AutoshardError):
        raise plans
    assert plans is not None
    return plans


__all__ = ["MODES", "NamedPlan", "broadcast_plans", "decision_key", "search_plans"]
