"""Rank roles of a mesh and the matching of their collectives, for ``autoshard/check.py``. Pure functions.

[Note: roles]
Two ranks with the same *role* build the same program up to the names of their
process groups: same pipeline stages (pp coordinate), same tp and cp pieces,
and the same shard lengths on the data-parallel axes. ZeRO-3 cuts dim 0 of
each parameter's tp piece over dp_shard and ZeRO-1/2 cut the flattened tensor
over dp, by ``torch.chunk``'s rule, so the last coordinates may hold shorter or
empty shards: a dp coordinate's class is the tuple of its chunk lengths over
every parameter's possible sizes (whole, tp piece, ep piece), plus its
position in the expert group when ep > 1. A role is (pp, cp, tp, dp class);
its representative is the lowest rank of that role. Every rank of a role is
assumed to issue the representative's collectives on the corresponding
groups: that is what the rank-symmetric passes make of equal shard shapes.

[Note: matching]
For every axis a role used, every group instance of that axis (the ranks that
differ only on it; ``"dp"`` = dp_replicate × dp_shard, ``"world"`` = all,
``"ep"``/``"edp"`` as ``runtime/mesh.py`` makes them) is checked: the
collectives each member issued on that axis, in order, must be equal in kind
and bytes (``Issued``) to the lowest member's. Send/recv on an axis are
matched in pairs instead: what a member sends to coordinate ``c`` of the axis,
in order and size, is what the member at ``c`` receives from it. Members whose
role was not built (sampled out, ``select_roles``) are skipped. A collective
whose group serves no known axis is itself a mismatch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from autoshard.graph import ModelGraph
from autoshard.passes.context import MESH_ORDER, coords_of
from autoshard.plan import Mesh
from autoshard.runtime._check_trace import Issued, format_bytes

RoleKey = tuple[int, int, int, int]  # (pp, cp, tp, dp class)


@dataclass(frozen=True)
class Role:
    """One rank role ([Note: roles]): its key, the rank built for it and how many ranks it stands for."""

    key: RoleKey
    rank: int
    num_ranks: int
    dp_coords: tuple[int, ...]  # the first few dp coordinates of its class, for the label

    def label(self, mesh: Mesh) -> str:
        """``pp 0 (first) · tp 1 · dp 0`` for people."""
        pp, cp, tp, _ = self.key
        parts = []
        if mesh.pp > 1:
            where = "first" if pp == 0 else "last" if pp == mesh.pp - 1 else "middle"
            parts.append(f"pp {pp} ({where})")
        if mesh.cp > 1:
            parts.append(f"cp {cp}")
        if mesh.tp > 1:
            parts.append(f"tp {tp}")
        if mesh.dp > 1:
            coords = ",".join(map(str, self.dp_coords[:3])) + ("…" if len(self.dp_coords) > 3 else "")
            parts.append(f"dp {coords}")
        return " · ".join(parts) or "rank 0"


def rank_of(mesh: Mesh, coords: Mapping[str, int]) -> int:
    """Global rank of ``coords`` (``MESH_ORDER``, row-major, tp innermost)."""
    rank = 0
    for axis in MESH_ORDER:
        rank = rank * getattr(mesh, axis) + coords[axis]
    return rank


def _sizes(graph: ModelGraph, mesh: Mesh) -> tuple[list[int], list[int]]:
    """(dim-0 lengths, flat lengths) a parameter may be cut from on a dp axis: whole, tp piece, ep piece."""
    dim0, flat = set(), set()
    for layer in graph.layers:
        for param in layer.params:
            shape = tuple(param.global_shape)
            numel = math.prod(shape)
            for split in {1, mesh.tp, mesh.ep}:
                if shape and shape[0] % split == 0:
                    dim0.add(shape[0] // split)
                if numel % split == 0:
                    flat.add(numel // split)
    return sorted(dim0), sorted(flat)


def _chunk_len(size: int, chunks: int, index: int) -> int:
    c = -(-size // chunks)
    return max(0, min(c, size - index * c))


def dp_classes(graph: ModelGraph, mesh: Mesh) -> list[tuple[int, ...]]:
    """The dp coordinates of each class ([Note: roles]), classes in order of their first coordinate."""
    dim0, flat = _sizes(graph, mesh)
    by_signature: dict[tuple, list[int]] = {}
    for d in range(mesh.dp):
        shard = d % mesh.dp_shard
        signature = (tuple(_chunk_len(n, mesh.dp_shard, shard) for n in dim0),
                     tuple(_chunk_len(n, mesh.dp, d) for n in flat),
                     d % mesh.ep)
        by_signature.setdefault(signature, []).append(d)
    return [tuple(coords) for coords in by_signature.values()]


def plan_roles(graph: ModelGraph, mesh: Mesh) -> list[Role]:
    """Every role of ``mesh`` ([Note: roles]), ordered by key."""
    classes = dp_classes(graph, mesh)
    roles = []
    for pp in range(mesh.pp):
        for cp in range(mesh.cp):
            for tp in range(mesh.tp):
                for index, coords in enumerate(classes):
                    d = coords[0]
                    rank = rank_of(mesh, {"pp": pp, "dp_replicate": d // mesh.dp_shard,
                                          "dp_shard": d % mesh.dp_shard, "cp": cp, "tp": tp})
                    roles.append(Role((pp, cp, tp, index), rank, len(coords), coords[:4]))
    return roles


def select_roles(roles: Sequence[Role], mesh: Mesh, max_roles: int, seed: int = 0) -> list[Role]:
    """``roles`` when there are at most ``max_roles``; else the corners (first and last pp, cp and tp
    coordinate, every dp class; the first and last stage of dp class 0 first) and a seeded sample of the
    rest, ``max_roles`` in all, in key order."""
    if len(roles) <= max_roles:
        return list(roles)

    def corner(role: Role) -> bool:
        pp, cp, tp, _ = role.key
        return pp in (0, mesh.pp - 1) and cp in (0, mesh.cp - 1) and tp in (0, mesh.tp - 1)

    # by dp class, then tp, cp and stage: a small max_roles still takes the first and the last stage (the
    # embedding's and the head's, where a pipeline's memory differs most) before the other corners
    corners = sorted((r for r in roles if corner(r)), key=lambda r: (r.key[3], r.key[2], r.key[1], r.key[0]))
    corners = corners[:max_roles]
    rest = [r for r in roles if not corner(r)]
    chosen = corners + random.Random(seed).sample(rest, min(len(rest), max_roles - len(corners)))
    return sorted(chosen, key=lambda r: r.key)


class RoleIndex:
    """Which role each rank has (``role_of``), from the dp classes of ``plan_roles``."""

    def __init__(self, graph: ModelGraph, mesh: Mesh) -> None:
        self.mesh = mesh
        self._dp_class = {d: i for i, coords in enumerate(dp_classes(graph, mesh)) for d in coords}

    def role_of(self, rank: int) -> RoleKey:
        c = coords_of(rank, self.mesh)
        d = c["dp_replicate"] * self.mesh.dp_shard + c["dp_shard"]
        return (c["pp"], c["cp"], c["tp"], self._dp_class[d])


# --------------------------------------------------------------------------- groups


def group_members(axis: str, rank: int, mesh: Mesh) -> list[int]:
    """Ranks of ``rank``'s group on ``axis`` (``MESH_ORDER`` axes, ``dp``, ``ep``, ``edp``, ``world``),
    in the order of the axis coordinate."""
    if axis == "world":
        return list(range(mesh.world_size))
    c = coords_of(rank, mesh)
    if axis in MESH_ORDER:
        return [rank_of(mesh, {**c, axis: i}) for i in range(getattr(mesh, axis))]
    d = c["dp_replicate"] * mesh.dp_shard + c["dp_shard"]
    if axis == "dp":
        coords = range(mesh.dp)
    elif axis == "ep":
        coords = range(d - d % mesh.ep, d - d % mesh.ep + mesh.ep)
    elif axis == "edp":
        coords = range(d % mesh.ep, mesh.dp, mesh.ep)
    else:
        raise ValueError(f"unknown axis {axis!r}")
    return [rank_of(mesh, {**c, "dp_replicate": e // mesh.dp_shard, "dp_shard": e % mesh.dp_shard}) for e in coords]


def _group_leaders(axis: str, mesh: Mesh) -> Iterable[int]:
    """The lowest rank of every group instance of ``axis`` (its coordinate on the axis is 0)."""
    if axis == "world":
        yield 0
        return
    for rank in range(mesh.world_size):
        c = coords_of(rank, mesh)
        d = c["dp_replicate"] * mesh.dp_shard + c["dp_shard"]
        leads = {"dp": d == 0, "ep": d % mesh.ep == 0, "edp": d < mesh.ep}.get(axis)
        if leads if leads is not None else c[axis] == 0:
            yield rank


# --------------------------------------------------------------------------- matching


def first_mismatch(records: Mapping[RoleKey, Sequence[Issued]], index: RoleIndex) -> str | None:
    """The first mismatch of [Note: matching] as one line (``rank 5: collective #12 ...``), or ``None``."""
    mesh = index.mesh
    for key, issued in sorted(records.items()):
        for i, c in enumerate(issued):
            if c.axis == "?":
                rank = min(r for r in range(mesh.world_size) if index.role_of(r) == key)
                return f"rank {rank}: collective #{i} {c.kind} on a group that serves no mesh axis"
    axes = sorted({c.axis for issued in records.values() for c in issued})
    for axis in axes:
        seen: set[tuple] = set()
        for leader in _group_leaders(axis, mesh):
            members = group_members(axis, leader, mesh)
            roles = tuple(index.role_of(r) for r in members)
            if roles in seen:
                continue
            seen.add(roles)
            found = (_collective_mismatch(axis, members, roles, records)
                     or _p2p_mismatch(axis, members, roles, records))
            if found:
                return found
    return None


def _on_axis(issued: Sequence[Issued], axis: str, p2p: bool) -> list[tuple[int, Issued]]:
    return [(i, c) for i, c in enumerate(issued) if c.axis == axis and (c.kind in ("send", "recv")) == p2p]


def _collective_mismatch(axis: str, members: list[int], roles: tuple, records: Mapping) -> str | None:
    built = [(rank, role) for rank, role in zip(members, roles) if role in records]
    if len(built) < 2:
        return None
    first_rank, first_role = built[0]
    expected = _on_axis(records[first_role], axis, p2p=False)
    for rank, role in built[1:]:
        found = _on_axis(records[role], axis, p2p=False)
        for k in range(max(len(expected), len(found))):
            want = expected[k][1] if k < len(expected) else None
            got = found[k][1] if k < len(found) else None
            if want != got:
                return _describe(rank, first_rank, axis, k, want, got, found)
    return None


def _describe(rank: int, first_rank: int, axis: str, k: int, want: Issued | None, got: Issued | None,
              found: list[tuple[int, Issued]]) -> str:
    if got is None:
        return (f"rank {rank}: collective #{k} on group {axis}: rank {first_rank} issues {want}, "
                f"rank {rank} issues nothing more ({len(found)} on {axis})")
    where = f"rank {rank}: collective #{found[k][0]} {got.kind} on group {axis}"
    if want is None:
        return f"{where}: rank {first_rank} issues nothing more on {axis}, found {got}"
    if want.kind != got.kind:
        return f"{where} expected {want.kind} (as rank {first_rank}), found {got.kind}"
    return f"{where} expected {_size(want)}, found {_size(got)} (rank {first_rank} issues {want})"


def _size(c: Issued) -> str:
    return "unsized" if c.nbytes is None else format_bytes(c.nbytes)


def _p2p_mismatch(axis: str, members: list[int], roles: tuple, records: Mapping) -> str | None:
    for coord, (rank, role) in enumerate(zip(members, roles)):
        if role not in records:
            continue
        sends = _on_axis(records[role], axis, p2p=True)
        for peer in sorted({c.peer for _, c in sends if c.kind == "send"}):
            peer_role = roles[peer] if peer < len(roles) else None
            if peer_role not in records:
                continue
            sent = [(i, c.nbytes) for i, c in sends if c.kind == "send" and c.peer == peer]
            received = [c.nbytes for _, c in _on_axis(records[peer_role], axis, p2p=True)
                        if c.kind == "recv" and c.peer == coord]
            for k, (i, nbytes) in enumerate(sent):
                if k >= len(received) or received[k] != nbytes:
                    got = "nothing" if k >= len(received) else _size(Issued("recv", axis, received[k]))
                    return (f"rank {rank}: collective #{i} send on group {axis} to rank {members[peer]}: "
                            f"sends {_size(Issued('send', axis, nbytes))}, rank {members[peer]} receives {got}")
            if len(received) > len(sent):
                return (f"rank {members[peer]}: receives {len(received)} tensors from rank {rank} on group {axis}, "
                        f"which sends {len(sent)}")
    return None


__all__ = ["Role", "RoleIndex", "dp_classes", "first_mismatch", "group_members", "plan_roles", "rank_of",
           "select_roles"]
