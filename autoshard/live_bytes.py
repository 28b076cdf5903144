"""Live tensor bytes, counted from the dispatcher: what a build or step holds at its peak, on any device.

CUDA has an allocator that counts (``torch.cuda.max_memory_allocated``); the CPU
has none. ``LiveBytes`` is a ``TorchDispatchMode`` that sees every tensor an op
returns while it is active, counts the bytes of each new storage once (views
share their base's storage) and subtracts them when the storage is freed
(``weakref.finalize`` on the storage's Python object, which torch keeps alive
exactly as long as the storage). An output sharing an input's storage (views,
in-place ops) allocates nothing and is not counted. Storages created outside
the mode (before it, or by C code such as a file reader) are not counted;
their copies are.

Compiled code (``ignore_compile_internals``): any other dispatch mode makes
``torch.compile`` skip its frames and run them eagerly, so a compiled program
measured under it would be measured as an eager one (for ZeRO-3 without its
re-gathers: every gathered weight kept). This mode is off while Dynamo traces
and compiles and on while the compiled artifact runs: it sees every op of an
``aot_eager`` graph (the CPU tests' backend); inductor's generated kernels
allocate their buffers without dispatching, so an inductor graph is seen only
through the ops it calls.

Meta tensors are not counted unless ``count_meta=True``: a program built on
the meta device (``autoshard/check.py``) has only meta storages, whose
``nbytes`` are the bytes the same tensors would take on a device.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created under the mode and still alive: ``live`` now, ``peak`` since entry (or ``reset``)."""

    def __init__(self, *, count_meta: bool = False) -> None:
        super().__init__()
        self.count_meta = count_meta
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` run compiled code under the mode (module docstring)."""
        return True

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _drop(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _count(self, tensor: torch.Tensor) -> None:
        if (tensor.device.type == "meta" and not self.count_meta) or not hasattr(tensor, "untyped_storage"):
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
        # an output aliasing an input (a view, an in-place op) allocated nothing: never count an input's storage,
        # or a tensor made before the mode would be counted the first time it passes through an op
        inputs = {_key(v) for v in tree_flatten((args, kwargs or {}))[0] if isinstance(v, torch.Tensor)}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and _key(value) not in inputs:
                self._count(value)
        return out


def _key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


__all__ = ["LiveBytes"]
