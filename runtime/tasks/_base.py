"""The shared task vocabulary, the ``Task`` protocol, ``CharTask`` and the reward checks.

The package docstring (``runtime/tasks/__init__.py``) states the decisions; the tasks
(``addition``, ``arithmetic``, ``sorting``) build on this module, and the package's
registry imports them.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from autoshard.errors import AutoshardError

PAD, EOS = "<pad>", "<eos>"
VOCAB: tuple[str, ...] = (PAD, EOS, *"0123456789", ",", "+", "=", ":")
PAD_ID, EOS_ID = 0, 1
_CHAR_TO_ID = {tok: i for i, tok in enumerate(VOCAB)}


class TaskError(AutoshardError):
    """A task name, option, vocabulary or reward is unusable for PPO."""


def encode(text: str) -> list[int]:
    """Characters of ``text`` → token ids (specials are not spelled in text)."""
    try:
        return [_CHAR_TO_ID[ch] for ch in text]
    except KeyError as err:
        raise TaskError(
            f"character {err.args[0]!r} of {text!r} is not in the task vocabulary {VOCAB[2:]}; "
            "use digits and , + = : only"
        ) from None


def decode(ids: list[int] | torch.Tensor, *, stop_at_eos: bool = True) -> str:
    """Token ids → text; ``<pad>`` prints as ``_``, ``<eos>`` ends the text (or prints as ``$``)."""
    out = []
    for i in ids.tolist() if isinstance(ids, torch.Tensor) else ids:
        if i == EOS_ID and stop_at_eos:
            break
        out.append({PAD_ID: "_", EOS_ID: "$"}.get(i, VOCAB[i] if 0 <= i < len(VOCAB) else "?"))
    return "".join(out)


@runtime_checkable
class Task(Protocol):
    """A prompt generator with a verifiable reward over the shared vocabulary."""

    name: str
    prompt_len: int
    """P: every prompt has exactly this many tokens."""
    max_response_len: int
    """R: the longest correct response, ``<eos>`` included (a good ``max_new_tokens``)."""

    def sample_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts as LongTensor [n, P]."""
        ...

    def rewards(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prompts [n, P], responses [n, R], mask [n, R] → (seq_reward [n], token_reward [n, R] or None)."""
        ...


class CharTask:
    """Shared machinery: a task defines ``_problems`` (prompt ids) and ``_targets`` (answer ids + ``<eos>``)."""

    name = "base"
    prompt_len = 0
    max_response_len = 0
    vocab = VOCAB
    pad_id, eos_id = PAD_ID, EOS_ID

    def sample_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts [n, P] drawn with ``generator``."""
        if n <= 0:
            raise TaskError(f"{self.name}: cannot sample n={n} prompts; ask for at least 1")
        prompts = self._problems(n, generator)
        assert prompts.shape == (n, self.prompt_len), prompts.shape
        return prompts

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The correct responses [n, R_target] (``<eos>`` last) for ``prompts`` [n, P]."""
        return self._targets(prompts)

    def _problems(self, n: int, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rewards(
        self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Text → ids."""
        return encode(text)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Ids → text, stopping at ``<eos>``."""
        return decode(ids)


def position_matches(prompts_targets: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float [n, R]: 1 where the (masked) response token equals the target token at that position."""
    n, resp_len = responses.shape
    tgt_len = prompts_targets.shape[1]
    width = min(resp_len, tgt_len)
    hits = torch.zeros(n, resp_len, dtype=torch.float32, device=responses.device)
    hits[:, :width] = (responses[:, :width] == prompts_targets[:, :width]).float()
    return hits * mask.float()


def exact_match(targets: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float [n]: 1 where the response (through its ``<eos>``) equals the target exactly."""
    hits = position_matches(targets, responses, mask)
    return (hits.sum(1) == targets.shape[1]).float() * (mask.sum(1) == targets.shape[1]).float()


def task_vocab_size(task: Task) -> int:
    """How many token ids ``task`` speaks (ids 0 .. n-1): ``len(VOCAB)`` unless the task says otherwise."""
    return len(getattr(task, "vocab", VOCAB))


def check_vocab(task: Task, vocab_size: int, *, what: str = "policy") -> None:
    """Raise ``TaskError`` if a policy with ``vocab_size`` logits cannot emit every task token.

    ``what`` names the policy in the message (e.g. ``"model 'cfg/'"``)."""
    needed = task_vocab_size(task)
    if vocab_size < needed:
        raise TaskError(
            f"{what} vocab_size={vocab_size} is smaller than the {needed} tokens of task {task.name!r}; "
            f"use a model with vocab_size >= {needed} (task token k is the model's id k)"
        )


def check_rewards(
    task_name: str, seq_reward: torch.Tensor, token_reward: torch.Tensor | None, shape: tuple[int, int]
) -> None:
    """Raise ``TaskError`` on wrong shapes or NaN / infinite rewards."""
    n, resp_len = shape
    if tuple(seq_reward.shape) != (n,):
        raise TaskError(f"task {task_name!r} returned seq_reward of shape {tuple(seq_reward.shape)}; expected ({n},)")
    if token_reward is not None and tuple(token_reward.shape) != (n, resp_len):
        raise TaskError(
            f"task {task_name!r} returned token_reward of shape {tuple(token_reward.shape)}; expected ({n}, {resp_len})"
        )
    for label, value in (("seq_reward", seq_reward), ("token_reward", token_reward)):
        if value is not None and not torch.isfinite(value).all():
            bad = int((~torch.isfinite(value)).sum())
            raise TaskError(
                f"task {task_name!r} returned {bad} non-finite {label} values (NaN or inf); "
                "fix the reward function: PPO refuses to train on them"
            )
