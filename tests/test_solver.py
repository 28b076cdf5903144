"""CP-SAT solver: known optima by brute force, determinism, memory binding, pins, infeasibility,
hints, explain/diff, and textbook rediscovery with the real cost model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import zlib

import pytest

from autoshard.errors import AutoshardError, InfeasibleError
from autoshard.graph import ModelGraph
from autoshard.plan import STATES, Mesh
from autoshard.search import Constraints, diff_plans, explain_layer, format_diff, format_explanation, solve
from autoshard.search.cost_model import LayerCost, MemoryBreakdown
from autoshard.search import cost_model
from autoshard.search.evaluate import CostTable, chain_flags, evaluate, interleaved_block_stages, layer_stages
from autoshard.search.solver import usable_memory, without_wall_time
from autoshard.search.space import (
    admissible_strategies, enumerate_meshes, resolve_pins, schedule_candidates, solver_classes,
)
from autoshard.search.synthetic import (
    GPT_1T, MIXTRAL_8X7B, SyntheticConfig, synthetic_cluster, synthetic_graph, toy_layer_cost,
)
from autoshard.train import TrainSpec

GiB = 2**30


# ----------------------------------------------------------------------------- a fake with a known optimum
def _h(*parts) -> float:
    """Deterministic pseudo-random number in [0, 1)."""
    return zlib.crc32(repr(parts).encode()) / 2**32


_STATIC = {"replicate": 4.0, "zero1": 3.0, "zero2": 2.5, "zero3": 1.0, "offload": 1.1}
_ACT = {"none": 3.0, "selective": 2.0, "full": 1.0}


def hashed_cost(layer, s, mesh, cluster, train, schedule) -> LayerCost:
    """Arbitrary costs that keep only the monotonicity the bounds rely on (solver docstring):
    the first-in-order strategy is the fastest, full recompute + zero3/offload the most frugal."""
    key = (layer.class_id, s.state, s.sp, s.recompute, s.weight_comm, s.grad_comm, mesh, schedule.micro_batch,
           schedule.name, schedule.virtual_stages)
    base = 1e-3 * schedule.micro_batch * (1 + _h(layer.class_id, mesh)) / mesh.tp
    simplest = s.state == "replicate" and s.recompute == "none" and s.weight_comm == s.grad_comm == "bf16"
    time = base * (1.0 if simplest else 1.0 + 0.5 * _h("t", key))
    memory = MemoryBreakdown(
        params=1e6 * _STATIC[s.state] * (1 + 0.05 * _h("s", key)),
        activations=1e6 * schedule.micro_batch * _ACT[s.recompute] * (1 + 0.05 * _h("a", key)) / (2 if s.sp else 1),
        buffers=2e5 * _h("g", key) if s.state == "zero3" else 0.0,
    )
    return LayerCost(fwd_s=time / 3, bwd_s=2 * time / 3, comm_exposed_s=1e-3 * _h("c", key),
                     comm_total_s=2e-3, optimizer_s=1e-4 * _h("o", key), memory=memory)


def _tiny_graph(num_blocks: int = 4) -> ModelGraph:
    """Two classes only (attention, MLP), so brute force over every strategy stays small."""
    full = synthetic_graph(SyntheticConfig(name="tiny", num_blocks=num_blocks, hidden=64, num_heads=4,
                                           ffn_hidden=128, vocab=256))
    layers = tuple(dataclasses.replace(l, index=i) for i, l in
                   enumerate(l for l in full.layers if l.kind in ("attention", "mlp")))
    names = [l.name for l in layers]
    return dataclasses.replace(full, layers=layers, edges=tuple(zip(names[:-1], names[1:])))


def _partitions(num_blocks: int, pp: int):
    for cuts in itertools.combinations(range(1, num_blocks), pp - 1):
        bounds = (0,) + cuts + (num_blocks,)
        yield [k for k in range(pp) for _ in range(bounds[k + 1] - bounds[k])]


def _brute_force(graph, cluster, train, constraints, cost_fn) -> float:
    """min step over every mesh, schedule, strategy per class and stage partition that fits M; offload only
    when no plan without it fits (``solve``'s two passes)."""
    best = _brute_force_pass(graph, cluster, train, constraints, cost_fn, offload=False)
    return best if math.isfinite(best) else _brute_force_pass(graph, cluster, train, constraints, cost_fn, offload=True)


def _brute_force_pass(graph, cluster, train, constraints, cost_fn, offload) -> float:
    cap = usable_memory(cluster, constraints)
    classes = solver_classes(graph, resolve_pins(constraints, graph))
    of_layer = {l.name: i for i, c in enumerate(classes) for l in c.layers}
    table, best = CostTable(cost_fn, cluster, train), math.inf
    for mesh in enumerate_meshes(graph, cluster, train, constraints.mesh).meshes:
        for sched in schedule_candidates(mesh, graph, train, constraints.schedule):
            v = sched.virtual_stages if sched.name == "interleaved_1f1b" else 1
            parts = [interleaved_block_stages(graph.num_blocks, mesh.pp, v)] if v > 1 else list(
                _partitions(graph.num_blocks, mesh.pp))
            per_class = [admissible_strategies(c.representative, mesh, dict(c.pin), offload=offload) for c in classes]
            for combo in itertools.product(*per_class):
                if len({s.sp for s in combo}) > 1:
                    continue
                opts = [table.option(l, combo[of_layer[l.name]], mesh, sched) for l in graph.layers]
                for blocks in parts:
                    ev = evaluate(opts, layer_stages(graph, blocks), mesh, sched)
                    if ev.peak_memory_bytes <= cap:
                        best = min(best, ev.step_s)
    return best


@pytest.mark.parametrize(
    "world, mesh, memory",
    [(2, {}, 40e6), (2, {}, 13e6), (4, {"tp": 1}, 14e6), (4, {"dp_shard": 1, "dp_replicate": 1}, 30e6),
     (2, {"pp": 2}, 20e6)],
)
def test_cp_sat_matches_brute_force(world, mesh, memory):
    graph = _tiny_graph()
    cluster = synthetic_cluster("cpu", world)
    train = TrainSpec(global_batch=4, seq_len=16)
    constraints = Constraints(mesh=mesh, max_memory_bytes=int(memory), memory_headroom=0.0)
    expected = _brute_force(graph, cluster, train, constraints, hashed_cost)
    plan = solve(graph, cluster, train, constraints=constraints, cost_fn=hashed_cost, time_limit_s=60)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.objective == pytest.approx(expected, rel=1e-5)
    assert plan.predictions.step_time_s == pytest.approx(plan.solver.objective, rel=1e-9)
    assert plan.predictions.peak_memory_bytes <= memory + 1


def grads_heavy_cost(layer, s, mesh, cluster, train, schedule) -> LayerCost:
    """``hashed_cost`` plus 2 MB of gradient per layer (halved under ZeRO-2/3): gradients large enough
    that a plan fits only because, with one micro-batch on one stage, they appear as the backward frees
    the activations (``memory.step_peak_bytes``)."""
    cost = hashed_cost(layer, s, mesh, cluster, train, schedule)
    extra = 2e6 / (2 if s.state in ("zero2", "zero3") else 1)
    return dataclasses.replace(cost, memory=dataclasses.replace(cost.memory, grads=cost.memory.grads + extra))


@pytest.mark.parametrize("memory", [36e6, 38e6])  # m = 1 fits only by the backward's timeline: sum 45 MB
def test_cp_sat_admits_plans_whose_gradients_and_activations_do_not_coexist(memory):
    """pp = m = 1: the timeline rows count gradients as the backward produces them, as ``predict`` does, so
    the solver reaches the brute-force optimum that a row adding all of both would exclude (faster here)."""
    graph = _tiny_graph()
    cluster, train = synthetic_cluster("cpu", 2), TrainSpec(global_batch=4, seq_len=16)
    constraints = Constraints(max_memory_bytes=int(memory), memory_headroom=0.0)
    expected = _brute_force(graph, cluster, train, constraints, grads_heavy_cost)
    plan = solve(graph, cluster, train, constraints=constraints, cost_fn=grads_heavy_cost, time_limit_s=60)
    assert plan.solver.objective == pytest.approx(expected, rel=1e-5)
    assert plan.schedule.num_micro_batches == 1 and plan.mesh.pp == 1
    assert plan.predictions.peak_memory_bytes <= memory + 1


def build_heavy_cost(layer, s, mesh, cluster, train, schedule) -> LayerCost:
    """``hashed_cost`` plus a build transient (search/memory.py, build peak) large enough to bind:
    20 MB per layer, a quarter of it under ZeRO-3."""
    cost = hashed_cost(layer, s, mesh, cluster, train, schedule)
    transient = 2e7 * (0.25 if s.state == "zero3" else 1.0) * (1 + 0.05 * _h("x", layer.class_id, s.state, mesh))
    return dataclasses.replace(cost, memory=dataclasses.replace(cost.memory, build_transient=transient))


@pytest.mark.parametrize("world, mesh, memory, binds", [
    (2, {}, 50e6, False), (4, {"tp": 1}, 16e6, True), (2, {"pp": 2}, 20e6, True),
])
def test_cp_sat_matches_brute_force_with_build_peaks(world, mesh, memory, binds):
    """The build/stage rows (added lazily) give the brute-force optimum of max(step, build) ≤ M,
    whether the build peak binds (a slower plan, or none) or not."""
    graph = _tiny_graph()
    cluster, train = synthetic_cluster("cpu", world), TrainSpec(global_batch=4, seq_len=16)
    constraints = Constraints(mesh=mesh, max_memory_bytes=int(memory), memory_headroom=0.0)
    expected = _brute_force(graph, cluster, train, constraints, build_heavy_cost)
    assert (expected > _brute_force(graph, cluster, train, constraints, hashed_cost)) == binds
    if math.isinf(expected):
        with pytest.raises(InfeasibleError, match="build/stage"):
            solve(graph, cluster, train, constraints=constraints, cost_fn=build_heavy_cost, time_limit_s=60)
        return
    plan = solve(graph, cluster, train, constraints=constraints, cost_fn=build_heavy_cost, time_limit_s=60)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.objective == pytest.approx(expected, rel=1e-5)
    assert plan.predictions.build_peak_bytes <= plan.predictions.peak_memory_bytes <= memory + 1


def test_memory_binding_moves_the_optimum():
    graph, cluster, train = _tiny_graph(), synthetic_cluster("cpu", 2), TrainSpec(global_batch=4, seq_len=16)
    loose = solve(graph, cluster, train, constraints=Constraints(max_memory_bytes=10**9, memory_headroom=0.0),
                  cost_fn=hashed_cost)
    tight_limit = int(loose.predictions.peak_memory_bytes * 0.6)
    tight = solve(graph, cluster, train, cost_fn=hashed_cost,
                  constraints=Constraints(max_memory_bytes=tight_limit, memory_headroom=0.0))
    assert tight.predictions.peak_memory_bytes <= tight_limit < loose.predictions.peak_memory_bytes
    assert tight.solver.objective >= loose.solver.objective


# ----------------------------------------------------------------------------- properties of plans
@pytest.fixture(scope="module")
def small():
    graph = synthetic_graph(SyntheticConfig(name="llama-1b", num_blocks=8, hidden=2048, num_heads=16,
                                            ffn_hidden=5632))
    return graph, synthetic_cluster("h100-sxm", 1), TrainSpec(global_batch=64, seq_len=2048)


def test_plan_is_complete_and_deterministic(small):
    graph, cluster, train = small
    a = solve(graph, cluster, train, cost_fn=toy_layer_cost)
    b = solve(graph, cluster, train, cost_fn=toy_layer_cost)
    assert [s.layer for s in a.layers] == [l.name for l in graph.layers]
    assert a.fingerprints.model == graph.fingerprint() and a.fingerprints.cost_model.startswith("custom:")
    assert a.solver.meshes_considered == 14 and 1 <= a.solver.meshes_solved <= 14
    assert a.solver.gap == 0.0 and a.solver.bound == pytest.approx(a.solver.objective)
    assert without_wall_time(a).to_json() == without_wall_time(b).to_json()
    stages = [s.stage for s in a.layers]
    assert stages == sorted(stages) and max(stages) < a.mesh.pp * a.schedule.virtual_stages


def test_tight_memory_forces_zero3(small):
    graph, cluster, train = small
    base = solve(graph, cluster, train, constraints=Constraints(mesh={"tp": 1, "pp": 1, "dp_replicate": 1}),
                 cost_fn=toy_layer_cost)
    assert any(s.state != "zero3" for s in base.layers if s.layer.startswith("blocks."))
    # Room for the activations of one micro-batch plus ZeRO-3 model states only.
    limit = 12 * graph.param_count // 8 + 3 * GiB
    plan = solve(graph, cluster, train, constraints=Constraints(mesh={"tp": 1, "pp": 1, "dp_replicate": 1},
                                                                max_memory_bytes=limit), cost_fn=toy_layer_cost)
    big = [s for s in plan.layers if s.layer.endswith((".attn", ".mlp"))]
    assert {s.state for s in big} == {"zero3"}
    assert plan.predictions.peak_memory_bytes <= limit


def test_pins_respected_and_contradictions_rejected(small):
    graph, cluster, train = small
    pins = {"lm_head": {"state": "zero3", "weight_comm": "fp8"}, "blocks.2.attn": {"recompute": "full"},
            "mlp:2048:5632:3": {"grad_comm": "fp32", "state": "zero1"}}
    plan = solve(graph, cluster, train, constraints=Constraints(pin=pins, mesh={"pp": 1}), cost_fn=toy_layer_cost)
    head = plan.strategy("lm_head")
    assert (head.state, head.weight_comm) == ("zero3", "fp8")
    assert plan.strategy("blocks.2.attn").recompute == "full"
    assert all(s.state == "zero1" and s.grad_comm == "fp32" for s in plan.layers if s.layer.endswith(".mlp"))
    with pytest.raises(AutoshardError, match="contradicts"):
        solve(graph, cluster, train, constraints=Constraints(pin={"blocks.0.attn": {"tp": "megatron"}},
                                                             mesh={"tp": 1}), cost_fn=toy_layer_cost)
    with pytest.raises(InfeasibleError, match="pin/"):  # zero3 needs dp > 1, the mesh leaves dp = 1
        solve(graph, cluster, train, constraints=Constraints(pin={"lm_head": {"state": "zero3"}},
                                                             mesh={"tp": 8}), cost_fn=toy_layer_cost)


def test_infeasible_message_names_family_need_and_relaxations(small):
    graph, cluster, train = small
    with pytest.raises(InfeasibleError) as err:  # 1.25 GiB less the 1 GiB reservation: ~0.24 GiB usable
        solve(graph, cluster, train, constraints=Constraints(max_memory_bytes=5 * 2**28), cost_fn=toy_layer_cost)
    text = str(err.value)
    assert "mem/stage" in text and "GiB" in text and "more devices" in text and "recompute" in text
    need = float(text.split("at least ")[1].split(" GiB")[0])
    usable = float(text.split("memory is ")[1].split(" GiB")[0])
    assert 0 < usable < need  # the smallest plan needs more than what is offered
    with pytest.raises(InfeasibleError) as err:  # a limit below the reservation: say so, never "-0.49 GiB usable"
        solve(graph, cluster, train, constraints=Constraints(max_memory_bytes=2**29), cost_fn=toy_layer_cost)
    assert "below the cost model's fixed reservation of 1.00 GiB" in str(err.value)
    assert "by 0.50 GiB" in str(err.value) and "-0." not in str(err.value)
    with pytest.raises(InfeasibleError, match="tp_divides/vocab"):
        odd = synthetic_graph(SyntheticConfig(name="odd", num_blocks=2, hidden=256, num_heads=8, vocab=1001))
        solve(odd, cluster, train, constraints=Constraints(mesh={"tp": 2}), cost_fn=toy_layer_cost)


@pytest.mark.slow
def test_hint_is_accepted_and_retargets(small):
    graph, cluster, train = small
    plan = solve(graph, cluster, train, cost_fn=toy_layer_cost)
    again = solve(graph, cluster, train, hint=plan, cost_fn=toy_layer_cost)
    assert again.layers == plan.layers and again.mesh == plan.mesh
    bigger = synthetic_cluster("h100-sxm", 2)
    moved = solve(graph, bigger, TrainSpec(global_batch=64, seq_len=2048), hint=plan, cost_fn=toy_layer_cost)
    assert moved.mesh.world_size == 16


def test_explain_and_diff(small):
    graph, cluster, train = small
    plan = solve(graph, cluster, train, constraints=Constraints(mesh={"pp": 1}), cost_fn=toy_layer_cost)
    expl = explain_layer(plan, graph, cluster, train, "blocks.1.mlp", k=50, cost_fn=toy_layer_cost)
    assert expl.chosen == plan.strategy("blocks.1.mlp") and expl.num_layers_in_class == graph.num_blocks
    assert expl.step_s == pytest.approx(plan.solver.objective, rel=1e-9)
    fitting = [a for a in expl.alternatives if a.over_memory_bytes == 0]
    assert all(a.delta_s >= -1e-12 for a in fitting)  # the plan is optimal: nothing that fits is faster
    assert [a.step_s for a in fitting] == sorted(a.step_s for a in fitting)
    assert all(a.reason.startswith("+") or ("ties" in a.reason) for a in fitting)
    tight = Constraints(mesh={"pp": 1}, max_memory_bytes=int(plan.predictions.peak_memory_bytes * 1.0) + 1,
                        memory_headroom=0.0)
    over = explain_layer(plan, graph, cluster, train, "blocks.1.attn", k=100, cost_fn=toy_layer_cost,
                         constraints=tight).alternatives
    assert any(a.reason.startswith("needs ") and "usable" in a.reason and a.over_memory_bytes > 0 for a in over)
    other = solve(graph, cluster, train, constraints=Constraints(mesh={"tp": 2, "pp": 1}), cost_fn=toy_layer_cost)
    diff = diff_plans(plan, other)
    assert not diff.identical and ("tp", plan.mesh.tp, 2) in diff.mesh
    assert any(f[0] == "tp" for change in diff.layers for f in change.fields)
    assert diff_plans(plan, plan).identical
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(format_explanation(expl))
    console.print(format_diff(diff))
    text = console.export_text()
    assert "why it lost" in text and "tp 1 → 2" in text.replace(f"tp {plan.mesh.tp} → 2", "tp 1 → 2")


# ----------------------------------------------------------------------------- textbook rediscovery (real cost model)
def _blocks(plan, suffix):
    return [s for s in plan.layers if s.layer.startswith("blocks.") and s.layer.endswith(suffix)]


def test_textbook_small_model_big_batch_is_pure_data_parallel():
    graph = synthetic_graph(SyntheticConfig(name="gpt-125m", num_blocks=12, hidden=768, num_heads=12,
                                            vocab=50304, gated_mlp=False))
    plan = solve(graph, synthetic_cluster("h100-sxm", 1), TrainSpec(global_batch=256, seq_len=1024))
    assert (plan.mesh.tp, plan.mesh.pp, plan.mesh.dp) == (1, 1, 8)
    assert {s.tp for s in plan.layers} == {"none"}
    # DDP or ZeRO-1: ZeRO-3 moves 1.5× the bytes (and per micro-batch), and hidden comm is not free.
    assert {s.state for s in _blocks(plan, (".attn", ".mlp"))} <= {"replicate", "zero1"}
    assert {s.recompute for s in _blocks(plan, (".attn", ".mlp"))} == {"none"}


@pytest.fixture(scope="module")
def llama13b_two_nodes():
    graph = synthetic_graph(SyntheticConfig(name="llama-13b", num_blocks=40, hidden=5120, num_heads=40,
                                            ffn_hidden=13824))
    return graph, synthetic_cluster("h100-sxm", 2), TrainSpec(global_batch=256, seq_len=2048)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_textbook_states_that_do_not_fit_replicated_are_sharded(llama13b_two_nodes):
    graph, cluster, train = llama13b_two_nodes
    assert 16 * graph.param_count > cluster.device.memory_bytes  # replicated model states cannot fit
    plan = solve(graph, cluster, train)
    # Free mesh (docs/search.md, "Textbook answers"): no rank holds replicated optimizer states; the
    # honest optimum splits the model over 2 pipeline stages across the nodes (no recompute needed)
    # rather than gathering ZeRO-3 weights every micro-batch over the inter-node links.
    assert "replicate" not in {s.state for s in _blocks(plan, (".attn", ".mlp"))}
    assert plan.mesh.pp == 1 or plan.mesh.dp_shard * plan.mesh.dp_replicate * plan.mesh.tp <= cluster.devices_per_node
    # Without pipelining, model states are fully sharded: ZeRO-3 inside the node, replicated across (HSDP).
    flat = solve(graph, cluster, train, constraints=Constraints(mesh={"tp": 1, "pp": 1}))
    assert {s.state for s in _blocks(flat, (".attn", ".mlp"))} <= {"zero3", "offload"}
    assert flat.mesh.dp_replicate > 1 and flat.mesh.dp_shard <= cluster.devices_per_node
    assert flat.predictions.step_time_s >= plan.predictions.step_time_s


def test_textbook_layer_too_large_for_one_gpu_uses_tp_inside_node():
    graph = synthetic_graph(SyntheticConfig(name="wide", num_blocks=2, hidden=49152, num_heads=64,
                                            ffn_hidden=4 * 49152, vocab=32768))
    cluster = synthetic_cluster("h100-sxm", 2)
    mlp_bytes = 2 * graph.layer("blocks.0.mlp").param_count
    assert mlp_bytes > cluster.device.memory_bytes / 2
    plan = solve(graph, cluster, TrainSpec(global_batch=16, seq_len=1024))
    assert 1 < plan.mesh.tp <= cluster.devices_per_node
    assert {s.tp for s in _blocks(plan, ".mlp")} == {"megatron"}


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_textbook_moe_uses_expert_parallelism():
    # 16 Mixtral blocks on 8 H100: without EP the experts' bf16 weights alone (~45 GB) need ZeRO-3, which
    # gathers every expert again each micro-batch; EP holds one expert per rank (whole states, the form the
    # runtime builds: ep_runs/state) and moves tokens instead.
    graph = synthetic_graph(dataclasses.replace(MIXTRAL_8X7B, num_blocks=16))
    cluster, train = synthetic_cluster("h100-sxm", 1), TrainSpec(global_batch=128, seq_len=4096)
    plan = solve(graph, cluster, train)
    assert plan.mesh.ep > 1
    assert {(s.ep, s.state, s.tp) for s in _blocks(plan, ".mlp")} == {(True, "replicate", "none")}
    without = solve(graph, cluster, train, constraints=Constraints(mesh={"ep": 1}))
    assert {s.state for s in _blocks(without, ".mlp")} == {"zero3"}
    assert without.predictions.step_time_s > plan.predictions.step_time_s


def test_textbook_slow_inter_node_links_avoid_cross_node_traffic():
    graph = synthetic_graph(SyntheticConfig(name="llama-3b", num_blocks=8, hidden=3072, num_heads=24,
                                            ffn_hidden=8192))
    train = TrainSpec(global_batch=64, seq_len=2048, comm_precision="auto")  # quantized wires allowed
    fast = solve(graph, synthetic_cluster("h100-sxm", 2), train, constraints=Constraints(mesh={"tp": 1, "pp": 1}))
    slow_cluster = synthetic_cluster("h100-sxm", 2, inter_node_bandwidth=0.5e9)
    slow = solve(graph, slow_cluster, train, constraints=Constraints(mesh={"tp": 1, "pp": 1}))
    big = _blocks(slow, (".attn", ".mlp"))
    hsdp = slow.mesh.dp_replicate > 1 and slow.mesh.dp_shard <= slow_cluster.devices_per_node
    quantized = any(s.weight_comm != "bf16" or s.grad_comm in ("int8", "int4") for s in big)
    assert hsdp or quantized
    assert diff_plans(fast, slow).layers or diff_plans(fast, slow).mesh


# ----------------------------------------------------------------------------- solver objective == predict
@pytest.mark.parametrize("mesh, limit_gib, schedule", [({"pp": 2, "tp": 1}, None, None), ({"pp": 2, "tp": 2}, 10.5, None),
                                                      ({"pp": 2, "tp": 1}, None, "1f1b")])
def test_objective_and_memory_equal_predict(small, mesh, limit_gib, schedule):
    """The CP-SAT objective, the float evaluation and ``cost_model.predict`` agree: stage-boundary
    send/recv, per-rank gather-buffer maximum and checkpoint regions are in all three. Memory is equal
    too, except that ``predict`` replays an interleaved schedule's order where the search keeps the
    order-free bound: there the search's is never below ``predict``'s (docs/cost-model.md)."""
    graph, cluster, _ = small
    train = TrainSpec(global_batch=64, seq_len=4096)
    limit = None if limit_gib is None else int(limit_gib * GiB)
    plan = solve(graph, cluster, train, constraints=Constraints(mesh=mesh, max_memory_bytes=limit, schedule=schedule))
    assert plan.mesh.pp == 2
    table = CostTable(cost_model.layer_cost, cluster, train)
    options = [table.option(l, plan.strategy(l.name), plan.mesh, plan.schedule) for l in graph.layers]
    ev = evaluate(options, [plan.strategy(l.name).stage for l in graph.layers], plan.mesh, plan.schedule,
                  chain_flags(graph))
    pred = cost_model.predict(graph, plan, cluster, train)
    assert pred.step_time_s == pytest.approx(plan.solver.objective, rel=1e-9)
    assert pred.step_time_s == pytest.approx(ev.step_s, rel=1e-9)
    # predict reports allocated bytes, as the solver's memory rows (headroom is in the limit)
    if plan.schedule.virtual_stages > 1:
        assert all(p <= e * (1 + 1e-9) for p, e in zip(pred.memory_by_stage, ev.rank_memory_bytes))
        assert pred.peak_memory_bytes <= ev.peak_memory_bytes * (1 + 1e-9)
    else:
        assert pred.peak_memory_bytes == pytest.approx(ev.peak_memory_bytes, rel=1e-9)
        assert [m for m in pred.memory_by_stage] == pytest.approx(list(ev.rank_memory_bytes), rel=1e-9)
    if limit is not None:
        assert pred.peak_memory_bytes <= limit


def test_full_recompute_region_counts_one_input_per_block(small):
    """A block under full recompute keeps only its first layer's input (Korthikanti's 2sbh)."""
    graph, cluster, _ = small
    train = TrainSpec(global_batch=64, seq_len=2048)
    plan = solve(graph, cluster, train, constraints=Constraints(
        mesh={"tp": 1, "pp": 1, "dp_replicate": 1}, pin={l.name: {"recompute": "full", "state": "zero3"}
                                                         for l in graph.layers if l.block is not None}))
    table = CostTable(cost_model.layer_cost, cluster, train)
    options = [table.option(l, plan.strategy(l.name), plan.mesh, plan.schedule) for l in graph.layers]
    stages = [0] * len(graph.layers)
    chained = evaluate(options, stages, plan.mesh, plan.schedule, chain_flags(graph))
    alone = evaluate(options, stages, plan.mesh, plan.schedule)
    first = [l for l in graph.layers if l.block is not None and not chain_flags(graph)[l.index]]
    kept = sum(plan.schedule.micro_batch * train.seq_len * l.input_bytes_per_token for l in first)
    acts = chained.rank_memory_bytes[0] - (alone.rank_memory_bytes[0] - sum(o.activation_bytes for o in options))
    assert len(first) == graph.num_blocks and kept < sum(o.activation_bytes for o in options)
    assert acts == pytest.approx(kept + sum(o.activation_bytes for o, l in zip(options, graph.layers)
                                            if l.block is None), rel=1e-9)
    pred = cost_model.predict(graph, plan, cluster, train)
    assert pred.peak_memory_bytes == pytest.approx(chained.peak_memory_bytes, rel=1e-9)


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_with_named_values(small):
    graph, cluster, train = small
    with pytest.raises(AutoshardError, match="global_batch=0"):
        solve(graph, cluster, TrainSpec(global_batch=0, seq_len=2048))
    with pytest.raises(InfeasibleError, match=r"batch_divides/dp.*global_batch=7"):
        solve(graph, cluster, TrainSpec(global_batch=7, seq_len=2048), constraints=Constraints(mesh={"tp": 1, "pp": 1}))
    odd_heads = synthetic_graph(SyntheticConfig(name="odd-heads", num_blocks=2, hidden=768, num_heads=12))
    with pytest.raises(InfeasibleError, match="tp_divides/heads") as err:
        solve(odd_heads, cluster, train, constraints=Constraints(mesh={"tp": 8}), cost_fn=toy_layer_cost)
    assert "relax" in str(err.value)


def test_cluster_too_small_names_need_device_memory_and_relaxations():
    graph = synthetic_graph(GPT_1T)
    cluster = synthetic_cluster("h100-sxm", 1)
    with pytest.raises(InfeasibleError) as err:
        solve(graph, cluster, TrainSpec(global_batch=64, seq_len=2048))
    text = str(err.value)
    need = float(text.split("at least ")[1].split(" GiB")[0])
    device = cluster.device.memory_bytes / GiB
    assert "mem/stage" in text and f"{device:.2f} GiB" in text
    assert need > device  # the smallest plan needs more than one device holds
    assert "more devices" in text and "offload" in text and "recompute='full'" in text


@pytest.mark.parametrize("mesh", [{}, {"pp": 2}])
def test_heuristic_incumbent_is_an_upper_bound_and_never_changes_the_plan(small, mesh, monkeypatch):
    from autoshard.search import incumbent

    graph, cluster, train = small
    constraints = Constraints(mesh=mesh)
    seen, upper_bound = [], incumbent.upper_bound
    monkeypatch.setattr(incumbent, "upper_bound", lambda *a: seen.append(upper_bound(*a)) or seen[-1])
    with_upper = solve(graph, cluster, train, constraints=constraints)
    monkeypatch.setattr(incumbent, "upper_bound", lambda *a: math.inf)
    without = solve(graph, cluster, train, constraints=constraints)
    finite = [u for u in seen if math.isfinite(u)]
    assert finite and min(finite) >= with_upper.solver.objective * (1 - 1e-9)
    assert with_upper.solver.status == without.solver.status == "OPTIMAL"
    assert without_wall_time(with_upper).to_json() == without_wall_time(without).to_json()


def test_prefix_memory_rows_bound_every_candidate_and_see_the_first_stage(small):
    """``bounds.py``: with prefix rows the table bound stays ≤ each candidate's CP-SAT optimum and the
    memory bound ≤ its peak, and the first stages' in-flight micro-batches make the memory bound of a
    deep pipeline larger than the all-rank row (least in-flight count) alone."""
    from autoshard.search import bounds, solver
    from autoshard.search.cpsat_model import ModelInput, block_members, solve_model
    from autoshard.search.evaluate import anchor_blocks, num_anchor_blocks

    graph, cluster, _ = small
    # Without the loss over the vocabulary: its T·V·12 bytes on the last stage (one micro-batch in
    # flight under 1F1B) would set the all-rank row, and this test is about the first stages.
    graph = dataclasses.replace(graph, layers=tuple(dataclasses.replace(l, vocab=None) for l in graph.layers))
    train = TrainSpec(global_batch=64, seq_len=4096)
    constraints = Constraints(mesh={"pp": 4, "tp": 2}, max_memory_bytes=int(12 * GiB))
    search = solver._new_search(graph, cluster, train, constraints, cost_model.layer_cost)
    meshes = enumerate_meshes(graph, cluster, train, constraints.mesh).meshes
    candidates, _ = solver._candidates(search, meshes, constraints, cost_model.layer_cost)
    anchors, num_blocks = anchor_blocks(graph), num_anchor_blocks(graph)
    tighter, solved = 0, 0
    for cand in [c for c in candidates if c.schedule.name == "1f1b"][:4]:
        options = solver._class_options(search, cand)
        time_lb, mem_lb = solver._table_bounds(search, cand, options)
        all_ranks = bounds.memory_rows(search.class_of_layer, anchors, chain_flags(graph), num_blocks,
                                       len(search.classes), cand.mesh, cand.schedule, prefix=False)
        _, mem_all = bounds.table_bounds(options, solver._layer_counts(search), all_ranks, cand.mesh,
                                         cand.schedule, float(search.cap_bytes))
        tighter += mem_lb > mem_all * 1.05
        inp = ModelInput(classes=search.classes, options=options,
                         block_classes=block_members(anchors, search.class_of_layer, num_blocks),
                         block_chain=block_members(anchors, chain_flags(graph), num_blocks),
                         mesh=cand.mesh, schedule=cand.schedule, cap_bytes=search.cap_bytes, unit_s=1e-8)
        result = solve_model(inp, time_limit_s=30, num_workers=2)
        if result.status != "OPTIMAL":
            assert result.status == "INFEASIBLE"
            continue
        solved += 1
        layer_options = [options[c][result.choice[c]] for c in search.class_of_layer]
        ev = evaluate(layer_options, layer_stages(graph, result.block_stage), cand.mesh, cand.schedule,
                      chain_flags(graph))
        assert time_lb <= ev.step_s * (1 + 1e-9) and mem_lb <= ev.peak_memory_bytes * (1 + 1e-9)
    assert solved >= 1 and tighter >= 1


def test_explain_durations_keep_near_ties_visible():
    from autoshard.search.explain import format_duration

    assert format_duration(2.5) == "2.5 s" and format_duration(0.0123) == "12.3 ms"
    assert format_duration(4.2e-6) == "4.2 µs" and format_duration(3e-9) == "3 ns"
    assert format_duration(-1.5e-4) == "-150 µs" and format_duration(0.0) == "0 ns"


# ----------------------------------------------------------------------------- exact by default
def _quantized(plan) -> set[str]:
    return {s.layer for s in plan.layers if s.weight_comm != "bf16" or s.grad_comm != "bf16"}


def test_default_plans_move_exact_values_and_auto_may_quantize():
    """``TrainSpec.comm_precision``: ``"exact"`` (default) never chooses a lossy wire; on slow links
    ``"auto"`` does; a pin that names one is honoured either way."""
    graph = synthetic_graph(SyntheticConfig(name="llama-3b", num_blocks=8, hidden=3072, num_heads=24,
                                            ffn_hidden=8192))
    cluster = synthetic_cluster("h100-sxm", 2, inter_node_bandwidth=0.5e9)
    constraints = Constraints(mesh={"tp": 1, "pp": 1})
    exact = solve(graph, cluster, TrainSpec(global_batch=64, seq_len=2048), constraints=constraints)
    auto = solve(graph, cluster, TrainSpec(global_batch=64, seq_len=2048, comm_precision="auto"),
                 constraints=constraints)
    assert not _quantized(exact)
    assert _quantized(auto)
    pinned = solve(graph, cluster, TrainSpec(global_batch=64, seq_len=2048), constraints=Constraints(
        mesh={"tp": 1, "pp": 1}, pin={"blocks.0.mlp": {"state": "zero3", "grad_comm": "int8"}}))
    assert _quantized(pinned) == {"blocks.0.mlp"}
    with pytest.raises(AutoshardError, match="comm_precision"):
        TrainSpec(global_batch=64, seq_len=2048, comm_precision="lossy")


@pytest.mark.parametrize("memory, offloads", [(20e6, True), (25e6, False)])
def test_offload_only_when_nothing_else_fits(memory, offloads):
    """Offload only for a model that fits no other way: at 25 MB a (slower, under this synthetic cost)
    plan fits without it and is chosen; at 20 MB nothing does, and offload is used."""
    graph, cluster, train = _tiny_graph(), synthetic_cluster("cpu", 2), TrainSpec(global_batch=4, seq_len=16)
    constraints = Constraints(mesh={"pp": 2}, max_memory_bytes=int(memory), memory_headroom=0.0)
    plan = solve(graph, cluster, train, constraints=constraints, cost_fn=hashed_cost, time_limit_s=60)
    assert any(s.state == "offload" for s in plan.layers) == offloads
    assert plan.solver.objective == pytest.approx(_brute_force(graph, cluster, train, constraints, hashed_cost),
                                                  rel=1e-5)


def test_infeasible_error_never_cites_a_bound_below_the_usable_memory():
    from types import SimpleNamespace

    from autoshard.search.solver import _infeasible_error

    cluster = synthetic_cluster("h100-sxm", 1)
    search = SimpleNamespace(min_memory_bytes=70 * 2**30, min_memory_where="mesh tp=2", cap_bytes=74 * 2**30,
                             cluster=cluster, statuses=["INFEASIBLE", "INFEASIBLE"])
    text = str(_infeasible_error(search, Constraints()))
    assert "needs is at least" not in text and "proved the 2 candidate(s)" in text
    search.min_memory_bytes = 90 * 2**30
    assert "needs is at least 90.00 GiB" in str(_infeasible_error(search, Constraints()))
