"""autoshard: a compiled-graph parallelism engine for PyTorch."""

from autoshard import _shadow

_shadow.install()  # before anything imports transformers (autoshard/_shadow.py)

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
from autoshard.train import SGD, AdamW, LRSchedule, TrainSpec

__version__ = "0.1.0"


def __getattr__(name: str):
    """``compile`` and ``Compiled`` load on first use: ``autoshard.api`` imports torch."""
    if name in ("compile", "Compiled"):
        from autoshard import api

        return getattr(api, name)
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")

__all__ = [
    "AdamW",
    "AutoshardError",
    "CaptureError",
    "Cluster",
    "Compiled",
    "ClusterError",
    "InfeasibleError",
    "LRSchedule",
    "ModelError",
    "Plan",
    "PlanError",
    "SGD",
    "TrainSpec",
    "compile",
]
