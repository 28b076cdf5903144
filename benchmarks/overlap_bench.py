"""ZeRO-3 forward all-gather overlap: step time and profiler evidence with ``schedule_overlap`` on vs off.

    torchrun --standalone --nproc-per-node 2 benchmarks/overlap_bench.py --device cuda --out overlap.json
    python benchmarks/overlap_bench.py --smoke --out /tmp/overlap.json     # CPU/gloo, tiny model, 2 ranks

Without torchrun the script re-launches itself under ``torch.distributed.run``
with ``--nproc`` ranks. Every layer is ``zero3`` over ``dp_shard = world``;
the same plan runs with ``schedule.prefetch = 0`` (blocking gathers at first
use) and ``= --prefetch`` (async start issued ahead, wait at first use:
``passes/schedule_overlap.py``). Per mode:

* ``median_step_s``: median wall time of ``--steps`` steps after ``--warmup``
  (slowest rank each; ``benchmarks/baselines/common.measure``);
* one more step under ``torch.profiler`` (rank 0's chrome trace, parsed):
  (a) ``nccl_kernel_s``: summed duration of NCCL kernels; (b) ``overlap_s``:
  length of (union of NCCL kernel intervals) ∩ (union of compute-kernel
  intervals on other streams), also per NCCL stream; (c) ``layers``: for the
  first few forward gathers, whether layer i+1's all-gather kernel interval
  intersects layer i's compute, i.e. the kernels launched between layer i's
  gather op and layer i+1's wait (blocking mode: its gather op). Forward
  gathers are the first ``G`` gather ops of the step (one micro-batch: the
  forward runs before any backward re-gather), ``G`` = gathers in the graph.
  (d) ``streams``: per CUDA stream id of the trace, NCCL and other kernel
  time and count, and ``compute_stream`` (the one with the most non-NCCL
  time): NCCL kernels on the compute stream cannot overlap it; (e)
  ``gpu_idle_s``: time in the profiled step when no kernel ran (host-bound
  gaps), and ``host_start_ms`` / ``host_wait_ms``: host time inside the
  start/gather and wait ops (a wait that blocks the host is large here).
  On the CPU there are no kernels: (a)-(e) are ``null`` except the host times.

Training setup: AdamW at ``--lr`` (default 3e-5; the runtime default 1e-3,
used by the first H100 run, made a 1.3b model diverge at once: every Adam
step moves each weight by about lr, 5% of the init std), random tokens, so
the loss can fall only to about ln(vocab) + the value term; the verdict flags
non-finite or rising losses.

Output: JSON at ``--out`` and a markdown table on stdout (card, date, torch).
Imports only torch and autoshard (+ its wheelhouse: ortools, networkx, rich,
pyyaml); the repository root is put on ``sys.path`` and, when autoshard is not
installed, its stage folders are mapped as ``pyproject.toml``'s package-dir does.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("passes", "kernels", "search", "runtime")


def _ensure_importable() -> None:
    """Make ``import autoshard.passes`` work from a bare checkout (module docstring)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import autoshard

    for stage in STAGES:
        name = f"autoshard.{stage}"
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        spec = importlib.util.spec_from_file_location(name, ROOT / stage / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / stage)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        setattr(autoshard, stage, module)
        spec.loader.exec_module(module)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt:1.3b", help="reference policy spec (default gpt:1.3b)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks (one micro-batch)")
    p.add_argument("--steps", type=int, default=8, help="timed + warm-up steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=1, help="prefetch depth of the overlap mode")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--nproc", type=int, default=2, help="ranks when not launched by torchrun")
    p.add_argument("--layers", type=int, default=6, help="forward gathers to report in (c)")
    p.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (module docstring)")
    p.add_argument("--forward-only-mode", action="store_true",
                   help="also run --prefetch with the backward overlap off (re-gather prefetch and asynchronous "
                        "reduce-scatters): forward gathers only")
    p.add_argument("--out", default="overlap_bench.json")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, gpt:tiny, seq 16, fp32, 3 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.seq, args.global_batch, args.steps, args.warmup = "gpt:tiny", 16, 4, 3, 1
        args.precision, args.device = "fp32", "cpu"
    return args


def _relaunch(argv: list[str], nproc: int) -> int:
    """Run this script under ``torch.distributed.run`` with ``nproc`` ranks; its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env=env, check=False).returncode


# --------------------------------------------------------------------------- trace analysis (pure)


def interval_union(intervals):
    """Sorted, disjoint union of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def intersection_length(a, b) -> float:
    """Total length of (∪a) ∩ (∪b)."""
    a, b = interval_union(a), interval_union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


GATHER_OPS = ("autoshard::all_gather_start", "autoshard::all_gather")
WAIT_OPS = ("autoshard::all_gather_wait",)
# dispatcher ops are "cpu_op"; the eager fast path (kernels/collectives.py) names its calls with
# record_function, which traces as "user_annotation"
HOST_CATS = ("cpu_op", "user_annotation")


def _kernels(events: list[dict]) -> list[dict]:
    """GPU kernels: name, stream, [start, end) in µs, CPU launch time (via the correlation id)."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") == "kernel":
            args = e.get("args", {})
            out.append({"name": e["name"], "stream": args.get("stream"), "start": e["ts"], "end": e["ts"] + e["dur"],
                        "nccl": e["name"].lower().startswith("nccl"), "launch": launches.get(args.get("correlation"))})
    return out


def summarise_trace(trace: dict, num_gathers: int, num_layers: int) -> dict:
    """(a)-(e) of the module docstring from a chrome trace dict; kernel fields ``None`` without kernels."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = _kernels(events)
    host = {"host_start_ms": _cpu_ms(events, GATHER_OPS), "host_wait_ms": _cpu_ms(events, WAIT_OPS)}
    if not kernels:
        return {"nccl_kernel_s": None, "overlap_s": None, "overlap_by_stream_s": None, "layers": None,
                "streams": None, "compute_stream": None, "gpu_idle_s": None, **host}
    nccl = [k for k in kernels if k["nccl"]]
    streams = sorted({k["stream"] for k in nccl}, key=str)
    by_stream = {}
    for s in streams:
        mine = [(k["start"], k["end"]) for k in nccl if k["stream"] == s]
        other = [(k["start"], k["end"]) for k in kernels if not k["nccl"] and k["stream"] != s]
        by_stream[str(s)] = intersection_length(mine, other) * 1e-6
    compute = [(k["start"], k["end"]) for k in kernels if not k["nccl"]]
    return {
        "nccl_kernel_s": sum(k["end"] - k["start"] for k in nccl) * 1e-6,
        "overlap_s": intersection_length([(k["start"], k["end"]) for k in nccl], compute) * 1e-6,
        "overlap_by_stream_s": by_stream,
        "layers": _layer_overlap(events, kernels, num_gathers, num_layers),
        **_streams(kernels), **host,
    }


def _cpu_ms(events: list[dict], names: tuple[str, ...]) -> float:
    """Host time spent inside the ``names`` ops (a wait that blocks the host shows up here, in ms)."""
    return sum(e["dur"] for e in events if e.get("cat") in HOST_CATS and e["name"] in names) * 1e-3


def _streams(kernels: list[dict]) -> dict:
    """(d) per stream: NCCL and other kernel time (ms) and count; the compute stream; (e) GPU idle time."""
    table: dict[str, dict] = {}
    for k in kernels:
        row = table.setdefault(str(k["stream"]), {"nccl_ms": 0.0, "compute_ms": 0.0, "kernels": 0})
        row["nccl_ms" if k["nccl"] else "compute_ms"] += (k["end"] - k["start"]) * 1e-3
        row["kernels"] += 1
    compute_stream = max(table, key=lambda s: table[s]["compute_ms"])
    busy = interval_union([(k["start"], k["end"]) for k in kernels])
    span = busy[-1][1] - busy[0][0]
    return {"streams": table, "compute_stream": compute_stream,
            "gpu_idle_s": (span - sum(b - a for a, b in busy)) * 1e-6}


def _cpu_ops(events: list[dict], names: tuple[str, ...]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in HOST_CATS and e["name"] in names), key=lambda e: e["ts"])


def _layer_overlap(events, kernels, num_gathers: int, num_layers: int) -> list[dict]:
    """(c): per forward gather i < num_layers, does gather i+1's NCCL kernel intersect layer i's compute kernels."""
    gathers = _cpu_ops(events, GATHER_OPS)[:num_gathers]
    waits = _cpu_ops(events, WAIT_OPS)[:num_gathers]
    # the CPU point after which layer i computes: its wait's end (async) or its blocking gather's end
    ready = [w["ts"] + w["dur"] for w in waits] if waits else [g["ts"] + g["dur"] for g in gathers]
    rows = []
    for i in range(min(num_layers, len(gathers) - 1, len(ready) - 1)):
        nxt = gathers[i + 1]
        gather_kernels = [k for k in kernels if k["nccl"] and k["launch"] is not None
                          and nxt["ts"] <= k["launch"] <= nxt["ts"] + nxt["dur"]]
        compute = [k for k in kernels if not k["nccl"] and k["launch"] is not None
                   and ready[i] <= k["launch"] < (waits[i + 1]["ts"] if waits else nxt["ts"])]
        both = intersection_length([(k["start"], k["end"]) for k in gather_kernels],
                                   [(k["start"], k["end"]) for k in compute])
        rows.append({"layer": i, "next_gather_kernels": len(gather_kernels), "compute_kernels": len(compute),
                     "overlap_us": both, "overlaps": both > 0})
    return rows


# --------------------------------------------------------------------------- measurement (per rank)


def _mode(args, graph, spec, device, prefetch: int, batches, trace_dir: str, backward: bool = True) -> dict:
    import torch
    import torch.distributed as dist

    from autoshard.plan import Mesh
    from autoshard.kernels import async_collectives
    from benchmarks.baselines.autoshard_trainer import AutoshardTrainer, uniform_plan
    from benchmarks.baselines.common import measure, reset_memory

    world = dist.get_world_size()
    plan = uniform_plan(graph, Mesh(dp_shard=world), state="zero3", global_batch=args.global_batch,
                        seq_len=args.seq, precision=args.precision)
    plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, prefetch=prefetch))
    reset_memory(device)
    trainer = AutoshardTrainer(spec, device, graph, plan, name=f"prefetch={prefetch}")
    if trainer.program.regather is not None and not backward:
        # forward prefetch only: backward re-gathers and reduce-scatters stay blocking
        from autoshard.passes._zero3 import Zero3Gather

        trainer.program.regather.prefetch = False
        for module in trainer.program.gm.modules():
            if isinstance(module, Zero3Gather):
                module.grad_sink = None
    gm = trainer.program.gm
    num_gathers = sum(type(m).__name__ in ("GatherStart", "Zero3Gather") for _n, m in gm.named_children())
    result = measure(trainer.step, batches[:-1], args.warmup, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        trainer.step(batches[-1])
        if device.type == "cuda":
            torch.cuda.synchronize()
    path = os.path.join(trace_dir, f"trace_prefetch{prefetch}{'' if backward else 'f'}_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        summary = summarise_trace(json.load(f), num_gathers, args.layers)
    trainer.close()
    assert async_collectives.pending_count() == 0, "a started all-gather was never waited"
    return {"prefetch": prefetch, "backward_prefetch": prefetch > 0 and backward, "median_step_s": result.median_step_s, "step_times_s": list(result.step_times_s),
            "losses": list(result.losses), "peak_memory_bytes": result.peak_memory_bytes,
            "forward_gathers": num_gathers, **summary}


def run(args: argparse.Namespace) -> dict | None:
    """Both modes on this rank; rank 0 returns the report (others ``None``)."""
    import torch
    import torch.distributed as dist

    from autoshard.passes.capture import capture_reference
    from benchmarks.baselines.common import RunSpec, make_batches, rank_device

    device = rank_device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    try:
        from autoshard.runtime.optimizer import OptimizerConfig

        spec = RunSpec(model=args.model, global_batch=args.global_batch, seq_len=args.seq,
                       precision=args.precision, device=args.device, optimizer=OptimizerConfig(lr=args.lr))
        graph = capture_reference(spec.model, seq_lens=(max(2, args.seq // 2), args.seq), dtype=spec.compute_dtype)
        vocab = max(layer.vocab or 0 for layer in graph.layers) or 128
        batches = make_batches(vocab, spec, args.steps + 1)
        with tempfile.TemporaryDirectory(prefix="overlap_bench_") as trace_dir:
            modes = [_mode(args, graph, spec, device, 0, batches, trace_dir),
                     _mode(args, graph, spec, device, args.prefetch, batches, trace_dir)]
            if args.forward_only_mode:
                modes.append(_mode(args, graph, spec, device, args.prefetch, batches, trace_dir, backward=False))
        if dist.get_rank() != 0:
            return None
        return _report(args, modes, device, dist.get_world_size())
    finally:
        dist.destroy_process_group()


def _report(args, modes: list[dict], device, world: int) -> dict:
    import torch

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    off, on = modes[:2]
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "card": card, "world": world,
            "model": args.model, "seq": args.seq, "global_batch": args.global_batch, "precision": args.precision,
            "speedup": off["median_step_s"] / on["median_step_s"] if on["median_step_s"] else None,
            "speedup_forward_only": (off["median_step_s"] / modes[2]["median_step_s"]) if len(modes) > 2 else None,
            "modes": modes}


def markdown(report: dict) -> str:
    """The report as a markdown table (one row per mode)."""
    def fmt(v, scale=1.0, spec=".2f"):
        return "n/a" if v is None else format(v * scale, spec)

    lines = [f"ZeRO-3 overlap, {report['model']} seq {report['seq']} batch {report['global_batch']} "
             f"{report['precision']}, {report['world']}× {report['card']}, torch {report['torch']}, {report['date']}",
             "", "| prefetch | median step (ms) | NCCL kernels (ms) | NCCL ∩ compute (ms) | layers i+1 gather ∩ i compute "
             "| compute stream | NCCL ms by stream | GPU idle (ms) | host in waits (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in report["modes"]:
        layers = m["layers"]
        label = f"{m['prefetch']}" + ("" if m["prefetch"] == 0 else (" (fwd+bwd)" if m.get("backward_prefetch") else " (fwd)"))
        hits = "n/a" if layers is None else f"{sum(r['overlaps'] for r in layers)}/{len(layers)}"
        by_stream = "n/a" if m["streams"] is None else ", ".join(
            f"{s}: {row['nccl_ms']:.1f}" for s, row in m["streams"].items() if row["nccl_ms"])
        lines.append(f"| {label} | {fmt(m['median_step_s'], 1e3)} | {fmt(m['nccl_kernel_s'], 1e3)} | "
                     f"{fmt(m['overlap_s'], 1e3)} | {hits} | {m['compute_stream'] or 'n/a'} | {by_stream} | "
                     f"{fmt(m['gpu_idle_s'], 1e3)} | {m['host_wait_ms']:.1f} |")
    lines.append(f"\nspeedup (prefetch 0 → {report['modes'][1]['prefetch']}): {fmt(report['speedup'], 1, '.3f')}×")
    return "\n".join(lines)


def verdict(report: dict) -> str:
    """One line: did the prefetch overlap, how much faster, and whether the losses were sane."""
    off, on = report["modes"][:2]
    losses = on["losses"]
    sane = all(math.isfinite(v) for v in losses) and losses[-1] <= losses[0] + 0.5
    tail = f"losses {losses[0]:.3f} → {losses[-1]:.3f} ({'stable' if sane else 'UNSTABLE'})"
    if on["overlap_s"] is None:
        return f"VERDICT: no GPU kernels (CPU run); speedup {report['speedup']:.3f}×; {tail}"
    streams = on["streams"] or {}
    nccl_on_compute = streams.get(on["compute_stream"], {}).get("nccl_ms", 0.0)
    hidden = on["overlap_s"] / on["nccl_kernel_s"] if on["nccl_kernel_s"] else 0.0
    ok = on["overlap_s"] > 0 and report["speedup"] > 1.0
    return (f"VERDICT: {'OVERLAP' if ok else 'NO OVERLAP'}: prefetch {on['prefetch']} step "
            f"{on['median_step_s'] * 1e3:.1f} ms vs {off['median_step_s'] * 1e3:.1f} ms ({report['speedup']:.3f}×); "
            f"NCCL∩compute {on['overlap_s'] * 1e3:.1f} of {on['nccl_kernel_s'] * 1e3:.1f} ms NCCL ({hidden:.0%}); "
            f"compute stream {on['compute_stream']} carries {nccl_on_compute:.1f} ms NCCL (backward); "
            f"GPU idle {on['gpu_idle_s'] * 1e3:.1f} ms vs {off['gpu_idle_s'] * 1e3:.1f}; "
            f"host in waits {on['host_wait_ms']:.1f} ms; {tail}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return _relaunch(argv, args.nproc)
    _ensure_importable()
    report = run(args)
    if report is not None:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(markdown(report), flush=True)
        print(verdict(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
