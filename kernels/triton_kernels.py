"""Triton quantize / dequantize / dequantize-reduce kernels and their typed launchers.

Importing this module imports triton; ``autoshard.kernels.ops`` imports it lazily and
falls back to the pure-torch reference when triton is missing.

Work split: a 2-D grid ``(programs per rank, world)``; a program owns ``BLOCKS_PER_PROG``
consecutive quantization blocks of one rank shard as a ``(BLOCKS_PER_PROG, BLOCK)`` tile,
so each program reads its input once (contiguous, vectorisable), computes the block
absmax in registers, and writes payload and scales once: bytes moved are the minimum,
``numel * (in_bytes + bits/8) + 4 * num_blocks``. Large tiles also matter for the
interpreter, whose cost is per program (PLATFORM_NOTES "Triton").

Two kernel families, chosen per (kernel, format) by ``CUDA_CONFIGS`` / ``KernelConfig``:
``tile`` kernels hold ``(BLOCKS_PER_PROG, BLOCK)`` element tiles; ``pairs`` kernels move
elements ``2j, 2j+1`` as one word (input int32/int64 words, int16 or byte payload words,
packed output words), so int4 nibble pairing is register arithmetic instead of a
shared-memory shuffle (int4 quantize 0.73x -> 0.97x copy bandwidth on an H100).

Arithmetic is exactly that of ``reference.py`` (same operations, same order):
``tl.div_rn`` for the two per-block divisions, multiplication elsewhere, round-half-even
through the ``1.5 * 2**23`` add-subtract (exact for ``|y| < 2**22``; here ``|y| <= 448``),
and launchers pass ``enable_fp_fusion=False`` so no multiply-add is contracted into an
FMA (which would round once where the reference rounds twice).

Offsets: per-program bases are int64 (tensors above 2**31 bytes); in-tile offsets int32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from autoshard.kernels.layout import QuantLayout

_KIND = {"int8": 0, "fp8": 1, "int4": 2}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TINY = tl.constexpr(2.0**-112)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23


@triton.jit
def _round_half_even(y):
    # exact round-half-even for |y| < 2**22 (no libdevice rint under the interpreter)
    return (y + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _fp8e4m3_bits(y):
    """fp32 ``y`` (finite, |y| <= 448) -> e4m3fn bits as uint8, round-half-even, integer ops only.

    The interpreter's fp32->fp8 cast drops the carry when rounding crosses a binade
    (124.3 -> 64), so the CPU path encodes by hand: round ``y`` to a multiple of the
    e4m3 spacing of its binade (binades below 2**-6 share 2**-9, the subnormal step),
    then read exponent and top 3 mantissa bits off the exact rounded fp32 value.
    """
    b = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((b >> 23) & 0xFF) - 127, -6)
    inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
    step = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    v = _round_half_even(y * inv_step) * step  # exact: power-of-two scalings
    vb = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80  # from y: the add-subtract rounding turns -0.0 into +0.0
    ve = ((vb >> 23) & 0xFF) - 127
    normal_bits = ((ve + 7) << 3) | ((vb >> 20) & 7)
    subnormal_bits = (tl.abs(v) * 512.0).to(tl.int32)  # v = k * 2**-9, k in 0..7
    return (sign | tl.where(ve >= -6, normal_bits, subnormal_bits)).to(tl.uint8)


@triton.jit
def _round_bf16(v):
    """fp32 -> the (fp32) value of its round-half-even bf16, by integer ops; NaN kept."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
    return tl.where(v != v, v, r.to(tl.float32, bitcast=True))


@triton.jit
def _round_fp16(v):
    """fp32 -> the (fp32) value of its round-half-even fp16 (subnormals, overflow to inf); NaN kept."""
    b = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((b >> 23) & 0xFF) - 127, -14)  # fp16 subnormals share the 2**-24 step
    inv_step = ((137 - e) << 23).to(tl.float32, bitcast=True)  # 2**(10 - e)
    step = ((117 + e) << 23).to(tl.float32, bitcast=True)  # 2**(e - 10)
    r = _round_half_even(v * inv_step) * step
    r = tl.where(tl.abs(v) >= 65520.0, tl.where(v > 0, float("inf"), float("-inf")), r)  # round-to-inf midpoint
    return tl.where(v != v, v, r)


@triton.jit
def _cast_out(v, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 -> output dtype (0 fp32, 1 bf16, 2 fp16), round-half-even.

    The interpreter's fp32->bf16/fp16 cast truncates, so off-GPU the value is first
    rounded exactly to the target grid (then the truncating cast is lossless).
    """
    if OUT_KIND == 1:
        if not HW_CAST:
            v = _round_bf16(v)
        v = v.to(tl.bfloat16)
    elif OUT_KIND == 2:
        if not HW_CAST:
            v = _round_fp16(v)
        v = v.to(tl.float16)
    return v


@triton.jit
def _encode(y, QMAX: tl.constexpr, KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 scaled values -> uint8 codes of the same shape: int8 (KIND 0) or fp8 e4m3 (KIND 1)."""
    if KIND == 1:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if HW_CAST:
            out = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            out = _fp8e4m3_bits(y)
    else:
        q = tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX).to(tl.int32)
        out = q.to(tl.int8).to(tl.uint8, bitcast=True)
    return out  # one return: the compiler types every return statement


@triton.jit
def _decode(p_ptrs, mask, KIND: tl.constexpr, BPP: tl.constexpr, BLOCK: tl.constexpr):
    """Load a payload tile and return fp32 quantized values (BPP, BLOCK)."""
    b = tl.load(p_ptrs, mask=mask, other=0)
    if KIND == 0:
        q = b.to(tl.int8, bitcast=True).to(tl.float32)
    elif KIND == 1:
        q = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b = b.to(tl.int32)
        lo = ((b & 0xF) ^ 8) - 8  # sign-extend 4-bit two's complement
        hi = ((b >> 4) ^ 8) - 8
        q = tl.reshape(tl.join(lo, hi), (BPP, BLOCK)).to(tl.float32)
    return q


@triton.jit
def _zero_nonfinite(x):
    """(x with NaN/Inf replaced by 0, finite mask) for an fp32 tile."""
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, x, 0.0), finite


@triton.jit
def _block_scales(absmax, bad, QMAX: tl.constexpr):
    """Per-block ``(inv, scale)`` from absmax and the non-finite flag (reference._block_scales)."""
    ok = (absmax >= _TINY) & (~bad)
    safe = tl.where(ok, absmax, 1.0)
    inv = tl.where(ok, tl.div_rn(tl.zeros_like(safe) + QMAX, safe), 0.0)
    scale = tl.where(ok, tl.div_rn(safe, tl.zeros_like(safe) + QMAX), 0.0)
    return inv, tl.where(bad, float("nan"), scale)


@triton.jit
def _quantize_kernel(
    x_ptr, out_ptr, scale_ptr,  # out_ptr: uint8 buffer; scale_ptr: the same buffer viewed as fp32
    numel, shard_numel, num_blocks, chunk_bytes, payload_bytes,
    QMAX: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    blk = pid * BPP + tl.arange(0, BPP)  # (BPP,) block index within the shard
    block_ok = blk < num_blocks
    src = x_ptr + rank * shard_numel
    limit = tl.minimum(shard_numel, numel - rank * shard_numel)  # valid elements of this shard
    row = out_ptr + rank * chunk_bytes
    within = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # (BPP, BLOCK)
    x, finite = _zero_nonfinite(tl.load(src + within, mask=within < limit, other=0.0).to(tl.float32))
    absmax = tl.max(tl.abs(x), axis=1)  # (BPP,)
    bad = tl.min(finite.to(tl.int32), axis=1) == 0
    inv, scale = _block_scales(absmax, bad, QMAX)
    if KIND == 2:
        # int4: pair even/odd codes with a reshape + split (a layout shuffle: ~0.6x copy on H200,
        # 0.73x on H100; two strided tiles measured 0.25x; the pairs kernel avoids both)
        q = _encode(x * inv[:, None], QMAX, 0, HW_CAST).to(tl.int8, bitcast=True).to(tl.int32)
        lo, hi = tl.split(tl.reshape(q, (BPP, BLOCK // 2, 2)))  # (BPP, BLOCK // 2) each
        half = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(row + half, ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8), mask=block_ok[:, None])
    else:
        tl.store(row + within, _encode(x * inv[:, None], QMAX, KIND, HW_CAST), mask=block_ok[:, None])
    scale_row = scale_ptr + (rank * chunk_bytes + payload_bytes) // 4
    tl.store(scale_row + blk, scale, mask=block_ok)


@triton.jit
def _load_dequant(row_ptr, scale_row_ptr, blk, within, block_ok,
                  KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr):
    """fp32 (BPP, BLOCK) dequantized values of blocks ``blk`` of one row (payload, scales)."""
    if KIND == 2:
        half = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        q = _decode(row_ptr + half, block_ok[:, None], KIND, BPP, BLOCK)
    else:
        q = _decode(row_ptr + within, block_ok[:, None], KIND, BPP, BLOCK)
    s = tl.load(scale_row_ptr + blk, mask=block_ok, other=0.0)
    return q * s[:, None]


@triton.jit
def _dequantize_kernel(
    in_ptr, scale_ptr, out_ptr,
    numel, shard_numel, num_blocks, chunk_bytes, payload_bytes,
    KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rank = tl.program_id(1).to(tl.int64)
    blk = pid * BPP + tl.arange(0, BPP)
    within = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    row_ptr = in_ptr + rank * chunk_bytes
    scale_row_ptr = scale_ptr + (rank * chunk_bytes + payload_bytes) // 4
    v = _load_dequant(row_ptr, scale_row_ptr, blk, within, blk < num_blocks, KIND, BLOCK, BPP)
    dst = rank * shard_numel
    mask = (within < shard_numel) & (dst + within < numel)
    tl.store(out_ptr + dst + within, _cast_out(v, OUT_KIND, HW_CAST), mask=mask)


@triton.jit
def _dequantize_reduce_kernel(
    in_ptr, scale_ptr, out_ptr,
    world, shard_numel, num_blocks, chunk_bytes, payload_bytes,
    KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr,
    WORLD: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid * BPP + tl.arange(0, BPP)
    within = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    block_ok = blk < num_blocks
    acc = tl.zeros((BPP, BLOCK), dtype=tl.float32)
    row_ptr = in_ptr  # 64-bit pointers advance one row per source rank (no int32 row offset)
    scale_row_ptr = scale_ptr + payload_bytes // 4
    if WORLD > 0:  # unrolled: the WORLD row loads are independent, so all are in flight at once
        for _ in tl.static_range(WORLD):  # rank order 0..world-1, as the reference
            acc += _load_dequant(row_ptr, scale_row_ptr, blk, within, block_ok, KIND, BLOCK, BPP)
            row_ptr += chunk_bytes
            scale_row_ptr += chunk_bytes // 4
    else:
        for _ in range(0, world):  # rank order 0..world-1, as the reference
            acc += _load_dequant(row_ptr, scale_row_ptr, blk, within, block_ok, KIND, BLOCK, BPP)
            row_ptr += chunk_bytes
            scale_row_ptr += chunk_bytes // 4
    tl.store(out_ptr + within, _cast_out(acc, OUT_KIND, HW_CAST), mask=within < shard_numel)



# ---- pair-word kernels ---------------------------------------------------------------------
# Elements 2j and 2j+1 travel as one word: the input is read as int32 (bf16/fp16) or int64
# (fp32) words, int8/fp8 payloads as int16 words, int4 payloads as bytes, and outputs are
# written as packed words. Even/odd pairing (int4 nibbles) is then integer arithmetic on one
# register, with no layout shuffle, and every access is a contiguous (BPP, BLOCK // 2) tile
# of words. Used when numel and the shard size are even (launcher check); tiles loop over a
# persistent grid when ``STAGES > 1`` (software pipelining of the loads).


@triton.jit
def _unpack_input(w, IN_KIND: tl.constexpr):
    """Input word -> fp32 (lo, hi) = elements (2j, 2j+1); IN_KIND 0 fp32 (int64 word), 1 bf16, 2 fp16."""
    if IN_KIND == 0:
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:  # bf16 bits are the top half of the exact fp32 value
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _out_bits(v, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """fp32 -> the output dtype's bits, zero-extended in int64 (fp32) or int32 (bf16/fp16)."""
    if OUT_KIND == 0:
        bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    elif OUT_KIND == 1 and not HW_CAST:
        bits = (_round_bf16(v).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    else:
        bits = _cast_out(v, OUT_KIND, HW_CAST).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits


@triton.jit
def _pack_out(lo, hi, OUT_KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """Two fp32 tiles -> one output word per pair (element 2j in the low half)."""
    half = 32 if OUT_KIND == 0 else 16
    return _out_bits(lo, OUT_KIND, HW_CAST) | (_out_bits(hi, OUT_KIND, HW_CAST) << half)


@triton.jit
def _decode_pairs(w, KIND: tl.constexpr):
    """Payload word (int16 for int8/fp8, uint8 for int4) -> fp32 codes (lo, hi)."""
    b = w.to(tl.int32)
    if KIND == 2:
        lo = ((b & 0xF) ^ 8) - 8
        hi = (((b >> 4) & 0xF) ^ 8) - 8
        return lo.to(tl.float32), hi.to(tl.float32)
    lo_b = b & 0xFF
    hi_b = (b >> 8) & 0xFF
    if KIND == 0:
        qlo = ((lo_b ^ 0x80) - 0x80).to(tl.float32)
        qhi = ((hi_b ^ 0x80) - 0x80).to(tl.float32)
    else:
        qlo = lo_b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        qhi = hi_b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return qlo, qhi


@triton.jit
def _encode_pairs(ylo, yhi, QMAX: tl.constexpr, KIND: tl.constexpr, HW_CAST: tl.constexpr):
    """Scaled fp32 (lo, hi) -> one payload word: int16 of two codes, or a byte of two nibbles."""
    if KIND == 2:
        qlo = _encode(ylo, QMAX, 0, HW_CAST).to(tl.int32)
        qhi = _encode(yhi, QMAX, 0, HW_CAST).to(tl.int32)
        word = ((qlo & 0xF) | ((qhi & 0xF) << 4)).to(tl.uint8)
    else:
        qlo = _encode(ylo, QMAX, KIND, HW_CAST).to(tl.int32)
        qhi = _encode(yhi, QMAX, KIND, HW_CAST).to(tl.int32)
        word = (qlo | (qhi << 8)).to(tl.int16)
    return word


@triton.jit
def _quantize_pairs_kernel(
    xw_ptr, pw_ptr, scale_ptr,  # input words; payload words (row stride row_words); fp32 scales
    half_numel, half_shard, num_blocks, row_words, scale_row0, scale_stride,
    QMAX: tl.constexpr, KIND: tl.constexpr, IN_KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr,
    STAGES: tl.constexpr, HW_CAST: tl.constexpr, STREAM: tl.constexpr,
):
    rank = tl.program_id(1).to(tl.int64)
    limit = tl.minimum(half_shard, half_numel - rank * half_shard)  # valid words of this shard
    src = xw_ptr + rank * half_shard
    row = pw_ptr + rank * row_words
    scale_row = scale_ptr + scale_row0 + rank * scale_stride
    n_tiles = tl.cdiv(num_blocks, BPP)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        blk = t * BPP + tl.arange(0, BPP)  # (BPP,)
        word = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]  # (BPP, BLOCK // 2)
        w = tl.load(src + word, mask=word < limit, other=0, eviction_policy="evict_first" if STREAM else "")
        lo, hi = _unpack_input(w, IN_KIND)
        lo, f_lo = _zero_nonfinite(lo)
        hi, f_hi = _zero_nonfinite(hi)
        absmax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))  # (BPP,)
        bad = tl.min((f_lo & f_hi).to(tl.int32), axis=1) == 0
        inv, scale = _block_scales(absmax, bad, QMAX)
        payload = _encode_pairs(lo * inv[:, None], hi * inv[:, None], QMAX, KIND, HW_CAST)
        block_ok = blk < num_blocks
        tl.store(row + word, payload, mask=block_ok[:, None], cache_modifier=".cs" if STREAM else "")
        tl.store(scale_row + blk, scale, mask=block_ok)


@triton.jit
def _dequant_pairs(pw_row, scale_row, blk, word, block_ok, KIND: tl.constexpr):
    """fp32 (lo, hi) dequantized values, each (BPP, BLOCK // 2), of blocks ``blk`` of one row."""
    qlo, qhi = _decode_pairs(tl.load(pw_row + word, mask=block_ok[:, None], other=0), KIND)
    s = tl.load(scale_row + blk, mask=block_ok, other=0.0)[:, None]
    return qlo * s, qhi * s


@triton.jit
def _dequantize_pairs_kernel(
    pw_ptr, scale_ptr, ow_ptr,  # payload words; fp32 scales; output words
    half_numel, half_shard, num_blocks, row_words, scale_row0, scale_stride,
    KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, OUT_KIND: tl.constexpr,
    STAGES: tl.constexpr, HW_CAST: tl.constexpr,
):
    rank = tl.program_id(1).to(tl.int64)
    pw_row = pw_ptr + rank * row_words
    scale_row = scale_ptr + scale_row0 + rank * scale_stride
    dst = rank * half_shard
    n_tiles = tl.cdiv(num_blocks, BPP)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        blk = t * BPP + tl.arange(0, BPP)
        word = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        lo, hi = _dequant_pairs(pw_row, scale_row, blk, word, blk < num_blocks, KIND)
        mask = (word < half_shard) & (dst + word < half_numel)
        tl.store(ow_ptr + dst + word, _pack_out(lo, hi, OUT_KIND, HW_CAST), mask=mask)


@triton.jit
def _dequantize_reduce_pairs_kernel(
    pw_ptr, scale_ptr, ow_ptr,
    world, half_shard, num_blocks, row_words, scale_row0, scale_stride,
    KIND: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr, OUT_KIND: tl.constexpr,
    STAGES: tl.constexpr, HW_CAST: tl.constexpr, WORLD: tl.constexpr,
):
    n_tiles = tl.cdiv(num_blocks, BPP)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        blk = t * BPP + tl.arange(0, BPP)
        word = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        block_ok = blk < num_blocks
        acc_lo = tl.zeros((BPP, BLOCK // 2), dtype=tl.float32)
        acc_hi = tl.zeros((BPP, BLOCK // 2), dtype=tl.float32)
        pw_row = pw_ptr  # 64-bit pointers advance one row per source rank (no int32 row offset)
        scale_row = scale_ptr + scale_row0
        if WORLD > 0:  # unrolled: the WORLD row loads are independent, so all are in flight at once
            for _ in tl.static_range(WORLD):  # rank order 0..world-1, as the reference
                lo, hi = _dequant_pairs(pw_row, scale_row, blk, word, block_ok, KIND)
                acc_lo += lo
                acc_hi += hi
                pw_row += row_words
                scale_row += scale_stride
        else:
            for _ in range(0, world):  # rank order 0..world-1, as the reference
                lo, hi = _dequant_pairs(pw_row, scale_row, blk, word, block_ok, KIND)
                acc_lo += lo
                acc_hi += hi
                pw_row += row_words
                scale_row += scale_stride
        tl.store(ow_ptr + word, _pack_out(acc_lo, acc_hi, OUT_KIND, HW_CAST), mask=word < half_shard)


@dataclass(frozen=True)
class KernelConfig:
    """How one kernel is launched on CUDA (the ``--sweep`` grid of benchmarks/kernels_bench.py).

    ``variant``: ``"tile"`` (a ``(BPP, block)`` element tile per program) or ``"pairs"``
    (pair-word kernels; they fall back to ``"tile"`` when numel or the shard size is odd or
    the input is not word-aligned). ``elems``: elements per tile. ``stages`` > 1 (pairs
    only): a persistent grid of ``progs_per_sm`` programs per SM loops over the tiles with
    ``num_stages=stages`` software pipelining; ``stages`` = 1: one program per tile.
    ``stream`` (pairs quantize only): evict-first input loads and streaming (``.cs``) stores.
    ``unroll`` (dequantize_reduce only): up to this many source rows the row loop is unrolled
    at compile time (one specialisation per row count), so every row's loads are in flight
    together instead of one DRAM round trip per row; above it (or 0) a runtime loop.
    """

    variant: str = "tile"
    elems: int = 8192
    num_warps: int = 8
    stages: int = 1
    progs_per_sm: int = 4
    stream: bool = False
    unroll: int = 8

    def __post_init__(self) -> None:
        assert self.variant in ("tile", "pairs"), self.variant
        assert self.elems >= 64 and self.num_warps in (1, 2, 4, 8, 16, 32) and self.stages >= 1
        assert self.unroll >= 0


# Per (kernel, quantized dtype) on CUDA: the best of the benchmarks/kernels_bench.py --sweep
# grid on an H100 (docs/kernels.md, "Measured bandwidth"). Under the interpreter, whose cost is
# per program, the same variants run with tiles as large as possible.
# Ratios to a device copy at 1G elements, block 512 (256M / 64M within 0.01 / 0.07 of them).
_TILE_Q, _TILE_D, _TILE_R = KernelConfig("tile", 8192, 8), KernelConfig("tile", 4096, 4), KernelConfig("tile", 2048, 4)
_PAIRS_4K = KernelConfig("pairs", 4096, 4)
CUDA_CONFIGS = {
    ("quantize", "int8"): _TILE_Q,  # 1.02 (pairs: 1.02)
    ("quantize", "fp8"): _TILE_Q,  # 1.02
    ("quantize", "int4"): KernelConfig("pairs", 8192, 8, stream=True),  # 0.97 (tile: 0.73)
    ("dequantize", "int8"): _TILE_D,  # 0.98
    ("dequantize", "fp8"): _TILE_D,  # 0.98
    ("dequantize", "int4"): _PAIRS_4K,  # 0.97 (tile: 0.96)
    ("dequantize_reduce", "int8"): _TILE_R,  # 1.00 (pairs: 0.94)
    ("dequantize_reduce", "fp8"): _TILE_R,  # 1.00
    ("dequantize_reduce", "int4"): _PAIRS_4K,  # 0.96 (tile: 0.95)
}

# Exceptions to CUDA_CONFIGS by quantization block and tensor size, first match wins:
# (kernel, qdtype, min_block, max_numel or None, config, why). ``numel`` is the element count
# of the whole quantized tensor (all rows), the kernel's work.
CUDA_CONFIG_RULES: tuple[tuple[str, str, int, int | None, KernelConfig, str], ...] = (
    ("quantize", "int4", 2048, None, KernelConfig("pairs", 2048, 1, stream=True),
     "block >= 2048: one block per single-warp program, so its absmax needs no cross-warp reduction; "
     "H100 (2026-11-26) 64M candidates: pairs/2048/w1/cs 0.922, pairs/4096/w4/cs 0.892, pairs/8192/w8/cs 0.87"),
)
INTERPRETER_ELEMS = 1 << 16


def default_config(kernel: str, qdtype: str, block: int, numel: int) -> tuple[KernelConfig, str]:
    """The CUDA launch config for ``kernel`` on ``qdtype`` at this block and size, and why."""
    for k, qd, min_block, max_numel, cfg, why in CUDA_CONFIG_RULES:
        if k == kernel and qd == qdtype and block >= min_block and (max_numel is None or numel <= max_numel):
            return cfg, why
    return CUDA_CONFIGS[(kernel, qdtype)], "per-format default (CUDA_CONFIGS)"


# fp8 quantize always takes the tile kernel on CUDA: the pairs kernel's hardware e4m3 encoding
# differed from the reference on an H100 (triton 3.6), and it is no faster there.
_PAIRS_FP8_QUANTIZE_ON_CUDA = False


def _resolve(kernel: str, layout: QuantLayout, device: torch.device, config: KernelConfig | None) -> KernelConfig:
    """``config``, else the default for (kernel, format): as measured on CUDA, big tiles interpreted."""
    if config is not None:
        return config
    cfg, _ = default_config(kernel, layout.qdtype, layout.block, layout.numel)
    return cfg if device.type == "cuda" else replace(cfg, elems=INTERPRETER_ELEMS, num_warps=4, stages=1)


def _grid(layout: QuantLayout, device: torch.device, cfg: KernelConfig, world: int):
    """(blocks per program, programs per rank, launch options)."""
    bpp = max(1, min(cfg.elems // layout.block, triton.next_power_of_2(layout.num_blocks)))
    progs = triton.cdiv(layout.num_blocks, bpp)
    opts = {"num_warps": cfg.num_warps, "enable_fp_fusion": False} if device.type == "cuda" else {}
    if cfg.stages > 1 and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        progs = min(progs, max(1, cfg.progs_per_sm * sms // world))
    return bpp, progs, opts


def _pairs_ok(layout: QuantLayout, *tensors: torch.Tensor) -> bool:
    """Pair-word kernels need even numel and shard size and word-aligned tensors."""
    aligned = all(t.data_ptr() % (2 * t.element_size()) == 0 for t in tensors)
    return layout.numel % 2 == 0 and layout.shard_numel % 2 == 0 and aligned


def _payload_words(data: torch.Tensor, layout: QuantLayout) -> tuple[torch.Tensor, int]:
    """(payload word view of ``data``, words per row): bytes for int4, int16 for int8/fp8."""
    if layout.qdtype == "int4":
        return data, layout.chunk_bytes
    return data.view(torch.int16), layout.chunk_bytes // 2


def _pair_args(data: torch.Tensor, layout: QuantLayout):
    """Shared pair-kernel arguments: payload words, scales, and the per-row word offsets."""
    words, row_words = _payload_words(data, layout)
    sizes = (layout.num_blocks, row_words, layout.payload_bytes // 4, layout.chunk_bytes // 4)
    return words, data.view(torch.float32), sizes


_WORD = {torch.float32: torch.int64, torch.bfloat16: torch.int32, torch.float16: torch.int32}
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def quantize_triton(x: torch.Tensor, layout: QuantLayout, config: KernelConfig | None = None) -> torch.Tensor:
    """Contiguous ``x`` -> ``uint8[world, chunk_bytes]`` (see ``reference.quantize_ref``).

    ``config`` overrides the per-device default launch (``CUDA_CONFIGS``).
    """
    out = torch.empty(layout.world, layout.chunk_bytes, dtype=torch.uint8, device=x.device)
    if layout.num_blocks == 0:
        return out
    cfg = _resolve("quantize", layout, x.device, config)
    bpp, progs, opts = _grid(layout, x.device, cfg, layout.world)
    consts = dict(QMAX=layout.fmt.qmax, KIND=_KIND[layout.qdtype], BLOCK=layout.block, BPP=bpp,
                  HW_CAST=x.device.type == "cuda")
    fp8_ok = layout.qdtype != "fp8" or x.device.type != "cuda" or _PAIRS_FP8_QUANTIZE_ON_CUDA
    if cfg.variant == "pairs" and fp8_ok and _pairs_ok(layout, x):
        words, scales, sizes = _pair_args(out, layout)
        _quantize_pairs_kernel[(progs, layout.world)](
            x.view(-1).view(_WORD[x.dtype]), words, scales, layout.numel // 2, layout.shard_numel // 2, *sizes,
            IN_KIND=_IN_KIND[x.dtype], STAGES=cfg.stages, STREAM=cfg.stream, **consts, **opts,
        )
        return out
    bpp, progs, opts = _grid(layout, x.device, replace(cfg, stages=1), layout.world)
    _quantize_kernel[(progs, layout.world)](
        x, out, out.view(torch.float32), layout.numel, layout.shard_numel, layout.num_blocks,
        layout.chunk_bytes, layout.payload_bytes, **consts, **opts,
    )
    return out


def dequantize_triton(data: torch.Tensor, layout: QuantLayout, out_dtype: torch.dtype,
                      config: KernelConfig | None = None) -> torch.Tensor:
    """``uint8[world, chunk_bytes]`` -> flat ``out_dtype[numel]`` (see ``reference.dequantize_ref``)."""
    out = torch.empty(layout.numel, dtype=out_dtype, device=data.device)
    if layout.num_blocks == 0:
        return out
    cfg = _resolve("dequantize", layout, data.device, config)
    bpp, progs, opts = _grid(layout, data.device, cfg, layout.world)
    consts = dict(KIND=_KIND[layout.qdtype], BLOCK=layout.block, BPP=bpp, OUT_KIND=_OUT_KIND[out_dtype],
                  HW_CAST=data.device.type == "cuda")
    if cfg.variant == "pairs" and _pairs_ok(layout, out):
        words, scales, sizes = _pair_args(data, layout)
        _dequantize_pairs_kernel[(progs, layout.world)](
            words, scales, out.view(_WORD[out_dtype]), layout.numel // 2, layout.shard_numel // 2, *sizes,
            STAGES=cfg.stages, **consts, **opts,
        )
        return out
    bpp, progs, opts = _grid(layout, data.device, replace(cfg, stages=1), layout.world)
    _dequantize_kernel[(progs, layout.world)](
        data, data.view(torch.float32), out, layout.numel, layout.shard_numel, layout.num_blocks,
        layout.chunk_bytes, layout.payload_bytes, **consts, **opts,
    )
    return out


def dequantize_reduce_triton(data: torch.Tensor, layout: QuantLayout, out_dtype: torch.dtype,
                             config: KernelConfig | None = None) -> torch.Tensor:
    """Sum over rows of ``uint8[world, chunk_bytes]`` -> ``out_dtype[shard_numel]``."""
    out = torch.empty(layout.shard_numel, dtype=out_dtype, device=data.device)
    if layout.num_blocks == 0:
        return out
    cfg = _resolve("dequantize_reduce", layout, data.device, config)
    bpp, progs, opts = _grid(layout, data.device, cfg, 1)
    consts = dict(KIND=_KIND[layout.qdtype], BLOCK=layout.block, BPP=bpp, OUT_KIND=_OUT_KIND[out_dtype],
                  HW_CAST=data.device.type == "cuda")
    unrolled = layout.world if layout.world <= cfg.unroll else 0  # 0: runtime row loop
    if cfg.variant == "pairs" and layout.shard_numel % 2 == 0:
        words, scales, sizes = _pair_args(data, layout)
        _dequantize_reduce_pairs_kernel[(progs,)](
            words, scales, out.view(_WORD[out_dtype]), layout.world, layout.shard_numel // 2, *sizes,
            STAGES=cfg.stages, WORLD=unrolled, **consts, **opts,
        )
        return out
    bpp, progs, opts = _grid(layout, data.device, replace(cfg, stages=1), 1)
    _dequantize_reduce_kernel[(progs,)](
        data, data.view(torch.float32), out, layout.world, layout.shard_numel, layout.num_blocks,
        layout.chunk_bytes, layout.payload_bytes, WORLD=unrolled, **consts, **opts,
    )
    return out
