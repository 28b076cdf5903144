"""``autoshard report PLAN.json -o plan.html [--trace trace.json] [--measured TRACE.json ...]``: pictures of a plan.

What it does, in order:

1. checks the output paths (``file_io.check_output_path``), loads the plan (``Plan.load``) and rebuilds what
   it was made for, as ``explain`` does: the model from its name (``cli_search.reference_spec``; a
   reference spec or a ``file.py:factory`` that still exists), the cluster the plan recorded (or
   ``--cluster``; ``--calibration`` applied: ``plan_reuse.cluster_for``, whose docstring says why a CPU or
   calibrated plan is priced as searched), the ``TrainSpec`` from its fields (``plan_reuse.train_of``), and
   checks the plan against them (``Plan.check_compatible``);
2. lays out the predicted step (``autoshard/report_model.py``: its docstring says which parts are the cost
   model's per-layer terms and which are per-step totals laid out in the runtime's order);
3. writes one self-contained HTML page (``autoshard/report_html.py``: inline SVG and CSS, no script, no
   network): the strategy per layer, memory per rank over the step stacked by kind, the step timeline
   per rank and stream, and with ``--measured`` the measured trace beside it;
4. with ``--trace FILE.json``, the same predicted timeline as a Chrome trace (``chrome_trace``): open it in
   Perfetto (ui.perfetto.dev) or ``chrome://tracing``. ``traceEvents`` holds one ``ph: "X"`` event per
   span, ``ts`` and ``dur`` in microseconds, ``pid`` = the pipeline rank, ``tid`` = the stream's index in
   ``report_model.STREAMS``, and ``ph: "M"`` events naming each process and thread.

Output: the written paths on stdout, after ``explain``'s calibration line and warning when they apply
(``plan_reuse.calibration_warning``); progress (capture, the PPO policy, compiled activations) as the
other result commands show it (``cli_search.Stages``: live on a terminal's stderr, nothing in a pipe or
with ``--quiet``).

``--measured`` reads a Chrome trace (``autoshard ppo --profile`` writes one per rank next to the metrics
file: ``runtime/step_profile.py``; any ``torch.profiler`` ``export_chrome_trace`` file works): its busiest
``(pid, tid)`` lanes, events classified as communication (names of NCCL / gloo / c10d collectives and
autoshard's own) or compute (kernels and ATen ops).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from autoshard import file_io
from autoshard.errors import AutoshardError
from autoshard.report_model import STREAMS, StepLayout, lay_out_step

TRACE_FILE = file_io.FileKind(
    "trace file", 512 * file_io.MiB, AutoshardError,
    "pass a Chrome trace JSON: one `autoshard ppo --profile` wrote, or torch.profiler's export_chrome_trace",
)
MEASURED_LANES = 12  # busiest (pid, tid) lanes drawn per measured trace
MEASURED_EVENTS = 4000  # longest events drawn per measured trace (a page stays a few MB)
COMM_MARKERS = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "all_to_all", "alltoall", "broadcast", "send", "recv", "autoshard::")


@dataclass(frozen=True)
class Report:
    """What the page shows: the plan, its laid-out step and, optionally, a measured trace."""

    title: str
    summary: tuple[str, ...]
    plan: Any
    layer_names: tuple[str, ...]
    layout: StepLayout
    measured: MeasuredTrace | None = None


def build_report(plan: Any, graph: Any, cluster: Any, train: Any, measured: MeasuredTrace | None = None) -> Report:
    """The ``Report`` of ``plan`` for ``graph`` on ``cluster`` (module docstring, steps 2 and 3)."""
    layout = lay_out_step(graph, plan, cluster, train)
    p = plan.predictions
    title = f"{plan.model_name}: {plan.mesh.world_size} ranks, {_mesh_text(plan.mesh)}, {plan.schedule}"
    summary = (
        f"global batch {plan.global_batch} × {plan.seq_len} tokens, {plan.precision}, {plan.optimizer}; "
        f"mesh {plan.mesh}",
        f"predicted step {_s(p.step_time_s)} (compute {_s(p.compute_s)}, exposed comm {_s(p.exposed_comm_s)}, "
        f"bubble {_s(p.bubble_s)}, optimizer {_s(p.optimizer_s)}); laid out below: {_s(layout.step_s)}",
        f"predicted peak memory per rank {_b(p.peak_memory_bytes)} (build {_b(p.build_peak_bytes)}); by pipeline "
        f"rank: {', '.join(_b(x) for x in p.memory_by_stage)}",
    )
    return Report(title=title, summary=summary, plan=plan, layer_names=tuple(layer.name for layer in graph.layers),
                  layout=layout, measured=measured)


def _mesh_text(mesh: Any) -> str:
    axes = [f"{axis}={getattr(mesh, axis)}" for axis in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp")
            if getattr(mesh, axis) > 1]
    return " ".join(axes) or "one rank"


def _s(seconds: float) -> str:
    from autoshard.report_html import fmt_seconds

    return fmt_seconds(seconds)


def _b(nbytes: float) -> str:
    from autoshard.report_html import fmt_bytes

    return fmt_bytes(nbytes)


# ------------------------------------------------------------------------------------- chrome trace
def chrome_trace(layout: StepLayout, plan: Any) -> dict[str, Any]:
    """The predicted step as a Chrome trace (module docstring, step 4)."""
    events: list[dict[str, Any]] = []
    for rank in layout.ranks:
        stages = ", ".join(str(s) for s in rank.stages)
        events.append({"name": "process_name", "ph": "M", "pid": rank.rank, "tid": 0,
                       "args": {"name": f"pipeline rank {rank.rank} (stage {stages})"}})
        for tid, stream in enumerate(STREAMS):
            events.append({"name": "thread_name", "ph": "M", "pid": rank.rank, "tid": tid, "args": {"name": stream}})
        for span in rank.spans:
            args = {k: v for k, v in (("layer", span.layer), ("micro_batch", span.micro_batch)) if v is not None}
            events.append({"name": span.name, "cat": span.category, "ph": "X", "ts": span.start_s * 1e6,
                           "dur": span.dur_s * 1e6, "pid": rank.rank, "tid": STREAMS.index(span.stream),
                           "args": args})
    other = {"model": plan.model_name, "mesh": str(plan.mesh), "schedule": str(plan.schedule),
             "predicted_step_s": plan.predictions.step_time_s, "laid_out_step_s": layout.step_s,
             "notes": list(layout.notes)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


# ---------------------------------------------------------------------------------- measured trace
@dataclass(frozen=True)
class MeasuredEvent:
    name: str
    category: str  # compute, communication, other
    start_s: float
    dur_s: float


@dataclass(frozen=True)
class MeasuredLane:
    label: str
    events: tuple[MeasuredEvent, ...]


@dataclass(frozen=True)
class MeasuredTrace:
    """The lanes of one or more Chrome traces (times in seconds, from the traces' own clock)."""

    source: str
    lanes: tuple[MeasuredLane, ...]
    start_s: float
    end_s: float
    event_count: int

    def seconds_by_category(self) -> list[tuple[str, float]]:
        """Busy seconds per category: the union of its events' intervals over all lanes drawn."""
        out = []
        for category in ("compute", "communication", "other"):
            spans = sorted((e.start_s, e.start_s + e.dur_s) for lane in self.lanes for e in lane.events
                           if e.category == category)
            total, reach = 0.0, float("-inf")
            for start, end in spans:
                total += max(end - max(start, reach), 0.0)
                reach = max(reach, end)
            out.append((category, total))
        return out


def classify(name: str, cat: str) -> str:
    """``communication`` for collectives (``COMM_MARKERS``), ``compute`` for kernels and ops, else ``other``."""
    lowered = name.lower()
    if any(marker in lowered for marker in COMM_MARKERS):
        return "communication"
    if cat.lower() in ("kernel", "cpu_op", "gpu_op", "operator", "cuda_runtime") or lowered.startswith("aten::"):
        return "compute"
    return "other"


def load_measured(paths: Sequence[str | Path]) -> MeasuredTrace:
    """The busiest lanes of the Chrome traces at ``paths`` (``MEASURED_LANES`` each, ``MEASURED_EVENTS`` longest
    events each); ``AutoshardError`` naming the file when one is not a trace with complete (``ph: "X"``) events."""
    lanes: list[MeasuredLane] = []
    for path in paths:
        lanes += _trace_lanes(Path(path))
    events = [e for lane in lanes for e in lane.events]
    start = min(e.start_s for e in events)
    end = max(e.start_s + e.dur_s for e in events)
    source = ", ".join(Path(p).name for p in paths)
    return MeasuredTrace(source=source, lanes=tuple(lanes), start_s=start, end_s=end, event_count=len(events))


def _trace_lanes(path: Path) -> list[MeasuredLane]:
    data = file_io.load_json_strict(path, TRACE_FILE)
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise AutoshardError(f"trace file {str(path)!r} has no traceEvents list; {TRACE_FILE.hint}")
    complete = [e for e in raw if isinstance(e, dict) and e.get("ph") == "X" and _number(e.get("ts"))
                and _number(e.get("dur"))]
    if not complete:
        raise AutoshardError(f"trace file {str(path)!r} has no complete events (ph 'X' with ts and dur); "
                             f"{TRACE_FILE.hint}")
    by_lane: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for event in complete:
        by_lane.setdefault((str(event.get("pid", "")), str(event.get("tid", ""))), []).append(event)
    busiest = sorted(by_lane.items(), key=lambda kv: -sum(e["dur"] for e in kv[1]))[:MEASURED_LANES]
    kept = sorted((e for _, evs in busiest for e in evs), key=lambda e: -e["dur"])[:MEASURED_EVENTS]
    keep_ids = {id(e) for e in kept}
    lanes = []
    for (pid, tid), evs in busiest:
        chosen = tuple(MeasuredEvent(str(e.get("name", "")), classify(str(e.get("name", "")), str(e.get("cat", ""))),
                                     e["ts"] / 1e6, e["dur"] / 1e6) for e in evs if id(e) in keep_ids)
        if chosen:
            lanes.append(MeasuredLane(f"{path.stem} {pid}/{tid}", chosen))
    return lanes


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------- CLI
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``autoshard report``."""
    parser.add_argument("plan", type=Path, metavar="PLAN.json", help="a plan file written by 'autoshard plan'")
    parser.add_argument("-o", "--out", type=Path, metavar="PLAN.html", help="the HTML page to write (default: PLAN "
                        "with .html)")
    parser.add_argument("--trace", type=Path, metavar="FILE.json", help="also write the predicted timeline as a "
                        "Chrome trace (Perfetto, chrome://tracing)")
    parser.add_argument("--measured", type=Path, action="append", default=[], metavar="TRACE.json",
                        help="a measured Chrome trace (autoshard ppo --profile) to lay beside the prediction "
                        "(repeatable: one per rank)")
    parser.add_argument("--cluster", metavar="PRESET:NODESxDEVICES|FILE", help="cluster to cost on (default: the "
                        "one recorded in the plan)")
    parser.add_argument("--calibration", type=Path, metavar="CAL.json", help="price on the cluster with this file of "
                        "'autoshard cluster calibrate' applied (default: the plan's recorded calibration, if any)")


def _matching_graph(plan: Any, spec: str, cluster: Any, stages: Any) -> Any:
    """The captured graph ``plan`` was searched against: the CLI's capture of ``spec`` (``autoshard plan``), else
    the PPO policy's (``autoshard ppo``: the actor-critic with the task's vocabulary, ``runtime/ppo_policy.py``);
    the plan's ``PlanError`` for the first when neither matches."""
    from autoshard.cli_search import capture_model
    from autoshard.errors import PlanError

    graph = capture_model(spec, stages)
    try:
        plan.check_compatible(graph=graph, cluster=cluster)
        return graph
    except PlanError as first:
        from autoshard.runtime.ppo_policy import capture_policy, load_policy

        with stages.stage("policy", f"capture the PPO policy of {spec}"):
            policy = load_policy(spec, 0, "meta")
            graph = capture_policy(policy.module, policy.name)
        try:
            plan.check_compatible(graph=graph, cluster=cluster)
        except PlanError:
            raise first from None
        return graph


def report_main(args: argparse.Namespace, console: Any, progress_console: Any) -> int:
    """CLI body of ``autoshard report`` (module docstring); ``progress_console``: where progress goes
    (``None``: ``--quiet``, none)."""
    from autoshard.cli_search import Stages, calibration_line, reference_spec, with_compiled_activations
    from autoshard.plan import Plan
    from autoshard.plan_reuse import calibration_warning, cluster_for, train_of

    if not args.plan.name:
        raise AutoshardError(f"{str(args.plan)!r} is not a plan file path; {file_io.PLAN_FILE.hint}")
    out = args.out if args.out is not None else args.plan.with_suffix(".html")
    file_io.check_output_path(out, noun="report file", parents=True)
    if args.trace is not None:
        file_io.check_output_path(args.trace, noun="trace file", parents=True)
    plan = Plan.load(args.plan)
    measured = load_measured(args.measured) if args.measured else None
    cluster = cluster_for(plan, args.cluster, args.calibration)
    spec = reference_spec(plan.model_name, source=str(args.plan))
    train = train_of(plan)
    with Stages(progress_console) as stages:
        graph = with_compiled_activations(spec, _matching_graph(plan, spec, cluster, stages), cluster, train, stages)
        stages.done()
    report = build_report(plan, graph, cluster, train, measured)
    from autoshard.report_html import render_html

    for line in (calibration_line(cluster, args.calibration, recorded=not args.cluster),
                 calibration_warning(plan, cluster)):
        if line:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    written = file_io.atomic_write(out, render_html(report), noun="report file", parents=True)
    console.print(f"report written to {written}", markup=False, highlight=False, soft_wrap=True)
    if args.trace is not None:
        text = json.dumps(chrome_trace(report.layout, plan))
        trace = file_io.atomic_write(args.trace, text, noun="trace file", parents=True)
        console.print(f"trace written to {trace} (open in ui.perfetto.dev)", markup=False, highlight=False,
                      soft_wrap=True)
    return 0


__all__ = ["MeasuredTrace", "Report", "add_report_arguments", "build_report", "chrome_trace", "classify",
           "load_measured", "report_main"]
