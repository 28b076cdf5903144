"""Pass ``shard_parameters``: every parameter becomes this rank's local shard, per its layer's strategy.

Pre-conditions: ``gm`` is an exported module (``ep.module()``) whose
parameters are reached by ``get_attr`` nodes; ``PassState.params``
maps every parameter FQN to ``(owner_layer, tp_role)`` (``build_program`` puts
it there from the ``ModelGraph``); the plan names every owner layer.

Post-conditions: a new module whose parameters are fresh, *uninitialised*
``nn.Parameter`` shards on ``ctx.device`` in ``ctx.compute_dtype`` with the
shapes of ``PassState.placements[fqn].local_shape`` (a
``ParamPlacement``, ``autoshard.passes.context``), and whose buffers are
uninitialised tensors of their full shape on ``ctx.device``; other pipeline
ranks' parameters stay on the meta device. The pass allocates only this
rank's shards and reads no values: ``gm`` may live on the meta device, and
``runtime/materialize.py`` fills shards and buffers afterwards from the model,
an initialiser or a file. The graph is unchanged: nodes that used a full
parameter now see a shard, and ``insert_collectives`` makes the graph valid
again (gathers for ZeRO-3, Megatron f/g around tp shards). The input module is
not modified.

Tensor-parallel layout (``TpLayout``, ``passes/context.py``) is read from the op
that uses a column / row weight, so it holds for any module that computes the
same op, whatever its type: ``linear(x, W)`` stores ``W`` as ``[out, in]``;
``addmm(b, x, W)``, ``mm(x, W)`` and ``matmul(x, W)`` (transformers' ``Conv1D``)
store it ``[in, out]``, which swaps the dims column and row split. A column
projection whose output (through reshapes that keep its last dim) is split into
``n`` equal parts along that dim (``split``, ``split_with_sizes``, ``chunk``:
GPT-2's fused ``c_attn`` → q, k, v; a fused gate/up) is fused with ``n`` parts,
and so is its bias. Unequal parts (a fused grouped-query qkv, [q | k | v] with
fewer k/v heads) cannot keep every rank's q, k and v heads together under
``_StridedShard``: ``PlanError`` for a tp plan of that layer.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from autoshard.errors import PlanError
from autoshard.passes import split_pipeline
from autoshard.passes._graph_utils import rebuild
from autoshard.passes.context import ParamPlacement, RankContext, TpLayout, gathers_in_graph, pass_state, placement_for
from autoshard.plan import Plan

NAME = "shard_parameters"
aten = torch.ops.aten
# projection op → (weight arg, bias arg, weight stored [in, out]); module docstring: tp layout
PROJECTIONS = {
    aten.linear.default: (1, 2, False),
    aten.addmm.default: (2, 0, True),
    aten.mm.default: (1, None, True),
    aten.matmul.default: (1, None, True),
}
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
            aten.unflatten.int)  # pure reshapes (no data moves)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def param_placements(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> dict[str, ParamPlacement]:
    """``ParamPlacement`` of every parameter of ``gm`` under ``plan`` on ``ctx``'s rank."""
    info = pass_state(gm).params
    roles = {fqn: role for fqn, (_layer, role) in info.items()}
    layouts = tp_layouts(gm.graph, roles) if ctx.size("tp") > 1 else {}
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
        layout = layouts.get(fqn, TpLayout())
        if isinstance(layout, str):  # a layout tp cannot shard (tp_layouts)
            if strategy.tp == "megatron" and ctx.size("tp") > 1:
                raise PlanError(f"layer {layer!r}: {layout}; use tp='none' for this layer")
            layout = TpLayout()
        out[fqn] = placement_for(fqn, tuple(param.shape), role, strategy, ctx, gathered_in_graph=in_graph,
                                 layout=layout)
    return out


def tp_layouts(graph: fx.Graph, roles: dict[str, str]) -> dict[str, TpLayout | str]:
    """FQN → ``TpLayout`` of every column / row parameter used by a projection op (module docstring),
    or the reason tp cannot shard it."""
    out: dict[str, TpLayout | str] = {}
    for node in graph.nodes:
        weight_at, bias_at, transposed = PROJECTIONS.get(node.target, (None, None, False))
        weight = _param_arg(node, weight_at)
        if weight is None or roles.get(weight) not in ("column", "row"):
            continue
        parts = _fused_parts(node, weight) if roles[weight] == "column" else 1
        bias = _param_arg(node, bias_at)
        if isinstance(parts, str):
            found = {weight: parts, bias: parts}
        else:
            found = {weight: TpLayout(transposed=transposed, parts=parts), bias: TpLayout(parts=parts)}
        for fqn, layout in found.items():
            if fqn is not None and out.setdefault(fqn, layout) != layout:
                out[fqn] = f"parameter {fqn!r} is used with two tp layouts ({out[fqn]} and {layout})"
    return out


def _param_arg(node: fx.Node, index: int | None) -> str | None:
    """FQN of the parameter (``get_attr``) at ``node.args[index]``, if it is one."""
    arg = node.args[index] if index is not None and index < len(node.args) else None
    return arg.target if isinstance(arg, fx.Node) and arg.op == "get_attr" else None


def _fused_parts(node: fx.Node, fqn: str) -> int | str:
    """How many equal parts a column projection's output is split into along its last dim (1: none);
    a reason string for unequal parts."""
    out = node
    while len(out.users) == 1:
        user = next(iter(out.users))
        val, last = user.meta.get("val"), out.meta["val"].shape[-1]
        if user.target in RESHAPES and isinstance(val, torch.Tensor) and val.shape[-1] == last:
            out = user
            continue
        if user.target not in _SPLITS or not isinstance(val, (list, tuple)):
            return 1
        dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        if dim % out.meta["val"].dim() != out.meta["val"].dim() - 1:
            return 1
        sizes = [int(t.shape[-1]) for t in val]
        if len(set(sizes)) > 1:
            return (f"the output of {fqn!r} is split into unequal parts {sizes} (a fused projection whose parts "
                    "differ, as grouped-query q/k/v): tp cannot give each rank its share of every part")
        return len(sizes)
    return 1


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Replace every parameter by its local shard (module docstring: pre/post-conditions)."""
    placements = param_placements(gm, plan, ctx)
    keep = split_pipeline.local_parameter_fqns(gm, plan, ctx)  # pp > 1: only this rank's stages (split_pipeline)
    replace = {}
    for fqn, param in gm.named_parameters():
        if keep is None or fqn in keep:
            local = torch.empty(placements[fqn].local_shape, device=ctx.device, dtype=ctx.compute_dtype)
        else:  # another pipeline rank's parameter: its shape on one meta element, no bytes even where ctx is meta
            local = torch.empty((), device="meta", dtype=ctx.compute_dtype).expand(placements[fqn].local_shape)
        replace[fqn] = nn.Parameter(local, requires_grad=param.requires_grad)
    for fqn, buffer in gm.named_buffers():
        replace[fqn] = torch.empty(buffer.shape, device=ctx.device, dtype=buffer.dtype)
    graph = copy.deepcopy(gm.graph)
    _canonical_targets(graph, {id(p): fqn for fqn, p in gm.named_parameters()}, gm)
    out = rebuild(gm, graph, replace)
    pass_state(out).placements = placements
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
