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
- ``--sweep``: the same for the launch configs of ``sweep_grid`` (variant, tile, warps,
  pipelining); each config is checked bit for bit at the smallest size before it is timed.
- candidates (on by default, ``--no-candidates`` to skip): at the smallest size only, the
  few launch configs of ``candidate_grid`` for the cases closest to the goal (int4 quantize,
  int4 dequantize+reduce); ``best`` in the JSON lists, per (block, kernel, size), the
  default's ratio beside the best bit-exact config's. The default is what the launcher
  picks (``default_config``: per format, block and size); the report picks nothing else.
- ``ratio_same_bytes`` (smallest size): kernel GB/s over a bf16 copy moving the same number
  of bytes as the kernel (a 64M-element dequantize+reduce moves ~0.4x the bytes of the
  64M-element copy, so fixed launch/ramp/tail costs weigh more on it); ``host_us``: host
  time per launch (do_bench flushes L2 before each call, a ~90 us GPU job, so a launch
  slower than that on the host would show up in the kernel's time).
- qwZ: all-gather of a ``--gather-bytes`` bf16 tensor over ``--world`` processes (NCCL on
  GPUs, gloo on CPU): bf16 ``all_gather_into_tensor`` against quantize + gather of
  quantized rows + dequantize, for int8 and fp8; median of ``--iters`` timed iterations
  (spawned processes; ``benchmarks/qcomm_bench.py`` is the torchrun version with per-step
  times and an error-bound check, the one whose numbers the docs record).

Bit-exactness against the pure-torch reference on the same device, recorded in the JSON:
the defaults at two awkward sizes (``bit_exact``; skip with ``--no-small-check``), and every
timed config at the smallest timed size (``bit_exact`` of its record).
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

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _config_name(cfg) -> str:
    """Short label of a ``KernelConfig`` (``None``: the launcher's default)."""
    if cfg is None:
        return "default"
    loop = f"/s{cfg.stages}x{cfg.progs_per_sm}" if cfg.stages > 1 else ""
    unroll = "" if cfg.unroll == 8 else f"/u{cfg.unroll}"
    return f"{cfg.variant}/{cfg.elems}/w{cfg.num_warps}{loop}{'/cs' if cfg.stream else ''}{unroll}"


def candidate_grid(block: int) -> dict[tuple[str, str], list]:
    """Launch configs tried at the smallest size for the cases closest to the 0.9 goal (H100, 64M).

    int4 quantize: fewer warps per program, so a block's absmax reduction spans fewer warps
    (a 2048-element block is 1024 words: one warp holds it at 1 warp, 32 words a thread).
    int4 dequantize+reduce: bigger or smaller tiles, fewer warps, the tile kernel, and the
    runtime row loop (``u0``, the kernel before the rows were unrolled) for comparison.
    """
    kc = triton_kernels().KernelConfig
    return {
        ("quantize", "int4"): [kc("pairs", 8192, 8, stream=True), kc("pairs", 4096, 4, stream=True),
                               kc("pairs", 4096, 2, stream=True), kc("pairs", 2048, 2, stream=True),
                               kc("pairs", 2048, 1, stream=True)],
        ("dequantize_reduce", "int4"): [kc("pairs", 4096, 4, unroll=0), kc("pairs", 8192, 4), kc("pairs", 8192, 8),
                                        kc("pairs", 2048, 2), kc("tile", 4096, 4)],
    }


def sweep_grid(block: int, grid: str = "full") -> dict[str, list]:
    """Candidate launch configs per kernel for ``--sweep`` (the defaults are always timed first).

    ``tile``: the element-tile kernels; ``pairs``: pair-word kernels (kernels/triton_kernels.py),
    one tile per program or a persistent grid with software-pipelined loads (``stages`` > 1).
    The grid is smaller at blocks above 512, where only the leading candidates are re-timed;
    ``grid="confirm"`` holds only the runners-up of the full grid.
    """
    kc = triton_kernels().KernelConfig
    if grid == "confirm":  # the runners-up of the full grid on an H100, re-timed beside the defaults
        return {"quantize": [kc("pairs", 8192, 8), kc("pairs", 4096, 4, stream=True)],
                "dequantize": [kc("pairs", 4096, 4)], "dequantize_reduce": [kc("pairs", 4096, 4)]}
    if block > 512:
        return {"quantize": [kc("pairs", 8192, 8), kc("pairs", 4 * block, 8)],
                "dequantize": [kc("pairs", 4096, 4)], "dequantize_reduce": [kc("pairs", 4096, 4)]}
    return {
        "quantize": [kc("tile", 4096, 4), kc("pairs", 4096, 4), kc("pairs", 8192, 8), kc("pairs", 16384, 8),
                     kc("pairs", 8192, 16), kc("pairs", 8192, 8, stream=True), kc("pairs", 4096, 4, 3, 4),
                     kc("pairs", 8192, 8, 2, 2)],
        "dequantize": [kc("pairs", 2048, 4), kc("pairs", 4096, 4), kc("pairs", 8192, 8), kc("pairs", 4096, 4, 3, 4)],
        "dequantize_reduce": [kc("pairs", 2048, 4), kc("pairs", 4096, 4), kc("pairs", 4096, 8),
                              kc("pairs", 2048, 4, 3, 4)],
    }


class _Inputs:
    """Per element count: the bf16 input (one NaN, one zero block), its quantized buffers, copy time."""

    def __init__(self, n: int, block: int, rows: int, device: torch.device):
        tk = triton_kernels()
        self.n, self.rows = n, rows
        self.x = torch.randn(n, device=device, dtype=torch.bfloat16)
        self.x[7], self.x[block : 2 * block] = float("nan"), 0.0  # exercised by the bit-exact checks
        self.lay = {qd: QuantLayout(qd, block, n, 1) for qd in QDTYPES}
        self.row_lay = {qd: QuantLayout(qd, block, n, rows) for qd in QDTYPES}  # rows sources of n/rows each
        self.q = {qd: tk.quantize_triton(self.x, lay) for qd, lay in self.lay.items()}
        self.q_rows = {qd: tk.quantize_triton(self.x, lay) for qd, lay in self.row_lay.items()}

    def case(self, kernel: str, qd: str):
        """(fn(config) -> output, bytes moved, fn() -> reference output)."""
        tk, x, lay, q = triton_kernels(), self.x, self.lay[qd], self.q[qd]
        if kernel == "quantize":
            return (lambda c: tk.quantize_triton(x, lay, c), 2 * self.n + q.numel(),
                    lambda: reference.quantize_ref(x, lay))
        if kernel == "dequantize":
            return (lambda c: tk.dequantize_triton(q, lay, torch.bfloat16, c), q.numel() + 2 * self.n,
                    lambda: reference.dequantize_ref(q, lay, torch.bfloat16))
        rl, qr = self.row_lay[qd], self.q_rows[qd]
        return (lambda c: tk.dequantize_reduce_triton(qr, rl, torch.float32, c), qr.numel() + 4 * rl.shard_numel,
                lambda: reference.dequantize_reduce_ref(qr, rl, torch.float32))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaNs in the same places."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def check_bit_exact(device: torch.device, block: int) -> dict[str, bool]:
    """The default kernels vs the reference at awkward sizes: an odd size (padding, tile-kernel
    fallback) and an even one (pair-word kernels), each with a NaN block and a zero block."""
    tk = triton_kernels()
    out = {}
    for n, rows in ((3 * block * 5 + 17, 3), (2 * block * 7 + 6, 2)):
        x = torch.randn(n, device=device) * 3
        x[5], x[block : 2 * block] = float("nan"), 0.0
        for qd in QDTYPES:
            lay = QuantLayout(qd, block, n, rows)
            ref_q = reference.quantize_ref(x, lay)
            out[f"quantize/{qd}/{n}"] = torch.equal(tk.quantize_triton(x, lay), ref_q)
            out[f"quantize/{qd}/bf16/{n}"] = torch.equal(tk.quantize_triton(x.bfloat16(), lay),
                                                          reference.quantize_ref(x.bfloat16(), lay))
            for od in (torch.bfloat16, torch.float32, torch.float16):
                d = tk.dequantize_triton(ref_q, lay, od)
                r = tk.dequantize_reduce_triton(ref_q, lay, od)
                out[f"dequantize/{qd}/{od}/{n}"] = _same(d, reference.dequantize_ref(ref_q, lay, od))
                out[f"dequantize_reduce/{qd}/{od}/{n}"] = _same(r, reference.dequantize_reduce_ref(ref_q, lay, od))
    return out


class _CopyRef:
    """bf16 device-copy bandwidth: per element count (the ratio's reference), and per byte
    count at the smallest size (``ratio_same_bytes``), each measured once and cached."""

    def __init__(self, device: torch.device):
        self.device, self._by_bytes = device, {}

    def bytes_per_s(self, nbytes: int) -> float:
        elems = max(1, round(nbytes / 4))  # bf16 copy: 2 bytes read + 2 written per element
        if elems not in self._by_bytes:
            src = torch.randn(elems, device=self.device, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            self._by_bytes[elems] = 4 * elems / _bench(lambda: dst.copy_(src), self.device)
            del src, dst
        return self._by_bytes[elems]


def _host_us(fn, device: torch.device) -> float:
    """Host (CPU) microseconds per launch of ``fn``, the GPU left to run behind."""
    calls = 20 if device.type == "cuda" else 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host


def bench_kernels(sizes: list[int], blocks: list[int], rows: int, sweep: str | None, device: torch.device,
                  deadline_s: float = float("inf"), on_record=None, candidates: bool = True) -> list[dict]:
    """One record per (block, kernel, config, size): the defaults first, then the candidate
    configs at the smallest size (``candidates``), then the sweep grid.

    Each config is checked bit for bit against the reference at the smallest size (the
    input holds a NaN and an all-zero block) before it is timed. Configs are skipped once
    ``deadline_s`` seconds have passed (records say how many were skipped).
    """
    start, records, skipped = time.perf_counter(), [], 0
    copies = _CopyRef(device)
    for block in blocks:
        inputs = [_Inputs(n, block, rows, device) for n in sizes]
        copy_bw = {}
        for inp in inputs:
            dst = torch.empty_like(inp.x)
            secs = _bench(lambda: dst.copy_(inp.x), device)
            copy_bw[inp.n] = 4 * inp.n / secs
            records.append({"block": block, "n": inp.n, "kernel": "copy", "seconds": secs,
                            "gbps": copy_bw[inp.n] / 1e9, "ratio": 1.0})
            del dst
        plan = [(kernel, qd, None, inputs) for kernel in ("quantize", "dequantize", "dequantize_reduce")
                for qd in QDTYPES]
        if candidates:  # at the smallest size; a candidate equal to the resolved default is not re-timed
            n0 = inputs[0].n
            plan += [(kernel, qd, cfg, inputs[:1]) for (kernel, qd), cfgs in candidate_grid(block).items()
                     for cfg in cfgs if cfg != triton_kernels().default_config(kernel, qd, block, n0)[0]]
        grid = sweep_grid(block, sweep) if sweep else {}
        plan += [(kernel, qd, cfg, inputs) for kernel in ("quantize", "dequantize", "dequantize_reduce")
                 for cfg in grid.get(kernel, []) for qd in QDTYPES]
        for kernel, qd, cfg, inps in plan:
            if time.perf_counter() - start > deadline_s:
                skipped += 1
                continue
            records += _time_config(inps, kernel, qd, cfg, block, copy_bw, copies, device)
            if on_record:
                on_record(records)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if skipped:
        records.append({"kernel": "skipped", "count": skipped, "deadline_s": deadline_s})
    return records


def _time_config(inputs, kernel, qd, cfg, block, copy_bw, copies, device) -> list[dict]:
    """Records of one (kernel, format, config) at every size; bit-exact check, host launch
    time and the same-bytes copy ratio at the first."""
    tk, out = triton_kernels(), []
    for i, inp in enumerate(inputs):
        fn, nbytes, ref = inp.case(kernel, qd)
        rec = {"block": block, "n": inp.n, "kernel": f"{kernel}/{qd}", "config": _config_name(cfg)}
        if cfg is None:  # what the launcher picks at this block and size
            lay = inp.row_lay[qd] if kernel == "dequantize_reduce" else inp.lay[qd]
            rec["resolved"] = _config_name(tk.default_config(kernel, qd, block, lay.numel)[0])
        if i == 0:
            rec["bit_exact"] = _same(fn(cfg), ref())
            rec["host_us"] = _host_us(lambda: fn(cfg), device)
        secs = _bench(lambda: fn(cfg), device)
        rec.update(seconds=secs, gbps=nbytes / secs / 1e9, ratio=nbytes / secs / copy_bw[inp.n])
        if i == 0:
            rec["ratio_same_bytes"] = nbytes / secs / copies.bytes_per_s(nbytes)
        out.append(rec)
    return out


def best_configs(records: list[dict]) -> list[dict]:
    """Per (block, kernel, size) timed with more than the default: the default's ratio beside
    the best bit-exact config's (the default is what the launcher runs; nothing is re-chosen)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("config") is not None:
            groups.setdefault((r["block"], r["kernel"], r["n"]), []).append(r)
    out = []
    for (block, kernel, n), recs in groups.items():
        default = next((r for r in recs if r["config"] == "default"), None)
        exact = [r for r in recs if r.get("bit_exact", True)]
        if default is None or len(recs) < 2 or not exact:
            continue
        best = max(exact, key=lambda r: r["ratio"])
        out.append({"block": block, "kernel": kernel, "n": n, "default": default.get("resolved", "default"),
                    "default_ratio": default["ratio"], "best": best["config"], "best_ratio": best["ratio"],
                    "default_is_best": best is default or best["config"] == default.get("resolved")})
    return out


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


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A blank line, then a markdown table of ``header`` and ``rows`` (cells already formatted)."""
    return ["", "| " + " | ".join(header) + " |", "| --- " * len(header) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def markdown(records: list[dict], gather: dict | None, best: list[dict] | None = None) -> str:
    """Markdown tables: ratio to copy per (block, kernel, config) across sizes; the all-gather comparison."""
    sizes = sorted({r["n"] for r in records if "n" in r})
    rows: dict[tuple, dict[int, float]] = {}
    for r in records:
        if "n" in r:
            key = (r["block"], r["kernel"], r.get("config", ""))
            rows.setdefault(key, {})[r["n"]] = r["gbps"] if r["kernel"] == "copy" else r["ratio"]
    head = " | ".join(f"{n // (1 << 20)}M" for n in sizes)
    lines = [f"| block | kernel | config | {head} | exact |", "| --- " * (4 + len(sizes)) + "|"]
    exact = {(r["block"], r["kernel"], r.get("config", "")): r["bit_exact"] for r in records if "bit_exact" in r}
    for key, by_n in rows.items():
        cells = " | ".join(f"{by_n[n]:.{0 if key[1] == 'copy' else 3}f}" if n in by_n else "" for n in sizes)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cells} | {exact.get(key, '')} |")
    lines += [f"skipped (deadline): {r['count']}" for r in records if r["kernel"] == "skipped"]
    if best:
        lines += _table(("block", "kernel", "size", "default (resolved)", "ratio", "best bit-exact", "ratio"),
                        [(b["block"], b["kernel"], f"{b['n'] >> 20}M", b["default"], f"{b['default_ratio']:.3f}",
                          b["best"], f"{b['best_ratio']:.3f}") for b in best])
    same = [r for r in records if "ratio_same_bytes" in r and r.get("config") == "default"]
    if same:
        lines += _table(("block", "kernel (default)", "size", "ratio", "ratio to a same-bytes copy", "host us/launch"),
                        [(r["block"], r["kernel"], f"{r['n'] >> 20}M", f"{r['ratio']:.3f}",
                          f"{r['ratio_same_bytes']:.3f}", f"{r['host_us']:.0f}") for r in same])
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
    p.add_argument("--blocks", type=int, nargs="*", default=[512], help="quantization block sizes")
    p.add_argument("--rows", type=int, default=4, help="source ranks summed by dequantize_reduce")
    p.add_argument("--sweep", nargs="?", const="full", choices=("full", "confirm"),
                   help="also time the sweep_grid() launch configs")
    p.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which configs are skipped")
    p.add_argument("--no-candidates", action="store_true", help="skip the candidate_grid() configs")
    p.add_argument("--no-small-check", action="store_true", help="skip the awkward-size bit-exact check")
    p.add_argument("--world", type=int, default=2, help="processes for the all-gather (0: skip)")
    p.add_argument("--gather-bytes", type=int, default=GiB)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.sizes, args.gather_bytes, args.iters = [1 << 14], 1 << 15, 2
    if triton_kernels() is None or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        sys.exit("kernels_bench needs a CUDA device, or TRITON_INTERPRET=1 with --smoke on CPU")
    import triton

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "blocks": args.blocks, "rows": args.rows,
              "defaults": {"/".join(k): _config_name(c) for k, c in triton_kernels().CUDA_CONFIGS.items()},
              "default_rules": [{"kernel": k, "qdtype": qd, "min_block": b, "max_numel": m, "config": _config_name(c),
                                 "why": why} for k, qd, b, m, c, why in triton_kernels().CUDA_CONFIG_RULES],
              "bit_exact": {} if args.no_small_check else check_bit_exact(device, args.blocks[0]),
              "kernels": [], "all_gather": None}

    def save(records):
        report["kernels"] = records
        report["best"] = best_configs(records)
        args.out.write_text(json.dumps(report, indent=1))

    save(bench_kernels(args.sizes, args.blocks, args.rows, args.sweep, device, args.deadline, save,
                       candidates=not args.no_candidates))
    if args.world > 1:
        report["all_gather"] = bench_all_gather(args.world, args.gather_bytes, args.blocks[0], args.iters,
                                                args.out.parent)
    save(report["kernels"])
    print(markdown(report["kernels"], report["all_gather"], report["best"]))
    exact = list(report["bit_exact"].values()) + [r["bit_exact"] for r in report["kernels"] if "bit_exact" in r]
    print("bit-exact vs reference:", all(exact))
    return report


if __name__ == "__main__":
    main()
