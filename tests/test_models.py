"""Reference policy models: shapes, parameter counts, TP roles, export, KV cache, MoE routing, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim, export

from autoshard.errors import ModelError
from autoshard.graph import TP_ROLES
from autoshard.models import (
    FAMILIES,
    GPTConfig,
    MoE,
    build,
    config_for,
    default_device,
    expert_capacity,
    list_models,
    parse_spec,
)

FAMILY_NAMES = tuple(FAMILIES)
ALL_SPECS = [f"{family}:{size}" for family, fam in FAMILIES.items() for size in fam.sizes]


def _tokens(batch: int, seq: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- forward ---


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tiny_forward_shapes(family):
    model = build(family)
    logits, values = model(_tokens(3, 10))
    assert logits.shape == (3, 10, 128) and values.shape == (3, 10)
    assert logits.dtype == values.dtype == torch.float32
    assert torch.isfinite(logits).all() and torch.isfinite(values).all()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_math_and_sdpa_attention_agree(family):
    tokens = _tokens(2, 16)
    math_out = build(family, attn_impl="math")(tokens)
    sdpa_out = build(family, attn_impl="sdpa")(tokens)
    torch.testing.assert_close(math_out, sdpa_out, rtol=1e-5, atol=1e-5)


def test_causality_future_tokens_do_not_change_past_logits():
    model = build("llama")
    a, b = _tokens(1, 12, seed=1), _tokens(1, 12, seed=2)
    b[:, :6] = a[:, :6]
    torch.testing.assert_close(model(a)[0][:, :6], model(b)[0][:, :6])
    assert not torch.allclose(model(a)[0][:, 6:], model(b)[0][:, 6:])


def test_dropout_active_only_in_training():
    model = build("gpt", dropout=0.3)
    tokens = _tokens(2, 8)
    model.train()
    assert not torch.equal(model(tokens)[0], model(tokens)[0])
    model.eval()
    assert torch.equal(model(tokens)[0], model(tokens)[0])


# ----------------------------------------------------------- param counts ---


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_param_count_formula_equals_built_model(spec):
    model = build(spec, device="meta")
    assert sum(p.numel() for p in model.parameters()) == model.config.param_count()


def _narayanan_gpt(cfg) -> float:
    """12·L·h²·(1 + 13/(12h) + (V+s)/(12Lh)), tied embeddings, no final norm or value head."""
    L, h, V, s = cfg.num_layers, cfg.hidden, cfg.vocab_size, cfg.max_seq_len
    return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


@pytest.mark.parametrize("size", ["125m", "350m", "1.3b", "7b", "13b", "70b"])
def test_gpt_param_counts_match_narayanan_formula(size):
    cfg = config_for(f"gpt:{size}")
    assert cfg.param_count() == pytest.approx(_narayanan_gpt(cfg), rel=0.01)


@pytest.mark.parametrize(
    "size,published", [("125m", 125e6), ("350m", 350e6), ("1.3b", 1.3e9), ("7b", 6.7e9), ("13b", 13e9)]
)
def test_gpt_param_counts_match_gpt3_table(size, published):
    assert config_for(f"gpt:{size}").param_count() == pytest.approx(published, rel=0.03)


def _llama_closed_form(cfg, experts: int = 0) -> int:
    L, h, f, V = cfg.num_layers, cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    kv = cfg.num_kv_heads * (h // cfg.num_heads)
    mlp = 3 * h * f if not experts else experts * 3 * h * f + h * experts
    return L * (2 * h * h + 2 * h * kv + mlp + 2 * h) + 2 * V * h + h + (h + 1)


@pytest.mark.parametrize(
    "spec,published",
    [("llama:7b", 6.74e9), ("llama:13b", 13.0e9), ("llama:70b", 69.0e9), ("moe:8x7b", 46.7e9)],
)
def test_llama_and_moe_counts_match_closed_form_and_published(spec, published):
    cfg = config_for(spec)
    assert cfg.param_count() == _llama_closed_form(cfg, getattr(cfg, "num_experts", 0))
    assert cfg.param_count() == pytest.approx(published, rel=0.01)


def test_mixtral_active_params():
    assert config_for("moe:8x7b").active_param_count() == pytest.approx(12.9e9, rel=0.01)


def test_list_models_covers_registry_with_counts():
    entries = list_models()
    assert [e.spec for e in entries] == ALL_SPECS
    assert all(e.params == config_for(e.spec).param_count() and e.description for e in entries)


# ---------------------------------------------------------------- build ---


def test_default_devices_and_dtype():
    assert default_device("gpt:350m").type == "cpu" and default_device("moe:8x7b").type == "meta"
    assert next(build("llama:7b").parameters()).device.type == "meta"
    model = build("llama", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(_tokens(1, 4))[0].dtype == torch.bfloat16


def test_tied_embeddings_survive_materialisation():
    gpt = build("gpt")
    assert gpt.head.weight is gpt.embed.weight
    assert "head.weight" not in dict(gpt.named_parameters())
    llama = build("llama")
    assert llama.head.weight is not llama.embed.weight
    tied = build("llama", tie_embeddings=True)
    assert tied.head.weight is tied.embed.weight
    assert tied.config.param_count() == llama.config.param_count() - 128 * 64


@pytest.mark.slow
def test_seeded_init_is_deterministic_and_scaled():
    a, b, c = build("moe", seed=3), build("moe", seed=3), build("moe", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.numel() > 1 and "norm" not in name and "bias" not in name:
            assert not torch.equal(pa, pc), name
    big = build("gpt", num_layers=8, hidden=256, num_heads=4)
    residual_std = big.blocks[0].attn.o.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert big.blocks[0].attn.q.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(big.blocks[0].attn_norm.weight, torch.ones(256))


def test_overrides_apply():
    model = build("llama", num_layers=3, dropout=0.1, attn_impl="math")
    assert len(model.blocks) == 3 and model.config.dropout == 0.1
    assert model.blocks[0].attn.attn_impl == "math"
    assert config_for("gpt:125m", hidden=512, num_heads=8).ffn_hidden == 4 * 512


# -------------------------------------------------------------- TP roles ---


@pytest.mark.parametrize("spec", ["gpt:tiny", "llama:tiny", "moe:tiny", "llama:70b", "moe:8x7b"])
def test_tp_roles_cover_every_parameter(spec):
    model = build(spec)
    roles = model.tp_roles()
    assert list(roles) == [name for name, _ in model.named_parameters()]
    assert set(roles.values()) <= set(TP_ROLES)


def test_tp_roles_by_module():
    gpt = build("gpt").tp_roles()
    assert gpt["embed.weight"] == "vocab" and gpt["pos_embed.weight"] == "replicate"
    assert gpt["blocks.0.attn.q.bias"] == "column" and gpt["blocks.1.attn.o.weight"] == "row"
    assert gpt["blocks.0.attn.o.bias"] == "replicate" and gpt["blocks.0.mlp.down.bias"] == "replicate"
    assert gpt["blocks.0.mlp.up.bias"] == "column" and gpt["norm.bias"] == "replicate"
    llama = build("llama").tp_roles()
    assert llama["head.weight"] == "vocab" and llama["blocks.0.mlp.gate.weight"] == "column"
    moe = build("moe").tp_roles()
    assert moe["blocks.1.moe.w_down"] == "expert" and moe["blocks.1.moe.router.weight"] == "replicate"
    assert moe["value_head.weight"] == "replicate"


# ---------------------------------------------------------------- export ---


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.slow
def test_export_with_dynamic_batch_and_seq(family, strict):
    overrides = {"capacity_factor": 1.5} if family == "moe" else {}
    model = build(family, **overrides)
    dims = ({0: Dim("batch"), 1: Dim("seq", max=model.config.max_seq_len)},)
    program = export(model, (_tokens(2, 8),), dynamic_shapes=dims, strict=strict)
    other = _tokens(3, 13)
    torch.testing.assert_close(program.module()(other), model(other), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------- KV cache ---


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("attn_impl", ["math", "sdpa"])
def test_kv_cache_decoding_matches_full_forward(family, attn_impl):
    model = build(family, attn_impl=attn_impl).eval()
    tokens = _tokens(2, 12)
    with torch.no_grad():
        full_logits, full_values = model(tokens)
        cache = model.new_cache(batch=2, max_len=16)
        steps = [model(tokens[:, :5], cache=cache, start_pos=0)]
        steps += [model(tokens[:, i : i + 1], cache=cache, start_pos=i) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat([s[0] for s in steps], 1), full_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([s[1] for s in steps], 1), full_values, rtol=1e-5, atol=1e-5)


def test_kv_cache_overflow_is_a_model_error():
    model = build("llama")
    cache = model.new_cache(batch=1, max_len=4)
    with pytest.raises(ModelError, match=r"max_len=4.*new_cache"):
        model(_tokens(1, 3), cache=cache, start_pos=2)


# ------------------------------------------------------------------- MoE ---


def _naive_moe(moe: MoE, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Token-by-token loop with the documented drop order (slot-major, then token order)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = (tokens @ moe.router.weight.t()).softmax(-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    load = [0] * moe.num_experts
    out = torch.zeros_like(tokens)
    for j in range(moe.top_k):
        for t in range(tokens.shape[0]):
            e = int(top_e[t, j])
            if load[e] >= capacity:
                continue
            load[e] += 1
            hidden = F.silu(moe.w_gate[e] @ tokens[t]) * (moe.w_up[e] @ tokens[t])
            out[t] += top_p[t, j] * (moe.w_down[e] @ hidden)
    return out.view_as(x)


def _moe_layer(capacity_factor):
    model = build("moe", capacity_factor=capacity_factor, num_experts=4, top_k=2, seed=5)
    return model.blocks[0].moe


def test_moe_dropless_matches_naive_loop():
    moe = _moe_layer(None)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, capacity=18), rtol=1e-5, atol=1e-6)
    assert bool(moe.route(x.reshape(-1, 64)).kept.all())


def test_moe_capacity_drops_in_documented_order():
    moe = _moe_layer(0.5)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0))
    capacity = expert_capacity(18, 4, 2, 0.5)  # ⌈0.5·2·18/4⌉ = 5
    assert capacity == 5
    routing = moe.route(x.reshape(-1, 64))
    assert not bool(routing.kept.all())
    kept_per_expert = torch.bincount(routing.experts[routing.kept], minlength=4)
    assert int(kept_per_expert.max()) <= capacity
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, capacity), rtol=1e-5, atol=1e-6)


def test_moe_large_capacity_equals_dropless():
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_moe_layer(2.0)(x), _moe_layer(None)(x))  # 2.0 ≥ E/k: C = T


def test_expert_capacity_formula():
    assert expert_capacity(100, 8, 2, None) == 100
    assert expert_capacity(100, 8, 2, 1.25) == math.ceil(1.25 * 2 * 100 / 8)
    assert expert_capacity(100, 8, 2, 10.0) == 100


def test_moe_aux_loss_is_differentiable():
    model = build("moe")
    logits, values, aux = model.forward_with_aux(_tokens(2, 8))
    torch.testing.assert_close(logits, model(_tokens(2, 8))[0])
    assert aux.shape == () and 0.0 < aux.item() <= model.config.num_experts  # E·Σ f·P with Σf = ΣP = 1
    aux.backward()
    assert model.blocks[0].moe.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- errors ---


def test_parse_spec_defaults_and_normalises():
    assert parse_spec("llama") == ("llama", "tiny")
    assert parse_spec(" GPT:1.3B ") == ("gpt", "1.3b")


@pytest.mark.parametrize(
    "spec,pattern",
    [
        ("bert:tiny", r"'bert'.*allowed: gpt, llama, moe.*autoshard models"),
        ("moe:7b", r"'7b'.*'moe'.*allowed: tiny, 8x7b.*autoshard models"),
        ("", r"empty.*autoshard models"),
    ],
)
def test_bad_spec_errors(spec, pattern):
    with pytest.raises(ModelError, match=pattern):
        build(spec)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        ({"num_experts": 4}, r"unknown GPTConfig field.*num_experts.*allowed:.*hidden"),
        ({"num_heads": 5}, r"hidden=64 is not divisible by num_heads=5"),
        ({"attn_impl": "flash"}, r"attn_impl='flash'.*math.*sdpa"),
        ({"dropout": 1.5}, r"dropout=1.5"),
        ({"num_layers": 0}, r"num_layers=0.*positive integer"),
    ],
)
def test_bad_gpt_overrides(overrides, pattern):
    with pytest.raises(ModelError, match=pattern):
        build("gpt", **overrides)


@pytest.mark.parametrize(
    "spec,overrides,pattern",
    [
        ("llama", {"num_kv_heads": 3}, r"num_heads=4 is not divisible by num_kv_heads=3"),
        ("moe", {"top_k": 5}, r"top_k=5 exceeds num_experts=4"),
        ("moe", {"capacity_factor": 0}, r"capacity_factor=0.*None for dropless"),
    ],
)
def test_bad_llama_and_moe_overrides(spec, overrides, pattern):
    with pytest.raises(ModelError, match=pattern):
        config_for(spec, **overrides)


def test_model_error_is_a_value_error():
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=10, max_seq_len=8, hidden=30, num_layers=1, num_heads=4)
