"""Quantization kernels: layout, Triton (interpreted) == reference, error bounds, NaN policy,
custom-op/export, quantized collectives on gloo (world 2 and 4), benchmark smoke run.

Run with TRITON_INTERPRET=1 (the Makefile does) so the Triton kernels run on CPU; without
it the bit-exactness tests skip (there is no second implementation to compare).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _harness import interpreted_kernels, run_gloo_cases
from autoshard.errors import AutoshardError
from autoshard.kernels import QuantizationError, QuantLayout, dequantize, dequantize_reduce, quantize, uses_triton
from autoshard.kernels import comm, reference

REPO = Path(__file__).resolve().parent.parent
QDTYPES = ("int8", "fp8", "int4")
needs_triton = pytest.mark.skipif(
    not uses_triton(torch.device("cpu")), reason="Triton kernels run on CPU only with TRITON_INTERPRET=1"
)


def _sample(kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, generator=gen)
    if kind == "student_t":  # df=2: heavy tails
        z = torch.randn(n, generator=gen)
        chi = torch.randn(n, 2, generator=gen).pow(2).sum(-1)
        return z / (chi / 2).sqrt()
    if kind == "cauchy":
        return torch.tan(torch.pi * (torch.rand(n, generator=gen) - 0.5)).clamp(-1e4, 1e4)
    raise AssertionError(kind)


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0), b.nan_to_num(0.0))


# ---- layout ------------------------------------------------------------------------------


def test_layout_sizes_with_padding():
    lay = QuantLayout("int4", 64, numel=1000, world=3)
    assert (lay.shard_numel, lay.padded_numel, lay.num_blocks) == (334, 384, 6)
    assert (lay.payload_bytes, lay.chunk_bytes) == (192, 192 + 24)
    assert [lay.valid_numel(r) for r in range(3)] == [334, 334, 332]
    lay8 = QuantLayout("int8", 128, numel=1000, world=3)
    assert lay8.chunk_bytes == 384 + 4 * 3 and lay8.chunk_bytes % 4 == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qdtype="int3", block=64, numel=8), r"'int3'.*allowed: \['fp8', 'int4', 'int8'\]"),
        (dict(qdtype="int8", block=100, numel=8), r"block size 100.*allowed: \[64, 128"),
        (dict(qdtype="int8", block=8192, numel=8), r"block size 8192"),
        (dict(qdtype="int8", block=64, numel=8, world=0), r"world=0"),
    ],
)
def test_layout_rejects_bad_arguments(kwargs, match):
    with pytest.raises(QuantizationError, match=match):
        QuantLayout(**kwargs)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8])
def test_unsupported_input_dtype_names_dtype_and_allowed_set(dtype):
    with pytest.raises(AutoshardError, match=rf"{dtype}.*allowed: \['float32', 'bfloat16', 'float16'\]"):
        quantize(torch.zeros(64, dtype=dtype), "int8", 64)


def test_unsupported_output_dtype_and_bad_buffer():
    q = quantize(torch.randn(100), "int8", 64)
    with pytest.raises(QuantizationError, match="float64"):
        dequantize(q, torch.float64)
    with pytest.raises(QuantizationError, match="needs torch.uint8 of shape"):
        torch.ops.autoshard.dequantize(q.data[:, :-4], "int8", 64, 100, torch.float32)


# ---- Triton == reference -----------------------------------------------------------------

SHAPES = [(1000, 1, 64), (5000, 3, 128), (4096, 4, 1024), (70000, 2, 512)]


@needs_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("numel, world, block", SHAPES)
def test_triton_matches_reference_bit_exact(qdtype, numel, world, block):
    gen = torch.Generator().manual_seed(numel + world)
    x = _sample("student_t", numel, gen) * 100
    x[3], x[min(numel - 1, block + 7)] = float("nan"), float("-inf")
    x[-block:] = 0.0  # an all-zero block (and padding after it)
    lay = QuantLayout(qdtype, block, numel, world)
    q = quantize(x.to(torch.bfloat16), qdtype, block, world)
    want = reference.quantize_ref(x.to(torch.bfloat16), lay)
    assert torch.equal(q.data, want)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _nan_equal(dequantize(q, out_dtype).reshape(-1), reference.dequantize_ref(want, lay, out_dtype))
        assert _nan_equal(dequantize_reduce(q, out_dtype), reference.dequantize_reduce_ref(want, lay, out_dtype))


PAIR_CONFIGS = {"pairs": dict(variant="pairs", elems=1024, num_warps=4, stream=True),
                "pairs_pipelined": dict(variant="pairs", elems=256, num_warps=4, stages=3, progs_per_sm=1)}


@needs_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("config", sorted(PAIR_CONFIGS))
@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_pair_word_kernels_match_reference_bit_exact(qdtype, config):
    # every input dtype; an even layout (pair-word kernels) and an odd shard (tile fallback)
    from autoshard.kernels import triton_kernels as tk

    cfg = tk.KernelConfig(**PAIR_CONFIGS[config])
    gen = torch.Generator().manual_seed(len(config))
    for numel, world, block in ((2 * 358, 2, 64), (999, 2, 64)):  # 999: odd numel, tile fallback but for the reduce
        for in_dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = _sample("student_t", numel, gen).to(in_dtype)
            x[3], x[70], x[128:192] = float("nan"), float("inf"), 0.0
            x[200:260] *= 1e-3  # fp8 subnormal codes
            lay = QuantLayout(qdtype, block, numel, world)
            want = reference.quantize_ref(x, lay)
            assert torch.equal(tk.quantize_triton(x, lay, cfg), want), (numel, in_dtype)
            for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                got = tk.dequantize_triton(want, lay, out_dtype, cfg)
                assert _nan_equal(got, reference.dequantize_ref(want, lay, out_dtype)), (numel, out_dtype)
                got = tk.dequantize_reduce_triton(want, lay, out_dtype, cfg)
                assert _nan_equal(got, reference.dequantize_reduce_ref(want, lay, out_dtype)), (numel, out_dtype)


@needs_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_dequantize_reduce_unrolled_and_runtime_row_loops_agree(qdtype):
    # rows unrolled at compile time (world <= unroll) and the runtime loop (world > unroll, or
    # unroll=0) sum in the same rank order: both equal the reference bit for bit
    from autoshard.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(11)
    for world, numel in ((3, 3 * 64 * 5 + 17), (4, 4 * 64 * 6)):  # odd shard (tile kernel) and even (pairs)
        x = _sample("student_t", numel, gen)
        x[5], x[64:128] = float("nan"), 0.0
        lay = QuantLayout(qdtype, 64, numel, world)
        q = reference.quantize_ref(x, lay)
        want = reference.dequantize_reduce_ref(q, lay, torch.float32)
        for variant in ("tile", "pairs"):
            for unroll in (0, 2, 8):
                cfg = tk.KernelConfig(variant, 256, 4, unroll=unroll)
                got = tk.dequantize_reduce_triton(q, lay, torch.float32, cfg)
                assert _nan_equal(got, want), (world, variant, unroll)


def test_default_launch_config_by_block_and_size(monkeypatch):
    from autoshard.kernels import triton_kernels as tk

    base = tk.CUDA_CONFIGS[("quantize", "int4")]
    assert tk.default_config("quantize", "int4", 512, 1 << 26) == (base, "per-format default (CUDA_CONFIGS)")
    big_block, why = tk.default_config("quantize", "int4", 2048, 1 << 26)
    assert big_block != base and big_block.num_warps == 1 and "2048" in why
    assert tk.default_config("quantize", "int8", 2048, 1 << 26)[0] == tk.CUDA_CONFIGS[("quantize", "int8")]
    # a size-bounded rule applies up to its max_numel only, and the first matching rule wins
    small = tk.KernelConfig("pairs", 2048, 2)
    rules = (("dequantize_reduce", "int4", 64, 1 << 27, small, "small tensors"), *tk.CUDA_CONFIG_RULES)
    monkeypatch.setattr(tk, "CUDA_CONFIG_RULES", rules)
    assert tk.default_config("dequantize_reduce", "int4", 512, 1 << 26) == (small, "small tensors")
    assert tk.default_config("dequantize_reduce", "int4", 512, (1 << 27) + 1)[0] == \
        tk.CUDA_CONFIGS[("dequantize_reduce", "int4")]
    # the launcher resolves through the same table (under the interpreter with bigger tiles)
    lay = QuantLayout("int4", 512, 1 << 26, 4)
    assert tk._resolve("dequantize_reduce", lay, torch.device("cpu"), None).num_warps == 4
    assert tk._resolve("dequantize_reduce", lay, torch.device("cpu"), None).elems == tk.INTERPRETER_ELEMS
    assert tk._resolve("dequantize_reduce", lay, torch.device("cuda"), None) == small


@needs_triton
def test_fp8_encoding_covers_every_code():
    # every e4m3fn value (and the midpoints between neighbours) round-trips like torch's cast
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[codes.isfinite() & (codes.abs() <= 448)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, torch.tensor([448.0])])  # 448 pins the block scale to 1
    x = torch.nn.functional.pad(x, (0, 512 - x.numel() % 512))
    lay = QuantLayout("fp8", 512, x.numel())
    assert torch.equal(quantize(x, "fp8", 512).data, reference.quantize_ref(x, lay))


# ---- accuracy ----------------------------------------------------------------------------


def _blockwise_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    xb = torch.nn.functional.pad(x.double(), (0, -x.numel() % block)).view(-1, block)
    return xb.abs().amax(1, keepdim=True).expand(-1, block).reshape(-1)[: x.numel()]


def _error_bound(x: torch.Tensor, qdtype: str, block: int) -> torch.Tensor:
    """Per-element |error| bound: half a step (int), e4m3 half-spacing + subnormal floor (fp8)."""
    absmax = _blockwise_absmax(x, block)
    slack = 1 + 1e-5  # fp32 rounding of x * (qmax / absmax) and of q * scale
    if qdtype == "int8":
        return absmax / 254 * slack
    if qdtype == "int4":
        return absmax / 14 * slack
    return (x.double().abs() * 2.0**-4 + absmax / 448 * 2.0**-10) * slack


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("kind", ["normal", "student_t", "cauchy"])
def test_round_trip_error_bounds(qdtype, kind):
    block = 256
    gen = torch.Generator().manual_seed(7)
    x = _sample(kind, 40 * block + 33, gen)
    x[5 * block : 6 * block] = 3.25  # a constant block
    x[6 * block : 7 * block] = 0.0  # an all-zero block
    err = (dequantize(quantize(x, qdtype, block), torch.float32).double() - x.double()).abs()
    assert bool((err <= _error_bound(x, qdtype, block)).all()), float((err - _error_bound(x, qdtype, block)).max())
    assert bool((err[6 * block : 7 * block] == 0).all())
    if qdtype != "int4":  # 3.25 / (3.25 / qmax) * qmax: constant blocks are exact up to fp32 rounding
        assert float(err[5 * block : 6 * block].max()) <= 3.25 * 2.0**-22


def test_error_bound_is_tight_enough_to_catch_a_wrong_scale():
    # the int8 bound fails for codes scaled by absmax/63 (a 7-bit quantizer): the test can fail
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    scale = _blockwise_absmax(x, 256) / 63
    coarse = torch.round(x.double() / scale) * scale
    assert not bool(((coarse - x.double()).abs() <= _error_bound(x, "int8", 256)).all())


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_nan_inf_poison_only_their_block(qdtype):
    block = 64
    x = torch.randn(6 * block, generator=torch.Generator().manual_seed(3))
    x[block + 3], x[4 * block] = float("nan"), float("inf")
    q = quantize(x, qdtype, block)
    scales = q.scales.reshape(-1)
    assert scales[[1, 4]].isnan().all() and scales[[0, 2, 3, 5]].isfinite().all()
    out = dequantize(q, torch.float32).view(6, block)
    assert out[[1, 4]].isnan().all() and out[[0, 2, 3, 5]].isfinite().all()


def test_all_zero_and_tiny_blocks_have_zero_scale():
    x = torch.zeros(192)
    x[64:128] = 1e-36  # absmax below TINY = 2**-112: flushed to zero, scale 0
    x[128:] = 1.0
    q = quantize(x, "int8", 64)
    assert q.scales.reshape(-1).tolist() == [0.0, 0.0, pytest.approx(1 / 127)]
    assert dequantize(q)[:128].eq(0).all()


def test_non_contiguous_input_is_made_contiguous():
    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(4)).t()  # (80, 96), strided
    assert not x.is_contiguous()
    q = quantize(x, "int8", 128)
    assert torch.equal(q.data, quantize(x.contiguous(), "int8", 128).data)
    assert dequantize(q).shape == (80, 96)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_dequantize_reduce_sums_rows(qdtype):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    q = quantize(x, qdtype, 128, world=4)
    rows = reference._dequant_rows(q.data, q.layout)
    want = (((rows[0] + rows[1]) + rows[2]) + rows[3])[: q.layout.shard_numel]
    assert torch.equal(dequantize_reduce(q, torch.float32), want)


# ---- custom ops --------------------------------------------------------------------------


def test_custom_ops_pass_opcheck():
    x = torch.randn(300)
    torch.library.opcheck(torch.ops.autoshard.quantize.default, (x, "int8", 64, 2))
    data = torch.ops.autoshard.quantize(x, "int4", 64, 2)
    torch.library.opcheck(torch.ops.autoshard.dequantize.default, (data, "int4", 64, 300, torch.bfloat16))
    torch.library.opcheck(torch.ops.autoshard.dequantize_reduce.default, (data, "int4", 64, 150, torch.float32))


class _RoundTrip(torch.nn.Module):
    def forward(self, x):
        data = torch.ops.autoshard.quantize(x, "fp8", 128, 1)
        return torch.ops.autoshard.dequantize(data, "fp8", 128, x.numel(), torch.float32).view(x.shape)


def test_round_trip_exports():
    x = torch.randn(4, 200)
    ep = torch.export.export(_RoundTrip(), (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"autoshard.quantize.default", "autoshard.dequantize.default"} <= targets
    assert torch.equal(ep.module()(x), _RoundTrip()(x))


# ---- quantized collectives (gloo) --------------------------------------------------------


def _rank_tensor(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _case_all_gather(rank: int, world: int, qdtype: str) -> bool:
    shard = _rank_tensor(rank, 3 * 333, 1).view(3, 333)  # 999 elements: padded in every shard
    full = comm.quantized_all_gather(shard, None, qdtype, 128)
    want = torch.cat([dequantize(quantize(_rank_tensor(r, 999, 1).view(3, 333), qdtype, 128)) for r in range(world)])
    return full.shape == (3 * world, 333) and torch.equal(full, want)


def _case_reduce_scatter(rank: int, world: int, qdtype: str) -> bool:
    numel = 2053  # not divisible by world nor by the block
    grads = [_rank_tensor(r, numel, 2) for r in range(world)]
    got = comm.quantized_reduce_scatter(grads[rank], None, qdtype, 64, torch.float32)
    lay = QuantLayout(qdtype, 64, numel, world)
    rows = [reference._dequant_rows(reference.quantize_ref(g, lay), lay)[rank] for g in grads]
    want = functools.reduce(torch.add, rows)[: lay.shard_numel]
    exact = torch.equal(got, want)
    mine = [torch.nn.functional.pad(g, (0, world * lay.shard_numel - numel)).view(world, -1)[rank] for g in grads]
    true = sum(g.double() for g in mine)
    bound = sum(_error_bound(g, qdtype, 64) for g in mine)  # blocks start at this rank's shard
    bound = bound + got.double().abs() * world * 2.0**-24  # fp32 rounding of the running sum
    return exact, bool(((got.double() - true).abs() <= bound).all())


def _case_hpz(rank: int, world: int, qdtype: str | None) -> tuple[bool, bool, list[list[int]]]:
    groups = comm.hpz_groups(ranks_per_node=2)
    param = _rank_tensor(0, 4 * 251, 3).view(4, 251)  # every rank knows the full parameter
    primary = param.reshape(-1).view(world, -1)[rank].view(-1, 251)
    full, secondary = comm.hpz_forward_gather(primary, groups, qdtype, 64)
    seen = []
    original = comm._all_gather_rows

    def recording(out, inp, group):
        seen.append(dist.get_process_group_ranks(group))
        original(out, inp, group)

    comm._all_gather_rows = recording
    try:
        again = comm.hpz_backward_gather(secondary, groups, tuple(full.shape))
    finally:
        comm._all_gather_rows = original
    forward_ok = torch.equal(full, param) if qdtype is None else full.shape == param.shape
    return forward_ok and secondary.numel() == 502, torch.equal(again, full), seen


def _world_cases(world: int) -> dict:
    cases = {}
    for qd in QDTYPES:
        cases[f"all_gather/{qd}"] = functools.partial(_case_all_gather, qdtype=qd)
        cases[f"reduce_scatter/{qd}"] = functools.partial(_case_reduce_scatter, qdtype=qd)
    if world == 4:
        cases["hpz/none"] = functools.partial(_case_hpz, qdtype=None)
        cases["hpz/int8"] = functools.partial(_case_hpz, qdtype="int8")
    return cases


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_results(request):
    with interpreted_kernels():  # the Triton kernels themselves across ranks (_harness note "kernels in ranks")
        return request.param, run_gloo_cases(_world_cases(request.param), request.param, timeout_s=180)


@pytest.mark.slow
def test_quantized_all_gather_and_reduce_scatter(gloo_results):
    world, results = gloo_results
    for qd in QDTYPES:
        assert results[f"all_gather/{qd}"] == [True] * world, qd
        assert results[f"reduce_scatter/{qd}"] == [(True, True)] * world, qd


@pytest.mark.slow
def test_hpz_backward_gather_stays_in_node(gloo_results):
    world, results = gloo_results
    if world != 4:
        pytest.skip("hpZ runs as 2 nodes x 2 ranks at world 4")
    for name in ("hpz/none", "hpz/int8"):
        for rank, (forward_ok, backward_ok, groups_seen) in enumerate(results[name]):
            assert forward_ok and backward_ok, (name, rank)
            node = [2 * (rank // 2), 2 * (rank // 2) + 1]
            assert groups_seen == [node], (name, rank, groups_seen)


# ---- benchmark smoke ---------------------------------------------------------------------


@pytest.mark.slow
@needs_triton
def test_benchmark_smoke_run(tmp_path):
    out = tmp_path / "kernels.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels_bench.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bit_exact"] and all(report["bit_exact"].values())
    kernels = {r["kernel"] for r in report["kernels"]}
    assert {"copy", "quantize/int8", "dequantize/fp8", "dequantize_reduce/int4"} <= kernels
    assert set(report["all_gather"]) == {"bf16", "int8", "fp8"}
    assert "| all-gather |" in proc.stdout
    # candidate configs at the smallest size, reported beside the default the launcher picks
    best = {(b["kernel"], b["block"]): b for b in report["best"]}
    assert {("quantize/int4", 512), ("dequantize_reduce/int4", 512)} <= set(best)
    assert all(r["bit_exact"] for r in report["kernels"] if "bit_exact" in r)
    first = [r for r in report["kernels"] if r.get("config") == "default" and "ratio_same_bytes" in r]
    assert first and all("resolved" in r and r["host_us"] > 0 for r in first)


@pytest.mark.slow
@needs_triton
def test_qcomm_benchmark_smoke_run_under_torchrun(tmp_path):
    # the qwZ all-gather benchmark as the GPU session runs it (torchrun, 2 ranks), on gloo
    out = tmp_path / "qcomm.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "benchmarks" / "qcomm_bench.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo" and report["world"] == 2
    for qd in ("int8", "fp8"):
        r = report[qd]
        assert r["bytes_ratio"] >= 1.9 and r["within_error_bound"] is True
        assert set(r["steps_seconds"]) == {"quantize", "all_gather", "dequantize"}
        assert len(r["per_rank_seconds"]) == 2 and r["seconds"] > 0
    assert "| int8 |" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_compiled_triton_kernels_match_reference_on_cuda(qdtype):
    """The Triton kernels compiled for the GPU (not interpreted) equal the torch reference bit for bit."""
    gen = torch.Generator().manual_seed(7)
    numel, world, block = 1 << 20, 4, 512
    x = _sample("student_t", numel, gen) * 100
    x[3], x[block + 7] = float("nan"), float("-inf")
    lay = QuantLayout(qdtype, block, numel, world)
    device_x = x.to(torch.bfloat16).cuda()
    assert uses_triton(device_x.device)
    q = quantize(device_x, qdtype, block, world)
    want = reference.quantize_ref(x.to(torch.bfloat16), lay)
    assert torch.equal(q.data.cpu(), want)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert _nan_equal(dequantize(q, out_dtype).reshape(-1).cpu(), reference.dequantize_ref(want, lay, out_dtype))
        assert _nan_equal(dequantize_reduce(q, out_dtype).cpu(), reference.dequantize_reduce_ref(want, lay, out_dtype))
