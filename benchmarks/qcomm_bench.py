"""qwZ all-gather: bf16 ``all_gather_into_tensor`` against quantize + all-gather of the
quantized rows + dequantize (int8, fp8), over the ranks of one torchrun job.

GPU (the number the docs quote; NCCL, one process per GPU):

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/qcomm_bench.py --out OUT.json

CPU smoke run of the same logic (gloo, tiny tensor, Triton interpreter; CI runs this):

    TRITON_INTERPRET=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/qcomm_bench.py --smoke --out /tmp/qcomm.json

What is measured, for a bf16 tensor of ``--bytes`` bytes in total (default 1 GiB), split in
equal shards over the ranks (each rank holds ``bytes / world``):

- ``bf16``: one ``all_gather_into_tensor`` of the bf16 shards.
- ``int8`` / ``fp8`` (``--qdtypes``): ``kernels.comm.quantized_all_gather`` (qwZ): quantize
  the shard (one row of payload + scales), ONE all-gather of ``uint8[world, chunk_bytes]``,
  dequantize to bf16. ``total`` is that whole call; ``quantize``, ``all_gather`` and
  ``dequantize`` are the three steps timed alone, on the same buffers.
- Times: per iteration, all ranks meet at a barrier, then CUDA events around the call on
  the current stream (wall clock on CPU); median over ``--iters`` iterations after
  ``--warmup`` untimed ones; the JSON holds every rank's median, and ``seconds`` is the
  largest (the slowest rank decides a collective step).
- Bytes: ``wire_bytes`` = the all-gather's output bytes (``world`` rows; each rank receives
  ``(world-1)/world`` of it); ``bytes_ratio`` = bf16 wire bytes over the quantized ones
  (goal: >= 1.9); ``speedup`` = bf16 seconds over the variant's ``total`` seconds.
- Accuracy: each element of the quantized result against the bf16 gather, within the
  documented per-block bound (docs/kernels.md, "Arithmetic and error bounds").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.kernels import QuantLayout, dequantize, quantize
from autoshard.kernels.comm import _all_gather_rows, quantized_all_gather
from autoshard.kernels.ops import QuantizedTensor

GiB = 1 << 30


def _timer(device: torch.device):
    """fn -> seconds of one call of ``fn`` after a barrier: CUDA events on GPU, wall clock on CPU."""

    def time_once(fn) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s

    return time_once


def _median(fn, time_once, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        time_once(fn)
    return statistics.median(time_once(fn) for _ in range(iters))


def _all_ranks(value: float) -> list[float]:
    """Every rank's ``value``, in rank order (an object all-gather: CPU side, any backend)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def error_bound(full: torch.Tensor, qdtype: str, block: int) -> torch.Tensor:
    """Per-element bound on |x - x'| for bf16 ``full`` quantized in ``block``-element blocks
    (its numel a multiple of ``block``) and dequantized to bf16: int8 ``absmax/254``, int4
    ``absmax/14``, fp8 ``2^-4 |x| + absmax/448 * 2^-10`` (relative slack 1e-5), plus the bf16
    rounding of the result (half an ulp: at most ``2^-8 |x'|``)."""
    x = full.float().view(-1, block)
    absmax = x.abs().amax(1, keepdim=True)
    if qdtype == "fp8":
        bound = x.abs() * 2.0**-4 + absmax / 448 * 2.0**-10
    else:
        bound = absmax / (254 if qdtype == "int8" else 14) + 0 * x
    bound = bound * (1 + 1e-5)
    return (bound + (x.abs() + bound) * 2.0**-8).view(-1)


def run(nbytes: int, qdtypes: list[str], block: int, iters: int, warmup: int) -> dict:
    """Measure on this rank (process group already up); every rank returns the same report."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    numel = nbytes // 2  # bf16 elements of the full tensor
    if numel % world:
        raise SystemExit(f"--bytes {nbytes}: {numel} bf16 elements do not split evenly over {world} ranks")
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    shard = torch.randn(numel // world, device=device, dtype=torch.bfloat16, generator=gen)
    full = torch.empty(numel, device=device, dtype=torch.bfloat16)
    time_once = _timer(device)
    bf16_s = _all_ranks(_median(lambda: _all_gather_rows(full, shard, None), time_once, iters, warmup))
    report = {"world": world, "numel": numel, "block": block, "device": str(device),
              "bf16": {"seconds": max(bf16_s), "per_rank_seconds": bf16_s, "wire_bytes": 2 * numel}}
    for qd in qdtypes:
        local = quantize(shard, qd, block, world=1)  # (1, chunk_bytes)
        lay = QuantLayout(qd, block, numel, world)
        rows = torch.empty((world, local.layout.chunk_bytes), dtype=torch.uint8, device=device)
        steps = {
            "total": lambda qd=qd: quantized_all_gather(shard, None, qd, block),
            "quantize": lambda qd=qd: quantize(shard, qd, block, world=1),
            "all_gather": lambda: _all_gather_rows(rows, local.data, None),
            "dequantize": lambda: dequantize(QuantizedTensor(rows, lay, (numel,), torch.bfloat16)),
        }
        times = {name: _all_ranks(_median(fn, time_once, iters, warmup)) for name, fn in steps.items()}
        got = quantized_all_gather(shard, None, qd, block)
        _all_gather_rows(full, shard, None)
        err = (got.float() - full.float()).abs()
        if numel % (world * block) == 0:  # shards fill whole blocks: the bound is per block of `full`
            ok = bool((err <= error_bound(full, qd, block)).all())
        else:
            ok = None
        wire = world * lay.chunk_bytes
        report[qd] = {
            "seconds": max(times["total"]), "per_rank_seconds": times["total"],
            "steps_seconds": {name: max(t) for name, t in times.items() if name != "total"},
            "wire_bytes": wire, "bytes_ratio": 2 * numel / wire,
            "speedup": report["bf16"]["seconds"] / max(times["total"]),
            "max_abs_error": float(err.max()), "within_error_bound": ok,
        }
        del local, rows, got, err
    return report


def markdown(report: dict) -> str:
    """One table: wire bytes, median ms, ratios against the bf16 gather."""
    base = report["bf16"]
    lines = [f"all-gather of {report['numel'] * 2 / GiB:.3g} GiB bf16 over {report['world']} ranks "
             f"(block {report['block']}, {report['device']})", "",
             "| variant | wire bytes | bytes ratio | total ms | quantize ms | all-gather ms | dequantize ms | "
             "speed-up | error bound |", "| --- " * 9 + "|",
             f"| bf16 | {base['wire_bytes']} | 1.00 | {base['seconds'] * 1e3:.3f} | | | | 1.00 | |"]
    for qd, r in report.items():
        if isinstance(r, dict) and "steps_seconds" in r:
            st = r["steps_seconds"]
            lines.append(f"| {qd} | {r['wire_bytes']} | {r['bytes_ratio']:.3f} | {r['seconds'] * 1e3:.3f} | "
                         f"{st['quantize'] * 1e3:.3f} | {st['all_gather'] * 1e3:.3f} | {st['dequantize'] * 1e3:.3f} | "
                         f"{r['speedup']:.2f} | {r['within_error_bound']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, join the torchrun job, measure, write JSON (rank 0) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON results path (written by rank 0)")
    p.add_argument("--smoke", action="store_true", help="tiny tensor, 2 iterations (CPU, gloo, CI)")
    p.add_argument("--bytes", type=int, default=GiB, help="bytes of the full bf16 tensor")
    p.add_argument("--qdtypes", nargs="*", default=["int8", "fp8"], choices=("int8", "fp8", "int4"))
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.bytes, args.iters, args.warmup = 1 << 16, 2, 1
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: python -m torch.distributed.run --nproc-per-node N "
                         "benchmarks/qcomm_bench.py --out OUT.json")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    try:
        report = run(args.bytes, args.qdtypes, args.block, args.iters, args.warmup)
        if dist.get_rank() == 0:
            import triton

            report.update(card=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                          triton=triton.__version__, backend=dist.get_backend(), iters=args.iters,
                          warmup=args.warmup, command="python -m torch.distributed.run ... benchmarks/qcomm_bench.py "
                          + " ".join(argv if argv is not None else sys.argv[1:]))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
            print(markdown(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
