"""``autoshard check`` at published scales: the searched plan of each case, its rank roles built at the real world size.

Cases (the model built on meta in bf16, as the CLI builds it; captured; searched on the cluster; checked):

==================  =========================================================  ================  ===============
case                model                                                      cluster           global batch × seq
==================  =========================================================  ================  ===============
llama-70b           ``llama:70b`` (Llama-2 70B, GQA 8)                         h100-sxm:8x8      128 × 4096
mixtral-8x7b        ``moe:8x7b`` (8 experts, top-2), trained at seq 4096       h100-sxm:8x8      256 × 4096
gpt-175b            GPT, 96 layers, h 12288, 96 heads, vocab 51200 (PTD-P)     a100-80gb:48x8    96 × 2048
gpt-530b            GPT, 105 layers, h 20480, 128 heads, vocab 51200 (PTD-P)   a100-80gb:280x8   560 × 2048
gpt-1t              GPT, 128 layers, h 25600, 160 heads, vocab 51200 (PTD-P)   a100-80gb:384x8   384 × 2048
==================  =========================================================  ================  ===============

The PTD-P shapes are Narayanan et al. 2021 (Table 1; vocabulary padded to 51200 as Megatron-LM does), with
the reference GPT family's tied embeddings, which the runtime does not pipeline (``tied/pp``: pp = 1, so
the search shards them over tp 8 × dp instead of PTD-P's pipeline);
their global batches (1536–3072), and Llama's 4M tokens, are cut so that a rank's step has few
micro-batches: the check runs every micro-batch of two steps on meta, and its time grows with them (a
first run of Llama-70B at 1024 × 4096 was searched to pp 4 with 256 micro-batches and stopped: at the
rate measured below, tens of minutes a role on this CPU); the memory peak does not grow with them (one micro-batch's activations per stage,
the schedule's in-flight count on a pipeline).

Per case: the search (``autoshard.search.solve``, ``--time-limit`` s), then ``autoshard/check.check_plan``
with at most ``--max-roles`` roles (beyond that the first and last pipeline stage's corner roles, then a
seeded sample: ``_check_match.select_roles``). Written per case to ``<out>/rows/<case>.json`` (so cases can
run in separate processes) and merged into ``<out>/check_scales.json``: model, cluster, plan mesh and
schedule, roles built of the mesh's, whether the collectives match, per role traced and predicted build
and step bytes, the worst step error, search and check seconds, and the verdict (pass: collectives match
and no role above its prediction by more than 5%).

    .venv/bin/python benchmarks/check_scales.py --only llama-70b --max-roles 2
    .venv/bin/python benchmarks/check_scales.py --merge   # rows → check_scales.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.models import build
from autoshard.passes import capture
from autoshard.check import TOLERANCE, check_plan
from autoshard.search import solve
from autoshard.train import TrainSpec

_PTDP = dict(vocab_size=51200, max_seq_len=2048)
CASES: dict[str, dict] = {
    "llama-70b": dict(spec="llama:70b", overrides={}, cluster="h100-sxm:8x8", global_batch=128, seq_len=4096),
    "mixtral-8x7b": dict(spec="moe:8x7b", overrides={}, cluster="h100-sxm:8x8", global_batch=256, seq_len=4096),
    "gpt-175b": dict(spec="gpt:7b", overrides=dict(_PTDP, hidden=12288, num_layers=96, num_heads=96),
                     cluster="a100-80gb:48x8", global_batch=96, seq_len=2048),
    "gpt-530b": dict(spec="gpt:7b", overrides=dict(_PTDP, hidden=20480, num_layers=105, num_heads=128),
                     cluster="a100-80gb:280x8", global_batch=560, seq_len=2048),
    "gpt-1t": dict(spec="gpt:7b", overrides=dict(_PTDP, hidden=25600, num_layers=128, num_heads=160),
                   cluster="a100-80gb:384x8", global_batch=384, seq_len=2048),
}
DEFAULT_OUT = Path("benchmarks/results/check_scales_cpu_2026-11-27")


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), with its core count."""
    name = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores (shared)"


def run_case(name: str, max_roles: int, time_limit_s: float, out: Path) -> dict:
    """Search and check one case; the row written to ``out/rows/<name>.json``."""
    case = CASES[name]
    start = time.perf_counter()
    model = build(case["spec"], device="meta", dtype=torch.bfloat16, **case["overrides"])
    graph = capture(model, seq_lens=(8, 16))
    params = sum(p.numel() for p in model.parameters())
    cluster = Cluster.parse(case["cluster"])
    train = TrainSpec(global_batch=case["global_batch"], seq_len=case["seq_len"], precision="bf16")
    row = {"case": name, **case, "params": params, "world_size": cluster.world_size,
           "capture_s": round(time.perf_counter() - start, 1)}
    start = time.perf_counter()
    try:
        plan = solve(graph, cluster, train, time_limit_s=time_limit_s)
    except AutoshardError as err:
        return _write(out, {**row, "searched": False, "error": str(err)[:300],
                            "search_s": round(time.perf_counter() - start, 1), "passed": False})
    row.update(searched=True, search_s=round(time.perf_counter() - start, 1), mesh=str(plan.mesh),
               schedule=plan.schedule.to_dict() if hasattr(plan.schedule, "to_dict") else str(plan.schedule),
               solver_status=plan.solver.status if getattr(plan, "solver", None) else None)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    plan.save(str(out / "plans" / f"{name}.plan.json"))
    start = time.perf_counter()
    try:
        report = check_plan(plan, model, graph, train, cluster=cluster, max_roles=max_roles)
    except AutoshardError as err:  # a plan the runtime refuses to build is a failed check, recorded as such
        return _write(out, {**row, "built": False, "error": f"{type(err).__name__}: {str(err)[:300]}",
                            "check_s": round(time.perf_counter() - start, 1), "passed": False})
    seconds = time.perf_counter() - start
    roles = [{"role": r.label, "rank": r.role.rank, "ranks": r.role.num_ranks, "collectives": r.collectives,
              "build_traced": r.build_bytes, "build_predicted": r.predicted_build,
              "step_traced": r.step_bytes, "step_predicted": r.predicted_step,
              "step_error": round(r.step_error, 4), "build_error": round(r.build_error, 4),
              "seconds": round(r.seconds, 1)} for r in report.roles]
    worst = max(report.roles, key=lambda r: max(r.step_error, r.build_error))
    row.update(built=True, roles_built=len(report.roles), roles=report.num_roles, max_roles=max_roles,
               collectives_match=report.collective_mismatch is None, collective_mismatch=report.collective_mismatch,
               memory_checked=report.memory_checked, memory_overflow=report.memory_overflow,
               worst_role=worst.label, worst_step_traced=worst.step_bytes, worst_step_predicted=worst.predicted_step,
               worst_step_error=round(worst.step_error, 4), worst_build_error=round(worst.build_error, 4),
               check_s=round(seconds, 1), seconds_per_role=round(seconds / max(len(report.roles), 1), 1),
               passed=report.ok, tolerance=TOLERANCE, per_role=roles)
    return _write(out, row)


def _write(out: Path, row: dict) -> dict:
    (out / "rows").mkdir(parents=True, exist_ok=True)
    (out / "rows" / f"{row['case']}.json").write_text(json.dumps(row, indent=2) + "\n")
    return row


def merge(out: Path) -> dict:
    """Every case row under ``out/rows`` (in ``CASES`` order) into ``out/check_scales.json``."""
    rows = [json.loads((out / "rows" / f"{name}.json").read_text()) for name in CASES
            if (out / "rows" / f"{name}.json").exists()]
    summary = {"device": cpu_name(), "torch": torch.__version__, "tolerance": TOLERANCE,
               "cases": len(rows), "passed": sum(r["passed"] for r in rows), "rows": rows}
    (out / "check_scales.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def markdown_table(summary: dict) -> str:
    """One row per case: model, cluster, mesh, roles built, collectives, worst role's step memory, error, seconds."""
    lines = ["| case | cluster | plan mesh (schedule) | roles built | collectives | worst role: step GiB predicted / "
             "traced | error | check s | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary["rows"]:
        if not r.get("searched"):
            lines.append(f"| {r['case']} | `{r['cluster']}` | no plan: {r['error'][:80]} | — | — | — | — | — | fail |")
            continue
        mesh = r["mesh"].replace(" ep=1", "").replace(" cp=1", "").replace("dp_replicate", "dp_r").replace("dp_shard", "dp_s")
        if not r.get("built"):
            lines.append(f"| {r['case']} | `{r['cluster']}` | {mesh} ({r['schedule']}) | 0 of — | — | — | — | "
                         f"{r['check_s']} | fail: {r['error'][:120]} |")
            continue
        verdict = "pass" if r["passed"] else f"fail: {r['collective_mismatch'] or r['memory_overflow']}"
        lines.append(f"| {r['case']} | `{r['cluster']}` | {mesh} ({r['schedule']}) | {r['roles_built']} of "
                     f"{r['roles']} | {'match' if r['collectives_match'] else 'mismatch'} | {r['worst_role']}: "
                     f"{_gib(r['worst_step_predicted'])} / {_gib(r['worst_step_traced'])} | "
                     f"{r['worst_step_error']:+.1%} | {r['check_s']:.0f} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="run this case (repeatable)")
    parser.add_argument("--max-roles", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=300.0, help="search time limit, seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--merge", action="store_true", help="only merge the rows written so far")
    args = parser.parse_args()
    if not args.merge:
        for name in args.only or list(CASES):
            row = run_case(name, args.max_roles, args.time_limit, args.out)
            print(json.dumps({k: v for k, v in row.items() if k != "per_role"}), flush=True)
    summary = merge(args.out)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    print(markdown_table(summary))


if __name__ == "__main__":
    main()
