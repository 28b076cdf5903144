"""Pass ``recompute``: activation-checkpoint regions (selective / full) and ZeRO-3 re-gather in backward.

Pre-conditions: ``insert_collectives`` ran. Post-conditions: (1) when the graph
has ``Zero3Gather`` modules and the program runs eager (not ``ctx.compiled``),
a ``Regather`` submodule ``autoshard_regather``
exists and every gather reports its outputs to it; the runtime runs the graph
inside ``torch.autograd.graph.saved_tensors_hooks(regather.pack,
regather.unpack)`` (``Program.forward``). (2) every checkpoint region of the
plan is outlined into a ``CheckpointRegion`` submodule
(``autoshard_ckpt_<layer>``) that runs its nodes through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: forward saves
only the region's inputs, backward re-runs the region (its collectives
included) and differentiates the recomputed graph.

[Note: checkpoint regions]
Regions follow the cost model (docs/cost-model.md, "Activations"):

* ``recompute="selective"`` (Korthikanti et al. 2022): the attention core —
  the nodes of the attention module itself between the q/k/v projections and
  the out projection (head views, RoPE, GQA expand, QKᵀ, mask, softmax,
  dropout, ·V, or SDPA). The S²-sized scores and probabilities are not kept;
  q, k, v are (region inputs). A layer whose own nodes contain no softmax /
  SDPA (an MLP, a norm) has no attention core: selective is a no-op there,
  as the cost model prices it (``Iₛ = 0``).
* ``recompute="full"``: a maximal run of consecutive full-recompute layers of
  one block (the module enclosing the layer, from ``nn_module_stack``; a
  top-level layer is its own block) is one region: every node from the run's
  first node to its last (the residual adds between its layers, the TP/SP
  collectives and ZeRO-3 gathers inserted for them) except parameter
  ``get_attr`` nodes. Only the region's input (the residual stream entering
  it, plus parameter shards) is kept.

A region is a set of nodes, not necessarily contiguous in the graph (the k
projection sits between q's head view and the attention core); it is outlined
at the position of its last node, which is valid when no outside node before
that position uses a region value (checked; ``PlanError`` otherwise).

ZeRO-3 composition: a full region contains its layers' ``Zero3Gather`` nodes,
so the recompute gathers the parameters again (one more all-gather per layer
in backward) and the gathered weights are never region inputs kept by the
checkpoint. Inside a region the checkpoint's own saved-tensor hooks are the
innermost ones, so ``Regather`` sees nothing there; outside regions it works
as before. The non-reentrant checkpoint re-runs collectives in backward in
graph order on every rank, so they line up.

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

[Note: backward prefetch]
With ``Regather.prefetch`` on, the unpack that re-gathers layer k also starts
(``Zero3Gather.start``: copy-in + ``autoshard::all_gather_start``, CUDA side
stream) the gather of the layer recorded just before k in forward, and the
next unpack of that layer takes it (``Zero3Gather.finish``) instead of a
blocking gather. At most one prefetch is in flight. Every rank runs the same
graph and the same hooks, so the collectives are issued in the same order on
all ranks. A prefetch whose layer backward never re-gathers (its weights were
saved by no op, or a misprediction) is waited in ``reset()``, so no collective
is left pending. Quantized layers are not prefetched (blocking quantized
re-gather, as before); pipelines (pp > 1) keep it off: their interleaved
micro-batch forwards make "the layer before" a poor guess.

Partial: a region holds whole layers of one pipeline stage; pipeline stage
splitting (when it lands) must keep regions inside stages. RNG state is
restored by ``checkpoint`` (``preserve_rng_state=True``), so dropout masks
recompute equal; this is exercised only with p = 0 models.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, copy_module, layer_of_path, tag
from autoshard.passes._zero3 import GradSink, Zero3Gather
from autoshard.passes.context import RankContext, pass_state
from autoshard.plan import Plan

NAME = "recompute"
REGATHER = "autoshard_regather"


def _storage_root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


class Regather(nn.Module):
    """Saved-tensor hooks that drop gathered ZeRO-3 weights at pack time and re-gather at unpack.

    With ``prefetch`` on (set by ``schedule_overlap`` when ``plan.schedule.prefetch > 0``
    and pp = 1; note "backward prefetch"), re-gathering layer k also starts the
    asynchronous all-gather of the layer gathered before k in forward, the one
    backward reaches next, so its transfer runs during layer k's backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple] = {}  # id(root) → (weakref(root), gather module, index, shards)
        self._cache: tuple | None = None  # (gather module, roots) of the last re-gather
        self._order: list[tuple] = []  # (gather module, shards) in forward order
        self._last: dict[int, int] = {}  # id(gather module) → index of its latest entry in _order
        self._prefetched: tuple | None = None  # (gather module, pending buffer) started ahead
        self.prefetch = False
        self.grad_sink = GradSink()  # backward reduce-scatters of the gathers that use it (passes/_zero3.py note)
        self.regathers = 0
        self.prefetches = 0  # prefetched gathers started
        self.prefetch_hits = 0  # of which taken by the re-gather they were started for

    def record(self, module: Zero3Gather, shards: tuple, roots: list[torch.Tensor]) -> None:
        """Called by a ``Zero3Gather`` in forward with its copy-out tensors."""
        shards = tuple(s.detach() for s in shards)
        for i, root in enumerate(roots):
            base = _storage_root(root)
            self._live[id(base)] = (weakref.ref(base), module, i, shards)
        self._last[id(module)] = len(self._order)  # its latest forward gather
        self._order.append((module, shards))

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
                self._cache = (module, self._regather(module, shards))
                if self.prefetch:
                    self._start_next(module)
            self.regathers += 1
        return _storage_root(self._cache[1][i]).as_strided(size, stride, offset)

    def _regather(self, module: Zero3Gather, shards: tuple) -> list[torch.Tensor]:
        """The layer's padded full tensors: from the prefetched gather when it is this layer's, else blocking."""
        if self._prefetched is not None and self._prefetched[0] is module:
            _module, pending = self._prefetched
            self._prefetched = None
            self.prefetch_hits += 1
            return module.finish(pending)
        return module.gather_roots(shards)

    def _start_next(self, module: Zero3Gather) -> None:
        """Start the gather of the layer recorded just before ``module``'s last forward gather (note)."""
        if self._prefetched is not None:
            return  # one in flight at most; it is waited when its layer is reached, or at reset()
        index = self._last.get(id(module))
        if index is None or index == 0:
            return
        previous, shards = self._order[index - 1]
        if previous is module or previous.spec.quantized:
            return
        self._prefetched = (previous, previous.start(shards))
        self.prefetches += 1

    def reset(self) -> None:
        """End of a backward: complete its reduce-scatters, wait a prefetch never used, forget the records."""
        self.grad_sink.drain()
        if self._prefetched is not None:
            module, pending = self._prefetched
            self._prefetched = None
            with torch.no_grad():
                module.finish(pending)  # every started collective is waited exactly once
        self._live.clear()
        self._order.clear()
        self._last.clear()
        self._cache = None

    def hooks(self):
        """The ``saved_tensors_hooks`` context to run the graph's forward in."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class CheckpointRegion(nn.Module):
    """Runs ``body`` (an outlined region) under non-reentrant activation checkpointing."""

    def __init__(self, body: fx.GraphModule, kind: str, layers: tuple[str, ...]) -> None:
        super().__init__()
        self.body, self.kind, self.layers = body, kind, layers

    def forward(self, *args):
        return checkpoint(self.body, *args, use_reentrant=False)


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Install ZeRO-3 re-gather, then outline checkpoint regions (module docstring).

    A compiled program (``ctx.compiled``) gets no ``Regather``: its gathers re-gather in the backward
    graph (``passes/_zero3.py`` note "compiled gather").
    """
    out = gm if ctx.compiled else _install_regather(gm)
    if all(s.recompute == "none" for s in plan.layers):
        return out
    if out is gm:
        out = copy_module(gm)  # the regions below edit the graph in place
    for name, kind, layers, nodes in checkpoint_regions(out.graph, plan):
        _outline(out, nodes, name, CheckpointRegion, kind=kind, layers=layers)
    out.graph.lint()
    out.recompile()
    return out


def _install_regather(gm: fx.GraphModule) -> fx.GraphModule:
    gathers = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Zero3Gather)}
    if not gathers:
        return gm
    regather = Regather()
    replace = {target: Zero3Gather(m.spec, on_gather=regather.record) for target, m in gathers.items()}
    out = copy_module(gm, replace)
    out.add_submodule(REGATHER, regather)
    pass_state(out).regather = REGATHER
    return out


# --------------------------------------------------------------------------- regions

_ATTENTION_CORE_OPS = (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default,
                       torch.ops.aten.scaled_dot_product_attention.default)


def _stack_paths(node: fx.Node) -> list[str]:
    return [path for path, _type in (node.meta.get("nn_module_stack") or {}).values()]


def checkpoint_regions(graph: fx.Graph, plan: Plan) -> list[tuple[str, str, tuple[str, ...], list[fx.Node]]]:
    """``(submodule name, kind, layers, nodes)`` of every checkpoint region (module docstring note)."""
    strategies = {s.layer: s for s in plan.layers}
    layer_nodes, block_of = _nodes_by_layer(graph, list(strategies))
    regions = []
    for layer, strategy in strategies.items():
        if strategy.recompute == "selective" and layer in layer_nodes:
            core = [n for n in layer_nodes[layer] if (_stack_paths(n) or [None])[-1] == layer]  # not q/k/v/o
            if any(n.target in _ATTENTION_CORE_OPS for n in core):
                regions.append((_region_name(layer), "selective", (layer,), core))
    for run_layers in _full_runs(list(strategies), strategies, block_of, layer_nodes):
        regions.append((_region_name(run_layers[0]), "full", tuple(run_layers), _full_region_nodes(graph, run_layers, layer_nodes)))
    return regions


def _nodes_by_layer(graph: fx.Graph, names: list[str]) -> tuple[dict[str, list[fx.Node]], dict[str, str | None]]:
    """Call nodes of each plan layer (innermost ``nn_module_stack`` match) and each layer's block path."""
    layer_nodes: dict[str, list[fx.Node]] = {}
    block_of: dict[str, str | None] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_module"):
            continue
        paths = _stack_paths(node)
        layer = next((found for path in reversed(paths) if (found := layer_of_path(path, names))), None)
        if layer is None:
            continue
        layer_nodes.setdefault(layer, []).append(node)
        if layer in paths:  # the enclosing module is the block ("" = the model: a top-level layer)
            i = paths.index(layer)
            block_of.setdefault(layer, paths[i - 1] if i > 0 and paths[i - 1] else None)
    return layer_nodes, block_of


def _region_name(layer: str) -> str:
    return "autoshard_ckpt_" + layer.replace(".", "_")


def _full_runs(names, strategies, block_of, layer_nodes) -> list[list[str]]:
    """Maximal runs of consecutive full-recompute layers (plan order) of one block and one stage."""
    runs: list[list[str]] = []
    prev = None
    for layer in names:
        s = strategies[layer]
        if s.recompute != "full" or layer not in layer_nodes:
            prev = None
            continue
        joins = (prev is not None and block_of.get(layer) is not None
                 and block_of.get(layer) == block_of.get(prev) and s.stage == strategies[prev].stage)
        if joins:
            runs[-1].append(layer)
        else:
            runs.append([layer])
        prev = layer
    return runs


def _full_region_nodes(graph: fx.Graph, layers: list[str], layer_nodes: dict) -> list[fx.Node]:
    """Every call node from the first to the last node of ``layers`` (ZeRO-3 gathers of those layers included)."""
    members = {n for layer in layers for n in layer_nodes[layer]}
    for node in graph.nodes:
        if node.op == "call_module" and (node.meta.get(META_KEY) or {}).get("layer") in layers:
            members.add(node)
            members.update(node.users)
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    first, last = min(index[n] for n in members), max(index[n] for n in members)
    return [n for n in order[first : last + 1] if n.op in ("call_function", "call_module") and not _shape_arithmetic(n)]


def _shape_arithmetic(node: fx.Node) -> bool:
    """A scalar computed from scalars alone (``s0 * s1`` of the inputs' sizes): it stays outside the region,
    where any later layer, and any pipeline stage, computes it again instead of receiving it from the
    region (a SymInt is no tensor a stage could send: ``split_pipeline``)."""
    if isinstance(node.meta.get("val"), torch.Tensor) or "val" not in node.meta:
        return False
    return all(not isinstance(a.meta.get("val"), torch.Tensor) and "val" in a.meta for a in node.all_input_nodes)


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, wrapper, **kwargs) -> None:
    """Move ``nodes`` of ``gm.graph`` into ``wrapper(body GraphModule, **kwargs)`` at submodule ``name`` (in place)."""
    graph = gm.graph
    index = {n: i for i, n in enumerate(graph.nodes)}
    nodes = sorted(set(nodes), key=index.__getitem__)
    members = set(nodes)
    last = nodes[-1]
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    for n in outputs:
        early = [u.name for u in n.users if u not in members and index[u] < index[last]]
        if early:
            raise PlanError(
                f"checkpoint region {name}: {n.name} is used by {early} before the region ends; "
                "this layer's graph cannot be recomputed as one region; choose another recompute for it"
            )
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = body.node_copy(n, env.__getitem__)
    body.output(tuple(env[n] for n in outputs))
    root = {n.target: gm.get_submodule(n.target) for n in nodes if n.op == "call_module"}
    gm.add_submodule(name, wrapper(fx.GraphModule(root, body, class_name="Region"), **kwargs))
    with graph.inserting_after(last):
        call = tag(graph.call_module(name, tuple(inputs)), NAME, f"{kwargs.get('kind')} recompute region",
                   layer=kwargs["layers"][0], **kwargs)  # ``layer``: split_pipeline stages the region by it
    item_at = call
    for i, n in enumerate(outputs):
        with graph.inserting_after(item_at):
            item_at = graph.call_function(operator.getitem, (call, i))
        item_at.meta = {k: v for k, v in n.meta.items() if k != META_KEY}
        n.replace_all_uses_with(item_at, delete_user_cb=lambda u: u not in members)
    for n in reversed(nodes):
        graph.erase_node(n)
