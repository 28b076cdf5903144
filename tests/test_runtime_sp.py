"""Megatron sequence parallelism (sp=True on the tp axis) equals single-device training; its graph has SP collectives.

Numerics: one gloo job per world size (tests/_runtime_cases.py: 3 SGD steps,
2 micro-batches, clipping; losses and full parameters at rtol 1e-5). Structure:
under a fake process group, the rewritten graph has reduce-scatters instead of
all-reduces and all-gathers before every column-parallel consumer.
"""

from __future__ import annotations

import functools

import pytest

from _harness import fake_world, run_gloo_cases
from _runtime_cases import check_against_reference, graph_of, make_plan, single_device, train_case
from autoshard.models import build
from autoshard.passes import insert_collectives as ic
from autoshard.plan import Mesh
from autoshard.runtime import build_program
from autoshard.train import TrainSpec

GPT, LLAMA = "gpt:tiny", "llama:tiny"


def _sp_all(_layer):
    return {"tp": "megatron", "sp": True}


def _sp_mlp_only(layer):
    # attention all-reduces (replicate), MLP reduce-scatters: the residual stream switches layout twice a block
    return {"tp": "megatron", "sp": not layer.endswith("attn")}


def _sp_zero3(_layer):
    return {"tp": "megatron", "sp": True, "state": "zero3"}


def _sp_mixed_states(layer):
    return {"tp": "megatron", "sp": True, "state": "zero1" if "norm" in layer else "replicate"}


CASES_2 = {
    "sp_gpt": (GPT, Mesh(tp=2), _sp_all),  # position embedding scattered, layer-norm and row biases partial
    "sp_llama": (LLAMA, Mesh(tp=2), _sp_all),
    "sp_gpt_mlp_only": (GPT, Mesh(tp=2), _sp_mlp_only),
}
CASES_4 = {
    "sp_llama_dp2_zero3": (LLAMA, Mesh(dp_shard=2, tp=2), _sp_zero3),
    "sp_gpt_dp2_mixed": (GPT, Mesh(dp_shard=2, tp=2), _sp_mixed_states),
}


def _run(cases, world_size):
    jobs = {
        name: functools.partial(train_case, spec=spec, graph=graph_of(spec), plan=make_plan(spec, mesh, choose))
        for name, (spec, mesh, choose) in cases.items()
    }
    return run_gloo_cases(jobs, world_size, timeout_s=400)


@pytest.fixture(scope="module")
def references():
    return {spec: single_device(spec) for spec in (GPT, LLAMA)}


@pytest.fixture(scope="module")
def results2():
    return _run(CASES_2, 2)


@pytest.fixture(scope="module")
def results4():
    return _run(CASES_4, 4)


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_sp_world2(results2, references, name):
    spec, mesh, _ = CASES_2[name]
    check_against_reference(results2[name], references[spec], mesh)


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_sp_dp_world4(results4, references, name):
    spec, mesh, _ = CASES_4[name]
    check_against_reference(results4[name], references[spec], mesh)


def _targets(spec, choose, mesh=Mesh(tp=2)):
    plan = make_plan(spec, mesh, choose)
    with fake_world(mesh.world_size, 0):
        program = build_program(build(spec), graph_of(spec), plan, TrainSpec(global_batch=8, seq_len=8, precision="fp32"))
    return [n for n in program.gm.graph.nodes if n.op == "call_function"]


def test_sp_graph_replaces_all_reduces():
    nodes = _targets(LLAMA, _sp_all)
    count = lambda fn: sum(n.target is fn for n in nodes)  # noqa: E731
    blocks = 2
    assert count(ic.sp_reduce_scatter) == 2 * blocks + 1  # o + down per block, + embedding
    assert count(ic.sp_gather) == 2 * blocks + 1  # q/k/v and gate/up share one gather per block half, + head
    assert count(ic.sp_gather_replicated) == 1  # the value output
    assert not any("reduce_from_tp" in str(n.target) for n in nodes)
    wrapped = {n.meta["autoshard"].get("param") for n in nodes if n.meta.get("autoshard", {}).get("table_key") == ("param", "seq_shard")}
    assert wrapped == {"blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight", "blocks.1.attn_norm.weight",
                       "blocks.1.mlp_norm.weight", "norm.weight", "value_head.weight", "value_head.bias"}


def test_sp_off_keeps_megatron_graph():
    nodes = _targets(LLAMA, lambda _layer: {"tp": "megatron"})
    assert not any(n.target in ic._SP_FNS for n in nodes)
    assert sum("reduce_from_tp" in str(n.target) for n in nodes) == 2 * 2 + 1
