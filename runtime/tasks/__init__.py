"""Verifiable character-vocabulary tasks for PPO: prompts, rewards, no downloads.

Every task speaks one shared 16-token vocabulary (``VOCAB``): ``<pad>``,
``<eos>``, the digits ``0``–``9`` and ``, + = :``. A policy whose
``vocab_size`` is at least 16 covers it: task token k is the policy's id k
(a wider policy is restricted to ids 0-15 by the PPO engine,
``runtime/ppo_program.py`` note "user models"); ``check_vocab`` raises
``TaskError`` otherwise.

Decisions:
- Prompts have one fixed length per task (``prompt_len``), so a batch of
  prompts needs no padding mask in the KV cache. Numbers are zero-padded to a
  fixed width where a task needs it.
- A response is the sampled tokens up to and including the first ``<eos>``.
  ``<eos>`` is an action like any other: an "empty" response (``<eos>``
  first) has one token in ``response_mask`` and receives its reward on that
  token, so no sequence ever has zero tokens to train on.
- Rewards are ``(seq_reward [n], token_reward [n, R] or None)``; the total
  reward of a sequence is ``seq_reward + sum_t token_reward[t]``. Every task
  keeps that total in [0, 1]. Rewards that are NaN or infinite raise
  ``TaskError`` (``check_rewards``): never train on garbage.

Registry: ``get_task("arithmetic", **options)``, ``list_tasks()``. The vocabulary, ``Task``,
``CharTask`` and the checks live in ``_base.py`` (the tasks import it; this package imports them).
"""

from __future__ import annotations

from typing import Callable

from autoshard.runtime.tasks._base import (
    EOS,
    EOS_ID,
    PAD,
    PAD_ID,
    VOCAB,
    CharTask,
    Task,
    TaskError,
    check_rewards,
    check_vocab,
    decode,
    encode,
    exact_match,
    position_matches,
    task_vocab_size,
)
from autoshard.runtime.tasks.addition import AdditionTask
from autoshard.runtime.tasks.arithmetic import ArithmeticTask
from autoshard.runtime.tasks.sorting import SortingTask


TASK_PRESETS: dict[str, dict[str, object]] = {"arithmetic": {"max_step": 1}}
"""Options a run gives a task by default (``autoshard ppo --task NAME``): the demo's arithmetic task at its
reference difficulty."""


def _registry() -> dict[str, Callable[..., CharTask]]:
    return {"arithmetic": ArithmeticTask, "sorting": SortingTask, "addition": AdditionTask}


def list_tasks() -> list[str]:
    """Names of the registered tasks."""
    return sorted(_registry())


def get_task(name: str, **options: object) -> CharTask:
    """The task ``name`` built with ``options`` (see each task's constructor)."""
    registry = _registry()
    if name not in registry:
        raise TaskError(f"unknown task {name!r}; allowed: {', '.join(sorted(registry))}")
    try:
        return registry[name](**options)
    except TypeError as err:
        raise TaskError(f"task {name!r} rejected options {options}: {err}; see its constructor docstring") from None


__all__ = [
    "EOS",
    "EOS_ID",
    "TASK_PRESETS",
    "PAD",
    "PAD_ID",
    "VOCAB",
    "CharTask",
    "Task",
    "TaskError",
    "check_rewards",
    "check_vocab",
    "decode",
    "encode",
    "exact_match",
    "get_task",
    "list_tasks",
    "position_matches",
    "task_vocab_size",
]
