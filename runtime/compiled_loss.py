"""The user's loss function compiled with the program: ``Program.step`` runs it through ``LossCompiler``.

When the program is compiled by inductor on CUDA (``compiles_loss``), the loss function a caller passes
to ``Program.step`` is compiled as well (``torch.compile(loss_fn, dynamic=False)``), as torchtitan
compiles its loss: a cross-entropy over the vocabulary then fuses into one reduction per row that keeps
only the bf16 logits for backward, where the eager loss keeps fp32 log-probabilities and their
gradients. The cost model prices the two forms from one declaration (``search/layer_terms.LossForm``,
``loss_form(runs_compiled(mesh, cluster))``): ``compiles_loss`` holds exactly when ``runs_compiled``
does (a GPU cluster, a compilable plan; ``BuildOptions.compile`` auto).

A loss function torch.compile cannot compile (an error at its first call) runs eagerly from then on,
with one warning naming the error: its memory is then the eager form's, more than the plan priced.
A loss function that must stay eager can say so itself (``torch.compiler.disable``). Compiled
wrappers are kept for the last ``CACHE_SIZE`` loss functions (a caller passing a new closure every step
reuses Dynamo's code cache, not this one).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

CACHE_SIZE = 4


def compiles_loss(compiled: bool, device: torch.device | str, backend: Any) -> bool:
    """Whether ``Program.step`` compiles the loss: the program is compiled, on CUDA, by inductor."""
    return bool(compiled) and torch.device(device).type == "cuda" and backend == "inductor"


class _Compiled:
    """``fn`` compiled; eager from the first compile error on (module docstring)."""

    def __init__(self, fn: Callable, backend: Any) -> None:
        self.fn = fn
        self.compiled: Callable | None = torch.compile(fn, dynamic=False, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compile failure: the eager function is still right
                name = getattr(self.fn, "__qualname__", repr(self.fn))
                log.warning("autoshard: the loss function %s did not compile (%s: %s); it runs eagerly, holding "
                            "more memory than the plan priced", name, type(err).__name__, str(err).splitlines()[0])
                self.compiled = None
        return self.fn(*args, **kwargs)


class LossCompiler:
    """Maps a caller's loss function to what ``Program.step`` runs: itself, or its compiled twin."""

    def __init__(self, enabled: bool, backend: Any = "inductor") -> None:
        self.enabled, self.backend = enabled, backend
        self._cache: OrderedDict[Any, _Compiled] = OrderedDict()

    def __call__(self, loss_fn: Callable) -> Callable:
        if not self.enabled:
            return loss_fn
        if loss_fn not in self._cache:
            self._cache[loss_fn] = _Compiled(loss_fn, self.backend)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(loss_fn)
        return self._cache[loss_fn]


__all__ = ["CACHE_SIZE", "LossCompiler", "compiles_loss"]
