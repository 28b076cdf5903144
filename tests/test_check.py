"""``autoshard check`` (``autoshard/check.py``): every rank role of a plan built at its world size in one process.

Unit tests of the matching (``runtime/_check_match.py``) on hand-made records, one of them deliberately
mismatched per kind of error; role enumeration; the memory-overflow rule; one plan built and matched end to
end (and a Hugging Face model with rotary buffers); and a bounded property sample: random reference models,
clusters (1–512 nodes × 1–8 devices) and pins, every plan the search returns issues matching collectives on
every group and holds no more than the cost model predicts (within ``check.TOLERANCE``). ``benchmarks/check_bench.py`` runs a larger sample.
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import pytest

from autoshard.plan import Mesh
from autoshard.runtime._check_match import RoleIndex, first_mismatch, group_members, plan_roles, select_roles
from autoshard.runtime._check_trace import Issued, axis_of_groups

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
NO_PARAMS = types.SimpleNamespace(layers=[])  # a graph without parameters: one dp class
# one (5, 3) parameter: over 2 dp ranks chunks of 3 and 2 rows, so each dp coordinate is a role of its own
UNEVEN = types.SimpleNamespace(layers=[types.SimpleNamespace(params=[types.SimpleNamespace(global_shape=(5, 3))])])
MIB = 2**20


def _records(mesh: Mesh, issued_of, graph=UNEVEN) -> dict:
    index = RoleIndex(graph, mesh)
    return {index.role_of(r): issued_of(r) for r in range(mesh.world_size)}, index


def _tp_dp(rank: int) -> list[Issued]:
    return [Issued("all_gather", "dp_shard", 4 * MIB), Issued("all_reduce", "tp", MIB),
            Issued("reduce_scatter", "dp_shard", 4 * MIB), Issued("all_reduce", "world", 4)]


def test_matching_records_pass():
    records, index = _records(Mesh(dp_shard=2, tp=2), _tp_dp)
    assert first_mismatch(records, index) is None


def test_size_mismatch_names_rank_collective_group_and_bytes():
    def issued(rank):
        out = _tp_dp(rank)
        if rank == 3:  # tp 1 of dp 1 gathers half
            out[0] = Issued("all_gather", "dp_shard", 2 * MIB)
        return out

    records, index = _records(Mesh(dp_shard=2, tp=2), issued)
    message = first_mismatch(records, index)
    assert message.startswith("rank 3: collective #0 all_gather on group dp_shard expected 4.0 MiB, found 2.0 MiB")


def test_kind_and_count_mismatch():
    def kind(rank):
        out = _tp_dp(rank)
        if rank == 1:
            out[1] = Issued("all_gather", "tp", MIB)
        return out

    records, index = _records(Mesh(tp=2), kind)
    assert first_mismatch(records, index) == "rank 1: collective #1 all_gather on group tp expected all_reduce " \
                                             "(as rank 0), found all_gather"
    records, index = _records(Mesh(tp=2), lambda r: _tp_dp(r)[: 4 - r])
    assert "rank 1" in first_mismatch(records, index) and "world" in first_mismatch(records, index)


def test_unknown_group_is_a_mismatch():
    records, index = _records(Mesh(tp=2), lambda r: [Issued("all_reduce", "?", 4)])
    assert "serves no mesh axis" in first_mismatch(records, index)


def test_send_recv_pairs():
    def p2p(rank, size=MIB):
        return [Issued("send", "pp", size, peer=1)] if rank == 0 else [Issued("recv", "pp", MIB, peer=0)]

    records, index = _records(Mesh(pp=2), p2p)
    assert first_mismatch(records, index) is None
    records, index = _records(Mesh(pp=2), lambda r: p2p(r, 2 * MIB))
    assert first_mismatch(records, index) == ("rank 0: collective #0 send on group pp to rank 1: sends 2.0 MiB, "
                                              "rank 1 receives 1.0 MiB")


def test_groups_and_roles():
    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert group_members("tp", 5, mesh) == [4, 5]
    assert group_members("dp", 1, mesh) == [1, 3, 5, 7]
    assert group_members("pp", 3, mesh) == [3, 11]
    assert len(plan_roles(NO_PARAMS, mesh)) == 4  # pp × tp; every dp coordinate alike without parameters
    classes = {r.key[3] for r in plan_roles(UNEVEN, Mesh(dp_shard=4))}  # 5 rows over 4: 2, 2, 1, 0
    assert len(classes) == 3
    roles = plan_roles(NO_PARAMS, Mesh(pp=4, tp=8))
    chosen = select_roles(roles, Mesh(pp=4, tp=8), 6, seed=1)
    assert len(chosen) == 6 and {(0, 0, 0, 0), (3, 0, 7, 0)} <= {r.key for r in chosen}
    two = select_roles(roles, Mesh(pp=4, tp=8), 2)  # a small sample still holds the first and the last stage
    assert {r.key for r in two} == {(0, 0, 0, 0), (3, 0, 0, 0)}
    assert axis_of_groups({"dp": "0", "dp_shard": "0", "world": "0", "tp": "3"}) == {"0": "dp_shard", "3": "tp"}


def test_memory_overflow_rule():
    from autoshard.check import RoleResult, _memory_overflow

    role = plan_roles(NO_PARAMS, Mesh())[0]
    fits = RoleResult(role, "rank 0", 3, 100, 1040, 100, 1000, 0.0)
    assert _memory_overflow([fits], 0.05) is None
    over = RoleResult(role, "rank 0", 3, 100, 1100, 100, 1000, 0.0)
    assert _memory_overflow([over], 0.05).startswith("rank 0: step memory 1.1 KiB traced, 1000 B predicted (+10.0%")


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny():
    from autoshard.models import build
    from autoshard.passes import capture

    model = build("llama:tiny", device="meta")
    return model, capture(model, seq_lens=(8, 16))


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_zero3_plan_matches_and_fits(tiny):
    from autoshard.plan import LayerStrategy, Plan, Schedule
    from autoshard.check import check_plan
    from autoshard.train import TrainSpec

    model, graph = tiny
    mesh = Mesh(dp_shard=4)
    plan = Plan(model_name=graph.model_name, mesh=mesh, global_batch=8, seq_len=16, precision="fp32",
                layers=tuple(LayerStrategy(layer=layer.name, state="zero3") for layer in graph.layers),
                schedule=Schedule(micro_batch=1, num_micro_batches=2))
    report = check_plan(plan, model, graph, TrainSpec(global_batch=8, seq_len=16, precision="fp32"))
    assert report.ok, report.table()
    assert [r.role.num_ranks for r in report.roles] == [1, 3]  # dp 0, and the three with equal shards
    assert all(r.collectives > 50 for r in report.roles)  # gathers, re-gathers, reduce-scatters, scalars
    assert all(abs(r.step_error) < 0.05 for r in report.roles), report.table()


@pytest.mark.slow
@pytest.mark.parametrize("family, micro_batch, micro_batches", [("moe", 2, 2), ("llama", 4, 2)])
def test_recomputed_regions_priced_as_their_backward_holds_them(family, micro_batch, micro_batches):
    """Two pipeline stages, ZeRO-3 and full recompute: each block's backward recomputes the block (a MoE's
    routed experts' activations) and gathers its weights again, at once; its layers' backwards then hold what
    the region recreated for them, their activation gradients, and the first stage the outputs it keeps."""
    import torch

    from autoshard.check import check_plan
    from autoshard.models import build
    from autoshard.passes import capture
    from autoshard.plan import LayerStrategy, Plan, Schedule
    from autoshard.train import TrainSpec

    config = dict(hidden=512, ffn_hidden=1024, num_heads=8, num_kv_heads=8, num_layers=4, vocab_size=512,
                  max_seq_len=512)
    model = build(f"{family}:tiny", device="meta", dtype=torch.bfloat16, **config)
    graph = capture(model, seq_lens=(8, 16))

    def stage(name: str) -> int:
        return int(name.split(".")[1]) // 2 if name.startswith("blocks.") else (0 if name.startswith("embed") else 1)

    layers = tuple(LayerStrategy(layer=l.name, state="zero3", stage=stage(l.name),
                                 recompute="full" if l.name.startswith("blocks.") else "none") for l in graph.layers)
    batch = 2 * micro_batch * micro_batches
    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=2, pp=2), layers=layers, precision="bf16",
                global_batch=batch, schedule=Schedule(name="1f1b", micro_batch=micro_batch,
                                                      num_micro_batches=micro_batches))
    report = check_plan(plan, model, graph, TrainSpec(global_batch=batch, seq_len=512, precision="bf16"))
    assert all(abs(r.step_error) < 0.05 for r in report.roles), report.table()


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_searched_plans_match_and_fit(seed):
    """Property sample (seeded): a random model, cluster and pin; the searched plan's roles match and no role
    holds more than its predicted memory."""
    from benchmarks import check_bench

    rng = random.Random(seed)
    row = check_bench.run_case(check_bench.random_case(rng), rng, max_roles=2, search_s=10.0)
    if not row["searched"]:
        pytest.skip(f"infeasible draw: {row['error']}")
    assert row["collectives_match"], row
    assert row["memory_within_tolerance"], row


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_meta_attention_runs_the_device_kernel(tiny, monkeypatch):
    """On meta, SDPA takes the math path ([b, a, s, s] fp32 scores, their softmax and its gradient) where a CPU or
    CUDA device runs a fused kernel; the check points the program's SDPA nodes at the fused op (checkpoint
    regions included), so a long-sequence plan's traced step is what a device holds."""
    import torch

    from autoshard.plan import LayerStrategy, Plan, Schedule
    from autoshard.runtime._check_trace import SDPA, device_sdpa, route_device_kernels
    from autoshard.check import check_plan
    from autoshard.train import TrainSpec

    model, graph = tiny
    g = torch.fx.Graph()
    q = g.placeholder("q")
    g.output(g.call_function(SDPA, (q, q, q), {"is_causal": True}))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert route_device_kernels(gm) == 1 and route_device_kernels(gm) == 0
    x = torch.empty(2, 4, 128, 16, device="meta", requires_grad=True)
    assert "Flash" in gm(x).grad_fn.name() and "Flash" in device_sdpa(x, x, x, is_causal=True).grad_fn.name()

    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=2), global_batch=16, seq_len=256, precision="bf16",
                layers=tuple(LayerStrategy(layer=layer.name, state="zero1") for layer in graph.layers),
                schedule=Schedule(micro_batch=8, num_micro_batches=1))
    train = TrainSpec(global_batch=16, seq_len=256, precision="bf16")
    report = check_plan(plan, model, graph, train, max_roles=1)
    assert report.ok, report.table()
    from autoshard import check

    monkeypatch.setattr(check, "route_device_kernels", lambda module: 0)  # the math path's scores: an overflow
    math = check_plan(plan, model, graph, train, max_roles=1)
    assert math.memory_overflow and math.roles[0].step_bytes > 1.5 * report.roles[0].step_bytes, math.table()


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_zero3_dim0_chunks_priced_as_the_first_rank_holds_them():
    """ZeRO-3 cuts dim 0 by ``torch.chunk``: 4 experts over 17 ranks put one whole expert on the first rank (and
    a gathered buffer of 17), not 4/17 of one. The cost model prices the first rank's ⌈d₀/N⌉ rows (a random
    HSDP plan, dp_shard 17, traced 2.9 MiB at build against 1.5 MiB predicted before)."""
    import math

    import torch

    from autoshard.cluster import Cluster
    from autoshard.models import build
    from autoshard.passes import capture
    from autoshard.plan import LayerStrategy, Schedule
    from autoshard.search.cost_model import layer_cost
    from autoshard.train import TrainSpec

    model = build("moe:tiny", device="meta", dtype=torch.bfloat16)
    moe = next(layer for layer in capture(model, seq_lens=(8, 16)).layers if layer.kind == "moe")
    experts = [p for p in moe.params if p.tp_role == "expert"]
    assert experts and all(p.global_shape[0] == 4 for p in experts)
    cpu, train = Cluster.preset("cpu", nodes=1, devices_per_node=17), TrainSpec(global_batch=17, seq_len=16)
    cost = layer_cost(moe, LayerStrategy(layer=moe.name, state="zero3"), Mesh(dp_shard=17), cpu, train,
                      Schedule(micro_batch=1, num_micro_batches=1))
    held = sum(math.prod(p.global_shape[1:]) for p in experts) + sum(
        math.ceil(p.global_shape[0] / 17) * math.prod(p.global_shape[1:]) for p in moe.params if p not in experts)
    assert cost.memory.params == 2 * held  # bf16: one expert of each weight, the first rank's chunk of the rest
    assert cost.memory.gathered == 2 * 17 * held  # the all-gather's 17 chunks
    cpu, train = Cluster.preset("cpu", nodes=1, devices_per_node=2), TrainSpec(global_batch=2, seq_len=16)
    wide = layer_cost(moe, LayerStrategy(layer=moe.name, state="zero3"), Mesh(dp_shard=2), cpu, train,
                      Schedule(micro_batch=1, num_micro_batches=1))
    assert wide.memory.params == 2 * sum(p.numel for p in moe.params) / 2  # d₀ divisible: ψ/N as before


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_hugging_face_model_with_buffers_checks():
    """A Hugging Face Llama (random weights, rotary ``inv_freq`` buffers) built on meta: ``check`` copies no
    buffer values (there are none on meta) and its two pipeline stages match and fit."""
    pytest.importorskip("transformers")
    import torch

    from autoshard.check import check_plan
    from autoshard.passes import capture
    from autoshard.plan import LayerStrategy, Plan, Schedule
    from autoshard.train import TrainSpec
    from benchmarks.hf_zoo import build_hf_policy

    model = build_hf_policy("hf-llama:tiny", dtype=torch.float32, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                            max_position_embeddings=64)
    assert any(name.endswith("inv_freq") for name, _ in model.named_buffers())
    graph = capture(model, seq_lens=(8, 16))
    second_block = next(i for i, l in enumerate(graph.layers) if l.block == 1)
    layers = tuple(LayerStrategy(layer=l.name, state="zero3", stage=int(i >= second_block))
                   for i, l in enumerate(graph.layers))
    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=2, pp=2), layers=layers, precision="fp32",
                global_batch=8, seq_len=16, schedule=Schedule(name="1f1b", micro_batch=2, num_micro_batches=2))
    report = check_plan(plan, model, graph, TrainSpec(global_batch=8, seq_len=16, precision="fp32"))
    assert report.ok, report.table()
    assert len(report.roles) >= 2
