"""Live tensor bytes, counted from the dispatcher: what a build or step holds at its peak, on any device.

CUDA has an allocator that counts (``torch.cuda.max_memory_allocated``); the CPU
has none. ``LiveBytes`` is a ``TorchDispatchMode`` that sees every tensor an op
returns while it is active, counts the bytes of each new storage once (views
share their base's storage) and subtracts them when the storage is freed
(``weakref.finalize`` on the storage's Python object, which torch keeps alive
exactly as long as the storage). Storages created outside the mode (before it,
or by C code such as a file reader) are not counted; their copies are.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created under the mode and still alive: ``live`` now, ``peak`` since entry (or ``reset``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _drop(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or not hasattr(tensor, "untyped_storage"):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._drop, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value)
        return out


__all__ = ["LiveBytes"]
