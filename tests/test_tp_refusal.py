"""A forced tp plan of a layer the tensor-parallel runtime cannot split is refused by
``Plan.check_compatible(graph=...)``, so ``autoshard.compile`` and the CLI refuse it before any rank
starts, in one line naming the layer and the reason: MQA / key-value heads tp does not divide (from the
head counts capture records), and what capture records in ``LayerInfo.tp_refusal`` (a fused projection
with unequal parts, a weight used other than as a projection's). Tier 1: capture on the CPU, no ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import PlanError
from autoshard.passes import capture
from autoshard.plan import LayerStrategy, Mesh, Plan
from autoshard.search.space import is_tp_able

transformers = pytest.importorskip("transformers")

from autoshard.models.hf import actor_critic  # noqa: E402

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
             max_position_embeddings=64)


def _hf(family: str, kv_heads: int) -> nn.Module:
    config = getattr(transformers, f"{family}Config")(**_TINY, num_key_value_heads=kv_heads)
    return actor_critic(config, dtype=torch.float32)


def _tp_plan(graph, mesh: Mesh, none: tuple[str, ...] = ()) -> Plan:
    """Megatron tp on every tp-able layer (the search's rule) but those in ``none``; no fingerprints."""
    return Plan(model_name=graph.model_name, mesh=mesh, layers=tuple(
        LayerStrategy(layer=layer.name, tp="megatron" if is_tp_able(layer) and layer.name not in none else "none")
        for layer in graph.layers))


def _refusal(plan: Plan, graph) -> str:
    with pytest.raises(PlanError) as err:
        plan.check_compatible(graph=graph)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_mqa_forced_to_tp2_is_refused_naming_the_layer(family):
    graph = capture(_hf(family, kv_heads=1), seq_lens=(8, 16))
    message = _refusal(_tp_plan(graph, Mesh(tp=2)), graph)
    assert message.startswith("layer 'model.layers.0.self_attn': key/value heads of size 1 split over tp=2: "
                              "tp does not divide it (num_heads=4, num_kv_heads=1)")
    assert "use tp='none' for it" in message
    attention = [layer.name for layer in graph.layers if layer.kind == "attention"]  # with tp='none' there: runs
    _tp_plan(graph, Mesh(tp=2), none=tuple(attention)).check_compatible(graph=graph)


@pytest.mark.slow
def test_kv_heads_that_tp_does_not_divide_and_runnable_degrees():
    graph = capture(_hf("Llama", kv_heads=2), seq_lens=(8, 16))
    assert "key/value heads of size 2 split over tp=4" in _refusal(_tp_plan(graph, Mesh(tp=4)), graph)
    _tp_plan(graph, Mesh(tp=2)).check_compatible(graph=graph)
    assert not any(layer.tp_refusal for layer in graph.layers)


class _FusedAttention(nn.Module):
    """A user's attention with a fused q/k/v of widths ``sizes`` (heads of 16); ``by_hand``: ``x @ W.t()``."""

    num_heads = 4

    def __init__(self, sizes: tuple[int, int, int], by_hand: bool) -> None:
        super().__init__()
        self.num_kv_heads, self.sizes, self.by_hand = sizes[1] // 16, list(sizes), by_hand
        self.qkv = nn.Linear(64, sum(sizes), bias=False)
        self.o = nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        fused = x @ self.qkv.weight.t() if self.by_hand else self.qkv(x)
        q, k, v = fused.split(self.sizes, dim=-1)
        q, k, v = (t.view(b, s, -1, 16).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 64))


class _OneBlock(nn.Module):
    def __init__(self, sizes: tuple[int, int, int], by_hand: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": _FusedAttention(sizes, by_hand)})])
        self.head = nn.Linear(64, 256, bias=False)
        self.value_head = nn.Linear(64, 1)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.blocks[0]["attn"](x)
        return self.head(x), self.value_head(x).squeeze(-1)


@pytest.mark.parametrize("sizes, by_hand, reason", [
    ((64, 32, 32), False, "the output of 'blocks.0.attn.qkv.weight' is split into unequal parts [64, 32, 32]"),
    ((64, 64, 64), True, "tp-split parameter 'blocks.0.attn.qkv.weight' is used by "),
])
def test_capture_records_what_tp_cannot_split(sizes, by_hand, reason):
    graph = capture(_OneBlock(sizes, by_hand), seq_lens=(8, 16))
    assert reason in graph.layer("blocks.0.attn").tp_refusal
    assert not any(layer.tp_refusal for layer in graph.layers if layer.name != "blocks.0.attn")
    assert _refusal(_tp_plan(graph, Mesh(tp=2)), graph).startswith(f"layer 'blocks.0.attn': {reason}")
    _tp_plan(graph, Mesh(tp=2), none=("blocks.0.attn",)).check_compatible(graph=graph)
    _tp_plan(graph, Mesh(dp_shard=2)).check_compatible(graph=graph)  # no tp axis: nothing is split


@pytest.mark.slow
def test_compile_refuses_before_any_rank_starts(monkeypatch):
    import autoshard.api as api

    def build(*args, **kwargs):
        raise AssertionError("the program must not be built")

    monkeypatch.setattr(api, "_build_program", build)
    model = _hf("Qwen2", kv_heads=1)
    graph = capture(model, seq_lens=(8, 16))
    with pytest.raises(PlanError, match=r"plan: layer 'model.layers.0.self_attn': key/value heads of size 1"):
        autoshard.compile(model, "cpu:1x2", plan=_tp_plan(graph, Mesh(tp=2)))


@pytest.mark.slow
def test_cli_refuses_a_forced_plan_in_one_line(capsys, tmp_path):
    from _user_models import mqa_policy
    from autoshard.cli import main

    graph = capture(mqa_policy(device="meta", dtype=torch.bfloat16), seq_lens=(32, 64))
    assert graph.layer("blocks.0.wk").num_kv_heads == 1  # recognised from the dataflow: one kv head
    path = tmp_path / "plan.json"
    plan = _tp_plan(graph, Mesh(tp=2))
    Plan.from_dict({**plan.to_dict(), "model_name": "_user_models:mqa_policy"}).save(path)
    assert main(["plan", "--plan", str(path), "--cluster", "cpu:1x2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "layer 'blocks.0.wq': key/value heads of size 1 split over tp=2" in lines[0]
