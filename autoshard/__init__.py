"""autoshard: a compiled-graph parallelism engine for PyTorch."""

from autoshard.errors import (
    AutoshardError,
    CaptureError,
    ClusterError,
    InfeasibleError,
    ModelError,
    PlanError,
)
from autoshard.cluster import Cluster
from autoshard.plan import Plan
from autoshard.train import TrainSpec

__version__ = "0.1.0"

__all__ = [
    "AutoshardError",
    "CaptureError",
    "Cluster",
    "ClusterError",
    "InfeasibleError",
    "ModelError",
    "Plan",
    "PlanError",
    "TrainSpec",
]
