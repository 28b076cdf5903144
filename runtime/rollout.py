"""Rollout: sample responses from a policy engine with a KV cache.

For a batch of equal-length prompts x [n, P] the sampler draws, for
t = 0 .. max_new_tokens − 1,

    y_t ~ top_p( softmax(logits(x, y_<t) / temperature) )

one token per sequence per step. A sequence stops after its first ``eos_id``
or ``stop_ids`` token (the stop token is part of the response and of
``response_mask``); its
later positions hold ``pad_id`` with mask 0. Decoding ends early when every
sequence has stopped, so R (the response width) is at most max_new_tokens.
With a cache, whether all have stopped is read every ``STOP_CHECK_EVERY``
steps, not every step: reading it waits for the device, which then idles while
the host prepares the next step (in profiled RL steps on H200s, 6.6–8.8 ms of
idle device a decode step for 1.3B and 7B policies). The steps decoded past the last stop are cut
off again, so R is the same as with a check per step; the sampling generator
advances over them.

With ``engine.new_cache`` returning a cache, the prompt is fed once and each
later step feeds one token at ``start_pos``; an engine without a cache
(``new_cache`` returns None) recomputes the whole prefix every step (same
distribution, quadratic cost).

``sample_logprobs`` records log π(y_t) under the tempered, *untruncated*
distribution as the decode path computed it; PPO recomputes the same numbers
with one full forward (``old_logprobs``) and reports the gap as the
rollout-vs-training mismatch (non-zero only through numerics: cached vs full
attention, or a different engine for generation). Top-p changes which tokens
can be drawn, not the log-probs PPO trains on (as in verl and OpenRLHF).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from autoshard.errors import AutoshardError


STOP_CHECK_EVERY = 8  # decode steps between reads of "all stopped" with a cache (module docstring)


class RolloutError(AutoshardError):
    """Sampling settings or prompts that cannot be sampled."""


class Sampler(Protocol):
    """What rollout needs from an engine (a subset of ``PolicyEngine``)."""

    max_seq_len: int

    def forward(self, tokens: torch.Tensor, *, cache: Any = None, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def new_cache(self, batch: int, max_len: int) -> Any:
        ...


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How responses are drawn."""

    max_new_tokens: int = 16
    """Most response tokens per sequence (``<eos>`` included)."""
    temperature: float = 1.0
    """Logits are divided by this before softmax (> 0); PPO's log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p (0 < top_p ≤ 1)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end a response as ``<eos>`` does (kept in the response and its mask)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise RolloutError(f"max_new_tokens={self.max_new_tokens}; must be at least 1")
        if not self.temperature > 0:
            raise RolloutError(f"temperature={self.temperature}; must be > 0 (use a small value for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise RolloutError(f"top_p={self.top_p}; allowed range (0, 1]")


@dataclass(frozen=True)
class Rollout:
    """Sampled sequences of one rank."""

    prompts: torch.Tensor  # [n, P] long
    responses: torch.Tensor  # [n, R] long, pad_id after the stop
    response_mask: torch.Tensor  # [n, R] float, 1 through the first <eos>
    sample_logprobs: torch.Tensor  # [n, R] float, 0 where masked

    @property
    def tokens(self) -> torch.Tensor:
        """prompts ‖ responses, [n, P + R]."""
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        """Response lengths [n] (``<eos>`` included)."""
        return self.response_mask.sum(1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the top-p nucleus of probs [n, V] and renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [n, V]
    keep_sorted = mass_before < top_p  # the first token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def _next_logits(engine: Sampler, tokens: torch.Tensor, cache: Any, start_pos: int) -> torch.Tensor:
    """Logits [n, V] of the next token after ``tokens`` (the new part when ``cache`` holds the prefix)."""
    if cache is None:
        logits, _ = engine.forward(tokens)
    else:
        logits, _ = engine.forward(tokens[:, start_pos:], cache=cache, start_pos=start_pos)
    return logits[:, -1].float()


def _all_done(engine: Sampler, done: torch.Tensor, cache: Any) -> bool:
    """Whether decoding may stop: this rank's sequences are all finished and, when decoding
    without a cache, every data-parallel rank's are too.

    Without a cache each decode step re-runs ``engine.forward``, which on a sharded program is
    a collective over the data-parallel ranks (ZeRO-3 gathers, EP all-to-alls): a rank that
    stopped early would leave the others waiting in that collective forever. So every rank
    all-reduces its count of unfinished sequences at every step (a rank-uniform rule, since
    all ranks run the same engine) and stops only when the sum is zero; finished sequences
    keep receiving ``pad_id`` with mask 0. With a cache, decoding is local and ranks stop
    independently.
    """
    dp = getattr(engine, "dp", None)
    if cache is not None or dp is None:
        return bool(done.all())
    remaining = torch.tensor(float((~done).sum()), dtype=torch.float64)
    return float(dp.all_reduce_sum(remaining)) == 0.0


@torch.no_grad()
def generate(
    engine: Sampler,
    prompts: torch.Tensor,
    sampling: SamplingConfig,
    *,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample one response per prompt (see module docstring); prompts [n, P] share one length."""
    n, prompt_len = prompts.shape
    total = prompt_len + sampling.max_new_tokens
    if total > engine.max_seq_len:
        raise RolloutError(
            f"prompt_len {prompt_len} + max_new_tokens {sampling.max_new_tokens} = {total} exceeds the "
            f"policy's max_seq_len {engine.max_seq_len}; lower max_new_tokens or build a longer model"
        )
    cache = engine.new_cache(n, total)
    stops = torch.tensor([eos_id, *sampling.stop_ids], dtype=torch.long, device=prompts.device)
    tokens = prompts
    done = torch.zeros(n, dtype=torch.bool, device=prompts.device)
    picked, masks, logps = [], [], []
    start_pos = 0
    for step in range(sampling.max_new_tokens):
        logits = _next_logits(engine, tokens, cache, start_pos) / sampling.temperature  # [n, V]
        start_pos = tokens.shape[1]
        logprobs = logits.log_softmax(-1)
        choice = torch.multinomial(top_p_filter(logprobs.exp(), sampling.top_p), 1, generator=generator)  # [n, 1]
        choice = choice.squeeze(1)
        alive = ~done
        picked.append(torch.where(alive, choice, torch.full_like(choice, pad_id)))
        masks.append(alive.float())
        logps.append(logprobs.gather(-1, choice[:, None]).squeeze(1) * alive)
        done = done | torch.isin(choice, stops)
        tokens = torch.cat([tokens, picked[-1][:, None]], dim=1)
        if (cache is None or (step + 1) % STOP_CHECK_EVERY == 0) and _all_done(engine, done, cache):
            break
    mask = torch.stack(masks, 1)
    width = int(mask.any(0).nonzero().max()) + 1  # past the last stop (module docstring); column 0 is alive
    return Rollout(prompts, torch.stack(picked, 1)[:, :width], mask[:, :width], torch.stack(logps, 1)[:, :width])
