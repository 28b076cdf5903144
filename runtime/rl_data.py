"""User prompts for RL: the prompt set, the tokenizers, and the task PPO/GRPO trains on.

A prompt set is a JSONL file with one ``{"prompt": str, "reference": str}``
object per line (``reference`` optional; other keys ignored), or any iterable
of such dicts or of plain strings (``load_prompts``). Errors are one line
(``PromptDataError``): a missing file, a line that is not JSON (its line
number), a line without ``"prompt"``, an empty set.

Tokenizers speak ``encode(text) -> list[int]`` and ``decode(ids) -> str`` and
name ``vocab_size``, ``pad_id``, ``eos_id`` (``as_tokenizer``):

| spec | ids | vocabulary |
| --- | --- | --- |
| ``"char"`` (default) | the tasks' characters: ``<pad>`` 0, ``<eos>`` 1, digits, ``, + = :`` | 16, the reference models' task vocabulary |
| ``"bytes"`` | UTF-8 bytes b → b + 2; ``<pad>`` 0, ``<eos>`` 1 | 258 (reference models are built with it) |
| a Hugging Face tokenizer object | ``encode(text, add_special_tokens=False)``, ``decode(ids, skip_special_tokens=True)``; ``eos_token_id``; ``pad_token_id`` or, without one, eos | ``len(tokenizer)`` |
| a directory | ``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)`` | as above |

``PromptTask`` implements the ``runtime/tasks`` ``Task`` protocol over a prompt
set, a tokenizer and a reward function (``runtime/rl_reward.py``): every
prompt is encoded once at construction and left-padded with ``pad_id`` to the
longest one, P tokens (the reference models have no attention mask: a short
prompt is seen after its pads). A prompt longer than the budget (the policy's
context minus ``max_new_tokens``) is refused or cut to its LAST ``budget``
tokens (``long_prompts``); ``notice`` says how many were cut, once. Prompts
are drawn uniformly with replacement from the seeded generator, so a resumed
run draws what an uninterrupted one draws.

[Note: which rows a batch holds]
The ``Task`` protocol scores ``rewards(prompts, responses, mask)``, but a
reward needs each prompt's reference, so ``sample_prompts`` records the
dataset indices it drew, and ``rewards`` scores the prompts of the last draw,
repeated G times per row (``PPOConfig.samples_per_prompt``, consecutive rows);
it checks the rows are those prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from autoshard.errors import AutoshardError
from autoshard.runtime.rl_options import (
    DEFAULT_PROMPT_NEW_TOKENS,
    LONG_PROMPT_CHOICES as LONG_PROMPTS,
    PromptSource,
    RLOptions,
)
from autoshard.runtime.rl_reward import resolve_reward, score
from autoshard.runtime.rollout import SamplingConfig
from autoshard.runtime.tasks import EOS_ID, PAD_ID, TASK_PRESETS, VOCAB, decode, encode, get_task


class PromptDataError(AutoshardError):
    """A prompt set, a prompt or a tokenizer is unusable."""


@dataclass(frozen=True)
class PromptExample:
    """One prompt and its optional reference answer."""

    prompt: str
    reference: str | None = None


# --------------------------------------------------------------------------- loading


def load_prompts(source: str | Path | Iterable[Any]) -> list[PromptExample]:
    """The prompt set of ``source``: a JSONL path, or an iterable of dicts / strings / ``PromptExample`` (module docstring)."""
    if isinstance(source, (str, Path)):
        return _load_jsonl(Path(source).expanduser())
    examples = [_example(item, f"item {i}") for i, item in enumerate(source)]
    if not examples:
        raise PromptDataError("the prompt set is empty; give at least one prompt")
    return examples


def _load_jsonl(path: Path) -> list[PromptExample]:
    if not path.is_file():
        raise PromptDataError(f"prompt file {str(path)!r} does not exist; give a JSONL file with one "
                              '{"prompt": ..., "reference": ...} object per line')
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptDataError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); "
                                      'each line must be one object like {"prompt": "2+3=", "reference": "5"}') from None
            examples.append(_example(item, f"{path}:{number}"))
    if not examples:
        raise PromptDataError(f"prompt file {str(path)!r} holds no prompts; add one JSON object per line")
    return examples


def _example(item: Any, where: str) -> PromptExample:
    if isinstance(item, PromptExample):
        return item
    if isinstance(item, str):
        return PromptExample(item)
    if not isinstance(item, dict):
        raise PromptDataError(f"{where}: a {type(item).__name__}, not an object with a \"prompt\" key or a string")
    if "prompt" not in item:
        raise PromptDataError(f"{where}: no \"prompt\" key (keys: {', '.join(map(str, item)) or 'none'}); "
                              'each entry needs {"prompt": ..., "reference": ... (optional)}')
    prompt, reference = item["prompt"], item.get("reference")
    if not isinstance(prompt, str):
        raise PromptDataError(f"{where}: \"prompt\" is a {type(prompt).__name__}; it must be a string")
    return PromptExample(prompt, None if reference is None else str(reference))


# --------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    """What RL needs of a tokenizer (module docstring); ``as_tokenizer`` adapts Hugging Face ones."""

    vocab_size: int
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        ...

    def decode(self, ids: Sequence[int]) -> str:
        ...


class CharTokenizer:
    """The tasks' 16-token character vocabulary (``runtime/tasks``): digits and ``, + = :``."""

    def __init__(self) -> None:
        self.vocab_size, self.pad_id, self.eos_id = len(VOCAB), PAD_ID, EOS_ID

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(list(ids))


class ByteTokenizer:
    """UTF-8 bytes as ids 2..257; ``<pad>`` 0, ``<eos>`` 1 (vocabulary 258)."""

    vocab_size, pad_id, eos_id = 258, 0, 1

    def encode(self, text: str) -> list[int]:
        return [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (duck-typed: ``encode``, ``decode``, ``eos_token_id``) as a ``Tokenizer``."""

    def __init__(self, inner: Any) -> None:
        eos = getattr(inner, "eos_token_id", None)
        if eos is None:
            raise PromptDataError(f"tokenizer {type(inner).__name__} has no eos_token_id; RL ends responses at it: "
                                  "set tokenizer.eos_token")
        pad = getattr(inner, "pad_token_id", None)
        self.inner, self.eos_id, self.pad_id = inner, int(eos), int(eos if pad is None else pad)
        self.vocab_size = len(inner) if hasattr(inner, "__len__") else int(inner.vocab_size)

    def encode(self, text: str) -> list[int]:
        try:
            return list(self.inner.encode(text, add_special_tokens=False))
        except TypeError:  # a duck-typed tokenizer without the keyword
            return list(self.inner.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return self.inner.decode(list(ids), skip_special_tokens=True)
        except TypeError:
            return self.inner.decode(list(ids))


def as_tokenizer(spec: Any = "char") -> Tokenizer:
    """``"char"``, ``"bytes"``, a local tokenizer directory, or a tokenizer object (module docstring)."""
    if spec is None or spec == "char":
        return CharTokenizer()
    if spec == "bytes":
        return ByteTokenizer()
    if isinstance(spec, (str, Path)):
        return _local_hf_tokenizer(Path(spec).expanduser())
    if all(hasattr(spec, name) for name in ("encode", "decode", "vocab_size", "pad_id", "eos_id")):
        return spec
    if hasattr(spec, "encode") and hasattr(spec, "decode"):
        return HFTokenizer(spec)
    raise PromptDataError(f"tokenizer {spec!r}: allowed: 'char', 'bytes', a tokenizer directory, or an object "
                          "with encode(text) and decode(ids)")


def _local_hf_tokenizer(path: Path) -> Tokenizer:
    if not path.is_dir():
        raise PromptDataError(f"tokenizer {str(path)!r}: allowed: 'char', 'bytes' or a Hugging Face tokenizer "
                              "directory (save_pretrained writes one)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PromptDataError(f"tokenizer {str(path)!r} needs the transformers package; pip install transformers") from None
    return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))


def encode_stops(tokenizer: Tokenizer, stops: Sequence[str]) -> tuple[int, ...]:
    """Token ids of the stop strings; each must be exactly one token of ``tokenizer``."""
    ids = []
    for stop in stops:
        encoded = tokenizer.encode(stop)
        if len(encoded) != 1:
            raise PromptDataError(f"stop {stop!r} is {len(encoded)} tokens under this tokenizer; a stop must be "
                                  "exactly one token")
        ids.append(encoded[0])
    return tuple(ids)


# --------------------------------------------------------------------------- the task


class PromptTask:
    """A ``Task`` (``runtime/tasks``) over a user prompt set and reward function (module docstring)."""

    name = "prompts"

    def __init__(self, examples: Sequence[PromptExample], tokenizer: Tokenizer, reward: Callable[..., list[float]],
                 *, budget: int, max_new_tokens: int, long_prompts: str = "refuse") -> None:
        if long_prompts not in LONG_PROMPTS:
            raise PromptDataError(f"long_prompts={long_prompts!r}; allowed: {', '.join(LONG_PROMPTS)}")
        if budget < 1:
            raise PromptDataError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the policy's "
                                  "context; lower max_new_tokens")
        self.examples, self.tokenizer, self.reward = list(examples), tokenizer, reward
        self.pad_id, self.eos_id = tokenizer.pad_id, tokenizer.eos_id
        self.vocab = range(tokenizer.vocab_size)
        self.max_response_len = max_new_tokens
        encoded = [self._encode(i, ex.prompt) for i, ex in enumerate(self.examples)]
        long = [i for i, ids in enumerate(encoded) if len(ids) > budget]
        if long and long_prompts == "refuse":
            raise PromptDataError(
                f"{len(long)} of {len(encoded)} prompts are longer than the {budget}-token budget (the policy's context "
                f"minus max_new_tokens {max_new_tokens}); first: prompt {long[0]} ({len(encoded[long[0]])} tokens); "
                "shorten them, lower max_new_tokens, or pass --long-prompts truncate")
        self.notice = (f"prompts: {len(long)} of {len(encoded)} longer than {budget} tokens, cut to their last {budget} "
                       f"(first: prompt {long[0]})") if long else None
        encoded = [ids[-budget:] for ids in encoded]
        self.prompt_len = max(len(ids) for ids in encoded)
        rows = [[self.pad_id] * (self.prompt_len - len(ids)) + ids for ids in encoded]  # left-padded
        self.prompt_tokens = torch.tensor(rows, dtype=torch.long)  # [N, P]
        self._drawn: torch.Tensor | None = None

    def _encode(self, index: int, text: str) -> list[int]:
        try:
            ids = list(self.tokenizer.encode(text))
        except AutoshardError as err:
            raise PromptDataError(f"prompt {index}: {err}; or pick a tokenizer that covers it (--tokenizer bytes)") from None
        if not ids:
            raise PromptDataError(f"prompt {index} ({text!r}) encodes to no tokens; give it some text")
        return ids

    def __len__(self) -> int:
        return len(self.examples)

    def sample_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` prompts [n, P] drawn uniformly with replacement (recorded: note "which rows a batch holds")."""
        self._drawn = torch.randint(0, len(self.examples), (n,), generator=generator)
        return self.prompt_tokens[self._drawn]

    def dataset_index(self, prompts: torch.Tensor) -> torch.Tensor:
        """Dataset index [n] of each row of ``prompts`` (the last draw, each repeated G times)."""
        drawn = self._drawn
        assert drawn is not None and len(prompts) % len(drawn) == 0, "rewards() scores the last sample_prompts() draw"
        index = drawn.repeat_interleave(len(prompts) // len(drawn))
        assert torch.equal(self.prompt_tokens[index], prompts.cpu()), "rewards() scores the last sample_prompts() draw"
        return index

    def rewards(self, prompts: torch.Tensor, responses: torch.Tensor,
                response_mask: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(seq_reward [n] from the reward function, None): one float per response, checked (``rl_reward``)."""
        index = self.dataset_index(prompts).tolist()
        lengths = response_mask.sum(1).long().tolist()
        ids = [row[:length] for row, length in zip(responses.cpu().tolist(), lengths)]
        texts = [self.tokenizer.decode(r[:-1] if r and r[-1] == self.eos_id else r) for r in ids]
        examples = [self.examples[i] for i in index]
        values = score(self.reward, [ex.prompt for ex in examples], texts, [ex.reference for ex in examples], ids, index)
        return torch.tensor(values, dtype=torch.float32, device=responses.device), None


def run_tokenizer(data: PromptSource | None) -> Any:
    """The run's tokenizer: the prompt source's, else the tasks' characters."""
    return as_tokenizer(None if data is None else data.tokenizer)


def build_task(task_name: str, data: PromptSource | None, options: RLOptions, *, context: int,
               tokenizer: Any = None) -> tuple[Any, Any]:
    """(the ``Task`` to train on, its ``SamplingConfig``): ``data``'s prompts and reward, else ``task_name``.

    ``context`` is the policy's longest sequence; a prompt set gets ``context − max_new_tokens`` as its budget.
    """
    tokenizer = tokenizer if tokenizer is not None else run_tokenizer(data)
    if data is None:
        task = get_task(task_name, **TASK_PRESETS.get(task_name, {}))
        new_tokens = options.max_new_tokens or task.max_response_len
    else:
        new_tokens = options.max_new_tokens or DEFAULT_PROMPT_NEW_TOKENS
        task = PromptTask(load_prompts(data.prompts), tokenizer, resolve_reward(data.reward), budget=context - new_tokens,
                          max_new_tokens=new_tokens, long_prompts=data.long_prompts)
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=options.temperature, top_p=options.top_p,
                              stop_ids=encode_stops(tokenizer, options.stop))
    return task, sampling


__all__ = [
    "LONG_PROMPTS",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "PromptDataError",
    "PromptExample",
    "PromptTask",
    "Tokenizer",
    "as_tokenizer",
    "build_task",
    "encode_stops",
    "load_prompts",
    "run_tokenizer",
]
