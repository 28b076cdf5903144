"""The search commands of the CLI: ``autoshard plan``, ``explain`` and ``diff``.

``autoshard/cli.py`` parses the arguments (its ``COMMANDS`` table); this
module holds what the commands do, so ``cli.py`` stays a table of small
handlers. Flag grammar (each parser raises ``AutoshardError`` naming the bad
text and the allowed set; the CLI prints it on one line and exits 2):

``--pin TARGET:field=value[,field=value...]`` (repeatable)
    ``TARGET`` is a glob (``fnmatch``) over layer names *and* layer-class ids
    (``blocks.*.attn``, ``lm_head``, ``attention:*``); a layer matches when its
    name or its class id does. Fields and values are those of
    ``search.space.Constraints.pin`` (``state tp sp ep recompute weight_comm
    grad_comm``); ``sp``/``ep`` take ``true/false`` (also ``1/0``, ``yes/no``,
    ``on/off``). Class ids contain ``:``, so the field list is what follows the
    *last* ``:``. Globs are expanded against the captured graph into per-layer
    pins; two pins giving one layer's field different values are refused.
``--mesh axis=degree[,axis=degree...]``
    Axes of ``plan.MESH_AXES``; every degree must divide the world size, the
    product of the fixed degrees (``ep`` excepted: it reuses dp ranks) must
    divide it too, and ``cp`` must be 1 (context parallelism is not searched).
``--max-memory QUANTITY``
    Per-rank bytes with a unit (``60GiB``, ``80GB``; ``cluster_io.parse_quantity``);
    a plain number is bytes.

``plan -o FILE`` checks FILE first (``file_io.check_output_path``: a regular
file or nothing, in an existing writable directory), so a bad path is refused
before the search, and writes it atomically (``Plan.save``). Plan and cluster
files are read by ``autoshard/file_io.py``'s strict rules.

``plan`` runs capture → search under a progress display on stderr (a spinner
and elapsed time per stage on a terminal; nothing when stderr is a file or a
pipe, so an error stays one line) and prints the plan, a timing line and,
with ``--retarget``, the diff from the old plan. ``--plan`` reuses a plan:
fingerprints are checked against the captured model and the cluster and the
training step against the flags, and the search is skipped.

``explain`` re-captures the plan's model from its name (a reference spec
such as ``llama:7b``), rebuilds the cluster from the plan's recorded
``cluster_spec`` (``plan_reuse.cluster_of``) unless ``--cluster`` is given,
and the ``TrainSpec`` from the plan's fields (``plan_reuse``: the recorded
cluster keeps its name, so a CPU plan is priced as CPU, and its calibration).

``--calibration FILE`` (``plan``, ``explain``, ``ppo``; ``run`` passes it to
the ranks) applies a file of ``autoshard cluster calibrate`` to the cluster
before it is searched or priced (``load_cluster``). A cluster file may name
one instead (``calibration: cal.json``, relative to the cluster file). The
plan records the calibrated figures in its cluster fingerprint and the whole
calibration record (cost-model constants, layer times) beside it, so ``explain``
of a calibrated plan prices it as the search did without ``--calibration``; with
``--cluster`` and no ``--calibration`` it warns in one line
(``plan_reuse.calibration_warning``).
"""

from __future__ import annotations

import fnmatch
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from autoshard.errors import AutoshardError, ModelError, PlanError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_MAX_LISTED = 6  # names shown in "did you mean" lists


# ----------------------------------------------------------------- flag grammar
@dataclass(frozen=True)
class PinSpec:
    """One ``--pin``: a glob over layer names / class ids and the fields it fixes."""

    pattern: str
    fields: tuple[tuple[str, Any], ...]
    text: str  # as the user wrote it, for messages


def parse_pin(text: str) -> PinSpec:
    """``"blocks.*.attn:state=zero3,recompute=full"`` → ``PinSpec`` (module docstring)."""
    from autoshard.search.space import PIN_FIELDS

    pattern, sep, body = text.rpartition(":")
    if not sep or not pattern or not body:
        raise AutoshardError(
            f"{text!r}: expected TARGET:field=value[,field=value...], e.g. 'blocks.*.attn:state=zero3'"
        )
    fields: dict[str, Any] = {}
    for item in body.split(","):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if key not in PIN_FIELDS:
            raise AutoshardError(f"{text!r}: unknown field {key!r}; allowed: {', '.join(PIN_FIELDS)}")
        if not eq or not raw:
            raise AutoshardError(f"{text!r}: field {key!r} has no value; write {key}=VALUE")
        if key in fields:
            raise AutoshardError(f"{text!r}: field {key!r} is given twice; give it once")
        fields[key] = _pin_value(text, key, raw, PIN_FIELDS[key])
    return PinSpec(pattern=pattern.strip(), fields=tuple(fields.items()), text=text)


def _pin_value(text: str, key: str, raw: str, allowed: tuple) -> Any:
    if all(isinstance(a, bool) for a in allowed):
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise AutoshardError(f"{text!r}: {key}={raw!r} is not a boolean; allowed: true, false")
    if raw not in allowed:
        raise AutoshardError(f"{text!r}: {key}={raw!r} is not allowed; allowed: {', '.join(allowed)}")
    return raw


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,pp=1"`` → ``{"tp": 2, "pp": 1}``; axes of ``MESH_AXES``, degrees ≥ 1."""
    from autoshard.plan import MESH_AXES

    mesh: dict[str, int] = {}
    for item in text.split(","):
        axis, eq, raw = (part.strip() for part in item.partition("="))
        if axis not in MESH_AXES:
            raise AutoshardError(f"{text!r}: unknown axis {axis!r}; allowed: {', '.join(MESH_AXES)}")
        if axis in mesh:
            raise AutoshardError(f"{text!r}: axis {axis!r} is given twice; give it once")
        try:
            degree = int(raw)
        except ValueError:
            degree = 0
        if not eq or degree < 1:
            raise AutoshardError(f"{text!r}: {axis}={raw!r} must be a positive integer degree")
        mesh[axis] = degree
    return mesh


def parse_memory(text: str) -> int:
    """``"60GiB"`` → bytes per rank (units: ``cluster_io``'s bytes table); must be > 0."""
    from autoshard.cluster_io import parse_quantity

    value = int(parse_quantity(text, "bytes", "memory"))
    if value <= 0:
        raise AutoshardError(f"{text!r} must be more than 0 bytes; give e.g. 60GiB")
    return value


def check_mesh(mesh: Mapping[str, int], world_size: int) -> None:
    """Refuse fixed mesh degrees that cannot tile a cluster of ``world_size`` ranks."""
    from autoshard.search.space import divisors

    allowed = f"divisors of the world size {world_size}: {divisors(world_size)}"
    for axis, degree in mesh.items():
        if world_size % degree:
            raise AutoshardError(f"--mesh {axis}={degree} does not divide the cluster; allowed: {allowed}")
    if mesh.get("cp", 1) != 1:
        raise AutoshardError(f"--mesh cp={mesh['cp']}: context parallelism is not searched yet; allowed: cp=1")
    fixed = {axis: degree for axis, degree in mesh.items() if axis != "ep"}
    product = 1
    for degree in fixed.values():
        product *= degree
    if world_size % product:
        terms = "*".join(f"{axis}={degree}" for axis, degree in fixed.items())
        raise AutoshardError(f"--mesh {terms} = {product} does not divide the world size {world_size}; "
                             "lower a degree or use a larger cluster")


def expand_pins(pins: Sequence[PinSpec], graph: Any) -> dict[str, dict[str, Any]]:
    """Per-layer pins for ``Constraints.pin``: each glob expanded over the graph's layers."""
    merged: dict[str, dict[str, Any]] = {}
    source: dict[tuple[str, str], str] = {}
    for pin in pins:
        layers = [l.name for l in graph.layers
                  if fnmatch.fnmatchcase(l.name, pin.pattern) or fnmatch.fnmatchcase(l.class_id, pin.pattern)]
        if not layers:
            raise AutoshardError(
                f"--pin {pin.text!r}: {pin.pattern!r} matches no layer name or class id of "
                f"{graph.model_name!r}; e.g. {_examples(graph)}; see `autoshard capture {graph.model_name}`"
            )
        for name in layers:
            for key, value in pin.fields:
                current = merged.setdefault(name, {})
                if key in current and current[key] != value:
                    raise AutoshardError(
                        f"--pin {pin.text!r} sets {key}={value!r} on layer {name!r}, but --pin "
                        f"{source[name, key]!r} set {key}={current[key]!r}; make the pins agree"
                    )
                current[key] = value
                source[name, key] = pin.text
    return merged


def _examples(graph: Any) -> str:
    names = [l.name for l in graph.layers][:_MAX_LISTED]
    classes = sorted({l.class_id for l in graph.layers})[:3]
    return ", ".join(names + classes)


# -------------------------------------------------------------------- cluster
def load_cluster(spec: str, calibration: Path | None = None) -> Any:
    """``Cluster.load(spec)`` with the calibration file ``calibration`` applied (``--calibration``)."""
    from autoshard.cluster import Cluster

    cluster = Cluster.load(spec)
    return cluster if calibration is None else cluster.with_calibration(calibration)


def describe_cluster_spec(spec: str) -> Any:
    """What ``autoshard cluster show`` prints for ``spec``: a calibration file's measurements, or the cluster
    (a preset string or a cluster file, with its calibration if it has one)."""
    from autoshard import cluster_io
    from autoshard.cluster import Cluster, describe_calibration_file

    if cluster_io.looks_like_file(spec) and Path(spec).is_file():
        data = cluster_io.read_mapping_file(spec)
        if cluster_io.file_kind(data) == "calibration":
            return describe_calibration_file(spec, data)
    return Cluster.load(spec).describe()


def calibration_line(cluster: Any, calibration: Path | None, *, recorded: bool = False) -> str | None:
    """``calibration cal.json: measured on DEVICE at DATE`` for the console, or ``None`` when uncalibrated.
    ``recorded``: without ``calibration``, the cluster is the plan's recorded one (``plan_reuse.cluster_of``)."""
    record = cluster.calibration
    if not record:
        return None
    where = " ".join(str(record[k]) for k in ("device", "date") if k in record) or "an unrecorded machine"
    source = f" {calibration}" if calibration is not None else (
        " (recorded in the plan)" if recorded else " (from the cluster file)")
    return f"calibration{source}: measured on {where}"


# ------------------------------------------------------------------- progress
class Stages:
    """Progress of a command on stderr: one row per stage with its elapsed time, plus the rows the
    stages' own work reports through ``reporter`` (capture's steps, the search's meshes).

    Drawn only when ``console`` is a terminal (``autoshard/progress.py`` with ``lines=False``: a
    pipe gets the result or one error line, no progress); nothing when ``console`` is ``None``
    (``--quiet``). ``seconds`` records every stage's wall time either way.
    """

    def __init__(self, console: Any) -> None:
        from autoshard.progress import Silent, reporter

        self.seconds: dict[str, float] = {}
        self.reporter = Silent() if console is None else reporter(console=console, lines=False)

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reporter.close()

    @contextmanager
    def stage(self, key: str, description: str) -> Iterator[None]:
        """Show ``description`` while the block runs; record its time under ``key``."""
        from autoshard.progress import Update

        self.reporter(Update(description, 0, 1))
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] = time.perf_counter() - start
            self.reporter(Update(description, 1, 1))

    def done(self) -> None:
        """A last row, ``done``, with the total time."""
        from autoshard.progress import Update

        self.reporter(Update(f"done in {sum(self.seconds.values()):.1f} s", 1, 1))


# --------------------------------------------------------------------- models
def reference_spec(spec: str, *, source: str | None = None) -> str:
    """The canonical ``family:size`` of a reference model (``"LLAMA"`` → ``"llama:tiny"``); a factory spec
    (``package.module:factory``, ``file.py:factory``: ``autoshard/models/source.py``) as given.

    ``source`` names the plan the spec came from, for a clearer error.
    """
    from autoshard.models import parse_spec
    from autoshard.models.source import is_factory_spec, is_hf_config_spec

    if is_factory_spec(spec) or is_hf_config_spec(spec):
        return spec.strip()

    try:
        family, size = parse_spec(spec)
    except ModelError as err:
        if source is None:
            raise
        raise ModelError(f"{source} was made for model {spec!r}, which is not a reference model the CLI can "
                         f"rebuild ({err}); use autoshard.compile(model, ..., plan=...) in Python") from None
    return f"{family}:{size}"


def check_seq_len(spec: str, seq_len: int) -> None:
    """Refuse a sequence longer than the reference model's ``max_seq_len`` (a factory's model: not checked)."""
    from autoshard.models import config_for
    from autoshard.models.source import is_factory_spec, is_hf_config_spec

    if is_factory_spec(spec) or is_hf_config_spec(spec):
        return

    limit = config_for(spec).max_seq_len
    if seq_len > limit:
        raise AutoshardError(f"--seq {seq_len} exceeds {spec}'s max_seq_len={limit}; give --seq <= {limit}")


# blocks traced for the compiled-activation scale: a ratio over identical blocks, so a few stand for all
COMPILED_SCALE_BLOCKS = 4


def with_compiled_activations(spec: str, graph: Any, cluster: Any, train: Any, stages: Stages) -> Any:
    """``graph`` with its compiled step's block-activation scale (``passes/compiled_saved.py``) when the
    runtime compiles on ``cluster`` (GPUs), as ``autoshard.compile`` measures it: traced on a meta copy of
    reference model ``spec`` with at most ``COMPILED_SCALE_BLOCKS`` blocks (the scale is a ratio over
    identical blocks). A trace that fails leaves it unmeasured, which the plan's caveats then say."""
    if cluster.runs_on_cpu:
        return graph
    import torch

    from autoshard.errors import CaptureError
    from autoshard.models import build
    from autoshard.models.source import is_factory_spec, is_hf_config_spec, load_model

    from autoshard.passes.compiled_saved import with_compiled_saved_scale

    with stages.stage("compiled", f"compiled activations of {spec} (AOT trace on meta)"):
        try:
            if is_factory_spec(spec) or is_hf_config_spec(spec):  # the user's model, whole
                model, _ = load_model(spec)
            else:
                depth = {"num_layers": COMPILED_SCALE_BLOCKS} if _blocks(graph) > COMPILED_SCALE_BLOCKS else {}
                model = build(spec, device="meta", dtype=torch.bfloat16, **depth)
            return with_compiled_saved_scale(graph, model, train.seq_len)
        except CaptureError:
            return graph


def _blocks(graph: Any) -> int:
    return len({layer.block for layer in graph.layers if layer.block is not None})


def capture_model(spec: str, stages: Stages) -> Any:
    """Capture reference model ``spec`` on meta under a progress row."""
    with stages.stage("capture", f"capture {spec} (torch.export on meta)"):
        return capture_spec(spec, progress=stages.reporter)


def capture_spec(spec: str, **options: Any) -> Any:
    """Capture a CLI ``MODEL`` (``autoshard/models/source.py``) built on meta in bf16; ``options`` go to
    ``capture`` (``seq_lens``, ``batch``)."""
    from autoshard.models.source import load_model
    from autoshard.passes.capture import capture

    model, name = load_model(spec)
    return capture(model, name=name, **options)


# ----------------------------------------------------------------------- plan
@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What ``autoshard plan`` was asked (``None``: not given on the command line)."""

    model: str | None
    cluster: str
    batch: int | None = None
    seq: int | None = None
    micro_batch: int | None = None
    optimizer: str | None = None
    precision: str | None = None
    comm_precision: str | None = None
    time_limit_s: float | None = None
    pins: tuple[PinSpec, ...] = ()
    mesh: Mapping[str, int] = field(default_factory=dict)
    max_memory_bytes: int | None = None
    output: Path | None = None
    reuse: Path | None = None
    retarget: Path | None = None
    calibration: Path | None = None
    json: bool = False
    """Print the plan's JSON (``Plan.to_json``) on stdout instead of the table and the timing line."""

    def search_flags(self) -> list[str]:
        """The search-only flags that were given (refused with ``--plan``)."""
        given = {"--pin": self.pins, "--mesh": self.mesh, "--max-memory": self.max_memory_bytes,
                 "--time-limit": self.time_limit_s, "--retarget": self.retarget}
        return [flag for flag, value in given.items() if value]


def run_plan(request: PlanRequest, console: Any, progress_console: Any) -> None:
    """``autoshard plan``: capture, then search (or reuse / retarget), print and save the plan."""
    from autoshard.file_io import check_output_path
    from autoshard.plan import Plan

    if request.output is not None:  # refused now, not after minutes of search
        check_output_path(request.output, noun="plan file", error=PlanError)
    if request.reuse and request.search_flags():
        raise AutoshardError(f"--plan reuses a plan and skips the search, so {', '.join(request.search_flags())} "
                             "cannot apply; drop them or drop --plan")
    cluster = load_cluster(request.cluster, request.calibration)
    check_mesh(request.mesh, cluster.world_size)
    old_path = request.reuse or request.retarget
    old = Plan.load(old_path) if old_path else None
    spec = _plan_model(request, old, old_path)
    train = _train_spec(request, old)
    check_seq_len(spec, train.seq_len)
    with Stages(progress_console) as stages:
        graph = capture_model(spec, stages)
        if old is not None:  # a plan that does not fit is refused before the compiled-activation trace
            _check_old(old, old_path, graph, cluster if request.reuse else None, train if request.reuse else None)
        graph = with_compiled_activations(spec, graph, cluster, train, stages)
        plan = old if request.reuse else _search(request, graph, cluster, train, old, stages)
        stages.done()
    _report(console, request, plan, old, stages.seconds, cluster)


def _plan_model(request: PlanRequest, old: Any, old_path: Path | None) -> str:
    if request.model is not None:
        return reference_spec(request.model)
    if old is None:
        raise AutoshardError("no MODEL given; name a reference model (e.g. 'llama:7b', see `autoshard models`), "
                             "or pass --plan/--retarget to take the plan's model")
    return reference_spec(old.model_name, source=str(old_path))


def _train_spec(request: PlanRequest, old: Any) -> Any:
    """The ``TrainSpec`` from the flags; unset fields come from the reused / retargeted plan."""
    from autoshard.train import TrainSpec

    base = {"global_batch": request.batch, "seq_len": request.seq, "micro_batch": request.micro_batch,
            "optimizer": request.optimizer, "precision": request.precision,
            "comm_precision": request.comm_precision}
    if old is not None:
        stored = {"global_batch": old.global_batch, "seq_len": old.seq_len,
                  "optimizer": old.optimizer, "precision": old.precision}
        base = {k: stored[k] if v is None and k in stored else v for k, v in base.items()}
    missing = [flag for flag, key in (("--batch", "global_batch"), ("--seq", "seq_len")) if base[key] is None]
    if missing:
        raise AutoshardError(f"missing {' and '.join(missing)}: give the global batch (sequences per step) and "
                             "the sequence length, e.g. --batch 64 --seq 4096")
    if base["micro_batch"] is not None and base["global_batch"] % base["micro_batch"]:
        raise AutoshardError(f"--micro-batch {base['micro_batch']} does not divide --batch {base['global_batch']}; "
                             "give a divisor of the global batch, or leave it to the search")
    return TrainSpec(**{k: v for k, v in base.items() if v is not None})


def _check_old(plan: Any, path: Path, graph: Any, cluster: Any, train: Any) -> None:
    """Refuse the ``--plan`` / ``--retarget`` plan at ``path`` made for another model (and, reused, another
    cluster or training shape), naming the file."""
    from autoshard.plan_reuse import check_train

    try:
        plan.check_compatible(graph=graph, cluster=cluster)
    except PlanError as err:
        raise PlanError(f"{path}: {err}") from None
    if train is not None:
        check_train(plan, train, source=str(path))


def _search(request: PlanRequest, graph: Any, cluster: Any, train: Any, old: Any, stages: Stages) -> Any:
    from autoshard.search import Constraints, solve
    from autoshard.search.solver import DEFAULT_TIME_LIMIT_S

    constraints = Constraints(pin=expand_pins(request.pins, graph), mesh=dict(request.mesh),
                              max_memory_bytes=request.max_memory_bytes)
    limit = request.time_limit_s or DEFAULT_TIME_LIMIT_S
    with stages.stage("search", f"search {cluster.name} (CP-SAT, time limit {limit:g} s)"):
        return solve(graph, cluster, train, constraints=constraints, time_limit_s=limit, hint=old,
                     progress=stages.reporter)


def _report(console: Any, request: PlanRequest, plan: Any, old: Any, seconds: Mapping[str, float],
            cluster: Any) -> None:
    if request.json:  # one JSON document on stdout: the plan as its file holds it
        from autoshard.cli_args import print_json

        if request.output is not None:
            plan.save(request.output)
        print_json(plan.to_json())
        return
    console.print(plan.to_rich())
    calibrated = calibration_line(cluster, request.calibration)
    if calibrated:
        console.print(calibrated, markup=False)
    if request.retarget:
        from autoshard.search import diff_plans, format_diff

        console.print(f"\nchanges from {request.retarget} (retargeted to {request.cluster}):", markup=False)
        console.print(format_diff(diff_plans(old, plan)))
    timing = f"capture {seconds.get('capture', 0.0):.1f} s"
    if "search" in seconds:
        s = plan.solver
        timing += (f", search {seconds['search']:.1f} s ({s.status}, gap {s.gap:.1%}, "
                   f"{s.meshes_solved} of {s.meshes_considered} meshes solved)")
    else:
        timing += f", search skipped: {request.reuse} matches the model, cluster and training step"
    console.print(timing, markup=False)
    if request.output is not None:
        console.print(f"plan written to {plan.save(request.output)}", markup=False)


# -------------------------------------------------------------------- explain
def run_explain(path: Path, layer: str, top: int, cluster_spec: str | None, max_memory_bytes: int | None,
                console: Any, progress_console: Any, calibration: Path | None = None) -> None:
    """``autoshard explain``: why ``layer`` got its strategy in the plan at ``path`` (priced on ``cluster_spec``
    or the plan's recorded cluster, with the ``calibration`` file applied when given)."""
    from autoshard.plan import Plan
    from autoshard.plan_reuse import calibration_warning, cluster_for, train_of
    from autoshard.search import Constraints, explain_layer, format_explanation

    plan = Plan.load(path)
    names = [s.layer for s in plan.layers]
    if layer not in names:
        close = [n for n in names if layer in n or n in layer][:_MAX_LISTED] or names[:_MAX_LISTED]
        raise AutoshardError(f"layer {layer!r} is not in {path}; layers include {', '.join(close)}; "
                             f"see `autoshard inspect --no-fold {path}`")
    cluster = cluster_for(plan, cluster_spec, calibration)
    spec = reference_spec(plan.model_name, source=str(path))
    with Stages(progress_console) as stages:
        graph = capture_model(spec, stages)
        stages.done()
    train = train_of(plan)
    _check_old(plan, path, graph, cluster, train)  # the model and cluster must be the plan's
    explanation = explain_layer(plan, graph, cluster, train, layer, k=top,
                                constraints=Constraints(max_memory_bytes=max_memory_bytes))
    console.print(format_explanation(explanation))
    for line in (calibration_line(cluster, calibration, recorded=not cluster_spec),
                 calibration_warning(plan, cluster)):
        if line:
            console.print(line, markup=False)


# ----------------------------------------------------------------------- diff
def run_diff(a: Path, b: Path, console: Any) -> None:
    """``autoshard diff``: what changed from plan ``a`` to plan ``b``."""
    from autoshard.plan import Plan
    from autoshard.search import diff_plans, format_diff

    diff = diff_plans(Plan.load(a), Plan.load(b))
    console.print(f"{a} → {b}", markup=False)
    console.print(format_diff(diff))


__all__ = [
    "PinSpec", "PlanRequest", "Stages", "calibration_line", "check_mesh", "check_seq_len", "describe_cluster_spec",
    "expand_pins", "load_cluster", "parse_memory", "parse_mesh", "parse_pin", "reference_spec", "run_diff",
    "run_explain", "run_plan",
]
