"""Multi-digit addition: ``"042+117="`` → ``"0159<eos>"``.

Prompt: two operands uniform in [0, 10^digits), zero-padded to ``digits``
characters, as ``a+b=``. Correct response: a + b zero-padded to
``digits + 1`` characters, then ``<eos>``; fixed widths keep every prompt the
same length.

Reward (sequence level only): 1 for an exact match (through ``<eos>``), else
0; token_reward is None.
"""

from __future__ import annotations

import torch

from autoshard.runtime.tasks._base import EOS_ID, CharTask, TaskError, encode, exact_match
from autoshard.runtime.tasks._numbers import from_digits, to_digits

_PLUS_ID, _EQUALS_ID = encode("+")[0], encode("=")[0]


class AdditionTask(CharTask):
    """Add two ``digits``-digit numbers (see module docstring)."""

    name = "addition"

    def __init__(self, *, digits: int = 2) -> None:
        if not 1 <= digits <= 9:
            raise TaskError(f"addition: digits={digits}; allowed 1..9")
        self.digits = digits
        self.prompt_len = 2 * digits + 2
        self.max_response_len = digits + 2

    def _problems(self, n: int, generator: torch.Generator) -> torch.Tensor:
        operands = torch.randint(0, 10**self.digits, (n, 2), generator=generator)
        a, b = to_digits(operands[:, 0], self.digits), to_digits(operands[:, 1], self.digits)
        return torch.cat([a, torch.full((n, 1), _PLUS_ID), b, torch.full((n, 1), _EQUALS_ID)], dim=1)

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        d = self.digits
        total = from_digits(prompts[:, :d]) + from_digits(prompts[:, d + 1 : 2 * d + 1])
        body = to_digits(total, d + 1)
        return torch.cat([body, torch.full_like(body[:, :1], EOS_ID)], dim=1)

    def rewards(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """Sequence-level: 1 for an exact match, else 0."""
        return exact_match(self._targets(prompts), responses, response_mask), None
