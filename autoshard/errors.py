"""Errors a user can cause, one class per front door.

Every message names the bad value, the allowed set and the next step. The CLI
prints ``str(err)`` on one line and exits 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations


class AutoshardError(ValueError):
    """Base class of every user-facing autoshard error."""


class ClusterError(AutoshardError):
    """A cluster description (preset, file, string) is malformed or inconsistent."""


class CaptureError(AutoshardError):
    """A model could not be captured by ``torch.export`` or named model lookup failed."""


class PlanError(AutoshardError):
    """A plan file is invalid, or does not belong to the model/cluster at hand."""


class InfeasibleError(AutoshardError):
    """No plan fits the request; the message names the binding constraint family."""


class ModelError(CaptureError):
    """An unknown reference model or size, or an invalid model configuration."""


__all__ = [
    "AutoshardError",
    "ClusterError",
    "CaptureError",
    "PlanError",
    "InfeasibleError",
    "ModelError",
]
