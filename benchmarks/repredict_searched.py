"""Re-predict recorded searched-plan rows with the current cost model and a calibration (no GPU needed).

    python benchmarks/repredict_searched.py benchmarks/results/runtime_h100x2_2026-11-26_run3 \\
        --calibration-dir benchmarks/results/calibration_h100x2_2026-11-26_run2/with_compiled_scale

For every ``benchmarks/run.py`` results file under the given files or folders (``results.json``,
``*_results.json``) and each of its ``autoshard`` rows (the searched plan; forced variants have
other names and are left out, ``benchmarks/predict_recorded.py`` re-predicts those), this runs
the search again as ``run.py --list-plans`` does — the recorded model, attention path, batch,
sequence, precision and cluster, with ``CALIBRATION_DIR/<family>_<size>.json`` — and prints the
search's plan and its calibrated step time and peak memory beside the measured ones. A row whose
plan the search no longer picks says so (its error is then about another plan). Medians of
|error| close the table. ``--json`` writes the rows.

This is how a new calibration (``calibrate --compile``) or cost-model change is checked against
runs already made; docs/cost-model.md records its outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def result_files(paths: list[Path]) -> list[Path]:
    """The results JSON files named or found (recursively) under ``paths``, sorted."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += [p for p in path.rglob("*.json") if p.name == "results.json" or p.name.endswith("_results.json")]
        else:
            out.append(path)
    return sorted(set(out))


def search_prediction(meta: dict, calibration: Path | None, out_dir: Path) -> dict:
    """The search's best plan for a run's ``meta``: ``{"plan", "step_s", "memory_bytes"}`` (calibrated when given)."""
    from benchmarks.run import main as run_main

    argv = ["--list-plans", "--model", meta["model"], "--batch", str(meta["global_batch"]), "--seq",
            str(meta["seq_len"]), "--precision", meta["precision"], "--cluster",
            meta["cluster"].removeprefix("detected:"), "--device", "cpu", "--out", str(out_dir)]
    if meta.get("attn_impl"):
        argv += ["--attn", meta["attn_impl"]]
    if calibration is not None:
        argv += ["--calibration", str(calibration)]
    saved = dict(os.environ)  # run.py sets WORLD_SIZE and friends for Cluster.detect: keep the caller's
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # run.py prints its own table of plans
            run_main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    best = json.loads((out_dir / "plans.json").read_text())["plans"][0]
    pred = best["predicted_calibrated"] if calibration is not None else best["predicted"]
    return {"plan": best["plan"], "step_s": pred["step_time_s"], "memory_bytes": pred["peak_memory_bytes"]}


def calibration_for(model: str, folder: Path | None) -> Path | None:
    """``folder/<family>_<size>.json`` for ``model`` (``"llama:1.3b"``), when it exists."""
    if folder is None:
        return None
    path = folder / f"{model.replace(':', '_')}.json"
    return path if path.is_file() else None


def repredict(files: list[Path], calibration_dir: Path | None) -> list[dict]:
    """One dict per measured ``autoshard`` row (module docstring)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(files):
            data = json.loads(path.read_text())
            meta = data["meta"]
            for row in data["rows"]:
                if row["config"] != "autoshard" or row.get("status") != "ok":
                    continue
                calibration = calibration_for(meta["model"], calibration_dir)
                pred = search_prediction(meta, calibration, Path(tmp) / str(i))
                rows.append({"file": str(path), "model": meta["model"], "recorded_plan": row["plan"],
                             "plan": pred["plan"], "same_plan": pred["plan"] == row["plan"],
                             "calibration": str(calibration) if calibration else None,
                             "measured_s": row["median_step_s"], "predicted_s": pred["step_s"],
                             "measured_bytes": row.get("peak_memory_bytes"), "predicted_bytes": pred["memory_bytes"]})
    return rows


def _err(pred: float, measured: float | None) -> float | None:
    return None if not measured else (pred - measured) / measured


def _run_name(path: Path) -> str:
    """``folder`` for ``folder/results.json``, ``folder/stem`` for ``folder/<stem>_results.json``."""
    if path.name == "results.json":
        return path.parent.name
    return f"{path.parent.name}/{path.stem.removesuffix('_results')}"


def markdown(rows: list[dict]) -> str:
    """The table and the medians of |error| (module docstring)."""
    lines = ["| run | model | plan (search now) | measured ms | predicted ms | err | measured GiB | predicted GiB | err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step, mem = _err(r["predicted_s"], r["measured_s"]), _err(r["predicted_bytes"], r["measured_bytes"])
        plan = r["plan"] if r["same_plan"] else f"{r['plan']} (recorded: {r['recorded_plan']})"
        gib = "–" if not r["measured_bytes"] else f"{r['measured_bytes'] / 2**30:.2f}"
        lines.append(f"| {_run_name(Path(r['file']))} | {r['model']} | {plan} | {r['measured_s'] * 1e3:.1f} "
                     f"| {r['predicted_s'] * 1e3:.1f} | {step:+.1%} | {gib} | {r['predicted_bytes'] / 2**30:.2f} "
                     f"| {'–' if mem is None else f'{mem:+.1%}'} |")
    same = [r for r in rows if r["same_plan"]]
    for label, key, meas in (("step", "predicted_s", "measured_s"), ("peak memory", "predicted_bytes", "measured_bytes")):
        errs = [abs(_err(r[key], r[meas])) for r in same if r[meas]]
        if errs:
            lines.append(f"- median |error| {label}: {statistics.median(errs):.1%} over {len(errs)} rows whose plan "
                         f"the search still picks")
    if len(same) < len(rows):
        lines.append(f"- {len(rows) - len(same)} rows: the search now picks another plan (left out of the medians)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="results JSON files or folders holding them")
    parser.add_argument("--calibration-dir", type=Path, help="folder of <family>_<size>.json calibration files")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    files = result_files(args.paths)
    if not files:
        parser.error(f"no results JSON under {[str(p) for p in args.paths]}")
    rows = repredict(files, args.calibration_dir)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
