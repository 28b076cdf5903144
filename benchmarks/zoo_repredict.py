"""Re-predict the rows of a zoo campaign with the current cost model (no GPU): a model change is judged on
runs already made, with the calibration measured in the same call.

    python benchmarks/zoo_repredict.py benchmarks/results/zoo_h200_2026-11-27/call2 [--md out.md]

For every autoshard row (``benchmarks/zoo_summary.rows_of``, archives included) the plan is the row's
``plan_dict`` (``benchmarks/run.py`` records it since 2026-11-27), else rebuilt from its label when the
label fixes every layer (``dp_shard=N; zero3×K; m=1 mb=B``: one state on every layer with parameters;
``replicate`` on the parameter-less ones, which hold nothing to shard); a searched mixed plan
recorded without its plan cannot be rebuilt and is listed as such. The model is captured on the CPU as
``run.py`` captures it for a GPU (meta device, compute dtype, the compiled step's activation scale), the
cluster is the card's preset (``h200:1xN``, ``h100-sxm:1xN``) with the calibration measured over N GPUs
in that call (``zoo_summary.calibration_file``: the folder's ``cal_x<N>.json``, else the one packed in its
``zoo.tgz``; ``--add FILE``: keys measured later override it), and ``predict`` prices the plan. A results
file repacked by a later call's archive counts once. Printed next to the measurement and to the prediction
the run recorded (the cost model of that day).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

_UNIFORM = re.compile(r"^dp_shard=(\d+); (?:replicate×(\d+) )?(replicate|zero1|zero2|zero3)×\d+; m=1 mb=(\d+)$")
_CARDS = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100-sxm"}


def rebuilt_plan(row: dict, graph):
    """The row's plan: its ``plan_dict``, else its uniform label rebuilt (module docstring), else None."""
    from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule

    if row.get("plan_dict"):
        return Plan.from_dict(row["plan_dict"])
    match = _UNIFORM.match(row["plan"])
    if match is None:
        return None
    dp, state, micro = int(match.group(1)), match.group(3), int(match.group(4))
    if match.group(2) is not None and int(match.group(2)) != sum(1 for l in graph.layers if not l.param_count):
        return None  # replicate on layers with parameters too: a mixed plan
    layers = tuple(LayerStrategy(layer=l.name, state=state if l.param_count else "replicate") for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=dp), layers=layers,
                schedule=Schedule(num_micro_batches=1, micro_batch=micro))


def main(argv: list[str]) -> int:
    import torch

    from autoshard.cluster import Cluster
    from autoshard.search.cost_model import predict
    from autoshard.train import TrainSpec
    from benchmarks import run
    from benchmarks.zoo_summary import calibration_file, distinct_results

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--md", type=Path, help="also write the table here")
    p.add_argument("--calibration", type=Path, help="price with this calibration file instead of each folder's "
                   "cal_x<N>.json")
    p.add_argument("--add", type=Path, metavar="FILE",
                   help="calibration keys that override each folder's own (e.g. figures measured later: the "
                        "overlap probe's overlap_contention and overlap_efficiency)")
    args = p.parse_args(argv)
    lines = ["| model | GPUs | config | plan | measured ms | recorded prediction | current prediction | current error "
             "| measured GiB | current GiB | memory error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    steps, mems = [], []
    for folder, _where, data in distinct_results(args.folders):
        meta = data.get("meta", {})
        for row in data.get("rows", []):
            if row.get("status") != "ok" or not row["config"].startswith("autoshard"):
                continue
            world, card = meta["world_size"], _CARDS.get(meta.get("device_name", ""), "h100-sxm")
            graph = run._capture_cached(meta["model"], meta["seq_len"], torch.bfloat16, (), True)
            plan = rebuilt_plan(row, graph)
            recorded = (row.get("predicted_calibrated") or row.get("predicted") or {}).get("step_time_s")
            head = (f"| {meta['model']} | {world} | {row['config']} | {row['plan']} | {row['median_step_s'] * 1e3:.1f} | "
                    f"{'–' if recorded is None else f'{recorded * 1e3:.1f}'} |")
            if plan is None:
                lines.append(head + " not rebuilt (mixed plan recorded without its plan) | – | – | – | – |")
                continue
            cluster = Cluster.load(f"{card}:1x{world}")
            figures = (json.loads(args.calibration.read_text()) if args.calibration
                       else calibration_file(folder, world))
            if figures is not None:
                if args.add:
                    figures.update({k: v for k, v in json.loads(args.add.read_text()).items()
                                    if k not in ("device", "date")})
                cluster = cluster.with_calibration(figures)
            pred = predict(graph, plan, cluster, TrainSpec(global_batch=meta["global_batch"], seq_len=meta["seq_len"],
                                                            precision=meta["precision"]))
            step_err = pred.step_time_s / row["median_step_s"] - 1
            mem_err = pred.peak_memory_bytes / row["peak_memory_bytes"] - 1
            steps.append(abs(step_err))
            mems.append(abs(mem_err))
            lines.append(head + f" {pred.step_time_s * 1e3:.1f} | {step_err * 100:+.1f}% | "
                         f"{row['peak_memory_bytes'] / 2**30:.2f} | {pred.peak_memory_bytes / 2**30:.2f} | "
                         f"{mem_err * 100:+.1f}% |")
    if steps:
        lines[0:0] = [f"{len(steps)} plans re-predicted: median |step error| {statistics.median(steps) * 100:.1f}%, "
                      f"median |peak-memory error| {statistics.median(mems) * 100:.1f}%", ""]
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
