"""``Plan``: the decision record search writes and the runtime executes.

A plan is data: frozen dataclasses, no live objects, saved as versioned JSON
(never pickle; nothing loaded is executed). It holds the mesh degrees, one
``LayerStrategy`` per layer, the pipeline schedule, the predictions of the
cost model, solver statistics and fingerprints of the model graph, cluster
and cost-model version, so a plan loaded for another model or cluster is
refused with what differs.

Forms (as DTensor prints ``Shard(dim=0)`` for machines and ``S(0)`` for people):

* ``repr(plan)``: the full dataclass repr;
* ``str(plan)``: a table (``autoshard/plan_format.py``): a mesh line
  ``mesh dp_replicate=1 dp_shard=8 tp=1 pp=1 ep=1 cp=1 (world 8) | 1f1b m=4
  mb=2``, the predictions, then one row per layer, with runs of identical
  blocks folded (``blocks.0-31.attn``);
* ``plan.to_rich()``: the same as a ``rich`` renderable for the CLI;
* ``str(strategy)`` / ``strategy.notation``: a compact per-layer notation,
  parts joined by ``·`` and omitted when at their default::

      DDP | Z1 | Z2 | Z3 | Off      state: replicate, zero1/2/3, offload
      TP                            tp == "megatron"
      SP                            sequence parallelism
      EP                            expert parallelism
      R(sel) | R(full)              recompute
      qW8 | qWf8                    weight all-gather in int8 / fp8
      qG8 | qG4 | G32               gradient reduction in int8 / int4 / fp32

  e.g. ``Z3·TP·SP·R(sel)·qW8``. The stage is not part of the notation (it is
  its own column).

JSON form (``to_dict``/``save``): every dataclass field under its own name,
plus ``"format": "autoshard.plan"`` and ``"version": 1`` at the top;
``sort_keys`` and 2-space indent, so one plan always gives the same bytes.

Reproducible files (a decision): identical inputs give identical bytes. A
plan file holds decisions, predictions and fingerprints, nothing about the
run that made it: no timestamp, no host, and no search wall time.
``SolverStats.wall_s`` is kept in memory (``autoshard plan`` prints it in its
timing line) but never written and not part of ``==``; files written before
this decision hold it, are still read (the value is checked, then kept in
memory only) and stay version 1, since no reader needs it. Floats are
written by ``json`` (shortest round-trip ``repr``), keys sorted, and the
search is deterministic for a given input (``search/solver.py``,
"Determinism"; a search cut short by its time limit is not).
``save`` writes a temporary file in the target directory and
``os.replace``-s it, so a reader never sees half a plan; the target must be a
regular file or nothing (``file_io.atomic_write``). ``load`` reads by
``autoshard/file_io.py``'s rules (a regular file of at most 16 MiB, UTF-8,
nesting ≤ 64, no duplicate keys), checks every field's type, enum and range
(``autoshard/_plan_schema.py``) and names the JSON path of the first bad one.
Every field must be present (a plan without ``global_batch`` is damaged, not
defaulted) but each record's ``OPTIONAL_ON_LOAD`` fields (``Predictions``, ``Fingerprints``,
``RolloutOption``, ...), added after the first plans were written; unknown fields are refused; the mesh's world size is at most
``file_io.MAX_WORLD_SIZE`` (2**20).

Invariants checked on construction and load: mesh degrees >= 1 and ``ep``
divides ``dp_replicate * dp_shard``; layer names unique; stages
non-decreasing across layers and ``< pp * virtual_stages`` (with interleaving a
layer's stage is its virtual stage, run by pp rank ``stage % pp``, as in
Megatron-Core); ``virtual_stages > 1`` only with
``interleaved_1f1b``; times and bytes >= 0 and finite.

``check_compatible(graph=, cluster=)`` compares the stored fingerprints and
says what differs: the first layer or parameter shape (from
``Fingerprints.layers``) or the first cluster field (from
``Fingerprints.cluster_spec``). The cost-model version is recorded, not
enforced: stale predictions do not make a plan wrong to execute. With a graph
it also refuses, before any rank starts, what the runtime could not run: expert
parallelism on a layer with ``LayerInfo.ep_refusal``, and Megatron tp (mesh
``tp > 1``, layer ``tp="megatron"``) on a layer with ``LayerInfo.tp_refusal`` or
whose recorded heads, key/value heads, FFN width or vocabulary tp does not
divide (the search's ``tp_divides`` rules: MQA's one key/value head under any tp).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from autoshard import file_io
from autoshard._plan_schema import PlanFieldError, Record, at_least, choice, decode, encode, join_path, transient
from autoshard.errors import PlanError
from autoshard.plan_format import format_plan, plan_to_rich
from autoshard.train import OPTIMIZERS, PRECISIONS

PLAN_VERSION = 1
SUPPORTED_VERSIONS = (1,)
PLAN_FORMAT = "autoshard.plan"

MESH_AXES = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp")
STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
TP_MODES = ("none", "megatron")
RECOMPUTE = ("none", "selective", "full")
WEIGHT_COMM = ("bf16", "int8", "fp8")
GRAD_COMM = ("bf16", "fp32", "int8", "int4")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

_NEXT_STEP = "fix the file or regenerate it with `autoshard plan`"

# Compact notation of each strategy field value ("" = default, not shown).
_STATE_NOTATION = {"replicate": "DDP", "zero1": "Z1", "zero2": "Z2", "zero3": "Z3", "offload": "Off"}
_RECOMPUTE_NOTATION = {"none": "", "selective": "R(sel)", "full": "R(full)"}
_WEIGHT_NOTATION = {"bf16": "", "int8": "qW8", "fp8": "qWf8"}
_GRAD_NOTATION = {"bf16": "", "fp32": "G32", "int8": "qG8", "int4": "qG4"}


@dataclass(frozen=True)
class Mesh(Record):
    """Mesh degrees; their product is the world size. ``ep`` and ``cp`` reuse
    data-parallel ranks (as in Megatron-Core: experts are sharded across the
    dp ranks), so ``world = dp_replicate * dp_shard * tp * pp * cp``, and
    ``ep`` must divide ``dp_replicate * dp_shard``."""

    dp_replicate: int = at_least(1, 1)
    dp_shard: int = at_least(1, 1)
    tp: int = at_least(1, 1)
    pp: int = at_least(1, 1)
    ep: int = at_least(1, 1)
    cp: int = at_least(1, 1)

    def _validate(self) -> None:
        if self.dp % self.ep:
            raise PlanFieldError(
                "ep",
                f"{self.ep} must divide dp_replicate*dp_shard = {self.dp_replicate}*{self.dp_shard} = {self.dp}",
            )

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def __str__(self) -> str:
        axes = " ".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)
        return f"{axes} (world {self.world_size})"


@dataclass(frozen=True)
class LayerStrategy(Record):
    """Per-layer decision (DESIGN.md, "Strategy space"); ``str`` is the compact notation."""

    layer: str
    state: str = choice("replicate", STATES)
    tp: str = choice("none", TP_MODES)
    sp: bool = False
    ep: bool = False
    recompute: str = choice("none", RECOMPUTE)
    weight_comm: str = choice("bf16", WEIGHT_COMM)
    grad_comm: str = choice("bf16", GRAD_COMM)
    stage: int = at_least(0, 0)

    @property
    def notation(self) -> str:
        """Compact form, e.g. ``Z3·TP·SP·R(sel)·qW8`` (module docstring has the table)."""
        parts = [
            _STATE_NOTATION[self.state],
            "TP" if self.tp == "megatron" else "",
            "SP" if self.sp else "",
            "EP" if self.ep else "",
            _RECOMPUTE_NOTATION[self.recompute],
            _WEIGHT_NOTATION[self.weight_comm],
            _GRAD_NOTATION[self.grad_comm],
        ]
        return "·".join(p for p in parts if p)

    def decision(self) -> tuple:
        """Every field but the layer name: equal decisions print as one folded row."""
        return (self.state, self.tp, self.sp, self.ep, self.recompute, self.weight_comm, self.grad_comm, self.stage)

    def __str__(self) -> str:
        return self.notation


def zero12_gathered_in_forward(strategy: LayerStrategy, mesh: Mesh, num_micro_batches: int, compiled: bool) -> bool:
    """Whether a ZeRO-1/2 layer runs as a gather in the compiled forward graph, kept for backward.

    The rule behind the gathered-in-forward form of ``autoshard/data_parallel.py``, which the
    runtime (how the layer is held and synced) and the cost model (where its gather runs) both
    read. A compiled program with one
    micro-batch on one stage holds such a layer as ZeRO-3's dim-0 shard over dp_shard when that
    is the whole dp group (dp_replicate = 1), the wires are unquantized and the layer is not
    expert-parallel ([Note: compiled ZeRO-1/2] in ``passes/context.py``).
    """
    return (compiled and strategy.state in ("zero1", "zero2") and num_micro_batches == 1 and mesh.pp == 1
            and mesh.dp_replicate == 1 and mesh.dp_shard > 1 and strategy.grad_comm == "bf16"
            and strategy.weight_comm == "bf16" and not strategy.ep)


@dataclass(frozen=True)
class Schedule(Record):
    """Global pipeline / batching decisions. ``str``: ``1f1b m=4 mb=2`` (+ ``v=2`` when interleaved)."""

    name: str = choice("1f1b", SCHEDULES)
    micro_batch: int = at_least(1, 1)
    num_micro_batches: int = at_least(1, 1)
    virtual_stages: int = at_least(1, 1)
    prefetch: int = at_least(1, 0)
    bucket_bytes: int = at_least(25 * 2**20, 0)

    def _validate(self) -> None:
        if self.virtual_stages > 1 and self.name != "interleaved_1f1b":
            raise PlanFieldError(
                "virtual_stages",
                f"{self.virtual_stages} > 1 needs name='interleaved_1f1b', got {self.name!r}",
            )

    def admits(self, num_micro_batches: int, pp: int) -> bool:
        """Whether this schedule runs ``num_micro_batches`` micro-batches over ``pp`` pipeline ranks: 1F1B needs
        ``m >= pp`` (torch.distributed.pipelining's requirement), interleaved 1F1B ``m % pp == 0`` (Megatron's,
        stricter than torch's), GPipe any ``m``. The search offers only admitted counts and the runtime (PPO's
        mini-batches) keeps to them."""
        if pp <= 1 or self.name == "gpipe":
            return num_micro_batches >= 1
        if self.name == "1f1b":
            return num_micro_batches >= pp
        return num_micro_batches % pp == 0

    def __str__(self) -> str:
        text = f"{self.name} m={self.num_micro_batches} mb={self.micro_batch}"
        return text + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")


@dataclass(frozen=True)
class Predictions(Record):
    """What the cost model expects of this plan, per rank, in seconds and bytes."""

    # added after the first plan files were written (benchmarks/results keeps one without them)
    OPTIONAL_ON_LOAD: ClassVar[frozenset[str]] = frozenset({"build_peak_bytes", "caveats"})

    step_time_s: float = at_least(0.0, 0)
    compute_s: float = at_least(0.0, 0)
    exposed_comm_s: float = at_least(0.0, 0)
    bubble_s: float = at_least(0.0, 0)
    optimizer_s: float = at_least(0.0, 0)
    peak_memory_bytes: int = at_least(0, 0)  # max over ranks of max(step peak, build peak)
    memory_by_stage: tuple[int, ...] = ()
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    tokens_per_s: float = at_least(0.0, 0)
    mfu: float = at_least(0.0, 0)
    build_peak_bytes: int = at_least(0, 0)  # max over ranks of the build (materialization) peak; 0: not recorded
    caveats: tuple[str, ...] = ()  # what the cost model could not price with confidence (cost_model.pricing_caveats)

    def _validate(self) -> None:
        for name, values in (("memory_by_stage", enumerate(self.memory_by_stage)),
                             ("memory_breakdown", self.memory_breakdown.items())):
            for key, value in values:
                if value < 0:
                    where = f"[{key}]" if isinstance(key, int) else f".{key}"
                    raise PlanFieldError(f"{name}{where}", f"{value} bytes: must be >= 0")


@dataclass(frozen=True)
class SolverStats(Record):
    """How the search ended: CP-SAT status, objective, bound, gap; and its wall time, ``wall_s``, which is
    in memory only ("Reproducible files" in the module docstring): 0.0 on a plan read from a file."""

    status: str = "NONE"
    objective: float = 0.0
    bound: float = 0.0
    gap: float = 0.0
    wall_s: float = transient(0.0, 0)
    meshes_considered: int = at_least(0, 0)
    meshes_solved: int = at_least(0, 0)


@dataclass(frozen=True)
class ParamSignature(Record):
    """One parameter as the model fingerprint saw it."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclass(frozen=True)
class LayerSignature(Record):
    """One layer as the model fingerprint saw it: enough to say what differs."""

    name: str
    kind: str = ""
    params: tuple[ParamSignature, ...] = ()


@dataclass(frozen=True)
class Fingerprints(Record):
    """Hashes of the model graph, cluster and cost-model version, plus the
    summaries behind them (``layers``, ``cluster_spec``) so a mismatch can be
    explained. Empty means "not recorded" (a hand-written plan): not checked.

    ``cluster_context``: the rest of the cluster's ``to_dict`` (its names, which
    ``Cluster.runs_on_cpu`` reads, and its calibration record), neither hashed nor
    checked; ``plan_reuse.cluster_of`` rebuilds the searched cluster from both.
    Plans written before it lack it (``OPTIONAL_ON_LOAD``)."""

    OPTIONAL_ON_LOAD: ClassVar[frozenset[str]] = frozenset({"cluster_context"})

    model: str = ""
    cluster: str = ""
    cost_model: str = ""
    layers: tuple[LayerSignature, ...] = ()
    cluster_spec: dict[str, Any] = field(default_factory=dict)
    cluster_context: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Any = None, cluster: Any = None, cost_model: str = "") -> Fingerprints:
        """Fingerprints of a ``ModelGraph`` and a ``Cluster`` (either may be ``None``)."""
        return cls(
            model=graph.fingerprint() if graph is not None else "",
            cluster=cluster_fingerprint(cluster) if cluster is not None else "",
            cost_model=cost_model,
            layers=layer_signatures(graph) if graph is not None else (),
            cluster_spec=cluster_dict(cluster) if cluster is not None else {},
            cluster_context=cluster_context(cluster) if cluster is not None else {},
        )


def layer_signatures(graph: Any) -> tuple[LayerSignature, ...]:
    """Layer names, kinds and parameter shapes of a ``ModelGraph``."""
    return tuple(
        LayerSignature(
            name=layer.name,
            kind=layer.kind,
            params=tuple(ParamSignature(p.name, tuple(p.global_shape), p.dtype) for p in layer.params),
        )
        for layer in graph.layers
    )


def cluster_dict(cluster: Any) -> dict[str, Any]:
    """What the cluster fingerprint covers, as JSON data: ``cluster.planning_dict()``
    (fields that change plans), else ``to_dict()``, else the dataclass fields."""
    for method in ("planning_dict", "to_dict"):
        if hasattr(cluster, method):
            raw = getattr(cluster, method)()
            break
    else:
        raw = encode(cluster)
    return json.loads(json.dumps(raw, sort_keys=True, allow_nan=False))


def cluster_context(cluster: Any) -> dict[str, Any]:
    """What ``cluster.to_dict()`` holds beyond ``cluster_dict``: names and the calibration record
    (``Fingerprints.cluster_context``); empty for a cluster without both methods."""
    if not (hasattr(cluster, "to_dict") and hasattr(cluster, "planning_dict")):
        return {}
    return json.loads(json.dumps(_beyond(cluster.to_dict(), cluster.planning_dict()), sort_keys=True,
                                 allow_nan=False))


def _beyond(full: dict[str, Any], planning: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``full`` (recursively) that ``planning`` lacks."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if key not in planning:
            out[key] = value
        elif isinstance(value, dict) and isinstance(planning[key], dict):
            rest = _beyond(value, planning[key])
            if rest:
                out[key] = rest
    return out


def cluster_fingerprint(cluster: Any) -> str:
    """``cluster.fingerprint()``, or a hash of ``cluster_dict`` when absent."""
    if hasattr(cluster, "fingerprint"):
        return cluster.fingerprint()
    blob = json.dumps(cluster_dict(cluster), sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RolloutOption(Record):
    """One rollout layout priced with its training plan (``search/rollout.py``): an RL step's seconds and a
    rank's bytes; ``refusal`` says why it was not chosen when it does not fit."""

    OPTIONAL_ON_LOAD: ClassVar[frozenset[str]] = frozenset({"advantages_s"})  # priced from 2026-11-28 on

    tp: int = at_least(1, 1)
    rl_step_s: float = at_least(0.0, 0)
    generate_s: float = at_least(0.0, 0)
    reshard_s: float = at_least(0.0, 0)
    score_s: float = at_least(0.0, 0)
    train_s: float = at_least(0.0, 0)
    train_step_s: float = at_least(0.0, 0)
    advantages_s: float = at_least(0.0, 0)  # rewards, KL and GAE on the host-bound small tensors (search/rollout.py)
    reshard_bytes: int = at_least(0, 0)  # received per rank per sync
    reshard_plan: str = ""  # the sync's steps per parameter, counted (search/rollout.reshard)
    weights_bytes: int = at_least(0, 0)  # the rollout replica's shard on one rank
    kv_cache_bytes: int = at_least(0, 0)
    peak_bytes: int = at_least(0, 0)  # max(training peak + rollout weights, sampling peak)
    training_mesh: str = ""
    refusal: str = ""


@dataclass(frozen=True)
class RolloutPlan(Record):
    """Where generation runs in an RL step: groups of ``tp`` consecutive ranks, each a Megatron shard of
    degree tp (``runtime/rollout_tp.py``), ``dp`` groups; the workload it was priced for and every
    layout considered (``search/rollout.co_plan``)."""

    tp: int = at_least(1, 1)
    dp: int = at_least(1, 1)
    sequences: int = at_least(1, 1)
    prompt_len: int = at_least(1, 1)
    response_len: int = at_least(1, 1)
    epochs: int = at_least(1, 1)
    mini_batches: int = at_least(1, 1)
    chosen: RolloutOption = field(default_factory=RolloutOption)
    options: tuple[RolloutOption, ...] = ()


@dataclass(frozen=True)
class Plan(Record):
    """A complete, executable sharding plan (module docstring: forms, file format, invariants)."""

    model_name: str
    mesh: Mesh
    layers: tuple[LayerStrategy, ...]
    schedule: Schedule = field(default_factory=Schedule)
    predictions: Predictions = field(default_factory=Predictions)
    solver: SolverStats = field(default_factory=SolverStats)
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    global_batch: int = at_least(1, 1)
    seq_len: int = at_least(1, 1)
    precision: str = choice("bf16", PRECISIONS)
    optimizer: str = choice("adamw", OPTIMIZERS)
    version: int = choice(PLAN_VERSION, SUPPORTED_VERSIONS)
    rollout: tuple[RolloutPlan, ...] = ()  # RL plans: one rollout layout (search/rollout.py); written only when present

    OPTIONAL_ON_LOAD: ClassVar[frozenset[str]] = frozenset({"rollout"})

    def _validate(self) -> None:
        if len(self.rollout) > 1:
            raise PlanFieldError("rollout", f"{len(self.rollout)} rollout layouts; a plan has at most one")
        if self.rollout and self.rollout[0].tp * self.rollout[0].dp != self.mesh.world_size:
            r = self.rollout[0]
            raise PlanFieldError("rollout", f"tp={r.tp} × dp={r.dp} is not the mesh's world size {self.mesh.world_size}")
        seen: dict[str, int] = {}
        previous_stage = 0
        for i, strategy in enumerate(self.layers):
            if strategy.layer in seen:
                raise PlanFieldError(
                    f"layers[{i}].layer", f"{strategy.layer!r} repeats layers[{seen[strategy.layer]}]"
                )
            seen[strategy.layer] = i
            if strategy.stage >= self.num_stages:
                raise PlanFieldError(
                    f"layers[{i}].stage",
                    f"{strategy.stage} must be < mesh.pp*schedule.virtual_stages = "
                    f"{self.mesh.pp}*{self.schedule.virtual_stages}",
                )
            if strategy.stage < previous_stage:
                raise PlanFieldError(
                    f"layers[{i}].stage",
                    f"{strategy.stage} < {previous_stage} of layers[{i - 1}]: stages must be non-decreasing",
                )
            previous_stage = strategy.stage

    # ----------------------------------------------------------------- lookup
    @property
    def num_stages(self) -> int:
        """Pipeline stages, virtual ones included (stage ``s`` runs on pp rank ``s % pp``)."""
        return self.mesh.pp * self.schedule.virtual_stages

    @property
    def compilable(self) -> bool:
        """Whether the runtime's default compiles this plan's per-rank graph on a GPU
        (``runtime.compile_allowed``; the cost model's ``compiled_activation_scale``): ep = cp = 1
        (expert routing and context parallelism are untested compiled). ZeRO-3 layers compile: their
        gathers and re-gathers are graph nodes (``passes/_zero3.py``); with pp > 1 each pipeline stage
        compiles on its own (``runtime/pipeline.py``)."""
        mesh = self.mesh
        return mesh.ep == 1 and mesh.cp == 1

    def strategy(self, layer: str) -> LayerStrategy:
        """The strategy of layer ``layer`` (``KeyError`` if the plan has none)."""
        for s in self.layers:
            if s.layer == layer:
                return s
        raise KeyError(layer)

    # ------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data with ``format`` and ``version`` keys (``rollout`` only when the plan has one)."""
        data = {"format": PLAN_FORMAT, **encode(self)}
        if not self.rollout:
            del data["rollout"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Inverse of ``to_dict``; raises ``PlanError`` naming the JSON path of a bad field."""
        if not isinstance(data, dict):
            raise PlanFieldError("", f"a plan is a JSON object, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanFieldError("format", f"{data.get('format')!r} is not {PLAN_FORMAT!r}: not an autoshard plan")
        version = data.get("version")
        if type(version) is not int or version not in SUPPORTED_VERSIONS:
            raise PlanFieldError(
                "version",
                f"plan version {version!r} is not supported; this autoshard reads versions {SUPPORTED_VERSIONS}"
                " (upgrade autoshard or regenerate the plan)",
            )
        plan = decode(cls, {k: v for k, v in data.items() if k != "format"})
        mesh = plan.mesh
        if mesh.world_size > file_io.MAX_WORLD_SIZE:  # ep reuses dp ranks: not a factor
            terms = "*".join(f"{axis}={getattr(mesh, axis)}" for axis in MESH_AXES if axis != "ep")
            raise PlanFieldError("mesh", f"world size {terms} is over {file_io.MAX_WORLD_SIZE} (2**20) ranks")
        return plan

    def to_json(self) -> str:
        """Canonical JSON text: sorted keys, 2-space indent, trailing newline."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "<string>") -> Plan:
        """Parse JSON text strictly (``file_io.parse_json_strict``); every error is a ``PlanError``
        that names ``source``."""
        data = file_io.parse_json_strict(text, source=source, kind=file_io.PLAN_FILE)
        try:
            return cls.from_dict(data)
        except PlanError as err:
            raise PlanError(f"{source}: {err}; {_NEXT_STEP}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan atomically (``file_io.atomic_write``: temporary file + ``os.replace``);
        returns the path. A path that is not a regular file or nothing, or whose directory is
        missing or unwritable, is a ``PlanError``."""
        return file_io.atomic_write(path, self.to_json(), noun="plan file", error=PlanError)

    @classmethod
    def load(cls, path: str | os.PathLike, *, graph: Any = None, cluster: Any = None) -> Plan:
        """Read and validate a plan file; with ``graph``/``cluster``, also ``check_compatible``."""
        path = Path(path)
        plan = cls.from_json(file_io.read_bounded_text(path, file_io.PLAN_FILE), source=str(path))
        if graph is not None or cluster is not None:
            try:
                plan.check_compatible(graph=graph, cluster=cluster)
            except PlanError as err:
                raise PlanError(f"{path}: {err}") from None
        return plan

    # ---------------------------------------------------------- compatibility
    def check_compatible(self, *, graph: Any = None, cluster: Any = None) -> None:
        """Refuse (``PlanError``) a plan made for another model or cluster, saying what differs."""
        if graph is not None:
            problem = _model_mismatch(self, graph)
            if problem:
                raise PlanError(
                    f"plan does not match model {getattr(graph, 'model_name', '?')!r}: {problem}; "
                    "search a new plan for this model, or use the model the plan was made for"
                )
            refused = _unrunnable_expert_parallel(self, graph)
            if refused:
                raise PlanError(f"{refused}; plan it with ep = 1 (the search does: rule ep_runs/experts)")
            refused = _unrunnable_tensor_parallel(self, graph)
            if refused:
                raise PlanError(f"{refused}; the tensor-parallel runtime cannot split the layer: use tp='none' for "
                                "it or a mesh with tp = 1")
        if cluster is not None:
            problem = _cluster_mismatch(self, cluster)
            if problem:
                raise PlanError(
                    f"plan does not match cluster {getattr(cluster, 'name', '?')!r}: {problem}; "
                    "search a new plan for this cluster, or use the cluster the plan was made for"
                )

    # ------------------------------------------------------------ human forms
    def __str__(self) -> str:
        return format_plan(self)

    def to_rich(self, *, fold: bool = True) -> Any:
        """A ``rich`` renderable of the plan (header + per-layer table) for the CLI."""
        return plan_to_rich(self, fold=fold)


def _model_mismatch(plan: Plan, graph: Any) -> str | None:
    """What differs between the model the plan was made for and ``graph`` (``None``: nothing)."""
    stored = plan.fingerprints
    if stored.model and stored.model != graph.fingerprint():
        return _signature_difference(stored, layer_signatures(graph)) or (
            f"model fingerprint {stored.model} != {graph.fingerprint()} although layer names and parameter "
            f"shapes match: the model name or dtype differs (plan: {plan.model_name!r}, "
            f"model: {getattr(graph, 'model_name', '?')!r})"
        )
    names = [layer.name for layer in graph.layers]
    for i, (ours, theirs) in enumerate(zip([s.layer for s in plan.layers], names)):
        if ours != theirs:
            return f"layers[{i}] is {ours!r} but the model's layer {i} is {theirs!r}"
    if len(plan.layers) != len(names):
        return f"plan has {len(plan.layers)} layers, model has {len(names)}"
    return None


def _unrunnable_expert_parallel(plan: Plan, graph: Any) -> str | None:
    """A layer the plan puts under expert parallelism whose experts the EP pass cannot exchange
    (``LayerInfo.ep_refusal``, set by capture), or ``None``."""
    if plan.mesh.ep <= 1:
        return None
    strategies = {s.layer: s for s in plan.layers}
    for layer in graph.layers:
        strategy = strategies.get(layer.name)
        if getattr(layer, "ep_refusal", "") and strategy is not None and strategy.ep:
            return f"layer {layer.name!r} cannot run expert-parallel: {layer.ep_refusal}"
    return None


# What Megatron tp splits, per layer kind: (LayerInfo field, kinds, what it counts, rule); the
# ``tp_divides`` rules of ``search/space.py`` over the same fields.
_TP_DIVIDES = (("num_heads", ("attention",), "attention heads", "heads"),
               ("num_kv_heads", ("attention",), "key/value heads", "kv_heads"),
               ("ffn_hidden", ("mlp",), "FFN width", "ffn"), ("vocab", ("embedding", "head"), "vocabulary", "vocab"))
_TP_SPLIT_ROLES = ("column", "row", "vocab")


def _unrunnable_tensor_parallel(plan: Plan, graph: Any) -> str | None:
    """The first layer the plan splits over tp (``tp="megatron"``, mesh ``tp > 1``, a column / row / vocab
    parameter or the LM head) that the runtime cannot split, and why; or ``None``."""
    tp = plan.mesh.tp
    if tp <= 1:
        return None
    strategies = {s.layer: s for s in plan.layers}
    for layer in graph.layers:
        strategy = strategies.get(layer.name)
        split = layer.kind == "head" or any(p.tp_role in _TP_SPLIT_ROLES for p in layer.params)
        if strategy is None or strategy.tp != "megatron" or not split:
            continue
        for field_name, kinds, what, rule in _TP_DIVIDES:
            size = getattr(layer, field_name, None)
            if layer.kind in kinds and size and size % tp:
                heads = (f" (num_heads={layer.num_heads}, num_kv_heads={layer.num_kv_heads})"
                         if layer.kind == "attention" else "")
                return (f"layer {layer.name!r}: {what} of size {size} split over tp={tp}: tp does not divide it"
                        f"{heads}, and the search never proposes that (rule tp_divides/{rule})")
        if getattr(layer, "tp_refusal", ""):
            return f"layer {layer.name!r}: {layer.tp_refusal}"
    return None


def _signature_difference(stored: Fingerprints, current: tuple[LayerSignature, ...]) -> str | None:
    """The first layer or parameter where two model summaries differ."""
    for i, (ours, theirs) in enumerate(zip(stored.layers, current)):
        if ours.name != theirs.name:
            return f"layer {i}: plan has {ours.name!r}, model has {theirs.name!r}"
        if ours.kind != theirs.kind:
            return f"layer {ours.name!r}: plan has kind {ours.kind!r}, model has {theirs.kind!r}"
        for p, q in zip(ours.params, theirs.params):
            if (p.name, p.shape, p.dtype) != (q.name, q.shape, q.dtype):
                return (
                    f"layer {ours.name!r}: plan has parameter {p.name!r} {list(p.shape)} {p.dtype}, "
                    f"model has {q.name!r} {list(q.shape)} {q.dtype}"
                )
        if len(ours.params) != len(theirs.params):
            return f"layer {ours.name!r}: plan has {len(ours.params)} parameters, model has {len(theirs.params)}"
    if len(stored.layers) != len(current):
        return f"plan has {len(stored.layers)} layers, model has {len(current)}"
    return None


def _cluster_mismatch(plan: Plan, cluster: Any) -> str | None:
    """What differs between the cluster the plan was made for and ``cluster`` (``None``: nothing)."""
    stored = plan.fingerprints
    if stored.cluster and stored.cluster != cluster_fingerprint(cluster):
        return _first_difference(stored.cluster_spec, cluster_dict(cluster), "") or (
            f"cluster fingerprint {stored.cluster} != {cluster_fingerprint(cluster)}"
        )
    if plan.mesh.world_size != cluster.world_size:
        return (
            f"mesh world size {plan.mesh.world_size} ({plan.mesh}) != cluster world size {cluster.world_size}"
        )
    return None


def _first_difference(ours: Any, theirs: Any, path: str) -> str | None:
    """The first JSON path where two cluster dicts differ, as a sentence (``None``: equal).

    ``ours`` empty means the plan did not record the cluster: nothing to compare.
    """
    if path == "" and not ours:
        return None
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours or key not in theirs:
                side = "the plan" if key in ours else "the cluster"
                return f"cluster field {join_path(path, key)!r} is only in {side}"
            found = _first_difference(ours[key], theirs[key], join_path(path, key))
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            found = _first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if ours != theirs:
        return f"cluster field {path!r}: plan has {ours!r}, cluster has {theirs!r}"
    return None


__all__ = [
    "zero12_gathered_in_forward",
    "GRAD_COMM",
    "MESH_AXES",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "RECOMPUTE",
    "SCHEDULES",
    "STATES",
    "SUPPORTED_VERSIONS",
    "TP_MODES",
    "WEIGHT_COMM",
    "Fingerprints",
    "LayerSignature",
    "LayerStrategy",
    "Mesh",
    "ParamSignature",
    "Plan",
    "PlanFieldError",
    "Predictions",
    "RolloutOption",
    "RolloutPlan",
    "Schedule",
    "SolverStats",
    "cluster_context",
    "cluster_dict",
    "cluster_fingerprint",
    "layer_signatures",
]
