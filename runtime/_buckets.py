"""Gradient / parameter buckets of the ``ShardedOptimizer``: one collective per bucket, not per parameter.

A step of a data-parallel plan syncs every parameter's gradient and (ZeRO-1/2,
offload) re-gathers every updated parameter. One collective per parameter is
hundreds of small NCCL calls per step, each paying launch + latency (α) for a
few KiB..MiB of payload. Like DDP's ``Reducer``, FSDP's flat parameters and
DeepSpeed's flat partitions, the optimizer packs many tensors into one flat
buffer of about ``plan.schedule.bucket_bytes`` and issues ONE collective for it:

| bucket kind | packing (per member ``i``) | collective | unpacking |
| --- | --- | --- | --- |
| all-reduce (DDP, HSDP dp_replicate, EP edp) | ``cat(g_i.flatten())`` | all-reduce | views of the result |
| reduce-scatter (ZeRO-1/2, offload) | row ``r`` = ``cat_i(chunk r of pad(g_i))``: ``(n, Σ c_i)`` rank-major | reduce-scatter → ``(Σ c_i,)`` | this rank's chunk of each member |
| all-gather (ZeRO-1/2, offload params) | ``cat_i(own chunk_i)`` ``(Σ c_i,)`` | all-gather → ``(n, Σ c_i)`` | column block ``i`` → ``pad(p_i)`` |

The rank-major reduce-scatter layout keeps the per-parameter flat-chunk
representation of the optimizer state unchanged (parameter ``i`` flattened,
zero-padded to ``n·c_i``, chunk ``coord("dp")``): each rank owns the same
elements as with one reduce-scatter per parameter, so checkpoints, clipping
and ``local_state_dict`` do not see buckets, and the sums are element-wise the
same reductions (bit-identical with gloo; with NCCL the ring order may differ
between payload sizes, a rounding-level difference).

Bucket assignment (``assign``): members with the same key (collective kind,
group, op, dtype, device, wire dtype) are packed in order; a bucket closes when
adding the next member would exceed ``bucket_bytes`` (a member larger than the
limit gets a bucket of its own). ``bucket_bytes == 0`` disables bucketing (one
member per bucket: the per-parameter behaviour). All ranks of a group hold the
same parameters in the same order (same pipeline stage, same tp coordinate, same
expert shard), so they form the same buckets, which the collectives require.

Wire dtypes: "none" reduces in the bucket's dtype, "fp32" upcasts the packed
bucket once, reduces and rounds back once (element-wise the same as per
parameter). Quantized wires (qgZ "int8"/"int4") are not bucketed here: their
block scales are per tensor, so the optimizer keeps one qgZ per parameter.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from autoshard.kernels import async_collectives, collectives

BUCKETED_WIRES = ("none", "fp32")


def assign(keys: Sequence[Hashable | None], nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices grouped into buckets: same key, in order, each bucket ≤ ``bucket_bytes`` (module docstring).

    ``keys[i] is None`` marks an item that is not bucketed (no list returned for it).
    """
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (members, bytes so far)
    buckets: list[list[int]] = []
    for i, (key, size) in enumerate(zip(keys, nbytes, strict=True)):
        if key is None:
            continue
        members, used = open_.get(key, ([], 0))
        if members and used + size > bucket_bytes:
            buckets.append(members)
            members, used = [], 0
        open_[key] = (members + [i], used + size)
    buckets.extend(members for members, _ in open_.values() if members)
    return sorted(buckets, key=lambda b: b[0])  # deterministic, first-member order


def _reduce(x: Tensor, wire: str, fn) -> Tensor:
    """``fn`` applied in ``x.dtype`` ("none") or upcast to fp32 and rounded back once ("fp32")."""
    assert wire in BUCKETED_WIRES, wire
    return fn(x) if wire == "none" else fn(x.float()).to(x.dtype)


def _pack_rows(grads: Sequence[Tensor], chunks: Sequence[int], n: int) -> Tensor:
    """The rank-major reduce-scatter bucket (module docstring): row r = every member's padded chunk r, flat."""
    rows = [F.pad(g.reshape(-1), (0, c * n - g.numel())).view(n, c) for g, c in zip(grads, chunks, strict=True)]
    return torch.cat(rows, dim=1).reshape(-1)  # (n, Σ c_i) rank-major → (n·Σ c_i,)


def all_reduce(grads: Sequence[Tensor], group: str, wire: str, op: str) -> list[Tensor]:
    """All-reduce many tensors (same dtype, device) with ONE collective; returns tensors shaped like ``grads``."""
    flat = torch.cat([g.reshape(-1) for g in grads])  # (Σ numel_i,)
    out = _reduce(flat, wire, lambda x: collectives.all_reduce(x, group, op))
    return [piece.view_as(g) for piece, g in zip(out.split([g.numel() for g in grads]), grads, strict=True)]


def reduce_scatter(grads: Sequence[Tensor], chunks: Sequence[int], n: int, group: str, wire: str, op: str) -> list[Tensor]:
    """Reduce many tensors over the ``n``-rank group, keep this rank's flat chunk of each, with ONE collective.

    ``chunks[i]`` = c_i = ceil(numel_i / n); returns this rank's ``(c_i,)`` chunk
    of each reduced, flattened, zero-padded ``grads[i]`` (module docstring layout).
    """
    packed = _pack_rows(grads, chunks, n)
    mine = _reduce(packed, wire, lambda x: collectives.reduce_scatter(x, 0, group, op))  # (Σ c_i,)
    return list(mine.split(list(chunks)))


def start(kind: str, grads: Sequence[Tensor], group: str, wire: str, op: str, chunks: Sequence[int] = (),
          n: int = 1) -> tuple:
    """``all_reduce`` / ``reduce_scatter`` (``kind``) of a bucket, launched and not waited: a handle for
    ``finish``. The packing, wire cast and collective are those of the blocking functions above, so
    the values are the same; the collective runs on ``async_collectives``' reduce-scatter side stream
    (CUDA) or gloo's worker thread."""
    if kind == "all_reduce":
        packed, sizes = torch.cat([g.reshape(-1) for g in grads]), [g.numel() for g in grads]
        launch = async_collectives.all_reduce_start
    else:
        packed, sizes = _pack_rows(grads, chunks, n), list(chunks)
        launch = async_collectives.reduce_scatter_start
    assert wire in BUCKETED_WIRES, wire
    wired = packed if wire == "none" else packed.float()
    return kind, launch(wired, group, op), sizes, [g.shape for g in grads], packed.dtype


def finish(handle: tuple) -> list[Tensor]:
    """Wait for a ``start``ed bucket; the reduced tensors shaped like the blocking function's result."""
    kind, pending, sizes, shapes, dtype = handle
    out = async_collectives.finish(pending).to(dtype)
    pieces = out.split(sizes)
    if kind == "all_reduce":
        return [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]
    return list(pieces)


def all_gather(chunks: Sequence[Tensor], n: int, group: str) -> list[Tensor]:
    """All-gather many flat chunks (same dtype, device) with ONE collective.

    Returns, per member, the ``(n·c_i,)`` concatenation of every rank's chunk
    ``i`` (the padded flat tensor; the caller trims the padding).
    """
    sizes = [c.numel() for c in chunks]
    full = collectives.all_gather(torch.cat(list(chunks)), 0, group).view(n, sum(sizes))  # (n, Σ c_i)
    return [block.reshape(-1) for block in full.split(sizes, dim=1)]


def all_gather_begin(chunks: Sequence[Tensor], n: int, group: str) -> tuple:
    """``all_gather`` launched and not waited (``async_collectives.all_gather_start``: a side stream
    on CUDA, ``async_op=True`` on gloo); ``all_gather_end`` completes it with the same result."""
    sizes = [c.numel() for c in chunks]
    return async_collectives.all_gather_start(torch.cat(list(chunks)), group), n, sizes


def all_gather_end(handle: tuple) -> list[Tensor]:
    """The result of an ``all_gather_begin``: per member the ``(n·c_i,)`` concatenation, as ``all_gather``."""
    pending, n, sizes = handle
    return [piece.reshape(-1) for piece in async_collectives.all_gather_wait(pending, n, sizes)]


__all__ = ["BUCKETED_WIRES", "all_gather", "all_gather_begin", "all_gather_end", "all_reduce", "assign", "finish", "reduce_scatter", "start"]
