"""Expert parallelism: all-to-all dispatch and combine around the expert matmuls of an EP layer.

The reference MoE (``autoshard/models/moe.py``) runs its experts on a
capacity buffer ``[E, C, h]`` whose shape depends only on the token count, so
every rank of an ep group has the same C (equal local batches). Under EP the
expert weights are split on dim 0 over the ep group (``ParamPlacement.ep_dim``;
rank ``i`` of the group holds experts ``[i·E/ep, (i+1)·E/ep)``, E_l = E/ep), and:

    dispatch: buffer [E, C, h] --all_to_all(dim 0, equal splits E_l)--> [ep·E_l, C, h]
              (chunk r = rank r's rows for MY experts) → view (ep, E_l, C, h)
              → transpose → [E_l, ep·C, h]    each local expert sees every rank's tokens
    experts:  the graph's own bmm / SwiGLU on [E_l, ep·C, h] with the local [E_l, f, h] weights
    combine:  [E_l, ep·C, h] → view (E_l, ep, C, h) → transpose → [ep·E_l, C, h]
              --all_to_all--> [E, C, h] (chunk r = rank r's experts' outputs for MY tokens)

so the rest of the layer (index_select of slots, weighted sum) is unchanged.
``all_to_all``'s backward is the reverse all-to-all (per-rank-losses
convention): an expert weight's gradient on its rank is the sum over the ep
group's losses; the optimizer sums it over the expert-data-parallel group
(``"edp"``: dp ranks holding the same experts) and divides by dp, which is the
gradient of the mean of all dp ranks' losses (``runtime/optimizer.py``).

Which nodes: an *expert matmul* is a ``bmm`` whose second operand is an
ep-split parameter (through ``transpose`` / ``view`` / ``t``). Its first
operand is a dispatch point unless it is computed from another expert matmul
(the down projection consumes the SwiGLU product); an expert matmul from which
no other expert matmul of the same layer is reachable is a combine point. One dispatch per
buffer node, one combine per exit.

Partial: EP layers must be ``state="replicate"``, ``tp="none"`` (``PlanError``
from ``placement_for`` otherwise); no capacity re-balancing across ranks (the
buffer is exchanged whole, including empty capacity slots).
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import tag
from autoshard.passes.context import RankContext
from autoshard.kernels import collectives

aten = torch.ops.aten
_THROUGH = (aten.transpose.int, aten.t.default, aten.view.default, aten.permute.default, aten.reshape.default)


def ep_dispatch(buffer: torch.Tensor, group_name: str, ep: int) -> torch.Tensor:
    """[E, C, h] → [E/ep, ep·C, h]: every rank's rows for this rank's experts (module docstring)."""
    num_experts, capacity, hidden = buffer.shape
    local = num_experts // ep
    received = collectives.all_to_all(buffer, [local] * ep, [local] * ep, group_name)  # [ep·E_l, C, h]
    return received.view(ep, local, capacity, hidden).transpose(0, 1).reshape(local, ep * capacity, hidden)


def ep_combine(out: torch.Tensor, group_name: str, ep: int) -> torch.Tensor:
    """[E/ep, ep·C, h] → [E, C, h]: this rank's tokens' outputs from every rank's experts."""
    local, rows, hidden = out.shape
    capacity = rows // ep
    send = out.view(local, ep, capacity, hidden).transpose(0, 1).reshape(ep * local, capacity, hidden)
    return collectives.all_to_all(send, [local] * ep, [local] * ep, group_name)  # [E, C, h]


def insert_expert_parallel(graph: fx.Graph, placements: dict, ctx: RankContext, pass_name: str) -> int:
    """Insert dispatch/combine around the expert matmuls of ep-split parameters; returns how many pairs."""
    if ctx.size("ep") <= 1:
        return 0
    expert_mms = [n for n in graph.nodes if n.op == "call_function" and n.target == aten.bmm.default
                  and _expert_param(n.args[1], placements) is not None]
    _check_every_split_layer_dispatches(graph, placements, {_expert_param(n.args[1], placements).layer
                                                            for n in expert_mms})
    if not expert_mms:
        return 0
    group, ep = ctx.group("ep"), ctx.size("ep")
    layer_of = {n: _expert_param(n.args[1], placements).layer for n in expert_mms}
    same_layer = {n: {m for m in expert_mms if layer_of[m] == layer_of[n]} for n in expert_mms}
    downstream = {n: _reachable(n) for n in expert_mms}
    dispatched: dict[fx.Node, fx.Node] = {}
    for mm in expert_mms:
        buffer = mm.args[0]
        if any(buffer in downstream[m] for m in same_layer[mm]):
            continue
        if buffer not in dispatched:
            with graph.inserting_after(buffer):
                dispatched[buffer] = tag(graph.call_function(ep_dispatch, (buffer, group, ep)), pass_name,
                                         "EP: all-to-all the capacity buffer to the experts' ranks")
        mm.update_arg(0, dispatched[buffer])
    exits = [mm for mm in expert_mms if not (downstream[mm] & same_layer[mm])]
    for mm in exits:
        with graph.inserting_after(mm):
            combined = tag(graph.call_function(ep_combine, (mm, group, ep)), pass_name,
                           "EP: all-to-all expert outputs back to the tokens' ranks")
        mm.replace_all_uses_with(combined, delete_user_cb=lambda u: u is not combined)
    return len(exits)


def _check_every_split_layer_dispatches(graph: fx.Graph, placements: dict, dispatched: set[str]) -> None:
    """``PlanError`` for a layer whose experts are split over ep but which has no expert ``bmm`` to
    dispatch at: its tokens would reach only this rank's experts (capture's ``LayerInfo.ep_refusal``
    keeps the search from proposing such a plan; this catches a plan made without it)."""
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    split = sorted({p.layer for fqn, p in placements.items() if p.ep_dim is not None and fqn in used} - dispatched)
    if split:
        raise PlanError(f"layer {split[0]!r}: expert parallelism splits its experts over ep, but its experts do not "
                        "run as bmm on a per-expert capacity buffer [E, C, h] (what the all-to-all exchanges); "
                        "plan it with ep = 1")


def _expert_param(node, placements: dict):
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _THROUGH:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr":
        p = placements.get(node.target)
        if p is not None and p.ep_dim is not None:
            return p
    return None


def _reachable(start: fx.Node) -> set[fx.Node]:
    """Nodes computed from ``start`` (excluding it)."""
    seen: set[fx.Node] = set()
    stack = list(start.users)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.users)
    return seen
