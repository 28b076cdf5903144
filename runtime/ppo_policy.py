"""The model a PPO run trains: which MODELs it takes, how each is built the same on every rank.

``PPORun.model`` takes the CLI's MODEL grammar (``autoshard/models/source.py``),
loaded by ``load_policy``:

| MODEL | built as | initial weights (the same on every rank) | rollout |
| --- | --- | --- | --- |
| ``llama:tiny`` (reference) | the task vocabulary (16), ``MODEL_MAX_SEQ_LEN`` | ``init_weights(seed)`` | KV-cached replica |
| ``package.module:factory``, ``file.py:factory`` | the factory's module, fp32, on the rank's device | the factory's own init under ``torch.manual_seed(seed)``, checked equal on every rank (``check_same_weights``); a module the factory leaves on meta: ``Initialize(seed)`` (its ``init_rule`` or each module's ``reset_parameters``, on shards) | recompute |
| HF config dir / ``config.json`` | ``models.hf.actor_critic`` on meta | ``Initialize(seed)`` (HF's rules, on shards); with ``weights=DIR``: ``Layered(Safetensors(DIR, name_map=hf_name_map), Initialize(seed))`` (the value head, absent from HF files, initialised) | recompute |

A factory must return an actor-critic: ``forward(tokens [B, S]) -> (logits [B, S, V],
values [B, S])``. Rollout recomputes the prefix through the program (as
``rollout_cache=False``) for any model without the reference models' cache API
(``new_cache(batch, max_len)``, ``forward(tokens, cache=, start_pos=)``, rebuilt as
``type(model)(model.config)``); ``rollout_cache_unsupported`` gives the reason,
which rank 0 prints.

Vocabulary: the tasks speak ``len(VOCAB)`` = 16 tokens (``runtime/tasks``), and
task token k IS the model's id k (no tokenizer mapping: a loaded HF model's id 5
is whatever its tokenizer calls it). A model with V ≥ 16 is used as is and its
logits are restricted to the first 16 ids: ``ProgramEngine.forward`` returns
``logits[..., :16]``, so the policy is π(y | s) = softmax(z_0..15 / τ), a
distribution over the task's tokens. Sampling, old and reference log-probs,
entropy and the ratio all use that one restricted softmax, so the objective of
``runtime/ppo.py`` holds as written with V = 16; ids ≥ 16 are never drawn and get
no gradient through the logits. (Leaving the other ids in would make them
zero-reward actions: a random 32k-vocabulary model would draw a task token about
once in 2,000 draws and learn nothing.) V < 16 is refused (``TaskError`` naming
both sizes).

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autoshard.errors import ModelError
from autoshard.models import build
from autoshard.models.hf import actor_critic, load_hf_config
from autoshard.models.source import build_from_factory, is_factory_spec, is_hf_config_spec
from autoshard.passes.capture import capture
from autoshard.runtime.hf_export import hf_name_map
from autoshard.runtime.materialize import Initialize, Layered, Safetensors
from autoshard.runtime.tasks import VOCAB, check_vocab

MODEL_MAX_SEQ_LEN = 32  # the reference run's context (ppo_demo); prompts + responses of every task fit


@dataclass(frozen=True)
class PolicyModel:
    """The model a PPO run trains, as ``load_policy`` built it on this rank (module docstring)."""

    module: torch.nn.Module
    """The actor-critic; holds data (reference, factory) or lives on meta (HF config)."""
    name: str
    """What plans record (``capture_policy``): the spec, with file paths made absolute."""
    weights: Any = None
    """``build_program``'s weights source; None: the module's own values."""
    user: bool = False
    """Not a reference model: its initial weights came from user code (``check_same_weights``)."""


def load_policy(spec: str, seed: int, device: str | torch.device = "cpu", *, weights: str | None = None, context: int | None = None,
                vocab_size: int | None = None, on_shards: bool = False) -> PolicyModel:
    """The model ``spec`` names (module docstring), initialised from ``seed`` on ``device``
    (``"meta"``: for capture only). ``weights``: an HF safetensors directory, HF config specs only.
    ``vocab_size``: a reference model's vocabulary (default the tasks' 16; a prompt set's tokenizer
    may need more, ``runtime/rl_data.py``); other models keep their own. ``context``: a reference model's
    positions (default ``MODEL_MAX_SEQ_LEN``); other models keep their own. ``on_shards``: a reference model
    is built on ``meta`` and its shards initialised by the program's build (``Initialize(seed)``: the same
    values as ``init_weights(seed)``), so no rank ever holds the whole model (sharded PPO runs)."""
    from pathlib import Path

    spec = spec.strip()
    if is_hf_config_spec(spec):
        return _load_hf_policy(str(Path(spec).expanduser().resolve()), seed, weights)
    if weights is not None:
        raise ModelError(f"weights {weights!r}: only a Hugging Face config MODEL (a directory or config.json) reads "
                         f"safetensors; {spec!r} builds its own weights (a factory may load them itself)")
    if not is_factory_spec(spec):
        if on_shards:
            module = build_policy_model(spec, seed, "meta", vocab_size=vocab_size, context=context)
            return PolicyModel(module, spec, Initialize(seed))
        return PolicyModel(build_policy_model(spec, seed, device, vocab_size=vocab_size, context=context), spec)
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        spec = f"{Path(target).expanduser().resolve()}:{attr}"  # the same name from every working directory
    torch.manual_seed(seed)  # the factory's own init, the same on every rank (check_same_weights)
    module = build_from_factory(spec, device=device, dtype=torch.float32)
    if torch.device(device).type != "meta" and any(p.is_meta for p in module.parameters()):
        return PolicyModel(module, spec, Initialize(seed), user=True)  # a module left on meta: init on shards
    return PolicyModel(module, spec, user=True)


def _load_hf_policy(path: str, seed: int, weights: str | None) -> PolicyModel:
    """An HF actor-critic on meta; its shards initialised by HF's rules or read from ``weights``."""
    from pathlib import Path

    config = load_hf_config(path)
    module = actor_critic(config, device="meta", dtype=torch.float32)
    source: Any = Initialize(seed)
    if weights is not None:
        if not Path(weights).expanduser().exists():
            raise ModelError(f"weights {weights!r}: no such file or directory; give a Hugging Face model directory "
                             "with *.safetensors (save_pretrained writes them)")
        source = Layered(Safetensors(Path(weights).expanduser(), name_map=hf_name_map(config)), Initialize(seed))
    return PolicyModel(module, path, source, user=True)


def load_reference(spec: str, policy: torch.nn.Module, seed: int, device: str | torch.device = "cpu", *,
                   vocab_size: int | None = None) -> PolicyModel:
    """A separate frozen reference: the model ``spec`` names (an HF model directory brings its safetensors),
    refused (``ModelError``) unless its parameters have the policy's names and shapes: it runs under the
    policy's plan and graph."""
    from pathlib import Path

    weights = None
    if is_hf_config_spec(spec) and Path(spec).expanduser().is_dir() and any(Path(spec).expanduser().glob("*.safetensors")):
        weights = spec
    reference = load_policy(spec, seed, device, weights=weights, vocab_size=vocab_size, context=policy_context(policy))
    mine = {name: tuple(p.shape) for name, p in policy.named_parameters()}
    theirs = {name: tuple(p.shape) for name, p in reference.module.named_parameters()}
    if mine != theirs:
        differ = next((n for n in mine if theirs.get(n) != mine[n]), None) or next(n for n in theirs if n not in mine)
        raise ModelError(f"reference {spec!r} does not match the policy: parameter {differ!r} is "
                         f"{mine.get(differ, 'absent')} in the policy and {theirs.get(differ, 'absent')} in the reference; "
                         "a separate reference needs the policy's architecture (or drop --reference)")
    if reference.user and reference.weights is None:
        check_same_weights(reference.module, reference.name, device)
    return reference


def build_policy_model(spec: str, seed: int, device: str | torch.device = "cpu", *,
                       vocab_size: int | None = None, context: int | None = None) -> torch.nn.Module:
    """The reference model ``spec`` with ``vocab_size`` (default the task vocabulary) and ``context`` positions
    (default ``MODEL_MAX_SEQ_LEN``), initialised from ``seed`` (any MODEL: ``load_policy``)."""
    vocab_size = len(VOCAB) if vocab_size is None else vocab_size
    return build(spec, seed=seed, device=device, vocab_size=vocab_size, max_seq_len=context or MODEL_MAX_SEQ_LEN)


def policy_vocab(model: torch.nn.Module) -> int | None:
    """The model's vocabulary: ``config.vocab_size``, else its first ``nn.Embedding``'s rows; None when neither."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


def check_policy_vocab(model: torch.nn.Module, name: str, task: Any) -> None:
    """``TaskError`` (both sizes named) when ``model``'s vocabulary is smaller than ``task``'s (module note)."""
    size = policy_vocab(model)
    if size is not None:  # unknown: ProgramEngine checks the logits' width at the first forward
        check_vocab(task, size, what=f"model {name!r}")


def policy_context(model: torch.nn.Module) -> int:
    """Longest sequence ``model`` takes, from its config; ``MODEL_MAX_SEQ_LEN`` (what the tasks need) when it has none."""
    config = getattr(model, "config", None)
    for field in ("max_seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(config, field, None)
        if isinstance(value, int):
            return value
    return MODEL_MAX_SEQ_LEN


def rollout_cache_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``RolloutEngine`` cannot serve ``model`` (it needs the reference models' cache API), or None."""
    import inspect

    try:
        forward_args = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        forward_args = {}
    missing = [what for what, ok in (
        ("new_cache(batch, max_len)", callable(getattr(model, "new_cache", None))),
        ("forward(tokens, cache=, start_pos=)", "cache" in forward_args and "start_pos" in forward_args),
        ("config", hasattr(model, "config")),
        ("tie_weights()", callable(getattr(model, "tie_weights", None))),
    ) if not ok]
    if not missing:
        return None
    return f"{type(model).__name__} has no {', no '.join(missing)} (the reference models' KV-cache API)"


def check_same_weights(model: torch.nn.Module, name: str, device: str | torch.device = "cpu") -> None:
    """Refuse (``ModelError``) a model whose values differ between ranks (collective over the world).

    Compares Σ p and Σ p² over all parameters (float64) by MAX all-reduces of ±them; a factory
    that seeds from anything but ``torch.manual_seed`` would otherwise train each rank's shards of
    a different model."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or any(p.is_meta for p in model.parameters()):
        return
    with torch.no_grad():
        params = [p.detach().double() for p in model.parameters()]
        sums = torch.stack([sum(p.sum() for p in params), sum((p * p).sum() for p in params)]).cpu()
    bounds = torch.cat([sums, -sums]).to(device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if not torch.equal(bounds[:2].cpu(), -bounds[2:].cpu()):
        raise ModelError(f"model {name!r} built different initial weights on different ranks; its factory must "
                         "draw them from torch's global RNG (seeded with --seed) or load them")


def capture_policy(model: torch.nn.Module, spec: str) -> Any:
    """The ``ModelGraph`` plans for ``model`` are searched against (short sequences: the model is small)."""
    return capture(model, name=spec, seq_lens=(8, 16))


__all__ = [
    "MODEL_MAX_SEQ_LEN",
    "PolicyModel",
    "build_policy_model",
    "capture_policy",
    "check_policy_vocab",
    "check_same_weights",
    "load_policy",
    "load_reference",
    "policy_context",
    "policy_vocab",
    "rollout_cache_unsupported",
]
