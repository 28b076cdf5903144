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

Reusing a plan: its fingerprints must match the captured model and the
cluster (``Plan.check_compatible``), and its training step the ``train``
argument (``plan_reuse.check_train``); without ``train`` the plan's own step
is used (``plan_reuse.train_of``), not the example inputs' shape. Any
mismatch raises ``PlanError`` naming what differs.

Under a process group, ``program`` is ``autoshard.runtime.build_program(model,
graph, plan, cluster, train, device=..., weights=..., inputs=...)`` (``inputs``: the example's tensor
inputs, ``bind_example``) on this rank's GPU when the group's
backend is NCCL (``cuda:<current device>``, which torchrun scripts set from
``LOCAL_RANK``), else on the CPU (gloo); an installation without that runtime stage logs
a warning and returns the plan with ``program=None``. Each rank allocates only
its own shards (``runtime/materialize.py``): a model on the meta device is
initialised shard by shard, or read from ``weights``; a model whose parameters
hold data is read and then released (its parameters move to the meta device:
keeping them would hold a whole model per rank beside the shards).

The search is deterministic (fixed seed and worker count), so under torchrun
every rank computes the same plan without communication.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError, CaptureError, PlanError
from autoshard.graph import ModelGraph
from autoshard.plan import Plan
from autoshard.plan_reuse import check_train, train_of
from autoshard.train import TrainSpec

if TYPE_CHECKING:
    from autoshard.search import Constraints

log = logging.getLogger(__name__)


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
    """``cluster`` as a ``Cluster``, with the calibration file of ``autoshard run --calibration``
    (``AUTOSHARD_CALIBRATION``) applied when the launcher set one (applying a file twice changes nothing)."""
    from autoshard.runtime.launch import CALIBRATION_ENV

    if isinstance(cluster, str):
        cluster = Cluster.load(cluster)
    if not isinstance(cluster, Cluster):
        raise AutoshardError(
            f"cluster={cluster!r}: expected an autoshard.Cluster or a string like 'h100-sxm:2x8' or a file path"
        )
    calibration = os.environ.get(CALIBRATION_ENV)
    return cluster.with_calibration(calibration) if calibration else cluster


def _default_train(example_inputs: tuple) -> TrainSpec:
    tokens = example_inputs[0]  # positional form (bind_example): the tokens first
    batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
    return TrainSpec(global_batch=batch, seq_len=seq)


def compile(  # noqa: A001 - mirrors torch.compile's name on purpose
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: tuple | dict | None = None,
    train: TrainSpec | None = None,
    plan: Plan | str | Path | None = None,
    constraints: Constraints | None = None,
    time_limit_s: float | None = None,
    name: str | None = None,
    weights: Any = None,
) -> Compiled:
    """Capture ``model``, search (or load) a plan for ``cluster``, and build it.

    Args:
        model: the policy (``forward(tokens, ...) -> (logits, values)``); may live
            on the meta device for planning.
        cluster: an ``autoshard.Cluster`` or a spec string / file path; under
            ``autoshard run --calibration FILE`` the file is applied to it.
        example_inputs: the forward's inputs, a tuple (``model(*example_inputs)``)
            or a dict of keywords (``model(**example_inputs)``): tokens ``[B, S]``
            first (forward's first parameter), then any other tensors the
            forward takes — a padding mask, position ids, segment ids — each
            ``[B, ...]`` (or ``[1, ...]``, broadcast over the batch); defaults to
            ``(2, 16)`` random tokens. The program takes exactly these tensors
            (``Program.forward``, ``Program.step``; [Note: model inputs] in
            ``passes/_capture_inputs.py``).
        train: batch, sequence length, optimizer and precision of one step,
            plus what only the runtime reads: the optimizer's hyper-parameters
            (``AdamW(...)`` / ``SGD(...)``), ``lr_schedule`` and ``grad_clip``
            (``autoshard/train.py``); defaults to the plan's step when ``plan``
            is given (default hyper-parameters: a plan records the optimizer's
            name only), else to the example inputs' batch and sequence.
        plan: a ``Plan`` or the path of a plan JSON to reuse (fingerprints and
            training step are checked; the search is skipped).
        constraints: ``autoshard.search.Constraints`` (pins, forced mesh
            degrees, a memory cap); search only.
        time_limit_s: wall-clock budget of the search (default: the solver's and the CLI's,
            ``search.solver.DEFAULT_TIME_LIMIT_S``, 60 s).
        name: model name recorded in the plan (defaults to the class name);
            reusing a plan needs the name it was made with.
        weights: where each rank's shards come from (``runtime/materialize.py``):
            ``None`` = the model's own parameters when they hold data (each is
            released to the meta device once read, so a model handed over on
            the GPU is never held twice), else initialised on shards from the
            meta device (the model's ``init_rule``, seed 0); a path (autoshard
            checkpoint directory, ``.safetensors`` file, Hugging Face
            safetensors directory); or ``Initialize(seed=...)``,
            ``Safetensors(path, name_map=...)``, ``Checkpoint(path)``.

    Raises:
        PlanError: ``plan`` is unreadable or made for another model, cluster
            or training step.
        InfeasibleError: no plan fits the cluster's memory.
        AutoshardError: bad ``cluster``, ``train`` or ``constraints``.
    """
    from autoshard.passes.capture import bind_example, capture

    resolved = _resolve_cluster(cluster)
    given = _load_plan(plan)
    if example_inputs is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        vocab = getattr(getattr(model, "config", None), "vocab_size", 2)
        example_inputs = (torch.randint(0, vocab, (2, 16), device=device),)
    positional, inputs = bind_example(model, example_inputs)
    graph = capture(model, example_inputs, name=name)
    train = train or (train_of(given) if given is not None else _default_train(positional))
    graph = _with_compiled_activations(graph, model, resolved, train)
    if given is not None:
        chosen = _check_reuse(given, plan, graph, resolved, train)
    else:
        chosen = _search(graph, resolved, train, constraints, time_limit_s)
    return Compiled(plan=chosen, graph=graph, cluster=resolved, train=train,
                    program=_build_program(model, graph, chosen, train, weights, inputs))


def _with_compiled_activations(graph: ModelGraph, model: torch.nn.Module, cluster: Cluster,
                               train: TrainSpec) -> ModelGraph:
    """``graph`` with the compiled step's block-activation scale when ``cluster``'s runtime compiles
    (GPUs; ``passes/compiled_saved.py``); a trace that fails leaves it unmeasured, which
    ``predict``'s caveats then say."""
    if cluster.runs_on_cpu:
        return graph
    from autoshard.passes.compiled_saved import with_compiled_saved_scale

    try:
        return with_compiled_saved_scale(graph, model, train.seq_len)
    except CaptureError as err:
        log.warning("autoshard.compile: %s; compiled plans' activations are priced as eager", err)
        return graph


def _load_plan(plan: Plan | str | Path | None) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise PlanError(f"plan={plan!r}: expected an autoshard.Plan or the path of a plan JSON file")


def _check_reuse(given: Plan, source: Any, graph: ModelGraph, cluster: Cluster, train: TrainSpec) -> Plan:
    """``given`` after checking it belongs to ``graph``, ``cluster`` and ``train`` (module docstring)."""
    where = str(source) if isinstance(source, (str, Path)) else "plan"
    try:
        given.check_compatible(graph=graph, cluster=cluster)
    except PlanError as err:
        raise PlanError(f"{where}: {err}") from None
    check_train(given, train, source=where)
    return given


def _search(graph: ModelGraph, cluster: Cluster, train: TrainSpec, constraints: Any,
            time_limit_s: float | None) -> Plan:
    from autoshard.search import solve
    from autoshard.search.solver import DEFAULT_TIME_LIMIT_S

    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    return solve(graph, cluster, train, constraints=constraints, time_limit_s=limit)


def _build_program(model: torch.nn.Module, graph: ModelGraph, plan: Plan, train: TrainSpec,
                   weights: Any = None, inputs: Any = None) -> Any:
    """The per-rank program under an initialised process group; ``None`` in plan mode."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from autoshard import runtime

    build_program = getattr(runtime, "build_program", None)
    if build_program is None:
        log.warning("autoshard.compile: this installation has no autoshard.runtime.build_program; "
                    "returning the plan only (program=None)")
        return None
    extra = {"inputs": inputs} if inputs is not None and len(inputs.tensors) > 1 else {}  # tokens alone: the default
    device = program_device()
    program = build_program(model, graph, plan, train, device=device, weights=weights, **extra,
                            options=runtime.BuildOptions(release_model=weights is None))
    from autoshard.runtime.step_profile import PROFILE_ENV, profile_program

    directory = os.environ.get(PROFILE_ENV)  # ``autoshard run --profile DIR``: the second step to a Chrome trace
    return profile_program(program, directory, torch.distributed.get_rank(), device) if directory else program


def program_device() -> str:
    """The device of this rank's program: its CUDA device under an NCCL process group, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"
