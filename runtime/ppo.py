"""PPO for a language-model policy with a value head: the exact objective implemented.

One ``PPOTrainer.step()`` on each data-parallel rank does:

1. **Rollout** (``generate``). Draw ``rollout_batch / G`` prompts from the
   task, repeat each G = ``samples_per_prompt`` times (consecutive rows: one
   group per prompt), giving x [n, P], and sample responses y with a KV cache
   (``runtime/rollout.py``): y_t ~ top_p(softmax(logits / τ)), at most
   ``max_new_tokens``, each sequence stopping after its first ``<eos>`` (or
   stop token). The response mask m_t is 1 through that stop (an action like
   any other), 0 after.
2. **Old log-probs and values** (``logprobs``; ``values`` with a separate
   critic). One forward of π_old over x ‖ y[:-1] gives
   logp_old_t = log softmax(logits_t / τ)[y_t] and V_t, the value head at the
   position that predicts y_t (state s_t = x ‖ y_<t). With a shared trunk both
   come from the same forward.
3. **Reference** (``reference``). logp_ref_t from the frozen reference policy.
4. **Rewards and advantages** (``advantages``). The task returns a
   sequence reward R_seq and optional dense rewards r^task_t (NaN/inf raise).

       r_t = m_t · r^task_t + [t = last response token] · R_seq − β · k1_t    (kl_mode="reward")
       r_t = m_t · r^task_t + [t = last response token] · R_seq               (kl_mode="loss")
       k1_t = logp_old_t − logp_ref_t

   ``algo="ppo"``: GAE with (γ, λ) over the response tokens (V past the end is 0):
   δ_t = r_t + γ V_{t+1} − V_t, A_t = Σ_k (γλ)^k δ_{t+k}, returns G_t = A_t + V_t.
   With ``whiten_advantages`` A is shifted and scaled to mean 0, std 1 over the
   response tokens of the GLOBAL batch (statistics all-reduced over dp).

   ``algo="grpo"`` (group-relative, no critic): with R_i = Σ_t r_t the total
   reward of response i and g(i) its group (the G responses to one prompt),

       A_{i,t} = m_{i,t} · (R_i − mean_{g(i)} R) / (std_{g(i)} R + eps)      (std: unbiased, eps = group_eps)

   on every token of the response; no values, returns or whitening. Groups
   never span ranks (each rank repeats its own prompts).
5. **Update** (``train``). For ``epochs`` passes, the local batch is shuffled
   and cut into ``mini_batches`` mini-batches; each mini-batch is one optimizer
   step, accumulated over micro-batches of ``micro_batch`` sequences. With
   ρ_t = exp(logp_t − logp_old_t) under the current policy, the per-token loss is

       ℓ_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε, 1 + ε))                    (ε = clip)
             [for A_t < 0 with dual_clip c: min(·, −c A_t)]
           + c_v · ½ max((V_t − G_t)², (V_old_t + clip(V_t − V_old_t, ±ε_v) − G_t)²)   (algo="ppo" only)
           − c_H · H_t                                                     (entropy bonus, off by default)
           + β · k3_t                                                      (kl_mode="loss" only)
       k3_t = exp(logp_ref_t − logp_t) − (logp_ref_t − logp_t) − 1

   and the mini-batch loss is

       L = Σ_{ranks} Σ_{micro-batches} Σ_t w_t ℓ_t / N,   N = Σ_{ranks} Σ_{micro-batches} Σ_t w_t

   with w_t = m_t (``loss_agg="token"``: N is the GLOBAL number of response
   tokens) or w_t = m_t / |y| (``loss_agg="sequence"``: each response's token
   mean, averaged over the N responses). N is all-reduced once per
   mini-batch through the engine's ``dp`` reducer (one process: the
   identity). Each micro-batch back-propagates its own share Σ w_t ℓ_t / N and
   the engine SUMS gradients over dp ranks (``ppo_engine`` note), so the
   gradient is that of the mean over the whole mini-batch: it does not
   change with the data-parallel size or the micro-batch size.

``algo="ppo"`` is token-level PPO as in verl / OpenRLHF ("token-mean" loss
aggregation), with a per-token KL penalty (k1 in the reward, InstructGPT-style)
or a k3 KL loss (GRPO-style). ``algo="grpo"`` is GRPO (DeepSeekMath) with the
same clipped surrogate, usually with ``kl_mode="loss"``. Defaults follow
REFERENCES.md "PPO defaults".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from autoshard.errors import AutoshardError
from autoshard.runtime import ppo_losses as L
from autoshard.runtime.metrics import PhaseTimer, mfu, peak_memory_gb
from autoshard.runtime.ppo_engine import PolicyEngine
from autoshard.runtime.rollout import Rollout, SamplingConfig, generate
from autoshard.runtime.tasks import Task, check_rewards, check_vocab

KL_MODES = ("reward", "loss")
ALGOS = ("ppo", "grpo")
LOSS_AGGREGATIONS = ("token", "sequence")
_STAT_KEYS = ("policy/loss", "policy/clip_frac", "policy/entropy", "policy/approx_kl", "value/loss", "value/clip_frac")


class PPOConfigError(AutoshardError):
    """A PPO hyperparameter or batch split is invalid."""


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """PPO hyperparameters; batch sizes count sequences of ONE data-parallel rank."""

    rollout_batch: int = 64
    """Prompts sampled per rank per step (the global batch is this × dp ranks)."""
    mini_batches: int = 1
    """Optimizer steps per PPO epoch; must divide ``rollout_batch``."""
    micro_batch: int | None = None
    """Sequences per forward/backward; must divide the mini-batch size (None: the whole mini-batch)."""
    epochs: int = 1
    """PPO epochs over each rollout batch (REFERENCES: 1–4)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout temperature, top-p and max new tokens; log-probs use the same temperature."""
    clip: float = 0.2
    """Policy ratio clip ε: ρ is clipped to [1 − ε, 1 + ε]."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (None: off)."""
    value_clip: float | None = 0.2
    """Value clip ε_v around the rollout values (None: unclipped squared error)."""
    value_coef: float = 0.5
    """c_v, weight of the value loss in the shared-trunk loss (also scales a separate critic's loss)."""
    entropy_coef: float = 0.0
    """c_H, entropy bonus weight (REFERENCES: off)."""
    gamma: float = 1.0
    """GAE discount γ."""
    lam: float = 0.95
    """GAE λ."""
    kl_coef: float = 0.01
    """β, weight of the KL to the reference policy (REFERENCES: 0.001–0.05; 0 disables it)."""
    kl_mode: str = "reward"
    """"reward": −β·k1 per token in the reward; "loss": +β·k3 per token in the loss."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the global batch's response tokens."""
    seed: int = 0
    """Seeds prompts, sampling and shuffles (offset by the dp rank)."""
    algo: str = "ppo"
    """"ppo": GAE over the value head (or critic) and a value loss; "grpo": group-relative advantages, no value loss."""
    samples_per_prompt: int = 1
    """G: responses per prompt (each rank draws rollout_batch / G prompts); GRPO needs G >= 2."""
    loss_agg: str = "token"
    """"token": mean over the mini-batch's response tokens; "sequence": mean over responses of their token means."""
    group_eps: float = 1e-6
    """eps of the GRPO advantage's denominator (a group of equal rewards gets advantage 0)."""

    def __post_init__(self) -> None:
        for name in ("rollout_batch", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise PPOConfigError(f"PPOConfig.{name}={getattr(self, name)}; must be a positive integer")
        if self.rollout_batch % self.mini_batches:
            raise PPOConfigError(
                f"rollout_batch={self.rollout_batch} is not divisible into mini_batches={self.mini_batches}; "
                f"choose mini_batches among the divisors of {self.rollout_batch}"
            )
        mini = self.mini_batch_size
        if self.micro_batch is not None and (self.micro_batch < 1 or mini % self.micro_batch):
            raise PPOConfigError(
                f"micro_batch={self.micro_batch} does not divide the mini-batch of {mini} sequences "
                f"(rollout_batch {self.rollout_batch} / mini_batches {self.mini_batches}); pick a divisor of {mini}"
            )
        if self.kl_mode not in KL_MODES:
            raise PPOConfigError(f"kl_mode={self.kl_mode!r}; allowed: {', '.join(KL_MODES)}")
        if not 0 < self.clip < 1:
            raise PPOConfigError(f"clip={self.clip}; allowed range (0, 1)")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise PPOConfigError(f"dual_clip={self.dual_clip}; must be > 1 (or None to disable)")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise PPOConfigError(f"gamma={self.gamma}, lam={self.lam}; both must lie in [0, 1]")
        self._check_algo()

    def _check_algo(self) -> None:
        for name, allowed in (("algo", ALGOS), ("loss_agg", LOSS_AGGREGATIONS)):
            if getattr(self, name) not in allowed:
                raise PPOConfigError(f"{name}={getattr(self, name)!r}; allowed: {', '.join(allowed)}")
        group = self.samples_per_prompt
        if group < 1 or self.rollout_batch % group:
            raise PPOConfigError(f"samples_per_prompt={group} does not divide rollout_batch={self.rollout_batch} "
                                 "(each rank repeats its prompts); pick a divisor of the per-rank batch")
        if self.algo == "grpo" and group < 2:
            raise PPOConfigError(f"algo='grpo' with samples_per_prompt={group}: group-relative advantages need "
                                 "at least 2 responses per prompt; pass samples_per_prompt >= 2")

    @property
    def mini_batch_size(self) -> int:
        """Sequences per mini-batch on one rank."""
        return self.rollout_batch // self.mini_batches


@dataclass(frozen=True)
class Experience:
    """One rank's rollout with everything the update needs; all [n, R] unless stated."""

    tokens: torch.Tensor  # [n, P + R] prompts ‖ responses
    prompt_len: int
    mask: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    @property
    def responses(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len :]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: torch.Tensor) -> "Experience":
        """The sequences at ``index`` [k]."""
        pick = lambda t: t[index]  # noqa: E731
        return Experience(
            pick(self.tokens), self.prompt_len, pick(self.mask), pick(self.old_logp), pick(self.ref_logp),
            pick(self.old_values), pick(self.advantages), pick(self.returns),
        )


class PPOTrainer:
    """Runs PPO steps (module docstring) for ``policy`` against a frozen ``reference`` on ``task``.

    ``critic``: optional separate value model (an engine whose ``forward``
    returns values); None uses the policy's value head (shared trunk).
    ``flops_per_token`` (training FLOPs per token, e.g. 6·params) and
    ``peak_flops`` (per device) enable the MFU metric. ``on_metrics`` is called
    with each step's metrics (e.g. a ``MetricsWriter.write`` or ``LiveSummary``).
    """

    def __init__(
        self,
        policy: PolicyEngine,
        reference: PolicyEngine,
        task: Task,
        config: PPOConfig,
        *,
        critic: PolicyEngine | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        on_metrics: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        check_vocab(task, policy.vocab_size)
        if critic is not None and config.algo == "grpo":
            raise PPOConfigError("algo='grpo' has no value function; drop the critic or use algo='ppo'")
        if reference.vocab_size != policy.vocab_size:
            raise PPOConfigError(
                f"reference vocab_size={reference.vocab_size} differs from policy vocab_size={policy.vocab_size}; "
                "build the reference from the same model spec"
            )
        self.policy, self.reference, self.critic, self.task, self.config = policy, reference, critic, task, config
        self.dp = policy.dp
        self.flops_per_token, self.peak_flops, self.on_metrics = flops_per_token, peak_flops, on_metrics
        seed = config.seed + 7919 * self.dp.rank
        self.cpu_generator = torch.Generator().manual_seed(seed)
        self.sample_generator = torch.Generator(device=policy.device).manual_seed(seed + 1)
        self.step_count = 0

    # ------------------------------------------------------------------ rollout and experience

    def rollout(self) -> Rollout:
        """Sample ``rollout_batch / G`` prompts, G responses to each (consecutive rows), from the policy."""
        group = self.config.samples_per_prompt
        prompts = self.task.sample_prompts(self.config.rollout_batch // group, self.cpu_generator)
        prompts = prompts.repeat_interleave(group, dim=0).to(self.policy.device)
        self.policy.eval_mode()
        engine = getattr(self.policy, "rollout", None)  # a rollout layout of its own (runtime/rollout_engine.py)
        if engine is not None:
            return engine.generate(self.policy, prompts, self.config.sampling, eos_id=self.task.eos_id,
                                   pad_id=self.task.pad_id, generator=self.sample_generator)
        return generate(
            self.policy, prompts, self.config.sampling,
            eos_id=self.task.eos_id, pad_id=self.task.pad_id, generator=self.sample_generator,
        )

    @torch.no_grad()
    def _score(self, engine: PolicyEngine, tokens: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp [n, R], values [n, R]) of the responses in ``tokens`` under ``engine``, in micro-batches."""
        resp_len = tokens.shape[1] - prompt_len
        chunk = self.config.micro_batch or self.config.mini_batch_size
        logps, values = [], []
        for part in tokens.split(chunk):
            logits, vals = engine.forward(part[:, :-1])
            logits = L.response_logits(logits, prompt_len, resp_len)
            logps.append(L.token_logprobs(logits, part[:, prompt_len:], self.config.sampling.temperature)[0])
            values.append(L.response_logits(vals[..., None], prompt_len, resp_len)[..., 0].float())
        return torch.cat(logps), torch.cat(values)

    def _rewards(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token task rewards [n, R] with R_seq on the last token, total reward per sequence [n])."""
        seq_reward, token_reward = self.task.rewards(rollout.prompts, rollout.responses, rollout.response_mask)
        check_rewards(self.task.name, seq_reward, token_reward, tuple(rollout.responses.shape))
        mask = rollout.response_mask
        rewards = torch.zeros_like(mask) if token_reward is None else token_reward.float() * mask
        last = (rollout.lengths.long() - 1).clamp(min=0)  # [n]; every response has ≥ 1 token
        rewards = rewards.scatter_add(1, last[:, None], seq_reward.float()[:, None].to(mask.dtype))
        return rewards, rewards.sum(1)

    def make_experience(self, rollout: Rollout, timer: PhaseTimer) -> tuple[Experience, dict[str, float]]:
        """Old/reference log-probs, values, rewards, GAE and whitening for ``rollout``."""
        tokens, prompt_len, mask, cfg = rollout.tokens, rollout.prompts.shape[1], rollout.response_mask, self.config
        with timer.phase("logprobs"):
            self.policy.eval_mode()
            old_logp, old_values = self._score(self.policy, tokens, prompt_len)
        with timer.phase("reference"):
            self.reference.eval_mode()
            ref_logp, _ = self._score(self.reference, tokens, prompt_len)
        if self.critic is not None:
            with timer.phase("values"):
                self.critic.eval_mode()
                _, old_values = self._score(self.critic, tokens, prompt_len)
        with timer.phase("advantages"):
            task_rewards, seq_total = self._rewards(rollout)
            k1 = L.kl_k1(old_logp, ref_logp) * mask
            rewards = task_rewards - cfg.kl_coef * k1 if cfg.kl_mode == "reward" else task_rewards
            if cfg.algo == "grpo":
                advantages = L.group_advantages(rewards.sum(1), cfg.samples_per_prompt, cfg.group_eps)[:, None] * mask
                returns = torch.zeros_like(advantages)
            else:
                advantages, returns = L.gae(rewards, old_values * mask, mask, cfg.gamma, cfg.lam)
                if cfg.whiten_advantages:
                    advantages = L.whiten(advantages, mask, self.dp)
        exp = Experience(tokens, prompt_len, mask, old_logp, ref_logp, old_values * mask, advantages, returns)
        return exp, self._rollout_metrics(rollout, exp, seq_total, k1)

    def _rollout_metrics(self, rollout: Rollout, exp: Experience, seq_total: torch.Tensor, k1: torch.Tensor) -> dict[str, float]:
        mask = exp.mask
        _, reward_mean, reward_var = L.masked_stats(seq_total, torch.ones_like(seq_total), self.dp)
        _, length, _ = L.masked_stats(rollout.lengths, torch.ones_like(seq_total), self.dp)
        empty = (rollout.responses[:, 0] == self.task.eos_id).float()
        _, empty_frac, _ = L.masked_stats(empty, torch.ones_like(empty), self.dp)
        _, kl1, _ = L.masked_stats(k1, mask, self.dp)
        _, kl3, _ = L.masked_stats(L.kl_k3(exp.old_logp, exp.ref_logp), mask, self.dp)
        gap = (rollout.sample_logprobs - exp.old_logp).abs() * mask
        _, gap_mean, _ = L.masked_stats(gap, mask, self.dp)
        return {
            "reward/mean": reward_mean, "reward/std": reward_var**0.5, "response/length": length,
            "response/empty_frac": empty_frac, "kl/k1": kl1, "kl/k3": kl3,
            "value/explained_var": (float("nan") if self.config.algo == "grpo"
                                    else L.explained_variance(exp.old_values, exp.returns, mask, self.dp)),
            "mismatch/logp_abs": gap_mean, "mismatch/logp_max": float(gap.max()),  # max: this rank only
        }

    # ------------------------------------------------------------------ update

    def global_token_count(self, mask: torch.Tensor) -> float:
        """N: response tokens of ``mask`` summed over every data-parallel rank (the dp hook)."""
        return float(self.dp.all_reduce_sum(mask.sum().detach().double().clone()))

    def loss_normaliser(self, mask: torch.Tensor) -> float:
        """N of the module docstring: Σ of the loss weights of ``mask`` over every data-parallel rank."""
        weights = L.loss_weights(mask, self.config.loss_agg)
        return float(self.dp.all_reduce_sum(weights.sum().detach().double().clone()))

    def accumulate_gradients(self, batch: Experience, num_tokens: float) -> dict[str, torch.Tensor]:
        """Back-propagate Σ w·ℓ / ``num_tokens`` of ``batch`` in micro-batches (no zero_grad, no step;
        w: the loss weights, the mask under ``loss_agg="token"``, module docstring).

        Returns this rank's share of each statistic (Σ w·stat / num_tokens), so
        the shares of all ranks sum to the global token means.
        """
        cfg = self.config
        stats = {k: torch.zeros((), dtype=torch.float64) for k in _STAT_KEYS}
        if getattr(self.policy, "pipelined", False) and self.critic is None:
            # pipeline stages (pp > 1): the engine runs its schedule over micro-batches of the mini-batch and
            # calls the loss on the last stage with each micro-batch's rows (ppo_program.ProgramEngine.accumulate)
            def rows_loss(logits: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
                return self._micro_batch_loss(batch.select(rows.to(batch.tokens.device)), num_tokens, logits, values)

            self.policy.accumulate(batch.tokens[:, :-1], rows_loss, stats, micro_batch=cfg.micro_batch)
            return stats
        sums: dict[str, torch.Tensor] = {}  # on the device: one host read per mini-batch, not per micro-batch
        for index in torch.arange(len(batch)).split(cfg.micro_batch or len(batch)):
            mb = batch.select(index)
            loss, parts = self._micro_batch_loss(mb, num_tokens, *self.policy.forward(mb.tokens[:, :-1]))
            # With a separate critic the scalar holds both losses; one backward reaches both models.
            self.policy.backward(loss)
            for key, value in parts.items():
                sums[key] = value.detach().double() + sums.get(key, 0.0)
        keys = sorted(sums)
        for key, value in zip(keys, torch.stack([sums[key] for key in keys]).cpu() if keys else ()):
            stats[key] += value
        return stats

    def _micro_batch_loss(self, mb: Experience, num_tokens: float, logits: torch.Tensor,
                          values: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(Σ w·ℓ / ``num_tokens``, statistics' shares) of micro-batch ``mb`` from the policy's
        (logits, values) of ``mb.tokens[:, :-1]``."""
        cfg, mask = self.config, mb.mask
        resp_len = mask.shape[1]
        logits = L.response_logits(logits, mb.prompt_len, resp_len)
        logp, entropy = L.token_logprobs(logits, mb.responses, cfg.sampling.temperature)
        if self.critic is not None:
            _, values = self.critic.forward(mb.tokens[:, :-1])
        values = L.response_logits(values[..., None], mb.prompt_len, resp_len)[..., 0].float()
        pg, pg_clipped = L.policy_loss(logp, mb.old_logp, mb.advantages, cfg.clip, cfg.dual_clip)
        per_token = pg - cfg.entropy_coef * entropy
        if cfg.algo == "grpo":  # no value function: the value head gets no gradient
            vl = v_clipped = torch.zeros_like(pg)
        else:
            vl, v_clipped = L.value_loss(values, mb.old_values, mb.returns, cfg.value_clip)
            per_token = per_token + cfg.value_coef * vl
        if cfg.kl_mode == "loss" and cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * L.kl_k3(logp, mb.ref_logp)
        weights = L.loss_weights(mask, cfg.loss_agg)
        share = lambda t: (t * weights).sum() / num_tokens  # noqa: E731
        parts = {
            "policy/loss": share(pg), "policy/clip_frac": share(pg_clipped), "policy/entropy": share(entropy),
            "policy/approx_kl": share(0.5 * (logp - mb.old_logp) ** 2),
            "value/loss": share(vl), "value/clip_frac": share(v_clipped),
        }
        return share(per_token), parts

    def train_on(self, exp: Experience) -> dict[str, float]:
        """``epochs`` × ``mini_batches`` optimizer steps on ``exp``; returns global mean statistics."""
        cfg = self.config
        engines = [self.policy] if self.critic is None else [self.policy, self.critic]
        totals = {k: torch.zeros((), dtype=torch.float64) for k in _STAT_KEYS}
        grad_norms = []
        for engine in engines:
            engine.train_mode()
        for _ in range(cfg.epochs):
            order = torch.randperm(len(exp), generator=self.cpu_generator).to(exp.tokens.device)
            for index in order.split(cfg.mini_batch_size):
                batch = exp.select(index)
                num_tokens = self.loss_normaliser(batch.mask)
                assert num_tokens > 0, "every response has at least its first token"
                for engine in engines:
                    engine.zero_grad()
                for key, value in self.accumulate_gradients(batch, num_tokens).items():
                    totals[key] += value
                grad_norms.append(self.policy.step())
                if self.critic is not None:
                    self.critic.step()
        steps = cfg.epochs * cfg.mini_batches
        summed = self.dp.all_reduce_sum(torch.stack([totals[k] for k in _STAT_KEYS]))
        out = {k: float(v) / steps for k, v in zip(_STAT_KEYS, summed)}
        out["grad/norm"] = sum(grad_norms) / len(grad_norms)
        return out

    # ------------------------------------------------------------------ one step

    def step(self) -> dict[str, float]:
        """One PPO step (rollout → experience → update); returns its metrics (``runtime/metrics.py``)."""
        timer = PhaseTimer(synchronize=self.policy.device.type == "cuda")
        start = time.perf_counter()
        if getattr(self.policy, "rollout", None) is not None:  # a separate rollout replica (ppo_program.ProgramEngine)
            with timer.phase("weight_sync"):
                self.policy.sync_rollout_weights()
        with timer.phase("generate"):
            rollout = self.rollout()
        exp, metrics = self.make_experience(rollout, timer)
        with timer.phase("train"):
            metrics.update(self.train_on(exp))
        self.step_count += 1
        metrics.update(self._perf_metrics(exp, timer, time.perf_counter() - start))
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        return metrics

    def _perf_metrics(self, exp: Experience, timer: PhaseTimer, step_s: float) -> dict[str, float]:
        n, seq = exp.tokens.shape
        local_tokens = float(n * seq)  # prompt + response positions of this rank
        global_tokens = float(self.dp.all_reduce_sum(torch.tensor(local_tokens, dtype=torch.float64)))
        trained = self.config.epochs * n * (seq - 1)
        return {
            "step": float(self.step_count),
            **timer.as_metrics(),
            "time/step": step_s,
            "perf/tokens_per_s": global_tokens / step_s / self.dp.world_size,
            "perf/mfu": mfu(self.flops_per_token, trained, timer.seconds["train"], self.peak_flops),
            "memory/peak_gb": peak_memory_gb(self.policy.device),
        }


__all__ = ["ALGOS", "KL_MODES", "LOSS_AGGREGATIONS", "Experience", "PPOConfig", "PPOConfigError", "PPOTrainer"]
