"""Collective communication times (α-β model) and the rank layout they assume.

Units: bytes, seconds, bytes/s. ``α`` is a link level's per-message latency
(``LinkSpec.latency``), ``β`` its bandwidth per device per direction
(``LinkSpec.bandwidth``: what one step of a ring moves per link).

Formulas (``n`` = bytes of the FULL tensor, ``g`` = group size; ``g = 1`` costs 0):

    all_gather(n, g)     = (g − 1) · (α + (n/g)/β)      n = gathered output bytes
    reduce_scatter(n, g) = (g − 1) · (α + (n/g)/β)      n = unreduced input bytes
    all_reduce(n, g)     = 2 · (g − 1) · (α + (n/g)/β)  ring = reduce-scatter + all-gather
    all_to_all(n, g)     = (g − 1) · (α + (n/g)/β)      n = bytes one rank sends in all
    send_recv(n)         = α + n/β

These are the ring (bandwidth-optimal) forms NCCL uses for large messages; a
tree or NVLS algorithm is faster for small messages and is left to
calibration (``autoshard cluster calibrate`` fits α and β per level).

Rank layout (the runtime builds its process groups the same way). Mesh axes
are ordered outermost → innermost::

    pp, dp_replicate, dp_shard, cp, tp

so ``rank = ((((pp_i·R + rep_i)·S + shard_i)·C + cp_i)·T + tp_i)``. An axis's
*stride* is the product of the degrees of the axes inside it: tp has stride 1
(contiguous ranks: inside one node when ``tp ≤ devices_per_node``), cp has
stride ``tp``, dp_shard ``cp·tp``, dp_replicate ``dp_shard·cp·tp``, pp
``dp·cp·tp``. Composite groups:

* data-parallel gradient group: dp_shard·cp ranks inside dp_replicate, i.e. the
  ``dp·cp`` ranks of stride ``tp`` (context-parallel ranks hold the same
  parameters, so they reduce gradients together, as torchtitan's
  ``dp_shard_cp``);
* ep group: carved from the dp ranks, innermost first: ``ep`` consecutive
  dp_shard indices, stride ``cp·tp``; the expert-data-parallel group (ranks
  holding the same experts) has size ``dp/ep``, stride ``ep·tp`` when
  ``cp = 1``; with ``cp > 1`` it is not one strided group and is priced as
  ``dp·cp/ep`` ranks of stride ``tp`` (an approximation).

A group of size ``g`` and stride ``r`` holds ranks ``{base + o + k·r}``; it
*spans nodes* when two of its members lie on different nodes
(``rank // devices_per_node`` differs; ``Cluster.group_spans_nodes``). For power-of-two layouts that is
``g·r > devices_per_node`` when ``r < devices_per_node``, and ``g > 1`` when
``r ≥ devices_per_node``. A spanning group pays the inter-node (α, β) on every
ring step (the slowest link bounds a ring). Hierarchical collectives (HSDP:
reduce-scatter inside dp_shard, then all-reduce across dp_replicate) are priced
level by level by the caller, one call per level.
"""

from __future__ import annotations

from autoshard.cluster import Cluster, LinkSpec
from autoshard.plan import Mesh

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def axis_stride(mesh: Mesh, axis: str) -> int:
    """Rank distance between neighbours along ``axis`` (product of the inner axes' degrees)."""
    if axis not in MESH_ORDER:
        raise ValueError(f"axis {axis!r} has no place in the rank layout {MESH_ORDER}")
    stride = 1
    for inner in reversed(MESH_ORDER):
        if inner == axis:
            return stride
        stride *= getattr(mesh, inner)
    raise AssertionError("unreachable")


def group_spans_nodes(cluster: Cluster, size: int, stride: int) -> bool:
    """Whether some group of ``size`` ranks at ``stride`` has members on two nodes (``Cluster.group_spans_nodes``)."""
    return cluster.group_spans_nodes(size, stride)


_LINK_CACHE: dict[tuple[int, int, int], tuple[Cluster, LinkSpec]] = {}
_LINK_CACHE_SIZE = 4096


def group_link(cluster: Cluster, size: int, stride: int) -> LinkSpec:
    """The link level a group's collectives pay: inter-node if it spans nodes, else intra-node.

    Memoised per cluster object (the search asks the same few groups thousands of times); the
    entry keeps the cluster alive, so an id is never reused while its entry exists.
    """
    key = (id(cluster), size, stride)
    hit = _LINK_CACHE.get(key)
    if hit is not None and hit[0] is cluster:
        return hit[1]
    if len(_LINK_CACHE) >= _LINK_CACHE_SIZE:
        _LINK_CACHE.clear()
    link = cluster.link_for(size, stride)
    _LINK_CACHE[key] = (cluster, link)
    return link


def _ring_steps(nbytes: float, size: int, link: LinkSpec) -> float:
    """(g − 1) · (α + (n/g)/β): one pass around a ring."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    return (size - 1) * (link.latency + (nbytes / size) / link.bandwidth)


def all_gather_time(nbytes: float, size: int, link: LinkSpec) -> float:
    """Ring all-gather producing ``nbytes`` on every rank of ``size``."""
    return _ring_steps(nbytes, size, link)


def reduce_scatter_time(nbytes: float, size: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of an ``nbytes`` input (each rank keeps ``nbytes/size``)."""
    return _ring_steps(nbytes, size, link)


def all_reduce_time(nbytes: float, size: int, link: LinkSpec) -> float:
    """Ring all-reduce of ``nbytes``: reduce-scatter then all-gather."""
    return 2.0 * _ring_steps(nbytes, size, link)


def all_to_all_time(nbytes: float, size: int, link: LinkSpec) -> float:
    """All-to-all where each rank sends ``nbytes`` in all (``nbytes/size`` to each peer)."""
    return _ring_steps(nbytes, size, link)


def send_recv_time(nbytes: float, link: LinkSpec) -> float:
    """Point-to-point transfer of ``nbytes`` (pipeline stage boundary)."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth


# ---- named groups of the layout ------------------------------------------------------------


def tp_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the tensor-parallel group."""
    return mesh.tp, 1


def cp_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the context-parallel group."""
    return mesh.cp, axis_stride(mesh, "cp")


def dp_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the full gradient-reduction group: dp_replicate·dp_shard·cp ranks."""
    return mesh.dp * mesh.cp, mesh.tp


def dp_shard_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the HSDP shard group: dp_shard·cp ranks inside one replica."""
    return mesh.dp_shard * mesh.cp, mesh.tp


def dp_replicate_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the HSDP replica group."""
    return mesh.dp_replicate, axis_stride(mesh, "dp_replicate")


def ep_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the expert-parallel group (innermost dp ranks)."""
    return mesh.ep, mesh.cp * mesh.tp


def expert_dp_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the ranks holding the same experts (exact for cp = 1; module docstring)."""
    if mesh.cp == 1:
        return mesh.dp // mesh.ep, mesh.ep * mesh.tp
    return mesh.dp * mesh.cp // mesh.ep, mesh.tp


def pp_group(mesh: Mesh) -> tuple[int, int]:
    """(size, stride) of the pipeline group."""
    return mesh.pp, axis_stride(mesh, "pp")
