"""``build_program(options=BuildOptions(compile=True))``: the per-rank graph through ``torch.compile`` trains as the eager one.

One gloo job (world 2, llama:tiny, fp32, 3 SGD steps of 2 micro-batches, clipping on):
a DP plan (replicate + ZeRO-1), a Megatron TP 2 plan and a TP 2 + SP plan, whose graphs hold
``autoshard::`` collectives, each compiled and eager; losses and trained shards must agree (fp32, 1e-5).
The plans compile with the default regions (``"stem"``); the DP plan also as one whole graph
(``regions="graph"``). Per-block regions
give gradients block by block: when the head's gradient is accumulated, the first
block's is not there yet, as in eager; the whole graph hands them all over at once.
ZeRO-3 plans compile as one joint forward+backward graph (``passes/_zero3.py`` note "compiled
gather"): an all-ZeRO-3 plan and a mixed one (ZeRO-3 MLPs with full recompute, ZeRO-2 attention with
selective recompute, replicated norms, int8 weight gathers on the head) train as eager. Their AOT
graphs are inspected: the forward keeps no gathered weight for backward, the backward graph
re-gathers (functional all-gathers) and reduce-scatters; with ``reshard_after_forward`` off the
weights are kept and backward gathers nothing. With one micro-batch, a compiled DP plan all-reduces its replicated
parameters' gradients in the backward graph and gathers its ZeRO-1/2 layers in the forward graph
(kept for backward, gradients reduce-scattered there), and trains as eager.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

import pytest
import torch

from _harness import run_gloo_cases
from _tiers import FULL, full, sample
from _runtime_cases import RecordGraphs, functional_ops, graph_of, make_plan, reassemble, train_case
from autoshard.errors import PlanError
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime import BuildOptions, build_program
from autoshard.train import TrainSpec

# inductor's CPU backend compiles C++: without a compiler there is nothing to test here
pytestmark = [
    pytest.mark.slow,  # spawned gloo ranks
    pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++")),
                       reason="torch.compile's CPU backend needs a C++ compiler"),
]

SPEC = "llama:tiny"
ALL_PLANS = {
    "dp": (Mesh(dp_shard=2), lambda name: {"state": "zero1" if name.endswith("mlp") else "replicate"}),
    "tp2": (Mesh(tp=2), lambda name: {"state": "replicate", "tp": "megatron"}
            if name.endswith(("attn", "mlp")) else {"state": "replicate"}),
    # sequence parallel: the residual stream is seq-sharded, SP all-gathers/reduce-scatters in the graph
    "tp2_sp": (Mesh(tp=2), lambda _name: {"state": "replicate", "tp": "megatron", "sp": True}),
    "zero3": (Mesh(dp_shard=2), lambda _name: {"state": "zero3"}),
    "mixed": (Mesh(dp_shard=2), lambda name: _mixed(name)),
}


# inductor compiles C++ on the CPU (tens of seconds per program on 2 cores): these plans run aot_eager
# (the same joint graph and partition, no code generation) to keep CI short; inductor's own numerics
# are covered by tests/test_compile_numerics.py (tied GPT, selective recompute) and the pipeline stages
BACKENDS = dict.fromkeys(ALL_PLANS, "aot_eager")

# `make test` (tests/_tiers.py): TP 2 + SP runs every path of TP 2; the mixed plan every path of all-ZeRO-3
# (and tests/test_compile_numerics.py compiles ZeRO-3 plans); the whole-graph DP compile, the "stem"/"graph"
# gradient orders and ZeRO-3 without resharding are `make test-full`'s
PLANS = sample(ALL_PLANS, ("dp", "tp2_sp", "mixed"))
ORDERS = sample({"eager": True, "block": True, "stem": False, "graph": False}, ("eager", "block"))


def _mixed(name: str) -> dict:
    if name.endswith("mlp"):
        return {"state": "zero3", "recompute": "full"}
    if name.endswith("attn"):
        return {"state": "zero2", "recompute": "selective"}
    if name == "head":
        return {"state": "zero3", "weight_comm": "int8"}
    return {"state": "replicate" if "norm" in name else "zero3"}


@pytest.fixture(scope="module")
def results():
    jobs = {}
    for name, (mesh, choose) in PLANS.items():
        plan = make_plan(SPEC, mesh, choose)
        jobs[f"{name}_eager"] = functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=plan)
        jobs[f"{name}_compiled"] = functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=plan,
                                                     compile_graph=True, compile_backend=BACKENDS.get(name, "inductor"))
    mesh, choose = PLANS["dp"]
    if FULL:
        jobs["dp_compiled_graph"] = functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC),
                                                      plan=make_plan(SPEC, mesh, choose), compile_graph=True,
                                                      compile_regions="graph", compile_backend="aot_eager")
    for mode in ORDERS:
        jobs[f"order_{mode}"] = functools.partial(_gradient_order, mode=mode)
    one = _one_micro_batch(make_plan(SPEC, Mesh(dp_shard=2), _dp_states))
    jobs["dp_m1_eager"] = functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=one)
    # aot_eager: the same joint graph and partition as inductor, without its code generation (CI time)
    jobs["dp_m1_compiled"] = functools.partial(train_case, spec=SPEC, graph=graph_of(SPEC), plan=one, compile_graph=True,
                                               compile_backend="aot_eager")
    jobs["dp_m1_graphs"] = _grad_sync_graphs
    for keep in (False, True) if FULL else (False,):
        jobs[f"graphs_keep{keep}"] = functools.partial(_zero3_graphs, keep=keep)
    return run_gloo_cases(jobs, 2, timeout_s=1200)


@pytest.mark.parametrize("name", list(PLANS))
def test_compiled_graph_trains_as_eager(results, name):
    eager, compiled = results[f"{name}_eager"], results[f"{name}_compiled"]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6)
        for fqn in b["shards"]:
            torch.testing.assert_close(a["shards"][fqn], b["shards"][fqn], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn: f"{name} {fqn}: {m}")


@full
def test_whole_graph_compile_trains_as_eager(results):
    for a, b in zip(results["dp_compiled_graph"], results["dp_eager"]):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6)
        for fqn in b["shards"]:
            torch.testing.assert_close(a["shards"][fqn], b["shards"][fqn], rtol=1e-5, atol=1e-6)
    assert all(r["compiled"] for r in results["dp_compiled_graph"])


def _gradient_order(rank, world_size, mode):
    """Whether block 0's gradient is still missing when the head's gradient is accumulated (one backward)."""
    mesh, choose = PLANS["dp"]
    plan = make_plan(SPEC, mesh, choose)
    program = build_program(build(SPEC), graph_of(SPEC), plan, TrainSpec(global_batch=8, seq_len=8),
                            # where dynamo cuts the graph; no code generation needed
                            options=BuildOptions(compile=mode != "eager", regions="graph" if mode == "eager" else mode,
                                                 backend="aot_eager"))
    params = dict(program.gm.named_parameters())
    first = params["blocks.0.attn.q.weight"]
    seen = []
    params["head.weight"].register_post_accumulate_grad_hook(lambda _p: seen.append(first.grad is None))
    tokens = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(rank))
    program.forward(tokens)[0].float().pow(2).mean().backward()
    return seen


@pytest.mark.parametrize("mode, incremental", list(ORDERS.items()))
def test_block_regions_hand_over_gradients_block_by_block(results, mode, incremental):
    assert all(r == [incremental] for r in results[f"order_{mode}"])


def _dp_states(name: str) -> dict:
    """replicate norms, ZeRO-1 attention, ZeRO-2 MLPs and the rest (embedding, head, value head)."""
    if name.endswith("attn"):
        return {"state": "zero1"}
    if name.endswith("mlp"):
        return {"state": "zero2"}
    return {"state": "replicate" if "norm" in name else "zero2"}


def _one_micro_batch(plan):
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, num_micro_batches=1))


def _grad_sync_graphs(rank, world_size):
    """One micro-batch, compiled: the DDP / ZeRO-1/2 gradient all-reduces are backward graph nodes."""
    plan = _one_micro_batch(make_plan(SPEC, Mesh(dp_shard=2), _dp_states))
    graphs = RecordGraphs()
    program = build_program(build(SPEC), graph_of(SPEC), plan, TrainSpec(global_batch=8, seq_len=8),
                            options=BuildOptions(compile=True, backend=graphs.backend, regions="graph"))
    tokens = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(rank))
    program.forward(tokens)[0].float().pow(2).mean().backward()
    (fw,), (bw,) = graphs.forward, graphs.backward
    placements = program.param_placements
    replicated = [fqn for fqn, p in placements.items() if p.state == "replicate"]
    gathered = {p.layer for p in placements.values() if p.state in ("zero1", "zero2")}
    return {"replicated": len(replicated), "gathered_layers": len(gathered),
            "in_graph": sorted(f for f, s in program.optimizer.slots.items() if s.reduced_in_graph),
            "sharded": all(placements[f].dp_dim == 0 for f in placements if placements[f].state != "replicate"),
            "forward": functional_ops(fw), "backward": functional_ops(bw)}


def test_one_micro_batch_reduces_gradients_in_the_backward_graph(results):
    for r in results["dp_m1_graphs"]:
        # replicated (DDP) parameters: one all-reduce each in backward
        assert len(r["in_graph"]) == r["replicated"] > 0
        assert "all_reduce" not in r["forward"]
        assert r["backward"].get("all_reduce") == r["replicated"]
        # ZeRO-1/2 layers (passes/context.py note "compiled ZeRO-1/2"): held as shards, gathered once in
        # forward and kept, their gradients reduce-scattered in backward
        assert r["sharded"]
        assert r["forward"].get("all_gather_into_tensor") == r["gathered_layers"]
        assert "all_gather_into_tensor" not in r["backward"]
        assert r["backward"].get("reduce_scatter_tensor") == r["gathered_layers"]


def test_one_micro_batch_compiled_trains_as_eager(results):
    """Same losses and trained parameters (reassembled: the compiled ZeRO-1/2 layers are dim-0 shards)."""
    compiled, eager = results["dp_m1_compiled"], results["dp_m1_eager"]
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=1e-6)
    full_a, full_b = reassemble(compiled, Mesh(dp_shard=2)), reassemble(eager, Mesh(dp_shard=2))
    for fqn in full_b:
        torch.testing.assert_close(full_a[fqn], full_b[fqn], rtol=1e-5, atol=1e-6, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    assert all(r["compiled"] for r in compiled)


def _zero3_graphs(rank, world_size, keep):
    """One ZeRO-3 forward/backward through AOT autograd: collective counts and the shapes forward saves."""
    from autoshard.passes._zero3 import Zero3Gather

    plan = make_plan(SPEC, Mesh(dp_shard=2), lambda _name: {"state": "zero3"})
    graphs = RecordGraphs()
    program = build_program(build(SPEC), graph_of(SPEC), plan, TrainSpec(global_batch=8, seq_len=8),
                            options=BuildOptions(compile=True, backend=graphs.backend, regions="graph"))
    gathers = [m for m in program.gm.modules() if isinstance(m, Zero3Gather)]
    for m in gathers:
        m.reshard_after_forward = not keep
    tokens = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(rank))
    program.forward(tokens)[0].float().pow(2).mean().backward()
    full_shapes = {tuple(p.global_shape) for p in program.param_placements.values()}
    shard_shapes = {tuple(p.local_shape) for p in program.param_placements.values()}
    (fw,), (bw,) = graphs.forward, graphs.backward
    saved = [n.meta["val"] for n in next(n for n in fw.graph.nodes if n.op == "output").args[0][1:]
             if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    return {"layers": len(gathers), "forward": functional_ops(fw), "backward": functional_ops(bw),
            "saved_full": sum(tuple(t.shape) in full_shapes - shard_shapes for t in saved)}


def test_zero3_regathers_in_the_backward_graph(results):
    for r in results["graphs_keepFalse"]:
        assert r["forward"].get("all_gather_into_tensor") == r["layers"]
        assert r["backward"].get("reduce_scatter_tensor") == r["layers"]
        # every layer but the embedding (its backward needs no weight) is gathered again in backward
        assert r["backward"].get("all_gather_into_tensor") == r["layers"] - 1
        assert r["saved_full"] == 0


@full
def test_zero3_without_reshard_keeps_gathered_weights(results):
    for r in results["graphs_keepTrue"]:
        assert r["forward"].get("all_gather_into_tensor") == r["layers"]
        assert r["backward"].get("reduce_scatter_tensor") == r["layers"]
        assert "all_gather_into_tensor" not in r["backward"]
        assert r["saved_full"] > 0


@pytest.mark.parametrize("name", list(PLANS))
def test_compiled_cases_ran_compiled(results, name):
    assert all(r["compiled"] for r in results[f"{name}_compiled"])
    assert not any(r["compiled"] for r in results[f"{name}_eager"])
