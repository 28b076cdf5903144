"""``Plan``: the decision record search writes and the runtime executes.

A plan is data: frozen dataclasses, no live objects, saved as versioned JSON
(never pickle). It holds the mesh degrees, one ``LayerStrategy`` per layer,
the pipeline schedule, the predictions of the cost model, solver statistics and
fingerprints of the model graph, cluster and cost-model version, so a plan
loaded for another model or cluster is refused with what differs.

PLACEHOLDER: JSON I/O, validation and the human table are completed in this
module by the Foundation issue; the field layout below is the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLAN_VERSION = 1

MESH_AXES = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp")
STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
TP_MODES = ("none", "megatron")
RECOMPUTE = ("none", "selective", "full")
WEIGHT_COMM = ("bf16", "int8", "fp8")
GRAD_COMM = ("bf16", "fp32", "int8", "int4")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Mesh:
    """Mesh degrees; their product is the world size. ``ep`` and ``cp`` reuse
    data-parallel ranks (as in Megatron-Core: experts are sharded across the
    dp ranks), so ``world = dp_replicate * dp_shard * tp * pp * cp``, and
    ``ep`` must divide ``dp_replicate * dp_shard``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class LayerStrategy:
    """Per-layer decision (DESIGN.md, "Strategy space")."""

    layer: str
    state: str = "replicate"
    tp: str = "none"
    sp: bool = False
    ep: bool = False
    recompute: str = "none"
    weight_comm: str = "bf16"
    grad_comm: str = "bf16"
    stage: int = 0


@dataclass(frozen=True)
class Schedule:
    """Global pipeline / batching decisions."""

    name: str = "1f1b"
    micro_batch: int = 1
    num_micro_batches: int = 1
    virtual_stages: int = 1
    prefetch: int = 1
    bucket_bytes: int = 25 * 2**20


@dataclass(frozen=True)
class Predictions:
    """What the cost model expects of this plan, per rank, in seconds and bytes."""

    step_time_s: float = 0.0
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    peak_memory_bytes: int = 0
    memory_by_stage: tuple[int, ...] = ()
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0


@dataclass(frozen=True)
class SolverStats:
    """How the search ended: CP-SAT status, objective, bound, gap, wall time."""

    status: str = "NONE"
    objective: float = 0.0
    bound: float = 0.0
    gap: float = 0.0
    wall_s: float = 0.0
    meshes_considered: int = 0
    meshes_solved: int = 0


@dataclass(frozen=True)
class Fingerprints:
    model: str = ""
    cluster: str = ""
    cost_model: str = ""


@dataclass(frozen=True)
class Plan:
    """A complete, executable sharding plan."""

    model_name: str
    mesh: Mesh
    layers: tuple[LayerStrategy, ...]
    schedule: Schedule = field(default_factory=Schedule)
    predictions: Predictions = field(default_factory=Predictions)
    solver: SolverStats = field(default_factory=SolverStats)
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    global_batch: int = 1
    seq_len: int = 1
    precision: str = "bf16"
    optimizer: str = "adamw"
    version: int = PLAN_VERSION

    def strategy(self, layer: str) -> LayerStrategy:
        for s in self.layers:
            if s.layer == layer:
                return s
        raise KeyError(layer)
