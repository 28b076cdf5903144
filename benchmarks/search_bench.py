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

Uses the real cost model when it is implemented, else ``toy_layer_cost``.
Writes ``benchmarks/results/search_<date>.json`` and prints a table.
Run from the repository root: ``.venv/bin/python benchmarks/search_bench.py [--only NAME]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the editable install maps autoshard.search only with the root on sys.path

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoshard.search import cost_model, solve  # noqa: E402
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


def run(only: str | None = None) -> list[dict]:
    cost_fn, cost_name = _cost_fn()
    rows = []
    for name, cfg, preset, nodes, train, target in PROBLEMS:
        if only and only not in name:
            continue
        graph, cluster = synthetic_graph(cfg), synthetic_cluster(preset, nodes)
        start = time.perf_counter()
        plan = solve(graph, cluster, train, cost_fn=cost_fn, time_limit_s=max(4 * target, 60.0))
        wall = time.perf_counter() - start
        block = next(s for s in plan.layers if s.layer.endswith(".mlp"))
        rows.append({
            "problem": name, "params": graph.param_count, "world": cluster.world_size, "wall_s": round(wall, 3),
            "target_s": target, "status": plan.solver.status, "step_s": plan.solver.objective,
            "mesh": str(plan.mesh), "schedule": str(plan.schedule), "mlp_strategy": block.notation or "DDP",
            "meshes_considered": plan.solver.meshes_considered, "meshes_solved": plan.solver.meshes_solved,
            "mfu": plan.predictions.mfu, "cost_model": cost_name,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the problems whose name contains this")
    args = parser.parse_args()
    rows = run(args.only)
    table = Table(title=f"search benchmark ({rows[0]['cost_model'] if rows else ''})")
    columns = ("problem", "world", "wall_s", "target_s", "status", "step_s", "mesh", "schedule", "mlp_strategy",
               "meshes_solved")
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
