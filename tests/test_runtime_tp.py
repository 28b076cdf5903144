"""Megatron TP (column/row pairs, vocab-parallel embedding and head, GQA) alone and mixed with ZeRO equal single-device training."""

from __future__ import annotations

import functools

import pytest

from _harness import run_gloo_cases
from _runtime_cases import check_against_reference, graph_of, make_plan, single_device, train_case
from autoshard.plan import Mesh

pytestmark = pytest.mark.slow  # spawned gloo ranks

GPT, LLAMA = "gpt:tiny", "llama:tiny"


def _tp_all(_layer):
    return {"tp": "megatron"}


def _tp_attention_only(layer):
    return {"tp": "megatron" if layer.endswith("attn") else "none", "state": "zero1"}


def _tp_mlp_zero3_attn(layer):
    return {"tp": "megatron" if layer.endswith("mlp") else "none", "state": "zero3" if layer.endswith("attn") else "replicate"}


def _tp_zero3(_layer):
    return {"tp": "megatron", "state": "zero3"}


CASES_2 = {
    "tp_gpt": (GPT, Mesh(tp=2), _tp_all),  # tied vocab-parallel embedding + head
    "tp_llama_gqa": (LLAMA, Mesh(tp=2), _tp_all),
    "tp_attention_only": (LLAMA, Mesh(tp=2), _tp_attention_only),
}
CASES_4 = {
    "tp2_dp2_zero3": (LLAMA, Mesh(dp_shard=2, tp=2), _tp_zero3),
    "tp2_dp2_mixed": (GPT, Mesh(dp_shard=2, tp=2), _tp_mlp_zero3_attn),
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
def test_tp_world2(results2, references, name):
    spec, mesh, _ = CASES_2[name]
    check_against_reference(results2[name], references[spec], mesh)


@pytest.mark.parametrize("name", list(CASES_4))
def test_tp_dp_world4(results4, references, name):
    spec, mesh, _ = CASES_4[name]
    check_against_reference(results4[name], references[spec], mesh)
