"""Rows, derived metrics and the two output files of ``benchmarks/run.py``.

Per measured row (``finish_row``):

    tokens_per_s  = B·S / median_step_s                     (whole job)
    mfu           = model_flops_per_step / (median_step_s · world · peak_flops[precision])
    step_error    = (predicted step − measured step) / measured step
    memory_error  = (predicted peak − measured peak) / measured peak   (GPU only)

``results.json``: ``{"meta": {...}, "rows": [...]}``; ``results.md``: one table
(config, plan, tokens/s, MFU, peak memory, median step, predictions and their
errors, status) and the mean absolute prediction error over the autoshard rows,
before and after calibration.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

import torch

from autoshard.plan import Plan

GIB = 2**30


def run_meta(args: Any, spec: Any, cluster: Any, world: int, model_flops: float) -> dict[str, Any]:
    """What the rows were measured on: model, shape, world, device, cluster peak, versions, date."""
    device_name = torch.cuda.get_device_name() if spec.device == "cuda" else platform.processor() or "cpu"
    return {
        "model": spec.model, "global_batch": spec.global_batch, "seq_len": spec.seq_len,
        "num_micro_batches": spec.num_micro_batches, "precision": spec.precision, "world_size": world,
        "device": spec.device, "device_name": device_name, "cluster": cluster.name,
        "peak_flops": cluster.peak_flops(spec.precision), "model_flops_per_step": model_flops,
        "steps": args.steps, "warmup": args.warmup, "plans": args.plans,
        "calibration": str(args.calibration) if args.calibration else None,
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def plan_summary(plan: Plan) -> str:
    """``dp_shard=8; zero3×13; m=1 mb=2``: mesh degrees > 1, state counts (·TP), micro-batching."""
    axes = " ".join(f"{a}={getattr(plan.mesh, a)}" for a in ("dp_replicate", "dp_shard", "tp") if getattr(plan.mesh, a) > 1)
    counts: dict[str, int] = {}
    for s in plan.layers:
        key = s.state + ("·TP" if s.tp == "megatron" else "")
        counts[key] = counts.get(key, 0) + 1
    states = " ".join(f"{k}×{v}" for k, v in sorted(counts.items()))
    return f"{axes or 'world=1'}; {states}; m={plan.schedule.num_micro_batches} mb={plan.schedule.micro_batch}"


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or not measured or not math.isfinite(measured):
        return None
    return (predicted - measured) / measured


def finish_row(row: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Add tokens/s, MFU and prediction errors to a measured row (module docstring)."""
    step = row.get("median_step_s")
    if row.get("status") == "ok" and step:
        row["tokens_per_s"] = meta["global_batch"] * meta["seq_len"] / step
        row["mfu"] = meta["model_flops_per_step"] / (step * meta["world_size"] * meta["peak_flops"])
    for key in ("predicted", "predicted_calibrated"):
        pred = row.get(key) or {}
        row[f"{key}_step_error"] = _error(pred.get("step_time_s"), step)
        row[f"{key}_memory_error"] = _error(pred.get("peak_memory_bytes"), row.get("peak_memory_bytes"))
    return row


def mean_abs_error(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean |error| of ``key`` over the measured autoshard rows (None when there is none)."""
    errors = [abs(r[key]) for r in rows if r["config"].startswith("autoshard") and r.get(key) is not None]
    return sum(errors) / len(errors) if errors else None


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return {"ms": f"{value * 1e3:.1f}", "gib": f"{value / GIB:.2f}", "pct": f"{value * 100:+.0f}%",
            "mfu": f"{value * 100:.1f}%", "tok": f"{value:,.0f}"}[kind]


COLUMNS = ("config", "plan", "tokens/s", "MFU", "peak GiB", "step ms", "pred ms", "err", "pred GiB", "err",
           "cal ms", "err", "status")


def _cells(row: dict[str, Any]) -> list[str]:
    pred, cal = row.get("predicted") or {}, row.get("predicted_calibrated") or {}
    status = row["status"] if len(row["status"]) < 80 else row["status"][:77] + "..."
    return [row["config"], row.get("plan", ""), _fmt(row.get("tokens_per_s"), "tok"), _fmt(row.get("mfu"), "mfu"),
            _fmt(row.get("peak_memory_bytes"), "gib"), _fmt(row.get("median_step_s"), "ms"),
            _fmt(pred.get("step_time_s"), "ms"), _fmt(row.get("predicted_step_error"), "pct"),
            _fmt(pred.get("peak_memory_bytes"), "gib"), _fmt(row.get("predicted_memory_error"), "pct"),
            _fmt(cal.get("step_time_s"), "ms"), _fmt(row.get("predicted_calibrated_step_error"), "pct"),
            status.replace("|", "/")]


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The results table and the prediction-error summary, as markdown."""
    head = (f"{meta['model']}, batch {meta['global_batch']} × seq {meta['seq_len']}, {meta['precision']}, "
            f"{meta['world_size']} × {meta['device_name']} ({meta['cluster']}), torch {meta['torch']}, {meta['date']}")
    lines = [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    summary = []
    for label, key in (("detected cluster", "predicted"), ("calibrated", "predicted_calibrated")):
        step, mem = mean_abs_error(rows, f"{key}_step_error"), mean_abs_error(rows, f"{key}_memory_error")
        if step is not None or mem is not None:
            summary.append(f"- autoshard rows, mean |error| ({label}): step {_fmt(step, 'mfu')}, "
                           f"memory {_fmt(mem, 'mfu')}")
    return "\n".join(lines + ([""] + summary if summary else [])) + "\n"


def write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``out/results.json`` and ``out/results.md`` (replacing earlier versions of this run)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(meta, rows))


__all__ = ["finish_row", "markdown", "mean_abs_error", "plan_summary", "run_meta", "write"]
