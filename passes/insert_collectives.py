"""Pass ``insert_collectives``: make the sharded graph compute the unsharded model again.

Pre-conditions: ``shard_parameters`` ran (``PassState.placements``
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
    gathered      SP: a reshape that flattens tokens ([B, S, h] → [B·S, h], transformers' Conv1D)
                  of an all-gathered sequence, feeding only column-parallel projections

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
    (param,       shard)     → copy_to_tp                                  replicated param used on this rank's heads
    (gathered,    column)    → nothing     the SP all-gather before a token-flattening reshape is f

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
loses the sharded dim raises ``PlanError``, except a reshape that flattens
the tokens for column-parallel projections: state ``gathered``). Parameters
that are replicated over tp but used on sequence chunks (norm weights,
row-parallel biases, the value head, and values computed from them only, as
Gemma's ``1 + weight``) get per-rank partial gradients; each use is wrapped in
``copy_to_tp`` (identity forward, all-reduce over tp backward), so the grad is
summed over tp in the graph and the optimizer sees full, tp-replicated
gradients. Decision: one all-reduce per such parameter per micro-batch
(Megatron batches them once per step; these are hidden-sized vectors). Every
value left on ``seq_shard`` records ``node.meta["autoshard"]["seq_shard"] =
(sequence dim, tp)``: ``split_pipeline`` sends such a value across a stage
boundary as this rank's chunk.

A node's consumer placement comes from its parameter. Projections are
``linear(x, W)`` (``W`` stored ``[out, in]``) and ``addmm(b, x, W)`` /
``mm(x, W)`` / ``matmul(x, W)`` (``W`` stored ``[in, out]``: transformers'
``Conv1D``; ``shard_parameters.PROJECTIONS``): one whose weight is tp-split on
its output-feature dim is column-parallel (its output is ``shard``), on its
input-feature dim row-parallel; an embedding or linear on a vocab-split weight
is vocab-parallel. Any other node outputs ``shard`` if an input is ``shard``,
else ``replicate``. Decisions: the LM head's logits are all-gathered (PPO needs
log-probs of chosen tokens and the entropy of the full distribution; a
vocab-parallel log-softmax is left for later) and its bias (Phi) is added to
the gathered logits; a row-parallel bias is added once, after the all-reduce,
which follows the pure reshapes after the projection (``Conv1D``'s ``[B·S, h]``
→ ``[B, S, h]``: the reduction then sees the sequence dim SP needs); ``f`` is
inserted once per producer, shared by all its column consumers (one backward
all-reduce for q, k and v together).

Static sizes: ``torch.export`` writes every static size as a literal (HF's
attention reshapes carry the *global* head counts, GPT-2 its fused width);
``passes/_tp_dims.py`` follows the tp-split dim of each ``shard`` activation
through the graph and rewrites each literal on it to its tp-local value.
A size on the split dim that tp does not divide (2 key/value heads under
tp = 4, MQA's one), an op no rule understands and a tp-split parameter used
other than as a projection's weight or bias or an embedding table (``x @
W.t()``) raise ``PlanError`` naming the layer, while the program is built (before any step); the search never
proposes such a tp degree (``search/space.py``, ``tp_divides``). ``Plan.check_compatible`` refuses most of these
before any rank starts, from what capture recorded (head counts, ``LayerInfo.tp_refusal``: ``passes/_capture_tp.py``);
the checks here stay for what only following the split dim finds. A vocab-parallel
embedding keeps the table's ``padding_idx`` (Gemma's pad token gets no gradient).

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
listed in ``PassState.grads_reduced_in_graph``; otherwise they act
on ``.grad`` after backward, in the runtime's optimizer (``runtime/optimizer.py``),
bucketed per parameter.

Not handled (clear ``PlanError``): tp on MoE layers; a fused projection split
into unequal parts (``shard_parameters``); SP with a sequence length not
divisible by tp fails in the collective (``CollectiveError``).
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx, nn

from autoshard.data_parallel import data_parallel_form
from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, node_layer, rebuild, tag
from autoshard.passes._tp_dims import ShardDims, split_param_misuse
from autoshard.passes._expert_parallel import insert_expert_parallel
from autoshard.passes._zero3 import GatherSpec, Zero3Gather
from autoshard.passes.context import RankContext, pass_state
from autoshard.passes.shard_parameters import PROJECTIONS, RESHAPES
from autoshard.plan import Plan
from autoshard.kernels import collectives, traced_collectives

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
    ("param", "shard"): (collectives.copy_to_tp, "replicated parameter used on this rank's heads (a per-head norm); "
                                                 "all-reduce its grad over tp"),
    ("seq_shard", "seq_shard"): None,
    ("gathered", "column"): None,
}


def vocab_parallel_embedding(weight: torch.Tensor, tokens: torch.Tensor, vocab_start: int,
                             padding_idx: int | None = None) -> torch.Tensor:
    """Embedding over this rank's vocabulary rows [vocab_start, vocab_start + V/tp); others give 0 (partial).
    ``padding_idx`` (global; Gemma's pad token) gets no gradient on the rank that holds its row."""
    local_vocab = weight.shape[0]
    outside = (tokens < vocab_start) | (tokens >= vocab_start + local_vocab)  # [B, S]
    local_ids = (tokens - vocab_start).masked_fill(outside, 0)
    local_pad = padding_idx - vocab_start if padding_idx is not None else None
    if local_pad is not None and not 0 <= local_pad < local_vocab:
        local_pad = None
    out = torch.nn.functional.embedding(local_ids, weight, padding_idx=local_pad)  # [B, S, h]
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def gather_logits(logits: torch.Tensor, group_name: str) -> torch.Tensor:
    """[B, S, V/tp] → [B, S, V]; backward keeps this rank's slice (the loss is replicated over tp)."""
    return collectives.gather_from_sp(logits, -1, group_name, grad_is_partial=False)


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Insert TP/SP and ZeRO-3 collectives (module docstring: table and pre/post-conditions)."""
    graph = copy.deepcopy(gm.graph)
    placements = pass_state(gm).placements
    if ctx.size("tp") > 1:
        roles = {fqn: role for fqn, (_layer, role) in pass_state(gm).params.items()}
        _TPRewriter(graph, placements, roles, ctx, plan).run()
    insert_expert_parallel(graph, placements, ctx, NAME)
    modules, hsdp_synced = _insert_zero3_gathers(graph, placements, ctx, plan)
    synced = hsdp_synced + _insert_grad_syncs(graph, placements, ctx, plan, modules)
    graph.lint()
    out = rebuild(gm, graph, modules)
    pass_state(out).grads_reduced_in_graph = tuple(synced)
    out.recompile()
    return out


class GradSync(nn.Module):
    """Graph module: a parameter, unchanged; its gradient all-reduced (mean over dp) in backward.

    ``kernels/traced_collectives.py`` note "gradient sync". The collective is looked up at
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

    def __init__(self, graph: fx.Graph, placements: dict, roles: dict, ctx: RankContext, plan: Plan) -> None:
        self.graph, self.placements, self.roles, self.ctx, self.plan = graph, placements, roles, ctx, plan
        self.sp_layers = frozenset(s.layer for s in plan.layers if s.sp)
        self.group = ctx.group("tp")
        self.state: dict[fx.Node, str] = {}
        self.dims = ShardDims(ctx.size("tp"), lambda node: node_layer(node, plan) or node.name)
        self.converted: dict[tuple[fx.Node, str], fx.Node] = {}  # (producer, consumer placement) → conversion
        self.param_derived: dict[fx.Node, bool] = {}
        tokens = next(n for n in graph.nodes if n.op == "placeholder")
        self.seq_size = tokens.meta["val"].shape[1]  # S (symbolic): locates the sequence dim of activations

    def param_of(self, node) -> object:
        if isinstance(node, fx.Node) and node.op == "get_attr" and node.target in self.placements:
            return self.placements[node.target]
        return None

    def run(self) -> None:
        self.check_split_param_uses()
        for node in list(self.graph.nodes):
            if node in self.state:  # a row projection's reshapes before its reduction (row)
                continue
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

    def check_split_param_uses(self) -> None:
        """A tp-split parameter may only feed a projection (as its weight or bias) or an embedding: any other
        use (``x @ W.t()``, a weight sliced by hand) would see this rank's piece as if it were whole."""
        for node in self.graph.nodes:
            param = self.param_of(node)
            user = split_param_misuse(node) if param is not None and param.tp_dim is not None else None
            if user is not None:
                raise PlanError(f"layer {param.layer!r}: tp-split parameter {param.fqn!r} is used by {user.name} "
                                f"({user.target}), not as a projection's weight or bias; the tensor-parallel "
                                "runtime cannot split it: use tp='none' for the layer")

    def visit(self, node: fx.Node) -> str:
        if node.target == aten.embedding.default:
            weight = self.param_of(node.args[0])
            if weight is not None and weight.tp_dim == 0:
                return self.vocab_embedding(node, weight)
        weight_at, _bias_at, transposed = PROJECTIONS.get(node.target, (None, None, False))
        weight = self.param_of(node.args[weight_at]) if weight_at is not None else None
        if weight is not None and weight.tp_dim is not None:
            if self.roles.get(weight.fqn) == "vocab" and node.target == aten.linear.default:
                return self.vocab_head(node)
            out_dim = 1 if transposed else 0  # tensor dim of the weight that holds the output features
            return self.column(node, weight) if weight.tp_dim == out_dim else self.row(node, weight)
        inputs = [self.state.get(a, "replicate") for a in node.all_input_nodes]
        if "shard" in inputs:
            if "seq_shard" in inputs:
                raise PlanError(f"node {node.name} ({node.target}) mixes head-sharded and sequence-sharded inputs; "
                                "set sp=False on the layers around it")
            self.dims.follow(node, {a for a in node.all_input_nodes if self.state.get(a) == "shard"})
            self.wrap_params(node, "shard")
            return "shard"
        if "seq_shard" in inputs and node.target in RESHAPES and self.seq_dim(node, node.name) is None \
                and node.users and all(self.column_weight(u, node) for u in node.users):
            node.update_arg(0, self.convert(node.args[0], "column", node))  # Conv1D's [B, S, h] → [B·S, h]
            return "gathered"
        if "seq_shard" in inputs:
            return self.seq_region(node)
        return "replicate"

    def column_weight(self, node: fx.Node, x: fx.Node) -> object:
        """The column-parallel weight of projection ``node`` whose activation operand is ``x`` (else None)."""
        weight_at, _bias_at, transposed = PROJECTIONS.get(node.target, (None, None, False))
        weight = self.param_of(node.args[weight_at]) if weight_at is not None else None
        at = 1 if node.target == aten.addmm.default else 0
        ok = weight is not None and weight.tp_dim == (1 if transposed else 0) and node.args[at] is x
        return weight if ok and self.roles.get(weight.fqn) != "vocab" else None

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
            elif self.from_params(arg):  # Gemma's norm: (1 + weight) computed before the use
                node.replace_input_with(arg, self.insert(("param", "seq_shard"), arg, node, param=arg.name))
        return "seq_shard"

    def wrap_params(self, node: fx.Node, region: str) -> None:
        """Wrap each tp-replicated parameter (or value computed from parameters) that ``node`` uses beside
        ``region`` activations in ``copy_to_tp``: each rank's gradient of it is a partial sum (Qwen3's
        per-head q/k norms see only this rank's heads), all-reduced over tp in the backward."""
        for arg in node.all_input_nodes:
            if self.state.get(arg, "replicate") != "replicate":
                continue
            param = self.param_of(arg)
            if (param is not None and param.tp_dim is None) or (param is None and self.from_params(arg)):
                node.replace_input_with(arg, self.insert(("param", region), arg, node,
                                                         param=param.fqn if param is not None else arg.name))

    def from_params(self, node: fx.Node) -> bool:
        """Whether ``node`` (no sequence dim) is computed from parameters: its gradient reaches them."""
        stack = [node]
        while stack:  # post-order without recursion: a deep graph would exceed Python's recursion limit
            top = stack[-1]
            todo = [a for a in top.all_input_nodes if a not in self.param_derived]
            if todo and self.param_of(top) is None:
                stack.extend(todo)
                continue
            stack.pop()
            self.param_derived[top] = self.param_of(top) is not None or any(
                self.param_derived.get(a, False) for a in top.all_input_nodes)
        return self.param_derived[node]

    def output(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if self.state.get(arg) == "seq_shard":
                node.replace_input_with(arg, self.convert(arg, "replicate", node))

    def column(self, node: fx.Node, weight) -> str:
        at = 1 if node.target == aten.addmm.default else 0  # the activation operand
        node.update_arg(at, self.convert(node.args[at], "column", node))
        self.dims.set(node, node.meta["val"].dim() - 1, weight.tp_parts)
        return "shard"

    def reduce_partial(self, node: fx.Node, layer: str) -> fx.Node:
        """Insert g (all-reduce) or, under SP for ``layer``, a reduce-scatter after partial ``node``."""
        key = ("partial", "seq_shard" if layer in self.sp_layers else "replicate")
        return self.insert(key, node, node, after=True)

    def row(self, node: fx.Node, weight) -> str:
        """Row-parallel projection: partial sums, reduced after the reshapes that follow it (``Conv1D``'s
        ``[B·S, h]`` → ``[B, S, h]``, so SP finds the sequence dim); the bias added once, after."""
        at = 1 if node.target == aten.addmm.default else 0
        self.dims.check_contracted(node, node.args[at], self.state.get(node.args[at]) == "shard")
        bias = node.args[2] if node.target == aten.linear.default and len(node.args) > 2 else None
        if node.target == aten.addmm.default:
            bias, node.target, node.args = node.args[0], aten.mm.default, (node.args[1], node.args[2])
        else:
            node.args = node.args[:2]
        end = node
        while len(end.users) == 1 and next(iter(end.users)).target in RESHAPES:
            end = next(iter(end.users))
            self.state[end] = "partial"
        reduced = self.reduce_partial(end, weight.layer)
        users = [u for u in end.users if u is not reduced]
        out = reduced
        if bias is not None:
            with self.graph.inserting_after(reduced):
                out = tag(self.graph.call_function(aten.add.Tensor, (reduced, bias)), NAME, "row-parallel bias, added once after g")
            out.meta["val"] = end.meta.get("val")
            self.state[out] = self.seq_region(out) if self.state[reduced] == "seq_shard" else "replicate"
        for user in users:
            user.replace_input_with(end, out)
        return "partial"

    def vocab_embedding(self, node: fx.Node, weight) -> str:
        local_vocab = weight.global_shape[0] // self.ctx.size("tp")  # tp-local rows, before any ZeRO-3 split
        node.target = vocab_parallel_embedding
        padding_idx = node.args[2] if len(node.args) > 2 and node.args[2] >= 0 else None
        node.args = (node.args[0], node.args[1], self.ctx.coord("tp") * local_vocab, padding_idx)
        tag(node, NAME, "vocab-parallel embedding: rows outside this rank's vocabulary slice give 0")
        reduced = self.reduce_partial(node, weight.layer)
        node.replace_all_uses_with(reduced, delete_user_cb=lambda u: u is not reduced)
        return "partial"

    def vocab_head(self, node: fx.Node) -> str:
        """Vocab-parallel head: local logits, all-gathered; a (replicated) bias added to the full logits."""
        node.update_arg(0, self.convert(node.args[0], "column", node))
        bias = node.args[2] if len(node.args) > 2 else None
        node.args = node.args[:2]
        _fn, why = TP_TABLE[("vocab_shard", "replicate")]
        with self.graph.inserting_after(node):
            full = tag(self.graph.call_function(gather_logits, (node, self.group)), NAME, why)
        out = full
        if bias is not None:
            with self.graph.inserting_after(full):
                out = tag(self.graph.call_function(aten.add.Tensor, (full, bias)), NAME,
                          "LM head bias, added to the gathered logits")
            out.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u not in (full, out))
        self.state[full] = self.state[out] = "replicate"
        return "vocab_shard"


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
