"""Tests of the capture pass (torch.export → ModelGraph): tier 1, pure unit, CPU and meta only."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from autoshard.errors import CaptureError
from autoshard.graph import LAYER_KINDS, TP_ROLES
from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes.capture import capture_reference, format_coverage, format_layer_table

BLOCK_KINDS = {"gpt": ["norm", "attention", "norm", "mlp"], "llama": ["norm", "attention", "norm", "mlp"],
               "moe": ["norm", "attention", "norm", "moe"]}
HEAD_KINDS = ["norm", "head", "value_head"]


# ---------------------------------------------------------------------------------------------
# small hand-written models with the reference naming (embed, blocks.i.*, norm, head, value_head)


@torch.library.custom_op("autoshard_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An op capture has no price for."""
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class TinyMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, branch: str = "none"):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.branch = branch

    def forward(self, x):
        y = F.gelu(self.up(x))  # [B, S, f]
        if self.branch == "item" and y.sum().item() > 0:  # data-dependent: not exportable
            y = y * 2
        if self.branch == "custom":
            y = mystery(y)
        return self.down(y)


class TinyAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, a, S, d]
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class TinyBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, branch: str):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(hidden), TinyAttention(hidden, heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(hidden), TinyMLP(hidden, ffn, branch)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyPolicy(nn.Module):
    """No ``tp_roles()``: capture falls back on its heuristic."""

    def __init__(self, vocab=96, hidden=32, heads=4, ffn=64, layers=2, branch="none"):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden, heads, ffn, branch) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.value_head = nn.Linear(hidden, 1)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x), self.value_head(x).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# fixtures: one capture per reference model, shared by the tests


@pytest.fixture(scope="module")
def tiny_graphs():
    return {family: capture_reference(f"{family}:tiny", dropout=0.1) for family in ("gpt", "llama", "moe")}


@pytest.fixture(scope="module")
def gpt125m_math():
    return capture_reference("gpt:125m", dropout=0.1, attn_impl="math")


def _block(graph, index):
    return [layer for layer in graph if layer.block == index]


# ---------------------------------------------------------------------------------------------
# structure


@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_layer_kinds_order_and_blocks(tiny_graphs, family):
    graph = tiny_graphs[family]
    prefix = ["embedding", "embedding"] if family == "gpt" else ["embedding"]
    expected = prefix + BLOCK_KINDS[family] * 2 + HEAD_KINDS
    assert [layer.kind for layer in graph] == expected
    assert [layer.index for layer in graph] == list(range(len(graph)))
    assert graph.num_blocks == 2
    assert [layer.name for layer in _block(graph, 1)] == [
        f"blocks.1.{n}" for n in ("attn_norm", "attn", "mlp_norm", "moe" if family == "moe" else "mlp")
    ]
    assert all(layer.kind in LAYER_KINDS for layer in graph)
    assert all(p.tp_role in TP_ROLES for layer in graph for p in layer.params)


@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_params_partition_the_model(tiny_graphs, family):
    model = build(f"{family}:tiny", device="meta", dtype=torch.bfloat16)
    graph = tiny_graphs[family]
    assert graph.param_count == sum(p.numel() for p in model.parameters())  # tied counted once
    names = [p.name for layer in graph for p in layer.params]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    roles = model.tp_roles()
    assert all(p.tp_role == roles[p.name] for layer in graph for p in layer.params)
    assert all(p.dtype == "bfloat16" for layer in graph for p in layer.params)
    if model.config.tie_embeddings:
        assert graph.layer("head").tied_params == ("head.weight",)
        assert graph.layer("head").params == ()


@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_identical_blocks_share_class_ids(tiny_graphs, family):
    graph = tiny_graphs[family]
    classes0 = [layer.class_id for layer in _block(graph, 0)]
    classes1 = [layer.class_id for layer in _block(graph, 1)]
    assert classes0 == classes1
    assert len(set(classes0)) == 3  # the two norms are one class
    assert graph.layer("value_head").class_id != graph.layer("head").class_id


def test_class_ids_differ_when_shapes_differ():
    graph = capture(TinyPolicy(layers=1), name="a")
    wider = capture(TinyPolicy(layers=1, ffn=128), name="b")
    assert graph.layer("blocks.0.mlp").class_id != wider.layer("blocks.0.mlp").class_id
    assert graph.layer("blocks.0.attn").class_id == wider.layer("blocks.0.attn").class_id


def test_edges_follow_data_flow(tiny_graphs):
    graph = tiny_graphs["llama"]
    index = {layer.name: layer.index for layer in graph}
    assert all(index[a] < index[b] for a, b in graph.edges)
    edges = set(graph.edges)
    # residual adds at block level belong to the preceding layer: attn and mlp consume the residual
    assert {("embed", "blocks.0.attn_norm"), ("embed", "blocks.0.attn"), ("blocks.0.attn_norm", "blocks.0.attn"),
            ("blocks.0.attn", "blocks.0.mlp"), ("blocks.1.mlp", "norm"), ("norm", "head"),
            ("norm", "value_head")} <= edges
    assert ("blocks.0.mlp", "head") not in edges
    assert len(graph.to_networkx().edges) == len(graph.edges)


def test_shape_metadata(tiny_graphs):
    llama, moe = tiny_graphs["llama"], tiny_graphs["moe"]
    attn = llama.layer("blocks.0.attn")
    assert (attn.num_heads, attn.num_kv_heads, attn.hidden) == (4, 2, 64)
    assert llama.layer("blocks.0.mlp").ffn_hidden == 128
    expert = moe.layer("blocks.0.moe")
    assert (expert.num_experts, expert.top_k, expert.ffn_hidden) == (4, 2, 128)
    assert llama.layer("embed").vocab == llama.vocab == 128
    assert {p.tp_role for p in expert.params} == {"expert", "replicate"}


# ---------------------------------------------------------------------------------------------
# FLOPs


def test_linear_flops_exact(tiny_graphs):
    h, f, a = 64, 256, 4  # gpt:tiny: GELU MLP of 4h, biases
    graph = tiny_graphs["gpt"]
    mlp = graph.layer("blocks.0.mlp")
    assert mlp.matmul_flops_per_token == 2 * h * f + 2 * f * h
    assert mlp.attention_flops_per_token_seq == 0
    attn = graph.layer("blocks.0.attn")
    assert attn.matmul_flops_per_token == 4 * 2 * h * h  # q, k, v, o
    assert attn.attention_flops_per_token_seq == 4 * h  # QKᵀ and ·V: 4·b·a·s²·d in all
    assert graph.layer("head").matmul_flops_per_token == 2 * h * 128
    assert graph.layer("value_head").matmul_flops_per_token == 2 * h
    assert graph.layer("blocks.0.attn_norm").matmul_flops_per_token == 0
    seq = 100
    expected = 2 * seq * (2 * h * f + 2 * f * h + mlp.elementwise_flops_per_token)
    assert mlp.forward_flops(2, seq) == pytest.approx(expected)


def test_moe_flops_price_the_graph_as_written(tiny_graphs):
    h, f, experts = 64, 128, 4
    moe = tiny_graphs["moe"].layer("blocks.0.moe")
    # dropless capacity buffer: every expert runs on all T tokens (+ the router)
    assert moe.matmul_flops_per_token == experts * 3 * 2 * h * f + 2 * h * experts


def test_math_attention_elementwise_grows_with_seq(gpt125m_math):
    attn = gpt125m_math.layer("blocks.0.attn")
    assert attn.elementwise_flops_per_token_seq > 0
    assert attn.bytes_per_token_seq > 0
    assert gpt125m_math.layer("blocks.0.mlp").elementwise_flops_per_token_seq == 0


# ---------------------------------------------------------------------------------------------
# export modes


def test_dynamic_export_and_static_agree():
    model = TinyPolicy()
    dynamic = capture(model, seq_lens=(16, 48))
    static = capture(model, seq_lens=(16, 48), dynamic=False)
    assert dynamic.dynamic_dims == ("batch", "seq")
    assert static.dynamic_dims == ()
    assert dynamic.capture_seq_lens == static.capture_seq_lens == (16, 48)
    for a, b in zip(dynamic, static):
        assert dataclasses.replace(a, class_id="") == dataclasses.replace(b, class_id="")


def test_real_cpu_model_with_example_inputs():
    model = build("llama:tiny")  # fp32 weights on cpu
    before = [p.clone() for p in model.parameters()]
    model.eval()
    graph = capture(model, (torch.randint(0, 128, (3, 40)),), name="llama-cpu")
    assert graph.capture_seq_lens == (20, 40)
    assert graph.dtype == "float32" and graph.model_name == "llama-cpu"
    assert not model.training  # mode restored
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    attn = graph.layer("blocks.0.attn")
    assert attn.saved_boundary_per_token > 0 and attn.saved_interior_per_token > 0


def test_heuristic_tp_roles_without_tp_roles_method():
    graph = capture(TinyPolicy())
    roles = {p.name: p.tp_role for layer in graph for p in layer.params}
    assert roles["blocks.0.attn.q.weight"] == roles["blocks.0.attn.v.weight"] == "column"
    assert roles["blocks.0.attn.o.weight"] == "row"
    assert roles["blocks.0.mlp.up.weight"] == roles["blocks.0.mlp.up.bias"] == "column"
    assert (roles["blocks.0.mlp.down.weight"], roles["blocks.0.mlp.down.bias"]) == ("row", "replicate")
    assert roles["embed.weight"] == roles["head.weight"] == "vocab"
    assert roles["blocks.0.attn_norm.weight"] == roles["value_head.weight"] == "replicate"
    assert graph.layer("blocks.0.attn").num_heads == 4


# ---------------------------------------------------------------------------------------------
# saved activations


def test_korthikanti_per_block_within_5_percent(gpt125m_math):
    h, a, b = 768, 12, 1
    for s in (128, 1024):
        block = _block(gpt125m_math, 3)
        measured = sum(layer.saved_bytes(b, s) for layer in block)
        assert measured == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.05)
        # the tensor-parallel split: boundary 10sbh, interior 24sbh + 5as²b
        boundary = b * s * sum(layer.saved_boundary_per_token for layer in block)
        interior = measured - boundary
        assert boundary == pytest.approx(10 * s * b * h, rel=0.05)
        assert interior == pytest.approx(s * b * h * (24 + 5 * a * s / h), rel=0.05)
    attn = gpt125m_math.layer("blocks.3.attn")
    assert attn.saved_interior_per_token_seq == pytest.approx(5 * a, rel=0.05)  # selective recompute drops it


def test_fused_attention_saves_no_scores(tiny_graphs):
    attn = tiny_graphs["llama"].layer("blocks.0.attn")  # sdpa, measured as the flash kernel saves
    assert attn.saved_interior_per_token_seq == 0
    assert attn.attention_flops_per_token_seq == 4 * 64


# ---------------------------------------------------------------------------------------------
# errors, coverage, reports


def test_unexportable_model_names_module_and_op():
    with pytest.raises(CaptureError) as info:
        capture(TinyPolicy(branch="item"), name="bad")
    message = str(info.value)
    assert "'blocks.0.mlp'" in message
    assert "aten.item" in message and ".item() > 0" in message  # the op and the source line
    assert "Next step: replace Python branching" in message


def test_unknown_custom_op_is_listed_not_dropped():
    graph = capture(TinyPolicy(branch="custom"))
    assert graph.coverage.unaccounted == {"autoshard_test.mystery": 2}
    assert graph.coverage.counted["aten.linear"] == 2 * 6 + 2
    assert graph.layer("blocks.0.mlp").matmul_flops_per_token == 2 * 2 * 32 * 64


def test_invalid_arguments_raise_capture_error():
    with pytest.raises(CaptureError, match="seq_lens"):
        capture(TinyPolicy(), seq_lens=(32, 16))
    with pytest.raises(CaptureError, match="tokens"):
        capture(TinyPolicy(), (torch.zeros(4, dtype=torch.long),))


def test_tables_render(tiny_graphs):
    graph = tiny_graphs["gpt"]
    console = Console(file=io.StringIO(), width=200)
    console.print(format_layer_table(graph))
    console.print(format_coverage(graph))
    text = console.file.getvalue()
    assert "blocks.1.mlp" in text and graph.layer("blocks.1.mlp").class_id in text
    assert "aten.linear" in text and "counted" in text


@pytest.mark.slow
def test_three_block_proxy_equals_full_export():
    model = build("llama:tiny", device="meta", dtype=torch.bfloat16, num_layers=6, dropout=0.1)
    proxied = capture(model, seq_lens=(16, 32))
    full = capture(model, seq_lens=(16, 32), export_all_blocks=True)
    assert proxied == full
    assert len({layer.class_id for layer in proxied if layer.kind == "attention"}) == 1
    assert ("blocks.4.mlp", "blocks.5.attn_norm") in proxied.edges
    assert ("embed", "blocks.4.attn") in proxied.edges  # RoPE tables feed every block


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["gpt:tiny", "moe:tiny"])
def test_three_block_proxy_measures_as_the_whole_model(spec):
    """Saved activations and the backward's working set measured on the proxy (blocks 0, 1, L−1; the middle
    blocks take block 1's) equal the whole model's: a tied head and embedding, a routed MoE."""
    model = build(spec, device="meta", dtype=torch.bfloat16, num_layers=6)
    assert capture(model, seq_lens=(16, 32)) == capture(model, seq_lens=(16, 32), export_all_blocks=True)


def test_proxy_refused_for_non_uniform_blocks():
    from autoshard.passes._capture_proxy import make_proxy

    model = build("llama:tiny", device="meta", num_layers=7)
    assert make_proxy(model) is not None
    model.blocks[3].attn.attn_impl = "math"  # same shapes, different computation
    assert make_proxy(model) is None
    assert make_proxy(build("llama:tiny", device="meta", num_layers=5)) is None  # too shallow to pay off


class CpuOnlyPolicy(TinyPolicy):
    """Creates a tensor on the CPU whatever the input's device: runs on CPU, not on meta."""

    def forward(self, tokens):
        bias = torch.zeros(tokens.shape[1], 1)  # [S, 1], always on cpu
        x = self.embed(tokens) + bias
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x), self.value_head(x).squeeze(-1)


def test_saved_activations_fall_back_to_the_real_device():
    real = capture(CpuOnlyPolicy(layers=1), seq_lens=(8, 16))
    reference = capture(TinyPolicy(layers=1), seq_lens=(8, 16))
    mlp, expected = real.layer("blocks.0.mlp"), reference.layer("blocks.0.mlp")
    assert mlp.saved_interior_per_token == expected.saved_interior_per_token > 0
    with pytest.raises(CaptureError, match="on the input's device"):
        capture(CpuOnlyPolicy(layers=1).to("meta"), seq_lens=(8, 16))  # export itself fails here


def test_invalid_tp_role_is_a_capture_error():
    class Declared(TinyPolicy):
        def tp_roles(self):
            return {"embed.weight": "diagonal"}

    with pytest.raises(CaptureError, match="diagonal"):
        capture(Declared())


def test_fit_charges_per_call_constants_at_the_longer_sequence():
    from autoshard.passes.capture import _fit

    batch, lens = 2, (16, 32)
    assert _fit((batch * 16 * (3 + 5 * 16), batch * 32 * (3 + 5 * 32)), batch, lens) == (3.0, 5.0)
    assert _fit((100.0, 100.0), batch, lens) == (100.0 / (batch * 32), 0.0)  # a [h]-sized op: constant per call


def test_root_level_tensors_are_charged_consistently(tiny_graphs):
    # dropout 0: GPT's root-level embed + pos_embed sum is saved only by block 0's norm and stays there;
    # llama's root-level RoPE tables are saved by every block and go to their creator, the embedding
    gpt = capture_reference("gpt:tiny", seq_lens=(16, 32))
    norms = [layer for layer in gpt if layer.kind == "norm"]
    assert len({layer.class_id for layer in norms}) == 1
    assert norms[0].saved_boundary_per_token == 2 * 64 + 8  # bf16 input + fp32 mean and rstd
    seq, head_dim, batch = 128, 16, 2
    rope = 2 * seq * head_dim * 4 / (batch * seq)  # cos and sin [S, d] fp32, per token
    assert tiny_graphs["llama"].layer("embed").saved_boundary_per_token == 8 + rope  # int64 token ids + RoPE


@pytest.mark.slow
def test_a_meta_model_takes_example_tokens_from_the_cpu():
    """Planning a model built on meta with the tokens a user has at hand (CPU): the tokens follow the model."""
    model = build("llama:tiny", device="meta", dtype=torch.bfloat16)
    on_cpu = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    on_meta = capture(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert [layer.name for layer in on_cpu.layers] == [layer.name for layer in on_meta.layers]
    assert on_cpu.layer("blocks.0.mlp").matmul_flops_per_token == on_meta.layer("blocks.0.mlp").matmul_flops_per_token > 0
