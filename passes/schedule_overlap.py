"""Pass ``schedule_overlap``: issue ZeRO-3 all-gathers ahead of their layer (prefetch).

Pre-conditions: ``insert_collectives`` ran (``Zero3Gather`` call nodes exist for
ZeRO-3 layers). Post-conditions: the gather of the k-th ZeRO-3 layer (in
execution order) is moved to right after the gather of layer
``k - plan.schedule.prefetch``, so at most
``prefetch + 1`` layers' full parameters are alive in forward; each moved node
records why in ``node.meta["autoshard"]``. ``prefetch = 0`` leaves the graph
as it is.

Partial: the ``autoshard::`` collectives are blocking, so moving a gather earlier
changes the order and peak memory but does not yet overlap it with compute
(that needs async collectives + wait nodes); gradient bucketing
(``schedule.bucket_bytes``) is not applied (the optimizer reduces per parameter).
"""

from __future__ import annotations

import copy

from torch import fx

from autoshard.passes._graph_utils import rebuild, tag
from autoshard.passes._zero3 import Zero3Gather
from autoshard.passes.context import RankContext
from autoshard.plan import Plan

NAME = "schedule_overlap"


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Hoist ZeRO-3 gathers by ``plan.schedule.prefetch`` layers (module docstring)."""
    prefetch = plan.schedule.prefetch
    graph = copy.deepcopy(gm.graph)
    gathers = [n for n in graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Zero3Gather)]
    if prefetch <= 0 or len(gathers) < 2:
        return gm
    for k in range(prefetch, len(gathers)):
        node, earlier = gathers[k], gathers[k - prefetch]
        items = list(node.users)  # the getitem nodes of the gathered parameters
        anchor = list(earlier.users)[-1]
        anchor.append(node)
        for item in reversed(items):
            node.append(item)
        tag(node, NAME, f"prefetch: all-gather issued {prefetch} layer(s) ahead of use", layer=gm.get_submodule(node.target).spec.layer)
    graph.lint()
    out = rebuild(gm, graph)
    out.recompile()
    return out
