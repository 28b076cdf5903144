"""Pass ``split_pipeline``: cut the rewritten graph into stage submodules at the plan's boundaries.

Pre-conditions: the other passes ran (``split_pipeline`` is the last pass of
``PASSES``: every earlier pass rewrites one flat graph; this one changes the
module structure). Post-conditions: with ``mesh.pp == 1`` the module is
returned unchanged. With ``pp > 1`` the result is a ``PipelineSplit``: one
``fx.GraphModule`` per *local* stage (stage ``k`` runs on pp rank ``k % pp``;
``K = pp · schedule.virtual_stages`` stages in all, Megatron-Core's
interleaved placement) plus a ``PipelineLayout`` saying what crosses each
boundary. Parameters of other ranks' stages are not referenced (and were
never materialised: ``shard_parameters`` asks ``local_parameter_fqns``).

[Note: stage assignment]
Every graph node gets a stage or is *replicable*:

* replicable: the node depends on no parameter (the user inputs, their
  ``sym_size``, position ids, RoPE tables, constants). Each stage recomputes
  the replicable nodes it needs from the user inputs, which every stage
  receives as keyword arguments (every pp rank of a dp coordinate holds the
  same local batch), so only activations cross a boundary;
* weight-derived: the node's inputs are parameters or weight-derived nodes
  only (a ZeRO-3 gather of a layer's shards, a transposed or scaled weight).
  Like a replicable node it is computed by every stage that uses it and never
  sent: a tied LM head gathers its own copy of the embedding's weight instead
  of receiving the full ``[V, h]`` matrix per micro-batch (its parameter is
  then shared between the pp ranks, below);
* a node inside a plan layer (``nn_module_stack``, or the ``layer`` a pass
  recorded in ``node.meta["autoshard"]``, e.g. a ZeRO-3 gather) takes that
  layer's ``LayerStrategy.stage``;
* any other node (a residual add between layers, a Megatron f/g op) takes the
  largest stage of its inputs (it runs as soon as its inputs exist), or, with
  no staged input, the smallest stage of its users;
* a ``get_attr`` of a parameter is copied into every stage that uses it (or
  that computes a weight-derived node from it).

Data must flow forward: an input of a node on stage ``s`` comes from a stage
``<= s`` (``PlanError`` otherwise). Boundary ``s → s+1`` carries every staged
value produced on a stage ``<= s`` and used on a stage ``> s`` (values that
skip stages are passed through), in graph order; each must be a tensor.
The last stage returns the tensor leaves of the model's outputs (logits and
values: the loss is computed there) as a flat tuple; ``PipelineSplit.outputs``
rebuilds the model's structure (a tuple, a dict, a ``ModelOutput``, a plain
dataclass, which capture registers as a pytree node (``_capture_export``,
"Output dataclasses"), or any registered pytree; the export's ``out_spec``),
putting back the constant leaves
(``None``, a Python number) the export kept out of the graph. So every stage
returns a tuple of tensors, the one output form ``torch.distributed.pipelining``
handles (it detaches each output of the last stage after its backward: a dict
would fail there with "'dict' object has no attribute '_is_view'").

What the runtime cannot run is refused here with ``PlanError`` naming the
node and its layer, while every rank builds and before any step: data flowing
to an earlier stage; a non-tensor value crossing a boundary (a SymInt, an
``.item()``) or a non-tensor model output computed by the graph; a boundary
value or an output whose shape depends on the data (an unbacked size, e.g.
after ``nonzero``): the schedule allocates its receive buffers from shapes
known from the inputs alone.

[Note: parameters shared between pp ranks]
A parameter used by stages on two or more pp ranks (a tied embedding and LM
head on the first and last stage) is held by each of them: the *owner* (the
pp rank of its first stage using it) keeps it as a parameter of the rank (its
placement, optimizer slot and checkpoint entry); every other rank holds a
*mirror*, materialised but outside ``local_parameters`` and the rank's
placements, so the optimizer, the clipping norm and checkpoints see it once.
``runtime/pipeline.py`` copies the owner's values into the mirrors before each
training step and inference pass, and adds the mirrors' gradients into the
owner's after the step's backward (``PipelineLayout.shared``): the gradient of
the tied weight is the sum over its uses, as on one device. Per step that is
one send of the weight and one of its gradient per mirror over pp, what
Megatron's embedding group all-reduces. The owner and the mirrors hold the
same local shard (the parameter's placement comes from its owning layer's
strategy, and the ranks of a pp group share their dp and tp coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, node_layer
from autoshard.passes.context import RankContext, pass_state
from autoshard.plan import Plan

NAME = "split_pipeline"


@dataclass(frozen=True)
class SharedParam:
    """A parameter used on two or more pp ranks ([Note: parameters shared between pp ranks]).

    fqn: its name in the stage submodules (the canonical FQN of a tied parameter).
    owner: the pp rank holding it as a parameter (optimizer slot); mirrors: the other pp ranks using it.
    """

    fqn: str
    owner: int
    mirrors: tuple[int, ...]


@dataclass(frozen=True)
class PipelineLayout:
    """Static shape of one rank's pipeline (module docstring).

    num_stages: K = pp · virtual_stages; stage ``k`` runs on pp rank ``k % pp``.
    local_stages: the stages of this rank, ascending.
    input_names: the model's user inputs (e.g. ``("tokens",)``), given to every stage by keyword.
    boundaries: per stage ``k``, the names of the values it receives from stage ``k - 1``
        (empty for stage 0), in the order of its positional arguments.
    shared: the parameters used on two or more pp ranks, in order of first use (``SharedParam``).
    """

    num_stages: int
    pp: int
    local_stages: tuple[int, ...]
    input_names: tuple[str, ...]
    boundaries: tuple[tuple[str, ...], ...]
    shared: tuple[SharedParam, ...] = ()

    @property
    def pp_rank(self) -> int:
        """This rank's pp coordinate."""
        return self.local_stages[0] % self.pp

    def mirrored(self) -> set[str]:
        """FQNs this rank holds as mirrors of another pp rank's parameter."""
        return {s.fqn for s in self.shared if self.pp_rank in s.mirrors}

    def rank_of(self, stage: int) -> int:
        """The pp coordinate that runs ``stage``."""
        return stage % self.pp


class PipelineSplit(nn.Module):
    """This rank's stage submodules (``stage_<k>``) and the ``PipelineLayout`` (module docstring).

    ``boundary_vals[k]`` are the fake tensors (symbolic shapes) of stage ``k``'s
    positional inputs and ``input_vals`` those of the user inputs: the runtime
    evaluates them for a concrete batch (``boundary_shapes``).
    """

    def __init__(self, stages: dict[int, fx.GraphModule], layout: PipelineLayout, vals: dict, meta: dict) -> None:
        super().__init__()
        for k, module in stages.items():
            self.add_module(f"stage_{k}", module)
        self.layout = layout
        self.boundary_vals: dict[int, list] = vals["boundaries"]  # stage k → fake vals of its positional inputs
        # stage k → per input, (tensor dim, tp) when it is sequence-sharded (SP), else None (``_seq_shard``)
        self.boundary_shards: dict[int, list] = vals["boundary_shards"]
        self.input_vals: dict[str, torch.Tensor] = vals["inputs"]  # user input name → fake val
        self.output_vals: list = vals["outputs"]  # the model's tensor output leaves (what the last stage returns)
        self.output_consts: dict[int, object] = vals["output_consts"]  # leaf index → constant leaf (None, 3, ...)
        self.output_spec = vals["output_spec"]  # the pytree structure of all the leaves
        self.meta = meta

    def stage(self, k: int) -> fx.GraphModule:
        """The submodule of local stage ``k``."""
        return self.get_submodule(f"stage_{k}")

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Parameter FQN (as in the unsplit model) → the one local Parameter object; mirrors of another
        pp rank's parameter are not this rank's ([Note: parameters shared between pp ranks])."""
        mirrored = self.layout.mirrored()
        out: dict[str, nn.Parameter] = {}
        for k in self.layout.local_stages:
            for fqn, p in self.stage(k).named_parameters():
                if fqn not in mirrored:
                    out.setdefault(fqn, p)
        return out

    def stage_parameter(self, fqn: str) -> nn.Parameter:
        """The local Parameter ``fqn`` (owned or mirrored) of the first local stage that uses it."""
        for k in self.layout.local_stages:
            params = dict(self.stage(k).named_parameters())
            if fqn in params:
                return params[fqn]
        raise KeyError(f"no local stage uses parameter {fqn!r}")

    def boundary_shapes(self, k: int, inputs: dict[str, torch.Tensor]) -> list[torch.Size]:
        """Concrete shapes of stage ``k``'s positional inputs for user inputs ``inputs`` (e.g. one micro-batch):
        a sequence-sharded value (SP) has ``1/tp`` of the global sequence dim."""
        shapes = self._concrete_shapes(self.boundary_vals[k], inputs)
        for i, shard in enumerate(self.boundary_shards[k]):
            if shard is not None:
                dim, tp = shard
                shapes[i] = torch.Size(size // tp if d == dim else size for d, size in enumerate(shapes[i]))
        return shapes

    def outputs(self, tensors) -> object:
        """The model's outputs from the last stage's tensor leaves (module docstring)."""
        tensors = iter(tensors)
        leaves = [self.output_consts[i] if i in self.output_consts else next(tensors)
                  for i in range(self.output_spec.num_leaves)]
        return pytree.tree_unflatten(leaves, self.output_spec)

    def output_shapes(self, inputs: dict[str, torch.Tensor]) -> list[torch.Size]:
        """Concrete shapes of the model's output leaves for user inputs ``inputs``."""
        return self._concrete_shapes(self.output_vals, inputs)

    def _concrete_shapes(self, vals: list, inputs: dict[str, torch.Tensor]) -> list[torch.Size]:
        subs = {}
        for name, val in self.input_vals.items():
            for size, actual in zip(val.shape, inputs[name].shape):
                if isinstance(size, torch.SymInt):
                    subs[size.node.expr] = actual
        return [torch.Size(_concrete(s, subs) for s in v.shape) for v in vals]


def _concrete(size, subs) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.xreplace(subs))
    return int(size)


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> nn.Module:
    """Identity for pp = 1; else this rank's ``PipelineSplit`` (module docstring)."""
    if plan.mesh.pp == 1:
        return gm
    graph = gm.graph
    stages = assign_stages(gm, plan)
    num_stages = plan.mesh.pp * plan.schedule.virtual_stages
    _check_flow(graph, stages, num_stages, plan)
    boundaries = _boundaries(graph, stages, num_stages, plan)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    leaves, spec, outputs = _model_outputs(graph, boundaries, placeholders, plan)
    local = tuple(k for k in range(num_stages) if k % plan.mesh.pp == ctx.coord("pp"))
    modules = {k: _stage_module(gm, stages, k, boundaries, num_stages, outputs) for k in local}
    shared = shared_params(_stage_parameters(gm, stages, boundaries, num_stages), plan.mesh.pp)
    meta = dict(gm.meta)
    state = meta[META_KEY] = pass_state(gm).copy()
    layout = PipelineLayout(
        num_stages=num_stages,
        pp=plan.mesh.pp,
        local_stages=local,
        input_names=tuple(n.name for n in placeholders),
        boundaries=tuple(tuple(n.name for n in b) for b in boundaries),
        shared=shared,
    )
    # the rank's parameters: its stages', mirrors of another rank's left out (note "parameters shared ...")
    used = {fqn for m in modules.values() for fqn, _ in m.named_parameters()} - layout.mirrored()
    state.placements = {f: p for f, p in state.placements.items() if f in used}
    vals = {
        "boundaries": {k: [_val(n) for n in boundaries[k]] for k in range(num_stages)},
        "boundary_shards": {k: [_seq_shard(n) for n in boundaries[k]] for k in range(num_stages)},
        "inputs": {n.name: n.meta["val"] for n in placeholders},
        "outputs": [_val(n) for n in outputs],
        "output_consts": {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, fx.Node)},
        "output_spec": spec,
    }
    split = PipelineSplit(modules, layout, vals, meta)
    regather = state.regather
    if regather:
        split.add_module(regather, gm.get_submodule(regather))
    state.pipeline = layout
    return split


# --------------------------------------------------------------------------- stage assignment


def _param_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    names = {fqn for fqn, _ in gm.named_parameters(remove_duplicate=False)}
    return {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in names}


def assign_stages(gm: fx.GraphModule, plan: Plan) -> dict[fx.Node, int | None]:
    """Stage of every node; ``None`` = computed on every stage that needs it (replicable or weight-derived);
    parameter ``get_attr`` nodes are absent (module docstring)."""
    weights = set(_param_nodes(gm))  # parameters and what is computed from them alone
    stage_of_layer = {s.layer: s.stage for s in plan.layers}
    stages: dict[fx.Node, int | None] = {}
    deferred = []
    for node in gm.graph.nodes:
        if node in weights or node.op == "output":
            continue
        inputs = node.all_input_nodes
        staged = [stages[a] for a in inputs if stages.get(a) is not None]
        if not staged and not any(a in weights for a in inputs):
            stages[node] = None  # replicable: depends on no parameter
            continue
        if not staged and all(a in weights for a in inputs):
            stages[node] = None  # weight-derived (a ZeRO-3 gather, a transposed weight): never sent
            weights.add(node)
            continue
        layer = node_layer(node, plan) or (node.meta.get(META_KEY) or {}).get("layer")
        if layer in stage_of_layer:
            stages[node] = stage_of_layer[layer]
        elif staged:
            stages[node] = max(staged)
        else:
            stages[node] = -1  # weights and user inputs outside any plan layer: placed with its users below
            deferred.append(node)
    for node in reversed(deferred):
        users = [stages[u] for u in node.users if stages.get(u) is not None and stages[u] >= 0]
        if not users:
            raise PlanError(f"node {node.name} uses parameters but no plan layer; capture and plan the same model")
        stages[node] = min(users)
    return stages


def _where(node: fx.Node, plan: Plan) -> str:
    """``node`` and the plan layer it belongs to, for messages."""
    layer = node_layer(node, plan) or (node.meta.get(META_KEY) or {}).get("layer")
    if layer:
        return f"{node.name} (layer {layer!r})"
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    module = stack[-1][0] if stack else ""
    return f"{node.name} (module {module!r}, between plan layers)" if module else f"{node.name} (between layers)"


def _check_flow(graph: fx.Graph, stages: dict, num_stages: int, plan: Plan) -> None:
    for node, k in stages.items():
        if k is None:
            continue
        if not 0 <= k < num_stages:
            raise PlanError(f"node {_where(node, plan)} is on stage {k}; allowed stages 0..{num_stages - 1} "
                            "(pp × virtual_stages)")
        for a in node.all_input_nodes:
            if stages.get(a) is not None and stages[a] > k:
                raise PlanError(
                    f"node {_where(node, plan)} on stage {k} uses {_where(a, plan)} from stage {stages[a]}: stages "
                    "must follow the data flow; give later layers stages >= earlier ones"
                )


def stage_parameters(gm: fx.GraphModule, plan: Plan) -> list[set[str]]:
    """Per stage, the FQNs (``get_attr`` targets) of the parameters its submodule reads."""
    stages = assign_stages(gm, plan)
    num_stages = plan.mesh.pp * plan.schedule.virtual_stages
    _check_flow(gm.graph, stages, num_stages, plan)
    return _stage_parameters(gm, stages, _boundaries(gm.graph, stages, num_stages, plan), num_stages)


def _stage_parameters(gm: fx.GraphModule, stages: dict, boundaries: list, num_stages: int) -> list[set[str]]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    params = _param_nodes(gm)
    return [{n.target for n in _needed(gm.graph, stages, k, boundaries, output if k == num_stages - 1 else None)
             if n in params} for k in range(num_stages)]


def shared_params(per_stage: list[set[str]], pp: int) -> tuple[SharedParam, ...]:
    """Parameters used on two or more pp ranks, owned by the pp rank of their first stage using them
    ([Note: parameters shared between pp ranks]); in order of first use, the same on every rank."""
    ranks: dict[str, list[int]] = {}
    for k, fqns in enumerate(per_stage):
        for fqn in sorted(fqns):
            ranks.setdefault(fqn, [])
            if k % pp not in ranks[fqn]:
                ranks[fqn].append(k % pp)  # owner first: the rank of the first stage using it
    return tuple(SharedParam(fqn=fqn, owner=r[0], mirrors=tuple(sorted(r[1:]))) for fqn, r in ranks.items()
                 if len(r) > 1)


def _val(node: fx.Node):
    """The export's fake value of ``node`` (global shape, symbolic batch/seq dims).

    A node a pass inserted (Megatron f/g, the logits all-gather) has none: it
    takes its first input's, which these ops preserve in global shape. Between
    plan layers activations are tp-replicated, so the global shape is the shape
    sent, except under sequence parallelism (``_seq_shard``).
    """
    while "val" not in node.meta and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.meta.get("val")


def _seq_shard(node: fx.Node) -> tuple[int, int] | None:
    """(sequence dim, tp) of a value ``insert_collectives`` left sequence-sharded (SP), else None: this
    rank sends and receives its ``1/tp`` chunk of that dim."""
    return (node.meta.get(META_KEY) or {}).get("seq_shard")


def _boundaries(graph: fx.Graph, stages: dict, num_stages: int, plan: Plan) -> list[list[fx.Node]]:
    """Per stage k, the staged values made on a stage < k and used on a stage >= k (graph order)."""
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        consumer = num_stages - 1 if node.op == "output" else stages.get(node)
        if consumer is None:
            continue
        for a in node.all_input_nodes:
            if stages.get(a) is not None:
                last_use[a] = max(last_use.get(a, -1), consumer)
    out = [[] for _ in range(num_stages)]
    for node in graph.nodes:
        if stages.get(node) is None or node not in last_use:
            continue
        for k in range(stages[node] + 1, last_use[node] + 1):
            val = _val(node)
            if not isinstance(val, torch.Tensor):
                raise PlanError(
                    f"value {_where(node, plan)}, a {type(val).__name__}, crosses pipeline stage boundary "
                    f"{k - 1}→{k}: only tensors can be sent; move the boundary (the layers' stages) so that its "
                    "users run on its stage, or compute it from tensors on the stage that uses it"
                )
            out[k].append(node)
    return out


# --------------------------------------------------------------------------- stage submodules


def _stage_module(gm: fx.GraphModule, stages: dict, k: int, boundaries: list, num_stages: int,
                  outputs: list[fx.Node]) -> fx.GraphModule:
    """GraphModule of stage ``k``: forward(*boundary_k, <user inputs by name>) → boundary_{k+1} or the output leaves."""
    src = gm.graph
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in boundaries[k]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in src.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    output = next(n for n in src.nodes if n.op == "output")
    wanted = _needed(src, stages, k, boundaries, output if k == num_stages - 1 else None)
    for node in src.nodes:
        if node in wanted and node not in env:
            env[node] = graph.node_copy(node, lambda a: env[a])
    if k == num_stages - 1:
        result = tuple(env[a] for a in outputs)  # the model's tensor output leaves (module docstring)
    else:
        result = tuple(env[n] for n in boundaries[k + 1])
    graph.output(result)
    graph.lint()
    root = {n.target: _fetch(gm, n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    out = fx.GraphModule(root, graph, class_name=f"Stage{k}")
    out.meta = {META_KEY: {"stage": k}}
    return out


def _output_spec(graph: fx.Graph, num_leaves: int) -> pytree.TreeSpec:
    """The model's output structure (the exported graph's pytree ``out_spec``; a flat tuple otherwise)."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        return info.out_spec
    return pytree.tree_structure(tuple(range(num_leaves)))


def _leaf_names(spec: pytree.TreeSpec) -> list[str]:
    """Each output leaf's path in the model's outputs (``['logits']``, ``[1]``, ``.values``), for messages."""
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
    return [pytree.keystr(path) or "the output" for path, _ in paths]


def _model_outputs(graph: fx.Graph, boundaries: list, placeholders: list,
                   plan: Plan) -> tuple[list, pytree.TreeSpec, list[fx.Node]]:
    """The output leaves (nodes and constants), their structure and the tensor leaves the last stage returns,
    checked with the boundaries (``_output_tensors``, ``_check_static_shapes``)."""
    leaves = list(next(n for n in graph.nodes if n.op == "output").args[0])
    spec = _output_spec(graph, len(leaves))
    named = _output_tensors(leaves, spec, plan)
    _check_static_shapes(boundaries, named, placeholders, plan)
    return leaves, spec, [node for _, node in named]


def _output_tensors(leaves: list, spec: pytree.TreeSpec, plan: Plan) -> list[tuple[str, fx.Node]]:
    """(path, node) of the output leaves the graph computes (what the last stage returns); ``PlanError`` for
    one that is not a tensor. Constant leaves (not graph nodes) are kept aside (``PipelineSplit.outputs``)."""
    names = _leaf_names(spec) if spec.num_leaves == len(leaves) else [f"[{i}]" for i in range(len(leaves))]
    out = []
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, fx.Node):
            continue
        val = _val(leaf)
        if not isinstance(val, torch.Tensor):
            raise PlanError(
                f"model output {name} is a {type(val).__name__} computed by {_where(leaf, plan)}, not a tensor: "
                "with pp > 1 the last stage sends tensors only; return it as a tensor (torch.tensor(...)) or "
                "leave it out of the outputs"
            )
        out.append((name, leaf))
    return out


def _check_static_shapes(boundaries: list, outputs: list[tuple[str, fx.Node]], placeholders: list, plan: Plan) -> None:
    """``PlanError`` for a boundary value or output leaf whose shape is not a function of the inputs' shapes."""
    known = set()
    for node in placeholders:
        val = node.meta.get("val")
        for size in getattr(val, "shape", ()):
            if isinstance(size, torch.SymInt):
                known |= size.node.expr.free_symbols
    crossing = [(node, f"crossing into stage {k}") for k, b in enumerate(boundaries) for node in b]
    for node, what in crossing + [(node, f"model output {name}") for name, node in outputs]:
        shape = _val(node).shape
        unknown = {sym for s in shape if isinstance(s, torch.SymInt) for sym in s.node.expr.free_symbols} - known
        if unknown:
            raise PlanError(
                f"{_where(node, plan)}, {what}, has shape {tuple(shape)}, which depends on the data "
                f"({', '.join(sorted(map(str, unknown)))}), not only on the inputs' shapes: the pipeline schedule "
                "allocates its buffers before the step; keep data-dependent shapes inside one stage (move the "
                "boundary) or pad the value to a static size"
            )


def _needed(graph: fx.Graph, stages: dict, k: int, boundaries: list, output: fx.Node | None) -> set[fx.Node]:
    """Nodes stage ``k`` computes: its own, the next boundary's, and the replicable/parameter nodes they read."""
    incoming = set(boundaries[k])
    roots = [n for n, s in stages.items() if s == k]
    if output is not None:
        roots.extend(output.all_input_nodes)
    wanted: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in wanted or node in incoming or node.op == "placeholder":
            continue
        if stages.get(node) is not None and stages[node] != k:
            continue  # produced elsewhere: must arrive through the boundary
        wanted.add(node)
        stack.extend(node.all_input_nodes)
    return wanted


def _fetch(gm: nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def local_parameter_fqns(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> set[str] | None:
    """FQNs of the parameters this rank's stages use, mirrors included (``None`` when pp = 1: all of them).

    ``shard_parameters`` materialises only these; the others become meta tensors.
    """
    if plan.mesh.pp == 1:
        return None
    canonical = {id(p): fqn for fqn, p in gm.named_parameters()}
    per_stage = stage_parameters(gm, plan)
    return {canonical[id(gm.get_parameter(target))] for k, fqns in enumerate(per_stage)
            if k % plan.mesh.pp == ctx.coord("pp") for target in fqns}


__all__ = ["PipelineLayout", "PipelineSplit", "SharedParam", "assign_stages", "local_parameter_fqns", "run",
           "shared_params", "stage_parameters"]
