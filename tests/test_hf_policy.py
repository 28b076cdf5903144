"""``autoshard.models.hf``: an actor-critic over a Hugging Face causal LM as the user has it
(``from_causal_lm``: e.g. ``LlamaForCausalLM.from_pretrained`` of a local directory) computes the
model's own logits with its own parameters and ties, plus a value head; ``actor_critic(config)``
builds one from a config on meta. Tiny random configs, CPU, fp32."""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoshard.errors import ModelError  # noqa: E402
from autoshard.models.hf import actor_critic, from_causal_lm  # noqa: E402

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=64)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


def _tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def test_a_pretrained_directory_wrapped_keeps_its_logits_and_parameters(tmp_path):
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    saved.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    expected = saved(_tokens()).logits
    policy = from_causal_lm(loaded)
    logits, values = policy(_tokens())
    assert torch.equal(logits, expected) and values.shape == (2, 16)
    assert policy.model is loaded.model and policy.lm_head is loaded.lm_head
    names = {n for n, _ in policy.named_parameters()}
    assert names == {f"model.{n}" for n, _ in loaded.model.named_parameters()} | {"lm_head.weight", "value_head.weight",
                                                                                   "value_head.bias"}
    again = from_causal_lm(transformers.LlamaForCausalLM.from_pretrained(tmp_path))
    assert torch.equal(again.value_head.weight, policy.value_head.weight)  # seeded: the same head every time
    assert torch.equal(policy.value_head.bias, torch.zeros(1))


def test_tied_heads_stay_tied():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    policy = from_causal_lm(model)
    assert policy.lm_head.weight is model.transformer.wte.weight
    assert torch.allclose(policy(_tokens())[0], model(_tokens()).logits, atol=1e-6)


def test_configs_build_on_meta_and_bad_models_are_refused():
    policy = actor_critic(transformers.LlamaConfig(**LLAMA))
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in policy.parameters())
    assert not any(b.is_meta for b in policy.buffers())  # rotary tables on the CPU
    with pytest.raises(ModelError, match="model_type 'bert' has no actor-critic policy here"):
        from_causal_lm(transformers.BertModel(transformers.BertConfig(hidden_size=64, num_hidden_layers=1,
                                                                      num_attention_heads=4, intermediate_size=128)))
    with pytest.raises(ModelError, match="expected a causal LM with a trunk"):
        from_causal_lm(transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)))


def test_scaled_rope_tables_on_meta_are_hf_own():
    """A Llama-3-style config (rope_type llama3) builds on meta with the rotary table HF computes for it."""
    config = transformers.LlamaConfig(**LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 32})
    policy = actor_critic(config)
    reference = transformers.LlamaForCausalLM(config).model.rotary_emb
    assert reference.rope_type == "llama3"
    assert torch.equal(policy.model.rotary_emb.inv_freq, reference.inv_freq)
    assert policy.model.rotary_emb.attention_scaling == reference.attention_scaling


# --------------------------------------------------------------------------- HF weights under a sharded plan (gloo)


def _forward_from_hf_files(rank, world_size, directory, state):
    """An actor-critic built on meta from ``directory``'s config, its weights read slice-wise from the HF files
    and the value head (which they lack) initialised: logits and values of a fixed batch under ``state``."""
    from autoshard.models.hf import load_hf_config
    from autoshard.passes import capture
    from autoshard.plan import LayerStrategy, Mesh, Plan
    from autoshard.runtime import BuildOptions, build_program
    from autoshard.runtime.materialize import Initialize, Layered, Safetensors
    from autoshard.train import TrainSpec

    del rank
    policy = actor_critic(load_hf_config(directory), dtype=torch.float32)
    graph = capture(policy, seq_lens=(8, 16))
    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=world_size),
                layers=tuple(LayerStrategy(layer=layer.name, state=state) for layer in graph.layers))
    program = build_program(policy, graph, plan, TrainSpec(global_batch=2 * world_size, seq_len=16,
                                                                 precision="fp32"),
                            weights=Layered(Safetensors(directory), Initialize(0)), options=BuildOptions(compile=False))
    with torch.no_grad():
        logits, values = program(_tokens())
    return {"logits": logits, "values": values}


@pytest.mark.slow
def test_hf_files_fill_a_sharded_plan_and_the_value_head_is_initialised(tmp_path):
    from _harness import run_gloo_cases

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    model.save_pretrained(tmp_path)
    expected = model(_tokens()).logits
    results = run_gloo_cases({state: functools.partial(_forward_from_hf_files, directory=str(tmp_path), state=state)
                              for state in ("replicate", "zero3")}, 2, timeout_s=300)
    reference_values = from_causal_lm(model)(_tokens())[1]  # the same seeded value head
    for state, per_rank in results.items():
        for out in per_rank:
            assert torch.allclose(out["logits"], expected, atol=1e-5), state
            assert torch.allclose(out["values"], reference_values, atol=1e-5), state


def test_layered_sources_refuse_what_they_cannot_do(tmp_path):
    from autoshard.runtime.materialize import Initialize, Layered, Safetensors, WeightsError

    with pytest.raises(WeightsError, match="two or more"):
        Layered(Initialize(0))
    policy = actor_critic(transformers.LlamaConfig(**LLAMA), dtype=torch.float32)
    with pytest.raises(WeightsError, match="cannot say which parameters it holds"):
        Layered(Initialize(0), Safetensors(tmp_path)).bind(policy)


# --------------------------------------------------------------------------- padding and packed rows


def _padded():
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 11:] = 0  # right padding
    mask[1, :4] = 0  # left padding
    return _tokens(), mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_padded_rows_give_the_hf_models_logits_on_their_tokens(family):
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)) if family == "llama"
             else transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))).eval()
    policy = from_causal_lm(model)
    tokens, mask = _padded()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # what HF's generate gives left-padded rows
    ours = policy(tokens, attention_mask=mask, position_ids=position_ids)[0]
    theirs = model(tokens, attention_mask=mask, position_ids=position_ids).logits
    keep = mask.bool()
    assert torch.allclose(ours[keep], theirs[keep], atol=1e-5)
    assert torch.allclose(policy(tokens)[0], policy(tokens, attention_mask=torch.ones_like(mask))[0], atol=1e-5)


def test_packed_rows_attend_within_their_documents():
    """position_ids restarting at 0 start a new document: each document's logits are those it has alone."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    policy = from_causal_lm(model)
    tokens = _tokens()[:1]  # [1, 16]: documents of 6, 7 and 3 tokens
    lengths = (6, 7, 3)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = policy(tokens, position_ids=position_ids)[0]
    start = 0
    for n in lengths:
        alone = model(tokens[:, start:start + n]).logits
        assert torch.allclose(packed[:, start:start + n], alone, atol=1e-5)
        start += n


@pytest.mark.slow
def test_a_masked_policy_captures_on_meta():
    from autoshard.passes import capture

    policy = actor_critic(transformers.LlamaConfig(**LLAMA))
    tokens, mask = _padded()
    graph = capture(policy, {"input_ids": tokens, "attention_mask": mask}, seq_lens=(8, 16))
    plain = capture(policy, seq_lens=(8, 16))
    assert [layer.name for layer in graph.layers] == [layer.name for layer in plain.layers]


@pytest.mark.parametrize("config_class, model_class", [("MistralConfig", "MistralForCausalLM"),
                                                       ("Qwen3Config", "Qwen3ForCausalLM")])
def test_mistral_and_qwen3_keep_their_logits(config_class, model_class):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**LLAMA, head_dim=16)
    model = getattr(transformers, model_class)(config).eval()
    assert torch.allclose(from_causal_lm(model)(_tokens())[0], model(_tokens()).logits, atol=1e-5)
    assert all(p.is_meta for p in actor_critic(config).parameters())
