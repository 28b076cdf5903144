"""The strategy space: mesh shapes, per-layer strategies, micro-batches and schedules.

Everything here is enumerated *outside* CP-SAT; the solver only chooses among
what this module admits. Decisions (docs/search.md has the long form):

Mesh (``enumerate_meshes``)
    ``world = dp_replicate × dp_shard × tp × pp`` with ``cp = 1`` (context
    parallelism is not searched yet) and ``ep`` carved from the data-parallel
    ranks (``ep | dp_replicate·dp_shard``, MoE models only, ``ep | experts``).
    Rules, each with a stable name used in pruning records and messages:

    ============================ ==================================================
    ``tp_in_node``               ``tp | devices_per_node`` (tp never crosses nodes)
    ``tp_divides/heads``         ``tp | num_heads`` of every attention layer
    ``tp_divides/kv_heads``      ``tp | num_kv_heads`` (KV heads are split, not replicated: an MQA
                                 model, one KV head, gets no tp; the runtime refuses a forced plan)
    ``tp_divides/ffn``           ``tp | ffn_hidden`` of every MLP / expert
    ``tp_divides/vocab``         ``tp | vocab`` — the vocabulary is *not* padded: pad it
                                 in the model (Megatron's make-vocab-divisible-by) to use tp
    ``ep_divides/experts``       ``ep | num_experts``
    ``ep_runs/experts``          ``ep = 1`` when a ``moe`` layer's experts are not the bmm on a capacity
                                 buffer the expert-parallel pass exchanges (``LayerInfo.ep_refusal``:
                                 Hugging Face's Mixtral, ``_grouped_mm``)
    ``tp_runs/<reason>``         not a mesh rule but recorded with them (``mesh=None``): a layer with
                                 ``LayerInfo.tp_refusal`` (``passes/_capture_tp.py``; ``<reason>``
                                 ``fused_parts``: a fused projection split into unequal parts,
                                 ``weight_use``: a tp-split weight used other than as a projection's)
                                 keeps ``tp = "none"`` on every mesh (per layer, below); tp > 1 is
                                 still searched for the other layers
    ``pp_le/blocks``             ``pp ≤ num_blocks`` (each stage holds ≥ 1 block)
    ``tied/pp``                  ``pp = 1`` for a model with tied weights: the runtime mirrors a
                                 parameter used on several pipeline ranks (``passes/split_pipeline.py``),
                                 but the cost model does not price the mirror's memory and traffic yet
    ``batch_divides/dp``         ``dp | global_batch``
    ``micro_batch_divides/dp``   a fixed ``TrainSpec.micro_batch`` divides ``global_batch/dp``
    ============================ ==================================================

    ``dp_replicate > 1`` is enumerated only with ``dp_shard > 1``: with
    ``dp_shard = 1`` every state degenerates to replication, which the mesh
    ``dp_shard = dp`` already offers (same behaviour, so the duplicate is skipped).

Per layer (``admissible_strategies``), for one mesh:
    * ``tp = "megatron"`` iff ``mesh.tp > 1`` and the layer has a column / row /
      vocab parameter: once the mesh has a tp axis every tp-able layer uses it
      (a layer replicated over tp would waste the axis and need extra
      re-layout collectives); norms and the value head stay ``"none"``, and so
      does a layer the runtime cannot split (``tp_runs/<reason>``:
      ``LayerInfo.tp_refusal``; ``Plan.check_compatible`` refuses a plan that
      splits it).
    * ``sp ∈ {False, True}`` only when ``mesh.tp > 1``; the solver makes ``sp``
      one global choice (the norm regions between tp layers must agree). A
      ``moe`` layer offers ``sp = False`` only (``sp_runs/moe``: the runtime
      routes flattened ``[B·S, h]`` tokens, which have no sequence dim to keep
      sharded), so a model with MoE layers trains without SP. Nor does a layer
      kept at ``tp = "none"`` by ``tp_runs`` (``sp_runs/tp_refusal``): the
      runtime would run it, replicated, on the sequence chunks (an attention
      would see only this rank's chunk; ``model_parallel`` declares no
      collectives for its column / row parameters left unsplit).
    * ``ep = True`` iff the layer is MoE and ``mesh.ep > 1`` (same reasoning as tp). Such a layer is
      offered ``state = "replicate"`` and ``tp = "none"`` only (``ep_runs/state``): the runtime builds
      expert parallelism with whole expert states on every rank of an expert's data-parallel group
      (``passes/context._expert_dim``); sharding them over that group is not built, so it is not priced.
    * ``state``: all of ``STATES`` when ``dp > 1`` and the layer has parameters;
      ``replicate`` / ``offload`` when ``dp = 1`` (sharding over one rank is
      replication); ``replicate`` only for a layer without parameters.
    * ``weight_comm`` other than ``bf16`` only with ``zero3`` (qwZ: only ZeRO-3
      gathers weights); ``grad_comm`` ``int8`` / ``int4`` only with ``zero2`` /
      ``zero3`` (qgZ); with ``dp = 1`` or no parameters both stay ``bf16``.
      Quantized wires are lossy: with ``TrainSpec.comm_precision = "exact"`` (the
      default) a layer is offered only the ones its pin names; ``"auto"`` offers
      them all. Offered only when pinned, because they cost the same or more for the
      same memory and so a time-minimising search never picks them:
      ``grad_comm = "fp32"`` (twice the bytes of bf16: a numerics choice) and
      ``weight_comm = "fp8"`` (the same bytes as int8: a numerics choice).
    * ``recompute ∈ {none, selective, full}`` for layers with an attention core
      (``attention_flops_per_token_seq`` or ``saved_interior_per_token_seq``
      > 0); ``{none, full}`` for the rest, where selective recompute (which
      drops the attention scores, Korthikanti et al.) equals ``none``.

Schedules (``schedule_candidates``): micro-batch sizes are the divisors of
``global_batch / dp`` (or the fixed ``TrainSpec.micro_batch``); ``m`` =
``global_batch / (dp · micro_batch)``. With ``pp = 1`` the only schedule is
``1f1b`` (plain gradient accumulation). With ``pp > 1``: ``1f1b`` (``m ≥ pp``,
torch.distributed.pipelining's requirement), ``gpipe`` only where 1F1B is not
admissible (``m < pp``) or it is asked for — both take ``(m + p − 1)·T``, and
GPipe keeps all m micro-batches in flight where 1F1B keeps ``p − k``, so
GPipe is otherwise dominated — and
``interleaved_1f1b`` with ``v ∈ {2, 3, 4}`` virtual stages when
``num_blocks % (pp·v) == 0`` and ``m % pp == 0`` (Megatron's requirement).

User constraints (``Constraints``) are validated here, against the graph and
cluster, before any search: unknown layers, fields, values and mesh axes, a
degree that does not divide the world, and pins that contradict each other or
a fixed mesh raise ``AutoshardError`` naming the value and the way out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.graph import LayerInfo, ModelGraph
from autoshard.plan import (
    GRAD_COMM, MESH_AXES, RECOMPUTE, SCHEDULES, STATES, TP_MODES, WEIGHT_COMM, LayerStrategy, Mesh, Schedule,
)
from autoshard.train import TrainSpec

TP_ABLE_ROLES = ("column", "row", "vocab")
__all__ = [
    "RECOMPUTE", "Constraints", "MeshEnumeration", "PruneRecord", "SolverClass", "admissible_strategies",
    "divisors", "enumerate_meshes", "resolve_pins", "schedule_candidates", "solver_classes", "strategy_key",
    "validate_constraints",
]
PIN_FIELDS: dict[str, tuple] = {
    "state": STATES, "tp": TP_MODES, "sp": (False, True), "ep": (False, True), "recompute": RECOMPUTE,
    "weight_comm": WEIGHT_COMM, "grad_comm": GRAD_COMM,
}
MAX_VIRTUAL_STAGES = 4


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What a user fixes before the search.

    pin: layer name or layer-class id → partial strategy, e.g.
        ``{"lm_head": {"state": "zero3"}, "attention:4096:32:32": {"recompute": "full"}}``.
        Fields: ``state tp sp ep recompute weight_comm grad_comm`` (the stage is
        chosen by the solver; fix ``pp`` through ``mesh``).
    mesh: mesh axis → degree, e.g. ``{"tp": 8, "pp": 4}``; free axes are searched.
    max_memory_bytes: per-rank memory limit; default the device memory.
    memory_headroom: fraction of the limit kept free for the allocator;
        ``None`` (default) uses the cost model's own allowance
        (``cost_model.usable_memory_bytes``: reserved CUDA/NCCL bytes and
        allocator fragmentation), so the solver and ``predict`` agree.
    schedule: restrict the pipeline schedule to one of ``SCHEDULES``.
    """

    pin: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    mesh: Mapping[str, int] = field(default_factory=dict)
    max_memory_bytes: int | None = None
    memory_headroom: float | None = None
    schedule: str | None = None


@dataclass(frozen=True)
class PruneRecord:
    """Why a mesh (or a whole axis value, when ``mesh`` is None) was not searched."""

    constraint: str  # stable name, e.g. "tp_divides/heads"
    detail: str
    mesh: Mesh | None = None


@dataclass(frozen=True)
class MeshEnumeration:
    """Meshes that pass every mesh-level rule, and why the others did not."""

    meshes: tuple[Mesh, ...]
    pruned: tuple[PruneRecord, ...]


@dataclass(frozen=True)
class SolverClass:
    """A group of layers that share one strategy variable set in CP-SAT.

    Normally one layer class (``LayerInfo.class_id``); a pin on a single layer, or a
    ``tp_refusal`` its class twins lack, splits it off into its own group, named
    ``<class_id>@<layer>``.
    """

    name: str
    class_id: str
    layers: tuple[LayerInfo, ...]
    pin: tuple[tuple[str, Any], ...] = ()

    @property
    def representative(self) -> LayerInfo:
        return self.layers[0]


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def is_tp_able(layer: LayerInfo) -> bool:
    """Whether Megatron tp splits any of the layer's parameters."""
    return any(p.tp_role in TP_ABLE_ROLES for p in layer.params)


def tp_runs(layer: LayerInfo) -> bool:
    """Whether Megatron tp may split the layer: it is tp-able and capture found nothing the tensor-parallel
    runtime cannot split (``LayerInfo.tp_refusal``, rule ``tp_runs/<reason>``)."""
    return is_tp_able(layer) and not layer.tp_refusal


# ``tp_runs/<reason>``: a phrase of the refusals ``passes/_capture_tp.py`` writes → the reason's name
_TP_REFUSAL_REASONS = (("unequal parts", "fused_parts"), ("not as a projection's weight", "weight_use"))


def _tp_refusal_records(graph: ModelGraph) -> list[PruneRecord]:
    """One ``tp_runs/<reason>`` record per reason: the first layer kept at tp='none' for it, and how many."""
    by_rule: dict[str, list[LayerInfo]] = {}
    for layer in graph.layers:
        if is_tp_able(layer) and layer.tp_refusal:
            reason = next((name for phrase, name in _TP_REFUSAL_REASONS if phrase in layer.tp_refusal), "layer")
            by_rule.setdefault(f"tp_runs/{reason}", []).append(layer)
    return [PruneRecord(rule, f"tp='megatron' on {layers[0].name}"
                        + (f" (and {len(layers) - 1} more layers)" if len(layers) > 1 else "")
                        + f": {layers[0].tp_refusal}; kept at tp='none' (and sp=False) on meshes with tp > 1")
            for rule, layers in by_rule.items()]


def is_moe(graph: ModelGraph) -> bool:
    return any(layer.kind == "moe" for layer in graph.layers)


# ----------------------------------------------------------------------------- meshes
def _tp_violations(graph: ModelGraph, tp: int) -> list[PruneRecord]:
    """Divisibility rules a tensor-parallel degree breaks (empty when tp is admissible)."""
    checks = (
        ("heads", "num_heads", ("attention",)), ("kv_heads", "num_kv_heads", ("attention",)),
        ("ffn", "ffn_hidden", ("mlp", "moe")), ("vocab", "vocab", ("embedding", "head")),
    )
    out = []
    for rule, attr, kinds in checks:
        for layer in graph.layers:
            value = getattr(layer, attr)
            if layer.kind in kinds and value and value % tp:
                out.append(PruneRecord(f"tp_divides/{rule}", f"tp={tp} does not divide {attr}={value} of {layer.name}"))
                break
    return out


def _num_experts(graph: ModelGraph) -> int:
    return math.gcd(*[layer.num_experts or 1 for layer in graph.layers if layer.kind == "moe"] or [1])


def _dp_meshes(dp: int, tp: int, pp: int, experts: int, moe: bool) -> list[Mesh]:
    out = []
    for dp_shard in divisors(dp):
        dp_replicate = dp // dp_shard
        if dp_replicate > 1 and dp_shard == 1:
            continue  # same behaviour as dp_shard=dp (module docstring)
        eps = divisors(math.gcd(dp, experts)) if moe else [1]
        out.extend(Mesh(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep) for ep in eps)
    return out


def enumerate_meshes(graph: ModelGraph, cluster: Cluster, train: TrainSpec | None = None,
                     fixed: Mapping[str, int] | None = None) -> MeshEnumeration:
    """Every admissible mesh for ``graph`` on ``cluster`` (module docstring lists the rules).

    ``fixed`` (axis → degree) keeps only meshes with those degrees. Returns the
    meshes in a deterministic order and one ``PruneRecord`` per rejected tp
    degree, pp degree or mesh.
    """
    fixed = dict(fixed or {})
    world = cluster.world_size
    pruned: list[PruneRecord] = []
    meshes: list[Mesh] = []
    no_ep = next((layer for layer in graph.layers if layer.kind == "moe" and layer.ep_refusal), None)
    if no_ep is not None:
        pruned.append(PruneRecord("ep_runs/experts", f"ep > 1: {no_ep.name}: {no_ep.ep_refusal}"))
    if world > 1:
        pruned.extend(_tp_refusal_records(graph))
    for tp in divisors(world):
        if cluster.devices_per_node % tp:
            pruned.append(PruneRecord("tp_in_node", f"tp={tp} does not divide devices_per_node={cluster.devices_per_node}"))
            continue
        violations = _tp_violations(graph, tp)
        if violations:
            pruned.extend(violations)
            continue
        tied = next((layer for layer in graph.layers if layer.tied_params), None)
        for pp in divisors(world // tp):
            if pp > max(graph.num_blocks, 1):
                pruned.append(PruneRecord("pp_le/blocks", f"pp={pp} > num_blocks={graph.num_blocks}"))
                continue
            if pp > 1 and tied is not None:  # the mirror (split_pipeline) is not priced
                pruned.append(PruneRecord("tied/pp", f"pp={pp}: {tied.name!r} uses the tied weight "
                                          f"{tied.tied_params[0]!r} of an earlier layer, which would sit on "
                                          "another pipeline rank; the runtime mirrors it there, but the cost "
                                          "model does not price the mirror yet: untie the embeddings to search "
                                          "pipelines of this model, or hand compile(plan=...) a plan with pp > 1"))
                continue
            dp = world // (tp * pp)
            for mesh in _dp_meshes(dp, tp, pp, _num_experts(graph), is_moe(graph) and no_ep is None):
                record = _mesh_batch_violation(mesh, train)
                if record:
                    pruned.append(record)
                elif all(getattr(mesh, axis) == degree for axis, degree in fixed.items()):
                    meshes.append(mesh)
    return MeshEnumeration(tuple(meshes), tuple(pruned))


def _mesh_batch_violation(mesh: Mesh, train: TrainSpec | None) -> PruneRecord | None:
    if train is None:
        return None
    if train.global_batch % mesh.dp:
        return PruneRecord("batch_divides/dp", f"dp={mesh.dp} does not divide global_batch={train.global_batch}", mesh)
    per_rank = train.global_batch // mesh.dp
    if train.micro_batch is not None and per_rank % train.micro_batch:
        return PruneRecord(
            "micro_batch_divides/dp",
            f"micro_batch={train.micro_batch} does not divide global_batch/dp={per_rank}", mesh,
        )
    return None


# ----------------------------------------------------------------------------- strategies
def _comm_options(state: str, dp: int, has_params: bool, pin: Mapping[str, Any],
                  comm_precision: str = "exact") -> tuple[tuple[str, ...], tuple[str, ...]]:
    if dp == 1 or not has_params:
        return ("bf16",), ("bf16",)
    weight = ("bf16", "int8") if state == "zero3" else ("bf16",)
    grad = ("bf16", "int8", "int4") if state in ("zero2", "zero3") else ("bf16",)
    if comm_precision == "exact":  # quantized wires only where a pin names one (module docstring)
        weight = tuple(w for w in weight if w == "bf16" or pin.get("weight_comm") == w)
        grad = tuple(g for g in grad if g == "bf16" or pin.get("grad_comm") == g)
    if pin.get("weight_comm") == "fp8" and state == "zero3":
        weight += ("fp8",)
    return weight, (grad + ("fp32",) if pin.get("grad_comm") == "fp32" else grad)


def _recompute_options(layer: LayerInfo) -> tuple[str, ...]:
    has_core = layer.attention_flops_per_token_seq > 0 or layer.saved_interior_per_token_seq > 0
    return RECOMPUTE if has_core else ("none", "full")


def admissible_strategies(layer: LayerInfo, mesh: Mesh, pin: Mapping[str, Any] | None = None,
                          comm_precision: str = "exact", offload: bool = True) -> tuple[LayerStrategy, ...]:
    """Strategies ``layer`` may take on ``mesh`` (module docstring), filtered by ``pin``.

    ``comm_precision`` (``TrainSpec.comm_precision``): ``"exact"`` offers quantized wires only where
    ``pin`` names one. ``offload=False`` drops the ``offload`` state unless ``pin`` asks for it (the
    solver's first pass: no offload on a model that fits without it).

    Each is a ``LayerStrategy`` named after ``layer`` with ``stage = 0``; the
    order is canonical (enum order of every field), so the solver is deterministic.
    """
    has_params = bool(layer.params)
    tp = "megatron" if mesh.tp > 1 and tp_runs(layer) else "none"
    ep = mesh.ep > 1 and layer.kind == "moe"
    states = STATES if mesh.dp > 1 and has_params else (("replicate", "offload") if has_params else ("replicate",))
    if ep:  # ep_runs/state
        tp, states = "none", ("replicate",)
    pin = dict(pin or {})
    if not offload and pin.get("state") != "offload":
        states = tuple(s for s in states if s != "offload")
    sp_runs = layer.kind != "moe" and not (is_tp_able(layer) and layer.tp_refusal)  # sp_runs/moe, sp_runs/tp_refusal
    sps = (False, True) if mesh.tp > 1 and sp_runs else (False,)
    out = []
    for state in states:
        weights, grads = _comm_options(state, mesh.dp, has_params, pin, comm_precision)
        for sp in sps:
            for recompute in _recompute_options(layer):
                for weight_comm in weights:
                    for grad_comm in grads:
                        out.append(LayerStrategy(layer=layer.name, state=state, tp=tp, sp=sp, ep=ep,
                                                 recompute=recompute, weight_comm=weight_comm, grad_comm=grad_comm))
    return tuple(s for s in out if all(getattr(s, k) == v for k, v in pin.items()))


_POSITION = tuple({name: i for i, name in enumerate(values)}
                  for values in (STATES, TP_MODES, RECOMPUTE, WEIGHT_COMM, GRAD_COMM))  # enum → order


def strategy_key(s: LayerStrategy) -> tuple:
    """Canonical sort key of a strategy's decision fields (enum order; the search's hottest helper)."""
    state, tp, recompute, weight, grad = _POSITION
    return (state[s.state], tp[s.tp], s.sp, s.ep, recompute[s.recompute], weight[s.weight_comm], grad[s.grad_comm])


# ----------------------------------------------------------------------------- schedules
def schedule_candidates(mesh: Mesh, graph: ModelGraph, train: TrainSpec,
                        only: str | None = None) -> tuple[Schedule, ...]:
    """(micro-batch, schedule) choices for ``mesh`` (module docstring), deterministic order."""
    per_rank = train.global_batch // mesh.dp
    mbs = [train.micro_batch] if train.micro_batch else divisors(per_rank)
    out: list[Schedule] = []
    for mb in mbs:
        m = per_rank // mb
        if mesh.pp == 1:
            out.append(Schedule(name="1f1b", micro_batch=mb, num_micro_batches=m))
            continue
        one_f_one_b = Schedule(name="1f1b", micro_batch=mb, num_micro_batches=m)
        if one_f_one_b.admits(m, mesh.pp):
            out.append(one_f_one_b)
        if not one_f_one_b.admits(m, mesh.pp) or only == "gpipe":
            out.append(Schedule(name="gpipe", micro_batch=mb, num_micro_batches=m))
        if Schedule(name="interleaved_1f1b").admits(m, mesh.pp):
            for v in range(2, MAX_VIRTUAL_STAGES + 1):
                if graph.num_blocks % (mesh.pp * v) == 0:
                    out.append(Schedule(name="interleaved_1f1b", micro_batch=mb, num_micro_batches=m,
                                        virtual_stages=v))
    if only is not None and mesh.pp > 1:
        out = [s for s in out if s.name == only]
    return tuple(out)


# ----------------------------------------------------------------------------- constraints
def _bad(what: str, value: Any, allowed: Any, step: str) -> AutoshardError:
    return AutoshardError(f"{what}={value!r} is not allowed; allowed: {allowed}; {step}")


def validate_constraints(constraints: Constraints, graph: ModelGraph, cluster: Cluster) -> None:
    """Raise ``AutoshardError`` for anything malformed or self-contradictory in ``constraints``."""
    world = cluster.world_size
    for axis, degree in sorted(constraints.mesh.items()):
        if axis not in MESH_AXES:
            raise _bad("Constraints.mesh axis", axis, MESH_AXES, "use one of the mesh axes")
        if not isinstance(degree, int) or degree < 1 or (axis != "ep" and world % degree):
            raise _bad(f"Constraints.mesh[{axis!r}]", degree, f"divisors of the world size {world}: {divisors(world)}",
                       "pick a divisor or change the cluster")
    if constraints.mesh.get("cp", 1) != 1:
        raise _bad("Constraints.mesh['cp']", constraints.mesh["cp"], (1,), "context parallelism is not searched yet")
    if constraints.schedule is not None and constraints.schedule not in SCHEDULES:
        raise _bad("Constraints.schedule", constraints.schedule, SCHEDULES, "pick one or leave it None")
    if constraints.max_memory_bytes is not None and constraints.max_memory_bytes <= 0:
        raise _bad("Constraints.max_memory_bytes", constraints.max_memory_bytes, "> 0", "give bytes per rank")
    if constraints.memory_headroom is not None and not 0.0 <= constraints.memory_headroom < 1.0:
        raise _bad("Constraints.memory_headroom", constraints.memory_headroom, "[0, 1)", "give a fraction")
    pins = resolve_pins(constraints, graph)
    for layer in graph.layers:
        _check_pin_contradictions(layer, pins.get(layer.name, {}), constraints.mesh)


def resolve_pins(constraints: Constraints, graph: ModelGraph) -> dict[str, dict[str, Any]]:
    """Layer name → merged pin (class pins, then layer pins); validates names, fields and values."""
    names = {layer.name for layer in graph.layers}
    class_ids = {layer.class_id for layer in graph.layers}
    out: dict[str, dict[str, Any]] = {}
    for target in sorted(constraints.pin, key=lambda t: (t in names, t)):  # classes first, then layers
        pin = constraints.pin[target]
        if target not in names and target not in class_ids:
            raise _bad("Constraints.pin target", target, f"layer names or class ids, e.g. {sorted(class_ids)[:6]}",
                       "`autoshard capture MODEL` lists the layers and their class ids (or ModelGraph.classes())")
        for key, value in pin.items():
            if key not in PIN_FIELDS:
                raise _bad(f"Constraints.pin[{target!r}] field", key, tuple(PIN_FIELDS),
                           "the stage is chosen by the solver; fix pp with Constraints.mesh")
            if value not in PIN_FIELDS[key] or (key in ("sp", "ep") and not isinstance(value, bool)):
                raise _bad(f"Constraints.pin[{target!r}][{key!r}]", value, PIN_FIELDS[key], "pick an allowed value")
        for layer in graph.layers:
            if layer.name == target or (layer.class_id == target and target not in names):
                merged = out.setdefault(layer.name, {})
                merged.update(pin)
    return out


def _check_pin_contradictions(layer: LayerInfo, pin: Mapping[str, Any], mesh: Mapping[str, int]) -> None:
    where = f"Constraints.pin for {layer.name}"
    stateful = {k: v for k, v in pin.items() if k in ("state", "weight_comm", "grad_comm")
                and v != {"state": "replicate"}.get(k, "bf16")}
    if stateful and not layer.params:
        owner = (f"{layer.tied_params[0]!r} is the tied weight of an earlier layer, the embedding for a tied LM "
                 "head, whose strategy sets its state: pin that layer"
                 if layer.tied_params else "it holds no state to shard")
        raise AutoshardError(f"{where}: {stateful} applies to a layer's own parameters, but {layer.name!r} has none "
                             f"({owner}); drop these fields from the pin")
    if pin.get("tp") == "megatron" and not is_tp_able(layer):
        raise AutoshardError(f"{where}: tp='megatron' but the layer has no column/row/vocab parameter; "
                             "pin tp='none' or drop the pin")
    if pin.get("tp") == "megatron" and mesh.get("tp") == 1:
        raise AutoshardError(f"{where}: tp='megatron' contradicts Constraints.mesh tp=1; drop one of them")
    if pin.get("tp") == "megatron" and layer.tp_refusal:
        raise AutoshardError(f"{where}: tp='megatron' but the tensor-parallel runtime cannot split the layer "
                             f"({layer.tp_refusal}; rule tp_runs); pin tp='none' or drop the pin")
    if pin.get("sp") and is_tp_able(layer) and layer.tp_refusal:
        raise AutoshardError(f"{where}: sp=True on a layer kept at tp='none' (rule tp_runs: {layer.tp_refusal}) "
                             "would run replicated on sequence chunks (sp_runs/tp_refusal); pin sp=False or "
                             "drop the pin")
    if pin.get("tp") == "none" and tp_runs(layer) and mesh.get("tp", 1) > 1:
        raise AutoshardError(f"{where}: tp='none' contradicts Constraints.mesh tp={mesh['tp']} (every tp-able "
                             "layer uses the tp axis); drop one of them")
    if pin.get("sp") and mesh.get("tp") == 1:
        raise AutoshardError(f"{where}: sp=True needs tensor parallelism but Constraints.mesh has tp=1")
    if pin.get("sp") and layer.kind == "moe":
        raise AutoshardError(f"{where}: sp=True on an MoE layer: the runtime routes flattened tokens, which "
                             "cannot stay sequence-sharded (sp_runs/moe); pin sp=False or drop the pin")
    if pin.get("ep") and (layer.kind != "moe" or mesh.get("ep") == 1):
        raise AutoshardError(f"{where}: ep=True needs an MoE layer on a mesh with ep>1 "
                             f"(layer kind {layer.kind!r}, mesh ep={mesh.get('ep', 'free')})")
    state = pin.get("state")
    if state and pin.get("weight_comm", "bf16") != "bf16" and state != "zero3":
        raise AutoshardError(f"{where}: weight_comm={pin['weight_comm']!r} needs state='zero3', got {state!r}")
    if state and pin.get("grad_comm") in ("int8", "int4") and state not in ("zero2", "zero3"):
        raise AutoshardError(f"{where}: grad_comm={pin['grad_comm']!r} needs state 'zero2' or 'zero3', got {state!r}")
    if state and state not in ("replicate", "offload") and mesh.get("dp_replicate", 0) * mesh.get("dp_shard", 0) == 1:
        raise AutoshardError(f"{where}: state={state!r} shards over data-parallel ranks but Constraints.mesh "
                             "has dp=1; use 'replicate' or 'offload', or allow dp>1")


def solver_classes(graph: ModelGraph, pins: Mapping[str, Mapping[str, Any]]) -> tuple[SolverClass, ...]:
    """Group layers by (class id, pin); see ``SolverClass``. Ordered by first layer."""
    groups: dict[tuple, list[LayerInfo]] = {}
    for layer in graph.layers:
        pin = tuple(sorted(pins.get(layer.name, {}).items()))
        # tp_refusal is not in the class id: a refused layer must not share a strategy with a splittable twin
        groups.setdefault((layer.class_id, pin, layer.tp_refusal), []).append(layer)
    per_class: dict[str, int] = {}
    for class_id, _, _ in groups:
        per_class[class_id] = per_class.get(class_id, 0) + 1
    out = []
    for (class_id, pin, _), layers in groups.items():
        name = class_id if per_class[class_id] == 1 else f"{class_id}@{layers[0].name}"
        out.append(SolverClass(name=name, class_id=class_id, layers=tuple(layers), pin=pin))
    return tuple(out)
