"""Fixed-width decimal numbers as token ids (digit ``k`` is token ``k + 2``), vectorised over a batch."""

from __future__ import annotations

import torch

DIGIT0_ID = 2  # id of "0" in the shared vocabulary


def to_digits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative ints [...] → zero-padded digit token ids [..., width], most significant first."""
    powers = 10 ** torch.arange(width - 1, -1, -1, device=values.device)  # [width]
    return (values[..., None] // powers) % 10 + DIGIT0_ID


def from_digits(ids: torch.Tensor) -> torch.Tensor:
    """Digit token ids [..., width] → ints [...] (inverse of ``to_digits``)."""
    width = ids.shape[-1]
    powers = 10 ** torch.arange(width - 1, -1, -1, device=ids.device)
    return ((ids - DIGIT0_ID) * powers).sum(-1)


def with_separator(digits: torch.Tensor, sep_id: int) -> torch.Tensor:
    """[n, terms, width] → [n, terms · (width + 1)]: every term followed by ``sep_id``."""
    sep = torch.full((*digits.shape[:-1], 1), sep_id, dtype=digits.dtype, device=digits.device)
    return torch.cat([digits, sep], dim=-1).flatten(1)
