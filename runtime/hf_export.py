"""Export to Hugging Face: an autoshard checkpoint (or a live program) → a ``from_pretrained`` directory.

``export_checkpoint(CKPT, DIR)`` reads a checkpoint saved under any plan and
world size (``runtime/checkpoint.py``) and writes what ``save_pretrained``
writes for the matching ``*ForCausalLM`` class::

    DIR/config.json                          the model's HF config (dtype and architectures set)
    DIR/model.safetensors                    every tensor, when they fit one shard, else
    DIR/model-0000k-of-0000n.safetensors     shards of at most ``max_shard_size`` bytes (a bigger
    DIR/model.safetensors.index.json         tensor gets a file of its own) and HF's index

so ``LlamaForCausalLM.from_pretrained(DIR)`` (or ``AutoModelForCausalLM``)
loads it, and ``Safetensors(DIR)`` reads it back into any plan. The CLI is
``autoshard export CKPT -o DIR``.

Names
    The HF actor-critic policies (``autoshard/models/hf.py``) name the trunk
    ``model.<trunk names>``; the HF causal LM names it ``<base_model_prefix>.``
    (``model.`` for Llama, Qwen2, Gemma, Mixtral, Phi; ``transformer.`` for
    GPT-2). ``lm_head.weight`` keeps its name. ``hf_name_map(config)`` is that
    map, for ``Safetensors(dir, name_map=...)`` when reading HF files. The
    names and global shapes are checked against the HF model of the config,
    built on meta, before any tensor is read: a checkpoint of another model
    (or a reference model ``llama:tiny``, whose names are autoshard's) is
    refused with the first mismatches. Tied weights: the HF model's own ties
    decide; a tied tensor is written once, under the name ``save_pretrained``
    keeps (the input embedding), as the policies also hold it once.

The value head
    Not part of a causal LM: dropped by default (the result lists it).
    ``value_head=FILE`` writes the critic's tensors (``value_head.*``, policy
    names, as saved: fp32) to a separate safetensors file outside ``DIR``, so
    ``Layered(Safetensors(DIR, name_map=hf_name_map(config)), Safetensors(FILE))``
    rebuilds the whole actor-critic.

Where config.json comes from (first that exists)
    1. ``config=``: an HF model directory or ``config.json`` (CLI ``--config``),
       or a ``transformers`` config object;
    2. the checkpoint's ``extras["hf_config"]``: record it when saving with
       ``extras=hf_config_extras(config)`` (``export_program`` does);
    3. the plan's ``model_name`` when it is an HF directory or JSON file that
       still exists (the CLI records the ``MODEL`` path it planned).

dtype
    ``dtype=`` (``float32``, ``bfloat16``, ``float16``), else the config's own
    ``dtype`` (as ``save_pretrained`` writes a model in the dtype it has), else
    float32, the checkpoint's fp32 masters: the only lossless choice, and a
    bit-exact round trip. The chosen dtype and why are in the result.

Memory and atomicity
    One tensor at a time is read (DCP, only its saved chunks) and cast; one
    output shard is held until written. Files go to a sibling temporary
    directory renamed to ``DIR`` at the end; ``DIR`` may exist only if empty.

Live programs
    ``export_program`` (collective) saves the program's fp32 masters as a
    temporary checkpoint beside ``DIR`` (``checkpoint.save``: every rank writes
    its shards, no rank gathers a whole model), then rank 0 exports it and
    removes it. Needs a file system every rank sees, as checkpoints do.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.cluster_io import parse_quantity
from autoshard.errors import AutoshardError
from autoshard.models.hf import load_hf_config
from autoshard.models.source import is_hf_config_spec
from autoshard.runtime._checkpoint_files import (
    CheckpointInfo,
    SafeFileSystemReader,
    WeightsOnlyLoadPlanner,
    dtype_from_name,
    read_info,
    read_metadata_safely,
    resolve_checkpoint,
)
from autoshard.runtime._safetensors_source import INDEX_NAME, SUFFIX, _plan_shards
from autoshard.runtime.checkpoint import MODEL_PREFIX, _broadcast_from_first, _world, program_state, save

CONFIG_EXTRA = "hf_config"  # checkpoint extras key holding the HF config dict
DEFAULT_MAX_SHARD_SIZE = "5GB"  # HF units: KB/MB/GB = 10^3.., KiB/MiB/GiB = 2^10..
CRITIC_PREFIX = "value_head."
POLICY_TRUNK = "model."  # the HF policies' trunk attribute (autoshard/models/hf.py)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MAX_LISTED = 5
# autoshard's training choices on the policy's config (models/hf.py TRAINING_FIELDS), not the model's
_TRAINING_KEYS = ("use_cache", "attn_implementation", "_attn_implementation")


class ExportError(AutoshardError):
    """A checkpoint cannot be exported to a Hugging Face directory: no config, names that do not match, bad options."""


@dataclass(frozen=True)
class ExportResult:
    """What ``export_checkpoint`` wrote and why (``dtype_reason``, ``config_source``)."""

    directory: Path
    files: tuple[str, ...]  # safetensors file names in ``directory``
    total_bytes: int
    dtype: torch.dtype
    dtype_reason: str
    config_source: str
    hf_class: str  # e.g. "LlamaForCausalLM"
    step: int
    dropped: tuple[str, ...]  # policy names not written to ``directory`` (the value head)
    value_head: Path | None = None  # where the dropped tensors went, when asked


# --------------------------------------------------------------------------- names


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ExportError("exporting to a Hugging Face directory needs the 'transformers' package: "
                          "pip install transformers") from None
    return transformers


def causal_lm_class(config: Any) -> type:
    """The ``transformers`` causal-LM class of ``config`` (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ExportError(f"model_type {getattr(config, 'model_type', None)!r} has no causal-LM class in "
                          "transformers; export writes *ForCausalLM directories only") from None


def hf_name_map(config: Any) -> Callable[[str], str]:
    """Policy parameter FQN → key in the HF causal LM's files (module docstring "Names").

    ``Safetensors(dir, name_map=hf_name_map(config))`` reads an HF directory
    into the policy for every family (GPT-2's trunk is ``transformer.``).
    """
    prefix = causal_lm_class(config).base_model_prefix + "."

    def hf_key(fqn: str) -> str:
        return prefix + fqn.removeprefix(POLICY_TRUNK) if fqn.startswith(POLICY_TRUNK) else fqn

    return hf_key


def hf_parameters(config: Any) -> dict[str, tuple[int, ...]]:
    """HF key → global shape of every tensor ``save_pretrained`` writes for ``config``, in its order.

    From the causal LM built on meta: parameters, each tied one once (its first
    name), and persistent buffers.
    """
    return _hf_tensors(config)[0]


def _hf_tensors(config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(``hf_parameters``, the second names of tied parameters, e.g. ``lm_head.weight``)."""
    with torch.device("meta"):
        model = causal_lm_class(config)(copy.deepcopy(config))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, value in model.state_dict().items():  # persistent buffers (none in the supported families)
        if name not in every_name:
            shapes[name] = tuple(value.shape)
    return shapes, every_name - set(shapes)


def _match(saved: Mapping[str, tuple[int, ...]], config: Any, what: str) -> tuple[dict[str, str], list[str]]:
    """(HF key → policy FQN for every HF tensor, policy FQNs of the critic); ``ExportError`` listing mismatches."""
    expected, tied = _hf_tensors(config)
    hf_key = hf_name_map(config)
    critic = [fqn for fqn in saved if fqn.startswith(CRITIC_PREFIX)]
    by_key = {hf_key(fqn): fqn for fqn in saved if not fqn.startswith(CRITIC_PREFIX)}
    problems = [f"{key!r} is {list(saved[by_key[key]])} in the checkpoint, {list(shape)} in the model"
                for key, shape in expected.items() if key in by_key and tuple(saved[by_key[key]]) != shape]
    problems += [f"{fqn!r} (as {key!r}) is " + ("tied to another parameter in this config" if key in tied else
                                                 "not in the model")
                 for key, fqn in by_key.items() if key not in expected]
    problems += [f"{key!r} missing from the checkpoint" for key in expected if key not in by_key]
    if problems:
        count = f"{len(problems)} mismatch{'es' if len(problems) > 1 else ''}"
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise ExportError(
            f"{what} does not match a {causal_lm_class(config).__name__} of this config: {count}, first: "
            f"{'; '.join(problems[:MAX_LISTED])}{more}; pass the config of the model that was trained "
            "(--config HF_DIR_OR_JSON); reference models (llama:tiny, ...) have no HF class: "
            "use checkpoint.export_safetensors"
        )
    return {key: by_key[key] for key in expected}, critic


# --------------------------------------------------------------------------- config


def hf_config_extras(config: Any) -> dict[str, Any]:
    """``{"hf_config": {...}}`` for ``CheckpointState.extras``, so ``export_checkpoint`` needs no ``config=``.

    autoshard's training switches on the policy's config (no KV cache, SDPA) are left out.
    """
    data = json.loads(config.to_json_string(use_diff=False))
    return {CONFIG_EXTRA: {k: v for k, v in data.items() if k not in _TRAINING_KEYS}}


def _config_from_dict(data: Mapping[str, Any], source: str) -> Any:
    transformers = _transformers()
    data = dict(data)
    model_type = data.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ExportError(f"{source}: model_type {model_type!r} is not a transformers model type")
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as err:  # noqa: BLE001 - transformers' own reasons, in one line
        raise ExportError(f"{source}: transformers cannot read this config: {type(err).__name__}: {err}") from None


def resolve_config(config: Any, info: CheckpointInfo | None = None) -> tuple[Any, str]:
    """(HF config, where it came from): ``config`` itself, else what checkpoint ``info`` records
    (module docstring "Where config.json comes from")."""
    _transformers()
    if isinstance(config, (str, os.PathLike)):
        return load_hf_config(config), str(config)
    if config is not None:
        return config, f"the {type(config).__name__} given"
    if info is None:
        raise ExportError("no Hugging Face config given; pass an HF directory, config.json or config object")
    if CONFIG_EXTRA in info.extras:
        return _config_from_dict(info.extras[CONFIG_EXTRA], "checkpoint extras 'hf_config'"), "checkpoint extras"
    model_name = str((info.plan or {}).get("model_name") or "")
    if model_name and is_hf_config_spec(model_name):
        return load_hf_config(model_name), f"the plan's model {model_name}"
    raise ExportError(
        f"the checkpoint records no Hugging Face config (no extras {CONFIG_EXTRA!r}; plan model "
        f"{model_name or 'none'!r} is not an HF directory or config.json); pass --config HF_DIR_OR_CONFIG_JSON"
    )


def _written_config(config: Any, dtype: torch.dtype) -> Any:
    """A copy of ``config`` as ``save_pretrained`` of the causal LM in ``dtype`` writes it."""
    config = copy.deepcopy(config)
    config.architectures = [causal_lm_class(config).__name__]
    config.dtype = dtype
    return config


# --------------------------------------------------------------------------- options


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` → ``torch.bfloat16`` (float32, bfloat16, float16)."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    name = DTYPE_ALIASES.get(str(value), str(value).removeprefix("torch."))
    if name not in DTYPES:
        raise ExportError(f"dtype {value!r}: allowed {', '.join([*DTYPES, *DTYPE_ALIASES])}")
    return DTYPES[name]


def parse_size(value: int | str) -> int:
    """``"5GB"`` → 5·10⁹ bytes, ``"2GiB"`` → 2·2³⁰, an int as bytes; must be > 0."""
    try:
        size = int(parse_quantity(value, "bytes", "max_shard_size"))
    except AutoshardError as err:
        raise ExportError(str(err)) from None
    if size <= 0:
        raise ExportError(f"max_shard_size={value!r} must be more than 0 bytes; give e.g. 5GB")
    return size


def _choose_dtype(dtype: Any, config: Any) -> tuple[torch.dtype, str]:
    if dtype is not None:
        return parse_dtype(dtype), "asked for"
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if own is not None and str(own).removeprefix("torch.") in DTYPES:
        return parse_dtype(own), "the config's dtype"
    return torch.float32, "the checkpoint's fp32 masters (the config names no dtype)"


# --------------------------------------------------------------------------- writing


def _output_dir(directory: Path) -> Path:
    """The sibling temporary directory to write into; refuses a ``directory`` that holds anything."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ExportError(f"{str(directory)!r} exists and is not an empty directory; pick a new output "
                          "directory or remove it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    return directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex[:12]}")


class _CheckpointTensors:
    """Reads one full model tensor at a time from a committed checkpoint (no process group)."""

    def __init__(self, directory: Path, info: CheckpointInfo) -> None:
        self.directory, self.info = directory, info
        self.metadata = read_metadata_safely(directory)

    def read(self, fqn: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        record = self.info.tensors[MODEL_PREFIX + fqn]
        out = torch.empty(record.shape, dtype=dtype_from_name(record.dtype))
        with warnings.catch_warnings():  # no_dist is meant: one process reads every rank's chunks
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({MODEL_PREFIX + fqn: out}, storage_reader=SafeFileSystemReader(self.directory, self.metadata),
                     planner=WeightsOnlyLoadPlanner(), no_dist=True)
        return out


def _write_shards(tmp: Path, names: dict[str, str], read: Callable[[str], torch.Tensor], shapes: Mapping[str, tuple],
                  dtype: torch.dtype, max_bytes: int, metadata: dict[str, str]) -> tuple[list[str], int]:
    """Write ``names`` (HF key → policy FQN) as HF does: one file, or shards and an index. (file names, bytes)."""
    from safetensors.torch import save_file

    keys = list(names)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [torch.Size(shapes[names[k]]).numel() * itemsize for k in keys]
    shards = _plan_shards(sizes, max_bytes)
    files, weight_map = [], {}
    for k, members in enumerate(shards, start=1):
        file_name = f"model{SUFFIX}" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}{SUFFIX}"
        tensors = {keys[i]: read(names[keys[i]]).to(dtype).contiguous() for i in members}
        save_file(tensors, str(tmp / file_name), metadata=metadata)
        del tensors
        files.append(file_name)
        weight_map.update({keys[i]: file_name for i in members})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files, sum(sizes)


def _check_value_head_path(value_head: Path | None, directory: Path) -> None:
    if value_head is not None and directory.absolute() in value_head.absolute().parents:
        raise ExportError(f"value head file {str(value_head)!r} is inside the output directory, where a second "
                          "unindexed safetensors file breaks reading it back; write it beside the directory")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    config: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    value_head: str | os.PathLike | None = None,
) -> ExportResult:
    """Write the autoshard checkpoint at ``checkpoint`` as a Hugging Face directory ``directory`` (module docstring).

    No process group. ``config``: an HF directory, ``config.json`` or config
    object (default: recorded in the checkpoint). ``dtype``: of the written
    tensors (default: the config's, else float32). ``max_shard_size``: bytes or
    ``"5GB"``-style. ``value_head``: a safetensors file for the critic tensors
    (default: dropped). Raises ``CheckpointError`` for a missing or uncommitted
    checkpoint, ``ExportError`` / ``ModelError`` for a bad config or names that
    do not match it, before anything is written.
    """
    source = resolve_checkpoint(checkpoint)
    info = read_info(source)
    hf_config, config_source = resolve_config(config, info)
    saved = {key.removeprefix(MODEL_PREFIX): tuple(record.shape)
             for key, record in info.tensors.items() if key.startswith(MODEL_PREFIX)}
    names, critic = _match(saved, hf_config, f"checkpoint {str(source)!r}")
    out_dtype, reason = _choose_dtype(dtype, hf_config)
    max_bytes = parse_size(max_shard_size)
    directory = Path(directory)
    value_head = Path(value_head) if value_head is not None else None
    _check_value_head_path(value_head, directory)
    tmp = _output_dir(directory)
    tensors = _CheckpointTensors(source, info)
    metadata = {"format": "pt", "autoshard.model_fingerprint": info.model_fingerprint, "autoshard.step": str(info.step)}
    try:
        tmp.mkdir()
        files, total = _write_shards(tmp, names, tensors.read, saved, out_dtype, max_bytes, metadata)
        _written_config(hf_config, out_dtype).save_pretrained(str(tmp))
        if value_head is not None and critic:
            _write_file(value_head, {fqn: tensors.read(fqn) for fqn in critic}, metadata)
        if directory.exists():
            directory.rmdir()  # empty (checked): the rename below needs the name free
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(directory=directory, files=tuple(files), total_bytes=total, dtype=out_dtype,
                        dtype_reason=reason, config_source=config_source,
                        hf_class=causal_lm_class(hf_config).__name__, step=info.step,
                        dropped=tuple(critic), value_head=value_head if critic else None)


def _write_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """One safetensors file, replaced atomically."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- live programs


def export_program(
    program: Any,
    directory: str | os.PathLike,
    config: Any,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    value_head: str | os.PathLike | None = None,
    step: int = 0,
    process_group: Any = None,
) -> ExportResult:
    """Write a runtime ``Program``'s weights as a Hugging Face directory (collective: every rank calls it).

    ``config``: the HF config (object, directory or ``config.json``). Names are
    checked on every rank before any collective; then the program is saved as
    a temporary checkpoint beside ``directory`` and rank 0 runs
    ``export_checkpoint`` on it (module docstring "Live programs"). Every rank
    returns the result, or raises rank 0's error.
    """
    hf_config, _ = resolve_config(config)
    saved = {fqn: tuple(p.global_shape) for fqn, p in program.param_placements.items()}
    _match(saved, hf_config, "the program")  # refuse on every rank, before any collective
    rank, _, distributed = _world(process_group)
    directory = Path(directory).absolute()
    token = uuid.uuid4().hex[:12]
    if distributed:
        token = _broadcast_from_first(token, process_group)
    staging = directory.with_name(f".{directory.name}.checkpoint-{token}")
    save(staging, program_state(program, step=step, extras=hf_config_extras(hf_config)), process_group=process_group)
    outcome: ExportResult | str | None = None
    if rank == 0:
        try:
            outcome = export_checkpoint(staging, directory, config=hf_config, dtype=dtype,
                                        max_shard_size=max_shard_size, value_head=value_head)
        except (AutoshardError, OSError) as err:
            outcome = f"{type(err).__name__}: {err}"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if distributed:
        outcome = _broadcast_from_first(outcome, process_group)
    if isinstance(outcome, str):
        raise ExportError(f"exporting the program to {str(directory)!r} failed on rank 0: {outcome}")
    return outcome


__all__ = [
    "CONFIG_EXTRA",
    "DEFAULT_MAX_SHARD_SIZE",
    "ExportError",
    "ExportResult",
    "causal_lm_class",
    "export_checkpoint",
    "export_program",
    "hf_config_extras",
    "hf_name_map",
    "hf_parameters",
    "parse_dtype",
    "parse_size",
    "resolve_config",
]
