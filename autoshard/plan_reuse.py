"""Reusing a plan: the training step and the cluster it was made for.

A plan file records everything the search decided from, except the model
itself: the ``TrainSpec`` fields (``global_batch``, ``seq_len``, ``optimizer``,
``precision``; the micro-batch is ``schedule.micro_batch``) and the cluster in
two parts: ``fingerprints.cluster_spec``, the fields the cluster fingerprint
covers (``Cluster.planning_dict``: device and link figures, calibrated ones
included), and ``fingerprints.cluster_context``, the rest of ``Cluster.to_dict``
(the names and the calibration record, not fingerprinted). From them:

* ``train_of(plan)`` rebuilds the ``TrainSpec`` (micro-batch fixed to the plan's);
* ``check_train(plan, train)`` refuses a plan reused for another training step;
* ``cluster_of(plan)`` rebuilds the cluster the plan was searched on: both parts
  merged, so its fingerprint equals the recorded one, a ``cpu:1xN`` plan stays a
  CPU cluster (``Cluster.runs_on_cpu``: no compiled-activation pricing; an older
  plan without the recorded names is still one, by its CPU device) and a calibrated plan keeps its calibration record, whose cost-model
  constants (kernel overhead, GEMM knee, optimizer rates, layer times) are in no
  fingerprinted field. ``explain`` and ``report`` thus price a plan as it was
  searched without ``--cluster`` or ``--calibration`` (a decision: the plan
  carries its calibration rather than a warning asking for the file again);
* ``cluster_for(plan, cluster, calibration)`` is the cluster ``explain`` and
  ``report`` price on: ``--cluster`` or the recorded one, ``--calibration`` applied;
* ``calibration_warning(plan, cluster)`` is the one line ``explain`` and
  ``report`` print when a cluster given with ``--cluster`` lacks the calibration
  the plan was searched with (the chosen cluster is priced as given).

A plan written before ``cluster_context`` was recorded rebuilds with placeholder
names (``RECORDED_CLUSTER_NAME``) and no calibration record, as before: it is
priced as a GPU cluster, and as uncalibrated; pass ``--cluster cpu:1xN`` (and
``--calibration FILE``) for such a plan.

``autoshard.compile(..., plan=...)`` and the ``plan --plan`` / ``explain`` /
``report`` CLI commands use them; the model is re-captured by the caller.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from autoshard import cluster_io
from autoshard.cluster import Cluster
from autoshard.errors import PlanError
from autoshard.train import TrainSpec

if TYPE_CHECKING:
    from autoshard.plan import Plan

RECORDED_CLUSTER_NAME = "recorded-in-plan"

# TrainSpec field → (plan attribute getter, CLI flag that sets it).
_TRAIN_FIELDS = (
    ("global_batch", lambda p: p.global_batch, "--batch"),
    ("seq_len", lambda p: p.seq_len, "--seq"),
    ("optimizer", lambda p: p.optimizer, "--optimizer"),
    ("precision", lambda p: p.precision, "--precision"),
)


def train_of(plan: Plan) -> TrainSpec:
    """The ``TrainSpec`` ``plan`` was made for, with its micro-batch fixed."""
    return TrainSpec(
        global_batch=plan.global_batch,
        seq_len=plan.seq_len,
        micro_batch=plan.schedule.micro_batch,
        optimizer=plan.optimizer,
        precision=plan.precision,
    )


def check_train(plan: Plan, train: TrainSpec, *, source: str = "plan") -> None:
    """Raise ``PlanError`` when ``train`` asks for another step than ``plan`` was made for.

    ``train.micro_batch=None`` (let the search choose) accepts the plan's.
    """
    for name, stored, flag in _TRAIN_FIELDS:
        if getattr(train, name) != stored(plan):
            raise PlanError(
                f"{source} was made for {name}={stored(plan)!r} ({flag}), but the request has "
                f"{getattr(train, name)!r}; use the plan's value or search a new plan"
            )
    if train.micro_batch is not None and train.micro_batch != plan.schedule.micro_batch:
        raise PlanError(
            f"{source} was made for micro_batch={plan.schedule.micro_batch} (--micro-batch), but the request "
            f"has {train.micro_batch}; use the plan's value, leave it unset, or search a new plan"
        )


def cluster_of(plan: Plan) -> Cluster:
    """The cluster ``plan`` was made for, rebuilt from ``fingerprints.cluster_spec`` and
    ``fingerprints.cluster_context`` (module docstring; placeholder names when the context is absent).

    Raises ``PlanError`` when the plan did not record one (a hand-written plan).
    """
    spec = copy.deepcopy(dict(plan.fingerprints.cluster_spec))
    if not spec:
        raise PlanError(
            f"plan for {plan.model_name!r} records no cluster (fingerprints.cluster_spec is empty); "
            "pass the cluster explicitly (--cluster PRESET:NODESxDEVICES or a cluster file)"
        )
    spec = cluster_io.deep_merge(spec, copy.deepcopy(dict(plan.fingerprints.cluster_context)))
    spec.setdefault("name", RECORDED_CLUSTER_NAME)
    for key in ("device", "intra_node", "inter_node"):
        if isinstance(spec.get(key), dict):
            spec[key].setdefault("name", RECORDED_CLUSTER_NAME)
    try:
        return Cluster.from_dict(spec)
    except ValueError as err:
        raise PlanError(f"plan's recorded cluster cannot be rebuilt: {err}; pass the cluster explicitly") from None


def cluster_for(plan: Plan, cluster: str | None = None, calibration: str | Path | None = None) -> Cluster:
    """The cluster ``explain`` and ``report`` price ``plan`` on: ``cluster`` (a preset string or cluster file,
    ``--cluster``) or else the plan's own (``cluster_of``), with the ``calibration`` file applied when given."""
    chosen = Cluster.load(cluster) if cluster else cluster_of(plan)
    return chosen if calibration is None else chosen.with_calibration(calibration)


def calibration_warning(plan: Plan, cluster: Cluster) -> str | None:
    """``warning: plan was searched with calibration measured on DEVICE DATE; ...`` when the plan records a
    calibrated cluster and ``cluster`` has no calibration record (module docstring), else ``None``."""
    recorded = plan.fingerprints.cluster_context.get("calibration") or {}
    if not recorded or cluster.calibration:
        return None
    where = " ".join(str(recorded[k]) for k in ("device", "date") if k in recorded) or "an unrecorded machine"
    return (f"warning: plan was searched with calibration measured on {where}; pass --calibration FILE to price "
            "it as searched")


__all__ = ["RECORDED_CLUSTER_NAME", "calibration_warning", "check_train", "cluster_for", "cluster_of", "train_of"]
