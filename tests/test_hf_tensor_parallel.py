"""Megatron tensor parallelism on Hugging Face trunks as ``autoshard.models.hf`` builds them equals plain
PyTorch training: grouped-query attention (Llama, Qwen2, Mixtral's attention; SDPA's ``enable_gqa`` and HF's
``repeat_kv`` paths), GPT-2's transposed ``Conv1D`` and fused ``c_attn``, Gemma's padding row and Phi's LM-head
bias; with SP, at tp 2 (2 ranks) and tp 2 × dp 2 with ZeRO-1/2/3 (4 ranks: Llama, Qwen2, Mixtral, GPT-2). What the
runtime cannot run (MQA under tp, a fused projection with unequal parts, a split weight used outside a
projection, SP on MoE layers) the search does not propose, and a forced plan is refused by
``Plan.check_compatible`` before any rank starts (``tests/test_tp_refusal.py``) or while building.
Tiny random configs, CPU, fp32, gloo (``tests/_hf_tp_cases.py``)."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import fake_world, run_gloo_cases  # noqa: E402
from _tiers import sample  # noqa: E402
from _hf_tp_cases import (  # noqa: E402
    attention_path, build_hf, check_against_reference, graph_of, single_device, tp_plan, train_case,
)
from autoshard.errors import AutoshardError, PlanError  # noqa: E402
from autoshard.plan import LayerStrategy, Mesh, Plan  # noqa: E402
from autoshard.runtime import BuildOptions, build_program  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402

TP2, TP2_DP2 = Mesh(tp=2), Mesh(dp_shard=2, tp=2)
CASES_2 = {  # name → (model, state, sp)
    "llama": ("llama", "replicate", False),
    "llama_repeat_kv": ("llama+repeat_kv", "replicate", False),
    "qwen2_sp": ("qwen2", "replicate", True),
    "qwen3": ("qwen3", "replicate", False),
    "mixtral_attention": ("mixtral", "replicate", False),
    "gpt2": ("gpt2", "replicate", False),
    "gpt2_sp": ("gpt2", "replicate", True),
    "gemma_sp": ("gemma", "replicate", True),
    "phi": ("phi", "replicate", False),
}
CASES_4 = {
    "llama_zero3": ("llama", "zero3", False),
    "llama_repeat_kv_zero2_sp": ("llama+repeat_kv", "zero2", True),
    "gpt2_zero3_sp": ("gpt2", "zero3", True),
    "qwen2_zero1_sp": ("qwen2", "zero1", True),
    "mixtral_attention_zero3": ("mixtral", "zero3", False),  # MoE: no sp (its experts stay unsplit over tp)
}
# `make test` (tests/_tiers.py): every family once on TP 2 (Llama through its repeat_kv form, GPT-2 with SP);
# on TP 2 × DP 2 one ZeRO-3 case per attention form (the ZeRO-1/2 × TP mixes run the same family code)
CASES_2 = sample(CASES_2, ("llama_repeat_kv", "qwen2_sp", "qwen3", "mixtral_attention", "gpt2_sp", "gemma_sp", "phi"))
CASES_4 = sample(CASES_4, ("llama_zero3", "gpt2_zero3_sp", "mixtral_attention_zero3"))
TRAIN = TrainSpec(global_batch=8, seq_len=8, precision="fp32")


def _run(cases, mesh):
    jobs = {name: functools.partial(train_case, name=model, plan=tp_plan(model, mesh, state, sp))
            for name, (model, state, sp) in cases.items()}
    return run_gloo_cases(jobs, mesh.world_size, timeout_s=400)


@pytest.fixture(scope="module")
def references():
    return {model: single_device(model) for model, _, _ in [*CASES_2.values(), *CASES_4.values()]}


@pytest.fixture(scope="module")
def results2():
    return _run(CASES_2, TP2)


@pytest.fixture(scope="module")
def results4():
    return _run(CASES_4, TP2_DP2)


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_tp2_matches_single_device(results2, references, name):
    check_against_reference(results2[name], references[CASES_2[name][0]], TP2)


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_tp2_dp2_matches_single_device(results4, references, name):
    check_against_reference(results4[name], references[CASES_4[name][0]], TP2_DP2)


# --------------------------------------------------------------------------- built programs (fake world)


def _build(model: str, plan: Plan, world: int = 2, rank: int = 0):
    with fake_world(world, rank), attention_path(model):
        return build_program(build_hf(model), graph_of(model), plan, TRAIN, options=BuildOptions(compile=False))


@pytest.mark.slow
def test_repeat_kv_literals_become_local_head_counts():
    """HF's ``repeat_kv``: expand(B, kv=2, rep=2, S, d) and reshape(B, 4, S, d) carry global head counts."""
    program = _build("llama+repeat_kv", tp_plan("llama+repeat_kv", TP2))
    nodes = [n for n in program.gm.graph.nodes if n.op == "call_function"]
    expands = [n.args[1] for n in nodes if n.target == torch.ops.aten.expand.default and len(n.args[1]) == 5]
    reshapes = [n.args[1] for n in nodes if n.target == torch.ops.aten.reshape.default and len(n.args[1]) == 4]
    assert expands and all(shape[1:3] == [1, 2] for shape in expands)  # one local kv head, repeated twice
    # two local query heads; a -1 (transformers 5.24 writes some as -1) is computed from the local input
    assert any(shape[1] == 2 for shape in reshapes) and all(shape[1] in (2, -1) for shape in reshapes)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_gpt2_conv1d_is_split_on_its_transposed_dims_and_c_attn_per_head():
    from torch.distributed.tensor.placement_types import _StridedShard

    graph = graph_of("gpt2")
    roles = {p.name: p.tp_role for layer in graph.layers for p in layer.params}
    assert roles["model.h.0.attn.c_attn.weight"] == roles["model.h.0.mlp.c_fc.weight"] == "column"
    assert roles["model.h.0.attn.c_proj.weight"] == roles["model.h.0.mlp.c_proj.weight"] == "row"
    assert next(l for l in graph.layers if l.name == "model.h.0.mlp").ffn_hidden == 256
    placements = _build("gpt2", tp_plan("gpt2", TP2), rank=1).param_placements
    c_attn, bias = placements["model.h.0.attn.c_attn.weight"], placements["model.h.0.attn.c_attn.bias"]
    assert (c_attn.tp_dim, c_attn.tp_parts, c_attn.local_shape) == (1, 3, (64, 96))
    assert isinstance(c_attn.placements[-1], _StridedShard) and (bias.tp_dim, bias.tp_parts) == (0, 3)
    assert placements["model.h.0.attn.c_proj.weight"].tp_dim == 0
    assert placements["model.h.0.mlp.c_fc.weight"].tp_parts == 1


def test_fused_shard_is_each_parts_chunk_as_dtensor_strided_shard():
    from torch.distributed.tensor.placement_types import _StridedShard

    from autoshard.passes.context import RankContext, TpLayout, placement_for

    full = torch.arange(12.0 * 2).reshape(2, 12)
    strategy = LayerStrategy(layer="attn", tp="megatron")
    for t in range(2):
        ctx = RankContext(rank=t, world_size=2, mesh=TP2, coords={"pp": 0, "dp_replicate": 0, "dp_shard": 0,
                                                                    "cp": 0, "tp": t})
        p = placement_for("w", (2, 12), "column", strategy, ctx, layout=TpLayout(transposed=True, parts=3))
        expected = _StridedShard(1, split_factor=3)._split_tensor(full, 2, with_padding=False)[0][t]
        assert torch.equal(p.shard(full, ctx), expected)


@pytest.mark.slow
def test_mqa_and_indivisible_kv_heads_are_refused_and_not_searched():
    from autoshard.search.space import enumerate_meshes
    from autoshard.search.synthetic import synthetic_cluster

    with pytest.raises(PlanError, match=r"layer 'model.layers.0.self_attn':.*size 1 .*not divide"):
        _build("llama_mqa", tp_plan("llama_mqa", TP2))
    with pytest.raises(PlanError, match=r"layer 'model.layers.0.self_attn':.*size 2 .*tp=4"):
        _build("llama", tp_plan("llama", Mesh(tp=4)), world=4)
    meshes = enumerate_meshes(graph_of("llama_mqa"), synthetic_cluster("h100-sxm", 1))
    assert {m.tp for m in meshes.meshes} == {1}
    assert any(r.constraint == "tp_divides/kv_heads" for r in meshes.pruned)


class _UserModel(torch.nn.Module):
    """A user's one-block model whose attention has a fused q/k/v projection (``_Attention``)."""

    def __init__(self, sizes: tuple[int, int, int], by_hand: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"attn": _Attention(sizes, by_hand)})])
        self.head = torch.nn.Linear(64, 256, bias=False)
        self.value_head = torch.nn.Linear(64, 1)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.blocks[0]["attn"](x)
        return self.head(x), self.value_head(x).squeeze(-1)


class _Attention(torch.nn.Module):
    """Fused projection split into ``sizes`` (q, k, v widths; heads of 16); ``by_hand``: ``x @ W.t()``."""

    num_heads = 4

    def __init__(self, sizes: tuple[int, int, int], by_hand: bool) -> None:
        super().__init__()
        self.num_kv_heads, self.sizes, self.by_hand = sizes[1] // 16, list(sizes), by_hand
        self.qkv = torch.nn.Linear(64, sum(sizes), bias=False)
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        fused = x @ self.qkv.weight.t() if self.by_hand else self.qkv(x)
        q, k, v = fused.split(self.sizes, dim=-1)
        q, k, v = (t.view(b, s, -1, 16).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 64))


@pytest.mark.parametrize("sizes, by_hand, message", [
    ((64, 32, 32), False, r"layer 'blocks.0.attn':.*unequal parts \[64, 32, 32\]"),  # fused grouped-query q/k/v
    ((64, 64, 64), True, r"layer 'blocks.0.attn': tp-split parameter 'blocks.0.attn.qkv.weight' is used by"),
])
@pytest.mark.slow
def test_user_projections_tp_cannot_split_are_refused(sizes, by_hand, message):
    from autoshard.passes import capture
    from autoshard.search.space import is_tp_able

    model = _UserModel(sizes, by_hand)
    graph = capture(model, seq_lens=(8, 16))
    plan = Plan(model_name=graph.model_name, mesh=TP2, layers=tuple(
        LayerStrategy(layer=l.name, tp="megatron" if is_tp_able(l) else "none") for l in graph.layers))
    with fake_world(2, 0), pytest.raises(PlanError, match=message):
        build_program(model, graph, plan, TRAIN, options=BuildOptions(compile=False))


@pytest.mark.slow
def test_moe_layers_get_no_sequence_parallelism():
    from autoshard.search.space import Constraints, admissible_strategies, validate_constraints
    from autoshard.search.synthetic import synthetic_cluster

    graph = graph_of("mixtral")
    moe = next(l for l in graph.layers if l.kind == "moe")
    attention = next(l for l in graph.layers if l.kind == "attention")
    assert {s.sp for s in admissible_strategies(moe, TP2)} == {False}
    assert {s.sp for s in admissible_strategies(attention, TP2)} == {False, True}
    with pytest.raises(AutoshardError, match="sp=True on an MoE layer"):
        validate_constraints(Constraints(mesh={"tp": 2}, pin={moe.name: {"sp": True}}), graph,
                             synthetic_cluster("h100-sxm", 1))
