"""User reward functions for RL: the calling convention, the checks, and a rule-based example.

A reward function scores one batch of responses:

    reward(prompts: list[str], responses: list[str], references: list[str | None],
           response_ids: list[list[int]]) -> Sequence[float]      # one finite float per response

``responses`` are decoded without their final ``<eos>``; ``response_ids`` are
the sampled ids through the stop token (what the policy is trained on). Under
GRPO a prompt appears G times in a row, once per sampled response.

``score`` calls it and refuses, in one line naming the dataset index of the
prompt (``RewardError``): an exception (the batch is re-scored one response at
a time to find the prompt that raises), a count other than one per response,
a value that is not a number, NaN or infinite. ``load_reward`` imports
``package.module:function`` or ``path/file.py:function``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from autoshard.errors import AutoshardError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(AutoshardError):
    """A reward function that cannot be loaded, raised, or returned something other than one finite float per response."""


def arithmetic_reward(prompts: Sequence[str], responses: Sequence[str], references: Sequence[str | None],
                      response_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
    """Rule-based verifier: 1.0 where the first number in the response equals the reference number, else 0.0.

    A response without a number scores 0; a missing or non-numeric reference raises (``score`` names the prompt).
    """
    out = []
    for response, reference in zip(responses, references):
        if reference is None or not _NUMBER.fullmatch(reference.strip()):
            raise ValueError(f"arithmetic_reward needs a numeric reference, got {reference!r}")
        found = _NUMBER.search(response)
        out.append(float(found is not None and math.isclose(float(found.group()), float(reference), abs_tol=1e-9)))
    return out


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def score(fn: Callable[..., Any], prompts: list[str], responses: list[str], references: list[str | None],
          response_ids: list[list[int]], dataset_index: list[int]) -> list[float]:
    """``fn`` on the batch, checked (module docstring); ``dataset_index[i]`` names response i's prompt in errors."""
    try:
        values = fn(prompts, responses, references, response_ids)
    except Exception as err:  # noqa: BLE001 - the user's function: say what it raised, and on which prompt
        raise RewardError(_raise_message(fn, err, prompts, responses, references, response_ids, dataset_index)) from err
    try:
        values = [v for v in values]
    except TypeError:
        raise RewardError(f"reward {_name(fn)} returned a {type(values).__name__} for the batch of prompts "
                          f"{_indices(dataset_index)}; return one float per response") from None
    if len(values) != len(responses):
        raise RewardError(f"reward {_name(fn)} returned {len(values)} values for {len(responses)} responses (prompts "
                          f"{_indices(dataset_index)}); return one float per response, in order")
    out = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward {_name(fn)} returned {value!r} for prompt {dataset_index[i]} (response {i} of "
                              "the batch); return a float") from None
        if not math.isfinite(number):
            raise RewardError(f"reward {_name(fn)} returned {number} for prompt {dataset_index[i]} (response {i} of "
                              "the batch); rewards must be finite")
        out.append(number)
    return out


def _raise_message(fn: Callable[..., Any], err: Exception, prompts: list[str], responses: list[str],
                   references: list[str | None], response_ids: list[list[int]], dataset_index: list[int]) -> str:
    """Name the first prompt whose response alone makes ``fn`` raise (else the batch)."""
    for i in range(len(responses)):
        try:
            fn(prompts[i : i + 1], responses[i : i + 1], references[i : i + 1], response_ids[i : i + 1])
        except Exception as one:  # noqa: BLE001
            return (f"reward {_name(fn)} raised {type(one).__name__}: {one} on prompt {dataset_index[i]} "
                    f"(response {responses[i]!r}); fix the function or the prompt set")
    return (f"reward {_name(fn)} raised {type(err).__name__}: {err} on the batch of prompts "
            f"{_indices(dataset_index)} (no single response raises)")


def _indices(index: list[int]) -> str:
    shown = ", ".join(map(str, index[:8]))
    return shown + (f", ... ({len(index)} in all)" if len(index) > 8 else "")


def load_reward(spec: str) -> Callable[..., Any]:
    """The function ``package.module:function`` or ``path/file.py:function`` names (``RewardError`` otherwise)."""
    target, sep, attr = spec.strip().rpartition(":")
    if not (sep and target and attr):
        raise RewardError(f"reward {spec!r}: give module:function or path/file.py:function")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardError(f"reward {spec!r}: no Python file {str(path)!r}")
        loader = importlib.util.spec_from_file_location(f"_autoshard_reward_{abs(hash(str(path.resolve())))}", path)
        module = importlib.util.module_from_spec(loader)
        runner = lambda: loader.loader.exec_module(module)  # noqa: E731
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as under python -m: the current directory's modules import
        module = None
        runner = lambda: importlib.import_module(target)  # noqa: E731
    try:
        loaded = runner()
    except ImportError as err:
        raise RewardError(f"reward {spec!r}: cannot import {target!r} ({err}); put it on PYTHONPATH or give "
                          "path/file.py:function") from None
    except Exception as err:  # noqa: BLE001 - importing the user's module ran its code
        raise RewardError(f"reward {spec!r}: importing {target!r} raised {type(err).__name__}: {err}") from err
    module = loaded if module is None else module
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {target!r} has no function {attr!r}")
    return fn


def resolve_reward(reward: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable as is; a string through ``load_reward``."""
    return load_reward(reward) if isinstance(reward, str) else reward


__all__ = ["RewardError", "arithmetic_reward", "load_reward", "resolve_reward", "score"]
