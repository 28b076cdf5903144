"""Quantized collectives (ZeRO++ qwZ / qgZ) as differentiable ``autoshard::`` custom ops.

The byte-level collectives live in ``autoshard.kernels.comm`` (plain functions on
detached tensors). This module wraps them as ``torch.library`` custom ops with
fake kernels and autograd formulas, so the per-rank graphs the ``quantize_comm``
pass rewrites stay traceable and exportable, and so every collective of a
program is an ``autoshard::`` op that tests can count.

Vocabulary (op level; the pass maps the plan's values onto it):

* ``qdtype`` ∈ ``QDTYPES`` = ("none", "int8", "fp8", "int4"): how a parameter
  gather moves its payload; "none" = unquantized, in the tensor's own dtype
  (what the plan calls ``weight_comm="bf16"``: the compute dtype).
* ``grad_comm`` ∈ ``GRAD_COMMS`` = ("none", "fp32", "int8", "int4"): how a
  gradient reduction moves it; "none" = the gradient's own dtype (the plan's
  ``"bf16"``), "fp32" = upcast, reduce in fp32, round once back.

| op | forward | backward |
| --- | --- | --- |
| ``quantized_all_gather(x, g, qdtype, grad_comm, block, grad_op)`` | dim-0 shards ``(s0, *rest)`` → ``(n·s0, *rest)`` in ``x.dtype``; qwZ when ``qdtype`` is quantized: quantize the local shard, ONE all-gather of ``uint8[n, chunk_bytes]`` rows (payload + scales together), dequantize fused with the cast to ``x.dtype`` | ``reduce_scatter_grad(grad, g, grad_comm, block, grad_op)``: full precision unless ``grad_comm`` quantizes (qwZ quantizes weights only) |
| ``quantized_reduce_scatter(x, g, qdtype, block, op)`` | qgZ: ``(n·c, *rest)`` → ``(c, *rest)``: quantize into ``n`` rank rows, ONE ``all_to_all`` of ``uint8`` rows, dequantize-and-sum the ``n`` received rows in fp32 (one rounding), ÷ n for ``avg`` | all-gather of the gradient (÷ n for ``avg``) |

``reduce_scatter_grad`` and ``all_reduce_grad`` are the dispatchers the ZeRO-3
gather backward and the optimizer call with a ``grad_comm`` value. A quantized
all-reduce is a qgZ reduce-scatter followed by a quantized all-gather of the
reduced chunk (ZeRO++'s form for the inter-node hop), so every rank decodes the
same bytes and replicas stay bit-identical.

Block size (``block_for``): the power of two in [64, DEFAULT_BLOCK=512]
elements per fp32 scale that moves the fewest bytes for the shard (padding to
whole blocks + 4 bytes of scale per block), so a tiny shard (a norm's 64
elements) is not padded to 512, which would move more bytes than bf16, and an
8320-element shard uses 256 (8580 bytes int8) rather than 512 (8772). Errors per element: int8
``absmax/254``, fp8 ``2^-4·|x|``, int4 ``absmax/14`` per block (docs/kernels.md);
a qgZ sum of ``n`` sources adds up to ``n`` such errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard.errors import AutoshardError
from autoshard.kernels import DEFAULT_BLOCK, QFORMATS
from autoshard.kernels.layout import SCALE_BYTES
from autoshard.kernels.comm import quantized_all_gather as _qwz_gather
from autoshard.kernels.comm import quantized_reduce_scatter as _qgz_scatter
from autoshard.kernels import collectives

try:
    from torch.distributed.distributed_c10d import _resolve_process_group
except ImportError:  # pragma: no cover - older layouts keep it only in the C module
    from torch._C._distributed_c10d import _resolve_process_group

QDTYPES = ("none", "int8", "fp8", "int4")
GRAD_COMMS = ("none", "fp32", "int8", "int4")
_GRAD_OPS = ("sum", "avg")
MIN_BLOCK = 64


class QuantizedCommError(AutoshardError):
    """A quantized collective was asked for a dtype, gradient mode or reduction it does not support."""


def block_for(shard_numel: int, qdtype: str) -> int:
    """Elements per scale for a ``shard_numel`` shard moved as ``qdtype``: the fewest wire bytes (module docstring).

    Over the powers of two in [64, DEFAULT_BLOCK], minimise
    ``ceil(S/b)·b·bits/8 + 4·ceil(S/b)`` (padding to whole blocks + one fp32
    scale per block); ties go to the larger block (fewer scales to compute).
    """
    bits = QFORMATS[qdtype].bits
    best, best_bytes = MIN_BLOCK, None
    block = MIN_BLOCK
    while block <= DEFAULT_BLOCK:
        blocks = -(-shard_numel // block)
        nbytes = blocks * block * bits // 8 + SCALE_BYTES * blocks
        if best_bytes is None or nbytes <= best_bytes:
            best, best_bytes = block, nbytes
        block *= 2
    return best


def _check(value: str, allowed: tuple[str, ...], role: str) -> None:
    if value not in allowed:
        raise QuantizedCommError(f"{role}={value!r} is not supported; allowed: {allowed}. Pick one of those.")


def _pg(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


def _gather_rows(x: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Unquantized dim-0 all-gather: (s0, *rest) → (n·s0, *rest)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = x.new_empty((pg.size() * x.shape[0], *x.shape[1:]))
    gather(out, x.contiguous(), group=pg)
    return out


# --------------------------------------------------------------------------- quantized_all_gather


@torch.library.custom_op("autoshard::quantized_all_gather", mutates_args=())
def _quantized_all_gather_op(x: Tensor, group_name: str, qdtype: str, grad_comm: str, block: int, grad_op: str) -> Tensor:
    _check(qdtype, QDTYPES, "qdtype")
    pg = _pg(group_name)
    if qdtype == "none" or x.numel() == 0:
        return _gather_rows(x, pg)
    return _qwz_gather(x.contiguous(), pg, qdtype, block, x.dtype)


@_quantized_all_gather_op.register_fake
def _(x, group_name, qdtype, grad_comm, block, grad_op):
    _check(qdtype, QDTYPES, "qdtype")
    return x.new_empty((_pg(group_name).size() * x.shape[0], *x.shape[1:]))


def _qag_setup(ctx, inputs, output):
    _x, ctx.group_name, _qdtype, ctx.grad_comm, _block, ctx.grad_op = inputs


def _qag_backward(ctx, grad):
    # the gradient's own block size (block_for over its shard and grad_comm's format)
    return reduce_scatter_grad(grad, ctx.group_name, ctx.grad_comm, None, ctx.grad_op), None, None, None, None, None


torch.library.register_autograd("autoshard::quantized_all_gather", _qag_backward, setup_context=_qag_setup)


# --------------------------------------------------------------------------- quantized_reduce_scatter


@torch.library.custom_op("autoshard::quantized_reduce_scatter", mutates_args=())
def _quantized_reduce_scatter_op(x: Tensor, group_name: str, qdtype: str, block: int, op: str) -> Tensor:
    _check(qdtype, QDTYPES[1:], "qdtype")
    _check(op, _GRAD_OPS, "op")
    pg = _pg(group_name)
    n = pg.size()
    chunk = (x.shape[0] // n, *x.shape[1:])  # (c, *rest)
    if x.numel() == 0:
        return x.new_zeros(chunk)
    flat = _qgz_scatter(x.contiguous(), pg, qdtype, block, torch.float32)  # (c·|rest|,) fp32 sum
    if op == "avg":
        flat = flat / n
    return flat.to(x.dtype).view(chunk)


@_quantized_reduce_scatter_op.register_fake
def _(x, group_name, qdtype, block, op):
    _check(qdtype, QDTYPES[1:], "qdtype")
    return x.new_empty((x.shape[0] // _pg(group_name).size(), *x.shape[1:]))


def _qrs_setup(ctx, inputs, output):
    _x, ctx.group_name, _qdtype, _block, ctx.op = inputs


def _qrs_backward(ctx, grad):
    full = torch.ops.autoshard.all_gather(grad, 0, ctx.group_name, "sum")
    if ctx.op == "avg":
        full = full / _pg(ctx.group_name).size()
    return full, None, None, None, None


torch.library.register_autograd("autoshard::quantized_reduce_scatter", _qrs_backward, setup_context=_qrs_setup)


# --------------------------------------------------------------------------- dispatchers


def quantized_all_gather(x: Tensor, group_name: str, qdtype: str, grad_comm: str = "none",
                         block: int | None = None, grad_op: str = "avg") -> Tensor:
    """Dim-0 all-gather ``(s0, *rest)`` → ``(n·s0, *rest)`` moved as ``qdtype`` (module table).

    Backward: ``reduce_scatter_grad(grad, group_name, grad_comm, op=grad_op)`` (its own block size).
    ``block`` defaults to ``block_for(x.numel(), qdtype)``.
    """
    _check(grad_comm, GRAD_COMMS, "grad_comm")
    _check(grad_op, _GRAD_OPS, "grad_op")
    if block is None:
        block = block_for(x.numel(), qdtype) if qdtype != "none" else DEFAULT_BLOCK  # (unused when "none")
    return torch.ops.autoshard.quantized_all_gather(x, group_name, qdtype, grad_comm, block, grad_op)


def reduce_scatter_grad(grad: Tensor, group_name: str, grad_comm: str, block: int | None = None, op: str = "avg") -> Tensor:
    """Reduce ``grad`` ``(n·c, *rest)`` over the group, keep this rank's ``(c, *rest)``, moved per ``grad_comm``.

    "none": ``autoshard::reduce_scatter`` in ``grad.dtype``; "fp32": the same on
    ``grad.float()``, rounded back once; "int8"/"int4": qgZ. Output dtype = ``grad.dtype``.
    """
    _check(grad_comm, GRAD_COMMS, "grad_comm")
    if grad_comm == "none":
        return collectives.reduce_scatter(grad, 0, group_name, op)
    if grad_comm == "fp32":
        return collectives.reduce_scatter(grad.float(), 0, group_name, op).to(grad.dtype)
    block = block_for(grad.numel() // _pg(group_name).size(), grad_comm) if block is None else block
    return torch.ops.autoshard.quantized_reduce_scatter(grad, group_name, grad_comm, block, op)


def all_reduce_grad(grad: Tensor, group_name: str, grad_comm: str, op: str = "avg") -> Tensor:
    """All-reduce ``grad`` (any shape) over the group, moved per ``grad_comm``; output dtype = ``grad.dtype``.

    Quantized: flatten, zero-pad to a multiple of n, qgZ reduce-scatter, then a
    quantized all-gather of the reduced chunk in the same dtype (module docstring).
    """
    _check(grad_comm, GRAD_COMMS, "grad_comm")
    if grad_comm == "none":
        return collectives.all_reduce(grad, group_name, op)
    if grad_comm == "fp32":
        return collectives.all_reduce(grad.float(), group_name, op).to(grad.dtype)
    n = _pg(group_name).size()
    chunk = -(-grad.numel() // n)
    flat = torch.nn.functional.pad(grad.reshape(-1), (0, chunk * n - grad.numel()))  # (n·chunk,)
    block = block_for(chunk, grad_comm)
    mine = torch.ops.autoshard.quantized_reduce_scatter(flat, group_name, grad_comm, block, op)  # (chunk,)
    full = torch.ops.autoshard.quantized_all_gather(mine, group_name, grad_comm, "none", block, "sum")
    return full[: grad.numel()].view_as(grad)


__all__ = [
    "GRAD_COMMS",
    "QDTYPES",
    "QuantizedCommError",
    "all_reduce_grad",
    "block_for",
    "quantized_all_gather",
    "reduce_scatter_grad",
]
