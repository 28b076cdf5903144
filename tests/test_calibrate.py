"""``autoshard/calibrate.py``: the α-β fit, a CPU calibration, its file read back by ``Cluster.with_calibration``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from _harness import run_gloo
from autoshard.calibrate import (
    CalibrationSizes,
    CommSample,
    add_calibrate_arguments,
    calibrate,
    calibrate_main,
    fit_alpha_beta,
    fit_gemm_knee,
    measure_kernel_overhead,
)
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError


def _ring_time(op: str, g: int, n: int, alpha: float, beta: float) -> float:
    k = 2 if op == "all_reduce" else 1
    return k * (g - 1) * (alpha + n / g / beta)


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 7e-6, 2.5e11
    samples = [CommSample(op, g, n, _ring_time(op, g, n, alpha, beta))
               for op in ("all_reduce", "all_gather") for g in (2, 8) for n in (1 << 16, 1 << 22, 1 << 28)]
    fitted_alpha, fitted_beta = fit_alpha_beta(samples)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)


def test_fit_clamps_negative_latency():
    # Times proportional to size with a negative intercept: α clamps to 0, β stays positive.
    samples = [CommSample("all_gather", 2, n, n / 2 / 1e9 - 1e-6) for n in (1 << 20, 1 << 22, 1 << 24)]
    alpha, beta = fit_alpha_beta(samples)
    assert alpha == 0.0 and 0.9e9 < beta < 1.1e9


def test_fit_refuses_one_size():
    with pytest.raises(AutoshardError, match="distinct message sizes"):
        fit_alpha_beta([CommSample("all_reduce", 2, 1024, 1e-5)] * 3)


def test_cpu_calibration_file_is_read_by_cluster(tmp_path):
    cluster = Cluster.detect()
    result = calibrate(cluster, torch.device("cpu"), CalibrationSizes.quick())
    assert 0 < result.matmul_efficiency <= 1 and 0 < result.hbm_efficiency <= 1
    assert set(result.matmul) == set(CalibrationSizes.quick().matmul_sizes) and result.copy_bytes_per_s > 0
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(result.to_file_dict()))
    applied = cluster.with_calibration(path)
    assert applied.device.matmul_efficiency == pytest.approx(result.matmul_efficiency)
    assert applied.device.hbm_efficiency == pytest.approx(result.hbm_efficiency)
    assert applied.calibration["kernel_overhead_s"] == pytest.approx(result.kernel_overhead_s)
    assert applied.calibration["gemm_knee_flops"] == pytest.approx(result.gemm_knee_flops)
    # the attention probe's figure is what the cost model's attention term reads
    assert len(result.attention) == len(CalibrationSizes.quick().attention_shapes)
    assert 0 < result.attention_efficiency <= 1
    from autoshard.search.layer_terms import attention_efficiency
    assert attention_efficiency(applied) == pytest.approx(result.attention_efficiency)


def test_fit_gemm_knee_recovers_the_law():
    # Times generated from e(w) = e_max·w/(w + knee) plus a launch floor: the fit removes the floor.
    peak, e_max, knee, floor = 1e15, 0.8, 3e9, 5e-6
    rates = {}
    for n in (256, 512, 1024, 2048, 4096, 8192):
        work = 2.0 * n**3
        rates[n] = work / (work / (peak * e_max * work / (work + knee)) + floor)
    assert fit_gemm_knee(rates, peak, floor) == pytest.approx(knee, rel=1e-6)
    assert fit_gemm_knee(rates, peak, 0.0) > knee  # the floor unremoved looks like a bigger knee


def test_fit_gemm_knee_is_stable_under_timing_noise():
    # ±10 % noise on each size's time: the knee stays within 30 % of the law's (the 1/e-against-1/w fit it
    # replaced moved 3-6x between such draws, the smallest sizes deciding).
    import random

    peak, e_max, knee, floor = 989e12, 0.78, 2e9, 10e-6
    for seed in range(8):
        rnd = random.Random(seed)
        rates = {}
        for n in (256, 512, 1024, 2048, 4096, 8192):
            work = 2.0 * n**3
            rates[n] = work / ((floor + (work + knee) / (e_max * peak)) * (1 + rnd.uniform(-0.1, 0.1)))
        assert fit_gemm_knee(rates, peak, floor) == pytest.approx(knee, rel=0.3), seed


def test_fit_gemm_knee_refuses_one_size():
    with pytest.raises(AutoshardError, match="matmul sizes"):
        fit_gemm_knee({1024: 1e14}, 1e15, 0.0)


def test_kernel_overhead_is_per_op():
    per_op = measure_kernel_overhead(50, torch.device("cpu"), 3)
    assert 0 < per_op < 1e-3  # one tiny add: well under a millisecond


def test_calibrate_main_writes_file_and_raw(tmp_path):
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "c.json"), "--raw", str(tmp_path / "raw.json"), "--quick",
                              "--iters", "2"])
    assert calibrate_main(args) == 0
    written = json.loads((tmp_path / "c.json").read_text())
    assert {"device", "date", "matmul_efficiency", "hbm_efficiency"} <= set(written)
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["copy_bytes_per_s"] > 0 and len(raw["matmul_flops_per_s"]) == len(CalibrationSizes.quick().matmul_sizes)
    assert written["kernel_overhead_s"] > 0 and written["gemm_knee_flops"] >= 0


def _calibrate_world(rank, world_size):
    result = calibrate(Cluster.detect(), torch.device("cpu"), CalibrationSizes.quick())
    return result.to_file_dict(), len(result.comm)


@pytest.mark.slow
def test_gloo_world2_fits_a_link():
    (file_dict, samples), _ = run_gloo(_calibrate_world, 2, timeout_s=120)
    level = "intra_node" if "intra_node" in file_dict else "inter_node"
    assert samples == 6  # 3 sizes × (all-reduce, all-gather)
    assert file_dict[level]["bandwidth"] > 0 and file_dict[level]["latency"] >= 0
    applied = Cluster.detect().with_calibration(file_dict)
    assert getattr(applied, level).bandwidth == pytest.approx(file_dict[level]["bandwidth"])


def test_fit_overlap_recovers_the_cost_models_law():
    """Times generated from exposed = c − (1 − κ)·min(c, f·w): the fit returns κ and f, clipped to [0, 1]."""
    from autoshard.calibrate import fit_overlap

    kappa, f, t_c = 0.15, 0.7, 0.020

    def both(t_n):
        return t_c + t_n - (1 - kappa) * min(t_n, f * t_c)

    times = {"compute_s": t_c, "small_comm_s": 0.008, "small_both_s": both(0.008),
             "big_comm_s": 0.040, "big_both_s": both(0.040)}
    assert fit_overlap(times) == pytest.approx((kappa, f))
    serial = {**times, "small_both_s": t_c + 0.008, "big_both_s": t_c + 0.040}  # nothing overlaps
    assert fit_overlap(serial)[0] == 1.0
    free = {**times, "small_both_s": t_c, "big_both_s": 0.040}  # perfect overlap, no contention
    assert fit_overlap(free) == pytest.approx((0.0, 1.0))


def test_overlap_figures_reach_the_cost_model(tmp_path):
    from autoshard.search.layer_terms import overlap_contention, overlap_efficiency

    cluster = Cluster.parse("h100-sxm:1x2")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"device": cluster.device.name, "matmul_efficiency": 0.7, "hbm_efficiency": 0.8,
                                "overlap_contention": 0.25, "overlap_efficiency": 0.6}))
    applied = cluster.with_calibration(path)
    assert overlap_contention(applied) == 0.25 and overlap_efficiency(applied) == 0.6
