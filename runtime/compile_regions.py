"""Compile regions: where ``torch.compile`` cuts the per-rank graph (``BuildOptions.regions``).

``"stem"`` (the default): one ``torch._dynamo.graph_break()`` in front of the first transformer
block, so dynamo compiles the model-level prologue (embedding, RoPE tables) as one graph and
everything from the first block on as another. ``"block"``: a break in front of every block and
after the last, one graph per block. ``"graph"``: one graph for the whole per-rank program.

Why ``"stem"``: the RoPE cos/sin tables are computed once at the model level from ``arange`` and
read by every block. Over one whole graph inductor fused their computation (``pow``,
``reciprocal``, ``cos``, ``sin``) into every block's rotary kernel, forward and backward: on
2×H100 (Llama-1.3B, DP plan, torch 2.11) 96 such kernels took 13 ms of a 173 ms step. Across a
region boundary the tables are an input of the block graph, computed once per step.

Why not ``"block"`` by default, though it hands gradients over block by block (a single graph
returns every gradient at the end of its one backward, so the overlapped DP gradient sync had
nothing to overlap) as FSDP2 with compiled blocks does: measured on the same machine, compiling
24 block graphs of Llama-1.3B took more than the 150 s a benchmark process is given, and GPT-1.3B
with the overlapped sync stepped in 218 ms against 176 ms as one graph, the reduce-scatters
contending with the backward's kernels (docs/runtime.md, "Compiled per-rank graph").

Regions come from the nodes' ``nn_module_stack`` (kept by ``torch.export`` and by the passes'
node copies): a node's region is the shortest module path in its stack whose last component is
an integer (``blocks.7``: an entry of a ``ModuleList``), or ``None`` at the model level. A node
with no stack of its own (inserted collectives, shape reads) stays in the region before it. Each
``get_attr`` (a parameter) moves in front of its first user, so a region reads its own
parameters rather than receiving every parameter as a live local across each break. Eager runs
are unchanged: ``graph_break()`` does nothing outside dynamo.
"""

from __future__ import annotations

import torch

REGIONS = ("stem", "block", "graph")
_BREAK = torch._dynamo.graph_break


def region_of(node: torch.fx.Node) -> str | None | bool:
    """The block path of ``node`` (``"blocks.3"``), ``None`` at the model level, ``False`` without a stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return False
    paths = [path for path, _type in stack.values() if isinstance(path, str)]
    if not paths or all(p.startswith("_empty_nn_module_stack") for p in paths):
        return False
    blocks = [p for p in paths if p and p.rsplit(".", 1)[-1].isdigit()]
    return min(blocks, key=len) if blocks else None


def insert_region_breaks(gm: torch.fx.GraphModule, regions: str = "block") -> int:
    """Put dynamo graph breaks into ``gm`` (module docstring): at every region change (``"block"``),
    or only in front of the first block (``"stem"``); the number inserted.

    Idempotent: a graph that already holds breaks is left as it is.
    """
    graph = gm.graph
    if any(n.op == "call_function" and n.target is _BREAK for n in graph.nodes):
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.users]:
        min(node.users, key=order.__getitem__).prepend(node)  # in front of its first user
    breaks, current = 0, None
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        region = region_of(node)
        if region is False or region == current:
            continue
        # "block": at every change; "stem": only the first step from the model level into a block
        if regions == "block" or (current is None and breaks == 0):
            with graph.inserting_before(_first_of_run(node)):
                graph.call_function(_BREAK, ())
            breaks += 1
        current = region
    graph.lint()
    gm.recompile()
    return breaks


def _first_of_run(node: torch.fx.Node) -> torch.fx.Node:
    """``node``, or the first of the parameter reads right before it (they are its region's)."""
    first = node
    while first.prev.op == "get_attr":
        first = first.prev
    return first


__all__ = ["REGIONS", "insert_region_breaks", "region_of"]
