"""Data-parallel states (DDP, ZeRO-1/2/3, HSDP, offload) and mixed plans equal single-device training.

One gloo job per world size runs every case (tests/_runtime_cases.py); the
small tests below read its results.
"""

from __future__ import annotations

import functools

import pytest

from _harness import run_gloo_cases
from _runtime_cases import check_against_reference, graph_of, make_plan, single_device, train_case
from autoshard.plan import Mesh

GPT, LLAMA = "gpt:tiny", "llama:tiny"


def _uniform(**fields):
    return lambda _layer: fields


def _attn_zero3_rest_ddp(layer):
    return {"state": "zero3" if layer.endswith("attn") else "replicate"}


def _alternate_states(layer):
    by_kind = {"attn_norm": "zero1", "attn": "zero3", "mlp_norm": "replicate", "mlp": "zero2"}
    return {"state": by_kind.get(layer.split(".")[-1], "offload") if "blocks" in layer else "zero3"}


CASES_2 = {
    "ddp": (GPT, Mesh(dp_shard=2), _uniform(state="replicate")),
    "zero1": (GPT, Mesh(dp_shard=2), _uniform(state="zero1")),
    "zero2": (LLAMA, Mesh(dp_shard=2), _uniform(state="zero2")),
    "zero3": (GPT, Mesh(dp_shard=2), _uniform(state="zero3")),
    "zero3_llama": (LLAMA, Mesh(dp_shard=2), _uniform(state="zero3")),
    "offload": (LLAMA, Mesh(dp_shard=2), _uniform(state="offload")),
    "mixed_attn_zero3": (LLAMA, Mesh(dp_shard=2), _attn_zero3_rest_ddp),
    "mixed_states": (GPT, Mesh(dp_shard=2), _alternate_states),
}
# bf16 compute with fp32 masters: equal to fp32 single-device training within bf16 tolerance.
CASES_BF16 = {
    "zero3_bf16": (LLAMA, Mesh(dp_shard=2), _uniform(state="zero3")),
    "mixed_bf16": (GPT, Mesh(dp_shard=2), _alternate_states),
}
CASES_4 = {
    "hsdp": (GPT, Mesh(dp_replicate=2, dp_shard=2), _uniform(state="zero3")),
    "hsdp_mixed": (LLAMA, Mesh(dp_replicate=2, dp_shard=2), _alternate_states),
    "zero3_uneven": (LLAMA, Mesh(dp_shard=4), _uniform(state="zero3")),
}


def _run(cases, world_size, precision="fp32"):
    jobs = {}
    for name, (spec, mesh, choose) in cases.items():
        plan = make_plan(spec, mesh, choose)
        jobs[name] = functools.partial(
            train_case, spec=spec, graph=graph_of(spec), plan=plan, count=name == "zero3", precision=precision
        )
    return run_gloo_cases(jobs, world_size, timeout_s=400)


@pytest.fixture(scope="module")
def results2():
    return _run(CASES_2, 2)


@pytest.fixture(scope="module")
def results_bf16():
    return _run(CASES_BF16, 2, precision="bf16")


@pytest.fixture(scope="module")
def results4():
    return _run(CASES_4, 4)


@pytest.fixture(scope="module")
def references():
    return {spec: single_device(spec) for spec in (GPT, LLAMA)}


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_world2_matches_single_device(results2, references, name):
    spec, mesh, _ = CASES_2[name]
    check_against_reference(results2[name], references[spec], mesh)


@pytest.mark.parametrize("name", list(CASES_BF16))
@pytest.mark.slow
def test_bf16_compute_matches_fp32_single_device(results_bf16, references, name):
    spec, mesh, _ = CASES_BF16[name]
    check_against_reference(results_bf16[name], references[spec], mesh, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_world4_matches_single_device(results4, references, name):
    spec, mesh, _ = CASES_4[name]
    check_against_reference(results4[name], references[spec], mesh)


@pytest.mark.slow
def test_zero3_collective_counts(results2):
    """ZeRO-3, 2 micro-batches: per layer one all-gather forward and one reduce-scatter backward per
    micro-batch; re-gathers in backward are counted as all-gathers too; the optimizer adds one world
    all-reduce (clipping) and one dp all-reduce (loss)."""
    graph = graph_of(GPT)
    layers_with_params = sum(1 for layer in graph.layers if layer.params)
    counts = results2["zero3"][0]["counts"]
    assert counts["reduce_scatter"] == 2 * layers_with_params
    # forward gathers are issued asynchronously (schedule_overlap, prefetch=1): one start per layer per
    # micro-batch; backward re-gathers are started one layer ahead (async starts) or, where backward's order
    # differs from the reverse forward order, blocking: about one per layer per micro-batch, plus at most one
    # started-but-unused prefetch per backward (passes/recompute.py note "backward prefetch")
    backward_starts = counts["all_gather_start"] - 2 * layers_with_params
    assert 0 < backward_starts < 2 * layers_with_params
    assert 0 < counts["all_gather"] + backward_starts <= 2 * layers_with_params + 2
    assert counts["all_reduce"] == 2


@pytest.mark.slow
def test_zero3_shards_are_chunks(results4):
    """Uneven ZeRO-3 shards follow torch.chunk: rank r holds chunk r (maybe empty)."""
    per_rank = results4["zero3_uneven"]
    placement = per_rank[0]["placements"]["value_head.bias"]  # 1 row over 4 ranks: 1, 0, 0, 0
    assert [r["placements"]["value_head.bias"].local_shape for r in per_rank] == [(1,), (0,), (0,), (0,)]
    assert placement.global_shape == (1,)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_update_matches_torch_adamw(weight_decay):
    """The runtime's AdamW (the fused kernel) and its foreach fallback step as torch.optim.AdamW does."""
    import torch

    from autoshard.runtime.optimizer import OptimizerConfig, apply_update, foreach_update, update_kind

    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (33, 5), (1024,), (3, 3, 3)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    reference = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay,
                                  foreach=False, fused=False)
    fused, looped = [t.clone() for t in start], [t.clone() for t in start]
    moments = {key: [torch.zeros(s) for s in shapes] for key in ("f1", "f2", "l1", "l2")}
    assert update_kind(cfg, fused) == "fused"
    assert update_kind(OptimizerConfig(name="sgd"), fused) == "foreach"
    for step in range(1, 6):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        reference.step()
        apply_update(cfg, step, fused, [g.clone() for g in grads], moments["f1"], moments["f2"])
        foreach_update(cfg, step, looped, [g.clone() for g in grads], moments["l1"], moments["l2"])
    for p, a, b in zip(params, fused, looped, strict=True):
        torch.testing.assert_close(a, p.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b, p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_optimizer_bench_smoke(tmp_path):
    """benchmarks/optimizer_bench.py runs both update paths and writes its JSON (tiny CPU run)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "optimizer.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "optimizer_bench.py"), "--smoke", "--out", str(out)],
                          cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["params"] == 4096 and report["fused"]["median_ms"] > 0 and report["foreach"]["median_ms"] > 0
