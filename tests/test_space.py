"""Strategy space: mesh enumeration and divisibility pruning, per-layer rules, schedules, constraints."""

from __future__ import annotations

import pytest
import torch

from autoshard.errors import AutoshardError
from autoshard.plan import Mesh, Schedule
from autoshard.search.cost_model import LayerCost, MemoryBreakdown
from autoshard.search.evaluate import Option, prune_dominated
from autoshard.search.space import (
    Constraints, admissible_strategies, divisors, enumerate_meshes, schedule_candidates, solver_classes,
    resolve_pins, validate_constraints,
)
from autoshard.search.synthetic import SyntheticConfig, synthetic_cluster, synthetic_graph
from autoshard.train import TrainSpec


def _graph(**kw):
    base = dict(name="tiny", num_blocks=8, hidden=256, num_heads=8, ffn_hidden=512, vocab=1024)
    base.update(kw)
    return synthetic_graph(SyntheticConfig(**base))


def _ordered_triples(world):
    return [(tp, pp, world // (tp * pp)) for tp in divisors(world) for pp in divisors(world // tp)]


def test_mesh_count_world8():
    # (tp, pp, dp) ordered factorisations of 8 = 10; dp splits with dp_replicate>1 ⇒ dp_shard>1:
    # dp=1:1, dp=2:1, dp=4:2, dp=8:3  → 4·1 + 3·1 + 2·2 + 1·3 = 14.
    out = enumerate_meshes(_graph(), synthetic_cluster("h100-sxm", 1))
    assert len(out.meshes) == 14
    assert len(set(out.meshes)) == 14
    assert all(m.world_size == 8 for m in out.meshes)
    assert not any(m.dp_replicate > 1 and m.dp_shard == 1 for m in out.meshes)


def test_mesh_count_matches_brute_force_two_nodes():
    cluster = synthetic_cluster("h100-sxm", 2)
    out = enumerate_meshes(_graph(num_blocks=64), cluster)
    expected = sum(
        sum(1 for ds in divisors(dp) if dp // ds == 1 or ds > 1)
        for tp, pp, dp in _ordered_triples(16) if 8 % tp == 0
    )
    assert len(out.meshes) == expected
    assert max(m.tp for m in out.meshes) == 8
    assert any(r.constraint == "tp_in_node" for r in out.pruned)


@pytest.mark.parametrize(
    "kw, rule, max_tp",
    [
        (dict(num_heads=6, hidden=384), "tp_divides/heads", 2),
        (dict(num_kv_heads=2), "tp_divides/kv_heads", 2),
        (dict(ffn_hidden=516), "tp_divides/ffn", 4),
        (dict(vocab=1001), "tp_divides/vocab", 1),
    ],
)
def test_tp_divisibility_pruning(kw, rule, max_tp):
    out = enumerate_meshes(_graph(**kw), synthetic_cluster("h100-sxm", 1))
    assert max(m.tp for m in out.meshes) == max_tp
    records = [r for r in out.pruned if r.constraint == rule]
    assert records and "does not divide" in records[0].detail


def test_pp_bounded_by_blocks_and_batch_divisibility():
    out = enumerate_meshes(_graph(num_blocks=2), synthetic_cluster("h100-sxm", 1), TrainSpec(global_batch=6, seq_len=8))
    assert max(m.pp for m in out.meshes) == 2
    assert all(6 % m.dp == 0 for m in out.meshes)
    names = {r.constraint for r in out.pruned}
    assert {"pp_le/blocks", "batch_divides/dp"} <= names


def test_moe_expert_parallel_degrees():
    graph = _graph(num_experts=4)
    out = enumerate_meshes(graph, synthetic_cluster("h100-sxm", 1))
    eps = {m.ep for m in out.meshes}
    assert eps == {1, 2, 4}
    assert all(m.dp % m.ep == 0 and 4 % m.ep == 0 for m in out.meshes)
    assert {m.ep for m in enumerate_meshes(_graph(), synthetic_cluster("h100-sxm", 1)).meshes} == {1}


def test_fixed_axes_filter():
    out = enumerate_meshes(_graph(), synthetic_cluster("h100-sxm", 1), fixed={"tp": 2, "pp": 2})
    assert out.meshes and all(m.tp == 2 and m.pp == 2 for m in out.meshes)


def test_admissible_strategy_rules():
    graph = _graph()
    attn, norm, mlp = graph.layer("blocks.0.attn"), graph.layer("blocks.0.attn_norm"), graph.layer("blocks.0.mlp")
    mesh = Mesh(dp_shard=2, tp=2, pp=2)
    attn_s = admissible_strategies(attn, mesh)
    assert {s.tp for s in attn_s} == {"megatron"} and {s.sp for s in attn_s} == {False, True}
    assert {s.tp for s in admissible_strategies(norm, mesh)} == {"none"}
    assert all(s.state == "zero3" for s in attn_s if s.weight_comm != "bf16")
    assert all(s.state in ("zero2", "zero3") for s in attn_s if s.grad_comm in ("int8", "int4"))
    assert not any(s.grad_comm == "fp32" or s.weight_comm == "fp8" for s in attn_s)
    assert {s.recompute for s in attn_s} == {"none", "selective", "full"}
    assert {s.recompute for s in admissible_strategies(mlp, mesh)} == {"none", "full"}
    single = admissible_strategies(attn, Mesh(tp=2, pp=4))
    assert {s.state for s in single} == {"replicate", "offload"}
    assert {(s.weight_comm, s.grad_comm) for s in single} == {("bf16", "bf16")}
    assert {s.tp for s in admissible_strategies(attn, Mesh(dp_shard=8))} == {"none"}
    pinned = admissible_strategies(attn, mesh, {"state": "zero3", "grad_comm": "fp32"})
    assert pinned and all(s.state == "zero3" and s.grad_comm == "fp32" for s in pinned)


def test_expert_parallel_only_for_moe_layers():
    graph = _graph(num_experts=4)
    mesh = Mesh(dp_shard=4, ep=2, tp=2)
    assert {s.ep for s in admissible_strategies(graph.layer("blocks.0.mlp"), mesh)} == {True}
    assert {s.ep for s in admissible_strategies(graph.layer("blocks.0.attn"), mesh)} == {False}


def test_schedule_candidates():
    graph, train = _graph(num_blocks=8), TrainSpec(global_batch=16, seq_len=8)
    flat = schedule_candidates(Mesh(dp_shard=2), graph, train)
    assert [(s.name, s.micro_batch, s.num_micro_batches) for s in flat] == [
        ("1f1b", 1, 8), ("1f1b", 2, 4), ("1f1b", 4, 2), ("1f1b", 8, 1)]
    piped = schedule_candidates(Mesh(dp_shard=2, pp=2), graph, train)
    assert {s.name for s in piped if s.num_micro_batches < 2} == {"gpipe"}
    assert all(s.num_micro_batches >= 2 for s in piped if s.name == "1f1b")
    inter = [s for s in piped if s.name == "interleaved_1f1b"]
    assert inter and all(8 % (2 * s.virtual_stages) == 0 and s.num_micro_batches % 2 == 0 for s in inter)
    assert {s.virtual_stages for s in inter} == {2, 4}
    fixed = schedule_candidates(Mesh(dp_shard=2), graph, TrainSpec(global_batch=16, seq_len=8, micro_batch=4))
    assert [(s.micro_batch, s.num_micro_batches) for s in fixed] == [(4, 2)]


def _opt(t, tail, static, act, sp=False, buffers=0.0):
    from autoshard.plan import LayerStrategy

    cost = LayerCost(fwd_s=t, bwd_s=0.0, comm_exposed_s=tail, comm_total_s=tail, optimizer_s=0.0,
                     memory=MemoryBreakdown(params=static, activations=act, buffers=buffers))
    return Option(LayerStrategy(layer="x", sp=sp), cost)


def test_prune_dominated():
    a, b, c, d = _opt(1, 1, 1, 1), _opt(2, 1, 1, 1), _opt(1, 1, 0.5, 2), _opt(3, 3, 3, 3, sp=True)
    tie = _opt(1, 1, 1, 1)
    kept = prune_dominated([a, b, c, d, tie])
    ids = [id(o) for o in kept]
    assert ids == [id(a), id(c), id(d)]  # b is slower, tie comes later, d has the other sp


def test_constraint_validation_messages():
    graph, cluster = _graph(), synthetic_cluster("h100-sxm", 1)
    bad = [
        (Constraints(pin={"nope": {"state": "zero3"}}), "nope"),
        (Constraints(pin={"lm_head": {"color": "red"}}), "color"),
        (Constraints(pin={"lm_head": {"state": "zero4"}}), "zero4"),
        (Constraints(mesh={"xp": 2}), "xp"),
        (Constraints(mesh={"tp": 3}), "divisors"),
        (Constraints(schedule="zigzag"), "zigzag"),
        (Constraints(pin={"blocks.0.attn": {"tp": "megatron"}}, mesh={"tp": 1}), "contradicts"),
        (Constraints(pin={"blocks.0.attn_norm": {"tp": "megatron"}}), "no column/row/vocab"),
        (Constraints(pin={"lm_head": {"state": "zero1", "weight_comm": "int8"}}), "needs state='zero3'"),
        (Constraints(pin={"lm_head": {"state": "replicate", "grad_comm": "int4"}}), "zero2"),
        (Constraints(pin={"blocks.0.attn": {"ep": True}}), "MoE"),
    ]
    for constraints, needle in bad:
        with pytest.raises(AutoshardError, match=needle):
            validate_constraints(constraints, graph, cluster)
    validate_constraints(Constraints(pin={"lm_head": {"state": "zero3"}}, mesh={"tp": 2}), graph, cluster)
    with pytest.raises(AutoshardError) as err:  # the next step names a command that exists
        resolve_pins(Constraints(pin={"nope": {"state": "zero3"}}), graph)
    assert "`autoshard capture MODEL`" in str(err.value) and "--show-layers" not in str(err.value)


def test_layer_pin_splits_its_class():
    graph = _graph(num_blocks=3)
    pins = resolve_pins(Constraints(pin={"blocks.1.attn": {"recompute": "full"},
                                         "attention:256:8:8": {"state": "zero3"}}), graph)
    assert pins["blocks.1.attn"] == {"state": "zero3", "recompute": "full"}
    assert pins["blocks.0.attn"] == {"state": "zero3"}
    classes = {c.name: c for c in solver_classes(graph, pins)}
    split = [c for c in classes.values() if c.class_id == "attention:256:8:8"]
    assert sorted(len(c.layers) for c in split) == [1, 2]
    assert any(name.endswith("@blocks.1.attn") for name in classes)


def test_pin_on_a_tied_head_names_the_real_reason():
    """A tied head owns no parameter: a state or wire pin on it is refused for that reason (the embedding
    sets the tied weight's state); a pin of what it does have (recompute) is accepted."""
    from autoshard.models import build
    from autoshard.passes import capture
    from autoshard.search.space import Constraints, validate_constraints

    graph = capture(build("gpt:tiny"))
    cluster = synthetic_cluster("cpu", 2)
    head = graph.layer("head")
    assert not head.params and head.tied_params
    with pytest.raises(AutoshardError, match="has none .*tied weight of an earlier layer"):
        validate_constraints(Constraints(pin={"head": {"state": "zero3"}}), graph, cluster)
    validate_constraints(Constraints(pin={"head": {"recompute": "full", "state": "replicate"}}), graph, cluster)


@pytest.mark.slow
def test_tied_weights_are_never_pipelined():
    """A tied embedding and head would sit on the first and last pp rank, which the runtime refuses
    (``passes/split_pipeline.py``): the mesh enumeration prunes pp > 1 for such a model."""
    from autoshard.models import build
    from autoshard.passes import capture

    tied = enumerate_meshes(capture(build("gpt:tiny")), synthetic_cluster("cpu", 4))
    assert tied.meshes and all(m.pp == 1 for m in tied.meshes)
    assert any(r.constraint == "tied/pp" for r in tied.pruned)
    untied = enumerate_meshes(capture(build("llama:tiny")), synthetic_cluster("cpu", 4))
    assert any(m.pp > 1 for m in untied.meshes)


class _FusedGqa(torch.nn.Module):
    """Attention with a fused ``[q | k | v]`` of widths 64, 32, 32 (heads of 16): tp cannot split it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, 16).transpose(1, 2) for t in self.qkv(x).split([64, 32, 32], dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 64))


class _RefusedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": _FusedGqa()})])
        self.head = torch.nn.Linear(64, 256, bias=False)
        self.value_head = torch.nn.Linear(64, 1)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.blocks[0]["attn"](x)
        return self.head(x), self.value_head(x).squeeze(-1)


def test_a_layer_tp_cannot_split_keeps_tp_none():
    """``tp_runs/<reason>``: capture's ``tp_refusal`` keeps the layer at tp='none' (and the model without SP)
    while the embedding and head still split; the solved plan passes ``check_compatible``."""
    from autoshard.passes import capture
    from autoshard.search import solve

    graph = capture(_RefusedBlock(), seq_lens=(8, 16))
    attn = graph.layer("blocks.0.attn")
    assert "unequal parts" in attn.tp_refusal
    cluster = synthetic_cluster("h100-sxm", 1, devices_per_node=2)
    record = next(r for r in enumerate_meshes(graph, cluster).pruned if r.constraint.startswith("tp_runs/"))
    assert record.constraint == "tp_runs/fused_parts" and "blocks.0.attn" in record.detail
    assert {(s.tp, s.sp) for s in admissible_strategies(attn, Mesh(tp=2))} == {("none", False)}
    assert {s.tp for s in admissible_strategies(graph.layer("head"), Mesh(tp=2))} == {"megatron"}
    plan = solve(graph, cluster, TrainSpec(global_batch=8, seq_len=16), constraints=Constraints(mesh={"tp": 2}),
                 time_limit_s=20, num_workers=1)
    assert plan.mesh.tp == 2
    assert plan.strategy("blocks.0.attn").tp == "none" and not any(s.sp for s in plan.layers)
    assert {plan.strategy(name).tp for name in ("embed", "head")} == {"megatron"}
    plan.check_compatible(graph=graph)
    with pytest.raises(AutoshardError, match=r"tp='megatron' but the tensor-parallel runtime cannot split .*tp_runs"):
        validate_constraints(Constraints(pin={"blocks.0.attn": {"tp": "megatron"}}), graph, cluster)
    validate_constraints(Constraints(pin={"blocks.0.attn": {"tp": "none"}}, mesh={"tp": 2}), graph, cluster)
