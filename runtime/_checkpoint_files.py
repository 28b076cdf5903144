"""Files of a checkpoint: the JSON sidecar, the weights-only DCP reader, atomic commit.

Kept apart from ``runtime/checkpoint.py`` (state, save, load) because none of it
runs a collective: everything here is local file work that every rank may do
on its own, which is what lets ``load`` refuse a bad checkpoint before any
collective starts.

Directory layout of one committed checkpoint ``PATH/``::

    PATH/.metadata          DCP metadata (pickle; read only through ``SafeFileSystemReader``)
    PATH/__<r>_0.distcp     DCP data, one file per rank (``torch.save`` tensor records)
    PATH/autoshard.json     sidecar, JSON: format, version, model fingerprint, plan, mesh,
                            step, extras, saved world size, every tensor's global shape/dtype

[Note: atomic commit]
Ranks write into ``PATH.tmp-<uuid>/`` (one uuid chosen by rank 0 and broadcast).
After DCP's own finish step (which only runs once every rank's writes
returned) rank 0 writes the sidecar, fsyncs it, and commits with renames:
``PATH`` (if it exists) → ``PATH.old-<uuid>``, then ``PATH.tmp-<uuid>`` →
``PATH``, then removes ``PATH.old-<uuid>``. So at every instant either ``PATH``
or ``PATH.old-<uuid>`` is a complete checkpoint: a save killed before the
first rename leaves the previous ``PATH`` untouched; one killed between the two
renames leaves ``PATH`` missing and ``PATH.old-<uuid>`` complete, which
``resolve_checkpoint`` picks up. A directory is committed iff it holds the
sidecar (written last, inside the temporary directory). Stale ``PATH.tmp-*``
and ``PATH.old-*`` siblings are removed by the next successful save of
``PATH``; one writer per ``PATH`` at a time is assumed. The directory must be
on a file system every rank sees (as DCP's ``FileSystemWriter`` requires).

[Note: what is unpickled on load]
DCP's ``FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``
(arbitrary code on a crafted file), reads tensor records with
``torch.load(weights_only=True)``, and its ``DefaultLoadPlanner`` reads
non-tensor ("bytes") entries with ``torch.load(weights_only=False)``.
autoshard therefore (1) never saves bytes entries (step, extras and the plan
go to the JSON sidecar; RNG states are uint8 tensors), (2) reads ``.metadata``
with ``_MetadataUnpickler``, which constructs only DCP's metadata dataclasses,
``torch.Size``, dtypes, layouts and paths and refuses any other global, and
(3) loads with ``WeightsOnlyLoadPlanner``, which refuses bytes entries. The
sidecar is JSON. Nothing read from a checkpoint is executed.

[Note: tensors held as several blocks]
DCP describes a rank's piece of a tensor as chunks (global offsets, sizes); a
DTensor gives it exactly one. A fused projection split over tp is several
blocks of the global tensor on each rank (``checkpoint.shard_blocks``), so
``BlockSavePlanner`` writes, and ``WeightsOnlyLoadPlanner`` reads, one chunk
per block (``Blocks``: global offsets → a view of the local tensor). The
files record them as any other chunks: the format does not depend on it.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import Placement, Shard

try:  # private, present in torch 2.11-2.13: the tp placement of a fused projection (``passes/context.py``)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - depends on the installed torch
    _StridedShard = None

from autoshard.errors import AutoshardError
from autoshard.file_io import MAX_WORLD_SIZE, MiB, FileKind, parse_json_strict, read_bounded_text

SIDECAR = "autoshard.json"
CHECKPOINT_FORMAT = "autoshard.checkpoint"
CHECKPOINT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


class CheckpointError(AutoshardError):
    """A checkpoint is missing, incomplete, foreign, or does not fit the state it is loaded into."""


# The sidecar is read by autoshard/file_io.py's strict rules: a regular file of at most 64 MiB (one
# record of ~100 B per saved tensor, plus the plan), UTF-8, nesting <= 64, no duplicate keys.
SIDECAR_FILE = FileKind(
    "checkpoint sidecar", 64 * MiB, CheckpointError,
    "the checkpoint is damaged or was not written by autoshard.runtime.checkpoint.save",
)


# --------------------------------------------------------------------------- sidecar


@dataclass(frozen=True)
class TensorRecord:
    """Global shape and dtype of one saved tensor, as the sidecar lists it."""

    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class CheckpointInfo:
    """The JSON sidecar of a committed checkpoint (everything but the tensor data).

    ``plan`` is the plan's JSON dict (``Plan.to_dict``) or ``None``; ``mesh`` maps
    mesh axis name to size of the DeviceMesh the tensors were saved from.
    """

    model_fingerprint: str
    step: int
    world_size: int
    tensors: dict[str, TensorRecord]
    extras: dict[str, Any] = field(default_factory=dict)
    mesh: dict[str, int] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    torch_version: str = ""
    created_unix: float = 0.0
    version: int = CHECKPOINT_VERSION

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, no NaN)."""
        data = {
            "format": CHECKPOINT_FORMAT,
            "version": self.version,
            "model_fingerprint": self.model_fingerprint,
            "step": self.step,
            "world_size": self.world_size,
            "tensors": {k: v.to_dict() for k, v in sorted(self.tensors.items())},
            "extras": self.extras,
            "mesh": self.mesh,
            "plan": self.plan,
            "torch_version": self.torch_version,
            "created_unix": self.created_unix,
        }
        return json.dumps(data, sort_keys=True, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> CheckpointInfo:
        """Parse a sidecar; a malformed one raises ``CheckpointError`` naming ``source``.

        Counts are checked, not coerced: ``step`` an integer >= 0, ``world_size`` and mesh sizes
        integers in ``[1, MAX_WORLD_SIZE]``, shapes integers >= 0."""
        data = parse_json_strict(text, source=source, kind=SIDECAR_FILE)
        try:
            if not isinstance(data, dict):
                raise TypeError(f"expected a JSON object, got {type(data).__name__}")
            if data.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
            if data.get("version") not in SUPPORTED_VERSIONS:
                raise ValueError(f"version {data.get('version')!r} not in {SUPPORTED_VERSIONS}")
            tensors = {k: TensorRecord(tuple(_count(d, f"tensors[{k!r}].shape", 0) for d in v["shape"]),
                                       str(v["dtype"]))
                       for k, v in data["tensors"].items()}
            return cls(
                model_fingerprint=str(data["model_fingerprint"]),
                step=_count(data["step"], "step", 0),
                world_size=_count(data["world_size"], "world_size", 1, MAX_WORLD_SIZE),
                tensors=tensors,
                extras=dict(data.get("extras") or {}),
                mesh={str(k): _count(v, f"mesh[{k!r}]", 1, MAX_WORLD_SIZE)
                      for k, v in (data.get("mesh") or {}).items()},
                plan=data.get("plan"),
                torch_version=str(data.get("torch_version", "")),
                created_unix=float(data.get("created_unix", 0.0)),
                version=int(data["version"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(
                f"{source}: not a valid autoshard checkpoint sidecar ({type(err).__name__}: {err}); "
                "the checkpoint is damaged or was not written by autoshard.runtime.checkpoint.save"
            ) from None


_INT64_MAX = 2**63 - 1


def _count(value: Any, where: str, minimum: int, maximum: int = _INT64_MAX) -> int:
    """A JSON integer in ``[minimum, maximum]`` (a bool or float is not one); else ``ValueError``."""
    if type(value) is not int or not minimum <= value <= maximum:
        raise ValueError(f"{where}={value!r}: expected an integer in [{minimum}, {maximum}]")
    return value


def write_sidecar(directory: Path, info: CheckpointInfo) -> None:
    """Write ``directory/autoshard.json`` durably (written last: it marks the directory committed)."""
    target = directory / SIDECAR
    with open(target, "w", encoding="utf-8") as f:
        f.write(info.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """The sidecar of the committed checkpoint at ``path`` (see ``resolve_checkpoint``)."""
    directory = resolve_checkpoint(path)
    sidecar = directory / SIDECAR
    return CheckpointInfo.from_json(read_bounded_text(sidecar, SIDECAR_FILE), source=str(sidecar))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; an unknown name raises ``CheckpointError``."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint sidecar; it was written by another torch")
    return value


# --------------------------------------------------------------------------- directories


def _committed(directory: Path) -> bool:
    return (directory / SIDECAR).is_file()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory for ``path``.

    ``path`` itself when it holds a sidecar; else, when ``path`` is missing, the
    newest committed ``path.old-*`` sibling (a save killed between its two
    renames, module note "atomic commit"); else ``CheckpointError``.
    """
    path = Path(path)
    if _committed(path):
        return path
    if not path.exists():
        survivors = [p for p in _siblings(path, OLD_MARK) if _committed(p)]
        if survivors:
            return max(survivors, key=lambda p: p.stat().st_mtime)
        partial = [p.name for p in _siblings(path, TMP_MARK)]
        hint = f"; incomplete saves found: {partial} (a save was interrupted)" if partial else ""
        raise CheckpointError(f"no checkpoint at {str(path)!r}{hint}; pass a directory written by checkpoint.save")
    raise CheckpointError(
        f"{str(path)!r} is not a committed autoshard checkpoint (no {SIDECAR}); "
        "pass a directory written by checkpoint.save, not a DCP directory from elsewhere or a partial save"
    )


def _siblings(path: Path, mark: str) -> list[Path]:
    parent = path.parent
    if not parent.is_dir():
        return []
    prefix = path.name + mark
    return [p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir()]


def check_replaceable(path: Path) -> None:
    """Refuse to save over something at ``path`` that is not a committed checkpoint."""
    if path.exists() and not _committed(path):
        raise CheckpointError(
            f"{str(path)!r} exists and is not an autoshard checkpoint; save refuses to replace it: "
            "pick a new path or remove it"
        )


def temporary_dir(path: Path, token: str) -> Path:
    """The temporary directory every rank writes into before the commit."""
    return path.with_name(f"{path.name}{TMP_MARK}{token}")


def commit(tmp: Path, path: Path, token: str) -> None:
    """Rank 0: make ``tmp`` visible as ``path`` (module note "atomic commit"), then sweep stale siblings."""
    old = path.with_name(f"{path.name}{OLD_MARK}{token}")
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    for stale in _siblings(path, OLD_MARK) + _siblings(path, TMP_MARK):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def now_unix() -> float:
    return round(time.time(), 3)


# --------------------------------------------------------------------------- weights-only reading

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset(
    {(_METADATA_MODULE, name) for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )}
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata``, constructing only the classes DCP itself writes there."""

    def __init__(self, stream: Any, source: str) -> None:
        super().__init__(stream)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.source}: refers to {module}.{name}, which a weights-only load does not construct "
            "(allowed: DCP metadata classes, torch.Size, dtypes, layouts, paths); "
            "the file was not written by torch.distributed.checkpoint or was altered: do not load it"
        )


def read_metadata_safely(path: Path) -> Any:
    """DCP ``Metadata`` of the checkpoint directory ``path`` through ``_MetadataUnpickler``."""
    source = str(path / ".metadata")
    with open(source, "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read()), source).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP ``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler.

    Tensor records are already read with ``torch.load(weights_only=True)`` by
    the base class (module note "what is unpickled on load"). ``metadata``:
    the result of ``read_metadata_safely`` when the caller already has it
    (checks run before DCP does, so a refused file raises ``CheckpointError``
    itself rather than inside DCP's ``CheckpointException``).
    """

    def __init__(self, path: str | os.PathLike, metadata: Any = None) -> None:
        super().__init__(path)
        self._safe_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # per-rank metadata files: autoshard never writes them
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not supported; re-save with autoshard")
        metadata = self._safe_metadata or read_metadata_safely(Path(self.path))
        # The bookkeeping of the base method, which cannot be called: it would unpickle unrestricted.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# --------------------------------------------------------------------------- tensors held as several blocks


@dataclass(frozen=True)
class Blocks:
    """One tensor a rank holds as several rectangular blocks of it (module note "tensors held as several
    blocks"): ``views`` maps each block's global offsets to the block, a view of the rank's local tensor."""

    global_shape: tuple[int, ...]
    views: Mapping[tuple[int, ...], torch.Tensor]

    @classmethod
    def of_held(cls, local: torch.Tensor, global_shape: tuple[int, ...], held: list[list[int]]) -> Blocks | None:
        """The blocks of ``local``, whose dims hold the global indices ``held`` (``held_indices``); ``None``
        when they are one block (a DTensor chunk describes it)."""
        runs = [_runs(h) for h in held]
        if all(len(r) <= 1 for r in runs):
            return None
        views = {tuple(run[0] for run in combo): local[tuple(slice(lo, lo + n) for _, lo, n in combo)]
                 for combo in itertools.product(*runs)}
        return cls(tuple(global_shape), views)

    def chunks(self) -> list[ChunkStorageMetadata]:
        """The blocks as DCP chunks, in ``views`` order."""
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self.views.items()]


def held_indices(global_shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                 coordinate: tuple[int, ...]) -> list[list[int]]:
    """Per tensor dim, the global indices the rank at mesh ``coordinate`` holds, in local order.

    DTensor's rule, placements applied left to right (``torch.chunk`` sizes): ``Shard(d)`` keeps the
    rank's chunk of dim ``d``; ``_StridedShard(d, split_factor=f)`` cuts dim ``d`` into ``f`` pieces
    and keeps the rank's chunk of each, concatenated (a fused projection's tp shard: ``[q_r | k_r | v_r]``).
    """
    held = [list(range(n)) for n in global_shape]
    for size, coord, placement in zip(mesh_shape, coordinate, placements):
        if _StridedShard is not None and isinstance(placement, _StridedShard):  # before Shard: a subclass on old torch
            pieces = _chunks(held[placement.dim], int(placement.split_factor))
            held[placement.dim] = [i for piece in pieces for i in _chunks(piece, size)[coord]]
        elif isinstance(placement, Shard):
            held[placement.dim] = _chunks(held[placement.dim], size)[coord]
    return held


def _chunks(seq: list[int], num_chunks: int) -> list[list[int]]:
    """``torch.chunk``'s pieces of ``seq``, padded with empty ones to ``num_chunks``."""
    size = -(-len(seq) // num_chunks)
    return [seq[i * size:(i + 1) * size] for i in range(num_chunks)]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: ``(global start, local start, length)``."""
    runs: list[tuple[int, int, int]] = []
    for local, index in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == index:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((index, local, 1))
    return runs


def _write_item(key: str, chunk: ChunkStorageMetadata, view: torch.Tensor, global_shape: tuple[int, ...]) -> WriteItem:
    """DCP's write item of one block (as ``_create_write_items_for_dtensor`` makes one for a DTensor's chunk)."""
    data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(view),
                           size=torch.Size(global_shape))
    return WriteItem(index=MetadataIndex(key, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)


class BlockSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that also writes ``blocks`` (checkpoint key → ``Blocks``), one chunk per block."""

    def __init__(self, blocks: Mapping[str, Blocks]) -> None:
        super().__init__()
        self.blocks = dict(blocks)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [_write_item(key, chunk, view, blocks.global_shape) for key, blocks in self.blocks.items()
                 for chunk, view in zip(blocks.chunks(), blocks.views.values())]
        self.plan = replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        blocks = self.blocks.get(index.fqn)
        return super().lookup_object(index) if blocks is None else blocks.views[tuple(index.offset)]


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses non-tensor (pickled) checkpoint entries, and also reads ``blocks``
    (checkpoint key → ``Blocks``: the saved chunks overlapping each block, written into its view)."""

    def __init__(self, blocks: Mapping[str, Blocks] | None = None) -> None:
        super().__init__()
        self.blocks = dict(blocks or {})

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = [item for key, blocks in self.blocks.items()
                 for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                              blocks.chunks())]
        return replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        blocks = self.blocks.get(index.fqn)
        return super().lookup_tensor(index) if blocks is None else blocks.views[tuple(index.offset)]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, which a weights-only load "
            "refuses; autoshard checkpoints hold tensors only: re-save with autoshard.runtime.checkpoint.save"
        )


__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "SIDECAR",
    "BlockSavePlanner",
    "Blocks",
    "CheckpointError",
    "CheckpointInfo",
    "SafeFileSystemReader",
    "TensorRecord",
    "WeightsOnlyLoadPlanner",
    "check_replaceable",
    "commit",
    "held_indices",
    "read_info",
    "read_metadata_safely",
    "resolve_checkpoint",
    "temporary_dir",
    "write_sidecar",
]
