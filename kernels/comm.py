"""Quantized collectives (ZeRO++: qwZ, qgZ, hpZ) over ``torch.distributed``.

Each collective moves one ``uint8[world, chunk_bytes]`` buffer whose rows hold payload and
scales together (layout.py), so data and scales travel in ONE collective; gloo (which has
no float8 dtype) and NCCL see only bytes.

- ``quantized_all_gather`` (qwZ): quantize the local shard -> ``all_gather_into_tensor`` of
  rows -> dequantize, cast fused. Bytes on the wire per rank: ``world * chunk_bytes``, i.e.
  ``(1 + 4/block) / 2`` of a bf16 gather for int8/fp8.
- ``quantized_reduce_scatter`` (qgZ): quantize the full gradient into ``world`` rank rows ->
  ``all_to_all_single`` (row r goes to rank r) -> dequantize + reduce (sum over source ranks
  in fp32, one rounding). Each source's contribution carries its own quantization error
  (bounded per block, reference.py), so the sum's error is at most the sum of those.
  ZeRO++ runs this all-to-all hierarchically (intra-node first, then inter-node, with a
  re-quantization between); here it is one flat all-to-all: same numerics class, not the
  cross-node volume reduction (partial: the two-hop variant is not implemented).
- hpZ: after the forward all-gather over all ranks, each rank keeps a secondary shard of
  the full parameter over its NODE's ranks (``hpz_secondary_shard``), so the backward
  re-gather (``hpz_backward_gather``) is an all-gather inside the node only. The secondary
  shard is a copy of what the forward produced (dequantized when the forward used qwZ),
  so backward sees bit-identical parameters.

Ranks are node-major: node ``n`` holds global ranks ``[n*L, (n+1)*L)`` for ``L`` ranks per
node (torchrun's assignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoshard.kernels.layout import QuantizationError, QuantLayout
from autoshard.kernels.ops import DEFAULT_BLOCK, QuantizedTensor, dequantize, dequantize_reduce, quantize


def _all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch 2.13 renames all_gather_into_tensor to all_gather_single; torch 2.11 has only the old name
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _check_shard(x: torch.Tensor, role: str) -> None:
    if x.dim() == 0:
        raise QuantizationError(f"{role} must have at least one dimension, got a 0-d tensor; reshape it to (1,).")


def quantized_all_gather(
    x_shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dtype: str = "int8",
    block: int = DEFAULT_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """qwZ: all-gather equal shards along dim 0, moved quantized; returns the full tensor.

    ``x_shard`` (shape ``(s0, *rest)``, the same on every rank) -> ``(world * s0, *rest)`` in
    ``out_dtype`` (default ``x_shard.dtype``), like ``all_gather_into_tensor`` but each
    element moves as ``dtype`` (``int8``, ``fp8`` or ``int4``) with per-block scales.
    """
    _check_shard(x_shard, "quantized_all_gather input")
    world = dist.get_world_size(group)
    local = quantize(x_shard, dtype, block, world=1)  # (1, chunk_bytes)
    gathered = torch.empty((world, local.layout.chunk_bytes), dtype=torch.uint8, device=x_shard.device)
    _all_gather_rows(gathered, local.data, group)
    full = QuantizedTensor(
        data=gathered,
        layout=QuantLayout(dtype, block, world * x_shard.numel(), world),
        shape=(world * x_shard.shape[0], *x_shard.shape[1:]),
        dtype=x_shard.dtype,
    )
    return dequantize(full, out_dtype)


def quantized_reduce_scatter(
    grad: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dtype: str = "int8",
    block: int = DEFAULT_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """qgZ: sum ``grad`` over ranks and keep this rank's flat shard, moved quantized.

    Returns ``out_dtype[ceil(numel / world)]`` (default ``grad.dtype``): elements
    ``[r*S, (r+1)*S)`` of the rank-summed flattened gradient, zeros past ``numel`` (the
    result of ``reduce_scatter_tensor`` on ``grad.flatten()`` zero-padded to ``world*S``).
    """
    world = dist.get_world_size(group)
    q = quantize(grad, dtype, block, world=world)  # (world, chunk_bytes): row r for rank r
    received = torch.empty_like(q.data)  # row s: source rank s's copy of this rank's shard
    dist.all_to_all_single(received, q.data, group=group)
    rows = QuantizedTensor(received, q.layout, q.shape, q.dtype)
    return dequantize_reduce(rows, out_dtype)


@dataclass(frozen=True)
class HpzGroups:
    """Process groups for hpZ: all ranks, and this rank's node (``ranks_per_node`` ranks)."""

    world: dist.ProcessGroup
    intra: dist.ProcessGroup
    ranks_per_node: int

    @property
    def local_rank(self) -> int:
        return dist.get_rank(self.world) % self.ranks_per_node


def hpz_groups(ranks_per_node: int, group: dist.ProcessGroup | None = None) -> HpzGroups:
    """Build the per-node groups of ``group`` (default WORLD). Collective: every rank calls it."""
    world_group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(world_group)
    if ranks_per_node < 1 or len(ranks) % ranks_per_node:
        raise QuantizationError(
            f"ranks_per_node={ranks_per_node} does not divide the group's {len(ranks)} ranks; "
            "pass the number of GPUs per node (a divisor of the world size)."
        )
    mine = None
    for start in range(0, len(ranks), ranks_per_node):  # every rank creates every node group
        node = dist.new_group(ranks[start : start + ranks_per_node])
        if dist.get_rank() in ranks[start : start + ranks_per_node]:
            mine = node
    return HpzGroups(world=world_group, intra=mine, ranks_per_node=ranks_per_node)


def hpz_secondary_shard(full: torch.Tensor, groups: HpzGroups) -> torch.Tensor:
    """This rank's intra-node slice of ``full``: flat ``[l*S2, (l+1)*S2)``, ``S2 = ceil(numel/L)``.

    A fresh tensor (zero-padded past ``numel``), so ``full`` can be freed after forward.
    """
    size = -(-full.numel() // groups.ranks_per_node)
    start = groups.local_rank * size
    out = torch.zeros(size, dtype=full.dtype, device=full.device)
    piece = full.reshape(-1)[start : start + size]
    out[: piece.numel()] = piece
    return out


def hpz_forward_gather(
    primary_shard: torch.Tensor,
    groups: HpzGroups,
    dtype: str | None = None,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: gather the primary shard over ALL ranks, keep a secondary intra-node shard.

    ``dtype`` None gathers unquantized; ``int8``/``fp8``/``int4`` uses qwZ. Returns
    ``(full, secondary_shard)``.
    """
    _check_shard(primary_shard, "hpz_forward_gather input")
    if dtype is None:
        world = dist.get_world_size(groups.world)
        full = primary_shard.new_empty((world * primary_shard.shape[0], *primary_shard.shape[1:]))
        _all_gather_rows(full, primary_shard.contiguous(), groups.world)
    else:
        full = quantized_all_gather(primary_shard, groups.world, dtype, block)
    return full, hpz_secondary_shard(full, groups)


def hpz_backward_gather(secondary: torch.Tensor, groups: HpzGroups, shape: tuple[int, ...]) -> torch.Tensor:
    """Backward: rebuild the full tensor of ``shape`` from secondary shards, inside the node only."""
    gathered = secondary.new_empty(groups.ranks_per_node * secondary.numel())
    _all_gather_rows(gathered, secondary.contiguous(), groups.intra)
    numel = 1
    for d in shape:
        numel *= d
    return gathered[:numel].view(shape)
