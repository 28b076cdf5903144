"""Pass ``insert_collectives``: make the sharded graph compute the unsharded model again.

Pre-conditions: ``shard_parameters`` ran (``gm.meta["autoshard"]["placements"]``
exists and parameters are local shards). Post-conditions: every use of a
parameter sees the tensor its consumer needs, and every activation crossing a
tensor-parallel boundary carries the Megatron f/g op that keeps forward values
and gradients equal to single-device training under a loss replicated over tp.
Each inserted node records why in ``node.meta["autoshard"]``.

Tensor parallelism is a table, ``TP_TABLE``: (producer placement, consumer
placement) → collective. Placements over the tp axis:

    replicate     every tp rank holds the same full tensor
    shard         local features/heads (column-parallel output, attention core)
    partial       each rank holds a summand (row-parallel output, vocab-masked embedding)
    vocab_shard   logits over this rank's vocabulary slice

    (replicate,   column)    → copy_to_tp       f: identity fwd, all-reduce bwd
    (partial,     replicate) → reduce_from_tp   g: all-reduce fwd, identity bwd
    (vocab_shard, replicate) → gather_from_sp(-1, grad_is_partial=False): all-gather logits
    (shard,       row)       → nothing          already local
    (replicate,   replicate) → nothing

A node's consumer placement comes from its parameter: a linear whose weight
is tp-split on dim 0 with role column is column-parallel (its output is
``shard``); split on dim 1, row-parallel (bias added after g); an embedding
or linear on a vocab-split weight is vocab-parallel. Any other node outputs
``shard`` if an input is ``shard``, else ``replicate``. Decisions: the LM head's
logits are all-gathered (PPO needs log-probs of chosen tokens and the entropy
of the full distribution; a vocab-parallel log-softmax is left for later); a
row-parallel bias is added once, after the all-reduce; ``f`` is inserted once
per producer, shared by all its column consumers (one backward all-reduce for
q, k and v together). Static head counts: the exported graph writes the kv
head count of GQA's ``expand`` as a literal; inside a ``shard`` region that
literal (dim 1 of a 5-d expand) is divided by tp.

ZeRO-3: for each layer whose parameters are split over dp_shard one
``Zero3Gather`` submodule is inserted before the first use (``passes/_zero3.py``:
one all-gather per layer forward, one reduce-scatter per layer backward).

Gradient reductions of DDP / ZeRO-1/2 / HSDP's replicate axis are not graph
nodes: they act on ``.grad`` after backward, in the runtime's optimizer
(``runtime/optimizer.py``), bucketed per parameter.

Not handled (clear ``PlanError``): sequence parallelism, tp on MoE layers.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, node_layer, rebuild, tag
from autoshard.passes._zero3 import GatherSpec, Zero3Gather
from autoshard.passes.context import RankContext
from autoshard.plan import Plan
from autoshard.runtime import collectives

NAME = "insert_collectives"
aten = torch.ops.aten

# (producer placement, consumer placement) → (collective, why); None = nothing to insert.
TP_TABLE: dict[tuple[str, str], tuple | None] = {
    ("replicate", "column"): (collectives.copy_to_tp, "Megatron f: replicated input of a column-parallel layer"),
    ("partial", "replicate"): (collectives.reduce_from_tp, "Megatron g: sum the partial outputs over tp"),
    ("vocab_shard", "replicate"): (None, "all-gather vocab-parallel logits (replicated loss)"),
    ("shard", "row"): None,
    ("replicate", "replicate"): None,
    ("shard", "shard"): None,
}


def vocab_parallel_embedding(weight: torch.Tensor, tokens: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Embedding over this rank's vocabulary rows [vocab_start, vocab_start + V/tp); others give 0 (partial)."""
    local_vocab = weight.shape[0]
    outside = (tokens < vocab_start) | (tokens >= vocab_start + local_vocab)  # [B, S]
    local_ids = (tokens - vocab_start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local_ids, weight)  # [B, S, h]
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def gather_logits(logits: torch.Tensor, group_name: str) -> torch.Tensor:
    """[B, S, V/tp] → [B, S, V]; backward keeps this rank's slice (the loss is replicated over tp)."""
    return collectives.gather_from_sp(logits, -1, group_name, grad_is_partial=False)


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Insert TP and ZeRO-3 collectives (module docstring: table and pre/post-conditions)."""
    _check_supported(plan, ctx)
    graph = copy.deepcopy(gm.graph)
    placements = gm.meta[META_KEY]["placements"]
    if ctx.size("tp") > 1:
        roles = {fqn: role for fqn, (_layer, role) in gm.meta[META_KEY]["params"].items()}
        _TPRewriter(graph, placements, roles, ctx).run()
    modules = _insert_zero3_gathers(graph, placements, ctx)
    graph.lint()
    out = rebuild(gm, graph, modules)
    out.recompile()
    return out


def _check_supported(plan: Plan, ctx: RankContext) -> None:
    for s in plan.layers:
        if s.sp and ctx.size("tp") > 1:
            raise PlanError(
                f"layer {s.layer!r}: sequence parallelism (sp=True) is not implemented by the runtime yet; "
                "set sp=False for this layer"
            )


class _TPRewriter:
    """Walks the graph once, tracking each node's tp placement and applying ``TP_TABLE``."""

    def __init__(self, graph: fx.Graph, placements: dict, roles: dict, ctx: RankContext) -> None:
        self.graph, self.placements, self.roles, self.ctx = graph, placements, roles, ctx
        self.group = ctx.group("tp")
        self.state: dict[fx.Node, str] = {}
        self.f_of: dict[fx.Node, fx.Node] = {}  # producer → its copy_to_tp node

    def param_of(self, node) -> object:
        if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in self.placements:
            return self.placements[node.target]
        return None

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.state[node] = self.visit(node)
            else:
                self.state[node] = "replicate"

    def visit(self, node: fx.Node) -> str:
        weight = self.param_of(node.args[1]) if len(node.args) > 1 else None
        if node.target == aten.embedding.default:
            weight = self.param_of(node.args[0])
            if weight is not None and weight.tp_dim == 0:
                return self.vocab_embedding(node, weight)
        if node.target == aten.linear.default and weight is not None and weight.tp_dim is not None:
            if self.roles.get(weight.fqn) == "vocab":
                return self.vocab_head(node)
            return self.column(node) if weight.tp_dim == 0 else self.row(node)
        inputs = [self.state.get(a, "replicate") for a in node.all_input_nodes]
        if "shard" in inputs:
            self.fix_static_heads(node)
            return "shard"
        return "replicate"

    def convert(self, producer: fx.Node, consumer_placement: str, before: fx.Node) -> fx.Node:
        key = (self.state.get(producer, "replicate"), consumer_placement)
        if key not in TP_TABLE:
            raise PlanError(f"no tp conversion from {key[0]!r} to {key[1]!r} at node {producer.name}")
        rule = TP_TABLE[key]
        if rule is None:
            return producer
        if key == ("replicate", "column") and producer in self.f_of:
            return self.f_of[producer]
        fn, why = rule
        with self.graph.inserting_before(before):
            new = self.graph.call_function(fn, (producer, self.group))
        tag(new, NAME, why, table_key=key)
        self.f_of[producer] = new
        return new

    def column(self, node: fx.Node) -> str:
        node.update_arg(0, self.convert(node.args[0], "column", node))
        return "shard"

    def row(self, node: fx.Node) -> str:
        bias = node.args[2] if len(node.args) > 2 else None
        node.args = (node.args[0], node.args[1])
        fn, why = TP_TABLE[("partial", "replicate")]
        with self.graph.inserting_after(node):
            reduced = tag(self.graph.call_function(fn, (node, self.group)), NAME, why, table_key=("partial", "replicate"))
        users = [u for u in node.users if u is not reduced]
        out = reduced
        if bias is not None:
            with self.graph.inserting_after(reduced):
                out = tag(self.graph.call_function(aten.add.Tensor, (reduced, bias)), NAME, "row-parallel bias, added once after g")
        for user in users:
            user.replace_input_with(node, out)
        self.state[reduced] = self.state[out] = "replicate"
        return "partial"

    def vocab_embedding(self, node: fx.Node, weight) -> str:
        local_vocab = weight.global_shape[0] // self.ctx.size("tp")  # tp-local rows, before any ZeRO-3 split
        node.target = vocab_parallel_embedding
        node.args = (node.args[0], node.args[1], self.ctx.coord("tp") * local_vocab)
        tag(node, NAME, "vocab-parallel embedding: rows outside this rank's vocabulary slice give 0")
        fn, why = TP_TABLE[("partial", "replicate")]
        with self.graph.inserting_after(node):
            reduced = tag(self.graph.call_function(fn, (node, self.group)), NAME, why, table_key=("partial", "replicate"))
        node.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
        self.state[reduced] = "replicate"
        return "partial"

    def vocab_head(self, node: fx.Node) -> str:
        node.update_arg(0, self.convert(node.args[0], "column", node))
        _fn, why = TP_TABLE[("vocab_shard", "replicate")]
        with self.graph.inserting_after(node):
            full = tag(self.graph.call_function(gather_logits, (node, self.group)), NAME, why)
        node.replace_all_uses_with(full, delete_user_cb=lambda u: u is not full)
        self.state[full] = "replicate"
        return "vocab_shard"

    def fix_static_heads(self, node: fx.Node) -> None:
        if node.target != aten.expand.default:
            return
        shape = list(node.args[1])
        if len(shape) == 5 and isinstance(shape[1], int):
            tp = self.ctx.size("tp")
            if shape[1] % tp:
                raise PlanError(
                    f"GQA: {shape[1]} key/value heads are not divisible by tp={tp}; choose tp dividing "
                    "num_kv_heads or tp='none' for the attention layers"
                )
            shape[1] //= tp
            node.update_arg(1, shape)
            tag(node, NAME, "local key/value head count under tp")


def _insert_zero3_gathers(graph: fx.Graph, placements: dict, ctx: RankContext) -> dict:
    """One ``Zero3Gather`` per layer with dp_shard-split parameters, before the layer's first use."""
    by_layer: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        p = placements.get(node.target) if node.op == "get_attr" else None
        if p is not None and p.dp_dim is not None and node.users:
            by_layer.setdefault(p.layer, []).append(node)
    modules = {}
    for layer, attrs in by_layer.items():
        spec = GatherSpec(
            layer=layer,
            fqns=tuple(n.target for n in attrs),
            group_name=ctx.group("dp_shard"),
            num_ranks=ctx.size("dp_shard"),
            global_dim0=tuple(_tp_local_shape(placements[n.target], ctx)[0] for n in attrs),
            rest_shapes=tuple(tuple(placements[n.target].local_shape[1:]) for n in attrs),
        )
        target = "autoshard_gather_" + layer.replace(".", "_")
        modules[target] = Zero3Gather(spec)
        first_use = min((u for n in attrs for u in n.users), key=_order(graph))
        with graph.inserting_before(first_use):
            call = tag(graph.call_module(target, tuple(attrs)), NAME, "ZeRO-3: all-gather the layer's parameters", layer=layer)
            for i, attr in enumerate(attrs):
                item = tag(graph.call_function(operator.getitem, (call, i)), NAME, "ZeRO-3 gathered parameter", param=attr.target)
                attr.replace_all_uses_with(item, delete_user_cb=lambda u: u is not call)
    return modules


def _tp_local_shape(p, ctx: RankContext) -> tuple[int, ...]:
    shape = list(p.global_shape)
    if p.tp_dim is not None:
        shape[p.tp_dim] //= ctx.size("tp")
    return tuple(shape)


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]
