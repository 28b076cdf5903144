"""Re-predict recorded benchmark rows with the current cost model (no GPU needed).

Reads a ``benchmarks/run.py`` results JSON (``meta`` + ``rows``), captures the
same reference model on the meta device, rebuilds each row's plan from its
summary (``"dp_shard=2; zero1×100; m=1 mb=8"``, ``"tp=2; replicate×50
replicate·TP×50; m=1 mb=16"``: the mesh, one ZeRO state on every layer, Megatron
TP on every tp-able layer when the summary says ``TP``, the micro-batch count)
and predicts it on the preset cluster the run detected, with the cost model's
default constants and, when ``--calibration`` is given, with that calibration
file applied (a file written by ``autoshard cluster calibrate --model MODEL --seq
S`` carries measured layer and optimizer times, which the calibrated column then
uses: ``search/measured.py``). Peak memory is compared as allocated bytes
(``torch.cuda.max_memory_allocated``, what the run recorded). Error = (predicted − measured) / measured. Rows that did not run
(``status`` not ``ok``) are skipped.

The plan summary does not record per-layer choices beyond the state and TP, so a
searched plan with mixed strategies is rebuilt as the uniform plan its summary
names; every recorded row so far is uniform.

Run from the repository root::

    .venv/bin/python benchmarks/predict_recorded.py benchmarks/results/bench_h100x2_2026-11-26/llama350m_run2.json \\
        --calibration benchmarks/results/bench_h100x2_2026-11-26/calibration.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from autoshard.cluster import Cluster  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.plan import Mesh, Plan, Predictions  # noqa: E402
from autoshard.search.cost_model import COST_MODEL_VERSION, predict  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402

_MESH_AXES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class PlanSummary:
    """What a row's plan summary says: mesh sizes, ZeRO state, TP on or off, micro-batches."""

    mesh: dict[str, int]
    state: str
    tp: bool
    num_micro_batches: int


def parse_summary(text: str) -> PlanSummary:
    """Parse ``report.plan_summary`` text; raises ``AutoshardError`` naming the text when it does not match."""
    parts = [p.strip() for p in text.split(";")]
    mesh = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", parts[0]) if k in _MESH_AXES}
    state = re.match(r"(\w+)", parts[1]) if len(parts) > 2 else None
    micro = re.search(r"\bm=(\d+)", parts[-1])
    if not mesh or state is None or micro is None:
        raise AutoshardError(f"plan summary {text!r}: expected 'AXIS=N…; STATE×K…; m=M mb=B'; "
                             "re-run benchmarks/run.py to record a parsable summary")
    return PlanSummary(mesh, state.group(1), "TP" in parts[1], int(micro.group(1)))


def rebuild_plan(graph, summary: PlanSummary, meta: dict) -> Plan:
    """The uniform plan a summary names, on the recorded batch shape."""
    from benchmarks.baselines.autoshard_trainer import uniform_plan

    return uniform_plan(graph, Mesh(**summary.mesh), state=summary.state, tp=summary.tp,
                        num_micro_batches=summary.num_micro_batches, global_batch=meta["global_batch"],
                        seq_len=meta["seq_len"], precision=meta["precision"])


def recorded_cluster(meta: dict) -> Cluster:
    """The preset cluster of ``meta["cluster"]`` (``"detected:PRESET:NxD"`` or ``"PRESET:NxD"``)."""
    return Cluster.parse(meta["cluster"].removeprefix("detected:"))


def _predict(graph, plan: Plan, cluster: Cluster, meta: dict) -> Predictions:
    train = TrainSpec(global_batch=meta["global_batch"], seq_len=meta["seq_len"], precision=meta["precision"],
                      micro_batch=plan.schedule.micro_batch)
    return predict(graph, plan, cluster, train)


def repredict(results: dict, calibration: Path | None) -> list[dict]:
    """One dict per measured row: measured and recorded/new predicted step seconds and terms."""
    from autoshard.passes.capture import capture_reference
    from benchmarks.baselines.common import DTYPES

    meta = results["meta"]
    seq = meta["seq_len"]
    graph = capture_reference(meta["model"], seq_lens=(max(2, seq // 2), seq), dtype=DTYPES[meta["precision"]])
    cluster = recorded_cluster(meta)
    calibrated = cluster.with_calibration(calibration) if calibration else None
    out = []
    for row in results["rows"]:
        if row.get("status") != "ok":
            continue
        plan = rebuild_plan(graph, parse_summary(row["plan"]), meta)
        new = _predict(graph, plan, cluster, meta)
        entry = {"config": row["config"], "plan": row["plan"], "measured_s": row["median_step_s"],
                 "recorded_s": (row.get("predicted") or {}).get("step_time_s"), "predicted_s": new.step_time_s,
                 "compute_s": new.compute_s, "exposed_comm_s": new.exposed_comm_s, "optimizer_s": new.optimizer_s,
                 "measured_bytes": row.get("peak_memory_bytes"), "predicted_bytes": new.peak_memory_bytes}
        if calibrated is not None:
            entry["calibrated_s"] = _predict(graph, plan, calibrated, meta).step_time_s
        out.append(entry)
    return out


def _err(pred: float | None, measured: float) -> str:
    return "–" if pred is None else f"{(pred - measured) / measured:+.0%}"


def markdown(rows: list[dict], meta: dict) -> str:
    """The error table (ms) and the median |error| of each prediction column."""
    lines = [f"{meta['model']}, batch {meta['global_batch']} × seq {meta['seq_len']}, {meta['precision']}, "
             f"{meta['cluster']}, cost model v{COST_MODEL_VERSION}", "",
             "| config | plan | measured ms | recorded pred ms | err | new pred ms | err | calibrated ms | err "
             "| compute ms | exposed comm ms | optimizer ms | measured GiB | pred GiB | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["measured_s"]
        cal = r.get("calibrated_s")
        fmt = (lambda v: "–" if v is None else f"{v * 1e3:.1f}")  # noqa: E731
        gib = (lambda v: "–" if v is None else f"{v / 2**30:.2f}")  # noqa: E731
        lines.append(f"| {r['config']} | {r['plan']} | {fmt(ms)} "
                     f"| {fmt(r['recorded_s'])} | {_err(r['recorded_s'], ms)} "
                     f"| {fmt(r['predicted_s'])} | {_err(r['predicted_s'], ms)} | {fmt(cal)} | {_err(cal, ms)} "
                     f"| {fmt(r['compute_s'])} | {fmt(r['exposed_comm_s'])} | {fmt(r['optimizer_s'])} "
                     f"| {gib(r.get('measured_bytes'))} | {gib(r['predicted_bytes'])} "
                     f"| {_err(r['predicted_bytes'], r['measured_bytes']) if r.get('measured_bytes') else '–'} |")
    lines.append("")
    for key in ("recorded_s", "predicted_s", "calibrated_s"):
        errs = [abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rows if r.get(key) is not None]
        if errs:
            median = statistics.median(errs)
            lines.append(f"- median |error| {key.removesuffix('_s')}: {median:.0%} over {len(errs)} rows")
    mem = [abs(r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"] for r in rows if r.get("measured_bytes")]
    if mem:
        lines.append(f"- median |error| peak memory (allocated): {statistics.median(mem):.1%} over {len(mem)} rows")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the re-predicted table of each results file; ``--json`` also writes the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="benchmarks/run.py results JSON")
    parser.add_argument("--calibration", type=Path, help="calibration file (autoshard cluster calibrate)")
    parser.add_argument("--json", type=Path, help="write the re-predicted rows here")
    args = parser.parse_args(argv)
    everything = {}
    for path in args.results:
        results = json.loads(path.read_text())
        rows = repredict(results, args.calibration)
        everything[str(path)] = rows
        print(markdown(rows, results["meta"]), end="\n\n")
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
