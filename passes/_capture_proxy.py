"""Capture, part 5: export three blocks of a deep uniform stack and expand to all of them.

Exporting is the slow step of capture (``llama:70b``: ~20 s on an idle 2-core
CPU for 80 blocks with dynamic shapes, twice that under load), and every block
of a uniform stack traces to the same nodes. So when

* the root has exactly one block container, an ``nn.ModuleList`` of
  ``L ≥ PROXY_MIN_BLOCKS`` blocks, and
* every block has the same *signature*: submodule names and types, parameter
  and buffer names, shapes, dtypes and ``requires_grad``, and every plain
  Python attribute (int, float, str, bool, None) of every submodule except
  those naming the position (``INDEX_ATTRS``: ``layer_idx`` …),

capture exports a *proxy*: a shallow copy of the root whose container holds
blocks ``(0, 1, L−1)`` (the same module objects; the user's model is not
touched) and maps the result back. Full block ``i`` takes the costs of proxy
block ``r(i)``: ``r(0) = 0``, ``r(L−1) = 2``, ``r(i) = 1`` otherwise. Edges
expand the same way; an edge from proxy block ``k`` to ``k+1`` is the
block-to-block pattern and holds for every ``i → i+1``.

The expansion is refused (capture then exports every block) unless the proxy
graph shows: block layers contiguous in execution order with the same local
order in each block; no node from outside the container attributed to a block
layer (root-level ops between blocks would be position-dependent); identical
``0→1`` and ``1→2`` edge patterns; no edge skipping a block. When the proxy is
used, the saved activations and the backward's working set are measured on it too
(a meta forward and backward of the whole model cost as much as the export at depth):
blocks 0, 1 and L−1 under their own names, every middle block taking block 1's
(``stand_in``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from autoshard.passes._capture_export import Accum, Exported, GraphView, root_nodes_in

PROXY_MIN_BLOCKS = 6
INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "block_index"})
_PLAIN = (int, float, str, bool, type(None))


def block_signature(block: nn.Module) -> tuple:
    """Everything about a block that can change what it computes, except position attributes."""
    modules = tuple(
        (name, type(m).__module__, type(m).__qualname__, _plain_attrs(m)) for name, m in block.named_modules()
    )
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return modules, params, buffers


def _plain_attrs(module: nn.Module) -> tuple:
    return tuple(
        sorted((k, v) for k, v in vars(module).items() if isinstance(v, _PLAIN) and k not in INDEX_ATTRS)
    )


@dataclass(frozen=True)
class Proxy:
    """A 3-block stand-in for the model and the name mapping back to all ``num_blocks`` blocks."""

    module: nn.Module
    container: str
    num_blocks: int

    def _split(self, name: str) -> tuple[int | None, str]:
        """``"blocks.7.attn"`` → ``(7, "attn")``; a name outside the container → ``(None, name)``."""
        head = f"{self.container}."
        if not name.startswith(head):
            return None, name
        index, _, local = name[len(head):].partition(".")
        return int(index), local

    def _join(self, block: int, local: str) -> str:
        return f"{self.container}.{block}.{local}" if local else f"{self.container}.{block}"

    def proxy_block(self, block: int) -> int:
        return 0 if block == 0 else 2 if block == self.num_blocks - 1 else 1

    def full_blocks(self, proxy_block: int) -> range:
        last = self.num_blocks - 1
        return {0: range(0, 1), 1: range(1, last), 2: range(last, last + 1)}[proxy_block]

    def stand_in(self, name: str) -> str:
        """The full-model name whose measurement on the proxy stands for ``name``: block 1's for a middle block."""
        block, local = self._split(name)
        return self._join(1, local) if block is not None and self.proxy_block(block) == 1 else name

    def proxy_name(self, name: str) -> str:
        block, local = self._split(name)
        return name if block is None else self._join(self.proxy_block(block), local)

    def expand(self, view: GraphView, exported: Exported) -> GraphView | None:
        """The full model's view from the proxy's, or None when a check of the module docstring fails."""
        order = self._expand_order(view.layer_order)
        edges = self._expand_edges(view.edges)
        if order is None or edges is None or root_nodes_in(exported, f"{self.container}."):
            return None
        costs = tuple({name: point.get(self.proxy_name(name), Accum()) for name in order} for point in view.costs)
        return GraphView(tuple(order), frozenset(edges), costs, view.dynamic_dims)

    def _expand_order(self, proxy_order: tuple[str, ...]) -> list[str] | None:
        blocks = [self._split(name)[0] for name in proxy_order]
        positions = [i for i, b in enumerate(blocks) if b is not None]
        span = blocks[positions[0]: positions[-1] + 1] if positions else [None]
        if None in span or span != sorted(span):
            return None  # block layers not contiguous, or blocks interleaved
        per_block = [[self._split(n)[1] for n in proxy_order if self._split(n)[0] == k] for k in range(3)]
        if not per_block[0] == per_block[1] == per_block[2]:
            return None
        body = [self._join(i, local) for i in range(self.num_blocks) for local in per_block[0]]
        return [*proxy_order[: positions[0]], *body, *proxy_order[positions[-1] + 1:]]

    def _expand_edges(self, proxy_edges: frozenset[tuple[str, str]]) -> set[tuple[str, str]] | None:
        out: set[tuple[str, str]] = set()
        steps: dict[int, set[tuple[str, str]]] = {0: set(), 1: set()}
        for a, b in proxy_edges:
            (ka, la), (kb, lb) = self._split(a), self._split(b)
            if ka is None and kb is None:
                out.add((a, b))
            elif ka is None:
                out.update((a, self._join(i, lb)) for i in self.full_blocks(kb))
            elif kb is None:
                out.update((self._join(i, la), b) for i in self.full_blocks(ka))
            elif ka == kb:
                out.update((self._join(i, la), self._join(i, lb)) for i in self.full_blocks(ka))
            elif kb == ka + 1:
                steps[ka].add((la, lb))
            else:
                return None
        if steps[0] != steps[1]:
            return None
        for i in range(self.num_blocks - 1):
            out.update((self._join(i, la), self._join(i + 1, lb)) for la, lb in steps[0])
        return out


def make_proxy(model: nn.Module) -> Proxy | None:
    """A ``Proxy`` when the model qualifies (module docstring), else None."""
    containers = [(n, c) for n, c in model.named_children() if isinstance(c, (nn.ModuleList, nn.ModuleDict))]
    if len(containers) != 1 or not isinstance(containers[0][1], nn.ModuleList):
        return None
    name, blocks = containers[0]
    if len(blocks) < PROXY_MIN_BLOCKS:
        return None
    first = block_signature(blocks[0])
    if any(block_signature(block) != first for block in blocks):
        return None
    module = copy.copy(model)  # shares parameters, submodules and config with the model
    modules = dict(model._modules)
    modules[name] = nn.ModuleList([blocks[0], blocks[1], blocks[-1]])
    object.__setattr__(module, "_modules", modules)
    return Proxy(module, name, len(blocks))
