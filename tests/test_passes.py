"""Per-rank programs at 64-1024 ranks under a fake process group (no compute), pass records, bad input."""

from __future__ import annotations

import pytest
import torch

from _harness import fake_world
from _runtime_cases import graph_of, make_plan
from autoshard.errors import PlanError
from autoshard.models import build
from autoshard.passes import PASSES
from autoshard.passes.context import chunk_or_empty, coords_of
from autoshard.plan import Mesh
from autoshard.runtime import build_program
from autoshard.train import TrainSpec

LLAMA = "llama:tiny"
TRAIN = TrainSpec(global_batch=8, seq_len=8, precision="fp32")


def test_pass_order():
    assert [p.NAME for p in PASSES] == ["shard_parameters", "insert_collectives", "recompute", "schedule_overlap", "quantize_comm", "split_pipeline"]


@pytest.mark.parametrize(
    "world, rank, mesh",
    [(64, 37, Mesh(dp_shard=32, tp=2)), (1024, 777, Mesh(dp_replicate=4, dp_shard=128, tp=2))],
)
@pytest.mark.slow
def test_large_mesh_local_shapes(world, rank, mesh):
    plan = make_plan(LLAMA, mesh, lambda layer: {"state": "zero3", "tp": "megatron"})
    with fake_world(world, rank):
        program = build_program(build(LLAMA), graph_of(LLAMA), plan, TRAIN)
    coords = coords_of(rank, mesh)
    assert program.ctx.coords == coords
    full = dict(build(LLAMA).named_parameters())
    for fqn, param in program.gm.named_parameters():
        placement = program.param_placements[fqn]
        expected = full[fqn]
        if placement.tp_dim is not None:
            expected = expected.chunk(2, placement.tp_dim)[coords["tp"]]
        expected = chunk_or_empty(expected, mesh.dp_shard, coords["dp_shard"], 0)
        assert tuple(param.shape) == tuple(expected.shape) == placement.local_shape, fqn
    q = program.param_placements["blocks.0.attn.q.weight"]
    assert q.global_shape == (64, 64) and str(q.placements[program_axes().index("tp")]) in ("S(0)", "Shard(dim=0)")


def program_axes():
    from autoshard.passes.context import MESH_ORDER

    return MESH_ORDER


def test_inserted_nodes_record_why():
    plan = make_plan(LLAMA, Mesh(dp_shard=2, tp=2), lambda layer: {"state": "zero3", "tp": "megatron"})
    with fake_world(4, 1):
        program = build_program(build(LLAMA), graph_of(LLAMA), plan, TRAIN)
    tagged = [n for n in program.gm.graph.nodes if "autoshard" in n.meta]
    passes = {n.meta["autoshard"]["pass"] for n in tagged}
    assert {"insert_collectives", "schedule_overlap"} <= passes
    assert all(n.meta["autoshard"]["why"] for n in tagged)
    targets = [str(n.target) for n in program.gm.graph.nodes if n.op == "call_function"]
    assert sum("copy_to_tp" in t for t in targets) == 2 * 2 + 1  # attn + mlp per block, + head
    assert sum("reduce_from_tp" in t for t in targets) == 2 * 2 + 1  # o + down per block, + embedding
    # schedule_overlap (prefetch=1 by default) splits every gather into a start and a wait module
    gathers = [n for n in program.gm.graph.nodes if n.op == "call_module" and n.target.startswith("autoshard_gather_")]
    starts = [n for n in gathers if n.target.endswith("_start")]
    waits = [n for n in gathers if n.target.endswith("_wait")]
    assert len(starts) == len(waits) == len(gathers) // 2 == sum(1 for layer in graph_of(LLAMA).layers if layer.params)


def test_world_size_mismatch_is_refused_before_collectives():
    plan = make_plan(LLAMA, Mesh(dp_shard=4), lambda layer: {})
    with fake_world(2, 0), pytest.raises(PlanError, match="needs 4 ranks but this job has world size 2"):
        build_program(build(LLAMA), graph_of(LLAMA), plan, TRAIN)


def test_plan_for_another_model_is_refused():
    plan = make_plan("gpt:tiny", Mesh(dp_shard=2), lambda layer: {})
    with fake_world(2, 0), pytest.raises(PlanError, match="does not match model"):
        build_program(build(LLAMA), graph_of(LLAMA), plan, TRAIN)


@pytest.mark.parametrize(
    "mesh, choose, message",
    [
        (Mesh(pp=2), lambda layer: {}, r"pipeline stages \[1\] of 2 .* own no layer"),  # every layer on stage 0
        (Mesh(cp=2), lambda layer: {}, "context parallelism"),  # recompute / SP / EP are implemented now
        (Mesh(tp=4), lambda layer: {"tp": "megatron"}, "not divisible by tp=4|key/value heads"),
    ],
)
def test_unimplemented_or_invalid_plans_raise(mesh, choose, message):
    plan = make_plan(LLAMA, mesh, choose)
    with fake_world(mesh.world_size, 0), pytest.raises(PlanError, match=message):
        build_program(build(LLAMA), graph_of(LLAMA), plan, TRAIN)


def test_shard_rule_matches_torch_chunk():
    t = torch.arange(10.0).view(5, 2)
    assert [tuple(chunk_or_empty(t, 4, i, 0).shape) for i in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
