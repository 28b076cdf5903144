"""Plan probe: fit what the runtime adds to the cost model's step time, on truncated copies of a model.

The model probe of ``autoshard cluster calibrate --model`` times layers alone. What the
runtime does around them under a strategy (collective dispatch, flat-buffer copies,
blocking waits, NCCL kernels waiting for a late peer) is not in it, and on the GPU runs of
2026-11-26 it was most of the step for ZeRO-3, SP and quantized-communication plans
(docs/cost-model.md, "Plan residuals"). This script measures it on the target machine:

1. for each depth ``d`` of ``--depths`` (default 2 and 4 blocks), the reference model with
   ``d`` blocks (the same block shapes; embedding and head unchanged) is captured and
   ``benchmarks/baselines/plans.py`` picks the search's best plan and the ``--variants``
   forced plans for it, on the calibrated cluster (``--calibration``, whose own plan
   residuals are dropped first);
2. each plan runs ``--steps`` steps under ``runtime.build_program`` (the benchmark's
   ``AutoshardTrainer``: same loss, data and optimizer as ``benchmarks/run.py``); its median
   step (slowest rank) minus the cost model's prediction is one residual;
3. ``search/measured.fit_residuals`` fits ``residual = c_plan + Σ_key n_key·r_key`` (``r_key ≥ 0``
   seconds per block layer per step for a strategy notation on a mesh and micro-batch count;
   ``c_plan`` per step and plan; ``c₀``, what the cost model adds per step, is their median)
   over every run of every depth;
4. rank 0 writes the input calibration plus ``"plan_residuals"`` (the fit, every probed run
   with its measured, predicted and fitted seconds) to ``--out``, which
   ``Cluster.with_calibration`` reads.

The fit extrapolates in depth: it sees 2- and 4-block models; the matrix runs the full
24-block models. It sees the plan families it is asked for, so probe every family a run will
measure or the search may choose (module docstring of ``search/measured.py``).

    torchrun --standalone --nproc-per-node 4 benchmarks/plan_probe.py --model llama:350m \\
        --batch 16 --seq 1024 --calibration cal/llama_350m.json --variants replicate,zero1,zero2,zero3 \\
        --out cal/llama_350m.json

On the CPU (gloo, what the tests run): ``--device cpu --precision fp32 --model llama:tiny``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/plan_probe.py` / torchrun from the repository root
    sys.path.insert(0, str(ROOT))

from autoshard.cluster import Cluster  # noqa: E402
from autoshard.cluster_io import read_mapping_file  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.runtime.optimizer import OptimizerConfig  # noqa: E402
from autoshard.search.cost_model import predict  # noqa: E402
from autoshard.search.measured import fit_residuals, mesh_key  # noqa: E402
from benchmarks import run as bench  # noqa: E402
from benchmarks.baselines.autoshard_trainer import AutoshardTrainer, train_spec  # noqa: E402
from benchmarks.baselines.common import RunSpec, make_batches, prepare_reference, rank_device  # noqa: E402
from benchmarks.baselines.plans import variants as variant_table  # noqa: E402

log = logging.getLogger("plan_probe")
DEFAULT_VARIANTS = "replicate,zero1,zero2,zero3"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:350m")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--attn", choices=("sdpa", "math"), help="the reference model's attention path")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--calibration", type=Path, required=True, help="calibration file (with the model probe)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"forced plan variants besides the search's best (default {DEFAULT_VARIANTS})")
    p.add_argument("--depths", default="2,4", help="block counts of the truncated models (default 2,4)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True, help="calibration file to write (may be --calibration)")
    args = p.parse_args(argv)
    args.depths = tuple(int(d) for d in args.depths.split(","))
    args.variants = [v for v in args.variants.split(",") if v]
    if min(args.depths) < 1 or len(set(args.depths)) < 2:
        p.error("--depths needs two or more distinct positive block counts")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def block_counts(graph, plan) -> Counter:
    """Per ``mesh_key|notation``, the plan's transformer-block layers with that strategy."""
    by_name = {s.layer: s for s in plan.layers}
    key = mesh_key(plan.mesh, plan.schedule)
    return Counter(f"{key}|{by_name[layer.name].notation}" for layer in graph if layer.block is not None)


def probe(args: argparse.Namespace) -> dict:
    """Run every (depth, plan) and fit; the ``plan_residuals`` record (module docstring)."""
    device = rank_device(args.device)
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    raw = {k: v for k, v in read_mapping_file(args.calibration).items() if k != "plan_residuals"}
    detected = Cluster.detect()
    calibrated = detected.with_calibration(raw)
    rows: list[dict] = []
    known = {"free", *(v.name for v in variant_table(world))}
    wanted = [v for v in args.variants if v in known]
    if rank == 0 and len(wanted) < len(args.variants):
        log.info("variants not defined at world %d, skipped: %s", world, sorted(set(args.variants) - known))
    search_args = argparse.Namespace(plans="forced", max_plans=len(wanted) + 1, variants=wanted)
    for depth in args.depths:
        spec = RunSpec(model=args.model, global_batch=args.batch, seq_len=args.seq, attn_impl=args.attn,
                       num_layers=depth, precision=args.precision, device=args.device,
                       optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr))
        graph = bench._capture(spec)
        plans = bench._plans(graph, calibrated, spec, search_args, world, rank)
        batches = make_batches(graph.vocab, spec, args.steps)
        prepare_reference(spec)
        for named in plans:
            build = lambda plan=named.plan, name=named.name: AutoshardTrainer(  # noqa: E731
                spec, device, graph, plan, detected, name=name)
            row = bench._run_one(named.name, build, batches, args.warmup, device, stop_on_error=False)
            row.update(depth=depth, plan=bench.plan_label(named.plan))
            if row["status"] == "ok":
                predicted = predict(graph, named.plan, calibrated,
                                    train_spec(spec, micro_batch=named.plan.schedule.micro_batch)).step_time_s
                row.update(predicted_s=predicted, residual_s=row["median_step_s"] - predicted,
                           counts=dict(block_counts(graph, named.plan)))
            rows.append({k: v for k, v in row.items() if k not in ("losses", "step_times_s")})
            if rank == 0:
                log.info("depth %d %s: %s", depth, named.name,
                         f"measured {row['median_step_s'] * 1e3:.1f} ms, predicted {row['predicted_s'] * 1e3:.1f} ms"
                         if row["status"] == "ok" else row["status"])
    return fit_record(args, rows)


def fit_record(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The fit over the ok rows, with each row's fitted seconds, as the calibration's ``plan_residuals``."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        raise AutoshardError(f"plan probe of {args.model}: no plan ran ({[r['status'] for r in rows]})")
    c0, per_key, intercepts = fit_residuals([(r["config"], r["counts"], r["residual_s"]) for r in ok])
    for r in ok:
        r["intercept_s"] = intercepts[r["config"]]
        r["fitted_s"] = r["predicted_s"] + r["intercept_s"] + sum(n * per_key.get(k, 0.0) for k, n in r["counts"].items())
    layers = [{"mesh": k.split("|", 1)[0], "strategy": k.split("|", 1)[1], "s_per_layer": v}
              for k, v in sorted(per_key.items())]
    return {"model": args.model, "dtype": args.precision, "seq_len": args.seq, "global_batch": args.batch,
            "step_s": c0, "layers": layers, "probes": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    owns_group = bench._init_distributed(args.device)
    try:
        record = probe(args)
        if dist.get_rank() == 0:
            out = dict(read_mapping_file(args.calibration), plan_residuals=record)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
            print(f"plan residuals of {args.model}: c0 {record['step_s'] * 1e3:+.1f} ms/step; "
                  + ", ".join(f"{e['strategy']}@{e['mesh']} {e['s_per_layer'] * 1e3:.2f} ms/layer"
                              for e in record["layers"]))
            for r in record["probes"]:
                if r["status"] == "ok":
                    print(f"  depth {r['depth']} {r['config']}: measured {r['median_step_s'] * 1e3:.1f} ms, "
                          f"predicted {r['predicted_s'] * 1e3:.1f}, fitted {r['fitted_s'] * 1e3:.1f}  [{r['plan']}]")
                else:
                    print(f"  depth {r['depth']} {r['config']}: {r['status']}")
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
