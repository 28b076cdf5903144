"""Capture recognises attention and MLP in hand-written blocks from the exported graph's dataflow
(``passes/_capture_blocks.py``): a nanoGPT block's raw ``qkv`` / ``proj`` / ``fc`` / ``out`` and a
Llama-style block's ``wq``..``w3`` get the kinds, tp roles and shape metadata a named attention / MLP
gets, the search offers and picks tp for them, and a tp plan (with SP) trains on 2 gloo ranks as
single-device training does (fp32, losses and parameters after 3 SGD steps, rtol 1e-5)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _harness import run_gloo_cases
from _hf_tp_cases import reassemble
from _runtime_cases import BATCH, MICRO, OPT, SEQ, batches, loss_fn
from _runtime_cases import single_device as train_single_device
from _user_models import LlamaStylePolicy, NanoPolicy
from autoshard import model_parallel as mp
from autoshard.passes import capture
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.search.space import admissible_strategies, enumerate_meshes, is_tp_able
from autoshard.search.synthetic import synthetic_cluster
from autoshard.train import TrainSpec

TP2 = Mesh(tp=2)
MODELS = {"nano": NanoPolicy, "llama_style": LlamaStylePolicy}


def build_user(name: str) -> nn.Module:
    """The fp32 model on the CPU, seed 0: the same in every process."""
    torch.manual_seed(0)
    return MODELS[name]()


@functools.lru_cache(maxsize=None)
def graph_of(name: str):
    return capture(MODELS[name](), seq_lens=(8, 16))


@functools.lru_cache(maxsize=None)
def single_device(name: str):
    """Losses and final parameters of plain single-process training (``_runtime_cases.single_device``)."""
    return train_single_device(name, builder=build_user)


def _roles(graph, block: int = 0) -> dict[str, tuple[str, str]]:
    """Local parameter name in ``blocks.<block>`` → (layer kind, tp role)."""
    prefix = f"blocks.{block}."
    return {p.name[len(prefix):]: (layer.kind, p.tp_role) for layer in graph.layers for p in layer.params
            if p.name.startswith(prefix)}


def test_nano_block_gets_attention_and_mlp_roles():
    graph = graph_of("nano")
    assert _roles(graph) == {
        "ln1.weight": ("norm", "replicate"), "ln1.bias": ("norm", "replicate"),
        "qkv.weight": ("attention", "column"), "qkv.bias": ("attention", "column"),  # fused [q | k | v]
        "proj.weight": ("attention", "row"), "proj.bias": ("attention", "replicate"),
        "ln2.weight": ("norm", "replicate"), "ln2.bias": ("norm", "replicate"),
        "fc.weight": ("mlp", "column"), "fc.bias": ("mlp", "column"),
        "out.weight": ("mlp", "row"), "out.bias": ("mlp", "replicate"),
    }
    qkv, proj, fc, out = (graph.layer(f"blocks.1.{n}") for n in ("qkv", "proj", "fc", "out"))
    assert (qkv.num_heads, qkv.num_kv_heads, proj.num_heads) == (4, 4, 4)
    assert fc.ffn_hidden == out.ffn_hidden == 256
    assert qkv.attention_flops_per_token_seq > 0  # SDPA follows qkv: the attention core's seq term
    assert out.saved_interior_per_token > 0 and out.saved_boundary_per_token == 0  # GELU output: tp-sharded
    assert graph.layer("lm_head").kind == "head"
    assert not any(layer.tp_refusal for layer in graph.layers)


@pytest.mark.parametrize("name", list(MODELS))
def test_critic_is_a_value_head(name):
    """``critic``: a width-1 linear on the final norm's output, squeezed into a model output, is recognised
    by structure (not by name) as a value head, replicated; so SP declares the all-gather of its output."""
    critic = graph_of(name).layer("critic")
    assert critic.kind == "value_head"
    assert {p.tp_role for p in critic.params} == {"replicate"}
    assert critic.output_bytes_per_token == 4  # the squeezed value, [B, S] fp32
    sp = LayerStrategy(layer="critic", sp=True)
    assert [(c.kind, c.payload) for c in mp.tensor_parallel_form(critic, sp, TP2)] == [
        ("all_reduce", "replicated_params"), ("all_gather", "output")]


class _NotAValueHead(nn.Module):
    """Width-1 linears that are no critic: one on a block's output (not the final norm's), one whose result
    is mixed into the logits instead of returned."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([nn.ModuleDict({"mix": nn.Linear(32, 32)})])
        self.probe, self.gate = nn.Linear(32, 1), nn.Linear(32, 1)
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        x = self.blocks[0]["mix"](self.tok(tokens))
        probe = self.probe(x).squeeze(-1)
        x = self.ln(x)
        return self.head(x) * torch.sigmoid(self.gate(x)), probe


def test_width_one_linears_off_the_final_norm_or_mixed_are_not_value_heads():
    graph = capture(_NotAValueHead(), seq_lens=(8, 16))
    assert (graph.layer("probe").kind, graph.layer("gate").kind) == ("other", "other")


def test_positional_table_output_is_batch_free():
    """``pos`` embeds ``arange(S)``: its module returns ``[S, h]`` with no batch dim (the add broadcasting it
    over the batch is root-level), recorded as ``batch_free_output``; ``tok`` returns ``[B, S, h]``. The
    three-block proxy and a static export record the same."""
    graph = graph_of("nano")
    assert {layer.name for layer in graph.layers if layer.batch_free_output} == {"pos"}
    pos = graph.layer("pos")
    assert (pos.kind, pos.hidden, pos.vocab) == ("embedding", 64, 256)
    assert pos.output_bytes_per_token == 64 * 4  # what leaves the layer: the tok + pos sum, [B, S, h]
    static = capture(NanoPolicy(layers=4), seq_lens=(8, 16), dynamic=False)
    assert {layer.name for layer in static.layers if layer.batch_free_output} == {"pos"}
    assert not any(layer.batch_free_output for layer in graph_of("llama_style").layers)


def test_llama_style_block_grouped_query_rope_swiglu():
    graph = graph_of("llama_style")
    roles = _roles(graph)
    assert {k: roles[f"{k}.weight"] for k in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")} == {
        "wq": ("attention", "column"), "wk": ("attention", "column"), "wv": ("attention", "column"),
        "wo": ("attention", "row"), "w1": ("mlp", "column"), "w3": ("mlp", "column"), "w2": ("mlp", "row")}
    wk, w2 = graph.layer("blocks.0.wk"), graph.layer("blocks.0.w2")
    assert (wk.num_heads, wk.num_kv_heads, w2.ffn_hidden) == (4, 2, 128)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_deep_stack_through_the_three_block_proxy():
    deep = capture(NanoPolicy(layers=7), seq_lens=(8, 16))  # exported as blocks 0, 1, 6 (_capture_proxy)
    full = capture(NanoPolicy(layers=7), seq_lens=(8, 16), export_all_blocks=True)
    assert [(layer.name, layer.kind, layer.class_id, layer.batch_free_output) for layer in deep.layers] == \
        [(layer.name, layer.kind, layer.class_id, layer.batch_free_output) for layer in full.layers]
    assert all(_roles(deep, i) == _roles(graph_of("nano"), 0) for i in range(7))


class _Unpaired(nn.Module):
    """Projections without Megatron structure: back-to-back linears, and an MLP whose intermediate is
    also read elsewhere (sharded over tp it would leak); both stay ``other``, replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([nn.ModuleDict({"a": nn.Linear(32, 32), "b": nn.Linear(32, 32),
                                                     "up": nn.Linear(32, 64), "down": nn.Linear(64, 32)})])
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        x, block = self.tok(tokens), self.blocks[0]
        x = x + block["b"](block["a"](x))
        h = F.gelu(block["up"](x))
        return self.head(x + block["down"](h) + h[..., :32]), h.sum(-1)


def test_projections_without_structure_stay_replicated():
    graph = capture(_Unpaired(), seq_lens=(8, 16))
    assert {layer.name: layer.kind for layer in graph.layers if layer.block == 0} == dict.fromkeys(
        ("blocks.0.a", "blocks.0.b", "blocks.0.up", "blocks.0.down"), "other")
    assert not any(is_tp_able(layer) for layer in graph.layers if layer.block == 0)


@pytest.mark.slow
def test_search_offers_and_picks_tp():
    graph = graph_of("nano")
    meshes = enumerate_meshes(graph, synthetic_cluster("h100-sxm", 1))
    assert {m.tp for m in meshes.meshes} >= {1, 2, 4}
    assert {s.tp for s in admissible_strategies(graph.layer("blocks.0.proj"), TP2)} == {"megatron"}
    # a block too wide for one GPU (cf. test_solver's textbook case), captured on meta: tp inside the node
    from autoshard.search import solve

    with torch.device("meta"):
        wide = NanoPolicy(vocab=32768, dim=49152, layers=2, heads=64, positions=2048).to(torch.bfloat16)
    plan = solve(capture(wide, seq_lens=(512, 1024)), synthetic_cluster("h100-sxm", 2),
                 TrainSpec(global_batch=16, seq_len=1024), time_limit_s=30)
    assert plan.mesh.tp > 1
    assert {plan.strategy(f"blocks.0.{n}").tp for n in ("qkv", "proj", "fc", "out")} == {"megatron"}


# --------------------------------------------------------------------------- trained on 2 gloo ranks


def _plan(name: str, sp: bool) -> Plan:
    graph = graph_of(name)
    layers = tuple(LayerStrategy(layer=layer.name, tp="megatron" if is_tp_able(layer) else "none", sp=sp)
                   for layer in graph.layers)
    return Plan(model_name=graph.model_name, mesh=TP2, layers=layers, schedule=Schedule(num_micro_batches=MICRO))


def train_case(rank, world_size, name: str, sp: bool):
    from autoshard.runtime import BuildOptions, build_program
    from autoshard.runtime.rollout_engine import unshard

    del rank, world_size
    program = build_program(build_user(name), graph_of(name), _plan(name, sp),
                            TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT,
                            options=BuildOptions(compile=False))
    losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in batches()]
    unsharded = {fqn: unshard(slot.param, program.param_placements[fqn], program.ctx).clone()
                 for fqn, slot in program.optimizer.slots.items()}
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "unsharded": unsharded}


CASES = {"nano_tp": ("nano", False), "nano_tp_sp": ("nano", True), "llama_style_tp_sp": ("llama_style", True)}


@pytest.fixture(scope="module")
def results():
    jobs = {case: functools.partial(train_case, name=name, sp=sp) for case, (name, sp) in CASES.items()}
    return run_gloo_cases(jobs, TP2.world_size, timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_tp2_trains_like_single_device(results, case):
    name = CASES[case][0]
    ref_losses, ref_params = single_device(name)
    ranks = results[case]
    placements = ranks[0]["placements"]
    assert placements["blocks.0.qkv.weight" if name == "nano" else "blocks.0.wk.weight"].tp_dim == 0
    if name == "nano":
        assert placements["blocks.0.qkv.weight"].tp_parts == 3 and placements["blocks.0.out.weight"].tp_dim == 1
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = reassemble(ranks, TP2)
    assert set(full) == set(ref_params)
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")
        assert all(torch.equal(r["unsharded"][fqn], value) for r in ranks)
