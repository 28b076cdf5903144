"""Why a plan chose what it chose: ``explain_layer`` ("why not X?") and ``diff_plans``.

``explain_layer`` re-costs one layer's class under every admissible strategy
with everything else in the plan fixed (mesh, schedule, stages, every other
class), using the same aggregation as the solver (``evaluate.evaluate``):
per-rank step time and memory against the same usable memory ``M``. Each
alternative carries why it lost, in words (``_why``): over memory, "needs
81.2 GiB > 74.6 GiB usable"; else the cost terms it made worse, per step on
the rank of the explained layer's stage, largest first ("+14 ms exposed
reduce-scatter on ib", "+3.1 ms recompute"; durations by ``format_duration``:
s, ms, µs or ns with 4 significant digits, so near-ties of tiny models stay
visible). Alternatives keep the plan's ``sp`` (sequence parallelism is one
global choice in the solver, so flipping it for one class is not a plan the
solver could return). The chosen strategy's own terms (``LayerCost.detail``,
the cost model's named terms, and its memory) are shown beside them, only
the non-zero ones, grouped: compute, communication on the critical path,
data-parallel communication, optimizer, memory (``_term_rows``).

``diff_plans`` compares two plans field by field: model and training step,
the recorded cluster, cost-model version, mesh, schedule, each layer's
strategy and every prediction (``memory_by_stage`` and ``memory_breakdown``
entry by entry). ``format_diff`` shows only what differs, predictions with
units and the ratio B/A.

``format_explanation`` / ``format_diff`` return ``rich`` renderables for the CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from autoshard.cluster import Cluster
from autoshard.graph import ModelGraph
from autoshard.plan import MESH_AXES, LayerStrategy, Plan
from autoshard.plan_format import format_bytes, format_seconds
from autoshard.search import comm, cost_model, layer_terms
from autoshard.search.cost_model import LayerCost
from autoshard.search.evaluate import CostFn, CostTable, Evaluation, Option, chain_flags, evaluate
from autoshard.search.solver import usable_memory
from autoshard.search.space import Constraints, admissible_strategies, strategy_key
from autoshard.train import TrainSpec

GiB = 2**30
DECISION_FIELDS = ("state", "tp", "sp", "ep", "recompute", "weight_comm", "grad_comm", "stage")


@dataclass(frozen=True)
class Alternative:
    """One strategy the layer's class could have taken, re-costed with the rest of the plan fixed."""

    strategy: LayerStrategy
    step_s: float
    delta_s: float  # step_s − chosen step_s
    peak_memory_bytes: float
    over_memory_bytes: float  # > 0: exceeds M on its worst stage by this much
    reason: str


@dataclass(frozen=True)
class Explanation:
    """The chosen strategy of ``layer`` and the best alternatives, each with why it lost."""

    layer: str
    class_id: str
    chosen: LayerStrategy
    chosen_cost: LayerCost
    step_s: float
    peak_memory_bytes: float
    usable_memory_bytes: int
    alternatives: tuple[Alternative, ...]
    num_layers_in_class: int
    dp_comm_label: str = "data-parallel comm"  # the chosen strategy's collectives and link, in words


def _plan_options(plan: Plan, graph: ModelGraph, table: CostTable) -> list[Option]:
    by_name = {s.layer: s for s in plan.layers}
    return [table.option(layer, by_name[layer.name], plan.mesh, plan.schedule) for layer in graph.layers]


def format_duration(seconds: float) -> str:
    """``seconds`` with a unit that keeps 4 significant digits: s, ms, µs or ns (near-ties stay visible)."""
    magnitude = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if magnitude >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def explain_layer(plan: Plan, graph: ModelGraph, cluster: Cluster, train: TrainSpec, layer_name: str, *,
                  k: int = 5, cost_fn: CostFn | None = None, constraints: Constraints | None = None) -> Explanation:
    """Explain ``layer_name``'s strategy in ``plan`` against its ``k`` best alternatives (module docstring)."""
    layer = graph.layer(layer_name)
    chosen = plan.strategy(layer_name)
    table = CostTable(cost_fn or cost_model.layer_cost, cluster, train)
    cap = usable_memory(cluster, constraints or Constraints())
    options = _plan_options(plan, graph, table)
    stages = [plan.strategy(l.name).stage for l in graph.layers]
    continues = chain_flags(graph)
    base = evaluate(options, stages, plan.mesh, plan.schedule, continues)
    members = [i for i, l in enumerate(graph.layers)
               if l.class_id == layer.class_id and strategy_key(plan.strategy(l.name)) == strategy_key(chosen)]
    # the explained layer's pp rank: its class members there are what a per-step term delta counts
    on_rank = sum(1 for i in members if stages[i] % plan.mesh.pp == chosen.stage % plan.mesh.pp)
    chosen_cost = options[graph.layers.index(layer)].cost
    alternatives = []
    for strategy in admissible_strategies(layer, plan.mesh, comm_precision=train.comm_precision):
        if strategy.sp != chosen.sp or strategy_key(strategy) == strategy_key(chosen):
            continue
        option = table.option(layer, strategy, plan.mesh, plan.schedule)
        trial = list(options)
        for i in members:
            trial[i] = option
        ev = evaluate(trial, stages, plan.mesh, plan.schedule, continues)
        worst = max(range(plan.mesh.pp), key=lambda r: ev.rank_memory_bytes[r])
        over = ev.rank_memory_bytes[worst] - cap
        terms = _term_deltas(chosen_cost, option.cost, _Labels.of(layer, chosen, strategy, plan, cluster),
                             on_rank, plan.schedule.num_micro_batches)
        alternatives.append(Alternative(
            strategy=dataclasses.replace(strategy, layer=layer_name, stage=chosen.stage), step_s=ev.step_s,
            delta_s=ev.step_s - base.step_s, peak_memory_bytes=ev.peak_memory_bytes, over_memory_bytes=max(over, 0.0),
            reason=_why(ev, base, over, worst, cap, plan.mesh.pp, terms),
        ))
    alternatives.sort(key=lambda a: (a.over_memory_bytes > 0, a.step_s, a.over_memory_bytes, strategy_key(a.strategy)))
    return Explanation(
        layer=layer_name, class_id=layer.class_id, chosen=chosen, chosen_cost=chosen_cost, step_s=base.step_s,
        peak_memory_bytes=base.peak_memory_bytes, usable_memory_bytes=cap, alternatives=tuple(alternatives[:k]),
        num_layers_in_class=len(members), dp_comm_label=_Labels.of(layer, chosen, chosen, plan, cluster).dp,
    )


# ----------------------------------------------------------------------------- why an alternative lost
@dataclass(frozen=True)
class _Labels:
    """Words for an alternative's cost terms: its data-parallel collectives and their link, its critical comm."""

    dp: str  # "all-gather + reduce-scatter on nvlink4"
    critical: str  # "TP/SP comm", "expert all-to-all", ...
    recompute: str

    @classmethod
    def of(cls, layer, chosen: LayerStrategy, strategy: LayerStrategy, plan: Plan, cluster: Cluster) -> _Labels:
        kinds = [c.kind.replace("_", "-") for c in layer_terms.layer_form(
            layer, strategy, plan.mesh, plan.schedule, cluster).collectives]
        groups = layer_terms.param_groups(layer, strategy, plan.mesh)
        size, stride = groups[0].shard_group if groups else (1, 1)
        link = comm.group_link(cluster, size, stride) if size > 1 else None
        where = f" on {link.name or ('inter-node link' if link is cluster.inter_node else 'intra-node link')}" if link else ""
        dp = " + ".join(dict.fromkeys(kinds)) + where if kinds else "data-parallel comm"
        critical = ("expert all-to-all" if strategy.ep else "TP/SP comm" if strategy.tp == "megatron"
                    else "critical-path comm")
        return cls(dp=dp, critical=critical, recompute=f"recompute ({strategy.recompute})")


def _term_deltas(chosen: LayerCost, alt: LayerCost, labels: _Labels, count: int, micro_batches: int
                 ) -> list[tuple[float, str]]:
    """(seconds per step on the layer's rank, words) of each cost term, alternative minus chosen."""
    def terms(cost: LayerCost) -> dict[str, float]:
        recompute = cost.detail.get("recompute_s", 0.0)
        compute = cost.compute_s or (cost.fwd_s + cost.bwd_s - cost.critical_comm_s)
        return {"compute": micro_batches * (compute - recompute), labels.recompute: micro_batches * recompute,
                labels.critical: micro_batches * cost.critical_comm_s,
                f"exposed {labels.dp}": cost.comm_exposed_s, "optimizer step": cost.optimizer_s}

    before, after = terms(chosen), terms(alt)
    return sorted(((count * (after[k] - before[k]), k) for k in after), reverse=True)


def _why(ev: Evaluation, base: Evaluation, over: float, worst: int, cap: float, pp: int,
         terms: list[tuple[float, str]]) -> str:
    """Why an alternative lost, in words (module docstring)."""
    if over > 0:
        stage = f" on stage {worst}" if pp > 1 else ""
        return f"needs {format_bytes(cap + over)} > {format_bytes(cap)} usable{stage}"
    delta = ev.step_s - base.step_s
    if delta == 0:
        return "ties with the chosen strategy (tie broken by the canonical order)"
    if delta < 0:
        return f"faster by {format_duration(-delta)} (the search stopped before proving optimality)"
    worse = [f"+{format_duration(seconds)} {words}" for seconds, words in terms if seconds > 1e-3 * delta][:2]
    if ev.bubble_s > base.bubble_s and not worse:
        worse = [f"+{format_duration(ev.bubble_s - base.bubble_s)} pipeline bubble"]
    saved = [f"{format_duration(-seconds)} less {words}" for seconds, words in terms if seconds < -1e-3 * delta][:1]
    return ", ".join(worse or [f"+{format_duration(delta)} step"]) + (f" (saves {saved[0]})" if saved else "")


# ----------------------------------------------------------------------------- the chosen strategy's terms
# (detail key, label) per group; a detail key of no group ending in "_s" goes to "other".
_TERM_GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("compute (per micro-batch)", (
        ("fwd_compute_s", "forward"), ("fwd_matmul_s", "  matmul"), ("fwd_memory_s", "  memory-bound ops"),
        ("fwd_overhead_s", "  kernel launches"), ("fwd_device_s", "  on the device"),
        ("fwd_host_s", "  host floor (eager)"), ("fwd_inference_host_s", "  host floor under no_grad (eager)"),
        ("bwd_compute_s", "backward"), ("bwd_host_s", "  host floor (eager)"), ("recompute_s", "recompute"),
        ("loss_fwd_s", "loss forward"), ("loss_bwd_s", "loss backward"))),
    ("communication on the critical path (per micro-batch)", (
        ("tp_fwd_s", "TP/SP forward"), ("tp_bwd_s", "TP/SP backward"), ("ep_fwd_s", "expert all-to-all forward"),
        ("ep_bwd_s", "expert all-to-all backward"), ("cp_fwd_s", "context-parallel forward"),
        ("cp_bwd_s", "context-parallel backward"), ("recompute_comm_s", "recompute re-gathers"))),
    ("data-parallel communication (per step)", (
        ("dp_exposed_s", "exposed"), ("dp_total_s", "total, hidden under compute included"),
        ("dp_quant_s", "  quantize kernels"), ("dp_kernels_s", "  collective launches"))),
    ("optimizer (per step)", (
        ("optimizer_hbm_s", "update"), ("optimizer_cpu_s", "update on the host CPU"),
        ("optimizer_overhead_s", "per-tensor kernels"))),
)
_NOT_TIMES = ("dp_gather_fwd_s", "dp_gather_bwd_s", "dp_grad_per_mb_s", "dp_grad_once_s", "dp_grad_after_s",
              "dp_post_step_s")  # parts of dp_total_s
_MEMORY_LABELS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states"),
                  ("activations", "activations (one micro-batch)"), ("buffers", "collective buffers"),
                  ("gathered", "gathered parameters"), ("host", "host memory (not on the device)"))


def _term_rows(expl: Explanation) -> list[tuple[str, str, str]]:
    """(group, term, value) rows of the chosen strategy's non-zero terms (module docstring)."""
    detail = expl.chosen_cost.detail
    rows, known = [], set(_NOT_TIMES)
    for group, labels in _TERM_GROUPS:
        for key, label in labels:
            known.add(key)
            if detail.get(key):
                label = f"{label} ({expl.dp_comm_label})" if key == "dp_exposed_s" else label
                rows.append((group, label, format_duration(detail[key])))
    rows += [("other", key, format_duration(value)) for key, value in sorted(detail.items())
             if key.endswith("_s") and key not in known and value]
    memory = expl.chosen_cost.memory
    rows += [("memory per rank (this layer)", label, format_bytes(getattr(memory, key)))
             for key, label in _MEMORY_LABELS if getattr(memory, key, 0)]
    return rows


def format_explanation(expl: Explanation) -> Group:
    """A rich renderable: the chosen strategy's non-zero cost terms by group, then the alternatives and why
    each lost."""
    head = Text(
        f"{expl.layer} ({expl.class_id}, {expl.num_layers_in_class} layer(s) share this choice): "
        f"{expl.chosen.notation or 'DDP'} on stage {expl.chosen.stage}; step {format_seconds(expl.step_s)}, "
        f"peak {format_bytes(expl.peak_memory_bytes)} of {format_bytes(expl.usable_memory_bytes)} usable"
    )
    terms = Table(title="cost terms of the chosen strategy (non-zero)")
    for column in ("", "term", "value"):
        terms.add_column(column, justify="right" if column == "value" else "left")
    previous = None
    for group, label, value in _term_rows(expl):
        if previous is not None and group != previous:
            terms.rows[-1].end_section = True
        terms.add_row(group if group != previous else "", label, value)
        previous = group
    alts = Table(title="best alternatives (everything else fixed)")
    for column in ("strategy", "step", "Δ step", "peak", "why it lost"):
        alts.add_column(column, justify="left" if column in ("strategy", "why it lost") else "right")
    for a in expl.alternatives:
        delta = ("+" if a.delta_s > 0 else "") + format_duration(a.delta_s)
        alts.add_row(a.strategy.notation or "DDP", format_duration(a.step_s), delta,
                     format_bytes(a.peak_memory_bytes), a.reason)
    return Group(head, terms, alts)


# ----------------------------------------------------------------------------- diff
TRAIN_FIELDS = ("model_name", "global_batch", "seq_len", "precision", "optimizer")


@dataclass(frozen=True)
class LayerChange:
    """One layer whose strategy differs: (field, in a, in b) per changed field."""

    layer: str
    fields: tuple[tuple[str, object, object], ...]


@dataclass(frozen=True)
class PlanDiff:
    """What changed from plan ``a`` to plan ``b``; every tuple lists ``(name, in a, in b)`` of what differs,
    but ``predictions``, which lists every prediction (``format_diff`` shows those that differ)."""

    mesh: tuple[tuple[str, int, int], ...]
    schedule: tuple[tuple[str, object, object], ...]
    layers: tuple[LayerChange, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    predictions: tuple[tuple[str, float, float], ...]  # (name, a, b): scalars, memory_by_stage[i], memory_breakdown.k
    train: tuple[tuple[str, object, object], ...] = ()  # model and training step (TRAIN_FIELDS)
    cluster: tuple[tuple[str, object, object], ...] = ()  # recorded cluster fields (fingerprints.cluster_spec)
    cost_model: tuple[tuple[str, object, object], ...] = ()  # the cost-model version
    caveats: tuple[tuple[str, object, object], ...] = ()  # ("only in a" / "only in b", text, "")

    @property
    def identical(self) -> bool:
        """No decision differs (predictions may still differ, e.g. another cost-model version)."""
        return not (self.mesh or self.schedule or self.layers or self.only_in_a or self.only_in_b)


def _changed(a: object, b: object, names: tuple[str, ...]) -> tuple[tuple[str, object, object], ...]:
    return tuple((n, getattr(a, n), getattr(b, n)) for n in names if getattr(a, n) != getattr(b, n))


def _flatten(data: object, path: str = "") -> dict[str, object]:
    """A JSON tree as ``{"device.memory_bytes": value}``."""
    if isinstance(data, dict):
        out: dict[str, object] = {}
        for key in sorted(data):
            out.update(_flatten(data[key], f"{path}.{key}" if path else str(key)))
        return out
    return {path: data}


def _prediction_values(plan: Plan) -> dict[str, float]:
    p = plan.predictions
    values = {f.name: float(getattr(p, f.name)) for f in dataclasses.fields(p)
              if isinstance(getattr(p, f.name), (int, float))}
    values.update({f"memory_by_stage[{i}]": float(v) for i, v in enumerate(p.memory_by_stage)})
    values.update({f"memory_breakdown.{k}": float(v) for k, v in sorted(p.memory_breakdown.items())})
    return values


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Every field that differs from ``a`` to ``b`` (module docstring), with every prediction's pair."""
    b_layers = {s.layer: s for s in b.layers}
    a_names = [s.layer for s in a.layers]
    changes = tuple(
        LayerChange(s.layer, _changed(s, b_layers[s.layer], DECISION_FIELDS))
        for s in a.layers if s.layer in b_layers and _changed(s, b_layers[s.layer], DECISION_FIELDS)
    )
    schedule_fields = tuple(f.name for f in dataclasses.fields(a.schedule))
    pa, pb = _prediction_values(a), _prediction_values(b)
    ca, cb = _flatten(a.fingerprints.cluster_spec), _flatten(b.fingerprints.cluster_spec)
    cluster = tuple((k, ca.get(k), cb.get(k)) for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k))
    caveats = tuple(("only in a", c, "") for c in a.predictions.caveats if c not in b.predictions.caveats) + tuple(
        ("only in b", c, "") for c in b.predictions.caveats if c not in a.predictions.caveats)
    return PlanDiff(
        mesh=_changed(a.mesh, b.mesh, MESH_AXES), schedule=_changed(a.schedule, b.schedule, schedule_fields),
        layers=changes, only_in_a=tuple(n for n in a_names if n not in b_layers),
        only_in_b=tuple(s.layer for s in b.layers if s.layer not in set(a_names)),
        predictions=tuple((n, pa.get(n, 0.0), pb.get(n, 0.0)) for n in dict.fromkeys([*pa, *pb])),
        train=_changed(a, b, TRAIN_FIELDS), cluster=cluster,
        cost_model=_changed(a.fingerprints, b.fingerprints, ("cost_model",)), caveats=caveats,
    )


def _fold(changes: tuple[LayerChange, ...]) -> list[tuple[list[str], tuple]]:
    """Group layers with the same change, in order of first appearance (80 blocks print as a few rows)."""
    rows: dict[tuple, list[str]] = {}
    for change in changes:
        rows.setdefault(change.fields, []).append(change.layer)
    return [(names, fields) for fields, names in rows.items()]


def format_value(name: str, value: float) -> str:
    """A prediction (or a schedule / cluster field) with its unit: ms, GiB, tokens/s, %."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "tokens_per_s":
        return f"{value:,.0f} tokens/s"
    if name.endswith("_s") or leaf == "latency":
        return format_seconds(value)
    if "bytes" in name or name.startswith(("memory_by_stage", "memory_breakdown")):
        return format_bytes(value)
    if name == "mfu":
        return f"{value:.2%}"
    if leaf in ("bandwidth", "hbm_bandwidth", "host_bandwidth"):
        return f"{value / 1e9:.4g} GB/s"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


_PREDICTION_LABELS = {
    "step_time_s": "step time", "compute_s": "compute", "exposed_comm_s": "exposed comm", "bubble_s": "bubble",
    "optimizer_s": "optimizer", "peak_memory_bytes": "peak memory/rank", "tokens_per_s": "throughput",
    "mfu": "MFU", "build_peak_bytes": "build peak memory",
}


def _prediction_label(name: str) -> str:
    """``step_time_s`` → ``step time``; ``memory_breakdown.params`` → ``memory: params``."""
    if name.startswith("memory_breakdown."):
        return "memory: " + name.split(".", 1)[1]
    if name.startswith("memory_by_stage["):
        return "memory of stage " + name[len("memory_by_stage["):-1]
    return _PREDICTION_LABELS.get(name, name)


def _ratio(x: object, y: object) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or not x:
        return ""
    return f"×{y / x:.3g}"


def _pairs(items: tuple[tuple[str, object, object], ...], *, units: bool = False) -> str:
    def show(name: str, v: object) -> str:
        return format_value(name, v) if units and isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)

    return ", ".join(f"{n} {show(n, x)} → {show(n, y)}" + (f" ({_ratio(x, y)})" if _ratio(x, y) else "")
                     for n, x, y in items)


def format_diff(diff: PlanDiff) -> Group:
    """A rich renderable of what differs in ``diff``: model and training step, cluster, mesh, schedule,
    per-layer changes, predictions with units and ratios B/A."""
    parts: list = []
    if diff.identical:
        parts.append(Text("plans make the same decisions"))
    for title, items, units in (("training step", diff.train, False), ("cluster", diff.cluster, True),
                                ("cost model", diff.cost_model, False), ("mesh", diff.mesh, False),
                                ("schedule", diff.schedule, True)):
        if items:
            parts.append(Text(f"{title}: {_pairs(items, units=units)}"))
    if diff.layers:
        table = Table(title="layer changes")
        table.add_column("layers")
        table.add_column("change")
        for names, fields in _fold(diff.layers):
            label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})"
            table.add_row(label, ", ".join(f"{n}: {x} → {y}" for n, x, y in fields))
        parts.append(table)
    for side, names in (("only in a", diff.only_in_a), ("only in b", diff.only_in_b)):
        if names:
            parts.append(Text(f"{side}: {', '.join(names[:8])}{' …' if len(names) > 8 else ''}"))
    for side, text, _ in diff.caveats:
        parts.append(Text(f"caveat {side}: {text}"))
    changed = [(n, x, y) for n, x, y in diff.predictions if x != y]
    if not changed:
        parts.append(Text("predictions: identical"))
        return Group(*parts)
    preds = Table(title="predictions that differ")
    for column in ("", "A", "B", "B/A"):
        preds.add_column(column, justify="left" if not column else "right")
    for name, x, y in changed:
        preds.add_row(_prediction_label(name), format_value(name, x), format_value(name, y), _ratio(x, y) or "—")
    parts.append(preds)
    if len(changed) < len(diff.predictions):
        parts.append(Text(f"({len(diff.predictions) - len(changed)} other predictions equal)"))
    return Group(*parts)


__all__ = ["Alternative", "Explanation", "LayerChange", "PlanDiff", "TRAIN_FIELDS", "diff_plans", "explain_layer",
           "format_diff", "format_explanation", "format_value"]
