"""Re-price recorded ``autoshard check`` rows with the current cost model: the traced bytes stay, the prediction is new.

A check's trace does not depend on the cost model, only on the runtime; its prediction does. For each row
of a ``check_scales.py`` folder (``rows/<case>.json`` with its ``plans/<case>.plan.json``) the model is
built and captured as ``check_scales.run_case`` does, ``check``'s own prediction (``autoshard/check._predict``,
``initialised_build_bytes``) is made for the recorded plan, and each recorded role's traced step is compared
with it. Rows must come from a runtime whose programs hold what they held then (the folder's commit).

    .venv/bin/python benchmarks/check_scales_reprice.py benchmarks/results/check_scales_cpu_2026-11-27 \\
        --only llama-70b gpt-175b --out /tmp/repriced.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from autoshard.check import _predict, initialised_build_bytes  # noqa: E402
from autoshard.cluster import Cluster  # noqa: E402
from autoshard.models import build  # noqa: E402
from autoshard.passes import capture  # noqa: E402
from autoshard.plan import Plan  # noqa: E402
from autoshard.search.cost_model import COST_MODEL_VERSION  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402


def reprice(folder: Path, case: str) -> dict:
    """One row's roles: traced step bytes, the recorded prediction and the current one."""
    row = json.loads((folder / "rows" / f"{case}.json").read_text())
    plan = Plan.load(str(folder / "plans" / f"{case}.plan.json"))
    model = build(row["spec"], device="meta", dtype=torch.bfloat16, **row["overrides"])
    graph = capture(model, seq_lens=(8, 16))
    train = TrainSpec(global_batch=row["global_batch"], seq_len=row["seq_len"], precision="bf16")
    predictions = _predict(plan, graph, train, Cluster.parse(row["cluster"]))
    build_bytes = initialised_build_bytes(predictions, plan, graph)
    roles = []
    for role in row["per_role"]:
        found = re.match(r"pp (\d+)", role["role"])
        predicted = max(build_bytes, predictions.memory_by_stage[int(found.group(1)) if found else 0])
        roles.append({"role": role["role"], "step_traced": role["step_traced"],
                      "step_predicted_recorded": role["step_predicted"], "step_predicted": int(predicted),
                      "step_error": round((role["step_traced"] - predicted) / predicted, 4),
                      "step_error_recorded": role["step_error"]})
    return {"case": case, "mesh": row["mesh"], "cost_model": COST_MODEL_VERSION, "roles": roles,
            "worst_step_error": max((r["step_error"] for r in roles), key=abs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--only", nargs="*", help="cases (default: every row)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cases = args.only or sorted(p.stem for p in (args.folder / "rows").glob("*.json"))
    out = []
    for case in cases:
        result = reprice(args.folder, case)
        out.append(result)
        print(f"{case:14s} {result['mesh']:48s} " + "  ".join(
            f"{r['role']}: {r['step_error_recorded']:+.2%} → {r['step_error']:+.2%}" for r in result["roles"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
