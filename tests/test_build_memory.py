"""Build (materialization) peak of a rank: ``search/memory.py``, "Build".

Pure unit tests (tier 1): hand-computed build peaks of llama:tiny (captured on meta) under
replicate, zero1, zero3 and tp 2; a plan whose build peak exceeds its step peak reports the build
peak, and the search keeps it under the memory limit; old plan files load with no build peak.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autoshard.cluster import Cluster, DeviceSpec, LinkSpec
from autoshard.graph import LayerInfo, ModelGraph, ParamInfo
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule
from autoshard.search import Constraints, solve
from autoshard.search.cost_model import predict
from autoshard.search.memory import (
    BUILD_BYTES_PER_ELEMENT,
    MemoryBreakdown,
    build_peak_bytes,
    build_region_elements,
    build_transient_bytes,
)
from autoshard.train import TrainSpec

LINK = LinkSpec(bandwidth=100e9, latency=1e-5)


def make_cluster(devices: int = 2) -> Cluster:
    device = DeviceSpec(name="test-gpu", memory_bytes=80 * 2**30, peak_flops={"bf16": 1e15, "fp32": 1e14},
                        hbm_bandwidth=2e12, matmul_efficiency=0.5)
    return Cluster(name="test", nodes=1, devices_per_node=devices, device=device, intra_node=LINK, inter_node=LINK,
                   host_bandwidth=25e9, cpu_adam_params_per_s=1e9)


def make_plan(graph: ModelGraph, mesh: Mesh, schedule: Schedule, **strategy) -> Plan:
    layers = tuple(LayerStrategy(layer=layer.name, **strategy) for layer in graph)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=schedule)


def step_bytes(pred: Predictions) -> int:
    """The forward/backward peak of the peak rank (``memory.step_peak_bytes``, breakdown key ``step_peak``)."""
    return pred.memory_breakdown["step_peak"]


def optimizer_step_bytes(pred: Predictions) -> int:
    """The optimizer-step peak of the peak rank from its breakdown (``memory.optimizer_step_peak_bytes``)."""
    b = pred.memory_breakdown
    return b["params"] + b["grads"] + b["optimizer"] + b["step_grads"] + b["step_transient"]


# ---- regions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("param, strategy, tp, ep, n, want", [
    # whole tp/ep-local parameter for every state but zero3
    (ParamInfo("w", (1000, 64), "bf16", "vocab"), dict(state="zero1"), 1, 1, 4, 64_000),
    (ParamInfo("w", (1000, 64), "bf16", "vocab"), dict(state="zero2", tp="megatron"), 2, 1, 4, 32_000),
    (ParamInfo("w", (64, 256), "bf16", "row"), dict(state="offload", tp="megatron"), 2, 1, 4, 8192),
    # zero3: the largest torch.chunk of tensor dim 0 of the tp-local shape: ⌈500/3⌉ = 167 rows of 64
    (ParamInfo("w", (1000, 64), "bf16", "vocab"), dict(state="zero3", tp="megatron"), 2, 1, 3, 167 * 64),
    (ParamInfo("w", (64, 256), "bf16", "row"), dict(state="zero3", tp="megatron"), 2, 1, 3, 22 * 128),
    (ParamInfo("w", (64,), "bf16"), dict(state="zero3", tp="megatron"), 2, 1, 3, 22),  # never tp-split
    # experts: dim 0 over ep (only with ep=True), then ZeRO-3 chunks of the local experts
    (ParamInfo("e", (8, 64, 256), "bf16", "expert"), dict(state="replicate", ep=True), 1, 4, 1, 2 * 64 * 256),
    (ParamInfo("e", (8, 64, 256), "bf16", "expert"), dict(state="replicate"), 1, 4, 1, 8 * 64 * 256),
    (ParamInfo("e", (8, 64, 256), "bf16", "expert"), dict(state="zero3", ep=True), 1, 4, 3, 64 * 256),
])
def test_build_region_elements(param, strategy, tp, ep, n, want):
    assert build_region_elements(param, LayerStrategy(layer="l", **strategy), tp, ep, n) == want


def test_build_transient_combines_by_max():
    assert build_transient_bytes([10, 30, 20]) == 8 * 30 == BUILD_BYTES_PER_ELEMENT * 30
    assert build_transient_bytes([]) == 0.0
    a = MemoryBreakdown(params=1, grads=100, optimizer=2, activations=100, buffers=100, host=100, build_transient=5)
    b = MemoryBreakdown(params=10, optimizer=20, build_transient=3)
    assert (a + b).build_transient == 5  # one parameter is read at a time
    assert build_peak_bytes([a, b]) == 1 + 2 + 10 + 20 + 5  # no grads, activations, buffers or host


# ---- llama:tiny by hand ------------------------------------------------------------------------
# Parameters (capture_reference("llama:tiny")): embed (128, 64) vocab; per block attn_norm (64,),
# q (64, 64) / k (32, 64) / v (32, 64) column, o (64, 64) row, mlp_norm (64,), gate/up (128, 64)
# column, down (64, 128) row; norm (64,); head (128, 64) vocab; value_head (1, 64) + bias (1,).
# Ψ = 8192 + 2·(64 + 12288 + 64 + 24576) + 64 + 8192 + 65 = 90 497; the largest tensors hold 8192.
# bf16 AdamW: p = 2, K = 12 (ZeRO Table 1); the transient is 8 B per element of the largest region.
PSI = 90_497
PSI_TP2 = 4096 + 2 * (64 + 6144 + 64 + 12_288) + 64 + 4096 + 65  # 45 441: vocab/column/row halved
PSI_DIM0 = (PSI - 65) // 2 + 65  # 45 281: the first of 2 ranks' dim-0 chunks (search/layer_terms._padded_dim0_psi)
HAND = {
    # dp 2: every layer holds the whole parameter; largest region 8192 → 65 536 B
    "replicate": 2 * PSI + 12 * PSI + 8 * 8192,  # 1 332 494
    # two micro-batches: optimizer states halved, whole parameters held: 789 512
    "zero1": 2 * PSI + 12 * PSI // 2 + 8 * 8192,
    # one micro-batch on a GPU: gathered in the compiled forward, held (and built) as ZeRO-3's dim-0 shards
    # (flat optimizer chunks); the first rank's shards: half of every even dim 0, and the whole value head
    # ((1, 64) and (1,): torch.chunk gives rank 0 the one row): (PSI − 65)/2 + 65 = 45 281 elements
    "zero1_gathered": 2 * PSI_DIM0 + 12 * PSI // 2 + 8 * 4096,  # 666 312
    # params and states as those dim-0 shards; regions are dim-0 chunks: embed/head/gate/up (64, 64), down (32, 128)
    "zero3": 2 * PSI_DIM0 + 12 * PSI_DIM0 + 8 * 4096,  # 666 702
    # tp 2: the local parameters of 45 441 elements; largest region 4096 (gate (64, 64), down (64, 64), embed)
    "tp2": 2 * PSI_TP2 + 12 * PSI_TP2 + 8 * 4096,  # 668 942
}


@pytest.fixture(scope="module")
def llama_tiny() -> ModelGraph:
    capture = pytest.importorskip("autoshard.passes.capture")
    return capture.capture_reference("llama:tiny")


@pytest.mark.parametrize("case", sorted(HAND))
@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_build_peak_of_llama_tiny_by_hand(llama_tiny, case):
    graph = llama_tiny
    assert graph.param_count == PSI
    if case == "tp2":
        mesh, schedule, strategy = Mesh(tp=2), Schedule(micro_batch=2), dict(tp="megatron")
    else:
        mesh, strategy = Mesh(dp_shard=2), dict(state=case.removesuffix("_gathered"))
        schedule = Schedule(micro_batch=1, num_micro_batches=2 if case == "zero1" else 1)
    plan = make_plan(graph, mesh, schedule, **strategy)
    train = TrainSpec(global_batch=2 * schedule.num_micro_batches, seq_len=16)
    pred = predict(graph, plan, make_cluster(2), train)
    assert pred.build_peak_bytes == HAND[case]
    sharded = ("zero3", "zero1_gathered", "tp2")
    assert pred.memory_breakdown["build_transient"] == (8 * 4096 if case in sharded else 8 * 8192)
    assert pred.peak_memory_bytes == max(step_bytes(pred), optimizer_step_bytes(pred),
                                         pred.build_peak_bytes)


# ---- a build peak above the step peak ----------------------------------------------------------

VOCAB, HIDDEN = 65_536, 1024


def embedding_heavy_graph() -> ModelGraph:
    """One huge embedding (64M parameters) before one small MLP block, priced for a tiny batch."""
    embed = LayerInfo(name="embed", kind="embedding", index=0, block=None, class_id="embed",
                      params=(ParamInfo("embed.weight", (VOCAB, HIDDEN), "bf16", "vocab"),),
                      bytes_per_token=4 * HIDDEN, output_bytes_per_token=2 * HIDDEN, hidden=HIDDEN, vocab=VOCAB)
    mlp = LayerInfo(name="blocks.0.mlp", kind="mlp", index=1, block=0, class_id="mlp",
                    params=(ParamInfo("blocks.0.mlp.up.weight", (256, HIDDEN), "bf16", "column"),
                            ParamInfo("blocks.0.mlp.down.weight", (HIDDEN, 256), "bf16", "row")),
                    matmul_flops_per_token=4 * 256 * HIDDEN, bytes_per_token=8 * HIDDEN,
                    saved_boundary_per_token=2 * HIDDEN, saved_interior_per_token=4 * 256,
                    input_bytes_per_token=2 * HIDDEN, output_bytes_per_token=2 * HIDDEN, hidden=HIDDEN,
                    ffn_hidden=256)
    return ModelGraph(model_name="embedding-heavy", layers=(embed, mlp), edges=(("embed", "blocks.0.mlp"),),
                      dtype="bf16", hidden=HIDDEN, num_blocks=1, vocab=VOCAB)


def test_build_peak_above_step_peak_is_the_peak():
    """DDP in bf16 holds 16 B per parameter in the step (2 + 2 + 12) but 14 B + 8 B per element of
    the largest region while building: one huge embedding makes the build the peak."""
    graph = embedding_heavy_graph()
    plan = make_plan(graph, Mesh(dp_shard=2), Schedule(micro_batch=1), state="replicate")
    pred = predict(graph, plan, make_cluster(2), TrainSpec(global_batch=2, seq_len=8))
    psi = VOCAB * HIDDEN + 2 * 256 * HIDDEN
    assert pred.build_peak_bytes == 14 * psi + 8 * VOCAB * HIDDEN
    assert step_bytes(pred) < pred.build_peak_bytes
    assert pred.peak_memory_bytes == pred.build_peak_bytes == pred.memory_by_stage[0]
    assert pred.memory_breakdown["build_transient"] == 8 * VOCAB * HIDDEN


def test_search_keeps_the_build_peak_under_the_limit():
    """With the optimizer update priced free (a calibration), DDP and ZeRO-1 tie on time and the search
    keeps the embedding DDP: 16 B per parameter in the forward/backward, 20 B in the optimizer step (its
    gradient's fp32 copy), 14 B + 8 B per element of the largest region while building. A limit between
    the optimizer step's peak and the build's binds only through the build/stage rows: the search must
    pick another plan, whose predicted peak, build included, fits."""
    graph, cluster = embedding_heavy_graph(), replace(make_cluster(2), calibration={"adamw_s_per_param": 0.0})
    train, fixed = TrainSpec(global_batch=2, seq_len=8), {"dp_shard": 2, "tp": 1, "pp": 1}
    loose = solve(graph, cluster, train, constraints=Constraints(mesh=fixed), time_limit_s=30)
    running = max(step_bytes(loose.predictions), optimizer_step_bytes(loose.predictions))
    assert loose.strategy("embed").state == "replicate"
    assert running < loose.predictions.build_peak_bytes == loose.predictions.peak_memory_bytes
    limit = (running + loose.predictions.build_peak_bytes) // 2
    tight = solve(graph, cluster, train, time_limit_s=30,
                  constraints=Constraints(mesh=fixed, max_memory_bytes=limit, memory_headroom=0.0))
    assert tight.strategy("embed").state != loose.strategy("embed").state
    assert tight.predictions.build_peak_bytes <= tight.predictions.peak_memory_bytes <= limit


def test_old_plan_files_load_without_a_build_peak(tmp_path):
    graph = embedding_heavy_graph()
    plan = replace(make_plan(graph, Mesh(dp_shard=2), Schedule(micro_batch=1)),
                   predictions=Predictions(step_time_s=1.0, peak_memory_bytes=10, build_peak_bytes=7))
    assert Plan.from_dict(plan.to_dict()) == plan
    data = plan.to_dict()
    del data["predictions"]["build_peak_bytes"]  # written before the field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = Plan.load(path)
    assert loaded.predictions.build_peak_bytes == 0 and loaded.predictions.peak_memory_bytes == 10
    assert "(build" not in str(loaded) and "(build 7 B)" in str(plan)
