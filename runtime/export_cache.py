"""One ``torch.export`` per model structure per process: a second ``build_program`` of the same model copies the first's graph.

``build_program`` exports the model's meta twin in the compute dtype (``runtime/program._export``):
no weight is read, so the graph depends only on the twin (module tree, attributes, parameter shapes
and dtypes, the classes' code) and on the example inputs' shapes and dynamic dims. Export is most of
a build's time (about 6 s of 7 for a 2-layer reference model on a CPU core), and a process often
builds the same model several times: PPO's policy and its frozen reference, a compiled program and
the eager one it is checked against, every case of a numerics test in one rank.

[Note: the key]
A SHA-256 of the pickled twin (every module's class by name and its ``__dict__``: sizes, flags,
buffers' and parameters' meta tensors), the ``id`` of each module class (a class redefined under
the same name does not match), the example inputs (meta tensors: shapes and dtypes) and the
dynamic-shape spec. A twin that does not pickle (a lambda or a hook on a module) is not cached.
What the key cannot see is process-global state a ``forward`` reads outside its module (a global
flag that changes the traced ops); ``AUTOSHARD_EXPORT_CACHE=0`` turns the cache off.

Each hit returns a deep copy (the passes rewrite the graph in place). At most ``CACHE_SIZE``
graphs are kept, least recently used first out.

[Note: on disk]
With ``AUTOSHARD_EXPORT_CACHE=disk`` a miss here is looked up on disk before exporting: the
``ExportedProgram`` saved by ``torch.export.save`` under a key every process computes alike
(``passes/_capture_cache.model_key``: the twin, the source files of its classes, their packages'
versions, autoshard's own sources, torch's version, the inputs and dynamic dims), in
``AUTOSHARD_CACHE_DIR/export/``. Ranks of one machine that build the same model at once take the
entry's lock, so one exports and the others load (``_capture_cache`` note "one process traces").
Loading is ~2.5x faster than exporting (1.5 s against 3.8 s for llama:tiny on a CPU core). What a
reload does not restore is rebuilt (``_reloaded``): every tensor node's ``tensor_meta`` (from its
``val``), the graph's ``inline_constraints`` (the unbacked symbols' ranges, as export records them),
``Tensor[]`` results as lists. Two things stay unlike a fresh export: ``tensor_meta.requires_grad``
is the saved ``val``'s (False for activations, which the trace saw requiring grad) and a stride that
export wrote symbolically (``Min(64, 64*s27)``) is its value (64). No pass reads either. A model
with tied parameters or buffers (one tensor under two names) is never saved: the reloaded program
holds two tensors where the model has one.
It is opt-in because a stale entry would change what a rank computes, not only what a plan costs:
the key cannot see code a ``forward`` calls from another file of the user's, so turn it on only
while such code does not change (the test suite turns it on: ``tests/conftest.py``). A program
that ``torch.export.save`` cannot write, or an entry that does not load, is exported as before.
"""

from __future__ import annotations

import copy
import io
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from autoshard.passes import _capture_cache
from autoshard.passes._graph_utils import STRUCTURE_CACHE_ENV, structure_key

log = logging.getLogger(__name__)

ENV = STRUCTURE_CACHE_ENV
CACHE_SIZE = 16  # graphs of meta twins (no weights); the test ranks' forkserver primes 9 (tests/_export_warm.py)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0  # exported here
    uncached: int = 0
    loaded: int = 0  # read from disk (note "on disk")


stats = CacheStats()
_CACHE: OrderedDict[str, torch.fx.GraphModule] = OrderedDict()


def export_key(twin: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> str | None:
    """The cache key of exporting ``twin`` with these inputs (note "the key"), or None when it cannot be formed."""
    return structure_key(twin, args, kwargs, dynamic_shapes)


def cached_export(twin: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                  export: Callable[[], torch.export.ExportedProgram]) -> torch.fx.GraphModule:
    """The graph of ``export()``'s program, or a copy of the one exported earlier for the same key (module
    docstring), or the program saved on disk (note "on disk")."""
    key = export_key(twin, args, kwargs, dynamic_shapes)  # None: no cache (unpicklable, or ENV "0")
    if key is None:
        stats.uncached += 1
        return export().module()
    if key in _CACHE:
        stats.hits += 1
        _CACHE.move_to_end(key)
        return copy.deepcopy(_CACHE[key])
    gm = _from_disk_or_export(twin, args, kwargs, dynamic_shapes, export)
    _CACHE[key] = copy.deepcopy(gm)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return gm


def on_disk() -> bool:
    """Whether exports are kept on disk too (note "on disk")."""
    return os.environ.get(ENV) == "disk"


def _from_disk_or_export(twin: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                         export: Callable[[], torch.export.ExportedProgram]) -> torch.fx.GraphModule:
    key = None  # tied tensors: a reloaded program unties them (note "on disk"), so they are never saved
    if on_disk() and not _has_aliases(twin):
        key = _capture_cache.model_key(twin, "export", args, kwargs, dynamic_shapes)
    with _capture_cache.locked(key, "export"):
        gm = _load(key)
        if gm is not None:
            stats.loaded += 1
            return gm
        stats.misses += 1
        program = export()
        if key is not None:
            _capture_cache.store_with(key, "export", ".pt2", lambda handle: torch.export.save(program, handle))
        return program.module()


def _has_aliases(twin: nn.Module) -> bool:
    """Whether a parameter or buffer is reachable under two names (an embedding tied to the head)."""
    return any(len(list(named(remove_duplicate=False))) != len(list(named()))
               for named in (twin.named_parameters, twin.named_buffers))


def _load(key: str | None) -> torch.fx.GraphModule | None:
    blob = _capture_cache.load_bytes(key, "export", ".pt2")
    if blob is None:
        return None
    try:
        return _reloaded(torch.export.load(io.BytesIO(blob)))
    except Exception as exc:  # noqa: BLE001 - a damaged, foreign or unloadable entry is a miss
        log.info("export cache: entry %s does not load (%s); exporting again", key[:12], exc)
        return None


def _returns_a_list(node: torch.fx.Node) -> bool:
    returns = getattr(getattr(node.target, "_schema", None), "returns", ())
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def _reloaded(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``program.module()`` with what ``torch.export.load`` does not restore and a fresh export has (note "on disk")."""
    gm = program.module()
    for node in gm.graph.nodes:
        if node.op == "output":  # a fresh export records no value for the output node
            node.meta.pop("val", None)
        val = node.meta.get("val")
        if isinstance(val, tuple) and _returns_a_list(node):  # a fresh export keeps ``Tensor[]`` results a list
            node.meta["val"] = list(val)
        if isinstance(val, torch.Tensor) and "tensor_meta" not in node.meta:
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    gm.meta.setdefault("inline_constraints", {
        symbol: bounds for symbol, bounds in program.range_constraints.items() if free_unbacked_symbols(symbol)})
    return gm


def clear() -> None:
    """Forget every cached graph and reset the counters."""
    _CACHE.clear()
    stats.hits = stats.misses = stats.uncached = stats.loaded = 0


__all__ = ["CACHE_SIZE", "ENV", "CacheStats", "cached_export", "clear", "export_key", "on_disk", "stats"]
