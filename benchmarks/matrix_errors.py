"""Median |prediction error| of the autoshard rows over recorded matrix runs.

    python benchmarks/matrix_errors.py benchmarks/results/matrix_h100x4_2026-11-26/*_x[24].json

Reads ``benchmarks/run.py`` results files (``meta`` + ``rows``) and, over every row whose
config starts with ``autoshard`` and whose status is ``ok``, prints the median of
|error| for step time before calibration (``predicted``), after it
(``predicted_calibrated``) and for peak memory, where error = (predicted − measured) /
measured, recomputed from the recorded predicted and measured values (the stored
``predicted_*_error`` fields are checked against it).

Rows are also split by how the runtime executes the plan, read from the plan summary:
*host-bound* if any layer uses ZeRO-3 (``zero3``), sequence parallelism (``SP×``) or
quantized communication (``qW``/``qG``): the paths whose step time is dominated by host
work and blocking collectives in these runs (docs/runtime.md, overlap section);
*efficient* otherwise (replicate, ZeRO-1/2, TP without SP, PP). A plan with a single
ZeRO-3 layer counts as host-bound. Nothing is measured here; stdlib only.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

HOST_BOUND = re.compile(r"zero3|SP×|\bq[WG]\d")
METRICS = (  # (label, predicted block, predicted key, measured key)
    ("step (uncalibrated)", "predicted", "step_time_s", "median_step_s"),
    ("step (calibrated)", "predicted_calibrated", "step_time_s", "median_step_s"),
    ("peak memory", "predicted", "peak_memory_bytes", "peak_memory_bytes"),
)
TARGETS = {"step (uncalibrated)": 0.10, "step (calibrated)": 0.10, "peak memory": 0.05}


def autoshard_rows(path: Path) -> list[dict]:
    """The run's ``ok`` autoshard rows, each tagged with its run name and path class."""
    data = json.loads(path.read_text())
    run = path.stem.removeprefix("bench_").removesuffix("_matrix")
    rows = []
    for row in data["rows"]:
        if row["config"].startswith("autoshard") and row.get("status") == "ok":
            kind = "host-bound" if HOST_BOUND.search(row.get("plan", "")) else "efficient"
            rows.append({**row, "run": run, "kind": kind})
    return rows


def error(row: dict, block: str, pred_key: str, meas_key: str) -> float | None:
    """(predicted − measured) / measured, or None when the row lacks either value."""
    predicted = (row.get(block) or {}).get(pred_key)
    measured = row.get(meas_key)
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def check_stored(row: dict) -> None:
    """Warn when a stored error field disagrees with the recomputed one."""
    stored = {("predicted", "step_time_s"): "predicted_step_error",
              ("predicted_calibrated", "step_time_s"): "predicted_calibrated_step_error",
              ("predicted", "peak_memory_bytes"): "predicted_memory_error"}
    for (block, key), field in stored.items():
        meas_key = "median_step_s" if key == "step_time_s" else key
        mine, theirs = error(row, block, key, meas_key), row.get(field)
        if mine is not None and theirs is not None and abs(mine - theirs) > 1e-9:
            print(f"warning: {row['run']}/{row['config']} {field} {theirs:+.4f} "
                  f"recomputed {mine:+.4f}", file=sys.stderr)


def median_abs(rows: list[dict], block: str, pred_key: str, meas_key: str) -> tuple[float | None, int]:
    """Median |error| over the rows that have the prediction, and how many did."""
    errors = [abs(e) for r in rows if (e := error(r, block, pred_key, meas_key)) is not None]
    return (statistics.median(errors) if errors else None), len(errors)


def main(argv: list[str]) -> int:
    """Print one line per row, then the medians over all rows and per path class."""
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    rows = [r for p in argv for r in autoshard_rows(Path(p))]
    print("| run | config | class | step err | cal step err | mem err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        check_stored(r)
        cells = [error(r, *m[1:]) for m in METRICS]
        shown = ["–" if e is None else f"{e * 100:+.0f}%" for e in cells]
        print(f"| {r['run']} | {r['config']} | {r['kind']} | " + " | ".join(shown) + " |")
    print("\n| rows | n | " + " | ".join(f"median abs err, {m[0]} (target {TARGETS[m[0]]:.0%})"
                                          for m in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for label, group in (("all", rows), ("efficient", [r for r in rows if r["kind"] == "efficient"]),
                         ("host-bound", [r for r in rows if r["kind"] == "host-bound"])):
        stats = [median_abs(group, *m[1:]) for m in METRICS]
        shown = ["–" if v is None else f"{v * 100:.1f}% (n={n})" for v, n in stats]
        print(f"| {label} | {len(group)} | " + " | ".join(shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
