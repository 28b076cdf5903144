"""Byte layout of a quantized tensor: validation, sizes and offsets (no kernels here).

A tensor of ``numel`` elements is split into ``world`` rank shards the way
``torch.chunk`` on the flattened tensor would (FSDP flat-parameter semantics):

    shard_numel  S  = ceil(numel / world)          rank r owns flat [r*S, min((r+1)*S, numel))
    padded_numel Sp = ceil(S / block) * block      each shard zero-padded to whole blocks
    num_blocks   nb = Sp / block
    payload_bytes   = Sp * bits / 8                int8, fp8: 1 byte/element; int4: 2 elements/byte
    chunk_bytes     = payload_bytes + 4 * nb       one fp32 scale per block

The quantized buffer is ``uint8[world, chunk_bytes]``; row ``r`` is rank ``r``'s chunk:

    [ payload (payload_bytes) | scales (nb fp32, little-endian, 4-byte aligned) ]

so one all-gather or all-to-all of rows moves payload and scales together. Shard
boundaries do not depend on ``block``: the sharding pass decides who owns what,
quantization only pads inside each shard. Padding quantizes to payload 0 and
dequantizes to exactly 0, so padded positions never perturb a reduction.

Rows gathered from ``world`` ranks that each quantized their own shard of ``S``
elements with ``world=1`` form exactly the layout of ``numel = world*S`` with
``world`` shards: gathered buffers need no re-layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.errors import AutoshardError


class QuantizationError(AutoshardError):
    """A quantize/dequantize request names an unsupported dtype, block size or layout."""


@dataclass(frozen=True)
class QFormat:
    """One quantized element format: symmetric, per-block fp32 scale = absmax / qmax."""

    name: str
    bits: int  # bits per element in the payload
    qmax: float  # largest representable |q|; scale = absmax / qmax


QFORMATS: dict[str, QFormat] = {
    "int8": QFormat("int8", 8, 127.0),
    "fp8": QFormat("fp8", 8, 448.0),  # float8 e4m3fn, moved as uint8
    "int4": QFormat("int4", 4, 7.0),  # two's-complement nibbles, element 2i in the low nibble
}

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK, MAX_BLOCK = 64, 4096
SCALE_BYTES = 4


def check_qdtype(qdtype: str) -> QFormat:
    """Return the format named ``qdtype`` or raise ``QuantizationError`` naming the allowed set."""
    if qdtype not in QFORMATS:
        raise QuantizationError(
            f"quantized dtype {qdtype!r} is not supported; allowed: {sorted(QFORMATS)}. "
            "Pick one of those (e.g. weight_comm='int8')."
        )
    return QFORMATS[qdtype]


def check_block(block: int) -> int:
    """Validate a block size: a power of two in [64, 4096]."""
    ok = isinstance(block, int) and MIN_BLOCK <= block <= MAX_BLOCK and block & (block - 1) == 0
    if not ok:
        allowed = [2**k for k in range(6, 13)]
        raise QuantizationError(f"block size {block!r} is not supported; allowed: {allowed}. Use e.g. block=512.")
    return block


def check_float_dtype(dtype: torch.dtype, role: str, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    """Raise ``QuantizationError`` unless ``dtype`` is in ``allowed``; ``role`` names the tensor."""
    if dtype not in allowed:
        names = [str(d).removeprefix("torch.") for d in allowed]
        raise QuantizationError(
            f"{role} dtype {dtype} is not supported; allowed: {names}. Cast the tensor first (e.g. .float())."
        )
    return dtype


@dataclass(frozen=True)
class QuantLayout:
    """Sizes and offsets of a ``uint8[world, chunk_bytes]`` quantized buffer (module docstring)."""

    qdtype: str
    block: int
    numel: int
    world: int = 1

    def __post_init__(self) -> None:
        check_qdtype(self.qdtype)
        check_block(self.block)
        if self.numel < 0 or self.world < 1:
            raise QuantizationError(
                f"layout needs numel >= 0 and world >= 1, got numel={self.numel}, world={self.world}."
            )

    @property
    def fmt(self) -> QFormat:
        return QFORMATS[self.qdtype]

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        return -(-self.shard_numel // self.block) * self.block

    @property
    def num_blocks(self) -> int:
        return self.padded_numel // self.block

    @property
    def payload_bytes(self) -> int:
        return self.padded_numel * self.fmt.bits // 8

    @property
    def chunk_bytes(self) -> int:
        return self.payload_bytes + SCALE_BYTES * self.num_blocks

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block."""
        return self.block * self.fmt.bits // 8

    def valid_numel(self, rank: int) -> int:
        """Elements of rank ``rank``'s shard that lie inside the tensor (the rest is padding)."""
        return max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))

    def check_buffer(self, data: torch.Tensor) -> None:
        """Raise ``QuantizationError`` unless ``data`` is a ``uint8[world, chunk_bytes]`` buffer."""
        want = (self.world, self.chunk_bytes)
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            raise QuantizationError(
                f"quantized buffer has dtype {data.dtype} and shape {tuple(data.shape)}; this layout "
                f"({self}) needs torch.uint8 of shape {want}. Build buffers with autoshard.kernels.quantize."
            )


def layout_from_rows(qdtype: str, block: int, rows: int, chunk_bytes: int, numel: int) -> QuantLayout:
    """Layout of a received ``uint8[rows, chunk_bytes]`` buffer holding ``numel`` elements in total."""
    layout = QuantLayout(qdtype, block, numel, rows)
    if layout.chunk_bytes != chunk_bytes:
        raise QuantizationError(
            f"buffer rows of {chunk_bytes} bytes do not match {layout} (needs {layout.chunk_bytes}); "
            "numel, block and qdtype must equal those used to quantize."
        )
    return layout
