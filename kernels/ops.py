"""``autoshard::`` custom ops for quantization and the small public API the passes call.

Three layers per kernel: a private ``@triton.jit`` kernel and typed launcher
(``triton_kernels.py``), a ``torch.library.custom_op`` wrapping the launcher with a
``register_fake`` (so graphs that call it stay exportable and compilable), and the
pure-torch reference (``reference.py``).

Dispatch, per call on the input's device:

- CUDA tensor: the Triton kernel;
- CPU tensor with ``TRITON_INTERPRET=1`` in the environment: the Triton kernel under the
  interpreter (how CI tests the kernels without a GPU; the variable must be set before
  triton is first imported);
- otherwise, or when triton cannot be imported: the reference (a ``RuntimeWarning`` says
  once why triton is unavailable).

``torch.library.triton_op`` is not used: it fails inside ``torch.export`` under the
interpreter, while a ``custom_op`` wrapping the launcher works in eager, FX and export.

Input handling: non-contiguous inputs are made contiguous (one extra copy) before the
kernel; dtypes outside the allowed sets raise ``QuantizationError`` (an
``AutoshardError``). The ops are not differentiable (no autograd formula): quantized
communication happens on detached parameters and gradients.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from autoshard.kernels import reference
from autoshard.kernels.layout import (
    INPUT_DTYPES,
    OUTPUT_DTYPES,
    QuantizationError,
    QuantLayout,
    check_float_dtype,
)

DEFAULT_BLOCK = 512


@functools.lru_cache(maxsize=None)
def triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or ``None`` when triton cannot be imported (warned once)."""
    try:
        from autoshard.kernels import triton_kernels as module
    except Exception as err:  # ImportError, or a triton install without a usable backend
        warnings.warn(
            f"autoshard.kernels: triton is unavailable ({type(err).__name__}: {err}); "
            "quantization runs the pure-torch reference. Install triton>=3.2 for the fused kernels.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return module


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the Triton kernels (module docstring)."""
    wanted = device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return wanted and triton_kernels() is not None


# ---- custom ops -------------------------------------------------------------------------


@torch.library.custom_op("autoshard::quantize", mutates_args=())
def quantize_op(x: torch.Tensor, qdtype: str, block: int, world: int) -> torch.Tensor:
    """Quantize ``x`` into the collective layout ``uint8[world, chunk_bytes]`` (layout.py)."""
    check_float_dtype(x.dtype, "quantize input", INPUT_DTYPES)
    layout = QuantLayout(qdtype, block, x.numel(), world)
    x = x.contiguous()
    if uses_triton(x.device):
        return triton_kernels().quantize_triton(x, layout)
    return reference.quantize_ref(x, layout)


@quantize_op.register_fake
def _quantize_fake(x: torch.Tensor, qdtype: str, block: int, world: int) -> torch.Tensor:
    check_float_dtype(x.dtype, "quantize input", INPUT_DTYPES)
    layout = QuantLayout(qdtype, block, x.numel(), world)
    return x.new_empty((world, layout.chunk_bytes), dtype=torch.uint8)


@torch.library.custom_op("autoshard::dequantize", mutates_args=())
def dequantize_op(data: torch.Tensor, qdtype: str, block: int, numel: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``uint8[world, chunk_bytes]`` holding ``numel`` elements -> flat ``out_dtype[numel]``."""
    layout = _checked_layout(data, qdtype, block, numel, out_dtype)
    data = data.contiguous()
    if uses_triton(data.device):
        return triton_kernels().dequantize_triton(data, layout, out_dtype)
    return reference.dequantize_ref(data, layout, out_dtype)


@dequantize_op.register_fake
def _dequantize_fake(data, qdtype, block, numel, out_dtype):
    _checked_layout(data, qdtype, block, numel, out_dtype)
    return data.new_empty((numel,), dtype=out_dtype)


@torch.library.custom_op("autoshard::dequantize_reduce", mutates_args=())
def dequantize_reduce_op(
    data: torch.Tensor, qdtype: str, block: int, shard_numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Sum of the dequantized rows of ``uint8[world, chunk_bytes]`` -> ``out_dtype[shard_numel]``.

    Row ``r`` is source rank ``r``'s quantized copy of the same shard (as received by
    all-to-all); rows are added in rank order in fp32 and rounded once.
    """
    layout = _checked_layout(data, qdtype, block, data.shape[0] * shard_numel, out_dtype)
    data = data.contiguous()
    if uses_triton(data.device):
        return triton_kernels().dequantize_reduce_triton(data, layout, out_dtype)
    return reference.dequantize_reduce_ref(data, layout, out_dtype)


@dequantize_reduce_op.register_fake
def _dequantize_reduce_fake(data, qdtype, block, shard_numel, out_dtype):
    _checked_layout(data, qdtype, block, data.shape[0] * shard_numel, out_dtype)
    return data.new_empty((shard_numel,), dtype=out_dtype)


def _checked_layout(data: torch.Tensor, qdtype: str, block: int, numel: int, out_dtype: torch.dtype) -> QuantLayout:
    check_float_dtype(out_dtype, "dequantize output", OUTPUT_DTYPES)
    if data.dim() != 2:
        raise QuantizationError(
            f"quantized buffer must be 2-D uint8[world, chunk_bytes], got shape {tuple(data.shape)}; "
            "pass QuantizedTensor.data."
        )
    layout = QuantLayout(qdtype, block, numel, data.shape[0])
    layout.check_buffer(data)
    return layout


# ---- public API -------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor quantized into the collective layout (layout.py), plus what restores it.

    ``data`` is ``uint8[world, chunk_bytes]``; row ``r`` is rank ``r``'s
    ``[payload | fp32 scales]`` chunk. ``shape`` and ``dtype`` are the original tensor's.
    """

    data: torch.Tensor
    layout: QuantLayout
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def payload(self) -> torch.Tensor:
        """``uint8[world, payload_bytes]`` view (int8 / fp8 e4m3 bits / packed int4)."""
        return reference.split_buffer(self.data, self.layout)[0]

    @property
    def scales(self) -> torch.Tensor:
        """``float32[world, num_blocks]`` view of the per-block scales."""
        return reference.split_buffer(self.data, self.layout)[1]

    @property
    def nbytes(self) -> int:
        """Bytes a collective moves for the whole tensor."""
        return self.data.numel()


def quantize(x: torch.Tensor, dtype: str = "int8", block: int = DEFAULT_BLOCK, world: int = 1) -> QuantizedTensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape) to ``dtype`` in ``int8``, ``fp8``, ``int4``.

    ``world > 1`` splits the flattened tensor into ``world`` rank shards, each row of the
    result contiguous with its scales, ready for ``all_to_all_single``.
    """
    data = quantize_op(x, dtype, block, world)
    return QuantizedTensor(data, QuantLayout(dtype, block, x.numel(), world), tuple(x.shape), x.dtype)


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Restore ``q`` to its shape in ``out_dtype`` (default: the original dtype), cast fused."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    flat = dequantize_op(q.data, q.layout.qdtype, q.layout.block, q.layout.numel, out_dtype)
    return flat.view(q.shape)


def dequantize_reduce(q: QuantizedTensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum the ``world`` rows of ``q`` (copies of one shard) -> flat ``out_dtype[shard_numel]``."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    return dequantize_reduce_op(q.data, q.layout.qdtype, q.layout.block, q.layout.shard_numel, out_dtype)
