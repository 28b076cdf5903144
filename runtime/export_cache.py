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
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from autoshard.passes._graph_utils import STRUCTURE_CACHE_ENV, structure_key

ENV = STRUCTURE_CACHE_ENV
CACHE_SIZE = 16  # graphs of meta twins (no weights); the test ranks' forkserver primes 9 (tests/_export_warm.py)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    uncached: int = 0


stats = CacheStats()
_CACHE: OrderedDict[str, torch.fx.GraphModule] = OrderedDict()


def export_key(twin: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> str | None:
    """The cache key of exporting ``twin`` with these inputs (note "the key"), or None when it cannot be formed."""
    return structure_key(twin, args, kwargs, dynamic_shapes)


def cached_export(twin: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                  export: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule:
    """``export()``'s graph, or a copy of the one exported earlier for the same key (module docstring)."""
    key = export_key(twin, args, kwargs, dynamic_shapes)  # None: no cache (unpicklable, or ENV "0")
    if key is None:
        stats.uncached += 1
        return export()
    if key in _CACHE:
        stats.hits += 1
        _CACHE.move_to_end(key)
        return copy.deepcopy(_CACHE[key])
    stats.misses += 1
    gm = export()
    _CACHE[key] = copy.deepcopy(gm)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return gm


def clear() -> None:
    """Forget every cached graph and reset the counters."""
    _CACHE.clear()
    stats.hits = stats.misses = stats.uncached = 0


__all__ = ["CACHE_SIZE", "ENV", "CacheStats", "cached_export", "clear", "export_key", "stats"]
