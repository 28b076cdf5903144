"""Pass ``shard_parameters``: every parameter becomes this rank's local shard, per its layer's strategy.

Pre-conditions: ``gm`` is an exported module (``ep.module()``) whose
parameters are reached by ``get_attr`` nodes; ``gm.meta["autoshard"]["params"]``
maps every parameter FQN to ``(owner_layer, tp_role)`` (``build_program`` puts
it there from the ``ModelGraph``); the plan names every owner layer.

Post-conditions: a new module whose parameters are fresh, *uninitialised*
``nn.Parameter`` shards on ``ctx.device`` in ``ctx.compute_dtype`` with the
shapes of ``gm.meta["autoshard"]["placements"][fqn].local_shape`` (a
``ParamPlacement``, ``autoshard.passes.context``), and whose buffers are
uninitialised tensors of their full shape on ``ctx.device``; other pipeline
ranks' parameters stay on the meta device. The pass allocates only this
rank's shards and reads no values: ``gm`` may live on the meta device, and
``runtime/materialize.py`` fills shards and buffers afterwards from the model,
an initialiser or a file. The graph is unchanged: nodes that used a full
parameter now see a shard, and ``insert_collectives`` makes the graph valid
again (gathers for ZeRO-3, Megatron f/g around tp shards). The input module is
not modified.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from autoshard.errors import PlanError
from autoshard.passes import split_pipeline
from autoshard.passes._graph_utils import META_KEY, rebuild
from autoshard.passes.context import ParamPlacement, RankContext, gathers_in_graph, placement_for
from autoshard.plan import Plan

NAME = "shard_parameters"


def param_placements(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> dict[str, ParamPlacement]:
    """``ParamPlacement`` of every parameter of ``gm`` under ``plan`` on ``ctx``'s rank."""
    info = gm.meta[META_KEY]["params"]
    out = {}
    for fqn, param in gm.named_parameters():
        if fqn not in info:
            raise PlanError(
                f"parameter {fqn!r} of the exported model has no owner layer in the captured graph; "
                "capture the same model the program is built from"
            )
        layer, role = info[fqn]
        try:
            strategy = plan.strategy(layer)
        except KeyError:
            raise PlanError(
                f"plan for model {plan.model_name!r} has no layer {layer!r} (owner of {fqn!r}); "
                "search a plan for this model"
            ) from None
        in_graph = gathers_in_graph(strategy, ctx, plan.schedule.num_micro_batches)
        out[fqn] = placement_for(fqn, tuple(param.shape), role, strategy, ctx, gathered_in_graph=in_graph)
    return out


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Replace every parameter by its local shard (module docstring: pre/post-conditions)."""
    placements = param_placements(gm, plan, ctx)
    keep = split_pipeline.local_parameter_fqns(gm, plan, ctx)  # pp > 1: only this rank's stages (split_pipeline)
    replace = {}
    for fqn, param in gm.named_parameters():
        device = ctx.device if keep is None or fqn in keep else "meta"  # meta: another pipeline rank's parameter
        local = torch.empty(placements[fqn].local_shape, device=device, dtype=ctx.compute_dtype)
        replace[fqn] = nn.Parameter(local, requires_grad=param.requires_grad)
    for fqn, buffer in gm.named_buffers():
        replace[fqn] = torch.empty(buffer.shape, device=ctx.device, dtype=buffer.dtype)
    graph = copy.deepcopy(gm.graph)
    _canonical_targets(graph, {id(p): fqn for fqn, p in gm.named_parameters()}, gm)
    out = rebuild(gm, graph, replace)
    out.meta[META_KEY]["placements"] = placements
    return out


def _canonical_targets(graph: fx.Graph, fqn_of: dict[int, str], gm: fx.GraphModule) -> None:
    """Point every ``get_attr`` of a tied parameter (``head.weight`` = ``embed.weight``) at its one FQN."""
    for node in graph.nodes:
        if node.op == "get_attr":
            obj = gm.get_parameter(node.target) if _is_param(gm, node.target) else None
            if obj is not None and fqn_of.get(id(obj), node.target) != node.target:
                node.target = fqn_of[id(obj)]


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True
