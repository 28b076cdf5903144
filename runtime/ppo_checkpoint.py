"""Checkpoint and resume of a sharded PPO run, under any plan (``runtime/checkpoint.py`` underneath).

What one checkpoint holds (DCP keys; every tensor by its GLOBAL shape, so a
run saved under one plan or world size resumes under another):

| key | value |
| --- | --- |
| ``model.policy.<fqn>`` | policy fp32 master, at its ``ParamPlacement`` |
| ``model.reference.<fqn>`` | frozen reference fp32 master |
| ``optim.policy.<fqn>.exp_avg`` / ``.exp_avg_sq`` | AdamW moments, re-assembled at the parameter's local shape |
| ``rng.cpu.<rank>`` | torch's global CPU generator per rank (``checkpoint.py``) |
| sidecar ``step`` | PPO steps done |
| sidecar ``extras`` | ``optimizer_steps`` (Adam's bias-correction counter), ``seed``, ``dp`` (the saving run's dp size) |

The trainer's own generators are not saved: ``ppo_program.train_loop``
re-seeds them from (seed, dp rank, step) before each step, so a resumed run
draws exactly what an uninterrupted one draws when the dp size is the same
(with another dp size the prompts are split differently: the run continues
from the same weights and optimizer state, on a different random stream).

Moments: the optimizer keeps ZeRO-1/2/offload moments as flat per-rank
chunks of the flattened parameter; ``ShardedOptimizer.local_moments`` all-gathers
them over dp into the parameter's local shape (as for the master), so they carry
the parameter's placement; on load each rank keeps its own chunk again
(``load_local_moments``). The same views serve ``checkpoint.program_state``.

Every rank calls ``save_ppo`` / ``load_ppo`` (DCP collectives plus one
device-mesh build).

Which model a checkpoint belongs to: the fingerprint of the policy's graph
(``ModelGraph.fingerprint``: the MODEL's name, as plans record it, and every
parameter's global shape) and the saving plan's ``model_name``.
``check_resumable`` compares them with the run's graph from the sidecar alone
(no collective, no tensor read), so ``autoshard ppo --resume`` refuses another
model in one line before it searches or launches a rank, naming both models,
or, when the name is the same but the model changed (a factory or config
edited since), the first parameter whose shape differs; ``load_ppo`` runs the
same check first on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime.mesh import build_device_mesh
from autoshard.runtime.optimizer import MOMENTS

_ENGINES = ("policy", "reference")


def _state(trainer: Any, graph: Any, mesh: Any) -> ckpt.CheckpointState:
    """This rank's ``CheckpointState`` of ``trainer`` (tensors are fresh copies: save source or load target)."""
    model: dict[str, Any] = {}
    optimizer: dict[str, dict[str, Any]] = {}
    for name in _ENGINES:
        program = getattr(trainer, name).program
        masters = program.local_state_dict()
        for fqn, placement in program.param_placements.items():
            model[f"{name}.{fqn}"] = ckpt.LocalShard.of(masters[fqn], placement)
    policy = trainer.policy.program
    for fqn, slot in policy.optimizer.slots.items():
        placement = policy.param_placements[fqn]
        optimizer[f"policy.{fqn}"] = {m: ckpt.LocalShard.of(slot.local_state(m), placement) for m in MOMENTS}
    extras = {"optimizer_steps": int(policy.optimizer.steps), "seed": int(trainer.config.seed), "dp": trainer.dp.world_size}
    return ckpt.CheckpointState(
        model=model, optimizer=optimizer, step=int(trainer.step_count), extras=extras, mesh=mesh,
        model_fingerprint=graph.fingerprint(), plan=policy.plan,
    )


def _device_mesh(trainer: Any) -> Any:
    program = trainer.policy.program
    return build_device_mesh(program.plan.mesh, torch.device(program.ctx.device).type)


def save_ppo(path: str | os.PathLike, trainer: Any, graph: Any) -> Path:
    """Save the whole PPO state of ``trainer`` (module table) to the directory ``path`` (atomic, collective)."""
    return ckpt.save(path, _state(trainer, graph, _device_mesh(trainer)))


def check_resumable(path: str | os.PathLike, graph: Any) -> Any:
    """The sidecar (``CheckpointInfo``) of the PPO checkpoint at ``path`` once it is known to hold ``graph``'s model;
    ``CheckpointError`` naming the mismatch otherwise (module docstring; reads one JSON file, no collective)."""
    directory = ckpt.resolve_checkpoint(path)
    info = ckpt.read_info(directory)
    if not info.model_fingerprint or info.model_fingerprint == graph.fingerprint():
        return info
    saved_name = (info.plan or {}).get("model_name", "?")
    where = f"checkpoint {str(directory)!r}"
    if saved_name != graph.model_name:
        raise ckpt.CheckpointError(
            f"{where} was saved from model {saved_name!r}, not {graph.model_name!r}; resume with the MODEL it was "
            "saved from, or train this one into another --checkpoint DIR"
        )
    raise ckpt.CheckpointError(f"{where} was saved from another version of model {graph.model_name!r}: "
                               f"{_first_difference(info, graph)}; resume with the model as it was saved, or "
                               "train this one into another --checkpoint DIR")


def _first_difference(info: Any, graph: Any) -> str:
    """The first policy parameter whose global shape differs between the checkpoint and ``graph``, in words."""
    prefix = f"{ckpt.MODEL_PREFIX}policy."
    saved = {key[len(prefix):]: tuple(r.shape) for key, r in info.tensors.items() if key.startswith(prefix)}
    here = {p.name: tuple(p.global_shape) for layer in graph.layers for p in layer.params}
    for fqn in [*here, *(fqn for fqn in saved if fqn not in here)]:
        if saved.get(fqn) != here.get(fqn):
            return (f"parameter {fqn!r} is {_shape_text(saved.get(fqn))} in the checkpoint and "
                    f"{_shape_text(here.get(fqn))} now")
    return (f"the parameters' shapes agree but its layers or dtype do not (fingerprint {info.model_fingerprint} in "
            f"the checkpoint, {graph.fingerprint()} now)")


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else f"[{', '.join(map(str, shape))}]"


def load_ppo(path: str | os.PathLike, trainer: Any, graph: Any) -> ckpt.CheckpointState:
    """Load a PPO checkpoint saved under any plan into ``trainer`` (collective); returns the loaded state.

    Sets the policy and reference weights, the AdamW moments and step
    counter, and ``trainer.step_count``; refuses (``CheckpointError``) a
    checkpoint of another model before any collective (``check_resumable``).
    """
    check_resumable(path, graph)
    template = _state(trainer, graph, _device_mesh(trainer))
    loaded = ckpt.load(path, template)
    for name in _ENGINES:
        prefix = f"{name}."
        engine = getattr(trainer, name)
        engine.load_state_dict({k[len(prefix):]: e.local for k, e in loaded.model.items() if k.startswith(prefix)})
    optimizer = trainer.policy.program.optimizer
    optimizer.load_local_moments({fqn: {m: e.local for m, e in loaded.optimizer[f"policy.{fqn}"].items()}
                                  for fqn in optimizer.slots})
    optimizer.steps = int(loaded.extras["optimizer_steps"])
    trainer.step_count = int(loaded.step)
    return loaded


__all__ = ["check_resumable", "load_ppo", "save_ppo"]
