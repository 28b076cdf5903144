"""``autoshard.rl``: user prompts and rewards, GRPO beside PPO, and ``autoshard ppo --prompts --reward``.

* a tiny policy learns a user reward (the fraction of ``7`` in its response) with GRPO and with PPO on one
  CPU process through ``rl.train`` (seeded; margins measured below);
* GRPO advantages equal (r − mean_group) / (std_group + eps) on a hand-made group; sequence-level loss weights;
* the prompt loader and bad inputs, bad reward outputs and long prompts give one-line errors;
* the CLI path trains 3 GRPO steps on a JSONL file with a reward module from ``PYTHONPATH`` (one gloo rank).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from autoshard import rl
from autoshard.errors import AutoshardError
from autoshard.cli import main as cli_main
from autoshard.runtime import ppo_losses as L
from autoshard.runtime.metrics import read_metrics
from autoshard.runtime.ppo import PPOConfig, PPOConfigError
from autoshard.runtime.rl_reward import score

LEARN_STEPS = 20
# Measured (seed 0, batch 32, 8 new tokens, 20 steps): mean reward of the first 5 steps → the last 5:
# GRPO 0.163 → 0.668, PPO 0.148 → 0.399; a random policy stays near 1/16 of its tokens.
LEARN_MARGIN = {"grpo": 0.3, "ppo": 0.15}


from _harness import one_intra_op_thread  # noqa: E402,F401 - autouse: one intra-op thread


def sevens(prompts, responses, references, response_ids):
    """The user's reward: the fraction of ``7`` in each response."""
    return [r.count("7") / max(len(r), 1) for r in responses]


def _sums():
    return [{"prompt": f"{a}+{b}=", "reference": str(a + b)} for a in range(10) for b in range(10)]


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.slow
def test_a_tiny_policy_learns_a_user_reward(algo):
    options = rl.RLOptions(algo=algo, samples_per_prompt=4 if algo == "grpo" else None, max_new_tokens=8)
    history = rl.train("llama:tiny", _sums(), sevens, steps=LEARN_STEPS, options=options, batch=32, live=False)
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= LEARN_MARGIN[algo], [round(r, 3) for r in rewards]
    assert (algo == "grpo") == math.isnan(history[-1]["value/explained_var"])


@pytest.mark.slow
def test_an_interrupted_grpo_run_resumes_exactly(tmp_path):
    """Policy, optimizer moments, step and the prompts drawn: 2 steps, a checkpoint, 2 more equal 4 in one go."""
    options = rl.RLOptions(algo="grpo", samples_per_prompt=4, max_new_tokens=6)
    common = dict(options=options, batch=16, live=False)
    whole = rl.train("llama:tiny", _sums(), sevens, steps=4, **common)
    rl.train("llama:tiny", _sums(), sevens, steps=2, checkpoint=tmp_path / "ckpt", **common)
    resumed = rl.train("llama:tiny", _sums(), sevens, steps=4, checkpoint=tmp_path / "ckpt", resume=True, **common)
    assert len(resumed) == 2
    for key in ("reward/mean", "kl/k1", "policy/entropy", "policy/clip_frac", "grad/norm", "response/length"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in whole[2:]], rel=1e-5, abs=1e-7), key
    with pytest.raises(AutoshardError, match="checkpoint=DIR"):
        rl.train("llama:tiny", _sums(), sevens, steps=1, resume=True, **common)


# --------------------------------------------------------------------------- algorithm math


def test_grpo_advantages_follow_the_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # two groups of 4
    eps = 1e-6
    adv = L.group_advantages(rewards, 4, eps)
    first = torch.tensor([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(sum((x - 0.5) ** 2 for x in first.tolist()) / 3)  # unbiased
    torch.testing.assert_close(adv[:4], (first - 0.5) / (std + eps))
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: no signal


def test_sequence_aggregation_weighs_each_response_once():
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])
    assert torch.equal(L.loss_weights(mask, "token"), mask)
    torch.testing.assert_close(L.loss_weights(mask, "sequence").sum(1), torch.ones(2))


def test_algorithm_options_are_checked():
    with pytest.raises(PPOConfigError, match="at least 2 responses per prompt"):
        PPOConfig(algo="grpo", samples_per_prompt=1)
    with pytest.raises(PPOConfigError, match="samples_per_prompt=3 does not divide rollout_batch=8"):
        PPOConfig(rollout_batch=8, algo="grpo", samples_per_prompt=3)
    with pytest.raises(PPOConfigError, match="algo='dpo'; allowed: ppo, grpo"):
        PPOConfig(algo="dpo")


# --------------------------------------------------------------------------- prompts and tokenizers


def test_prompt_files_and_bad_inputs_are_one_line_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+2=", "reference": "3"}\n\n"4+4="\n')
    assert rl.load_prompts(path) == [rl.PromptExample("1+2=", "3"), rl.PromptExample("4+4=")]
    assert rl.load_prompts(["2+2=", {"prompt": "1+1=", "reference": 2}])[1].reference == "2"
    cases = [
        (tmp_path / "absent.jsonl", None, "does not exist"),
        (tmp_path / "bad.jsonl", '{"prompt": "1+2="}\n{"prompt": \n', "bad.jsonl:2: not valid JSON"),
        (tmp_path / "nokey.jsonl", '{"question": "1+2="}\n', 'nokey.jsonl:1: no "prompt" key (keys: question)'),
        (tmp_path / "empty.jsonl", "\n", "holds no prompts"),
    ]
    for file, text, needle in cases:
        if text is not None:
            file.write_text(text)
        with pytest.raises(rl.PromptDataError, match=None) as info:
            rl.load_prompts(file)
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_tokenizers_and_long_prompts():
    class Duck:  # a Hugging Face-like tokenizer: encode/decode and the special ids, no hub
        eos_token_id, pad_token_id = 1, None

        def __len__(self):
            return 300

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    duck = rl.as_tokenizer(Duck())
    assert (duck.vocab_size, duck.eos_id, duck.pad_id) == (300, 1, 1) and duck.decode(duck.encode("hi")) == "hi"
    assert rl.as_tokenizer("bytes").decode(rl.as_tokenizer("bytes").encode("héllo")) == "héllo"
    char = rl.as_tokenizer("char")
    examples = [rl.PromptExample("12+34="), rl.PromptExample("1+1=")]
    with pytest.raises(rl.PromptDataError, match="1 of 2 prompts are longer than the 4-token budget.*prompt 0"):
        rl.PromptTask(examples, char, sevens, budget=4, max_new_tokens=8)
    task = rl.PromptTask(examples, char, sevens, budget=4, max_new_tokens=8, long_prompts="truncate")
    assert task.notice == "prompts: 1 of 2 longer than 4 tokens, cut to their last 4 (first: prompt 0)"
    assert task.prompt_tokens.tolist() == [char.encode("+34="), char.encode("1+1=")]  # left-padded, tail kept
    with pytest.raises(rl.PromptDataError, match="prompt 1: character 'x'"):
        rl.PromptTask([rl.PromptExample("1"), rl.PromptExample("x=")], char, sevens, budget=8, max_new_tokens=8)


# --------------------------------------------------------------------------- rewards


def test_bad_reward_outputs_name_the_prompt_index():
    batch = (["1+2=", "3+4="], ["3", "x"], ["3", None], [[5, 1], [1]], [17, 42])

    def raises_on_42(prompts, responses, references, ids):
        return [float(r) for r in responses]  # "x" fails

    cases = [
        (raises_on_42, "raised ValueError: could not convert string to float: 'x' on prompt 42"),
        (lambda *a: [1.0], "returned 1 values for 2 responses (prompts 17, 42)"),
        (lambda *a: [1.0, float("nan")], "returned nan for prompt 42"),
        (lambda *a: [1.0, "good"], "returned 'good' for prompt 42"),
        (rl.arithmetic_reward, "needs a numeric reference, got None on prompt 42"),
    ]
    for fn, needle in cases:
        with pytest.raises(rl.RewardError) as info:
            score(fn, *batch)
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert rl.arithmetic_reward(["1+2=", "2+2="], ["3", "it is 5"], ["3", "4"]) == [1.0, 0.0]
    with pytest.raises(rl.RewardError, match="has no function 'nope'"):
        rl.load_reward("autoshard.rl:nope")
    assert rl.load_reward("autoshard.rl:arithmetic_reward") is rl.arithmetic_reward


# --------------------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_trains_grpo_on_a_prompt_file(tmp_path, monkeypatch, capfd):
    prompts = tmp_path / "sums.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in _sums()[:20]))
    (tmp_path / "my_reward.py").write_text(
        "def sevens(prompts, responses, references, response_ids):\n"
        "    return [r.count('7') / max(len(r), 1) for r in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    metrics = tmp_path / "m.jsonl"
    code = cli_main(["ppo", "llama:tiny", "--cluster", "cpu:1x1", "--prompts", str(prompts), "--reward",
                     "my_reward:sevens", "--algo", "grpo", "--steps", "3", "--batch", "8", "--quiet",
                     "--max-new-tokens", "6", "--metrics", str(metrics)])
    out = capfd.readouterr().out
    assert code == 0, out
    rows = read_metrics(metrics)
    assert [row["step"] for row in rows] == [1, 2, 3] and all(math.isfinite(r["reward/mean"]) for r in rows)
    assert "samples per prompt: 4 (GRPO" in out


def test_cli_refuses_a_reward_without_prompts_in_one_line(capsys):
    assert cli_main(["ppo", "llama:tiny", "--cluster", "cpu:1x1", "--reward", "m:f"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: --reward needs --prompts") and len(err.splitlines()) == 1


def test_rl_flags_reach_the_workers_and_a_foreign_reference_is_refused(tmp_path):
    import argparse
    from pathlib import Path

    from autoshard import cli_ppo
    from autoshard.errors import ModelError
    from autoshard.runtime.ppo_program import load_policy, load_reference, run_from_args, worker_arguments

    cli, worker = argparse.ArgumentParser(), argparse.ArgumentParser()
    cli_ppo.add_ppo_arguments(cli)
    worker_arguments(worker)
    args = cli.parse_args(["llama:tiny", "--cluster", "cpu:1x2", "--prompts", "p.jsonl", "--reward", "r.py:fn",
                           "--algo", "grpo", "--samples-per-prompt", "8", "--loss-agg", "sequence", "--stop", ",",
                           "--top-p", "0.9", "--long-prompts", "truncate"])
    run = run_from_args(worker.parse_args(cli_ppo._worker_flags(args, "llama:tiny", Path("plan.json"))))
    assert run.data.prompts == str(Path("p.jsonl").absolute()) and run.data.reward == f"{Path('r.py').absolute()}:fn"
    assert run.data.long_prompts == "truncate"
    assert (run.rl.algo, run.rl.group(), run.rl.loss_agg, run.rl.stop, run.rl.top_p) == ("grpo", 8, "sequence", (",",), 0.9)
    policy = load_policy("llama:tiny", 0, "meta")
    with pytest.raises(ModelError, match="reference 'gpt:tiny' does not match the policy: parameter"):
        load_reference("gpt:tiny", policy.module, 0, "meta")
