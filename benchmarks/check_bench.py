"""Property benchmark of ``autoshard check``: random models, clusters and pins; every searched plan is checked.

Each case draws a reference family (``autoshard.models.FAMILIES``) at a small random size, built in
bf16 as the CLI builds it (capture prices activations in the dtype it sees), a cluster of 1–512 nodes
(log-uniform, so node counts such as 3, 48 or 280 come up) × 1–8 H100s, a global batch and sometimes a
pinned layer strategy; the search (``autoshard.search.solve``, ``--search-s``) returns a plan and
``autoshard/check.check_plan`` builds its roles (at most ``--max-roles`` each) under the fake process
group. Written: per case the plan's mesh, the roles built, the seconds, whether the collectives matched
and the worst memory error; totals (``passed``: collectives match and memory within tolerance); to
``--out`` (the campaign folder ``benchmarks/results/check_property_cpu_<date>/``).

    .venv/bin/python benchmarks/check_bench.py --cases 200 --max-roles 2 --budget-s 1500
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.models import FAMILIES, build
from autoshard.passes import capture
from autoshard.check import check_plan
from autoshard.search import solve
from autoshard.search.space import Constraints
from autoshard.train import TrainSpec

try:
    from benchmarks.check_scales import cpu_name
except ImportError:  # run as a script: benchmarks/ is the script's folder
    from check_scales import cpu_name

STATES = ("replicate", "zero1", "zero2", "zero3")


def random_case(rng: random.Random) -> dict:
    """One case: model spec and overrides, cluster, train step and pins (drawn from ``rng``)."""
    family = rng.choice(sorted(FAMILIES))
    overrides = {"hidden": rng.choice((64, 128)), "num_layers": rng.choice((2, 3, 4)), "num_heads": 4}
    nodes = min(512, int(round(2 ** rng.uniform(0, 9))))  # 1–512, log-uniform
    devices = rng.randint(1, 8)
    world = nodes * devices
    return {"spec": f"{family}:tiny", "overrides": overrides, "cluster": f"h100-sxm:{nodes}x{devices}",
            "global_batch": world * rng.choice((1, 2)), "seq_len": rng.choice((16, 32)),
            "pin": rng.choice((None, "state", "recompute"))}


def run_case(case: dict, rng: random.Random, max_roles: int, search_s: float = 20.0) -> dict:
    """Search the case's plan (``search_s`` seconds at most) and check it; the row written to the results."""
    model = build(case["spec"], device="meta", dtype=torch.bfloat16, **case["overrides"])
    graph = capture(model, seq_lens=(8, 16))
    train = TrainSpec(global_batch=case["global_batch"], seq_len=case["seq_len"], precision="bf16")
    pin = {}
    if case["pin"] == "state":
        pin = {rng.choice(graph.layers).name: {"state": rng.choice(STATES)}}
    elif case["pin"] == "recompute":
        pin = {rng.choice(graph.layers).name: {"recompute": "full"}}
    cluster = Cluster.parse(case["cluster"])
    row = {**case, "pins": pin}
    try:
        plan = solve(graph, cluster, train, constraints=Constraints(pin=pin), time_limit_s=search_s)
    except AutoshardError as err:  # an infeasible draw is not a check
        return {**row, "searched": False, "error": str(err)[:200]}
    start = time.perf_counter()
    report = check_plan(plan, model, graph, train, cluster=cluster, max_roles=max_roles)
    seconds = time.perf_counter() - start
    errors = [r.step_error for r in report.roles] + [r.build_error for r in report.roles]
    return {**row, "searched": True, "mesh": str(plan.mesh), "world_size": plan.mesh.world_size,
            "roles_built": len(report.roles), "roles": report.num_roles, "check_s": round(seconds, 2),
            "collectives_match": report.collective_mismatch is None, "collective_mismatch": report.collective_mismatch,
            "memory_within_tolerance": report.memory_overflow is None, "memory_overflow": report.memory_overflow,
            "worst_memory_error": round(max(errors), 4) if report.memory_checked else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--max-roles", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop drawing cases after this many seconds")
    parser.add_argument("--search-s", type=float, default=20.0, help="search time limit per case, seconds")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/check_property_cpu_2026-11-27/check_property.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows, start = [], time.perf_counter()
    for i in range(args.cases):
        if time.perf_counter() - start > args.budget_s:
            break
        row = run_case(random_case(rng), rng, args.max_roles, args.search_s)
        rows.append(row)
        print(i, json.dumps(row), flush=True)
    checked = [r for r in rows if r["searched"]]
    summary = {
        "device": cpu_name(), "torch": torch.__version__, "seed": args.seed, "max_roles": args.max_roles,
        "search_s": args.search_s, "cases": len(rows), "plans_checked": len(checked),
        "passed": sum(r["collectives_match"] and r["memory_within_tolerance"] for r in checked),
        "collectives_match": sum(r["collectives_match"] for r in checked),
        "memory_within_tolerance": sum(r["memory_within_tolerance"] for r in checked),
        "roles_built": sum(r["roles_built"] for r in checked),
        "seconds_per_check": round(sum(r["check_s"] for r in checked) / max(len(checked), 1), 2),
        "seconds_per_role": round(sum(r["check_s"] for r in checked) / max(sum(r["roles_built"] for r in checked), 1), 2),
        "wall_s": round(time.perf_counter() - start, 1), "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
