"""Pass ``recompute``: ZeRO-3 re-gather in backward; activation-checkpoint regions (not yet).

Pre-conditions: ``insert_collectives`` ran. Post-conditions: when the graph
has ``Zero3Gather`` modules, a ``Regather`` submodule ``autoshard_regather``
exists and every gather reports its outputs to it; the runtime runs the graph
inside ``torch.autograd.graph.saved_tensors_hooks(regather.pack,
regather.unpack)`` (``Program.forward``).

[Note: ZeRO-3 re-gather]
Autograd saves the full (gathered) weight for the input gradient of every op
that uses it (``linear`` saves ``weight.t()``, a norm's ``mul`` saves the
weight). Keeping them would hold every layer's full parameters until
backward, i.e. no ZeRO-3 memory saving. The pack hook recognises a saved
tensor whose storage root is a gathered copy-out tensor (``_zero3.py``) and
stores only a recipe: (gather module, parameter index, local shards, size,
stride, storage offset). The unpack hook re-runs that layer's all-gather
(no autograd) and rebuilds the saved view with ``as_strided``. The last
layer re-gathered is cached, so backward costs one extra all-gather per layer
(its saved weights are unpacked together); ``reset()`` drops the cache at the
end of backward. Every rank runs the same graph, so the re-gathers happen in
the same order everywhere.

Partial: ``recompute="selective"`` / ``"full"`` (checkpoint regions around a
layer's subgraph) raise ``PlanError``: not implemented yet.
"""

from __future__ import annotations

import weakref

import torch
from torch import fx, nn

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, copy_module
from autoshard.passes._zero3 import Zero3Gather
from autoshard.passes.context import RankContext
from autoshard.plan import Plan

NAME = "recompute"
REGATHER = "autoshard_regather"


def _storage_root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class Regather(nn.Module):
    """Saved-tensor hooks that drop gathered ZeRO-3 weights at pack time and re-gather at unpack."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple] = {}  # id(root) → (weakref(root), gather module, index, shards)
        self._cache: tuple | None = None  # (gather module, roots) of the last re-gather
        self.regathers = 0

    def record(self, module: Zero3Gather, shards: tuple, roots: list[torch.Tensor]) -> None:
        """Called by a ``Zero3Gather`` in forward with its copy-out tensors."""
        for i, root in enumerate(roots):
            base = _storage_root(root)
            self._live[id(base)] = (weakref.ref(base), module, i, tuple(s.detach() for s in shards))

    def pack(self, t: torch.Tensor):
        entry = self._live.get(id(_storage_root(t)))
        if entry is None or entry[0]() is not _storage_root(t):
            return t
        _ref, module, i, shards = entry
        return (module, i, shards, t.size(), t.stride(), t.storage_offset())

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        module, i, shards, size, stride, offset = packed
        if self._cache is None or self._cache[0] is not module:
            with torch.no_grad():
                self._cache = (module, module.gather_roots(shards))
            self.regathers += 1
        return _storage_root(self._cache[1][i]).as_strided(size, stride, offset)

    def reset(self) -> None:
        """Forget forward records and the re-gather cache (end of a backward)."""
        self._live.clear()
        self._cache = None

    def hooks(self):
        """The ``saved_tensors_hooks`` context to run the graph's forward in."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Install ZeRO-3 re-gather; refuse checkpoint regions (module docstring)."""
    for s in plan.layers:
        if s.recompute != "none":
            raise PlanError(
                f"layer {s.layer!r}: recompute={s.recompute!r} is not implemented by the runtime yet; "
                "set recompute='none' (allowed now: ('none',))"
            )
    gathers = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Zero3Gather)}
    if not gathers:
        return gm
    regather = Regather()
    replace = {target: Zero3Gather(m.spec, on_gather=regather.record) for target, m in gathers.items()}
    out = copy_module(gm, replace)
    out.add_submodule(REGATHER, regather)
    out.meta[META_KEY]["regather"] = REGATHER
    return out
