"""Plan residuals: the fit, the calibration file, the cost model's use of them, and the probe on gloo.

``benchmarks/plan_probe.py`` times forced plans on truncated copies of a model and fits
``measured − predicted = c₀ + Σ n_key·r_key`` (``search/measured.py``); the cost model then adds
``r_key`` per transformer-block layer and ``c₀`` per step. CPU tests check the arithmetic and the
plumbing; no timing is asserted.
"""

from __future__ import annotations

import json

import pytest

from _harness import run_gloo
from autoshard.cluster import Cluster
from autoshard.errors import ClusterError
from autoshard.models import build
from autoshard.passes import capture
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.search.cost_model import predict
from autoshard.search.measured import fit_residuals, layer_signature, mesh_key
from autoshard.train import TrainSpec


def test_fit_recovers_coefficients_and_keeps_them_non_negative():
    truth = {"a": 2.0, "b": 0.5}
    offsets = {"pa": 1.0, "pb": 2.0, "pab": 1.5}
    rows = []
    for plan, counts in [("pa", {"a": 2}), ("pa", {"a": 4}), ("pb", {"b": 2}), ("pb", {"b": 4}),
                         ("pab", {"a": 2, "b": 2}), ("pab", {"a": 4, "b": 4})]:
        rows.append((plan, counts, offsets[plan] + sum(n * truth[k] for k, n in counts.items())))
    c0, per_key, intercepts = fit_residuals(rows)
    assert per_key == pytest.approx(truth)
    assert intercepts == pytest.approx(offsets)
    assert c0 == pytest.approx(1.5)  # the median plan intercept
    # a key whose runs get faster with depth than predicted is pinned at 0, the rest refit
    rows = [("pa", {"a": 2}, 3.0), ("pa", {"a": 4}, 5.0), ("pc", {"c": 2}, 0.0), ("pc", {"c": 4}, -1.0)]
    c0, per_key, _ = fit_residuals(rows)
    assert per_key["c"] == 0.0 and per_key["a"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        fit_residuals([])


def _graph():
    return capture(build("llama:tiny"), seq_lens=(8, 16))


def _uniform(graph, mesh: Mesh, state: str, micro: int = 1) -> Plan:
    layers = tuple(LayerStrategy(layer=layer.name, state=state) for layer in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, global_batch=8, seq_len=16,
                schedule=Schedule(micro_batch=8 // (mesh.dp * micro), num_micro_batches=micro))


def _fit(mesh: str, step_s: float = 0.004, **per_layer: float) -> dict:
    return {"model": "llama:tiny", "dtype": "fp32", "seq_len": 16, "global_batch": 8, "step_s": step_s,
            "layers": [{"mesh": mesh, "strategy": k, "s_per_layer": v} for k, v in per_layer.items()]}


def test_cost_model_adds_residual_per_block_layer_and_per_step():
    graph = _graph()
    base = Cluster.preset("h100-sxm", 1, 2)
    plan = _uniform(graph, Mesh(dp_shard=2), "zero3")
    train = TrainSpec(global_batch=8, seq_len=16, precision="fp32")
    key = mesh_key(plan.mesh, plan.schedule)
    calibrated = base.with_calibration({"plan_residuals": _fit(key, Z3=0.001, DDP=0.5)})
    blocks = sum(1 for layer in graph if layer.block is not None)
    before, after = predict(graph, plan, base, train), predict(graph, plan, calibrated, train)
    assert blocks >= 4
    assert after.step_time_s == pytest.approx(before.step_time_s + 0.004 + blocks * 0.001)
    assert after.exposed_comm_s == pytest.approx(before.exposed_comm_s + 0.004 + blocks * 0.001)
    assert after.peak_memory_bytes == before.peak_memory_bytes
    # not probed on this mesh: the same strategy's mean elsewhere, but no cheaper than the worst probed here
    other = base.with_calibration({"plan_residuals": _fit("r9s9t1p1c1e1m1", step_s=0.0, Z3=0.002)})
    assert predict(graph, plan, other, train).step_time_s == pytest.approx(before.step_time_s + blocks * 0.002)
    zero1 = _uniform(graph, Mesh(dp_shard=2), "zero1")  # never probed: the worst probed anywhere
    assert predict(graph, zero1, other, train).step_time_s == pytest.approx(
        predict(graph, zero1, base, train).step_time_s + blocks * 0.002)
    mixed = {"model": "llama:tiny", "dtype": "fp32", "step_s": 0.0, "layers": [
        {"mesh": "r9s9t1p1c1e1m1", "strategy": "Z3", "s_per_layer": 0.002},
        {"mesh": key, "strategy": "DDP", "s_per_layer": 0.005}]}
    worst_here = base.with_calibration({"plan_residuals": mixed})
    assert predict(graph, plan, worst_here, train).step_time_s == pytest.approx(before.step_time_s + blocks * 0.005)


def test_bad_plan_residuals_are_cluster_errors():
    base = Cluster.preset("h100-sxm", 1, 2)
    bad = _fit("r1s2t1p1c1e1m1", Z3=0.001)
    del bad["layers"][0]["s_per_layer"]
    with pytest.raises(ClusterError, match="s_per_layer"):
        base.with_calibration({"plan_residuals": bad})
    with pytest.raises(ClusterError, match="plan_residuals"):
        base.with_calibration({"plan_residuals": {**_fit("m", Z3=0.0), "extra": 1}})


def test_math_and_sdpa_attention_have_different_signatures():
    sdpa = capture(build("gpt:tiny", attn_impl="sdpa"), seq_lens=(8, 16))
    math = capture(build("gpt:tiny", attn_impl="math"), seq_lens=(8, 16))
    pick = lambda g: {layer_signature(layer) for layer in g if layer.kind == "attention"}  # noqa: E731
    assert pick(sdpa) and pick(math) and pick(sdpa).isdisjoint(pick(math))
    mlp = lambda g: {layer_signature(layer) for layer in g if layer.kind == "mlp"}  # noqa: E731
    assert mlp(sdpa) == mlp(math)


def _probe_main(rank, world_size, calibration, out):
    from benchmarks import plan_probe

    return plan_probe.main(["--device", "cpu", "--precision", "fp32", "--model", "llama:tiny", "--batch", "8",
                            "--seq", "16", "--depths", "1,2", "--variants", "replicate,zero3,tp4",
                            "--steps", "3", "--warmup", "1", "--calibration", calibration, "--out", out])


def test_probe_on_gloo_writes_a_calibration_the_search_reads(tmp_path):
    calibration, out = tmp_path / "cal.json", tmp_path / "out.json"
    calibration.write_text(json.dumps({"matmul_efficiency": 0.05, "hbm_efficiency": 0.5}))
    run_gloo(_probe_main, 2, str(calibration), str(out), timeout_s=300)
    written = json.loads(out.read_text())
    assert written["matmul_efficiency"] == 0.05  # the input calibration is kept
    fit = written["plan_residuals"]
    assert fit["model"] == "llama:tiny" and fit["dtype"] == "fp32"
    rows = fit["probes"]
    assert {r["depth"] for r in rows} == {1, 2}
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    configs = {r["config"] for r in rows}
    # tp4 is not defined on 2 ranks: skipped; the replicate variant is merged into the searched plan
    # ("autoshard") when the search picks it (plans are de-duplicated by decision)
    assert "autoshard-zero3" in configs and "autoshard-tp4" not in configs
    assert all(e["s_per_layer"] >= 0 for e in fit["layers"])
    strategies = {e["strategy"] for e in fit["layers"]}
    assert {"DDP", "Z3"} <= strategies
    for r in rows:
        # the fitted seconds are the prediction plus the fitted terms of the row's own counts
        expected = r["predicted_s"] + r["intercept_s"] + sum(
            n * next(e["s_per_layer"] for e in fit["layers"] if f"{e['mesh']}|{e['strategy']}" == k)
            for k, n in r["counts"].items())
        assert r["fitted_s"] == pytest.approx(expected)
    cluster = Cluster.detect().with_calibration(out)
    assert any(k.startswith("plan_residual|") for k in cluster.calibration)
