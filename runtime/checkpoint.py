"""Checkpoints: layout-independent, atomic, weights-only (``torch.distributed.checkpoint``).

What is saved (``CheckpointState``): model parameters, optimizer states (fp32
master and moments, sharded like their parameters), the step, per-rank RNG
states and JSON extras (e.g. PPO counters), plus the model fingerprint and the
plan. Tensors go through DCP; everything else goes to a JSON sidecar
(``runtime/_checkpoint_files.py`` has the directory layout, the commit
protocol and what is unpickled on load).

Layout independence
    Each rank holds local shards (``LocalShard``: local tensor, DTensor
    placements per mesh axis, global shape). ``save`` wraps each one as
    ``DTensor.from_local(local, mesh, placements, shape=global_shape,
    stride=contiguous(global_shape), run_check=False)``, so DCP records every
    tensor by its global shape and each rank's chunk by its global offset
    (DTensor's uneven chunk rule: along a sharded tensor dim of size ``n`` over
    ``k`` ranks, rank ``c`` holds ``[c*ceil(n/k), min(n, (c+1)*ceil(n/k)))``).
    ``load`` builds the same wrapping around the *new* plan's local shards and
    DCP reads the overlapping byte ranges: any plan, any world size, as long as
    the global shapes agree. Keys: ``model.<fqn>``, ``optim.<fqn>.<state>``,
    ``rng.cpu.<rank>``, ``rng.cuda.<rank>``.

Fused projections split over tp (decision)
    A rank's shard of one (``_StridedShard(tp_dim, split_factor=parts)``: its chunk of every part) is
    several blocks of the global tensor; it is saved and loaded as one DCP chunk per block under the
    same key and global shape (``shard_blocks``), so the files are those any other plan writes.

Checks before any collective
    ``load`` reads the sidecar on every rank and refuses, with
    ``CheckpointError`` and before DCP runs a single collective: a model
    fingerprint that differs from the template's (both named), a template
    tensor the checkpoint lacks, a global shape that differs, a local shard
    whose shape breaks the chunk rule. Every rank reaches the same verdict
    from the same files, so no rank is left waiting in a collective.

RNG states
    Saved per rank under ``rng.<device>.<rank>``. On load, rank ``r`` restores
    the state saved by rank ``r`` when the saved world had one; ranks beyond
    the saved world size keep their current generators (a resharded resume
    cannot reproduce the old random streams anyway).

Non-tensor values
    ``step``, ``extras`` and the plan come from the sidecar; ``extras`` must
    be JSON-serialisable and are taken from rank 0 on save.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DeviceMesh, DTensor, Placement

from autoshard.runtime._checkpoint_files import (
    SIDECAR,
    BlockSavePlanner,
    Blocks,
    CheckpointError,
    CheckpointInfo,
    SafeFileSystemReader,
    TensorRecord,
    WeightsOnlyLoadPlanner,
    check_replaceable,
    commit,
    dtype_from_name,
    dtype_name,
    held_indices,
    now_unix,
    read_info,
    read_metadata_safely,
    resolve_checkpoint,
    temporary_dir,
    write_sidecar,
)
from autoshard.runtime.mesh import build_device_mesh

try:  # private, present in torch 2.11-2.13: DTensor's own local-shape rule
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - depends on the installed torch
    compute_local_shape_and_global_offset = None
try:  # private, present in torch 2.11-2.13: the tp placement of a fused projection (``passes/context.py``)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - depends on the installed torch
    _StridedShard = None

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
STEPS_EXTRA = "optimizer_steps"  # sidecar extras key of a program's optimizer step counter

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class LocalShard:
    """One rank's piece of a global tensor and how it was cut (DTensor semantics).

    ``placements`` has one entry per axis of the state's mesh (``Shard(d)``,
    ``_StridedShard`` or ``Replicate()``); ``local`` follows DTensor's chunk
    rule for them (a fused projection's tp shard is several blocks of the global
    tensor: ``shard_blocks``). ``load`` writes into ``local`` in place.
    """

    local: torch.Tensor  # local_shape
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...]

    @classmethod
    def of(cls, local: torch.Tensor, placement: Any) -> LocalShard:
        """``local`` cut as a runtime ``ParamPlacement`` says (its ``placements`` and ``global_shape``)."""
        return cls(local, tuple(placement.placements), tuple(placement.global_shape))


Entry = LocalShard | torch.Tensor  # a plain tensor is the same (replicated) on every rank


@dataclass(frozen=True)
class RngState:
    """Generator states of one rank: torch's CPU generator and, when CUDA is in use, the current device's."""

    cpu: torch.Tensor  # uint8 (state bytes,)
    cuda: torch.Tensor | None = None  # uint8 (state bytes,)

    @classmethod
    def capture(cls) -> RngState:
        """The generator states of this process now."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(cpu=torch.get_rng_state(), cuda=cuda)

    def restore(self) -> None:
        """Make this process's generators continue from these states."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda)


@dataclass(frozen=True)
class CheckpointState:
    """Everything a training run needs to resume, as this rank holds it.

    ``model`` maps parameter FQN to its entry; ``optimizer`` maps parameter FQN
    to its named states (``{"master": ..., "exp_avg": ..., "exp_avg_sq": ...,
    "step": ...}``), sharded like the parameter. ``mesh`` is the DeviceMesh
    every ``LocalShard``'s placements refer to (``None`` when there is none).
    ``rng=None`` on save captures the current generators. ``model_fingerprint``
    is ``ModelGraph.fingerprint()``; empty means "not recorded" (not checked).
    As a ``load`` template, the tensors name what to load and receive it; the
    returned state carries the saved step, extras and RNG.
    """

    model: Mapping[str, Entry]
    optimizer: Mapping[str, Mapping[str, Entry]] = field(default_factory=dict)
    step: int = 0
    extras: Mapping[str, Any] = field(default_factory=dict)
    rng: RngState | None = None
    mesh: DeviceMesh | None = None
    model_fingerprint: str = ""
    plan: Any = None  # autoshard.plan.Plan or None; recorded in the sidecar

    def tensor_entries(self) -> dict[str, Entry]:
        """Every tensor under its checkpoint key (``model.<fqn>``, ``optim.<fqn>.<state>``)."""
        out: dict[str, Entry] = {MODEL_PREFIX + fqn: entry for fqn, entry in self.model.items()}
        for fqn, states in self.optimizer.items():
            for name, entry in states.items():
                out[f"{OPTIM_PREFIX}{fqn}.{name}"] = entry
        return out


# --------------------------------------------------------------------------- DTensor wrapping


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``: ``(2, 3, 4)`` → ``(12, 4, 1)``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _check_shard(key: str, shard: LocalShard, mesh: DeviceMesh | None) -> None:
    """Refuse a ``LocalShard`` that does not fit the mesh or DTensor's chunk rule (no collective)."""
    if mesh is None:
        raise CheckpointError(f"{key!r} is a LocalShard but the state has mesh=None; pass the DeviceMesh it lives on")
    if len(shard.placements) != mesh.ndim:
        raise CheckpointError(
            f"{key!r} has {len(shard.placements)} placements {list(shard.placements)} for a {mesh.ndim}-axis mesh "
            f"{_mesh_dict(mesh)}; give one placement per mesh axis"
        )
    if compute_local_shape_and_global_offset is None or mesh.get_coordinate() is None:
        return
    expected, _ = compute_local_shape_and_global_offset(shard.global_shape, mesh, list(shard.placements))
    if tuple(expected) != tuple(shard.local.shape):
        raise CheckpointError(
            f"{key!r}: local shape {list(shard.local.shape)} is not the shard of global {list(shard.global_shape)} "
            f"under {list(shard.placements)} on this rank (expected {list(expected)}); the placements or the "
            "global shape passed to the checkpoint are wrong"
        )


def to_dtensor(shard: LocalShard, mesh: DeviceMesh) -> DTensor:
    """``shard`` as a DTensor sharing its local storage (no communication)."""
    return DTensor.from_local(
        shard.local,
        mesh,
        list(shard.placements),
        run_check=False,
        shape=torch.Size(shard.global_shape),
        stride=contiguous_stride(tuple(shard.global_shape)),
    )


def _dcp_tensors(state: CheckpointState) -> tuple[dict[str, torch.Tensor], dict[str, Blocks]]:
    """The state's tensors as DCP wants them: DTensors for one-block shards, plain tensors for replicas;
    and the shards of several blocks (``shard_blocks``), for the planners."""
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, Blocks] = {}
    for key, entry in state.tensor_entries().items():
        if not isinstance(entry, LocalShard):
            out[key] = entry
            continue
        _check_shard(key, entry, state.mesh)
        split = shard_blocks(key, entry, state.mesh)
        if split is None:
            out[key] = to_dtensor(entry, state.mesh)
        else:
            blocks[key] = split
    return out, blocks


# --------------------------------------------------------------------------- shards of several blocks


def shard_blocks(key: str, shard: LocalShard, mesh: DeviceMesh | None) -> Blocks | None:
    """``shard`` as the blocks of its global tensor it holds (views of ``shard.local``), or ``None`` when
    it is one block, as a DTensor chunk describes it (every placement without ``_StridedShard``, and
    tp then ZeRO-3 on one dim). Several blocks: a fused projection split over tp (module docstring)."""
    strided = _StridedShard is not None and any(isinstance(p, _StridedShard) for p in shard.placements)
    coordinate = mesh.get_coordinate() if strided and mesh is not None else None
    if coordinate is None:
        return None
    held = held_indices(tuple(shard.global_shape), tuple(shard.placements), tuple(mesh.shape), tuple(coordinate))
    if tuple(len(h) for h in held) != tuple(shard.local.shape):
        raise CheckpointError(
            f"{key!r}: local shape {list(shard.local.shape)} is not the shard of global {list(shard.global_shape)} "
            f"under {list(shard.placements)} on this rank (expected {[len(h) for h in held]}); the placements or "
            "the global shape passed to the checkpoint are wrong")
    return Blocks.of_held(shard.local, tuple(shard.global_shape), held)


def _mesh_dict(mesh: DeviceMesh | None) -> dict[str, int]:
    if mesh is None:
        return {}
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    return {str(name): int(size) for name, size in zip(names, mesh.shape)}


# --------------------------------------------------------------------------- process group


def _world(process_group: Any) -> tuple[int, int, bool]:
    """(rank in the group, group size, whether a process group is in use)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group), True
    return 0, 1, False


def _broadcast_from_first(value: Any, process_group: Any) -> Any:
    """``value`` of the group's first rank, on every rank (a small Python object)."""
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    box = [value]
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


# --------------------------------------------------------------------------- save


def _rng_tensors(rng: RngState, rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng.cpu.{rank}": rng.cpu}
    if rng.cuda is not None:
        out[f"rng.cuda.{rank}"] = rng.cuda.cpu()
    return out


def _check_extras(extras: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(extras), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint extras {sorted(extras)} are not JSON data ({err}); keep extras to numbers, strings, "
            "lists and dicts (tensors belong in model/optimizer)"
        ) from None


def _sidecar(state: CheckpointState, metadata: Any, world_size: int, extras: dict[str, Any]) -> CheckpointInfo:
    tensors = {
        key: TensorRecord(tuple(md.size), dtype_name(md.properties.dtype))
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "size")
    }
    return CheckpointInfo(
        model_fingerprint=state.model_fingerprint,
        step=int(state.step),
        world_size=world_size,
        tensors=tensors,
        extras=extras,
        mesh=_mesh_dict(state.mesh),
        plan=state.plan.to_dict() if state.plan is not None else None,
        torch_version=torch.__version__,
        created_unix=now_unix(),
    )


def save(path: str | os.PathLike, state: CheckpointState, *, process_group: Any = None) -> Path:
    """Save ``state`` (collective over ``process_group``; every rank calls it) to the directory ``path``.

    Atomic (``_checkpoint_files`` note "atomic commit"): ranks write into
    ``path.tmp-<uuid>/``; rank 0 commits with renames once every rank's writes
    have returned; a previous checkpoint at ``path`` is replaced only then.
    A failure on any rank raises on every rank and leaves ``path`` as it was:
    DCP reports failures inside its phases as ``CheckpointException`` (a
    ``BaseException`` subclass, with every failed rank's traceback); a bad
    state raises ``CheckpointError`` before any collective. Without a process
    group, saves from this one process. Returns ``path``.
    """
    path = Path(path).absolute()
    rank, world_size, distributed = _world(process_group)
    check_replaceable(path)
    extras = _check_extras(state.extras)
    tensors, blocks = _dcp_tensors(state)
    tensors.update(_rng_tensors(state.rng or RngState.capture(), rank))
    token = uuid.uuid4().hex[:12]
    if distributed:
        token = _broadcast_from_first(token, process_group)
    tmp = temporary_dir(path, token)
    try:
        metadata = dcp.save(
            tensors,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            planner=BlockSavePlanner(blocks),
            process_group=process_group,
            no_dist=not distributed,
        )
        failure = _commit_on_first(rank, tmp, path, token, _sidecar(state, metadata, world_size, extras))
        if distributed:
            failure = _broadcast_from_first(failure, process_group)
        if failure:
            raise CheckpointError(f"saving checkpoint {str(path)!r} failed at commit on rank 0: {failure}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _commit_on_first(rank: int, tmp: Path, path: Path, token: str, info: CheckpointInfo) -> str | None:
    """Rank 0 writes the sidecar and commits; returns the error text instead of raising (others must hear it)."""
    if rank != 0:
        return None
    try:
        write_sidecar(tmp, info)
        commit(tmp, path, token)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


# --------------------------------------------------------------------------- load


def _check_fingerprint(info: CheckpointInfo, expected: str, directory: Path) -> None:
    if expected and info.model_fingerprint and expected != info.model_fingerprint:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} was saved from model {info.model_fingerprint}, "
            f"but the model being loaded has fingerprint {expected}; load a checkpoint of this model "
            "(or read its tensors with load_weights, which does not check)"
        )


def _check_template(entries: Mapping[str, Entry], info: CheckpointInfo, directory: Path) -> None:
    """Every template tensor exists in the checkpoint with the same global shape."""
    for key, entry in entries.items():
        record = info.tensors.get(key)
        if record is None:
            near = sorted(k for k in info.tensors if k.split(".", 1)[0] == key.split(".", 1)[0])[:5]
            raise CheckpointError(
                f"{key!r} is not in checkpoint {str(directory)!r} (saved {key.split('.', 1)[0]} keys include {near}); "
                "load into a state with the saved parameter names, or drop the entry from the template"
            )
        shape = tuple(entry.global_shape) if isinstance(entry, LocalShard) else tuple(entry.shape)
        if shape != tuple(record.shape):
            raise CheckpointError(
                f"{key!r}: the checkpoint holds global shape {list(record.shape)}, the template "
                f"{list(shape)}; resharding changes placements, not global shapes: use the same model"
            )


def _rng_template(info: CheckpointInfo, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors for the RNG states saved by this rank (nothing when the saved world was smaller)."""
    out = {}
    for device in ("cpu", "cuda"):
        record = info.tensors.get(f"rng.{device}.{rank}")
        if record is not None:
            out[f"rng.{device}.{rank}"] = torch.empty(record.shape, dtype=dtype_from_name(record.dtype))
    return out


def _copy_back(loaded: Mapping[str, torch.Tensor], entries: Mapping[str, Entry]) -> None:
    """Make sure each template tensor holds what DCP loaded (DCP writes into DTensor locals in place, and
    into the views of shards of several blocks, which are not in ``loaded``)."""
    for key, value in loaded.items():
        entry = entries[key]
        target = entry.local if isinstance(entry, LocalShard) else entry
        value = value.to_local() if isinstance(value, DTensor) else value
        if value.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.copy_(value)


def load(
    path: str | os.PathLike,
    template: CheckpointState,
    *,
    process_group: Any = None,
    restore_rng: bool = True,
) -> CheckpointState:
    """Load the checkpoint at ``path`` into ``template``'s tensors, for this rank's plan (collective).

    The template's entries (model and, when given, optimizer) say what to load
    and receive it in place, under whatever placements and world size the
    current plan uses. Checks run first, with no collective (module docstring).
    Returns ``template`` with the saved step, extras and this rank's RNG state
    (restored into the generators when ``restore_rng``).
    """
    directory = resolve_checkpoint(path)
    info = read_info(directory)
    _check_fingerprint(info, template.model_fingerprint, directory)
    entries = template.tensor_entries()
    _check_template(entries, info, directory)
    metadata = read_metadata_safely(directory)
    rank, _, distributed = _world(process_group)
    tensors, blocks = _dcp_tensors(template)
    rng_tensors = _rng_template(info, rank)
    dcp.load(
        {**tensors, **rng_tensors},
        storage_reader=SafeFileSystemReader(directory, metadata),
        planner=WeightsOnlyLoadPlanner(blocks),
        process_group=process_group,
        no_dist=not distributed,
    )
    _copy_back(tensors, entries)
    rng = None
    if f"rng.cpu.{rank}" in rng_tensors:
        rng = RngState(cpu=rng_tensors[f"rng.cpu.{rank}"], cuda=rng_tensors.get(f"rng.cuda.{rank}"))
        if restore_rng:
            rng.restore()
    return replace(template, step=info.step, extras=dict(info.extras), rng=rng)


# --------------------------------------------------------------------------- runtime programs


def program_state(
    program: Any,
    device_mesh: DeviceMesh | None = None,
    *,
    step: int = 0,
    extras: Mapping[str, Any] | None = None,
    model_fingerprint: str = "",
) -> CheckpointState:
    """The ``CheckpointState`` of a runtime ``Program`` (collective: every rank calls it).

    | key | value |
    | --- | --- |
    | ``model.<fqn>`` | fp32 master (``Program.local_state_dict``) at its ``ParamPlacement`` |
    | ``optim.<fqn>.exp_avg`` / ``.exp_avg_sq`` | AdamW moments at the same placement (``ShardedOptimizer.local_moments``; SGD has none) |
    | ``rng.cpu.<rank>`` (``rng.cuda.<rank>``) | this rank's generators, captured by ``save`` |
    | sidecar ``extras["optimizer_steps"]`` | updates taken: Adam's bias-correction count and the learning-rate schedule's position |
    | sidecar ``step``, other ``extras`` | the caller's (training step, data position, ...) |

    ZeRO-1/2/offload keep masters and moments as flat per-rank chunks; they are all-gathered over
    dp into the parameter's local shape, so every optimizer state is cut like its parameter and a
    run resumes under any plan or world size. ``device_mesh`` is the mesh the placements refer to
    (``runtime/mesh.py``: ``program.device_mesh`` when the program keeps it, else built again from
    ``program.plan.mesh``).
    """
    if device_mesh is None:
        device_mesh = _program_mesh(program)
    masters = program.local_state_dict()
    moments = program.optimizer.local_moments()
    return _program_checkpoint(program, device_mesh, masters, moments, step=step,
                               extras={**(extras or {}), STEPS_EXTRA: int(program.optimizer.steps)},
                               model_fingerprint=model_fingerprint)


def _program_checkpoint(program: Any, device_mesh: DeviceMesh, masters: Mapping[str, torch.Tensor],
                        moments: Mapping[str, Mapping[str, torch.Tensor]], **fields: Any) -> CheckpointState:
    """``CheckpointState`` of ``program`` holding ``masters`` and ``moments`` (local-shape tensors) at their placements."""
    placements = program.param_placements
    model = {fqn: LocalShard.of(masters[fqn], placement) for fqn, placement in placements.items()}
    optimizer = {fqn: {name: LocalShard.of(value, placements[fqn]) for name, value in states.items()}
                 for fqn, states in moments.items() if states}
    return CheckpointState(model=model, optimizer=optimizer, mesh=device_mesh, plan=program.plan, **fields)


def load_program(
    path: str | os.PathLike,
    program: Any,
    device_mesh: DeviceMesh | None = None,
    *,
    model_fingerprint: str = "",
    process_group: Any = None,
    restore_rng: bool = True,
) -> CheckpointState:
    """Load a checkpoint saved under any plan into ``program`` (collective): masters and compute
    parameters, AdamW moments, the optimizer's step counter (hence the schedule's position) and,
    with ``restore_rng``, this rank's generators (``program_state`` has the table).

    The template is allocated at each parameter's local shape with no collective; DCP reads into
    it the byte ranges this rank's placements cover. A checkpoint without moments (an SGD run, or
    one saved before moments were saved) loads into an AdamW program with fresh moments and the
    step counter at 0 (a warning says so). Returns the loaded state (step, extras, RNG).
    """
    if device_mesh is None:
        device_mesh = _program_mesh(program)
    info = read_info(resolve_checkpoint(path))
    names = program.optimizer.config.state_names
    with_moments = bool(names) and any(key.startswith(OPTIM_PREFIX) for key in info.tensors)
    device = program.ctx.device
    masters = {fqn: torch.empty(p.local_shape, dtype=torch.float32, device=device)
               for fqn, p in program.param_placements.items()}
    moments = {fqn: {name: torch.empty_like(masters[fqn]) for name in (names if with_moments else ())}
               for fqn in masters}
    template = _program_checkpoint(program, device_mesh, masters, moments, model_fingerprint=model_fingerprint)
    loaded = load(path, template, process_group=process_group, restore_rng=restore_rng)
    program.load_local_state_dict(masters)
    program.optimizer.load_local_moments(moments)
    saved_steps = int(loaded.extras.get(STEPS_EXTRA, 0))
    if names and not with_moments:
        log.warning("load_program: %s holds no AdamW moments; the optimizer restarts them and its step counter "
                    "(%d saved) at 0", path, saved_steps)
        saved_steps = 0
    program.optimizer.steps = saved_steps
    return loaded


def _program_mesh(program: Any) -> DeviceMesh:
    mesh = getattr(program, "device_mesh", None)
    if mesh is not None:
        return mesh

    return build_device_mesh(program.plan.mesh, torch.device(program.ctx.device).type)


# --------------------------------------------------------------------------- inference exports


def load_weights(path: str | os.PathLike, *, model_fingerprint: str = "") -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict ``{fqn: tensor}`` of a checkpoint, in this process.

    No process group is used (safe to call on one rank of a job, or offline).
    Optimizer states and RNG are not read. With ``model_fingerprint``, refuses
    a checkpoint of another model.
    """
    directory = resolve_checkpoint(path)
    info = read_info(directory)
    _check_fingerprint(info, model_fingerprint, directory)
    metadata = read_metadata_safely(directory)
    full = {
        key: torch.empty(record.shape, dtype=dtype_from_name(record.dtype))
        for key, record in info.tensors.items()
        if key.startswith(MODEL_PREFIX)
    }
    reader = SafeFileSystemReader(directory, metadata)
    dcp.load(full, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in full.items()}


def export_safetensors(path: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """Write the checkpoint's full model state dict to ``out_file`` as safetensors (atomic replace).

    The file's metadata records the model fingerprint and the step. Needs the
    ``safetensors`` package.
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(
            "export_safetensors needs the 'safetensors' package, which is not installed; "
            "install it (pip install safetensors) or use load_weights and torch.save"
        ) from None
    info = read_info(path)
    weights = {k: v.contiguous() for k, v in load_weights(path).items()}
    out_file = Path(out_file)
    tmp = out_file.with_name(f".{out_file.name}.{uuid.uuid4().hex[:8]}.tmp")
    metadata = {"format": "pt", "autoshard.model_fingerprint": info.model_fingerprint, "autoshard.step": str(info.step)}
    try:
        save_file(weights, str(tmp), metadata=metadata)
        os.replace(tmp, out_file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_file


__all__ = [
    "SIDECAR",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointState",
    "Entry",
    "LocalShard",
    "RngState",
    "contiguous_stride",
    "export_safetensors",
    "load",
    "load_program",
    "load_weights",
    "program_state",
    "read_info",
    "save",
    "shard_blocks",
    "to_dtensor",
]
