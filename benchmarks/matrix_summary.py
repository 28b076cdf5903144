"""One markdown page over the runs of ``gpu_session.sh matrix``: a line per (model, world), then each table.

    python benchmarks/matrix_summary.py OUT/matrix > summary.md

Reads every ``OUT/matrix/*/results.json`` (``benchmarks/run.py``) and prints, per run:
model, world, the searched plan's and the best baseline's tokens/s (and their ratio), how
many autoshard plans were measured with predictions, the mean |error| of predicted step
time and memory over them, the loss-agreement verdicts (``report.loss_agreement``), and
the run's summed config wall time; then every run's own ``results.md`` table. Nothing is
measured here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks.baselines import report  # noqa: E402


def _best(rows: list[dict], autoshard: bool) -> dict | None:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")
          and r["config"].startswith("autoshard") == autoshard]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f}%"


def summary_line(name: str, data: dict) -> str:
    """One table row: model, world, searched vs best baseline, plans measured, errors, loss verdicts, wall."""
    meta, rows = data["meta"], data["rows"]
    searched = next((r for r in rows if r["config"] == "autoshard" and r.get("status") == "ok"), None)
    baseline = _best(rows, autoshard=False)
    ratio = (f"{searched['tokens_per_s'] / baseline['tokens_per_s']:.2f}×"
             if searched and baseline and searched.get("tokens_per_s") else "–")
    measured = [r for r in rows if r["config"].startswith("autoshard") and r.get("status") == "ok"
                and (r.get("predicted") or {}).get("step_time_s")]
    verdicts = " ".join(f"{c['config']}≈{c['reference']}:{'yes' if c['within_tolerance'] else 'NO'}"
                        f"({c['max_rel_diff']:.1e})" for c in data.get("loss_agreement", []))
    failed = [r["config"] for r in rows if not r.get("status", "").startswith(("ok", "skipped"))]
    wall = sum(r.get("wall_s") or 0.0 for r in rows)
    cells = [name, meta["model"], str(meta["world_size"]),
             f"{searched['tokens_per_s']:,.0f}" if searched else "–",
             f"{baseline['config']} {baseline['tokens_per_s']:,.0f}" if baseline else "–", ratio,
             str(len(measured)), _pct(report.mean_abs_error(rows, "predicted_step_error")),
             _pct(report.mean_abs_error(rows, "predicted_memory_error")), verdicts or "–",
             ", ".join(failed) or "–", f"{wall:.0f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    """Print the summary of the run folders under ``argv[0]``."""
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    runs = sorted(Path(argv[0]).glob("*/results.json"))
    datas = [(path.parent.name, json.loads(path.read_text())) for path in runs]
    print("| run | model | world | autoshard tok/s | best baseline tok/s | ratio | plans measured | step err | "
          "mem err | loss agreement (max rel diff) | failed | config wall s |")
    print("|" + "---|" * 12)
    for name, data in datas:
        print(summary_line(name, data))
    for name, data in datas:
        print(f"\n## {name}\n")
        print(report.markdown(data["meta"], data["rows"]))
    if not datas:
        print(f"\n(no results.json under {argv[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
