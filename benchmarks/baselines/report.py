"""Rows, derived metrics and the two output files of ``benchmarks/run.py``.

Per measured row (``finish_row``):

    tokens_per_s  = B·S / median_step_s                     (whole job)
    mfu           = model_flops_per_step / (median_step_s · world · peak_flops[precision])
    step_error    = (predicted step − measured step) / measured step
    memory_error  = (predicted peak − measured peak) / measured peak   (GPU only)

Loss agreement (``loss_agreement``): every config trains the same model from the
same weights on the same batches, so their per-step losses must agree up to
precision. For each pair, ``max_rel_diff = max over steps of |a − b| / |b|``,
judged against ``LOSS_RTOL`` (1e-2, the bf16 tolerance):

    megatron-tp     vs  autoshard's TP plan without SP (largest tp), else with SP
    megatron-tp-sp  vs  autoshard's TP plan with SP, else without
                        (no autoshard TP plan in the run, e.g. GPT: the searched plan, said so)
    deepspeed-z3    vs  fsdp2            (ZeRO-3 against ZeRO-3)
    deepspeed-z2    vs  fsdp2-noreshard  (ZeRO-2 against ZeRO-2)
    every config    vs  autoshard        (one summary line: the worst)

``results.json``: ``{"meta": {...}, "rows": [...], "loss_agreement": [...]}``;
``results.md``: one table (config, plan, tokens/s, MFU, peak memory, median
step, predictions and their errors, status), the mean absolute prediction error
over the autoshard rows, before and after calibration, and the loss agreement.
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
LOSS_RTOL = 1e-2  # bf16: the loss pairs agree when max_rel_diff <= this
# (baseline, autoshard row wanted): "tp" / "tp-sp" = autoshard's TP plan (without / with SP)
LOSS_PAIRS = (("megatron-tp", "tp"), ("megatron-tp-sp", "tp-sp"), ("deepspeed-z3", "fsdp2"),
              ("deepspeed-z2", "fsdp2-noreshard"))


def run_meta(args: Any, spec: Any, cluster: Any, world: int, model_flops: float) -> dict[str, Any]:
    """What the rows were measured on: model, shape, world, device, cluster peak, versions, date."""
    device_name = torch.cuda.get_device_name() if spec.device == "cuda" else platform.processor() or "cpu"
    return {
        "model": spec.model, "global_batch": spec.global_batch, "seq_len": spec.seq_len,
        "num_micro_batches": spec.num_micro_batches, "precision": spec.precision, "attn_impl": spec.attn_impl,
        "world_size": world,
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
    attn = f" (attention {meta['attn_impl']})" if meta.get("attn_impl") else ""
    head = (f"{meta['model']}{attn}, batch {meta['global_batch']} × seq {meta['seq_len']}, {meta['precision']}, "
            f"{meta['world_size']} × {meta['device_name']} ({meta['cluster']}), torch {meta['torch']}, {meta['date']}")
    lines = [head, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    summary = []
    for label, key in (("detected cluster", "predicted"), ("calibrated", "predicted_calibrated")):
        step, mem = mean_abs_error(rows, f"{key}_step_error"), mean_abs_error(rows, f"{key}_memory_error")
        if step is not None or mem is not None:
            summary.append(f"- autoshard rows, mean |error| ({label}): step {_fmt(step, 'mfu')}, "
                           f"memory {_fmt(mem, 'mfu')}")
    return "\n".join(lines + ([""] + summary if summary else []) + _loss_lines(loss_agreement(rows))) + "\n"


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and row.get("status") == "ok" and bool(row.get("losses"))


def _tp_row(rows: list[dict[str, Any]], sp: bool) -> dict[str, Any] | None:
    """The measured autoshard row with tp > 1, same SP setting first, then the largest tp."""
    found = [r for r in rows if r["config"].startswith("autoshard") and _ok(r) and (r.get("tp") or 1) > 1]
    found.sort(key=lambda r: (bool(r.get("sp")) != sp, -r["tp"]))
    return found[0] if found else None


def compare_losses(row: dict[str, Any], reference: dict[str, Any], basis: str) -> dict[str, Any]:
    """Step-1 and max relative loss difference of ``row`` against ``reference`` (module docstring)."""
    pairs = list(zip(row["losses"], reference["losses"]))
    diffs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in pairs]
    worst = max(diffs) if diffs else float("nan")
    return {"config": row["config"], "reference": reference["config"], "basis": basis, "steps": len(pairs),
            "step1_rel_diff": diffs[0] if diffs else None, "max_rel_diff": worst, "tolerance": LOSS_RTOL,
            "within_tolerance": bool(diffs) and math.isfinite(worst) and worst <= LOSS_RTOL}


def loss_agreement(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loss pairs of the module docstring that this run measured (both rows ok)."""
    by_name = {r["config"]: r for r in rows}
    out = []
    for name, wanted in LOSS_PAIRS:
        row = by_name.get(name)
        if not _ok(row):
            continue
        if wanted.startswith("tp"):
            reference, basis = _tp_row(rows, sp=wanted == "tp-sp"), "autoshard TP plan"
            if reference is None:
                reference, basis = by_name.get("autoshard"), "no autoshard TP plan in this run: the searched plan"
        else:
            reference, basis = by_name.get(wanted), "same ZeRO stage"
        if _ok(reference):
            out.append(compare_losses(row, reference, basis))
    anchor = by_name.get("autoshard")
    if _ok(anchor):
        others = [compare_losses(r, anchor, "every config vs the searched plan") for r in rows
                  if r is not anchor and _ok(r)]
        if others:
            worst = max(others, key=lambda c: c["max_rel_diff"])
            out.append({**worst, "config": f"all {len(others)} others (worst: {worst['config']})"})
    return out


def _loss_lines(agreement: list[dict[str, Any]]) -> list[str]:
    if not agreement:
        return []
    lines = ["", f"Loss agreement (|a − b| / |b| over every step; tolerance {LOSS_RTOL:g}, bf16):", "",
             "| config | vs | basis | steps | step-1 diff | max diff | within |", "|---|---|---|---|---|---|---|"]
    for c in agreement:
        step1 = "–" if c["step1_rel_diff"] is None else f"{c['step1_rel_diff']:.2e}"
        lines.append(f"| {c['config']} | {c['reference']} | {c['basis']} | {c['steps']} | {step1} | "
                     f"{c['max_rel_diff']:.2e} | {'yes' if c['within_tolerance'] else 'NO'} |")
    return lines


def write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``out/results.json`` and ``out/results.md`` (replacing earlier versions of this run)."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": rows, "loss_agreement": loss_agreement(rows)}
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(meta, rows))


__all__ = ["LOSS_RTOL", "compare_losses", "finish_row", "loss_agreement", "markdown", "mean_abs_error", "plan_summary",
           "run_meta", "write"]
