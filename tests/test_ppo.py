"""PPO: loss math, batching invariance (micro-batch, data parallel), errors, metrics, and a learning run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autoshard.models import build
from autoshard.runtime import ppo_losses as L
from autoshard.runtime.metrics import MetricsWriter, format_summary, read_metrics
from autoshard.runtime.ppo import PPOConfig, PPOConfigError, PPOTrainer
from autoshard.runtime.ppo_engine import EngineError, LocalReducer, ModuleEngine
from autoshard.runtime.rollout import SamplingConfig
from autoshard.runtime.tasks import TaskError, get_task

VOCAB = 16


from _harness import one_intra_op_thread  # noqa: E402,F401 - autouse: one intra-op thread


def _engines(seed: int = 0, lr: float = 1e-3, **model_overrides):
    overrides = {"vocab_size": VOCAB, "max_seq_len": 32, **model_overrides}
    model = build("llama:tiny", seed=seed, **overrides)
    policy = ModuleEngine(model, torch.optim.AdamW(model.parameters(), lr=lr), max_grad_norm=1.0)
    reference = ModuleEngine.frozen_copy(policy, build("llama:tiny", **overrides))
    return policy, reference


def _trainer(config: PPOConfig | None = None, task: str = "arithmetic", **kw) -> PPOTrainer:
    policy, reference = _engines()
    config = config or PPOConfig(rollout_batch=8, sampling=SamplingConfig(max_new_tokens=6))
    return PPOTrainer(policy, reference, get_task(task), config, **kw)


def _experience(trainer: PPOTrainer):
    from autoshard.runtime.metrics import PhaseTimer

    return trainer.make_experience(trainer.rollout(), PhaseTimer())[0]


def _grads(trainer: PPOTrainer, batch, num_tokens: float) -> list[torch.Tensor]:
    trainer.policy.zero_grad()
    trainer.policy.train_mode()
    trainer.accumulate_gradients(batch, num_tokens)
    return [p.grad.clone() for p in trainer.policy.model.parameters()]


# --------------------------------------------------------------------------- loss math


def test_gae_matches_the_discounted_sum_of_td_errors():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    gamma, lam = 0.9, 0.8
    adv, ret = L.gae(rewards, values * mask, mask, gamma, lam)
    for i in range(3):
        n = int(mask[i].sum())
        v = torch.cat([values[i, :n], torch.zeros(1)])
        delta = rewards[i, :n] + gamma * v[1:] - v[:-1]
        expected = torch.tensor([sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)])
        torch.testing.assert_close(adv[i, :n], expected)
        torch.testing.assert_close(ret[i, :n], expected + values[i, :n])
        assert bool((adv[i, n:] == 0).all())


def test_policy_loss_clips_and_dual_clips():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 5.0]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = L.policy_loss(logp, old, adv, 0.2, None)
    # A>0, ρ=1.5 → −1.2 (clipped); A<0, ρ=0.5 → 0.8 (clipped); ρ=1.1 inside → −1.1; A<0, ρ=5 → 5 (unclipped)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -1.1, 5.0]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    dual, _ = L.policy_loss(logp, old, adv, 0.2, 3.0)
    torch.testing.assert_close(dual, torch.tensor([-1.2, 0.8, -1.1, 3.0]))


def test_value_loss_takes_the_worse_of_clipped_and_plain():
    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.5])
    loss, clipped = L.value_loss(values, old, returns, 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.5 * 0.8**2, 0.5 * 0.25]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(L.value_loss(values, old, returns, None)[0], torch.tensor([0.0, 0.125]))


def test_kl_estimators_and_whitening():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    torch.testing.assert_close(L.kl_k1(logp, ref), torch.tensor([0.5, -1.0, 0.0]))
    k3 = L.kl_k3(logp, ref)
    assert bool((k3 >= 0).all()) and float(k3[2]) == 0.0
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = L.whiten(x, mask, LocalReducer())
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]) * math.sqrt(1.5), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- batching invariance


@pytest.fixture(scope="module")
def trainer_and_experience():
    config = PPOConfig(rollout_batch=8, sampling=SamplingConfig(max_new_tokens=6), kl_coef=0.05, entropy_coef=0.01)
    trainer = _trainer(config)
    trainer.policy.model.init_weights(seed=1)  # policy ≠ reference so every term is non-trivial
    exp = _experience(trainer)
    assert exp.mask.sum(1).min() < exp.mask.sum(1).max(), "want responses of different lengths"
    return trainer, exp


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_micro_batching_does_not_change_gradients(trainer_and_experience, kl_mode):
    trainer, exp = trainer_and_experience
    num_tokens = trainer.global_token_count(exp.mask)
    grads = {}
    for micro in (None, 2, 1):
        config = dataclasses.replace(trainer.config, micro_batch=micro, kl_mode=kl_mode)
        t = PPOTrainer(trainer.policy, trainer.reference, trainer.task, config)
        grads[micro] = _grads(t, exp, num_tokens)
    for micro in (2, 1):
        for a, b in zip(grads[None], grads[micro]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(float(g.abs().sum()) > 0 for g in grads[None])


def test_two_data_parallel_halves_sum_to_the_full_gradient(trainer_and_experience):
    """dp 1 vs 2 simulated: each half normalises by the GLOBAL token count; summing grads gives the full one."""
    trainer, exp = trainer_and_experience
    num_tokens = trainer.global_token_count(exp.mask)
    full = _grads(trainer, exp, num_tokens)
    halves = [_grads(trainer, exp.select(torch.arange(4) + 4 * r), num_tokens) for r in range(2)]
    for f, a, b in zip(full, *halves):
        torch.testing.assert_close(a + b, f, atol=1e-6, rtol=1e-5)
    # Per-rank token means (the naive normalisation) would be wrong whenever the halves' lengths differ.
    local = [float(exp.mask[4 * r : 4 * r + 4].sum()) for r in range(2)]
    if local[0] != local[1]:
        naive = [_grads(trainer, exp.select(torch.arange(4) + 4 * r), local[r]) for r in range(2)]
        assert not all(torch.allclose((a + b) / 2, f, atol=1e-6) for f, a, b in zip(full, *naive))


def _gloo_case(rank: int, world_size: int) -> dict:
    """Rank r trains on half r of a shared batch through a real gloo all-reduce; returns grads and whitening."""
    from autoshard.runtime.ppo_engine import DistReducer

    torch.manual_seed(0)
    dp = DistReducer()
    trainer = _trainer(PPOConfig(rollout_batch=8, sampling=SamplingConfig(max_new_tokens=6), kl_coef=0.05))
    trainer.policy.model.init_weights(seed=1)
    exp = _experience(trainer)  # rank-independent: LocalReducer and the same seed on every rank
    half = exp.select(torch.arange(4) + 4 * rank)
    trainer.policy.dp = trainer.dp = dp
    grads = _grads(trainer, half, trainer.global_token_count(half.mask))
    for g in grads:
        dp.all_reduce_sum(g)
    white = L.whiten(half.returns, half.mask, dp)
    # One full step on both ranks (different prompts per rank) must keep the replicas identical.
    trainer.step()
    params = torch.cat([p.detach().flatten() for p in trainer.policy.model.parameters()])
    return {"grads": grads, "white": white, "params": params, "exp": exp}


@pytest.mark.slow
def test_real_two_rank_gloo_matches_single_process():
    from _harness import run_gloo

    results = run_gloo(_gloo_case, 2, timeout_s=90)
    exp = results[0]["exp"]
    trainer = _trainer(PPOConfig(rollout_batch=8, sampling=SamplingConfig(max_new_tokens=6), kl_coef=0.05))
    trainer.policy.model.init_weights(seed=1)
    full = _grads(trainer, exp, float(exp.mask.sum()))
    for r in range(2):
        for f, g in zip(full, results[r]["grads"]):
            torch.testing.assert_close(g, f, atol=1e-6, rtol=1e-5)
    white = L.whiten(exp.returns, exp.mask, LocalReducer())
    torch.testing.assert_close(torch.cat([results[0]["white"], results[1]["white"]]), white[:8], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[0]["params"], results[1]["params"], atol=0, rtol=0)


# --------------------------------------------------------------------------- errors


def test_config_errors_name_the_values():
    with pytest.raises(PPOConfigError, match="rollout_batch=10 is not divisible into mini_batches=4"):
        PPOConfig(rollout_batch=10, mini_batches=4)
    with pytest.raises(PPOConfigError, match="micro_batch=3 does not divide the mini-batch of 8"):
        PPOConfig(rollout_batch=16, mini_batches=2, micro_batch=3)
    with pytest.raises(PPOConfigError, match="kl_mode='k2'; allowed: reward, loss"):
        PPOConfig(kl_mode="k2")
    with pytest.raises(PPOConfigError, match="dual_clip=0.5"):
        PPOConfig(dual_clip=0.5)


def test_small_vocab_and_frozen_reference_are_refused():
    policy, reference = _engines(vocab_size=8)
    with pytest.raises(TaskError, match="vocab_size=8"):
        PPOTrainer(policy, reference, get_task("arithmetic"), PPOConfig())
    _, reference = _engines()
    with pytest.raises(EngineError, match="frozen engine"):
        reference.step()


class _NaNTask:
    def __init__(self) -> None:
        self._inner = get_task("sorting")
        self.name, self.prompt_len, self.max_response_len = "nan", self._inner.prompt_len, 5
        self.eos_id, self.pad_id = 1, 0

    def sample_prompts(self, n, generator):
        return self._inner.sample_prompts(n, generator)

    def rewards(self, prompts, responses, mask):
        return torch.full((prompts.shape[0],), float("nan")), None


def test_nan_rewards_stop_training():
    policy, reference = _engines()
    trainer = PPOTrainer(policy, reference, _NaNTask(), PPOConfig(rollout_batch=4))
    with pytest.raises(TaskError, match="non-finite seq_reward"):
        trainer.step()


# --------------------------------------------------------------------------- metrics and variants


def test_step_metrics_jsonl_and_plot(tmp_path):
    from autoshard.runtime.plot import plot_main, plot_metrics

    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as writer:
        trainer = _trainer(
            PPOConfig(rollout_batch=8, mini_batches=2, micro_batch=2, epochs=2, sampling=SamplingConfig(max_new_tokens=6)),
            flops_per_token=1e6, peak_flops=1e12, on_metrics=writer.write,
        )
        metrics = [trainer.step() for _ in range(2)]
    keys = {"reward/mean", "response/length", "kl/k1", "policy/clip_frac", "policy/entropy", "value/loss",
            "policy/loss", "value/explained_var", "grad/norm", "time/generate", "time/logprobs", "time/reference",
            "time/advantages", "time/train", "perf/tokens_per_s", "perf/mfu", "memory/peak_gb", "mismatch/logp_abs"}
    assert keys <= set(metrics[0])
    assert all(math.isfinite(metrics[1][k]) for k in keys)
    assert metrics[0]["mismatch/logp_abs"] < 1e-4 and 0 < metrics[0]["perf/mfu"] < 1
    assert metrics[1]["kl/k1"] != 0.0  # the policy moved away from the reference after one step
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1.0, 2.0] and rows[1]["reward/mean"] == pytest.approx(metrics[1]["reward/mean"])
    assert "reward" in format_summary(metrics[1])
    out = plot_metrics(path, tmp_path / "m.png")
    assert out.stat().st_size > 10_000
    assert plot_main([str(path), "-o", str(tmp_path / "cli.png")]) == 0 and (tmp_path / "cli.png").exists()


def test_separate_critic_gets_the_value_gradient():
    policy, reference = _engines()
    critic_model = build("llama:tiny", vocab_size=VOCAB, max_seq_len=32, seed=5)
    critic = ModuleEngine(critic_model, torch.optim.AdamW(critic_model.parameters(), lr=1e-3))
    before = critic_model.value_head.weight.detach().clone()
    trainer = PPOTrainer(policy, reference, get_task("addition"), PPOConfig(rollout_batch=4), critic=critic)
    metrics = trainer.step()
    assert "time/values" in metrics and math.isfinite(metrics["value/loss"])
    assert not torch.equal(before, critic_model.value_head.weight)
    assert policy.model.value_head.weight.grad is None  # the policy's own value head is unused


# --------------------------------------------------------------------------- learning


LEARN_STEPS = 150
LEARN_THRESHOLD = 0.65  # format alone (commas, <eos>) caps the reward at 0.6: passing needs right digits


@pytest.mark.slow
def test_ppo_learns_arithmetic_sequences():
    """The reference run (``runtime/ppo_demo.py``): mean reward ~0.06 → ≥ LEARN_THRESHOLD within LEARN_STEPS."""
    from autoshard.runtime.ppo_demo import demo_trainer

    trainer = demo_trainer()
    rewards = [trainer.step()["reward/mean"] for _ in range(LEARN_STEPS)]
    assert rewards[0] < 0.15
    assert sum(rewards[-10:]) / 10 >= LEARN_THRESHOLD, [round(r, 3) for r in rewards[::10]]


def test_resumed_metrics_keep_rows_up_to_the_checkpoint(tmp_path):
    """``truncate_metrics``: a resume drops the rows written after its checkpoint (the resumed run writes those
    steps again), keeps the others byte for byte, and leaves a missing file alone."""
    from autoshard.runtime.metrics import truncate_metrics

    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as writer:
        for step in range(1, 6):
            writer.write({"step": step, "reward/mean": 0.1 * step, "kl/k1": float("nan")})
    before = path.read_text().splitlines()
    assert truncate_metrics(path, 3) == 2
    assert path.read_text().splitlines() == before[:3]
    assert [row["step"] for row in read_metrics(path)] == [1, 2, 3]
    assert truncate_metrics(path, 3) == 0
    assert truncate_metrics(tmp_path / "absent.jsonl", 1) == 0
