"""``autoshard.models.hf``: an actor-critic over a Hugging Face causal LM as the user has it
(``from_causal_lm``: e.g. ``LlamaForCausalLM.from_pretrained`` of a local directory) computes the
model's own logits with its own parameters and ties, plus a value head; ``actor_critic(config)``
builds one from a config on meta. Tiny random configs, CPU, fp32."""

from __future__ import annotations

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
