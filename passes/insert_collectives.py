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
    seq_shard     sequence parallelism: this rank's chunk of the sequence dim, all features

    (replicate,   column)    → copy_to_tp       f: identity fwd, all-reduce bwd
    (partial,     replicate) → reduce_from_tp   g: all-reduce fwd, identity bwd
    (vocab_shard, replicate) → gather_from_sp(-1, grad_is_partial=False): all-gather logits
    (shard,       row)       → nothing          already local
    (replicate,   replicate) → nothing
    (seq_shard,   column)    → gather_from_sp(seq, grad_is_partial=True)   SP g-bar: all-gather fwd, reduce-scatter bwd
    (partial,     seq_shard) → reduce_scatter(seq, "sum")                  SP g: reduce-scatter fwd, all-gather bwd
    (replicate,   seq_shard) → scatter_to_sp(seq)                          keep own chunk fwd, all-gather bwd
    (seq_shard,   replicate) → gather_from_sp(seq, grad_is_partial=False)  all-gather fwd, keep own chunk bwd
    (param,       seq_shard) → copy_to_tp                                  replicated param used on seq chunks

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022): a layer with
``sp=True`` whose output is ``partial`` (row-parallel linear, vocab-parallel
embedding) reduce-scatters it along the sequence instead of all-reducing, so
the following norm / dropout / residual region runs on ``seq_shard``
activations; a column-parallel consumer (the next block's q/k/v or up/gate, the
LM head) all-gathers the sequence first. ``seq_shard`` propagates through any
op that has a ``seq_shard`` input and no ``shard`` input; its other activation
inputs that carry the sequence dim (GPT's position embedding) are scattered,
and the graph outputs (values) are gathered back to replicate. The sequence
dim of an activation is found by matching its symbolic size with the tokens'
dim 1 (so the batch-first [B, S, h] layout is required; an op whose output
loses the sharded dim raises ``PlanError``). Parameters that are replicated
over tp but used on sequence chunks (norm weights, row-parallel biases, the
value head) get per-rank partial gradients; each use is wrapped in
``copy_to_tp`` (identity forward, all-reduce over tp backward), so the grad is
summed over tp in the graph and the optimizer sees full, tp-replicated
gradients. Decision: one all-reduce per such parameter per micro-batch
(Megatron batches them once per step; these are hidden-sized vectors). Every
value left on ``seq_shard`` records ``node.meta["autoshard"]["seq_shard"] =
(sequence dim, tp)``: ``split_pipeline`` sends such a value across a stage
boundary as this rank's chunk.

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

Expert parallelism (layers with ``ep=True``, mesh ep > 1): all-to-all
dispatch before and combine after the expert matmuls of ep-split weights
(``passes/_expert_parallel.py``).

Gradient reductions of DDP / ZeRO-1/2 / HSDP's replicate axis: in a compiled
program with one micro-batch on one stage and unquantized wires they are
backward graph nodes (``GradSync`` per DDP / ZeRO-1/2 parameter; HSDP's replica
all-reduce after each ZeRO-3 layer's reduce-scatter, ``Zero3Gather.replicate``),
listed in ``gm.meta["autoshard"]["grads_reduced_in_graph"]``; otherwise they act
on ``.grad`` after backward, in the runtime's optimizer (``runtime/optimizer.py``),
bucketed per parameter.

Not handled (clear ``PlanError``): tp on MoE layers; SP with a sequence length
not divisible by tp fails in the collective (``CollectiveError``).
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx, nn

from autoshard.data_parallel import data_parallel_form
from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, rebuild, tag
from autoshard.passes._expert_parallel import insert_expert_parallel
from autoshard.passes._zero3 import GatherSpec, Zero3Gather
from autoshard.passes.context import RankContext
from autoshard.plan import Plan
from autoshard.runtime import collectives, traced_collectives

NAME = "insert_collectives"
aten = torch.ops.aten



def sp_gather(x: torch.Tensor, group_name: str, dim: int) -> torch.Tensor:
    """SP → column-parallel: all-gather ``dim`` (backward: reduce-scatter of the partial input grads)."""
    return collectives.gather_from_sp(x, dim, group_name, grad_is_partial=True)


def sp_reduce_scatter(x: torch.Tensor, group_name: str, dim: int) -> torch.Tensor:
    """Row-parallel partial sums → SP: reduce-scatter along ``dim`` (backward: all-gather)."""
    return collectives.reduce_scatter(x, dim, group_name, "sum")


def sp_scatter(x: torch.Tensor, group_name: str, dim: int) -> torch.Tensor:
    """Replicated activation → SP: this rank's chunk of ``dim`` (backward: all-gather)."""
    return collectives.scatter_to_sp(x, dim, group_name)


def sp_gather_replicated(x: torch.Tensor, group_name: str, dim: int) -> torch.Tensor:
    """SP → replicated consumer: all-gather ``dim`` (backward: keep this rank's chunk)."""
    return collectives.gather_from_sp(x, dim, group_name, grad_is_partial=False)


_SP_FNS = (sp_gather, sp_reduce_scatter, sp_scatter, sp_gather_replicated)

# (producer placement, consumer placement) → (collective, why); None = nothing to insert.
# SP entries take the sequence dim as a third argument.
TP_TABLE: dict[tuple[str, str], tuple | None] = {
    ("replicate", "column"): (collectives.copy_to_tp, "Megatron f: replicated input of a column-parallel layer"),
    ("partial", "replicate"): (collectives.reduce_from_tp, "Megatron g: sum the partial outputs over tp"),
    ("vocab_shard", "replicate"): (None, "all-gather vocab-parallel logits (replicated loss)"),
    ("shard", "row"): None,
    ("replicate", "replicate"): None,
    ("shard", "shard"): None,
    ("seq_shard", "column"): (sp_gather, "SP: all-gather the sequence before a column-parallel layer (bwd: reduce-scatter)"),
    ("partial", "seq_shard"): (sp_reduce_scatter, "SP: reduce-scatter the partial sums along the sequence"),
    ("replicate", "seq_shard"): (sp_scatter, "SP: keep this rank's sequence chunk of a replicated activation"),
    ("seq_shard", "replicate"): (sp_gather_replicated, "SP: all-gather the sequence for a replicated consumer"),
    ("param", "seq_shard"): (collectives.copy_to_tp, "SP: replicated parameter used on sequence chunks; all-reduce its grad over tp"),
    ("seq_shard", "seq_shard"): None,
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
    """Insert TP/SP and ZeRO-3 collectives (module docstring: table and pre/post-conditions)."""
    graph = copy.deepcopy(gm.graph)
    placements = gm.meta[META_KEY]["placements"]
    if ctx.size("tp") > 1:
        roles = {fqn: role for fqn, (_layer, role) in gm.meta[META_KEY]["params"].items()}
        sp_layers = frozenset(s.layer for s in plan.layers if s.sp)
        _TPRewriter(graph, placements, roles, ctx, sp_layers).run()
    insert_expert_parallel(graph, placements, ctx, NAME)
    modules, hsdp_synced = _insert_zero3_gathers(graph, placements, ctx, plan)
    synced = hsdp_synced + _insert_grad_syncs(graph, placements, ctx, plan, modules)
    graph.lint()
    out = rebuild(gm, graph, modules)
    out.meta[META_KEY]["grads_reduced_in_graph"] = synced
    out.recompile()
    return out


class GradSync(nn.Module):
    """Graph module: a parameter, unchanged; its gradient all-reduced (mean over dp) in backward.

    ``runtime/traced_collectives.py`` note "gradient sync". The collective is looked up at
    construction (the group is live), not while ``torch.compile`` traces.
    """

    def __init__(self, group_name: str, num_ranks: int) -> None:
        super().__init__()
        self.sync = traced_collectives.traced_grad_sync(group_name, num_ranks)

    def forward(self, param: torch.Tensor) -> torch.Tensor:
        return self.sync(param)


def _insert_grad_syncs(graph: fx.Graph, placements: dict, ctx: RankContext, plan: Plan, modules: dict) -> tuple[str, ...]:
    """Compiled programs with one micro-batch on one stage: the DDP / ZeRO-1/2 gradient all-reduce as a
    backward graph node per parameter (``GradSync``), so it overlaps the rest of the backward. The
    optimizer then takes these gradients as reduced (``runtime/optimizer.py``). Quantized gradient
    wires, offload, expert and ZeRO-3 parameters keep the optimizer's sync. Returns the FQNs."""
    if not ctx.compiled or ctx.size("dp") == 1:
        return ()
    strategies = {s.layer: s for s in plan.layers}
    synced = []
    for node in list(graph.nodes):
        p = placements.get(node.target) if node.op == "get_attr" else None
        if p is None or not node.users or p.dp_dim is not None or p.ep_dim is not None:
            continue
        strategy = strategies.get(p.layer)
        if strategy is None or not data_parallel_form(strategy, plan.mesh, plan.schedule.num_micro_batches,
                                                      ctx.compiled).has("all_reduce", "dp", "backward"):
            continue
        target = "autoshard_gradsync_" + node.target.replace(".", "_")
        modules[target] = GradSync(ctx.group("dp"), ctx.size("dp"))
        with graph.inserting_after(node):
            call = tag(graph.call_module(target, (node,)), NAME, "DP gradient all-reduce in backward", param=node.target,
                       layer=p.layer)
        node.replace_all_uses_with(call, delete_user_cb=lambda u: u is not call)
        synced.append(node.target)
    return tuple(synced)


class _TPRewriter:
    """Walks the graph once, tracking each node's tp placement and applying ``TP_TABLE``."""

    def __init__(self, graph: fx.Graph, placements: dict, roles: dict, ctx: RankContext, sp_layers: frozenset) -> None:
        self.graph, self.placements, self.roles, self.ctx = graph, placements, roles, ctx
        self.sp_layers = sp_layers
        self.group = ctx.group("tp")
        self.state: dict[fx.Node, str] = {}
        self.converted: dict[tuple[fx.Node, str], fx.Node] = {}  # (producer, consumer placement) → conversion
        tokens = next(n for n in graph.nodes if n.op == "placeholder")
        self.seq_size = tokens.meta["val"].shape[1]  # S (symbolic): locates the sequence dim of activations

    def param_of(self, node) -> object:
        if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in self.placements:
            return self.placements[node.target]
        return None

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.state[node] = self.visit(node)
            elif node.op == "output":
                self.output(node)
            else:
                self.state.setdefault(node, "replicate")
        for node, placement in self.state.items():  # split_pipeline sizes stage boundaries from it
            if placement == "seq_shard":
                record = node.meta.get(META_KEY) or {}
                record["seq_shard"] = (self.seq_dim(node, node.name), self.ctx.size("tp"))
                node.meta[META_KEY] = record

    def visit(self, node: fx.Node) -> str:
        weight = self.param_of(node.args[1]) if len(node.args) > 1 else None
        if node.target == aten.embedding.default:
            weight = self.param_of(node.args[0])
            if weight is not None and weight.tp_dim == 0:
                return self.vocab_embedding(node, weight)
        if node.target == aten.linear.default and weight is not None and weight.tp_dim is not None:
            if self.roles.get(weight.fqn) == "vocab":
                return self.vocab_head(node)
            return self.column(node) if weight.tp_dim == 0 else self.row(node, weight)
        inputs = [self.state.get(a, "replicate") for a in node.all_input_nodes]
        if "shard" in inputs:
            if "seq_shard" in inputs:
                raise PlanError(f"node {node.name} ({node.target}) mixes head-sharded and sequence-sharded inputs; "
                                "set sp=False on the layers around it")
            self.fix_static_heads(node)
            return "shard"
        if "seq_shard" in inputs:
            return self.seq_region(node)
        return "replicate"

    def insert(self, key: tuple[str, str], producer: fx.Node, where, after: bool = False, **meta) -> fx.Node:
        """Insert ``TP_TABLE[key]`` applied to ``producer`` before (or after) ``where``; records its state."""
        fn, why = TP_TABLE[key]
        args = (producer, self.group)
        if fn in _SP_FNS:
            dim = self.seq_dim(producer, producer.name)
            if dim is None:
                raise PlanError(f"SP: {producer.name} has no sequence dim to {why!r}; set sp=False around it")
            args += (dim,)
        with (self.graph.inserting_after(where) if after else self.graph.inserting_before(where)):
            new = tag(self.graph.call_function(fn, args), NAME, why, table_key=key, **meta)
        new.meta["val"] = producer.meta.get("val")  # global shape: seq_dim() of the new node still works
        self.state[new] = key[1] if key[1] in ("seq_shard", "replicate") else "replicate"
        return new

    def convert(self, producer: fx.Node, consumer_placement: str, before: fx.Node) -> fx.Node:
        key = (self.state.get(producer, "replicate"), consumer_placement)
        if key not in TP_TABLE:
            raise PlanError(f"no tp conversion from {key[0]!r} to {key[1]!r} at node {producer.name}")
        if TP_TABLE[key] is None:
            return producer
        cached = self.converted.get((producer, consumer_placement))
        if cached is None:
            cached = self.converted[(producer, consumer_placement)] = self.insert(key, producer, before)
        return cached

    def seq_dim(self, node: fx.Node, what: str) -> int | None:
        """The one dim of ``node``'s (global) shape that is the sequence; None when it has none."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        dims = [d for d, size in enumerate(val.shape) if str(size) == str(self.seq_size)]
        if len(dims) > 1:
            raise PlanError(f"SP: {what} has shape {tuple(val.shape)} with {len(dims)} sequence dims; sequence "
                            "parallelism needs one; set sp=False on the layers around it")
        return dims[0] if dims else None

    def seq_region(self, node: fx.Node) -> str:
        """``node`` runs on sequence chunks: scatter its replicated activations, wrap its parameters."""
        if node.meta.get("val") is not None and self.seq_dim(node, f"output of {node.name}") is None:
            raise PlanError(f"SP: {node.name} ({node.target}) removes the sequence dim of a sequence-sharded input; "
                            "set sp=False on the layers around it")
        for arg in node.all_input_nodes:
            if self.state.get(arg, "replicate") != "replicate":
                continue
            param = self.param_of(arg)
            if param is not None:
                if param.tp_dim is not None:
                    raise PlanError(f"SP: tp-split parameter {param.fqn!r} used on sequence chunks at {node.name}")
                node.replace_input_with(arg, self.insert(("param", "seq_shard"), arg, node, param=param.fqn))
            elif self.seq_dim(arg, f"input {arg.name} of {node.name}") is not None:
                node.replace_input_with(arg, self.convert(arg, "seq_shard", node))
        return "seq_shard"

    def output(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if self.state.get(arg) == "seq_shard":
                node.replace_input_with(arg, self.convert(arg, "replicate", node))

    def column(self, node: fx.Node) -> str:
        node.update_arg(0, self.convert(node.args[0], "column", node))
        return "shard"

    def reduce_partial(self, node: fx.Node, layer: str) -> fx.Node:
        """Insert g (all-reduce) or, under SP for ``layer``, a reduce-scatter after partial ``node``."""
        key = ("partial", "seq_shard" if layer in self.sp_layers else "replicate")
        return self.insert(key, node, node, after=True)

    def row(self, node: fx.Node, weight) -> str:
        bias = node.args[2] if len(node.args) > 2 else None
        node.args = (node.args[0], node.args[1])
        reduced = self.reduce_partial(node, weight.layer)
        users = [u for u in node.users if u is not reduced]
        out = reduced
        if bias is not None:
            with self.graph.inserting_after(reduced):
                out = tag(self.graph.call_function(aten.add.Tensor, (reduced, bias)), NAME, "row-parallel bias, added once after g")
            out.meta["val"] = node.meta.get("val")
            self.state[out] = self.seq_region(out) if self.state[reduced] == "seq_shard" else "replicate"
        for user in users:
            user.replace_input_with(node, out)
        return "partial"

    def vocab_embedding(self, node: fx.Node, weight) -> str:
        local_vocab = weight.global_shape[0] // self.ctx.size("tp")  # tp-local rows, before any ZeRO-3 split
        node.target = vocab_parallel_embedding
        node.args = (node.args[0], node.args[1], self.ctx.coord("tp") * local_vocab)
        tag(node, NAME, "vocab-parallel embedding: rows outside this rank's vocabulary slice give 0")
        reduced = self.reduce_partial(node, weight.layer)
        node.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
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


def _replicas_in_graph(strategy, ctx: RankContext, plan: Plan) -> bool:
    """Whether a ZeRO-3 layer's HSDP replica all-reduce is a backward graph node (module docstring)."""
    return (strategy is not None and strategy.state == "zero3"
            and data_parallel_form(strategy, plan.mesh, plan.schedule.num_micro_batches,
                                   ctx.compiled).has("all_reduce", "dp_replicate", "backward"))


def _insert_zero3_gathers(graph: fx.Graph, placements: dict, ctx: RankContext,
                          plan: Plan) -> tuple[dict, tuple[str, ...]]:
    """One ``Zero3Gather`` per layer with dp_shard-split parameters, before the layer's first use.
    Returns the modules and the FQNs whose HSDP replica all-reduce the graph runs."""
    strategies = {s.layer: s for s in plan.layers}
    synced: list[str] = []
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
        replicate = None
        if _replicas_in_graph(strategies.get(layer), ctx, plan):
            replicate = (ctx.group("dp_replicate"), ctx.size("dp_replicate"))
            synced.extend(spec.fqns)
        modules[target] = Zero3Gather(spec, replicate=replicate)
        # compiled ZeRO-1/2 (passes/context.py note): gathered in forward, kept for the backward
        modules[target].reshard_after_forward = placements[attrs[0].target].state == "zero3"
        first_use = min((u for n in attrs for u in n.users), key=_order(graph))
        with graph.inserting_before(first_use):
            call = tag(graph.call_module(target, tuple(attrs)), NAME, "ZeRO-3: all-gather the layer's parameters", layer=layer)
            for i, attr in enumerate(attrs):
                item = tag(graph.call_function(operator.getitem, (call, i)), NAME, "ZeRO-3 gathered parameter", param=attr.target)
                attr.replace_all_uses_with(item, delete_user_cb=lambda u: u is not call)
    return modules, tuple(synced)


def _tp_local_shape(p, ctx: RankContext) -> tuple[int, ...]:
    shape = list(p.global_shape)
    if p.tp_dim is not None:
        shape[p.tp_dim] //= ctx.size("tp")
    return tuple(shape)


def _order(graph: fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]
