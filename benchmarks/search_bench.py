"""Time the search on four reference problems and record the plans it finds.

Problems (synthetic graphs from ``search/synthetic.py``; targets on a 2-core CPU):

==============  =====================  ============  ======
model           cluster                global batch  target
==============  =====================  ============  ======
llama-7b        1 × 8 H100 SXM         512 × 4096    2 s
llama-70b       8 × 8 H100 SXM         1024 × 4096   10 s
gpt-1t (128 L)  384 × 8 A100 80GB      3072 × 2048   60 s
mixtral-8x7b    8 × 8 H100 SXM         1024 × 4096   10 s
==============  =====================  ============  ======

plus the captured reference graph of llama:7b (``passes.capture.capture_reference``) on the
7B problem; its capture time is reported apart from the search time (``capture_s``), and the
captured graph is kept in memory for the process.

Per problem, ``phases`` splits the wall time (seconds, exclusive): ``candidates`` (mesh
enumeration, probe bounds), ``tables`` (memory probe, cost tables, dominance, table bounds),
``upper`` (the heuristic incumbent, ``search/incumbent.py``), ``cpsat`` (build and solve), and
counts the candidates, refinements and CP-SAT solves (by status). The phases are measured by
wrapping the solver's internal functions in this process only. Each problem is solved ``--repeat``
times (default 3); ``wall_s`` is the median, ``wall_runs_s`` all of them, ``cpu_s`` the median run's
process CPU time (all CP-SAT threads counted; on a shared host it is the steadier number) and
``load_avg_1m`` the host's 1-minute load average before each run.

Uses the real cost model when it is implemented, else ``toy_layer_cost``.
Writes ``benchmarks/results/search_<date>.json`` and prints a table.
Run from the repository root: ``.venv/bin/python benchmarks/search_bench.py [--only NAME] [--no-capture]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the editable install maps autoshard.search only with the root on sys.path

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoshard.search import cost_model, solve, solver  # noqa: E402
from autoshard.search.synthetic import (  # noqa: E402
    GPT_1T, LLAMA_7B, LLAMA_70B, MIXTRAL_8X7B, synthetic_cluster, synthetic_graph, toy_layer_cost,
)
from autoshard.train import TrainSpec  # noqa: E402

PROBLEMS = (
    ("llama-7b/8", LLAMA_7B, "h100-sxm", 1, TrainSpec(global_batch=512, seq_len=4096), 2.0),
    ("llama-70b/64", LLAMA_70B, "h100-sxm", 8, TrainSpec(global_batch=1024, seq_len=4096), 10.0),
    ("gpt-1t/3072", GPT_1T, "a100-80gb", 384, TrainSpec(global_batch=3072, seq_len=2048), 60.0),
    ("mixtral-8x7b/64", MIXTRAL_8X7B, "h100-sxm", 8, TrainSpec(global_batch=1024, seq_len=4096), 10.0),
)


def _cost_fn():
    graph = synthetic_graph(LLAMA_7B)
    try:
        from autoshard.plan import LayerStrategy, Mesh, Schedule

        cost_model.layer_cost(graph.layers[1], LayerStrategy(layer=graph.layers[1].name), Mesh(),
                              synthetic_cluster(), TrainSpec(global_batch=1, seq_len=8), Schedule())
        return None, f"cost_model v{cost_model.COST_MODEL_VERSION}"
    except NotImplementedError:
        return toy_layer_cost, "toy_layer_cost (real cost model not implemented)"


PHASES = {"_candidates": "candidates", "_refine": "tables", "_note_upper": "upper", "_solve_candidate": "cpsat"}


@contextlib.contextmanager
def _phase_profile():
    """Exclusive wall seconds, CPU seconds (process time: every CP-SAT worker thread counted) and call
    counts per solver phase (``PHASES``), by wrapping the functions."""
    seconds, cpu, calls, stack = (collections.defaultdict(float), collections.defaultdict(float),
                                  collections.Counter(), [])
    originals = {name: getattr(solver, name) for name in PHASES}

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack.append([0.0, 0.0])
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total, total_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                inner, inner_cpu = stack.pop()
                seconds[PHASES[name]] += total - inner
                cpu[PHASES[name]] += total_cpu - inner_cpu
                calls[PHASES[name]] += 1
                if stack:
                    stack[-1][0] += total
                    stack[-1][1] += total_cpu
        return timed

    for name, fn in originals.items():
        setattr(solver, name, wrap(name, fn))
    try:
        yield seconds, cpu, calls
    finally:
        for name, fn in originals.items():
            setattr(solver, name, fn)


@functools.lru_cache(maxsize=None)
def _captured(spec: str):
    """(graph, capture seconds) of a reference model, captured once per process."""
    from autoshard.passes.capture import capture_reference

    start = time.perf_counter()
    graph = capture_reference(spec)
    return graph, time.perf_counter() - start


def _problems(only: str | None, with_capture: bool):
    for name, cfg, preset, nodes, train, target in PROBLEMS:
        if not only or only in name:
            yield name, (lambda cfg=cfg: (synthetic_graph(cfg), 0.0)), preset, nodes, train, target
    if with_capture and (not only or only in "llama-7b/8 captured"):
        yield "llama-7b/8 captured", lambda: _captured("llama:7b"), "h100-sxm", 1, PROBLEMS[0][4], 2.0


def _timed_solve(graph, cluster, train, cost_fn, target: float) -> dict:
    """One profiled solve: plan, wall and CPU seconds, phases, 1-minute load average before it."""
    load = os.getloadavg()[0]
    with _phase_profile() as (seconds, cpu, calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = solve(graph, cluster, train, cost_fn=cost_fn, time_limit_s=max(4 * target, 60.0))
        wall, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    return {"plan": plan, "wall": wall, "cpu": cpu_s, "seconds": dict(seconds), "cpu_phases": dict(cpu),
            "calls": calls, "load": load}


def run(only: str | None = None, with_capture: bool = True, repeat: int = 1) -> list[dict]:
    """Solve each problem ``repeat`` times; report the median wall time (and that run's profile)."""
    cost_fn, cost_name = _cost_fn()
    rows = []
    for name, make_graph, preset, nodes, train, target in _problems(only, with_capture):
        (graph, capture_s), cluster = make_graph(), synthetic_cluster(preset, nodes)
        runs = sorted((_timed_solve(graph, cluster, train, cost_fn, target) for _ in range(repeat)),
                      key=lambda r: r["wall"])
        assert len({r["plan"].solver.objective for r in runs}) == 1, "repeated solves disagree"
        median = runs[len(runs) // 2]
        plan, wall, seconds, calls = median["plan"], median["wall"], median["seconds"], median["calls"]
        block = next((s for s in plan.layers if "mlp" in s.layer and "norm" not in s.layer), plan.layers[0])
        rows.append({
            "problem": name, "params": graph.param_count, "world": cluster.world_size, "wall_s": round(wall, 3),
            "capture_s": round(capture_s, 3), "target_s": target, "status": plan.solver.status,
            "step_s": plan.solver.objective, "mesh": str(plan.mesh), "schedule": str(plan.schedule),
            "mlp_strategy": block.notation or "DDP", "meshes_considered": plan.solver.meshes_considered,
            "meshes_solved": plan.solver.meshes_solved, "mfu": plan.predictions.mfu, "cost_model": cost_name,
            "wall_runs_s": [round(r["wall"], 3) for r in runs], "cpu_s": round(median["cpu"], 3),
            "load_avg_1m": [round(r["load"], 2) for r in runs], "num_workers": solver.DEFAULT_NUM_WORKERS,
            "phases": {"seconds": {k: round(v, 3) for k, v in sorted(seconds.items())},
                       "cpu_seconds": {k: round(v, 3) for k, v in sorted(median["cpu_phases"].items())},
                       "other_s": round(wall - sum(seconds.values()), 3),
                       "refinements": calls["tables"], "cpsat_solves": calls["cpsat"]},
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the problems whose name contains this")
    parser.add_argument("--no-capture", action="store_true", help="skip the captured llama:7b graph")
    parser.add_argument("--repeat", type=int, default=3, help="solves per problem; the median wall time is reported")
    args = parser.parse_args()
    rows = run(args.only, not args.no_capture, args.repeat)
    table = Table(title=f"search benchmark ({rows[0]['cost_model'] if rows else ''})")
    columns = ("problem", "world", "wall_s", "cpu_s", "capture_s", "target_s", "status", "step_s", "mesh", "schedule",
               "mlp_strategy", "meshes_solved")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    Console(width=200).print(table)
    out = ROOT / "benchmarks" / "results" / f"search_{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "results": rows}, indent=2, sort_keys=True))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
