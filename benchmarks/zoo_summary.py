"""Accuracy table of ``benchmarks/zoo_campaign.sh``: predicted against measured, per plan and per benchmark.

Reads every ``results.json`` under the given folders, and inside their ``sharded.tgz`` archives (the
session trees of ``benchmarks/sharded_session.sh``). Each ``ok`` row is one plan measured by
``benchmarks/run.py``: its median step (slowest rank) and peak memory (``max_memory_allocated``, max
over ranks), next to the cost model's prediction on the calibrated cluster (``predicted_calibrated``;
rows without a calibration fall back to ``predicted`` and are marked ``(uncal.)``). Autoshard rows are
the runtime executing a plan (``autoshard`` = the search's, ``autoshard-<variant>`` = forced); a
baseline row (FSDP2, DeepSpeed, Megatron) is predicted by its nearest autoshard plan.

Two tables:

1. **Per plan** (autoshard rows only: the cost model prices the runtime): step error and peak-memory
   error = (predicted − measured) / measured, and whether the plan was predicted to fit the card it
   ran on (``fits``: predicted peak ≤ the card) and did. The header gives median |error| over all
   rows (targets: step ≤ 10%, memory ≤ 5%).
2. **Ratios** (per model and world): the searched plan against each other measured config (forced
   plans and baselines): predicted ratio = predicted step(other) / predicted step(searched), measured
   ratio = the same on measured steps, and their agreement = predicted / measured − 1 (target within
   ±10%: the search's margin over a plan is what it believes, and this says whether to believe it).
   The headline counts the forced autoshard plans and the best baseline (the fastest measured
   non-autoshard config, a plan the runtime could run: its nearest plan is its equivalent); other
   baselines are listed (eager FSDP2 and DeepSpeed run code the cost model does not price).

    python benchmarks/zoo_summary.py DIR [DIR ...] > zoo.md
"""

from __future__ import annotations

import io
import json
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any, Iterator

GIB = 2**30


def _results(root: Path) -> Iterator[tuple[str, dict]]:
    """(where, results.json content) for every file under ``root`` and in its ``.tgz`` archives, nested
    ones included (``zoo_campaign.sh`` packs the sessions' ``sharded.tgz`` into ``zoo.tgz``)."""
    for path in sorted(root.rglob("results.json")):
        yield str(path.relative_to(root)), json.loads(path.read_text())
    for archive in sorted(root.rglob("*.tgz")):
        with tarfile.open(archive) as tar:
            yield from _archive_results(tar, archive.parent.name)


def _archive_results(tar: tarfile.TarFile, where: str) -> Iterator[tuple[str, dict]]:
    for member in tar.getmembers():
        data = tar.extractfile(member) if member.isfile() else None
        if data is None:
            continue
        name = f"{where}/{member.name.lstrip('./')}"
        if member.name.endswith("results.json"):
            yield name, json.load(io.TextIOWrapper(data))
        elif member.name.endswith(".tgz"):
            payload = data.read()
            if not payload:  # a session's archive packed while a neighbour session was still writing its own
                print(f"zoo_summary: skipped empty archive {name}", file=sys.stderr)
                continue
            with tarfile.open(fileobj=io.BytesIO(payload)) as inner:
                yield from _archive_results(inner, name)


def distinct_results(roots: list[Path]) -> Iterator[tuple[Path, str, dict]]:
    """(root, where, results.json content) over ``roots``, each distinct file once: a device call's
    archive may repack a tree that an earlier call's archive already holds."""
    seen = set()
    for root in roots:
        for where, data in _results(root):
            key = json.dumps(data, sort_keys=True)
            if key not in seen:
                seen.add(key)
                yield root, where, data


def calibration_file(root: Path, world: int) -> dict | None:
    """The calibration ``zoo_campaign.sh`` measured over ``world`` GPUs for the runs under ``root``:
    ``root/cal_x<world>.json``, else the same file packed in ``root``'s ``zoo.tgz``."""
    name = f"cal_x{world}.json"
    if (root / name).exists():
        return json.loads((root / name).read_text())
    for archive in sorted(root.rglob("zoo.tgz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.lstrip("./") == name:
                    return json.load(tar.extractfile(member))
    return None


def rows_of(roots: list[Path]) -> list[dict[str, Any]]:
    """One record per measured row: model, world, card, config, plan, measured and predicted figures."""
    out = []
    for _root, where, data in distinct_results(roots):
        meta = data.get("meta", {})
        for row in data.get("rows", []):
            if row.get("status") != "ok":
                continue
            pred = row.get("predicted_calibrated") or {}
            calibrated = "step_time_s" in pred
            if not calibrated:
                pred = row.get("predicted") or {}
            if "step_time_s" not in pred:
                continue
            out.append({"model": meta.get("model"), "world": meta.get("world_size"),
                        "card": meta.get("device_name"), "card_bytes": meta.get("device_memory_bytes"),
                        "config": row["config"], "plan": row.get("plan", ""), "where": where,
                        "measured_s": row["median_step_s"], "measured_bytes": row.get("peak_memory_bytes"),
                        "predicted_s": pred["step_time_s"], "predicted_bytes": pred.get("peak_memory_bytes"),
                        "calibrated": calibrated})
    return out


def _pooled(rows: list[dict]) -> list[dict]:
    """Rows of one (model, world, config, plan) pooled over processes: median measured step, largest peak."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["world"], r["config"], r["plan"]), []).append(r)
    out = []
    for group in groups.values():
        first = dict(group[0])
        first["measured_s"] = statistics.median(r["measured_s"] for r in group)
        peaks = [r["measured_bytes"] for r in group if r["measured_bytes"]]
        first["measured_bytes"] = max(peaks) if peaks else None
        first["processes"] = len(group)
        out.append(first)
    return sorted(out, key=lambda r: (r["model"], r["world"], r["config"]))


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:+.1f}%"


def _err(pred: float | None, meas: float | None) -> float | None:
    return None if not pred or not meas else (pred - meas) / meas


def per_plan(rows: list[dict]) -> list[str]:
    plans = [r for r in rows if r["config"].startswith("autoshard")]
    steps = [abs(_err(r["predicted_s"], r["measured_s"])) for r in plans]
    mems = [abs(e) for r in plans if (e := _err(r["predicted_bytes"], r["measured_bytes"])) is not None]
    lines = [f"## Per plan: {len(plans)} autoshard plans measured",
             "",
             f"median |step error| **{statistics.median(steps) * 100:.1f}%** (target ≤ 10%), "
             f"median |peak-memory error| **{statistics.median(mems) * 100:.1f}%** (target ≤ 5%)" if steps and mems
             else "no measured plan",
             "",
             "| model | GPUs | config | plan | measured ms | predicted ms | step error | measured GiB | predicted GiB "
             "| memory error | processes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in plans:
        mark = "" if r["calibrated"] else " (uncal.)"
        mb, pb = r["measured_bytes"], r["predicted_bytes"]
        lines.append(f"| {r['model']} | {r['world']} × {r['card']} | {r['config']} | {r['plan']} | "
                     f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f}{mark} | "
                     f"{_pct(_err(r['predicted_s'], r['measured_s']))} | "
                     f"{'–' if not mb else f'{mb / GIB:.2f}'} | {'–' if not pb else f'{pb / GIB:.2f}'} | "
                     f"{_pct(_err(pb, mb))} | {r['processes']} |")
    return lines


def ratios(rows: list[dict]) -> list[str]:
    lines = ["## The searched plan against the others: predicted and measured step ratios", "",
             "ratio = step(other) / step(searched): > 1 means the searched plan is faster. Agreement = predicted "
             "ratio / measured ratio − 1 (target within ±10%). Baselines are predicted by their nearest autoshard "
             "plan.", "",
             "| model | GPUs | other config | predicted ratio | measured ratio | agreement |", "|---|---|---|---|---|---|"]
    agreements = []
    by_bench: dict[tuple, list[dict]] = {}
    for r in rows:
        by_bench.setdefault((r["model"], r["world"]), []).append(r)
    for (model, world), group in sorted(by_bench.items()):
        searched = next((r for r in group if r["config"] == "autoshard"), None)
        if searched is None:
            continue
        baselines = [r for r in group if not r["config"].startswith("autoshard")]
        best = min(baselines, key=lambda r: r["measured_s"]) if baselines else None
        for other in group:
            if other is searched:
                continue
            pr = other["predicted_s"] / searched["predicted_s"]
            mr = other["measured_s"] / searched["measured_s"]
            counted = other is best or other["config"].startswith("autoshard")
            if counted:
                agreements.append(abs(pr / mr - 1))
            label = other["config"] + (" (best baseline)" if other is best else "" if counted else " (not counted)")
            lines.append(f"| {model} | {world} | {label} | {pr:.3f} | {mr:.3f} | {_pct(pr / mr - 1)} |")
    if agreements:
        lines[2:2] = [f"median |agreement| **{statistics.median(agreements) * 100:.1f}%**, worst "
                      f"{max(agreements) * 100:.1f}%, over {len(agreements)} counted pairs", ""]
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    rows = _pooled(rows_of([Path(a) for a in argv]))
    print("\n".join(["# Cost model against measured plans", ""] + per_plan(rows) + [""] + ratios(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
