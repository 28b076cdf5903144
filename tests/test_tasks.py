"""Character tasks: fixed-length prompts, correct answers score 1, bad rewards and vocabularies are refused."""

from __future__ import annotations

import pytest
import torch

from autoshard.runtime.tasks import (
    EOS_ID,
    VOCAB,
    TaskError,
    check_rewards,
    check_vocab,
    decode,
    encode,
    get_task,
    list_tasks,
)


def _total(task, prompts, responses, mask):
    seq, tok = task.rewards(prompts, responses, mask)
    check_rewards(task.name, seq, tok, tuple(responses.shape))
    return seq + (0 if tok is None else tok.sum(1))


def test_registry_lists_three_tasks_and_vocab_is_16_tokens():
    assert list_tasks() == ["addition", "arithmetic", "sorting"]
    assert len(VOCAB) == 16


@pytest.mark.parametrize("name", ["arithmetic", "sorting", "addition"])
def test_prompts_fixed_length_in_vocab_and_seeded(name):
    task = get_task(name)
    a = task.sample_prompts(32, torch.Generator().manual_seed(3))
    b = task.sample_prompts(32, torch.Generator().manual_seed(3))
    assert a.shape == (32, task.prompt_len) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert int(a.min()) >= 2 and int(a.max()) < len(VOCAB)  # no specials inside prompts


@pytest.mark.parametrize("name", ["arithmetic", "sorting", "addition"])
def test_correct_answers_score_one_and_wrong_ones_less(name):
    task = get_task(name)
    prompts = task.sample_prompts(64, torch.Generator().manual_seed(0))
    targets = task.targets(prompts)
    assert targets.shape[1] == task.max_response_len and bool((targets[:, -1] == EOS_ID).all())
    mask = torch.ones_like(targets, dtype=torch.float32)
    torch.testing.assert_close(_total(task, prompts, targets, mask), torch.ones(64))
    wrong = targets.clone()
    wrong[:, 0] = (wrong[:, 0] - 2 + 1) % 10 + 2  # change the first digit
    total = _total(task, prompts, wrong, mask)
    assert bool((total < 1).all()) and bool((total >= 0).all())


def test_known_examples():
    arith = get_task("arithmetic")
    assert decode(arith.targets(torch.tensor([encode("3,5,7,")]))[0]) == "9,1,"
    assert decode(arith.targets(torch.tensor([encode("3,2,1,")]))[0]) == "0,9,"
    assert decode(get_task("sorting").targets(torch.tensor([encode("3142:")]))[0]) == "1234"
    assert decode(get_task("addition").targets(torch.tensor([encode("42+79=")]))[0]) == "121"
    assert decode(get_task("addition", digits=3).targets(torch.tensor([encode("042+117=")]))[0]) == "0159"


def test_arithmetic_dense_reward_is_per_position_and_masked():
    task = get_task("arithmetic")
    prompts = torch.tensor([encode("3,5,7,")])
    responses = torch.tensor([encode("9,2,") + [EOS_ID]])  # second term wrong
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])  # pretend the <eos> was never reached
    seq, tok = task.rewards(prompts, responses, mask)
    torch.testing.assert_close(tok, torch.tensor([[0.2, 0.2, 0.0, 0.2, 0.0]]))
    assert float(seq) == 0.0


def test_empty_response_gets_its_reward_on_the_eos_token():
    task = get_task("sorting")
    prompts = task.sample_prompts(4, torch.Generator().manual_seed(0))
    responses = torch.zeros(4, task.max_response_len, dtype=torch.long)
    responses[:, 0] = EOS_ID
    mask = torch.zeros(4, task.max_response_len)
    mask[:, 0] = 1
    seq, tok = task.rewards(prompts, responses, mask)
    assert tok is None and bool((seq == 0).all())


def test_vocab_check_names_the_sizes():
    check_vocab(get_task("arithmetic"), 16)
    with pytest.raises(TaskError, match=r"vocab_size=8 .*vocab_size >= 16"):
        check_vocab(get_task("arithmetic"), 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_are_refused(bad):
    seq = torch.tensor([0.5, bad])
    with pytest.raises(TaskError, match="non-finite seq_reward"):
        check_rewards("t", seq, None, (2, 3))
    tok = torch.zeros(2, 3)
    tok[1, 2] = bad
    with pytest.raises(TaskError, match="non-finite token_reward"):
        check_rewards("t", torch.zeros(2), tok, (2, 3))


def test_wrong_reward_shape_is_refused():
    with pytest.raises(TaskError, match=r"shape \(3,\); expected \(2,\)"):
        check_rewards("t", torch.zeros(3), None, (2, 3))


def test_registry_and_option_errors():
    with pytest.raises(TaskError, match="unknown task 'nope'; allowed: addition, arithmetic, sorting"):
        get_task("nope")
    with pytest.raises(TaskError, match="rejected options"):
        get_task("sorting", digits=3)
    with pytest.raises(TaskError, match="max_step"):
        get_task("arithmetic", max_step=10)
    with pytest.raises(TaskError, match="'x'"):
        encode("1x")
    with pytest.raises(TaskError, match="n=0"):
        get_task("addition").sample_prompts(0, torch.Generator())


def test_wide_arithmetic_uses_fixed_width_terms():
    task = get_task("arithmetic", modulus=100, max_step=30)
    prompts = task.sample_prompts(16, torch.Generator().manual_seed(1))
    assert prompts.shape == (16, 9)  # 3 terms × ("dd,")
    assert decode(task.targets(torch.tensor([encode("95,97,99,")]))[0]) == "01,03,"
