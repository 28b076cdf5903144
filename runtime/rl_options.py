"""What a sharded PPO/GRPO run trains on and how: the prompt source, the algorithm options, their flags.

``PPORun`` (``runtime/ppo_program.py``) carries ``data: PromptSource | None``
(None: the built-in ``task``) and ``rl: RLOptions``. ``build_task`` turns
them into the ``Task`` the trainer samples from; ``ppo_config`` in
``ppo_program`` turns ``RLOptions`` into ``PPOConfig`` fields
(``rl_config_fields``). ``add_rl_arguments`` declares the flags once for
``autoshard ppo`` and its torchrun workers; ``rl_worker_flags`` forwards them.

Defaults chosen from ``algo`` (printed by rank 0 with the reason):
``samples_per_prompt`` 1 for PPO, 4 for GRPO (a group needs at least 2);
``kl_mode`` "reward" for PPO (InstructGPT), "loss" for GRPO (DeepSeekMath).
``max_new_tokens``: the task's longest answer, 16 for a prompt set.

No torch import here: the CLI's ``--help`` reads these flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError

DEFAULT_GROUP = 4
LONG_PROMPT_CHOICES = ("refuse", "truncate")
DEFAULT_PROMPT_NEW_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class PromptSource:
    """User prompts and reward instead of a built-in task (``runtime/rl_data.py``, ``runtime/rl_reward.py``)."""

    prompts: Any
    """A JSONL path, or an iterable of ``{"prompt", "reference"}`` dicts or strings."""
    reward: Any
    """``package.module:function``, ``path/file.py:function`` or a callable (``rl_reward`` convention)."""
    tokenizer: Any = "char"
    """``"char"``, ``"bytes"``, a tokenizer directory, or a tokenizer object (``rl_data.as_tokenizer``)."""
    long_prompts: str = "refuse"
    """A prompt over the budget (context − max_new_tokens): "refuse" or "truncate" (keep its last tokens)."""


@dataclass(frozen=True, kw_only=True)
class RLOptions:
    """Algorithm and generation options of a run (``PPOConfig`` documents each objective term)."""

    algo: str = "ppo"
    """"ppo" (GAE over the value head) or "grpo" (group-relative advantages, no value loss)."""
    samples_per_prompt: int | None = None
    """Responses per prompt (None: 1 for PPO, 4 for GRPO)."""
    loss_agg: str = "token"
    """"token" (token mean over the mini-batch) or "sequence" (mean of each response's token mean)."""
    kl_mode: str | None = None
    """"reward" (−β·k1 per token in the reward) or "loss" (+β·k3 in the loss); None: by algo."""
    entropy_coef: float = 0.0
    """Entropy bonus c_H."""
    clip: float = 0.2
    """Ratio clip ε."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs use it too)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int | None = None
    """Longest response (None: the task's longest answer, 16 for a prompt set)."""
    stop: tuple[str, ...] = ()
    """Strings (one token each) that end a response as ``<eos>`` does."""
    reference: str | None = None
    """MODEL of a separate frozen reference for the KL (same architecture); None: a frozen copy of the policy's start."""

    def group(self) -> int:
        """G, with the algo's default."""
        if self.samples_per_prompt is not None:
            return self.samples_per_prompt
        return DEFAULT_GROUP if self.algo == "grpo" else 1

    def defaults_said(self) -> list[str]:
        """One line per default chosen from ``algo`` (module docstring)."""
        said = []
        if self.algo == "grpo" and self.samples_per_prompt is None:
            said.append(f"samples per prompt: {DEFAULT_GROUP} (GRPO compares responses within a group of the same prompt)")
        if self.kl_mode is None and self.algo == "grpo":
            said.append("KL: k3 in the loss (GRPO keeps the reward free of the KL; --kl-mode reward to change)")
        return said


def rl_config_fields(options: RLOptions) -> dict[str, Any]:
    """The ``PPOConfig`` fields ``options`` sets (sampling excluded: it needs the task)."""
    return dict(algo=options.algo, samples_per_prompt=options.group(), loss_agg=options.loss_agg,
                kl_mode=options.kl_mode or ("loss" if options.algo == "grpo" else "reward"),
                entropy_coef=options.entropy_coef, clip=options.clip)


# --------------------------------------------------------------------------- flags (CLI and workers)


def add_rl_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt-set and algorithm flags of ``autoshard ppo`` and its workers."""
    group = parser.add_argument_group("your own prompts and rewards, algorithm")
    group.add_argument("--prompts", metavar="FILE.jsonl", help='train on these prompts (one {"prompt": ..., '
                       '"reference": ...} per line) instead of --task; needs --reward')
    group.add_argument("--reward", metavar="MODULE:FUNCTION", help="reward function of --prompts: "
                       "fn(prompts, responses, references, response_ids) -> one float per response")
    group.add_argument("--tokenizer", default="char", metavar="char|bytes|DIR", help="tokenizer of --prompts: the "
                       "tasks' characters (default), UTF-8 bytes, or a Hugging Face tokenizer directory")
    group.add_argument("--long-prompts", choices=LONG_PROMPT_CHOICES, default="refuse", help="a prompt longer than "
                       "the context minus --max-new-tokens: refuse the run (default) or keep its last tokens")
    group.add_argument("--algo", choices=("ppo", "grpo"), default="ppo", help="ppo: GAE with the value head "
                       "(default); grpo: group-relative advantages, no value loss")
    group.add_argument("--samples-per-prompt", type=int, default=None, metavar="N",
                       help=f"responses per prompt (default 1 for ppo, {DEFAULT_GROUP} for grpo)")
    group.add_argument("--loss-agg", choices=("token", "sequence"), default="token",
                       help="loss mean over response tokens (default) or over responses")
    group.add_argument("--kl-mode", choices=("reward", "loss"), default=None,
                       help="KL to the reference in the reward (k1) or in the loss (k3); default: reward for ppo, loss for grpo")
    group.add_argument("--entropy-coef", type=float, default=0.0, metavar="C", help="entropy bonus (default 0)")
    group.add_argument("--clip", type=float, default=0.2, metavar="EPS", help="policy ratio clip (default 0.2)")
    group.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature (default 1)")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1)")
    group.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                       help=f"longest response (default: the task's answer length, {DEFAULT_PROMPT_NEW_TOKENS} for --prompts)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="a one-token string that ends a response like <eos> (repeatable)")
    group.add_argument("--reference", metavar="MODEL", help="a separate frozen reference model for the KL "
                       "(same architecture as MODEL; default: a frozen copy of the policy's initial weights)")


def source_from_args(args: argparse.Namespace) -> PromptSource | None:
    """The ``PromptSource`` of parsed flags (None without ``--prompts``); ``--prompts`` and ``--reward`` go together."""
    if (args.prompts is None) != (args.reward is None):
        given, missing = ("--prompts", "--reward") if args.reward is None else ("--reward", "--prompts")
        raise AutoshardError(f"{given} needs {missing}: a prompt set is scored by a reward function "
                             "(e.g. --reward autoshard.rl:arithmetic_reward)")
    if args.prompts is None:
        return None
    return PromptSource(prompts=str(args.prompts), reward=args.reward, tokenizer=str(args.tokenizer),
                        long_prompts=args.long_prompts)


def options_from_args(args: argparse.Namespace) -> RLOptions:
    """The ``RLOptions`` of parsed flags."""
    return RLOptions(algo=args.algo, samples_per_prompt=args.samples_per_prompt, loss_agg=args.loss_agg,
                     kl_mode=args.kl_mode, entropy_coef=args.entropy_coef, clip=args.clip,
                     temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                     stop=tuple(args.stop), reference=args.reference)


def rl_worker_flags(args: argparse.Namespace, *, absolute: Any = str) -> list[str]:
    """The flags of ``add_rl_arguments`` as given, for the workers (``absolute`` maps paths)."""
    flags: list[str] = []
    for name in ("prompts", "reward", "tokenizer", "long_prompts", "algo", "samples_per_prompt", "loss_agg", "kl_mode",
                 "entropy_coef", "clip", "temperature", "top_p", "max_new_tokens", "reference"):
        value = getattr(args, name)
        if value is None:
            continue
        if name == "prompts" or (name == "tokenizer" and value not in ("char", "bytes")):
            value = absolute(value)
        elif name == "reward" and (value.rpartition(":")[0].endswith(".py") or "/" in value):
            target, _, attr = value.rpartition(":")
            value = f"{absolute(target)}:{attr}"
        flags += [f"--{name.replace('_', '-')}", str(value)]
    for stop in args.stop:
        flags += ["--stop", stop]
    return flags


__all__ = [
    "DEFAULT_GROUP",
    "PromptSource",
    "RLOptions",
    "add_rl_arguments",
    "options_from_args",
    "rl_config_fields",
    "rl_worker_flags",
    "source_from_args",
]
