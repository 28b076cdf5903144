"""The model probe of ``autoshard cluster calibrate --model`` and the cost model's use of it.

``autoshard/calibrate_probe.py`` (timing the reference layers and the AdamW slot step),
``search/measured.py`` (signatures, interpolation) and the probe-driven terms of
``search/layer_terms.py``; on the CPU with the tiny Llama.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from autoshard.calibrate import add_calibrate_arguments, calibrate_main
from autoshard.calibrate_probe import ProbeSpec, probe_adamw, probe_layers
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.passes.capture import capture_reference
from autoshard.plan import LayerStrategy, Mesh, Schedule
from autoshard.search import cost_model, layer_terms
from autoshard.search.measured import interpolate, layer_signature, measured_layer_time
from autoshard.train import TrainSpec

SEQ = 32


@pytest.fixture(scope="module")
def probed():
    """(samples, calibrated cluster, full tiny graph) from one CPU probe of llama:tiny."""
    spec = ProbeSpec(model="llama:tiny", seq_len=SEQ, micro_batches=(1, 2), tp=(1, 2), reps=1, iters=1)
    samples = probe_layers(spec, torch.device("cpu"), torch.float32)
    file = {"adamw_s_per_param": 1e-9, "adamw_s_per_tensor": 2e-5,
            "layer_times": {"model": spec.model, "dtype": "fp32", "seq_len": SEQ, "samples": samples}}
    graph = capture_reference("llama:tiny", seq_lens=(SEQ // 2, SEQ), dtype=torch.float32)
    return samples, Cluster.preset("h100-sxm", 1, 2).with_calibration(file), graph


@pytest.mark.slow
def test_probe_times_every_distinct_layer_at_each_size(probed):
    samples, _, graph = probed
    kinds = {s["signature"].split(":")[0] for s in samples}
    assert kinds == {"embedding", "norm", "attention", "mlp", "head", "value_head"}
    assert all(s["fwd_s"] > 0 and s["bwd_s"] >= 0 for s in samples)
    tp2 = {s["signature"].split(":")[0] for s in samples if s["tp"] == 2}
    assert tp2 == {"attention", "mlp", "head"}  # norms and embeddings are not TP-split by the probe
    assert {s["tokens"] for s in samples} == {SEQ, 2 * SEQ}
    # the one-block probe model names the same layers as the full model: every full layer is covered
    assert {layer_signature(l) for l in graph} == {s["signature"] for s in samples}


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_cost_model_uses_measured_times_and_falls_back(probed):
    samples, cluster, graph = probed
    attn = next(l for l in graph if l.kind == "attention")
    row = {s["tokens"]: s for s in samples if s["signature"] == layer_signature(attn) and s["tp"] == 1}
    train = TrainSpec(global_batch=4, seq_len=SEQ, precision="fp32", micro_batch=2)
    cost = cost_model.layer_cost(attn, LayerStrategy(layer=attn.name), Mesh(), cluster, train,
                                 Schedule(micro_batch=2, num_micro_batches=2))
    assert cost.detail["fwd_measured"] == 1.0
    assert cost.detail["fwd_compute_s"] == pytest.approx(row[2 * SEQ]["fwd_s"])
    assert cost.detail["bwd_compute_s"] == pytest.approx(row[2 * SEQ]["bwd_s"])
    # another precision or sequence length was not probed: analytic terms
    for other in (TrainSpec(global_batch=4, seq_len=SEQ, precision="bf16", micro_batch=2),
                  TrainSpec(global_batch=4, seq_len=2 * SEQ, precision="fp32", micro_batch=2)):
        cost = cost_model.layer_cost(attn, LayerStrategy(layer=attn.name), Mesh(), cluster, other,
                                     Schedule(micro_batch=2, num_micro_batches=2))
        assert cost.detail["fwd_measured"] == 0.0
    # the optimizer rates of the file replace the pass count
    opt = cost_model.layer_cost(attn, LayerStrategy(layer=attn.name), Mesh(), cluster, train, Schedule())
    assert opt.detail["optimizer_hbm_s"] == pytest.approx(attn.param_count * 1e-9)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_tp_probe_is_used_for_megatron_layers(probed):
    _, cluster, graph = probed
    mlp = next(l for l in graph if l.kind == "mlp")
    train = TrainSpec(global_batch=4, seq_len=SEQ, precision="fp32", micro_batch=2)
    strategy = LayerStrategy(layer=mlp.name, tp="megatron")
    sh = layer_terms.sharding(mlp, strategy, Mesh(tp=2, dp_shard=1), Schedule(micro_batch=2), SEQ)
    assert sh.tp_mm == 2
    assert layer_terms.probed_time(mlp, strategy, sh, cluster, train) is not None
    sh4 = layer_terms.sharding(mlp, strategy, Mesh(tp=4), Schedule(micro_batch=2), SEQ)
    assert layer_terms.probed_time(mlp, strategy, sh4, cluster, train) is None  # tp 4 not probed


def test_interpolation_is_linear_and_extends_the_end_segments():
    points = ((1024.0, 1.0), (2048.0, 1.5), (4096.0, 2.5))
    assert interpolate(points, 1536.0) == pytest.approx(1.25)
    assert interpolate(points, 8192.0) == pytest.approx(4.5)  # last segment's slope
    assert interpolate(points, 512.0) == pytest.approx(0.75)  # first segment's line
    assert interpolate(points, 1.0) == pytest.approx(0.5 + 0.5 / 1024)
    assert interpolate(((1000.0, 1.0), (2000.0, 3.0)), 100.0) == pytest.approx(0.1)  # never below proportional
    assert interpolate(((100.0, 2.0),), 50.0) == pytest.approx(1.0)


def test_measured_layer_time_without_probe_is_none(probed):
    _, _, graph = probed
    assert measured_layer_time(graph.layers[1], Cluster.preset("h100-sxm", 1, 2), "fp32", 1, SEQ, 64) is None


def test_loss_memory_counts_full_vocab_logits(probed):
    _, cluster, graph = probed
    head = next(l for l in graph if l.kind == "head")
    train = TrainSpec(global_batch=4, seq_len=SEQ, precision="fp32", micro_batch=2)
    base = cost_model.layer_cost(head, LayerStrategy(layer=head.name), Mesh(), cluster, train, Schedule(micro_batch=2))
    tp = cost_model.layer_cost(head, LayerStrategy(layer=head.name, tp="megatron"), Mesh(tp=2), cluster, train,
                               Schedule(micro_batch=2))
    logits = 2 * SEQ * head.vocab
    per_logit = layer_terms.loss_form(layer_terms.runs_compiled(Mesh(), cluster)).peak_bytes
    assert base.memory.activations >= logits * per_logit
    # the runtime gathers the logits: the loss memory does not shrink with tp
    assert tp.memory.activations - per_logit * logits >= 0


def test_adamw_probe_per_param_and_per_tensor():
    per_param, per_tensor = probe_adamw(torch.device("cpu"), torch.float32, big_params=1 << 14, small_tensors=4,
                                        iters=1)
    assert per_param >= 0 and per_tensor > 0


def test_cli_writes_layer_times(tmp_path):
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    out = tmp_path / "c.json"
    args = parser.parse_args(["--out", str(out), "--quick", "--iters", "1", "--model", "llama:tiny", "--seq", "16",
                              "--micro-batch", "1", "--probe-tp", "1"])
    assert calibrate_main(args) == 0
    written = json.loads(out.read_text())
    assert written["layer_times"]["model"] == "llama:tiny" and written["layer_times"]["seq_len"] == 16
    assert written["adamw_s_per_param"] >= 0 and written["adamw_s_per_tensor"] > 0
    applied = Cluster.detect().with_calibration(out)
    assert sum(k.startswith("layer_time|") for k in applied.calibration) == 2 * len(written["layer_times"]["samples"])


def test_cli_model_needs_seq(tmp_path):
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "c.json"), "--quick", "--model", "llama:tiny"])
    with pytest.raises(AutoshardError, match="--seq"):
        calibrate_main(args)


_NEEDS_CXX = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++")),
                                reason="torch.compile's CPU backend needs a C++ compiler")


@_NEEDS_CXX
@pytest.mark.slow
def test_compiled_model_times_run_the_runtime_regions():
    """The whole-model compiled step: exported, cut in front of the first block, compiled (two graphs)."""
    from torch._dynamo.utils import counters

    from autoshard.calibrate_probe import compiled_model_times

    counters.clear()
    spec = ProbeSpec(model="llama:tiny", seq_len=16, micro_batches=(1,), tp=(1,), reps=1, iters=1)
    fwd, bwd = compiled_model_times(spec, torch.device("cpu"), torch.float32, blocks=1, batch=1)
    assert fwd > 0 and bwd >= 0
    assert counters["stats"]["unique_graphs"] >= 2  # the prologue, then the block(s) and head


def _fake_compiled(times):
    """``compiled_model_times`` stand-in: ``times[blocks] = (fwd, bwd)`` whatever the batch."""
    return lambda spec, device, dtype, blocks, batch: times[blocks]


@pytest.mark.slow
def test_compile_scaled_splits_block_and_rest(probed, monkeypatch):
    """Scaled samples: block layers × block/Σeager-block, the others × rest/Σeager-rest, per phase."""
    import autoshard.calibrate_probe as probe

    samples, _cluster, _graph = probed
    monkeypatch.setattr(probe, "compiled_model_times", _fake_compiled({1: (3e-3, 5e-3), 3: (7e-3, 11e-3)}))
    spec = ProbeSpec(model="llama:tiny", seq_len=SEQ, micro_batches=(1, 2), tp=(1, 2), reps=1, iters=1)
    before = [dict(s) for s in samples]
    scaled, scales = probe.compile_scaled(spec, torch.device("cpu"), torch.float32, samples)
    assert samples == before  # the eager samples are left as they were
    assert [f["tokens"] for f in scales] == [SEQ, 2 * SEQ]
    one_block = capture_reference("llama:tiny", seq_lens=(SEQ // 2, SEQ), dtype=torch.float32, num_layers=1)
    kinds = {layer_signature(l): l.block is not None for l in one_block if l.kind != "norm" or l.block is not None}
    for factors in scales:
        tokens = factors["tokens"]
        for phase, block in (("fwd", 2e-3), ("bwd", 3e-3)):
            # one block = (t3 − t1)/2, the rest = t1 − block; the scaled samples add up to them
            mine = [(a, b) for a, b in zip(samples, scaled) if a["tokens"] == tokens and a["tp"] == 1]
            block_sum = sum(b[f"{phase}_s"] for l in one_block if l.block is not None
                            for a, b in mine if a["signature"] == layer_signature(l))
            assert block_sum == pytest.approx(block, rel=1e-9)
            for a, b in zip(samples, scaled):
                if a["tokens"] == tokens:
                    where = "block" if kinds.get(a["signature"], True) else "rest"
                    assert b[f"{phase}_s"] == pytest.approx(a[f"{phase}_s"] * factors[f"{where}_{phase}"], rel=1e-12)
    assert all(a["fwd_s"] != b["fwd_s"] for a, b in zip(samples, scaled))  # every sample was scaled


def test_compile_scaled_refuses_noise(probed, monkeypatch):
    import autoshard.calibrate_probe as probe

    samples, _cluster, _graph = probed
    monkeypatch.setattr(probe, "compiled_model_times", _fake_compiled({1: (3e-3, 5e-3), 3: (2e-3, 11e-3)}))
    spec = ProbeSpec(model="llama:tiny", seq_len=SEQ, micro_batches=(1,), tp=(1,), reps=1, iters=1)
    with pytest.raises(AutoshardError, match="too noisy"):
        probe.compile_scaled(spec, torch.device("cpu"), torch.float32, samples)


@pytest.mark.slow
def test_cli_compile_writes_scaled_samples_and_factors(tmp_path, monkeypatch):
    """``calibrate --compile``: the file says compiled, carries the factors, and loads."""
    import autoshard.calibrate_probe as probe

    monkeypatch.setattr(probe, "compiled_model_times", _fake_compiled({1: (3e-3, 5e-3), 3: (7e-3, 11e-3)}))
    parser = argparse.ArgumentParser()
    add_calibrate_arguments(parser)
    out = tmp_path / "c.json"
    args = parser.parse_args(["--out", str(out), "--quick", "--iters", "1", "--model", "llama:tiny", "--seq", "16",
                              "--micro-batch", "1,2", "--probe-tp", "1", "--compile"])
    assert calibrate_main(args) == 0
    written = json.loads(out.read_text())["layer_times"]
    assert written["compiled"] is True and [f["tokens"] for f in written["compiled_scales"]] == [16, 32]
    applied = Cluster.detect().with_calibration(out)
    assert sum(k.startswith("layer_time|") for k in applied.calibration) == 2 * len(written["samples"])


@pytest.mark.slow
def test_compiled_saved_scale_of_llama_is_below_one(monkeypatch):
    """Inductor's min-cut partitioner recomputes Llama's fp32 norm/RoPE chains instead of saving them."""
    from autoshard import calibrate_probe

    sizes = calibrate_probe.block_saved_bytes("llama:tiny", SEQ, 2)
    assert 0 < sizes["min_cut"] < sizes["default"]
    # the scale is their ratio; the four traces are not run a second time for it
    monkeypatch.setattr(calibrate_probe, "block_saved_bytes",
                        lambda *args: sizes if args == ("llama:tiny", SEQ, 2, None) else None)
    assert calibrate_probe.compiled_saved_scale("llama:tiny", SEQ, 2) == pytest.approx(sizes["min_cut"] / sizes["default"])


def _with_scale(scale, model="llama:tiny"):
    return Cluster.preset("h100-sxm", 1, 2).with_calibration(
        {"layer_times": {"model": model, "dtype": "bf16", "seq_len": SEQ, "samples": [],
                         "compiled_saved_scale": scale}})


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_compiled_scale_applies_to_block_activations_of_compiled_plans_only():
    graph = capture_reference("llama:tiny", seq_lens=(SEQ // 2, SEQ), dtype=torch.bfloat16)
    train = TrainSpec(global_batch=4, seq_len=SEQ, precision="bf16", micro_batch=2)
    from autoshard.plan import Plan

    def plan(state):
        return Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=2),
                    layers=tuple(LayerStrategy(layer=l.name, state=state) for l in graph.layers),
                    schedule=Schedule(micro_batch=2, num_micro_batches=1))

    def activations(p, cluster):
        return cost_model.predict(graph, p, cluster, train).memory_breakdown["activations"]

    eager, half = Cluster.preset("h100-sxm", 1, 2), _with_scale(0.5)
    blocks = sum(l.saved_bytes(2, SEQ) for l in graph if l.block is not None)
    dp = plan("zero1")
    assert cost_model.compiled_activation_scale(graph, dp, half) == 0.5
    assert activations(dp, eager) - activations(dp, half) == pytest.approx(0.5 * blocks, rel=1e-6)
    # ZeRO-3 plans compile too (their gathers are graph nodes); a scale measured for another model is not used
    assert activations(plan("zero3"), eager) - activations(plan("zero3"), half) == pytest.approx(0.5 * blocks, rel=1e-6)
    assert cost_model.compiled_activation_scale(graph, dp, _with_scale(0.5, model="gpt:tiny")) == 1.0


@pytest.mark.parametrize("bad", [0.0, 1.5, "x"])
def test_compiled_scale_out_of_range_is_refused(bad):
    with pytest.raises(AutoshardError, match="compiled_saved_scale"):
        _with_scale(bad)
