"""Bandwidth of the quantization kernels against a device copy, and qwZ all-gather time.

GPU (the numbers the docs quote; not run in CI):

    python benchmarks/kernels_bench.py --out results/kernels.json

CPU smoke run of the same logic (tiny sizes, Triton interpreter, gloo; CI runs this):

    TRITON_INTERPRET=1 python benchmarks/kernels_bench.py --smoke --out /tmp/kernels.json

What is measured, per element count ``n`` (bf16 input unless stated):

- ``copy``: ``dst.copy_(src)`` of ``n`` bf16 elements; bytes = read + written = 4n.
- each kernel (quantize bf16 -> int8/fp8/int4; dequantize -> bf16; dequantize+reduce of
  ``--rows`` rows -> fp32): bytes = input bytes read + output bytes written (payload and
  scales counted), time = median of ``triton.testing.do_bench``; ratio = kernel GB/s over
  copy GB/s at the same ``n``. Goal: >= 0.9.
- ``--sweep``: the same for several (elements per program, num_warps) tiles.
- qwZ: all-gather of a ``--gather-bytes`` bf16 tensor over ``--world`` processes (NCCL on
  GPUs, gloo on CPU): bf16 ``all_gather_into_tensor`` against quantize + gather of
  quantized rows + dequantize, for int8 and fp8; median of ``--iters`` timed iterations.

Every kernel output is first checked bit for bit against the pure-torch reference on a
small input on the same device; the JSON records the result.
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
import torch.multiprocessing as mp

from autoshard.kernels import QuantLayout, reference
from autoshard.kernels.ops import triton_kernels

QDTYPES = ("int8", "fp8", "int4")
GiB = 1 << 30


def _bench(fn, device: torch.device) -> float:
    """Median seconds of ``fn()``: do_bench on CUDA, a few wall-clock runs elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_cases(n: int, block: int, rows: int, device: torch.device):
    """(name, layout, fn(tile, warps) -> output, bytes moved) per kernel at ``n`` elements."""
    tk = triton_kernels()
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    for qd in QDTYPES:
        lay = QuantLayout(qd, block, n, 1)
        q = tk.quantize_triton(x, lay)
        row_lay = QuantLayout(qd, block, n, rows)  # rows sources of n/rows each
        q_rows = tk.quantize_triton(x, row_lay)
        yield (f"quantize/{qd}", lambda tile, lay=lay: tk.quantize_triton(x, lay, tile), 2 * n + q.numel())
        yield (f"dequantize/{qd}", lambda tile, lay=lay, q=q: tk.dequantize_triton(q, lay, torch.bfloat16, tile),
               q.numel() + 2 * n)
        yield (f"dequantize_reduce/{qd}",
               lambda tile, lay=row_lay, q=q_rows: tk.dequantize_reduce_triton(q, lay, torch.float32, tile),
               q_rows.numel() + 4 * row_lay.shard_numel)


def check_bit_exact(device: torch.device, block: int) -> dict[str, bool]:
    """Triton kernels vs the reference on one awkward size (padding, NaN block, zero block)."""
    tk = triton_kernels()
    n, rows = 3 * block * 5 + 17, 3
    x = torch.randn(n, device=device) * 3
    x[5], x[block : 2 * block] = float("nan"), 0.0
    out = {}
    for qd in QDTYPES:
        lay = QuantLayout(qd, block, n, rows)
        ref_q = reference.quantize_ref(x, lay)
        out[f"quantize/{qd}"] = torch.equal(tk.quantize_triton(x, lay), ref_q)
        for od in (torch.bfloat16, torch.float32, torch.float16):
            d = tk.dequantize_triton(ref_q, lay, od).nan_to_num(7)
            r = tk.dequantize_reduce_triton(ref_q, lay, od).nan_to_num(7)
            out[f"dequantize/{qd}/{od}"] = torch.equal(d, reference.dequantize_ref(ref_q, lay, od).nan_to_num(7))
            want = reference.dequantize_reduce_ref(ref_q, lay, od).nan_to_num(7)
            out[f"dequantize_reduce/{qd}/{od}"] = torch.equal(r, want)
    return out


def bench_kernels(sizes: list[int], block: int, rows: int, tiles: list[tuple[int, int] | None],
                  device: torch.device) -> list[dict]:
    """One record per (size, kernel, tile)."""
    records = []
    for n in sizes:
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        copy_s = _bench(lambda: dst.copy_(src), device)
        copy_bw = 4 * n / copy_s
        records.append({"n": n, "kernel": "copy", "seconds": copy_s, "gbps": copy_bw / 1e9, "ratio": 1.0})
        del src, dst
        for name, fn, nbytes in _kernel_cases(n, block, rows, device):
            for tile in tiles:
                secs = _bench(lambda: fn(tile), device)
                elems, warps = tile if tile else ("default", "default")
                records.append({"n": n, "kernel": name, "tile": elems, "num_warps": warps, "seconds": secs,
                                "gbps": nbytes / secs / 1e9, "ratio": nbytes / secs / copy_bw})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def _gather_worker(rank: int, world: int, numel: int, block: int, iters: int, init: str, result_path: str) -> None:
    from autoshard.kernels.comm import quantized_all_gather

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    shard = torch.randn(numel // world, device=device, dtype=torch.bfloat16)
    full = torch.empty(numel, device=device, dtype=torch.bfloat16)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    runs = {"bf16": lambda: gather(full, shard)}
    for qd in ("int8", "fp8"):
        runs[qd] = lambda qd=qd: quantized_all_gather(shard, None, qd, block)
    result = {}
    for name, fn in runs.items():
        times = []
        for i in range(iters + 2):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:  # two warm-ups
                times.append(time.perf_counter() - start)
        wire = 2 * numel if name == "bf16" else world * QuantLayout(name, block, numel // world).chunk_bytes
        result[name] = {"seconds": statistics.median(times), "bytes_received": wire * (world - 1) // world}
    if rank == 0:
        Path(result_path).write_text(json.dumps(result))
    dist.destroy_process_group()


def bench_all_gather(world: int, nbytes: int, block: int, iters: int, workdir: Path) -> dict:
    """qwZ vs bf16 all-gather of ``nbytes`` of bf16 over ``world`` spawned processes."""
    result_path = workdir / "gather.json"
    init = f"file://{workdir / 'gather.init'}"
    (workdir / "gather.init").unlink(missing_ok=True)
    mp.start_processes(_gather_worker, args=(world, nbytes // 2, block, iters, init, str(result_path)),
                       nprocs=world, join=True, start_method="spawn")
    return json.loads(result_path.read_text())


def markdown(records: list[dict], gather: dict | None) -> str:
    """Markdown tables of the kernel records and the all-gather comparison."""
    lines = ["| n | kernel | tile | warps | GB/s | / copy |", "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['n']} | {r['kernel']} | {r.get('tile', '')} | {r.get('num_warps', '')} "
                     f"| {r['gbps']:.1f} | {r['ratio']:.2f} |")
    if gather:
        base = gather["bf16"]["seconds"]
        lines += ["", "| all-gather | bytes received / rank | ms | speed-up |", "| --- | --- | --- | --- |"]
        for name, g in gather.items():
            lines.append(f"| {name} | {g['bytes_received']} | {g['seconds'] * 1e3:.2f} | {base / g['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, run the benchmarks, write JSON to ``--out``, print markdown tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON results path")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sizes", type=int, nargs="*", default=[1 << 26, 1 << 28, 1 << 30], help="elements")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--rows", type=int, default=4, help="source ranks summed by dequantize_reduce")
    p.add_argument("--sweep", action="store_true", help="also time several (tile, num_warps) configs")
    p.add_argument("--world", type=int, default=2, help="processes for the all-gather (0: skip)")
    p.add_argument("--gather-bytes", type=int, default=GiB)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.sizes, args.gather_bytes, args.iters = [1 << 16], 1 << 17, 2
    if triton_kernels() is None or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit("kernels_bench needs a CUDA device, or TRITON_INTERPRET=1 with --smoke on CPU")
    tiles = [None]  # the launchers' per-kernel defaults
    if args.sweep:
        tiles += [(t, w) for t in (2048, 4096, 8192, 16384) for w in (4, 8, 16)]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "block": args.block,
              "bit_exact": check_bit_exact(device, args.block),
              "kernels": bench_kernels(args.sizes, args.block, args.rows, tiles, device), "all_gather": None}
    if args.world > 1:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report["all_gather"] = bench_all_gather(args.world, args.gather_bytes, args.block, args.iters,
                                                args.out.parent)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report["kernels"], report["all_gather"]))
    print("bit-exact vs reference:", all(report["bit_exact"].values()))
    return report


if __name__ == "__main__":
    main()
