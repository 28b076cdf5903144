"""PPO's per-token math: log-probs, entropy, KL estimators, GAE, whitening, clipped losses.

Shapes: n sequences, R response positions, V vocabulary. ``mask`` [n, R] is 1
on response tokens (through the first ``<eos>``), 0 after. Every function
returns per-token values; reduction (sum over tokens / global token count)
is the caller's, so these stay independent of batching.

Formulas (ρ = exp(logp − logp_old), A advantage, R return, ε clip):

    k1 = logp − logp_ref                      (unbiased, can be negative)
    k3 = exp(logp_ref − logp) − (logp_ref − logp) − 1   (≥ 0, unbiased; Schulman's k3)
    δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t ;  A_t = δ_t + γλ·m_{t+1}·A_{t+1} ;  R_t = A_t + V_t
    L_pg = max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)),  and for A < 0 with dual clip c:  min(L_pg, −A·c)
    L_v  = ½·max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²)
    H    = −Σ_v π(v) log π(v)
    GRPO (groups of G responses to one prompt, R_i a response's total reward):
         A_i = (R_i − mean_group(R)) / (std_group(R) + eps),  std the unbiased sample std (torch.std)
    loss weights w_t (the caller sums w·ℓ and divides by the global Σ w):
         "token": w_t = m_t ;  "sequence": w_t = m_t / Σ_t' m_t'  (each response weighs 1)
"""

from __future__ import annotations

import torch

from autoshard.runtime.ppo_engine import Reducer


def response_logits(logits: torch.Tensor, prompt_len: int, response_len: int) -> torch.Tensor:
    """Logits [n, S, V] of a forward over prompt ‖ response[:-1] → the R positions that predict responses."""
    return logits[:, prompt_len - 1 : prompt_len - 1 + response_len]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(tokens), entropy), each [n, R], under softmax(logits [n, R, V] / temperature) in fp32."""
    logp_all = (logits.float() / temperature).log_softmax(-1)  # [n, R, V]
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp − logp_ref per token."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(logp_ref − logp) − (logp_ref − logp) − 1 per token (≥ 0)."""
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return log_ratio.exp() - log_ratio - 1.0


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [n, R] by generalised advantage estimation; zero past each response's end."""
    n, resp_len = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(resp_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = adv
        next_value = values[:, t] * mask[:, t]
        next_adv = adv
    returns = (advantages + values) * mask
    return advantages, returns


def group_advantages(seq_rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages [n] of sequence rewards [n] laid out as consecutive groups of ``group_size`` (module formula)."""
    groups = seq_rewards.view(-1, group_size)  # [n / G, G]
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)


def loss_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Per-token loss weights [n, R]: ``mask`` for "token", ``mask`` / response length for "sequence"."""
    if aggregation == "token":
        return mask
    return mask / mask.sum(1, keepdim=True).clamp(min=1.0)


def masked_stats(x: torch.Tensor, mask: torch.Tensor, dp: Reducer) -> tuple[float, float, float]:
    """(count, mean, variance) of x over mask = 1 across every data-parallel rank (biased variance)."""
    sums = torch.stack([mask.sum(), (x * mask).sum(), (x * x * mask).sum()]).double()
    count, total, total_sq = dp.all_reduce_sum(sums).tolist()
    mean = total / max(count, 1.0)
    return count, mean, max(total_sq / max(count, 1.0) - mean * mean, 0.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, dp: Reducer, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / (std + eps) with mean and std over the masked tokens of the GLOBAL batch; 0 where masked."""
    _, mean, var = masked_stats(x, mask, dp)
    return (x - mean) / (var**0.5 + eps) * mask


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_pg, clipped) per token: the clipped surrogate (dual-clipped for A < 0 when ``dual_clip``), and 1.0 where the clip bound."""
    ratio = (logp - old_logp).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        lower = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, lower), loss)
    return loss, was_clipped


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_v, clipped) per token: ½·max of plain and clipped squared errors (plain only when ``clip`` is None)."""
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), (clipped > plain).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, dp: Reducer) -> float:
    """1 − Var[R − V] / Var[R] over the global masked tokens (nan when Var[R] is 0)."""
    _, _, var_returns = masked_stats(returns, mask, dp)
    _, _, var_err = masked_stats(returns - values, mask, dp)
    return float("nan") if var_returns == 0 else 1.0 - var_err / var_returns
