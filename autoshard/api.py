"""``autoshard.compile``: the Python front door.

What happens, in order:

1. **capture** — ``torch.export`` (non-strict, dynamic batch and sequence dims)
   turns ``model`` into a ``ModelGraph``: layers with parameters, FLOPs, bytes
   and measured saved activations (``autoshard.passes.capture``).
2. **search** — unless a plan is given, the CP-SAT planner
   (``autoshard.search.solve``) picks the mesh, a strategy per layer class,
   stage boundaries and the micro-batching that minimise the predicted step
   time within every rank's memory. A given plan (object or JSON path) skips
   the search after its fingerprints are checked against the captured model
   and the cluster.
3. **per-rank build** — under an initialised process group every rank builds
   its own program from the plan (graph passes, then the runtime). Without a
   process group, ``compile`` stops after step 2 ("plan mode").

The search is deterministic (fixed seed and worker count), so under torchrun
every rank computes the same plan without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.graph import ModelGraph
from autoshard.plan import Plan
from autoshard.train import TrainSpec


@dataclass(frozen=True)
class Compiled:
    """Result of :func:`compile`: the plan, and what it was made from.

    ``program`` is the per-rank executable (module + optimizer) when a process
    group is initialised and the runtime supports the plan; ``None`` in plan mode.
    """

    plan: Plan
    graph: ModelGraph
    cluster: Cluster
    train: TrainSpec
    program: Any = None

    def __str__(self) -> str:
        return str(self.plan)


def _resolve_cluster(cluster: Cluster | str) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.load(cluster)
    raise AutoshardError(
        f"cluster={cluster!r}: expected an autoshard.Cluster or a string like 'h100-sxm:2x8' or a file path"
    )


def _default_train(example_inputs: tuple) -> TrainSpec:
    tokens = example_inputs[0]
    batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
    return TrainSpec(global_batch=batch, seq_len=seq)


def compile(  # noqa: A001 - mirrors torch.compile's name on purpose
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: tuple | None = None,
    train: TrainSpec | None = None,
    plan: Plan | str | Path | None = None,
    constraints: Any = None,
    time_limit_s: float = 30.0,
    name: str | None = None,
) -> Compiled:
    """Capture ``model``, search (or load) a plan for ``cluster``, and build it.

    Args:
        model: the policy (``forward(tokens) -> (logits, values)``); may live
            on the meta device for planning.
        cluster: an ``autoshard.Cluster`` or a spec string / file path.
        example_inputs: a tuple whose first element is a ``[batch, seq]``
            token tensor; defaults to ``(2, 16)`` random tokens.
        train: batch, sequence length, optimizer and precision of one step;
            defaults to the example inputs' batch and sequence.
        plan: a ``Plan`` or the path of a plan JSON to reuse (fingerprints are
            checked; the search is skipped).
        constraints: ``autoshard.search.Constraints`` (pins, forced mesh
            degrees, a memory cap).
        time_limit_s: CP-SAT time limit per mesh.
        name: model name recorded in the plan (defaults to the class name).
    """
    from autoshard.passes.capture import capture

    resolved = _resolve_cluster(cluster)
    if example_inputs is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        example_inputs = (torch.randint(0, vocab, (2, 16), device=device),)
    train = train or _default_train(example_inputs)
    graph = capture(model, example_inputs, name=name)
    chosen = _plan_for(graph, resolved, train, plan, constraints, time_limit_s)
    program = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from autoshard.runtime import build_program  # lands with the runtime

        program = build_program(model, graph, chosen, resolved, train)
    return Compiled(plan=chosen, graph=graph, cluster=resolved, train=train, program=program)


def _plan_for(graph, cluster, train, plan, constraints, time_limit_s) -> Plan:
    if plan is not None:
        loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
        loaded.check_compatible(graph=graph, cluster=cluster)
        return loaded
    from autoshard.search import solve

    return solve(graph, cluster, train, constraints=constraints, time_limit_s=time_limit_s)
