"""Pure-torch reference of every quantization kernel (the CPU path and the test oracle).

Per block of ``block`` elements, with ``qmax`` of the format (int8 127, fp8 448, int4 7),
all in fp32 after an exact upcast of the input:

    finite   = |x| < inf                        (false for NaN and +-Inf)
    absmax   = max over the block of |x| where finite, else 0
    bad      = any element not finite
    ok       = absmax >= TINY and not bad        TINY = 2**-112
    inv      = qmax / absmax if ok else 0        one IEEE division per block
    scale    = NaN if bad, absmax / qmax if ok, else 0
    y        = x * inv                           (non-finite x replaced by 0 first)
    q        = int8/int4: clamp(round_half_even(y), -qmax, qmax)
               fp8:       e4m3fn(clamp(y, -448, 448)), round-to-nearest-even
    dequant  = q * scale, rounded once to the output dtype

NaN/Inf policy: a block holding any NaN or +-Inf stores payload 0 and scale NaN, so it
dequantizes to all-NaN (a non-finite gradient stays visible to overflow checks) while
every other block is untouched. Blocks with absmax below TINY (all-zero blocks, padding)
store scale 0 and dequantize to exact zeros; TINY keeps ``qmax / absmax`` finite and the
scale a normal fp32 number, so no flush-to-zero difference can arise between devices.

The Triton kernels evaluate the same expressions in the same order (fp fusion off), so
they match this reference bit for bit; ``dequantize_reduce`` sums source rows in rank
order 0..world-1 in fp32.
"""

from __future__ import annotations

import torch

from autoshard.kernels.layout import QuantLayout

TINY = 2.0**-112
_FP8 = torch.float8_e4m3fn


def _blocks(x: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """Flat input -> fp32 ``(world, num_blocks, block)``, zero-padded per the layout."""
    shards_numel = layout.world * layout.shard_numel
    flat = torch.zeros(shards_numel, dtype=torch.float32, device=x.device)
    flat[: layout.numel] = x.reshape(-1).float()
    shards = flat.view(layout.world, layout.shard_numel)
    shards = torch.nn.functional.pad(shards, (0, layout.padded_numel - layout.shard_numel))
    return shards.view(layout.world, layout.num_blocks, layout.block)


def _block_scales(xb: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x with non-finite zeroed, inv, scale)`` for fp32 blocks ``(..., block)``."""
    finite = xb.abs() < float("inf")
    xs = torch.where(finite, xb, 0.0)
    absmax = xs.abs().amax(dim=-1)  # (..., )
    bad = ~finite.all(dim=-1)
    ok = (absmax >= TINY) & ~bad
    safe = torch.where(ok, absmax, 1.0)
    qmax_t = torch.full_like(safe, qmax)  # tensor/tensor: true IEEE division (a python-scalar
    inv = torch.where(ok, qmax_t / safe, 0.0)  # operand may become a reciprocal multiply)
    scale = torch.where(ok, safe / qmax_t, 0.0)
    scale = torch.where(bad, float("nan"), scale)
    return xs, inv, scale


def _encode(y: torch.Tensor, qdtype: str, qmax: float) -> torch.Tensor:
    """Scaled fp32 values ``(W, nb, B)`` -> payload bytes ``(W, payload_bytes)``."""
    w = y.shape[0]
    if qdtype == "fp8":
        return y.clamp(-qmax, qmax).to(_FP8).view(torch.uint8).reshape(w, -1)
    q = torch.round(y).clamp(-qmax, qmax).to(torch.int16)
    if qdtype == "int8":
        return q.to(torch.int8).view(torch.uint8).reshape(w, -1)
    q = q.reshape(w, -1)
    packed = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)  # element 2i low nibble, 2i+1 high
    return packed.to(torch.uint8)


def _decode(payload: torch.Tensor, qdtype: str) -> torch.Tensor:
    """Payload bytes ``(W, payload_bytes)`` -> fp32 quantized values ``(W, padded_numel)``."""
    if qdtype == "fp8":
        return payload.contiguous().view(_FP8).float()
    if qdtype == "int8":
        return payload.contiguous().view(torch.int8).float()
    b = payload.to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8  # sign-extend a 4-bit two's-complement nibble
    hi = ((b >> 4) ^ 8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(b.shape[0], -1).float()


def split_buffer(data: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload uint8 (W, payload_bytes), scales fp32 (W, num_blocks))`` views of a buffer."""
    payload = data[:, : layout.payload_bytes]
    scales = data[:, layout.payload_bytes :].view(torch.float32)
    return payload, scales


def quantize_ref(x: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """Quantize ``x`` (any shape, ``layout.numel`` elements) -> ``uint8[world, chunk_bytes]``."""
    xb = _blocks(x, layout)  # (W, nb, B)
    xs, inv, scale = _block_scales(xb, layout.fmt.qmax)
    payload = _encode(xs * inv[..., None], layout.qdtype, layout.fmt.qmax)
    out = torch.empty(layout.world, layout.chunk_bytes, dtype=torch.uint8, device=x.device)
    out[:, : layout.payload_bytes] = payload
    out[:, layout.payload_bytes :] = scale.contiguous().view(torch.uint8).reshape(layout.world, -1)
    return out


def _dequant_rows(data: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """fp32 ``(W, padded_numel)`` dequantized rows."""
    payload, scales = split_buffer(data, layout)
    q = _decode(payload, layout.qdtype).view(layout.world, layout.num_blocks, layout.block)
    return (q * scales[..., None]).view(layout.world, layout.padded_numel)


def dequantize_ref(data: torch.Tensor, layout: QuantLayout, out_dtype: torch.dtype) -> torch.Tensor:
    """``uint8[world, chunk_bytes]`` -> flat ``out_dtype[numel]`` (padding dropped)."""
    rows = _dequant_rows(data, layout)[:, : layout.shard_numel]
    return rows.reshape(-1)[: layout.numel].to(out_dtype)


def dequantize_reduce_ref(data: torch.Tensor, layout: QuantLayout, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum of the ``world`` dequantized rows (each one shard) -> ``out_dtype[shard_numel]``.

    Rows are added in order 0..world-1 in fp32, then rounded once to ``out_dtype``.
    """
    rows = _dequant_rows(data, layout)
    acc = rows[0].clone()
    for r in range(1, layout.world):
        acc = acc + rows[r]
    return acc[: layout.shard_numel].to(out_dtype)
