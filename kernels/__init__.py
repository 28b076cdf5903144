"""Quantization kernels for communication: int8 / fp8 e4m3 / packed int4, blockwise symmetric.

Public API (what the ``quantize_comm`` pass and the runtime call):

- ``quantize(x, dtype, block, world) -> QuantizedTensor`` and
  ``dequantize(q, out_dtype) -> Tensor``; ``dequantize_reduce(q, out_dtype)`` for gradients;
- ``autoshard::quantize`` / ``autoshard::dequantize`` / ``autoshard::dequantize_reduce``
  custom ops (``ops.py``) with fake kernels;
- quantized collectives in ``autoshard.kernels.comm`` (qwZ all-gather, qgZ reduce-scatter,
  hpZ secondary partition).

The byte layout is in ``layout.py`` and docs/kernels.md; the arithmetic, error bounds and
NaN/Inf policy in ``reference.py``. Triton is imported lazily, only when a kernel runs.
"""

from autoshard.kernels.layout import QFORMATS, QuantizationError, QuantLayout
from autoshard.kernels.ops import (
    DEFAULT_BLOCK,
    QuantizedTensor,
    dequantize,
    dequantize_reduce,
    quantize,
    uses_triton,
)

__all__ = [
    "DEFAULT_BLOCK",
    "QFORMATS",
    "QuantLayout",
    "QuantizationError",
    "QuantizedTensor",
    "dequantize",
    "dequantize_reduce",
    "quantize",
    "uses_triton",
]
