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
* a node inside a plan layer (``nn_module_stack``, or the ``layer`` a pass
  recorded in ``node.meta["autoshard"]``, e.g. a ZeRO-3 gather) takes that
  layer's ``LayerStrategy.stage``;
* any other node (a residual add between layers, a Megatron f/g op) takes the
  largest stage of its inputs (it runs as soon as its inputs exist), or, with
  no staged input, the smallest stage of its users;
* a ``get_attr`` of a parameter is copied into every stage that uses it.

Data must flow forward: an input of a node on stage ``s`` comes from a stage
``<= s`` (``PlanError`` otherwise). Boundary ``s → s+1`` carries every staged
value produced on a stage ``<= s`` and used on a stage ``> s`` (values that
skip stages are passed through), in graph order; each must be a tensor.
The last stage returns the leaves of the model's outputs (logits and values:
the loss is computed there) as a flat tuple; ``PipelineSplit.output_spec``
rebuilds their structure. So every stage returns a tuple of tensors, the one
output form ``torch.distributed.pipelining`` handles (it detaches each output
of the last stage after its backward: a dict would not pass).

Partial: a parameter used by stages on different pp ranks (tied embedding and
LM head on the first and last stage) raises ``PlanError``; it needs a
gradient all-reduce between the ranks holding a copy (Megatron's embedding
group), not implemented yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, node_layer
from autoshard.passes.context import RankContext
from autoshard.plan import Plan

NAME = "split_pipeline"


@dataclass(frozen=True)
class PipelineLayout:
    """Static shape of one rank's pipeline (module docstring).

    num_stages: K = pp · virtual_stages; stage ``k`` runs on pp rank ``k % pp``.
    local_stages: the stages of this rank, ascending.
    input_names: the model's user inputs (e.g. ``("tokens",)``), given to every stage by keyword.
    boundaries: per stage ``k``, the names of the values it receives from stage ``k - 1``
        (empty for stage 0), in the order of its positional arguments.
    """

    num_stages: int
    pp: int
    local_stages: tuple[int, ...]
    input_names: tuple[str, ...]
    boundaries: tuple[tuple[str, ...], ...]

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
        self.output_vals: list = vals["outputs"]  # the model's output leaves
        self.output_spec = vals["output_spec"]  # their pytree structure
        self.meta = meta

    def stage(self, k: int) -> fx.GraphModule:
        """The submodule of local stage ``k``."""
        return self.get_submodule(f"stage_{k}")

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Parameter FQN (as in the unsplit model) → the one local Parameter object."""
        out: dict[str, nn.Parameter] = {}
        for k in self.layout.local_stages:
            for fqn, p in self.stage(k).named_parameters():
                out.setdefault(fqn, p)
        return out

    def boundary_shapes(self, k: int, inputs: dict[str, torch.Tensor]) -> list[torch.Size]:
        """Concrete shapes of stage ``k``'s positional inputs for user inputs ``inputs`` (e.g. one micro-batch):
        a sequence-sharded value (SP) has ``1/tp`` of the global sequence dim."""
        shapes = self._concrete_shapes(self.boundary_vals[k], inputs)
        for i, shard in enumerate(self.boundary_shards[k]):
            if shard is not None:
                dim, tp = shard
                shapes[i] = torch.Size(size // tp if d == dim else size for d, size in enumerate(shapes[i]))
        return shapes

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
    _check_flow(graph, stages, num_stages)
    _check_shared_params(gm, stages, plan.mesh.pp)
    boundaries = _boundaries(graph, stages, num_stages)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    local = tuple(k for k in range(num_stages) if k % plan.mesh.pp == ctx.coord("pp"))
    modules = {k: _stage_module(gm, stages, k, boundaries, num_stages) for k in local}
    meta = dict(gm.meta)
    meta[META_KEY] = dict(meta.get(META_KEY, {}))
    used = {fqn for m in modules.values() for fqn, _ in m.named_parameters()}
    meta[META_KEY]["placements"] = {f: p for f, p in meta[META_KEY]["placements"].items() if f in used}
    layout = PipelineLayout(
        num_stages=num_stages,
        pp=plan.mesh.pp,
        local_stages=local,
        input_names=tuple(n.name for n in placeholders),
        boundaries=tuple(tuple(n.name for n in b) for b in boundaries),
    )
    leaves = list(next(n for n in graph.nodes if n.op == "output").args[0])
    vals = {
        "boundaries": {k: [_val(n) for n in boundaries[k]] for k in range(num_stages)},
        "boundary_shards": {k: [_seq_shard(n) for n in boundaries[k]] for k in range(num_stages)},
        "inputs": {n.name: n.meta["val"] for n in placeholders},
        "outputs": [_val(n) for n in leaves],
        "output_spec": _output_spec(graph, len(leaves)),
    }
    split = PipelineSplit(modules, layout, vals, meta)
    regather = meta[META_KEY].get("regather")
    if regather:
        split.add_module(regather, gm.get_submodule(regather))
    meta[META_KEY]["pipeline"] = layout
    return split


# --------------------------------------------------------------------------- stage assignment


def _param_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    names = {fqn for fqn, _ in gm.named_parameters(remove_duplicate=False)}
    return {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in names}


def assign_stages(gm: fx.GraphModule, plan: Plan) -> dict[fx.Node, int | None]:
    """Stage of every node; ``None`` = replicable; parameter ``get_attr`` nodes are absent (module docstring)."""
    params = _param_nodes(gm)
    stage_of_layer = {s.layer: s.stage for s in plan.layers}
    stages: dict[fx.Node, int | None] = {}
    deferred = []
    for node in gm.graph.nodes:
        if node in params or node.op == "output":
            continue
        inputs = node.all_input_nodes
        if not any(a in params or stages.get(a) is not None for a in inputs):
            stages[node] = None  # replicable: depends on no parameter
            continue
        layer = node_layer(node, plan) or (node.meta.get(META_KEY) or {}).get("layer")
        staged = [stages[a] for a in inputs if stages.get(a) is not None]
        if layer in stage_of_layer:
            stages[node] = stage_of_layer[layer]
        elif staged:
            stages[node] = max(staged)
        else:
            stages[node] = -1  # only parameters as inputs: placed with its users below
            deferred.append(node)
    for node in reversed(deferred):
        users = [stages[u] for u in node.users if stages.get(u) is not None and stages[u] >= 0]
        if not users:
            raise PlanError(f"node {node.name} uses parameters but no plan layer; capture and plan the same model")
        stages[node] = min(users)
    return stages


def _check_flow(graph: fx.Graph, stages: dict, num_stages: int) -> None:
    for node, k in stages.items():
        if k is None:
            continue
        if not 0 <= k < num_stages:
            raise PlanError(f"node {node.name} is on stage {k}; allowed stages 0..{num_stages - 1} (pp × virtual_stages)")
        for a in node.all_input_nodes:
            if stages.get(a) is not None and stages[a] > k:
                raise PlanError(
                    f"node {node.name} (stage {k}) uses {a.name} from stage {stages[a]}: stages must follow the "
                    "data flow; give later layers stages >= earlier ones"
                )


def _check_shared_params(gm: fx.GraphModule, stages: dict, pp: int) -> None:
    for node in _param_nodes(gm):
        ranks = {stages[u] % pp for u in node.users if stages.get(u) is not None}
        if len(ranks) > 1:
            raise PlanError(
                f"parameter {node.target!r} is used on pp ranks {sorted(ranks)} (a tied embedding/head across "
                "stages): sharing a parameter between pipeline ranks is not implemented yet; untie it "
                "(tie_embeddings=False) or place its users on one pp rank"
            )


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


def _boundaries(graph: fx.Graph, stages: dict, num_stages: int) -> list[list[fx.Node]]:
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
                    f"value {node.name} ({type(val).__name__}) crosses pipeline stage boundary {k - 1}→{k}; "
                    "only tensors can be sent: move the boundary"
                )
            out[k].append(node)
    return out


# --------------------------------------------------------------------------- stage submodules


def _stage_module(gm: fx.GraphModule, stages: dict, k: int, boundaries: list, num_stages: int) -> fx.GraphModule:
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
        result = tuple(env[a] for a in output.args[0])  # the model's output leaves (module docstring)
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
    """FQNs of the parameters this rank's stages use (``None`` when pp = 1: all of them).

    ``shard_parameters`` materialises only these; the others become meta tensors.
    """
    if plan.mesh.pp == 1:
        return None
    stages = assign_stages(gm, plan)
    canonical = {id(p): fqn for fqn, p in gm.named_parameters()}
    out = set()
    for node in _param_nodes(gm):
        if any(stages.get(u) is not None and stages[u] % plan.mesh.pp == ctx.coord("pp") for u in node.users):
            out.add(canonical[id(gm.get_parameter(node.target))])
    return out


__all__ = ["PipelineLayout", "PipelineSplit", "assign_stages", "local_parameter_fqns", "run"]
