"""Rollout sampling: KV cache vs recompute, stopping at <eos>, top-p, temperature, errors."""

from __future__ import annotations

import pytest
import torch

from autoshard.models import build
from autoshard.runtime import ppo_losses as L
from autoshard.runtime.ppo_engine import ModuleEngine
from autoshard.runtime.rollout import RolloutError, SamplingConfig, generate, top_p_filter

EOS, PAD = 1, 0


from _harness import one_intra_op_thread  # noqa: E402,F401 - autouse: one intra-op thread


class _NoCache(ModuleEngine):
    """The same model, but rollout must recompute every prefix."""

    def new_cache(self, batch, max_len):
        return None


class _FixedLogits:
    """An engine whose next-token logits ignore the input; ``eos_at`` forces <eos> at step k per row."""

    max_seq_len = 64

    def __init__(self, logits: torch.Tensor, eos_at: list[int] | None = None, prompt_len: int = 2) -> None:
        self.logits, self.eos_at, self.prompt_len = logits, eos_at, prompt_len

    def new_cache(self, batch, max_len):
        return None

    def forward(self, tokens, *, cache=None, start_pos=0):
        n, seq = tokens.shape
        logits = self.logits.expand(n, seq, -1).clone()
        if self.eos_at is not None:
            step = seq - self.prompt_len
            for row, k in enumerate(self.eos_at):
                if step == k:
                    logits[row, -1] = -1e9
                    logits[row, -1, EOS] = 0.0
                else:
                    logits[row, -1, EOS] = -1e9
        return logits, torch.zeros(n, seq)


@pytest.fixture(scope="module")
def model():
    return build("llama:tiny", vocab_size=16, max_seq_len=32)


def test_cached_and_recomputed_decoding_agree(model):
    prompts = torch.randint(2, 16, (6, 5), generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.9)
    runs = [
        generate(engine, prompts, sampling, eos_id=EOS, pad_id=PAD, generator=torch.Generator().manual_seed(1))
        for engine in (ModuleEngine(model, None), _NoCache(model, None))
    ]
    assert torch.equal(runs[0].responses, runs[1].responses)
    torch.testing.assert_close(runs[0].sample_logprobs, runs[1].sample_logprobs, atol=1e-5, rtol=0)


def test_sample_logprobs_match_a_full_forward(model):
    prompts = torch.randint(2, 16, (4, 5), generator=torch.Generator().manual_seed(2))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7)
    out = generate(ModuleEngine(model, None), prompts, sampling, eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, _ = model(out.tokens[:, :-1])
    resp_len = out.responses.shape[1]
    logp, _ = L.token_logprobs(L.response_logits(logits, 5, resp_len), out.responses, 0.7)
    torch.testing.assert_close(logp * out.response_mask, out.sample_logprobs, atol=1e-5, rtol=0)


def test_each_sequence_stops_after_its_eos_and_decoding_ends_when_all_stop():
    engine = _FixedLogits(torch.zeros(8), eos_at=[0, 2, 1])
    prompts = torch.full((3, 2), 5)
    out = generate(engine, prompts, SamplingConfig(max_new_tokens=10), eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert out.responses.shape == (3, 3)  # the longest response is 3 tokens: decoding ended early
    expected_mask = torch.tensor([[1.0, 0, 0], [1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(out.response_mask, expected_mask)
    assert out.responses[0, 0] == EOS and out.responses[1, 2] == EOS and out.responses[2, 1] == EOS
    assert bool((out.responses[expected_mask == 0] == PAD).all())
    assert bool((out.sample_logprobs[expected_mask == 0] == 0).all())
    torch.testing.assert_close(out.lengths, torch.tensor([1.0, 3, 2]))


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(top_p_filter(probs, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert top_p_filter(probs, 1.0) is probs


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -1e9, -1e9])  # ids 4, 5 never drawn; no <eos> (id 1 ok)
    engine = _FixedLogits(logits)
    prompts = torch.full((4000, 2), 3)
    out = generate(engine, prompts, SamplingConfig(max_new_tokens=1, temperature=2.0), eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out.responses[:, 0], minlength=6).float() / 4000
    expected = (logits / 2.0).softmax(-1)
    assert float((freq - expected).abs().max()) < 0.03  # 4000 draws: binomial std ≤ 0.008
    top = generate(engine, prompts[:500], SamplingConfig(max_new_tokens=1, top_p=0.5), eos_id=EOS, pad_id=PAD,
                   generator=torch.Generator().manual_seed(0))
    assert bool((top.responses == 0).all())  # softmax([2, 1, 0, -1])[0] = 0.64 ≥ 0.5: only id 0 survives


def test_sampling_errors_name_the_value(model):
    with pytest.raises(RolloutError, match="temperature=0"):
        SamplingConfig(temperature=0)
    with pytest.raises(RolloutError, match=r"top_p=1.5; allowed range \(0, 1\]"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(RolloutError, match="max_new_tokens=0"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(RolloutError, match="exceeds the policy's max_seq_len 32"):
        generate(ModuleEngine(model, None), torch.zeros(1, 30, dtype=torch.long), SamplingConfig(max_new_tokens=4),
                 eos_id=EOS, pad_id=PAD)
