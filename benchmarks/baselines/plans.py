"""Which autoshard plans the benchmark measures: the search's best, or the best plus forced alternatives.

``--plans best``: one ``solve`` under ``autoshard_trainer.plan_constraints``
(pp = cp = ep = 1, no recompute, no SP, uncompressed communication: the
plan family measured since the first GPU runs).

``--plans forced``: the best plan, then one ``solve`` per entry of
``variants(world)``, each fixing part of the answer (a ``Constraints`` pin on
every layer class and/or fixed mesh degrees, a pipeline schedule, a micro-batch)
so the cost model is tested away from its own optimum — predicted-vs-measured
needs plans it did not choose. Order = what a truncated run (``--max-plans``)
should keep first, the most informative contrasts first:

    ====  =========================  ==========================================================
     #    variant                    pins (every layer class unless noted) / mesh / schedule
    ====  =========================  ==========================================================
     1    free                       the search's best over everything the runtime executes
                                     (cp = 1; pp = 1 when the model ties a parameter across layers)
     2    replicate (DDP)            state=replicate, tp = pp = 1
     3    zero3                      state=zero3, tp = pp = 1
     4    tp2                        tp = 2, pp = 1, no SP
     5    pp2-1f1b                   pp = 2, tp = 1, schedule 1f1b
     6    zero3-int8w                state=zero3, weight_comm=int8
     7    zero2-int8g                state=zero2, grad_comm=int8
     8    zero3-selective            state=zero3, recompute=selective on attention classes
     9    full-recompute             recompute=full, tp = pp = 1 (state searched)
    10    tp2-sp                     tp = 2, sp=True
    11    pp2-interleaved            pp = 2, schedule interleaved_1f1b
    12    zero1, zero2               state pinned, tp = pp = 1
    13    replicate-mbH, zero3-mbH   half the per-rank batch per micro-batch (two micro-batches)
    14    rep2 (HSDP), tp4, tp2-zero3, world ≥ 4 only
          tp4-sp
    15    pp2-gpipe, zero3-int4g, zero3-fp8w, offload
    ====  =========================  ==========================================================

Model mesh pins (``hf_zoo.mesh_pins``): the Hugging Face zoo is planned with tp = 1 (the
runtime's TP rewrite does not cover its layers; ``benchmarks/hf_zoo.py`` says why), in the best
plan, the free search and every variant; a variant fixing tp > 1 is skipped for it.

Fields a variant does not pin keep ``runtime_pin``'s defaults (no recompute,
no SP, uncompressed communication) and pp = cp = ep = 1 unless the variant
frees or fixes them. Variants the solver refuses (infeasible, indivisible:
``tp2`` on GPT's 50257-token vocabulary, ``pp2-interleaved`` with fewer than
4 blocks) and plans the runtime refuses before running (``runtime_refusal``:
a parameter used on two pp ranks, SP inside a pipeline) are skipped; plans are
de-duplicated by every decision (``decision_key``) and capped at ``max_plans``.

``--variants NAMES`` (``search_plans(..., only=NAMES)``): the best plan plus only the named
variants, in the order given (``free`` and the table's names; ``replicate-mbH`` and
``zero3-mbH`` as written here): e.g. ``tp4,tp4-sp`` adds autoshard's TP plans over the whole
world next to the Megatron-Core rows without the cost of a full forced sweep.
Rank 0 searches and broadcasts the plans as JSON, so every rank runs the same
plans even when a search hits its time limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.graph import ModelGraph
from autoshard.plan import Plan
from benchmarks.baselines.autoshard_trainer import plan_constraints, train_spec
from benchmarks.baselines.common import RunSpec
from benchmarks.hf_zoo import mesh_pins

log = logging.getLogger(__name__)

MODES = ("best", "forced")
SOLVE_TIME_LIMIT_S = 30.0
DP_ONLY = {"tp": 1, "pp": 1}
PARAM_FIELDS = ("state", "weight_comm", "grad_comm")  # pinned only on classes that own parameters


@dataclass(frozen=True)
class NamedPlan:
    """A plan and the config name it is reported under (``autoshard`` for the search's best)."""

    name: str
    plan: Plan


@dataclass(frozen=True)
class Variant:
    """One forced alternative: what ``solve`` is told to fix (module docstring, the table).

    pin: fields for every layer class; attention_pin: extra fields for attention classes only
    (selective recompute exists only where there is an attention core); mesh: fixed degrees
    on top of ``RUNTIME_MESH``; half_micro: micro-batch = half the per-rank batch.
    """

    name: str
    pin: Mapping[str, Any] = field(default_factory=dict)
    mesh: Mapping[str, int] = field(default_factory=dict)
    attention_pin: Mapping[str, Any] = field(default_factory=dict)
    schedule: str | None = None
    half_micro: bool = False
    min_world: int = 2


def variants(world: int) -> list[Variant]:
    """The forced variants admissible at ``world`` ranks, most informative first (module docstring)."""
    zero3, tp2, pp2 = {"state": "zero3"}, {"tp": 2, "pp": 1}, {"pp": 2, "tp": 1}
    table = [
        Variant("replicate", {"state": "replicate"}, DP_ONLY, min_world=1),
        Variant("zero3", zero3, DP_ONLY),
        Variant("tp2", {}, tp2),
        Variant("pp2-1f1b", {}, pp2, schedule="1f1b"),
        Variant("zero3-int8w", {**zero3, "weight_comm": "int8"}, DP_ONLY),
        Variant("zero2-int8g", {"state": "zero2", "grad_comm": "int8"}, DP_ONLY),
        Variant("zero3-selective", zero3, DP_ONLY, attention_pin={"recompute": "selective"}),
        Variant("full-recompute", {"recompute": "full"}, DP_ONLY, min_world=1),
        Variant("tp2-sp", {"sp": True}, tp2),
        Variant("pp2-interleaved", {}, pp2, schedule="interleaved_1f1b"),
        Variant("zero1", {"state": "zero1"}, DP_ONLY),
        Variant("zero2", {"state": "zero2"}, DP_ONLY),
        Variant("replicate-mbH", {"state": "replicate"}, DP_ONLY, half_micro=True, min_world=1),
        Variant("zero3-mbH", zero3, DP_ONLY, half_micro=True),
        Variant("zero3-rep2", zero3, {**DP_ONLY, "dp_replicate": 2}, min_world=4),
        Variant("tp4", {}, {"tp": 4, "pp": 1}, min_world=4),
        Variant("tp2-zero3", zero3, tp2, min_world=4),
        Variant("tp4-sp", {"sp": True}, {"tp": 4, "pp": 1}, min_world=4),
        Variant("pp2-gpipe", {}, pp2, schedule="gpipe"),
        Variant("zero3-int4g", {**zero3, "grad_comm": "int4"}, DP_ONLY),
        Variant("zero3-fp8w", {**zero3, "weight_comm": "fp8"}, DP_ONLY),
        Variant("offload", {"state": "offload"}, DP_ONLY, min_world=1),
    ]
    return [v for v in table if world >= v.min_world and world % max(v.mesh.get("tp", 1), v.mesh.get("pp", 1)) == 0]


def decision_key(plan: Plan) -> tuple:
    """What makes two plans different runs: mesh, every per-layer field, the schedule."""
    layers = tuple((s.layer, s.state, s.tp, s.sp, s.ep, s.recompute, s.weight_comm, s.grad_comm, s.stage)
                   for s in plan.layers)
    sched = plan.schedule
    return (plan.mesh, layers, sched.name, sched.micro_batch, sched.num_micro_batches, sched.virtual_stages)


def runtime_refusal(plan: Plan, graph: ModelGraph) -> str | None:
    """Why the runtime would refuse ``plan`` (docs/runtime.md, "Partial"), or ``None`` when it runs it.

    Checked here so a forced run does not spend a row on a known refusal: a
    parameter used on two pp ranks (GPT's tied embedding/head: ``tied_params``
    names the alias, not the owner, so any tie with pp > 1 is refused), SP
    inside a pipeline (boundary shapes come from the export's global shapes)
    and expert-parallel layers that are not ``replicate``.
    """
    if any(s.ep and s.state != "replicate" for s in plan.layers):
        return "expert parallelism on a layer whose state is not 'replicate'"
    if plan.mesh.pp == 1:
        return None
    if any(s.sp for s in plan.layers):
        return "sequence parallelism inside a pipeline (pp > 1)"
    if _has_tied(graph):
        return "a parameter tied across layers (embedding/head) with pp > 1: it would span pp ranks"
    return None


def _has_tied(graph: ModelGraph) -> bool:
    return any(layer.tied_params for layer in graph.layers)


def _constraints(graph: ModelGraph, spec: RunSpec, variant: Variant):
    from autoshard.search import Constraints

    base = plan_constraints(graph, spec.precision, mesh={**variant.mesh, **mesh_pins(spec.model)}, **variant.pin)
    with_params = {layer.class_id for layer in graph.layers if layer.params}
    pin = {}
    for cid, fields in base.pin.items():
        if cid not in with_params:  # no parameters (GPT's tied head): replicate, uncompressed, by definition
            fields = {k: v for k, v in fields.items() if k not in PARAM_FIELDS}
        pin[cid] = {**fields, **(variant.attention_pin if cid.startswith("attention:") else {})}
    return Constraints(mesh=base.mesh, pin=pin, schedule=variant.schedule)


def _free_constraints(graph: ModelGraph, spec: RunSpec):
    """Only what the runtime cannot run at all: cp > 1; pp > 1 when a parameter is tied across layers;
    the model's mesh pins (tp = 1 for the Hugging Face zoo)."""
    from autoshard.search import Constraints

    return Constraints(mesh={"cp": 1, **({"pp": 1} if _has_tied(graph) else {}), **mesh_pins(spec.model)})


def _solve(graph: ModelGraph, cluster: Cluster, spec: RunSpec, constraints, micro_batch: int | None = None,
           label: str = "best") -> Plan | None:
    from autoshard.search import solve

    try:
        plan = solve(graph, cluster, train_spec(spec, micro_batch=micro_batch), constraints=constraints,
                     time_limit_s=SOLVE_TIME_LIMIT_S)
    except AutoshardError as err:  # infeasible or contradictory variant: not a plan to measure
        log.info("variant %s skipped: %s", label, err)
        return None
    refusal = runtime_refusal(plan, graph)
    if refusal:
        log.info("variant %s skipped: the runtime refuses %s", label, refusal)
        return None
    return plan


def _half_micro(spec: RunSpec, world: int) -> int | None:
    per_rank = spec.global_batch // world
    return per_rank // 2 if per_rank >= 2 and per_rank % 2 == 0 else None


def _selected(world: int, only: Sequence[str] | None) -> tuple[bool, list[Variant]]:
    """(whether ``free`` is wanted, the variants to solve in order): all, or ``only``'s names."""
    table = variants(world)
    if only is None:
        return True, table
    by_name = {v.name: v for v in table}
    unknown = [n for n in only if n != "free" and n not in by_name]
    if unknown:
        raise AutoshardError(f"--variants {unknown}: allowed at world {world}: {['free', *by_name]}")
    return "free" in only, [by_name[n] for n in only if n != "free"]


def _forced(graph: ModelGraph, cluster: Cluster, spec: RunSpec, world: int, only: Sequence[str] | None = None):
    """``(name, plan or None)`` per forced variant (all, or ``only``), lazily (each is one search)."""
    free, selected = _selected(world, only)
    if free:
        yield "autoshard-free", _solve(graph, cluster, spec, _free_constraints(graph, spec), label="free")
    pins = mesh_pins(spec.model)
    for variant in selected:
        if any(variant.mesh.get(axis, value) != value for axis, value in pins.items()):
            log.info("variant %s skipped: %s is planned with %s", variant.name, spec.model, pins)
            continue
        micro = _half_micro(spec, world) if variant.half_micro else None
        if variant.half_micro and micro is None:
            continue
        name = "autoshard-" + variant.name.replace("mbH", f"mb{micro}")
        yield name, _solve(graph, cluster, spec, _constraints(graph, spec, variant), micro, label=variant.name)


def search_plans(graph: ModelGraph, cluster: Cluster, spec: RunSpec, mode: str, *, max_plans: int = 12,
                 world: int = 1, only: Sequence[str] | None = None) -> list[NamedPlan]:
    """The plans of ``mode`` (module docstring), best first; raises when even the best cannot be found.

    ``only``: with ``mode="forced"``, the named variants instead of the whole table.
    """
    if mode not in MODES:
        raise AutoshardError(f"--plans {mode!r}: allowed {MODES}")
    if max_plans < 1:
        raise AutoshardError(f"--max-plans {max_plans}: allowed >= 1; the best plan alone is --max-plans 1")
    best = _solve(graph, cluster, spec, plan_constraints(graph, spec.precision, mesh=mesh_pins(spec.model)))
    if best is None:
        raise AutoshardError(
            f"no runnable plan for {spec.model} at batch {spec.global_batch} x seq {spec.seq_len} on {cluster.name}; "
            "lower --batch or --seq, or use a smaller model"
        )
    plans, seen = [NamedPlan("autoshard", best)], {decision_key(best)}
    if mode == "best":
        return plans
    for name, plan in _forced(graph, cluster, spec, world, only):
        if len(plans) >= max_plans:
            break
        if plan is not None and decision_key(plan) not in seen:
            seen.add(decision_key(plan))
            plans.append(NamedPlan(name, plan))
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


__all__ = ["MODES", "NamedPlan", "Variant", "broadcast_plans", "decision_key", "runtime_refusal", "search_plans",
           "variants"]
