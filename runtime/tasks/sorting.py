"""Sort a short digit string: ``"3142:"`` → ``"1234<eos>"``.

Prompt: ``length`` digits drawn uniformly (repeats allowed), then ``:``.
Correct response: the digits in ascending order, then ``<eos>``.

Reward (sequence level only): the fraction of the T = length + 1 target
positions (``<eos>`` included) that the response matches, in [0, 1];
token_reward is None.
"""

from __future__ import annotations

import torch

from autoshard.runtime.tasks._base import EOS_ID, CharTask, TaskError, encode, position_matches
from autoshard.runtime.tasks._numbers import DIGIT0_ID

_COLON_ID = encode(":")[0]


class SortingTask(CharTask):
    """Sort ``length`` digits ascending (see module docstring)."""

    name = "sorting"

    def __init__(self, *, length: int = 4) -> None:
        if length < 2:
            raise TaskError(f"sorting: length={length}; need at least 2 digits to sort")
        self.length = length
        self.prompt_len = length + 1
        self.max_response_len = length + 1

    def _problems(self, n: int, generator: torch.Generator) -> torch.Tensor:
        digits = torch.randint(0, 10, (n, self.length), generator=generator) + DIGIT0_ID
        return torch.cat([digits, torch.full((n, 1), _COLON_ID)], dim=1)

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        ordered = prompts[:, : self.length].sort(dim=1).values
        return torch.cat([ordered, torch.full_like(ordered[:, :1], EOS_ID)], dim=1)

    def rewards(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """Sequence-level: fraction of target positions matched."""
        targets = self._targets(prompts)
        hits = position_matches(targets, responses, response_mask)
        return hits.sum(1) / targets.shape[1], None
