"""Time of the runtime's AdamW update: the fused kernel (``apply_update``) against the foreach path.

    python benchmarks/optimizer_bench.py --params 650e6 --tensors 400 --out results/optimizer.json

One device; fp32 masters, gradients and moments split into ``--tensors`` equal tensors (a
1.3B model's ZeRO-2 half on one of 2 ranks: 650M parameters in about 400 tensors). Per path:
median of ``--iters`` timed updates after 3 untimed ones (CUDA events on GPUs, the wall clock on
the CPU), the peak memory the update adds (CUDA only) and the bytes one update must move at
least (read master, gradient and both moments, write master and moments: 28 B per parameter)
over the measured time. ``--smoke``: a tiny CPU run of the same code (CI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autoshard.runtime.optimizer import OptimizerConfig, apply_update, foreach_update


def _time(fn, iters: int, device: torch.device) -> list[float]:
    out = []
    for i in range(iters + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i + 1)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn(i + 1)
            seconds = time.perf_counter() - t0
        if i >= 3:
            out.append(seconds)
    return out


def measure(params: int, tensors: int, iters: int, device: torch.device) -> dict:
    """Both paths on the same tensors (module docstring)."""
    cfg = OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.1)
    size = max(1, params // tensors)
    state = {k: [torch.rand(size, device=device) for _ in range(tensors)] for k in ("m", "g", "a", "s")}
    rows = {}
    for name, update in (("fused", apply_update), ("foreach", foreach_update)):
        def run(step, update=update):
            update(cfg, step, state["m"], state["g"], state["a"], state["s"])
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = _time(run, iters, device)
        median = statistics.median(times)
        rows[name] = {"median_ms": median * 1e3, "min_ms": min(times) * 1e3,
                      "min_bytes_GBps": 28 * size * tensors / median / 1e9,
                      "extra_peak_GiB": ((torch.cuda.max_memory_allocated() - base) / 2**30
                                         if device.type == "cuda" else None)}
    rows["foreach_over_fused"] = rows["foreach"]["median_ms"] / rows["fused"]["median_ms"]
    return {"params": size * tensors, "tensors": tensors, "device": _device_name(device), "torch": torch.__version__,
            **rows}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=650e6)
    p.add_argument("--tensors", type=int, default=400)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (CI)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.params, args.tensors, args.iters = 4096, 8, 2
    result = measure(int(args.params), args.tensors, args.iters, device)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
