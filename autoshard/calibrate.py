"""``autoshard cluster calibrate``: measure this machine and write the file ``Cluster.with_calibration`` reads.

What is measured (medians of ``iters`` timed runs after one warm-up; CUDA
synchronised around each):

- **matmul efficiency**: ``n×n @ n×n`` in ``dtype`` (bf16 on GPUs, fp32 on the
  CPU) for each ``n`` of ``matmul_sizes``; achieved FLOP/s = ``2n³ / t``;
  ``matmul_efficiency`` = achieved at the largest ``n`` / ``device.peak_flops[dtype]``
  (the cost model's "achieved / peak for large GEMMs").
- **kernel overhead**: a chain of ``overhead_ops`` eager ``x.add_(1)`` on a
  4 KiB tensor, synchronised once at the end; ``kernel_overhead_s`` = time /
  ops: what one eager op costs when the device is starved (launch + dispatch),
  the cost model's per-kernel floor. On CUDA, ``graph_kernel_s`` is what a
  rollout's captured decode step pays per op the price counts: a fixed small
  Llama's decode step (``DECODE_PROBE``: 4 blocks of width 1024, 32 sequences)
  captured and replayed, less its weight and cache reads, over its ops counted
  on ``meta``. (A chain of tiny adds replayed gives 1.0 µs per kernel on an
  H200, while the kernels of a real decode step cost 3.4–3.7 µs each there:
  ``benchmarks/results/rl_step_h200x2_2026-11-28``.) ``graph_compiled_kernel_s``:
  the same with the probe's step compiled before capture, as the rollout runs
  it (about 10 s of compilation). ``eager_kernel_s`` / ``eager_inference_kernel_s``: host seconds per
  counted kernel of an eager program's forward + backward / ``no_grad`` forward, timed on a fixed small
  Llama (``EAGER_PROBE``) whose kernels are tiny (CUDA only; the cost model's eager host floor). Over several ranks, 64
  4 KiB all-reduces captured together give ``graph_collective_s``, per
  collective of the captured step (``search/rollout.py``).
- **GEMM knee**: the matmul sweep runs small sizes too. The cost model's
  small-GEMM law ``e(w) = e_max · w / (w + knee)`` (``w = 2n³``) plus the launch
  floor makes each time affine in the work: ``t = c + s·w`` with ``s = 1 /
  (e_max·peak)`` and ``c = kernel_overhead_s + knee·s``. Least squares on the
  *relative* residuals (each row divided by its measured ``t``) fits ``c`` and
  ``s``; ``gemm_knee_flops = max(c − kernel_overhead_s, 0) / s``. Fitting ``1/e``
  against ``1/w`` instead lets the smallest, overhead-dominated sizes swing the
  knee: with ±10 % timing noise it moved 3–6× between draws (a 2e9 knee fitted
  as 6e8 … 3.6e9; one 2-H200 calibration gave 7.5e10, a 95 µs constant per
  GEMM, and priced a 1.1B model's step 32% slow), while this fit stays within
  about 20 % (``tests/test_calibrate.py``).
- **HBM bandwidth**: ``dst.copy_(src)`` of ``copy_bytes``; bytes moved = read +
  written = ``2·copy_bytes``; ``hbm_efficiency`` = that / t / ``device.hbm_bandwidth``.
- **attention efficiency**: causal ``scaled_dot_product_attention`` forward + backward in ``dtype``
  for each ``(batch, heads, seq, head_dim)`` of ``attention_shapes`` (flash on GPUs); the work is
  counted as capture counts it (``4·batch·heads·seq²·head_dim`` forward, the full square: capture
  does not halve a causal mask) and the cost model prices backward as twice forward, so
  ``attention_efficiency`` = median over shapes of ``3·F_fwd / (t_fwd+bwd · peak)``: the figure
  with which the cost model's attention term reproduces the measured forward + backward.
- **collective α/β** (only with a process group of ≥ 2 ranks): all-reduce and
  all-gather of each size in ``message_bytes`` over the world. With the ring
  formulas of ``search/comm.py`` (``g`` ranks, ``n`` bytes of the full tensor,
  ``k`` = 2 for all-reduce, 1 for all-gather)::

      t = k(g−1)·α + k(g−1)/g · n · (1/β)

  every sample is one linear equation in (α, 1/β); both are fitted by least
  squares over all samples (α clamped at 0 and 1/β refitted when the
  unconstrained fit makes it negative). The result is the ``intra_node`` link
  when the world lies in one node, else ``inter_node`` (a ring across nodes
  pays the slowest link).

- **overlap** (with a process group of ≥ 2 ranks): a chain of ``overlap_gemms`` ``n×n`` matmuls
  (``n = overlap_gemm``, seconds ``t_c``) against an all-gather over the world started just before
  it (``async_op``: NCCL's own stream, as the runtime's in-graph collectives), sized to take about
  0.4·t_c and 2·t_c alone (``t_n``). The cost model prices a collective ``c`` hidden under compute
  ``w`` as ``exposed = c − (1 − κ)·min(c, f·w)`` (``search/layer_terms``): with the small one fully
  hidden, ``t_both = t_c + κ·t_n`` gives ``overlap_contention`` κ (what hidden communication slows
  compute by: NCCL kernels take SMs and HBM bandwidth); with the big one, ``t_both = t_c + t_n −
  (1 − κ)·f·t_c`` gives ``overlap_efficiency`` f (the share of a compute window a collective can
  fill). Both clipped to [0, 1] (f above 0); every rank takes the slowest rank's times.
- **optimizer** (``autoshard/calibrate_probe.py``): the AdamW slot step of
  ``runtime/optimizer.py`` (cast, norm, clip scale, update, write-back) over
  one flat fp32 buffer of ``optimizer_params`` elements and over
  ``optimizer_tensors`` tiny tensors: ``adamw_s_per_param`` (slope) and
  ``adamw_s_per_tensor`` (per-tensor floor), what the cost model's optimizer
  term uses instead of its pass count over HBM bandwidth.
- **model probe** (only with ``--model``; ``autoshard/calibrate_probe.py``):
  forward and backward seconds of each distinct layer of the reference model
  at ``--seq`` for each ``--micro-batch`` size and ``--probe-tp`` shard, in
  the compute dtype; the file's ``layer_times``, which the cost model uses
  instead of its FLOP/byte terms (``search/measured.py``).

Efficiencies are clipped to (0, 1]: a CPU "peak" from a preset is only an
estimate, and a measured value above it means the preset is low, not that
the model should expect more than peak. The file holds only the keys
``Cluster.with_calibration`` accepts (``device``, ``date``, ``matmul_efficiency``,
``hbm_efficiency``, ``attention_efficiency``, ``kernel_overhead_s``, ``gemm_knee_flops``, ``intra_node``/``inter_node``,
``overlap_contention``, ``overlap_efficiency``,
``adamw_s_per_param``, ``adamw_s_per_tensor``, ``layer_times``); the raw samples go to
``--raw FILE`` when asked.

Under torchrun every rank measures (collectives need them all); rank 0 writes.
``--out`` and ``--raw`` are checked before anything is measured
(``file_io.check_output_path``: a regular file or a new one, missing parent
directories created) and written atomically (``file_io.atomic_write``).
Rank 0 shows which probe runs and the ETA on stdout (``autoshard/progress.py``:
a live row on a terminal, a plain line every 2 s in a log; none with ``--quiet``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoshard import file_io
from autoshard.calibrate_probe import (ProbeSpec, compile_scaled, compiled_saved_scale, parse_int_list, probe_adamw,
                                      probe_layers)
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.progress import ProgressFn, Update, reporter

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1}
_MIN_EFFICIENCY = 1e-3
# torch 2.13 renames all_gather_into_tensor (deprecated there); 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, kw_only=True)
class CalibrationSizes:
    """What to measure. The defaults are GPU-sized; ``quick()`` is for CPUs and tests."""

    matmul_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    copy_bytes: int = 1 << 30
    message_bytes: tuple[int, ...] = tuple(1 << k for k in range(16, 30, 2))  # 64 KiB … 256 MiB
    overhead_ops: int = 500
    optimizer_params: int = 1 << 24  # elements of the flat AdamW buffer (64 MiB of fp32 each state)
    optimizer_tensors: int = 256  # tiny tensors of the per-tensor AdamW floor
    # (batch, heads, seq, head_dim) of the attention probe: the head widths of common models
    attention_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 32, 2048, 128), (8, 16, 2048, 64),
                                                                (2, 32, 4096, 128), (4, 8, 2048, 256))
    overlap_gemm: int = 4096  # n of the overlap probe's matmuls
    overlap_gemms: int = 40  # matmuls in its compute window (~8 ms on an H200)
    overlap_base_bytes: int = 1 << 27  # the first all-gather, timed to size the two of the probe
    iters: int = 10

    @classmethod
    def quick(cls) -> CalibrationSizes:
        """Tiny sizes: seconds on a CPU."""
        return cls(matmul_sizes=(32, 64, 128, 256), copy_bytes=1 << 22, message_bytes=(1 << 12, 1 << 18, 1 << 22),
                   overhead_ops=50, optimizer_params=1 << 16, optimizer_tensors=16,
                   attention_shapes=((1, 2, 64, 16),), overlap_gemm=128, overlap_gemms=8,
                   overlap_base_bytes=1 << 18, iters=3)


@dataclass(frozen=True)
class CommSample:
    """One timed collective: op, group size, bytes of the full tensor, median seconds."""

    op: str
    group_size: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """Measured figures and the samples behind them; ``to_file_dict`` is what the file holds."""

    device: str
    date: str
    matmul_efficiency: float
    hbm_efficiency: float
    attention_efficiency: float | None = None
    kernel_overhead_s: float = 0.0
    gemm_knee_flops: float = 0.0
    link_level: str | None = None  # "intra_node" | "inter_node" | None (single rank)
    latency_s: float | None = None
    bandwidth: float | None = None
    overlap_contention: float | None = None
    overlap_efficiency: float | None = None
    adamw_s_per_param: float | None = None
    adamw_s_per_tensor: float | None = None
    graph_kernel_s: float | None = None  # per counted op of a replayed decode step (rollout, search/rollout.py)
    graph_compiled_kernel_s: float | None = None  # the same, the step compiled before capture (as the rollout runs it)
    graph_collective_s: float | None = None  # per small all-reduce inside a replayed CUDA graph, over the world
    eager_kernel_s: float | None = None  # per counted kernel of an eager training step (forward + backward)
    eager_inference_kernel_s: float | None = None  # per counted kernel of an eager forward under no_grad
    layer_times: dict[str, Any] | None = None  # {"model", "dtype", "seq_len", "samples": [...]} (model probe)
    matmul: dict[int, float] = field(default_factory=dict)  # n → achieved FLOP/s
    copy_bytes_per_s: float = 0.0
    attention: tuple[dict[str, Any], ...] = ()  # {"shape": [b, h, s, d], "seconds": fwd + bwd, "efficiency"}
    overlap: dict[str, float] = field(default_factory=dict)  # the overlap probe's times (measure_overlap)
    comm: tuple[CommSample, ...] = ()

    def to_file_dict(self) -> dict[str, Any]:
        """The calibration file (``Cluster.with_calibration`` format)."""
        out: dict[str, Any] = {"device": self.device, "date": self.date, "matmul_efficiency": self.matmul_efficiency,
                               "hbm_efficiency": self.hbm_efficiency, "kernel_overhead_s": self.kernel_overhead_s,
                               "gemm_knee_flops": self.gemm_knee_flops}
        if self.link_level is not None:
            out[self.link_level] = {"bandwidth": self.bandwidth, "latency": self.latency_s}
        for key in ("attention_efficiency", "overlap_contention", "overlap_efficiency", "adamw_s_per_param", "adamw_s_per_tensor",
                    "graph_kernel_s", "graph_compiled_kernel_s", "graph_collective_s", "eager_kernel_s",
                    "eager_inference_kernel_s", "layer_times"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def to_raw_dict(self) -> dict[str, Any]:
        """Everything measured, for ``--raw``."""
        return {**self.to_file_dict(), "matmul_flops_per_s": {str(k): v for k, v in self.matmul.items()},
                "copy_bytes_per_s": self.copy_bytes_per_s, "attention": list(self.attention), "overlap": self.overlap,
                "comm": [asdict(s) for s in self.comm]}


# --------------------------------------------------------------------------- timing


def _median_seconds(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Median wall seconds of ``fn`` over ``iters`` runs after one warm-up (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul(sizes: Sequence[int], dtype: torch.dtype, device: torch.device, iters: int) -> dict[int, float]:
    """Achieved FLOP/s of an ``n×n @ n×n`` matmul for each ``n`` (``2n³`` FLOP)."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        out[n] = 2.0 * n**3 / _median_seconds(lambda: a @ b, iters, device)
    return out


def measure_kernel_overhead(ops: int, device: torch.device, iters: int) -> float:
    """Seconds per eager op in a chain of ``ops`` tiny in-place adds (launch + dispatch floor)."""
    x = torch.zeros(1024, device=device)

    def chain() -> None:
        for _ in range(ops):
            x.add_(1.0)

    return _median_seconds(chain, iters, device) / ops


def _captured(body: Callable[[], Any], device: torch.device) -> torch.cuda.CUDAGraph:
    """``body`` warmed up on a side stream, then captured as a CUDA graph."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


# The decode-step probe: a fixed small Llama (not the priced model), its decode step captured as the rollout does.
DECODE_PROBE = {"num_layers": 4, "hidden": 1024, "num_heads": 8, "num_kv_heads": 8, "ffn_hidden": 2816,
                "vocab_size": 256, "max_seq_len": 256}
DECODE_PROBE_BATCH = 32


def measure_graph_kernel(device: torch.device, iters: int, bytes_per_s: float, compile: bool = False) -> float | None:
    """Seconds per counted op of a replayed decode step (None off CUDA): the ``DECODE_PROBE`` Llama's KV-cached
    step at ``DECODE_PROBE_BATCH`` sequences, captured as ``runtime/rollout_graph.py`` captures a rollout's
    (``compile``: compiled first, as the rollout runs it), its replay time less the weights and cache read at
    ``bytes_per_s``, over its ops counted on ``meta`` (``search.rollout.count_decode_ops``, the count the price
    multiplies)."""
    if device.type != "cuda":
        return None
    from autoshard.models import build
    from autoshard.runtime.rollout_graph import DecodeGraph
    from autoshard.search.rollout import count_decode_ops

    model = build("llama:tiny", device=device, dtype=torch.bfloat16, **DECODE_PROBE).eval()
    cache = model.new_cache(DECODE_PROBE_BATCH, DECODE_PROBE["max_seq_len"])
    step = DecodeGraph(model, cache, DECODE_PROBE_BATCH, device, compile=compile).graph
    replays = 10

    def replay() -> None:
        for _ in range(replays):
            step.replay()

    seconds = _median_seconds(replay, iters, device) / replays
    read = sum(t.numel() * t.element_size() for t in [*model.parameters(), *cache.keys, *cache.values])
    return max(seconds - read / bytes_per_s, 0.0) / count_decode_ops("llama:tiny", **DECODE_PROBE)


# The eager-step probe: a fixed small Llama whose kernels are tiny, so that its eager step is all host time.
EAGER_PROBE = {"num_layers": 4, "hidden": 256, "num_heads": 4, "num_kv_heads": 4, "ffn_hidden": 704,
               "vocab_size": 256, "max_seq_len": 64}
EAGER_PROBE_BATCH = 2


def measure_eager_kernel(device: torch.device, iters: int) -> tuple[float, float] | None:
    """``eager_probe`` on CUDA; None elsewhere (on CPU ranks an op's host time and its compute are one thread's,
    which the roofline's sum already prices)."""
    return eager_probe(device, iters) if device.type == "cuda" else None


def eager_probe(device: torch.device, iters: int) -> tuple[float, float]:
    """(training, inference) seconds per counted kernel of an eager program: the
    ``EAGER_PROBE`` Llama's forward + backward, and its forward under ``no_grad``, over the forward kernels the
    cost model counts for its captured layers (``layer_terms.forward_kernels``; a backward counts
    ``BACKWARD_KERNEL_FACTOR`` times as many). Its kernels are tiny, so the time is what the host spends per op:
    the Python module calls, dispatch, autograd's recording and its engine, and the launch."""
    from autoshard.models import build
    from autoshard.passes.capture import capture_reference
    from autoshard.search import layer_terms

    graph = capture_reference("llama:tiny", seq_lens=(16, 32), **EAGER_PROBE)
    count = sum(layer_terms.forward_kernels(layer) for layer in graph.layers)
    model = build("llama:tiny", device=device, dtype=torch.bfloat16, **EAGER_PROBE)
    tokens = torch.randint(0, EAGER_PROBE["vocab_size"], (EAGER_PROBE_BATCH, EAGER_PROBE["max_seq_len"]), device=device)
    repeats = 5

    def loss() -> torch.Tensor:
        out = model(tokens)
        return sum(t.float().log_softmax(-1).mean() if t.dim() == 3 else t.float().mean()
                   for t in (out if isinstance(out, tuple) else (out,)))

    def train() -> None:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            loss().backward()

    def infer() -> None:
        with torch.no_grad():
            for _ in range(repeats):
                loss()

    step = _median_seconds(train, iters, device) / repeats
    forward = _median_seconds(infer, iters, device) / repeats
    return step / ((1.0 + layer_terms.BACKWARD_KERNEL_FACTOR) * count), forward / count


def measure_graph_collective(count: int, device: torch.device, iters: int) -> float | None:
    """Seconds per 4 KiB all-reduce over the world inside a replayed CUDA graph (the slowest rank's median);
    None off CUDA, alone, or where NCCL cannot be captured."""
    if device.type != "cuda" or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    x = torch.zeros(1024, device=device)

    def chain() -> None:
        for _ in range(count):
            dist.all_reduce(x)

    try:
        graph = _captured(chain, device)
    except RuntimeError:
        return None
    return _slowest(_median_seconds(graph.replay, iters, device) / count, device)


def fit_gemm_knee(flops_per_s: dict[int, float], peak: float, overhead_s: float) -> float:
    """GEMM knee (FLOP) of ``e(w) = e_max·w/(w + knee)`` fitted to ``n → achieved FLOP/s`` (module docstring).

    Raises ``AutoshardError`` with fewer than 2 sizes.
    """
    if len(flops_per_s) < 2:
        raise AutoshardError(f"fit_gemm_knee needs ≥ 2 matmul sizes, got {sorted(flops_per_s)}; "
                             "measure more matmul_sizes")
    rows, ys = [], []
    for n, rate in flops_per_s.items():
        work = 2.0 * n**3
        seconds = work / rate
        rows.append((1.0 / seconds, work / seconds))  # t = c + s·w, each row over its t: relative residuals
        ys.append(1.0)
    c, s = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                              torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    del peak  # e_max = 1 / (s·peak) is measured apart (the largest size's efficiency)
    return max(c - overhead_s, 0.0) / s if s > 0 else 0.0


def measure_attention(shapes: Sequence[tuple[int, int, int, int]], dtype: torch.dtype, device: torch.device,
                      iters: int, peak: float) -> tuple[dict[str, Any], ...]:
    """Causal SDPA forward + backward per ``(batch, heads, seq, head_dim)``: seconds and the cost model's
    efficiency ``3·F_fwd / (t · peak)``, ``F_fwd = 4·b·h·s²·d`` (module docstring)."""
    out = []
    for b, h, s, d in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

        def step() -> None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.backward(y, grad)

        seconds = _median_seconds(step, iters, device)
        flops = 3.0 * 4.0 * b * h * s * s * d
        out.append({"shape": [b, h, s, d], "seconds": seconds, "efficiency": flops / seconds / peak})
    return tuple(out)


def measure_copy(nbytes: int, device: torch.device, iters: int) -> float:
    """Bytes/s of a device copy, counting bytes read + written (``2·nbytes`` per copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _median_seconds(lambda: dst.copy_(src), iters, device)


def measure_collectives(message_bytes: Sequence[int], device: torch.device, iters: int,
                        group: Any = None) -> tuple[CommSample, ...]:
    """All-reduce and all-gather of each size over ``group``; each sample is the slowest rank's median."""
    size = dist.get_world_size(group)
    samples = []
    for nbytes in message_bytes:
        numel = max(size, nbytes // 4 // size * size)  # fp32, a multiple of the group size
        full = torch.ones(numel, dtype=torch.float32, device=device)
        shard = torch.ones(numel // size, dtype=torch.float32, device=device)
        ops = {"all_reduce": lambda: dist.all_reduce(full, group=group),
               "all_gather": lambda: _all_gather(full, shard, group=group)}
        for op, run in ops.items():
            seconds = torch.tensor([_median_seconds(run, iters, device)], dtype=torch.float64, device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
            samples.append(CommSample(op, size, numel * 4, float(seconds.item())))
    return tuple(samples)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_overlap(gemm: int, gemms: int, dtype: torch.dtype, device: torch.device, iters: int,
                    base_bytes: int = 1 << 27) -> dict[str, float]:
    """The overlap probe (module docstring): ``t_c``, and per comm size ``t_n`` and ``t_both``, slowest rank.
    Each all-gather is sized from a first one of ``base_bytes`` (large enough to be bandwidth-bound, so
    that scaling it by the wanted time holds)."""
    world = dist.get_world_size()
    a, b = torch.randn(gemm, gemm, device=device, dtype=dtype), torch.randn(gemm, gemm, device=device, dtype=dtype)

    def compute() -> None:
        for _ in range(gemms):
            torch.mm(a, b)

    def gather(shard: torch.Tensor, full: torch.Tensor) -> Any:
        return _all_gather(full, shard, async_op=True)

    t_c = _slowest(_median_seconds(compute, iters, device), device)
    base = base_bytes
    out: dict[str, float] = {"compute_s": t_c}
    for label, target in (("small", 0.4), ("big", 2.0)):
        numel = max(world, base // 4 // world * world)
        full = torch.empty(numel, dtype=torch.float32, device=device)
        shard = torch.ones(numel // world, dtype=torch.float32, device=device)
        t_base = _slowest(_median_seconds(lambda: gather(shard, full).wait(), iters, device), device)
        numel = max(world, int(numel * target * t_c / max(t_base, 1e-9)) // world * world)
        full = torch.empty(numel, dtype=torch.float32, device=device)
        shard = torch.ones(numel // world, dtype=torch.float32, device=device)

        def both() -> None:
            work = gather(shard, full)
            compute()
            work.wait()

        out[f"{label}_bytes"] = float(numel * 4)
        out[f"{label}_comm_s"] = _slowest(_median_seconds(lambda: gather(shard, full).wait(), iters, device), device)
        out[f"{label}_both_s"] = _slowest(_median_seconds(both, iters, device), device)
    return out


def fit_overlap(times: dict[str, float]) -> tuple[float, float]:
    """(κ, f) of the cost model's overlap law from ``measure_overlap``'s times (module docstring)."""
    t_c = times["compute_s"]
    kappa = (times["small_both_s"] - t_c) / times["small_comm_s"]
    kappa = min(1.0, max(0.0, kappa))
    f = (t_c + times["big_comm_s"] - times["big_both_s"]) / ((1.0 - kappa) * t_c) if kappa < 1.0 else _MIN_EFFICIENCY
    return kappa, min(1.0, max(_MIN_EFFICIENCY, f))


def fit_alpha_beta(samples: Sequence[CommSample]) -> tuple[float, float]:
    """Least-squares (α seconds, β bytes/s) of the ring model (module docstring) over ``samples``.

    Raises ``AutoshardError`` when the samples do not determine a positive bandwidth
    (too few sizes, or times that do not grow with the message).
    """
    rows, times = [], []
    for s in samples:
        k, g = _RING_FACTOR[s.op], s.group_size
        rows.append((k * (g - 1), k * (g - 1) / g * s.nbytes))
        times.append(s.seconds)
    if len({r[1] for r in rows}) < 2:
        raise AutoshardError(f"fit_alpha_beta needs ≥ 2 distinct message sizes, got {len(samples)} sample(s); "
                             "measure more message_bytes")
    a = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)[:, None]
    alpha, inv_beta = torch.linalg.lstsq(a, t).solution[:, 0].tolist()
    if alpha < 0:  # refit the bandwidth alone through the origin
        alpha = 0.0
        x = a[:, 1:]
        inv_beta = float((x.T @ t / (x.T @ x)).item())
    if inv_beta <= 0:
        raise AutoshardError(f"collective times do not grow with the message size (1/β = {inv_beta:.3g}); "
                             "measure larger message_bytes")
    return alpha, 1.0 / inv_beta


# --------------------------------------------------------------------------- calibrate


def _clip(value: float) -> float:
    return min(1.0, max(_MIN_EFFICIENCY, value))


def calibrate(cluster: Cluster, device: torch.device, sizes: CalibrationSizes = CalibrationSizes(),
              dtype: str | None = None, probe: ProbeSpec | None = None,
              progress: ProgressFn | None = None) -> Calibration:
    """Measure ``device`` (and the world's collectives, if any) against ``cluster``'s figures;
    with ``probe``, also time the layers of ``probe.model`` (module docstring).

    ``progress`` receives ``Update("calibrate", k, N, unit="probes", note=PROBE)`` as each
    measurement starts and a last one at ``N`` (``autoshard/progress.py``); ``None``: silent.
    """
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype not in _DTYPES or dtype not in cluster.device.peak_flops:
        raise AutoshardError(f"calibrate dtype={dtype!r}: allowed {sorted(set(_DTYPES) & set(cluster.device.peak_flops))}")
    world = dist.is_initialized() and dist.get_world_size() > 1
    step = _probe_reporter(progress, 5 + 2 * world + (probe is not None) + bool(probe and probe.compile))
    step("matmul")
    matmul = measure_matmul(sizes.matmul_sizes, _DTYPES[dtype], device, sizes.iters)
    step("kernel overhead")
    overhead = measure_kernel_overhead(sizes.overhead_ops, device, sizes.iters)
    step("HBM copy")
    copy = measure_copy(sizes.copy_bytes, device, sizes.iters)
    graph_kernel = measure_graph_kernel(device, sizes.iters, copy)
    graph_compiled_kernel = measure_graph_kernel(device, sizes.iters, copy, compile=True)
    eager_kernel = measure_eager_kernel(device, sizes.iters)
    step("attention")
    attention = measure_attention(sizes.attention_shapes, _DTYPES[dtype], device, sizes.iters,
                                  cluster.device.peak_flops[dtype])
    level = latency = bandwidth = graph_collective = None
    comm: tuple[CommSample, ...] = ()
    overlap: dict[str, float] = {}
    contention = overlap_eff = None
    if world:
        step("collectives")
        comm = measure_collectives(sizes.message_bytes, device, sizes.iters)
        latency, bandwidth = fit_alpha_beta(comm)
        level = "inter_node" if dist.get_world_size() > cluster.devices_per_node else "intra_node"
        step("overlap")
        overlap = measure_overlap(sizes.overlap_gemm, sizes.overlap_gemms, _DTYPES[dtype], device, sizes.iters,
                                  sizes.overlap_base_bytes)
        contention, overlap_eff = fit_overlap(overlap)
        graph_collective = measure_graph_collective(64, device, sizes.iters)
    step("optimizer")
    per_param, per_tensor = probe_adamw(device, _DTYPES[dtype], big_params=sizes.optimizer_params,
                                        small_tensors=sizes.optimizer_tensors, iters=sizes.iters)
    layer_times = None
    if probe is not None:
        step(f"layers of {probe.model}")
        samples = probe_layers(probe, device, _DTYPES[dtype])
        layer_times = {"model": probe.model, "dtype": dtype, "seq_len": probe.seq_len}
        if probe.compile:  # the eager samples scaled to the whole-model compiled step
            step(f"compiled step of {probe.model}")
            samples, scales = compile_scaled(probe, device, _DTYPES[dtype], samples)
            layer_times.update(compiled=True, compiled_scales=scales)
        layer_times["samples"] = samples
        if device.type == "cuda":  # where build_program compiles by default: what inductor saves per block
            layer_times["compiled_saved_scale"] = compiled_saved_scale(probe.model, probe.seq_len, 1, probe.attn_impl)
    step("done")
    return Calibration(
        device=cluster.device.name,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        matmul_efficiency=_clip(matmul[max(matmul)] / cluster.device.peak_flops[dtype]),
        hbm_efficiency=_clip(copy / cluster.device.hbm_bandwidth),
        attention_efficiency=_clip(statistics.median(a["efficiency"] for a in attention)) if attention else None,
        attention=attention,
        kernel_overhead_s=overhead,
        gemm_knee_flops=fit_gemm_knee(matmul, cluster.device.peak_flops[dtype], overhead),
        link_level=level, latency_s=latency, bandwidth=bandwidth,
        overlap_contention=contention, overlap_efficiency=overlap_eff, overlap=overlap,
        adamw_s_per_param=per_param, adamw_s_per_tensor=per_tensor, layer_times=layer_times,
        graph_kernel_s=graph_kernel, graph_compiled_kernel_s=graph_compiled_kernel, graph_collective_s=graph_collective,
        eager_kernel_s=eager_kernel and eager_kernel[0], eager_inference_kernel_s=eager_kernel and eager_kernel[1],
        matmul=matmul, copy_bytes_per_s=copy, comm=comm,
    )


def _probe_reporter(progress: ProgressFn | None, total: int) -> Callable[[str], None]:
    """``step(name)``: the next of ``total`` probes starts (``"done"``: all ran), to ``progress``."""
    started = [0]

    def step(name: str) -> None:
        if progress is None:
            return
        completed = total if name == "done" else started[0]
        started[0] += 1
        progress(Update("calibrate", completed, total, unit="probes", note=name))

    return step


# --------------------------------------------------------------------------- CLI


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``autoshard cluster calibrate``."""
    parser.add_argument("--out", type=Path, default=Path("calibration.json"), metavar="FILE",
                        help="calibration file to write (read by Cluster.with_calibration / --calibration)")
    parser.add_argument("--raw", type=Path, metavar="FILE", help="also write every measured sample here")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="matmul dtype (default bf16 on GPUs, fp32 on CPUs)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for CPUs and tests)")
    parser.add_argument("--iters", type=int, help="timed runs per measurement (median reported)")
    parser.add_argument("--model", metavar="SPEC",
                        help="also probe this reference model's layers (e.g. llama:350m): forward/backward seconds "
                             "per layer, used by the cost model instead of FLOP estimates")
    parser.add_argument("--seq", type=int, metavar="N", help="sequence length of the model probe (required with --model)")
    parser.add_argument("--micro-batch", type=parse_int_list, default=(1, 2, 4, 8), metavar="B,B,…",
                        help="micro-batch sizes the model probe times (default 1,2,4,8)")
    parser.add_argument("--attn", choices=("sdpa", "math"),
                        help="the model probe's attention path (default: the model family's; GPT math, Llama sdpa)")
    parser.add_argument("--compile", action="store_true",
                        help="scale the model probe's layer times to the reference model's step compiled whole "
                             "(1 and 3 blocks; what the runtime runs on CUDA by default: "
                             "BuildOptions.compile=auto)")
    parser.add_argument("--probe-tp", type=parse_int_list, default=(1, 2), metavar="T,T,…",
                        help="Megatron TP shards the model probe times (default 1,2; 1 = unsharded)")


def _join_world() -> bool:
    """Join torchrun's process group when launched by it; True when this call created the group."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    return True


def calibrate_main(args: argparse.Namespace, console: Any = None) -> int:
    """Run ``autoshard cluster calibrate`` (a CLI handler: ``(args, console) -> exit code``)."""
    if int(os.environ.get("RANK", "0")) == 0:  # the writer; refused now, not after minutes of measuring
        for path in (args.out, args.raw):
            if path is not None:
                file_io.check_output_path(path, noun="calibration file", parents=True)
    owns_group = _join_world()
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        sizes = CalibrationSizes.quick() if args.quick else CalibrationSizes()
        if args.iters:
            sizes = CalibrationSizes(**{**asdict(sizes), "iters": args.iters})
        writer = not dist.is_initialized() or dist.get_rank() == 0
        with reporter(quiet=getattr(args, "quiet", False) or not writer) as progress:  # plain lines in a log
            result = calibrate(Cluster.detect(), device, sizes, args.dtype, _probe_spec(args), progress=progress)
        if writer:
            _write(args, result, console)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0


def _probe_spec(args: argparse.Namespace) -> ProbeSpec | None:
    """The ``--model`` probe of the command line, or None."""
    model = getattr(args, "model", None)
    if model is None:
        return None
    if not getattr(args, "seq", None):
        raise AutoshardError(f"--model {model} needs --seq N (the training sequence length to probe)")
    iters = {"iters": args.iters} if args.iters else ({"iters": 3, "reps": 1} if args.quick else {})
    return ProbeSpec(model=model, seq_len=args.seq, micro_batches=tuple(args.micro_batch), tp=tuple(args.probe_tp),
                     attn_impl=getattr(args, "attn", None), compile=bool(getattr(args, "compile", False)), **iters)


def _write(args: argparse.Namespace, result: Calibration, console: Any) -> None:
    file_io.atomic_write(args.out, json.dumps(result.to_file_dict(), indent=2) + "\n", noun="calibration file",
                         parents=True)
    if args.raw:
        file_io.atomic_write(args.raw, json.dumps(result.to_raw_dict(), indent=2) + "\n", noun="calibration file",
                             parents=True)
    link = (f", {result.link_level}: α={result.latency_s * 1e6:.1f} µs β={result.bandwidth / 1e9:.1f} GB/s, "
            f"overlap κ={result.overlap_contention:.2f} f={result.overlap_efficiency:.2f}" if result.link_level else "")
    probed = (f", {len(result.layer_times['samples'])} layer samples of {result.layer_times['model']}"
              if result.layer_times else "")
    line = (f"{result.device}: matmul efficiency {result.matmul_efficiency:.2f}, "
            f"HBM efficiency {result.hbm_efficiency:.2f}, attention efficiency {result.attention_efficiency or 0:.2f}, "
            f"kernel overhead {result.kernel_overhead_s * 1e6:.1f} µs, "
            f"GEMM knee {result.gemm_knee_flops:.3g} FLOP{link}, AdamW {result.adamw_s_per_param * 1e12:.0f} ps/param "
            f"+ {result.adamw_s_per_tensor * 1e6:.0f} µs/tensor{probed} → {args.out}")
    (console.print if console is not None else print)(line)


__all__ = [
    "Calibration",
    "CalibrationSizes",
    "CommSample",
    "add_calibrate_arguments",
    "calibrate",
    "calibrate_main",
    "fit_alpha_beta",
    "fit_overlap",
    "fit_gemm_knee",
    "measure_attention",
    "measure_collectives",
    "measure_copy",
    "measure_kernel_overhead",
    "measure_overlap",
    "measure_matmul",
]


if __name__ == "__main__":  # `python -m autoshard.calibrate` (what benchmarks/gpu_run.sh runs under torchrun)
    _parser = argparse.ArgumentParser(prog="python -m autoshard.calibrate", description=__doc__.split("\n\n")[0])
    add_calibrate_arguments(_parser)
    raise SystemExit(calibrate_main(_parser.parse_args()))
