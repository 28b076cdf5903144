"""Device mesh and process groups from ``plan.mesh``; the ``RankContext`` of this process.

The mesh is a ``torch.distributed.DeviceMesh`` with axes ``pp, dp_replicate,
dp_shard, cp, tp`` (outermost → innermost, ``autoshard.passes.context``
docstring: tp innermost = contiguous ranks), plus the flattened ``"dp"``
axis (dp_replicate × dp_shard), and with ``mesh.ep > 1`` the expert groups
``"ep"`` (runs of ep consecutive dp coordinates) and ``"edp"`` (dp coordinates
holding the same experts), made with ``dist.new_group``. Every rank must build it (group creation is a
collective over the world), which ``build_rank_context`` does after checking
the plan against the live world, so a mismatched plan fails before any
collective can hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import PlanError
from autoshard.passes.context import MESH_ORDER, RankContext, coords_of
from autoshard.plan import Mesh


def check_world(mesh: Mesh) -> None:
    """Raise ``PlanError`` unless a process group exists whose size equals the mesh's world size."""
    if not dist.is_initialized():
        raise PlanError(
            f"building a per-rank program for mesh {mesh} needs torch.distributed initialised; "
            "launch with `autoshard run` / torchrun, or call init_process_group first"
        )
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise PlanError(
            f"plan mesh {mesh} needs {mesh.world_size} ranks but this job has world size {world}; "
            "launch with the plan's world size or search a plan for this one"
        )


def build_device_mesh(mesh: Mesh, device_type: str = "cpu") -> DeviceMesh:
    """A ``DeviceMesh`` over the world with the axes of ``MESH_ORDER`` and a flattened ``"dp"`` axis."""
    check_world(mesh)
    shape = tuple(getattr(mesh, axis) for axis in MESH_ORDER)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_ORDER)
    device_mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return device_mesh


def build_rank_context(
    mesh: Mesh, *, device: str = "cpu", compute_dtype: torch.dtype = torch.float32
) -> tuple[RankContext, DeviceMesh]:
    """This process's ``RankContext`` and the live ``DeviceMesh`` it names groups of."""
    device_mesh = build_device_mesh(mesh, torch.device(device).type)
    rank = dist.get_rank()
    names = {axis: device_mesh.get_group(axis).group_name for axis in (*MESH_ORDER, "dp")}
    names["world"] = dist.group.WORLD.group_name
    if mesh.ep > 1:
        names.update(_expert_group_names(mesh, rank))
    coords = coords_of(rank, mesh)
    assert all(device_mesh.get_local_rank(axis) == coords[axis] for axis in MESH_ORDER), (coords, rank)
    ctx = RankContext(
        rank=rank,
        world_size=mesh.world_size,
        mesh=mesh,
        coords=coords,
        group_names=names,
        device=device,
        compute_dtype=compute_dtype,
    )
    return ctx, device_mesh


def _expert_group_names(mesh: Mesh, rank: int) -> dict[str, str]:
    """Create every ``"ep"`` and ``"edp"`` group (collective over the world); names of this rank's two.

    ep: runs of ``ep`` consecutive dp coordinates (experts sharded over them);
    edp: dp coordinates with the same index inside their run (same experts; their
    gradients are reduced together). Other axes (pp, cp, tp) fixed.
    """
    dp, cp, tp = mesh.dp, mesh.cp, mesh.tp

    def rank_of(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    names = {}
    for p in range(mesh.pp):
        for c in range(cp):
            for t in range(tp):
                runs = [[rank_of(p, b * mesh.ep + i, c, t) for i in range(mesh.ep)] for b in range(dp // mesh.ep)]
                for axis, groups in (("ep", runs), ("edp", [list(g) for g in zip(*runs)])):
                    for ranks in groups:
                        group = dist.new_group(ranks)
                        if rank in ranks:
                            names[axis] = group.group_name
    return names


__all__ = ["build_device_mesh", "build_rank_context", "check_world"]
