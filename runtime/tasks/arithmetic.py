"""Arithmetic-sequence continuation with a dense per-token reward.

Prompt: ``num_terms`` terms of a_k = (a + k·d) mod ``modulus``, each written
with a fixed width and followed by ``,`` — with the defaults (modulus 10,
width 1) ``"3,5,7,"``. Correct response: the next ``answer_terms`` terms in
the same format, then ``<eos>`` — ``"9,1,<eos>"``. Start a is uniform in
[0, modulus), step d uniform in [1, max_step].

Reward (dense, per token): token t earns 1/T when it equals target token t
(T = target length, ``<eos>`` included); tokens past the target earn 0.
seq_reward is 0, so a sequence's total reward is the fraction of target
positions it got right, in [0, 1]. A uniformly random policy over the 16
tokens scores about 1/16.
"""

from __future__ import annotations

import torch

from autoshard.runtime.tasks._base import EOS_ID, CharTask, TaskError, encode, position_matches
from autoshard.runtime.tasks._numbers import from_digits, to_digits, with_separator

_COMMA_ID = encode(",")[0]


class ArithmeticTask(CharTask):
    """Continue an arithmetic sequence modulo ``modulus`` (see module docstring)."""

    name = "arithmetic"

    def __init__(self, *, num_terms: int = 3, answer_terms: int = 2, modulus: int = 10, max_step: int = 9) -> None:
        if num_terms < 2 or answer_terms < 1:
            raise TaskError(
                f"arithmetic: num_terms={num_terms}, answer_terms={answer_terms}; "
                "need num_terms >= 2 (to show the step) and answer_terms >= 1"
            )
        if modulus < 2 or not 1 <= max_step < modulus:
            raise TaskError(f"arithmetic: modulus={modulus}, max_step={max_step}; need 1 <= max_step < modulus")
        self.num_terms, self.answer_terms = num_terms, answer_terms
        self.modulus, self.max_step = modulus, max_step
        self.width = len(str(modulus - 1))
        self.prompt_len = num_terms * (self.width + 1)
        self.max_response_len = answer_terms * (self.width + 1) + 1

    def _problems(self, n: int, generator: torch.Generator) -> torch.Tensor:
        start = torch.randint(0, self.modulus, (n, 1), generator=generator)
        step = torch.randint(1, self.max_step + 1, (n, 1), generator=generator)
        terms = (start + step * torch.arange(self.num_terms)) % self.modulus  # [n, num_terms]
        return with_separator(to_digits(terms, self.width), _COMMA_ID)

    def _terms(self, prompts: torch.Tensor) -> torch.Tensor:
        return from_digits(prompts.view(prompts.shape[0], self.num_terms, self.width + 1)[..., : self.width])

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        terms = self._terms(prompts)  # [n, num_terms]
        step = (terms[:, 1:2] - terms[:, 0:1]) % self.modulus
        ks = torch.arange(1, self.answer_terms + 1, device=prompts.device)
        nxt = (terms[:, -1:] + step * ks) % self.modulus  # [n, answer_terms]
        body = with_separator(to_digits(nxt, self.width), _COMMA_ID)
        eos = torch.full((prompts.shape[0], 1), EOS_ID, dtype=body.dtype, device=body.device)
        return torch.cat([body, eos], dim=1)  # [n, T]

    def rewards(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense: 1/T per correct position; seq_reward 0 (see module docstring)."""
        targets = self._targets(prompts)
        token_reward = position_matches(targets, responses, response_mask) / targets.shape[1]
        return torch.zeros(prompts.shape[0], device=prompts.device), token_reward
