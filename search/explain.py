"""Why a plan chose what it chose: ``explain_layer`` ("why not X?") and ``diff_plans``.

``explain_layer`` re-costs one layer's class under every admissible strategy
with everything else in the plan fixed (mesh, schedule, stages, every other
class), using the same aggregation as the solver (``evaluate.evaluate``):
per-rank step time and memory against the same usable memory ``M``. Each
alternative carries why it lost: "slower by X" (``format_duration``: s, ms,
µs or ns with 4 significant digits, so near-ties of tiny models stay
visible) or "exceeds memory on stage k by Y GiB". Alternatives keep the plan's ``sp`` (sequence parallelism is one
global choice in the solver, so flipping it for one class is not a plan the
solver could return). The chosen strategy's own ``LayerCost.detail`` (the cost
model's named terms) is shown beside them.

``diff_plans`` compares two plans field by field: mesh, schedule, each layer's
strategy and the predictions, with deltas.

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
from autoshard.search import cost_model
from autoshard.search.cost_model import LayerCost
from autoshard.search.evaluate import CostFn, CostTable, Option, chain_flags, evaluate
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


def _reason(delta_s: float, over: float, worst_stage: int) -> str:
    if over > 0:
        return f"exceeds memory on stage {worst_stage} by {over / GiB:.2f} GiB"
    if delta_s > 0:
        return f"slower by {format_duration(delta_s)}"
    if delta_s == 0:
        return "ties with the chosen strategy (tie broken by the canonical order)"
    return f"faster by {format_duration(-delta_s)} (the search stopped before proving optimality)"


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
        alternatives.append(Alternative(
            strategy=dataclasses.replace(strategy, layer=layer_name, stage=chosen.stage), step_s=ev.step_s,
            delta_s=ev.step_s - base.step_s, peak_memory_bytes=ev.peak_memory_bytes, over_memory_bytes=max(over, 0.0),
            reason=_reason(ev.step_s - base.step_s, over, worst),
        ))
    alternatives.sort(key=lambda a: (a.over_memory_bytes > 0, a.step_s, a.over_memory_bytes, strategy_key(a.strategy)))
    return Explanation(
        layer=layer_name, class_id=layer.class_id, chosen=chosen,
        chosen_cost=options[graph.layers.index(layer)].cost, step_s=base.step_s,
        peak_memory_bytes=base.peak_memory_bytes, usable_memory_bytes=cap, alternatives=tuple(alternatives[:k]),
        num_layers_in_class=len(members),
    )


def format_explanation(expl: Explanation) -> Group:
    """A rich renderable: the chosen strategy's cost terms, then the alternatives and why each lost."""
    head = Text(
        f"{expl.layer} ({expl.class_id}, {expl.num_layers_in_class} layer(s) share this choice): "
        f"{expl.chosen.notation or 'DDP'} on stage {expl.chosen.stage}; step {expl.step_s * 1e3:.3f} ms, "
        f"peak {expl.peak_memory_bytes / GiB:.2f} of {expl.usable_memory_bytes / GiB:.2f} GiB usable"
    )
    terms = Table(title="cost terms of the chosen strategy (per micro-batch / per step)")
    terms.add_column("term")
    terms.add_column("value", justify="right")
    for name, value in sorted(expl.chosen_cost.detail.items()):
        terms.add_row(name, f"{value * 1e3:.4f} ms" if name.endswith("_s") else f"{value:.6g}")
    alts = Table(title="best alternatives (everything else fixed)")
    for column in ("strategy", "step (ms)", "Δ", "peak (GiB)", "why it lost"):
        alts.add_column(column)
    for a in expl.alternatives:
        delta = ("+" if a.delta_s > 0 else "") + format_duration(a.delta_s)
        alts.add_row(a.strategy.notation or "DDP", f"{a.step_s * 1e3:.3f}", delta,
                     f"{a.peak_memory_bytes / GiB:.2f}", a.reason)
    return Group(head, terms, alts)


# ----------------------------------------------------------------------------- diff
@dataclass(frozen=True)
class LayerChange:
    """One layer whose strategy differs: (field, in a, in b) per changed field."""

    layer: str
    fields: tuple[tuple[str, object, object], ...]


@dataclass(frozen=True)
class PlanDiff:
    """What changed from plan ``a`` to plan ``b``."""

    mesh: tuple[tuple[str, int, int], ...]
    schedule: tuple[tuple[str, object, object], ...]
    layers: tuple[LayerChange, ...]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    predictions: tuple[tuple[str, float, float], ...]  # (name, a, b) of every scalar prediction

    @property
    def identical(self) -> bool:
        """No decision differs (predictions may still differ, e.g. another cost-model version)."""
        return not (self.mesh or self.schedule or self.layers or self.only_in_a or self.only_in_b)


def _changed(a: object, b: object, names: tuple[str, ...]) -> tuple[tuple[str, object, object], ...]:
    return tuple((n, getattr(a, n), getattr(b, n)) for n in names if getattr(a, n) != getattr(b, n))


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Per-layer strategy changes, mesh/schedule changes and prediction deltas from ``a`` to ``b``."""
    b_layers = {s.layer: s for s in b.layers}
    a_names = [s.layer for s in a.layers]
    changes = tuple(
        LayerChange(s.layer, _changed(s, b_layers[s.layer], DECISION_FIELDS))
        for s in a.layers if s.layer in b_layers and _changed(s, b_layers[s.layer], DECISION_FIELDS)
    )
    schedule_fields = tuple(f.name for f in dataclasses.fields(a.schedule))
    scalar = [f.name for f in dataclasses.fields(a.predictions)
              if isinstance(getattr(a.predictions, f.name), (int, float))]
    return PlanDiff(
        mesh=_changed(a.mesh, b.mesh, MESH_AXES), schedule=_changed(a.schedule, b.schedule, schedule_fields),
        layers=changes, only_in_a=tuple(n for n in a_names if n not in b_layers),
        only_in_b=tuple(s.layer for s in b.layers if s.layer not in set(a_names)),
        predictions=tuple((n, float(getattr(a.predictions, n)), float(getattr(b.predictions, n))) for n in scalar),
    )


def _fold(changes: tuple[LayerChange, ...]) -> list[tuple[list[str], tuple]]:
    """Group layers with the same change, in order of first appearance (80 blocks print as a few rows)."""
    rows: dict[tuple, list[str]] = {}
    for change in changes:
        rows.setdefault(change.fields, []).append(change.layer)
    return [(names, fields) for fields, names in rows.items()]


def format_diff(diff: PlanDiff) -> Group:
    """A rich renderable of ``diff``: mesh and schedule changes, per-layer changes, prediction deltas."""
    parts: list = []
    if diff.identical:
        parts.append(Text("plans make the same decisions"))
    for title, items in (("mesh", diff.mesh), ("schedule", diff.schedule)):
        if items:
            parts.append(Text(f"{title}: " + ", ".join(f"{n} {x} → {y}" for n, x, y in items)))
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
    preds = Table(title="predictions")
    for column in ("", "a", "b", "Δ"):
        preds.add_column(column, justify="right")
    for name, x, y in diff.predictions:
        preds.add_row(name, f"{x:.6g}", f"{y:.6g}", f"{y - x:+.6g}" + (f" ({(y - x) / x:+.1%})" if x else ""))
    parts.append(preds)
    return Group(*parts)


__all__ = ["Alternative", "Explanation", "LayerChange", "PlanDiff", "diff_plans", "explain_layer",
           "format_diff", "format_explanation"]
