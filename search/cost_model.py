"""Topology cost model (CONTRACT STUB — being implemented; signatures are fixed).

Formulas and units are written out here once implemented. The solver
(``search/solver.py``) calls only the functions below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.cluster import Cluster
from autoshard.graph import LayerInfo, ModelGraph
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule
from autoshard.train import TrainSpec

COST_MODEL_VERSION = "1"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds for one layer (or a whole stage when summed)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # for ONE micro-batch in flight
    buffers: float = 0.0  # collective / gather buffers

    @property
    def total_static(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer under one strategy, per micro-batch unless stated."""

    fwd_s: float  # forward compute time (incl. TP/SP/EP comm on the critical path)
    bwd_s: float  # backward compute (incl. recompute) time
    comm_exposed_s: float  # per optimizer step: data-parallel comm not hidden by overlap
    comm_total_s: float  # per optimizer step: all data-parallel comm, hidden or not
    optimizer_s: float  # per optimizer step: optimizer update time (incl. offload)
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    detail: dict[str, float] = field(default_factory=dict)  # named terms, for `explain`


def layer_cost(
    layer: LayerInfo,
    strategy: LayerStrategy,
    mesh: Mesh,
    cluster: Cluster,
    train: TrainSpec,
    schedule: Schedule,
) -> LayerCost:
    """Cost of ``layer`` under ``strategy`` on ``mesh``."""
    raise NotImplementedError


def predict(graph: ModelGraph, plan: Plan, cluster: Cluster, train: TrainSpec) -> Predictions:
    """Whole-plan prediction: stage times, pipeline bubble, exposed comm, peak memory per rank."""
    raise NotImplementedError
