"""Reusing a plan: the training step and the cluster it was made for.

A plan file records everything the search decided from, except the model
itself: the ``TrainSpec`` fields (``global_batch``, ``seq_len``, ``optimizer``,
``precision``; the micro-batch is ``schedule.micro_batch``) and, in
``fingerprints.cluster_spec``, the planning fields of the cluster
(``Cluster.planning_dict``: names and calibration records left out, as they
never change a plan). From them:

* ``train_of(plan)`` rebuilds the ``TrainSpec`` (micro-batch fixed to the plan's);
* ``check_train(plan, train)`` refuses a plan reused for another training step;
* ``cluster_of(plan)`` rebuilds an equivalent ``Cluster`` whose fingerprint
  equals the recorded one (names are placeholders: they are not fingerprinted).

``autoshard.compile(..., plan=...)`` and the ``plan --plan`` / ``explain`` CLI
commands use them; the model is re-captured by the caller.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from autoshard.errors import PlanError
from autoshard.train import TrainSpec

if TYPE_CHECKING:
    from autoshard.cluster import Cluster
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
    """The cluster ``plan`` was made for, rebuilt from ``fingerprints.cluster_spec``.

    Raises ``PlanError`` when the plan did not record one (a hand-written plan).
    """
    from autoshard.cluster import Cluster

    spec = copy.deepcopy(dict(plan.fingerprints.cluster_spec))
    if not spec:
        raise PlanError(
            f"plan for {plan.model_name!r} records no cluster (fingerprints.cluster_spec is empty); "
            "pass the cluster explicitly (--cluster PRESET:NODESxDEVICES or a cluster file)"
        )
    spec["name"] = RECORDED_CLUSTER_NAME
    for key in ("device", "intra_node", "inter_node"):
        if isinstance(spec.get(key), dict):
            spec[key].setdefault("name", RECORDED_CLUSTER_NAME)
    try:
        return Cluster.from_dict(spec)
    except ValueError as err:
        raise PlanError(f"plan's recorded cluster cannot be rebuilt: {err}; pass the cluster explicitly") from None


__all__ = ["RECORDED_CLUSTER_NAME", "check_train", "cluster_of", "train_of"]
