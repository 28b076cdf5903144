"""Tables of an RL-step campaign (``benchmarks/rl_campaign.sh``): measured against predicted, floors, reshard.

``python benchmarks/rl_summary.py DIR`` reads DIR/<run>.jsonl (``autoshard ppo`` metrics, rank 0),
DIR/<run>.plan.json (the plan with its rollout section), DIR/floor.jsonl and DIR/reshard.jsonl, and prints
markdown. Measured = the median over steps 2.. (step 1 warms up); phases map to the prediction as
generate ↔ time/generate, reshard ↔ time/weight_sync, score ↔ time/logprobs + time/reference + time/values,
train ↔ time/train, RL step ↔ time/step. Rollout tokens/s = sequences × mean response length / generate.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


# phase → the metrics (summed) it is measured by; the plan's rollout section prices each (module docstring)
PHASES = {"generate": ("time/generate",), "reshard": ("time/weight_sync",),
          "score": ("time/logprobs", "time/reference", "time/values"), "advantages": ("time/advantages",),
          "train": ("time/train",), "step": ("time/step",)}


def _median(rows: list[dict], key: str) -> float:
    values = [r.get(key, 0.0) for r in rows[1:]] or [r.get(key, 0.0) for r in rows]
    return statistics.median(values) if values else 0.0


def measured_phases(rows: list[dict]) -> dict[str, float]:
    """Per phase of ``PHASES``, the median over steps 2.. of ``rows`` (the metrics of the steps, in order)."""
    return {phase: sum(_median(rows, key) for key in keys) for phase, keys in PHASES.items()}


def run_rows(folder: Path) -> list[dict]:
    out = []
    for metrics in sorted(folder.glob("x*.jsonl")):
        plan_file = metrics.with_suffix(".plan.json")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "time/step" in r]
        if not rows or not plan_file.exists():
            continue
        plan = json.loads(plan_file.read_text())
        rollout = (plan.get("rollout") or [None])[0]
        if rollout is None:
            continue
        c = rollout["chosen"]
        measured = measured_phases(rows)
        predicted = {"generate": c["generate_s"], "reshard": c["reshard_s"], "score": c["score_s"],
                     "advantages": c.get("advantages_s", 0.0), "train": c["train_s"], "step": c["rl_step_s"]}
        tokens = rollout["sequences"] * _median(rows, "response/length")
        mesh = plan["mesh"]
        out.append({"run": metrics.stem, "world": mesh["dp_replicate"] * mesh["dp_shard"] * mesh["tp"] * mesh["pp"] * mesh["cp"],
                    "model": plan["model_name"], "rollout_tp": rollout["tp"], "training_mesh": c["training_mesh"],
                    "measured": measured, "predicted": predicted, "rollout_tokens_per_s": tokens / measured["generate"],
                    "response_len": _median(rows, "response/length"), "peak_gb": _median(rows, "memory/peak_gb"),
                    "predicted_peak_gb": c["peak_bytes"] / 1e9, "steps": len(rows)})
    return out


def _err(m: float, p: float) -> str:
    return f"{(p - m) / m:+.1%}" if m > 0 else "-"


def main(folder: str) -> int:
    root = Path(folder)
    runs = run_rows(root)
    print("| run | model | GPUs | training | rollout tp | generate m / p | reshard m / p | score m / p | advantages m / p "
          "| train m / p | RL step m / p | error | rollout tok/s | peak GB m / p |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        m, p = r["measured"], r["predicted"]
        cells = " | ".join(f"{m[k]:.3g} / {p[k]:.3g}" for k in ("generate", "reshard", "score", "advantages", "train", "step"))
        print(f"| {r['run']} | {r['model']} | {r['world']} | {r['training_mesh']} | {r['rollout_tp']} | {cells} | "
              f"{_err(m['step'], p['step'])} | {r['rollout_tokens_per_s']:,.0f} | {r['peak_gb']:.1f} / {r['predicted_peak_gb']:.1f} |")
    floors = [json.loads(line) for line in (root / "floor.jsonl").read_text().splitlines()] if (root / "floor.jsonl").exists() else []
    if floors:
        print("\n| floor: HF generate, 1 GPU | batch | new tokens | tokens/s | best autoshard run | its tokens/s | ratio |")
        print("|---|---|---|---|---|---|---|")
        for f in floors:
            mine = [r for r in runs if r["model"].startswith(f["model"].split(":")[0]) and r["model"] == f["model"]]
            best = max(mine, key=lambda r: r["rollout_tokens_per_s"], default=None)
            tail = (f"{best['run']} | {best['rollout_tokens_per_s']:,.0f} | {best['rollout_tokens_per_s'] / f['tokens_per_s']:.2f}×"
                    if best else "- | - | -")
            print(f"| {f['model']} ({f['device']}) | {f['batch']} | {f['new']} | {f['tokens_per_s']:,.0f} | {tail} |")
    reshards = [json.loads(line) for line in (root / "reshard.jsonl").read_text().splitlines()] if (root / "reshard.jsonl").exists() else []
    if reshards:
        print("\n| reshard | training | rollout tp | bytes in / rank | measured | predicted | NVLink limit | measured / limit |")
        print("|---|---|---|---|---|---|---|---|")
        for r in reshards:
            limit = r.get("physical_limit_s", 0.0)
            print(f"| {r['model']} | {r['train_mesh'].split(' (')[0]} | {r['rollout_tp']} | {r.get('bytes_received', 0) / 1e9:.2f} GB | "
                  f"{r['seconds'] * 1e3:.1f} ms | {r.get('predicted_s', 0) * 1e3:.1f} ms | {limit * 1e3:.1f} ms | "
                  f"{(r['seconds'] / limit if limit else float('nan')):.2f} |")
    print(f"\n{len(runs)} runs; m = measured median over steps 2.., p = predicted (plan's rollout section).")
    json.dump(runs, sys.stderr, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
