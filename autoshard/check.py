"""Build every rank role of a plan at its real world size in one process, and check it (``autoshard check``).

``check_plan(plan, model, graph, train)`` needs no weights, no GPU and no
second process:

1. **World.** For each rank it builds, the default process group is the
   ``fake`` backend over a ``FakeStore`` (``torch.testing._internal.
   distributed.fake_pg``; torch 2.11–2.13) at the plan's world size, for CPU
   and meta tensors (``"cpu:fake,meta:fake"``: pipeline send/recv dispatch on
   the meta device). Collectives return at once and move nothing; group
   creation, ``DeviceMesh`` and every rank computation are the real ones.
2. **Roles.** Ranks are grouped into roles (pipeline stage × cp × tp × dp
   shard class, ``runtime/_check_match.py`` [Note: roles]); one rank per role is
   built — all roles up to ``max_roles`` (256), beyond that the corner roles
   (first/last stage, tp and cp coordinate, every dp class) and a seeded
   sample of the rest.
3. **Build and step.** Each role's program is built by ``build_program`` on
   the meta device from one export of the model (copied per role), then runs
   two training steps (forward, backward, optimizer) on meta tokens of the
   local batch's shape, under ``runtime/_check_trace.Trace``: a ``LiveBytes``
   counting meta storages (what the tensors would take on a device) that also
   records every collective issued, with its kind, mesh axis and bytes.
   **Eager only**: the program is built eager (``BuildOptions(compile=Compile.OFF)``); a
   compiled program (``torch.compile`` on CUDA) is not traced here, so the
   collectives checked are the eager forms of the same plan
   (docs/runtime.md, "Compiled per-rank graph", lists what differs).
4. **Collectives.** The build's and the second step's collectives of every
   role are matched across the ranks of each group (``_check_match``
   [Note: matching]): same order, kind and bytes on every member; sends equal
   the peer's receives. A mismatch is a hang or a shape error on real ranks.
5. **Memory.** Build peak (the ``LiveBytes`` peak while ``build_program``
   runs) and step peak (max of the build peak and the peak of the second
   step, which starts from the resident shards, masters and optimizer state)
   against ``search.cost_model.predict`` of the same plan on a CPU cluster of
   the plan's shape (the cost model prices the eager runtime there; a GPU
   cluster's plan is priced compiled): ``build_peak_bytes`` and
   ``memory_by_stage[pp coordinate]``. With no weights to read, every
   shard is initialised (``autoshard/init.py``), whose workspace (at most 48
   bytes an element of the largest region, up to 2²² elements, the device
   chunk) the cost model does not price (it prices reading a checkpoint: 8
   bytes an element): ``initialised_build_bytes`` adds it to the prediction,
   for the largest region of any rank (the cost model's ``E(w)``,
   ``layer_terms.build_regions``), as ``build_peak_bytes`` is the largest
   stage's.

**Memory match.** The cost model prices the rank with the largest shards of
each pipeline stage, so a rank may hold less. A role *overflows* when its
traced bytes exceed the prediction by more than ``tolerance`` (default
``TOLERANCE`` = 5%): on a device with the predicted memory, it would not fit.
Below the prediction is reported (the error column) but not a mismatch: a
pessimistic prediction costs speed, not a crash. Memory comparisons are
skipped (and say so) for offload plans, whose host states live on the CPU
while the device copies are meta.

**What the meta trace counts as a real run does** (each found by comparing the trace with a gloo run's
``LiveBytes`` of the same plan, phase by phase; ``tests/test_live_memory*.py`` are those runs):

- another pipeline rank's parameters: ``passes/shard_parameters.py`` keeps them as meta tensors, which a
  device run does not count but a meta build did (every stage's parameters, +50% on a pp2 × tp2 Llama
  build, +9.6% on a pp4 MoE build); they are now views of one meta element, no bytes on any device;
- the AdamW update: ``runtime/optimizer.update_kind`` chose the multi-tensor path on meta (a
  ``sqrt(v)`` of every master, +10% on a one-rank MoE step); on meta it takes the fused kernel, as on
  the CPU and CUDA;
- the initializer's workspace: it was added for the peak rank's largest region (on a pipeline, possibly
  another stage's, smaller than the first stage's embedding), now for the plan's largest;
- attention: on meta, ``scaled_dot_product_attention`` takes the math path and materialises the fp32
  ``[b, a, s, s]`` scores, their softmax and its gradient (16 GiB a tensor for a Llama-70B layer at tp 2,
  8 × 4096 tokens: +226% on a two-layer cut of that plan), where a CPU or CUDA device runs a fused
  kernel; the built program's SDPA nodes now run the flash op on meta (``_check_trace.
  route_device_kernels``), as capture measures saved activations.

**Overruns the check found, and their prices.** Gradient buckets span layers (``runtime/_buckets.assign``),
the backward holds an activation-gradient working set (an RMSNorm's fp32 copies), a recomputed region's
members hold what the region recreated, and a ZeRO-3 gather's flat output lives beside its copy-out: all
priced since cost model 12 (``search/memory.py``). What is left on random plans, and at published scales:
``benchmarks/results/check_property_cpu_2026-12-07``, ``benchmarks/results/check_scales_cpu_2026-12-07``.

Exit of ``autoshard check``: 0 when every role's collectives match and no
role overflows; 1 with the first mismatch in one line; 2 for a plan file
that cannot be read (the CLI's usual one line).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.graph import ModelGraph
from autoshard.passes.context import RankContext, coords_of
from autoshard.plan import Plan
from autoshard.runtime._check_match import Role, RoleIndex, first_mismatch, plan_roles, select_roles
from autoshard.runtime._check_trace import Issued, Trace, axis_of_groups, format_bytes, route_device_kernels
from autoshard.train import TrainSpec

TOLERANCE = 0.05
MAX_ROLES = 256
BACKEND = "cpu:fake,meta:fake"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class RoleResult:
    """One built role: what it issued and held, against the prediction for its stage."""

    role: Role
    label: str
    collectives: int  # issued in the build and one step
    build_bytes: int
    step_bytes: int  # max(build peak, step peak)
    predicted_build: int
    predicted_step: int
    seconds: float

    @property
    def step_error(self) -> float:
        """(traced − predicted) / predicted step bytes."""
        return (self.step_bytes - self.predicted_step) / max(self.predicted_step, 1)

    @property
    def build_error(self) -> float:
        """(traced − predicted) / predicted build bytes."""
        return (self.build_bytes - self.predicted_build) / max(self.predicted_build, 1)


@dataclass(frozen=True)
class CheckReport:
    """What ``check_plan`` found: per role results, the first collective mismatch and the first memory
    overflow (``None``: none), notes."""

    plan: Plan
    roles: tuple[RoleResult, ...]
    num_roles: int  # roles of the mesh (``roles`` may be a sample)
    collective_mismatch: str | None
    memory_overflow: str | None
    tolerance: float
    memory_checked: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def mismatch(self) -> str | None:
        """The first mismatch, collectives first (one line), or ``None``."""
        return self.collective_mismatch or self.memory_overflow

    @property
    def ok(self) -> bool:
        """Whether every collective matched and no role overflowed its predicted memory."""
        return self.mismatch is None

    def table(self) -> str:
        """The per-role table and the verdict, for people."""
        mesh = self.plan.mesh
        header = ("role", "ranks", "rank", "collectives", "build traced/predicted", "step traced/predicted", "error")
        rows = [header]
        for r in self.roles:
            rows.append((r.label, str(r.role.num_ranks), str(r.role.rank), str(r.collectives),
                         f"{format_bytes(r.build_bytes)} / {format_bytes(r.predicted_build)}",
                         f"{format_bytes(r.step_bytes)} / {format_bytes(r.predicted_step)}",
                         f"{r.step_error:+.1%}" if self.memory_checked else "not checked"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        seconds = sum(r.seconds for r in self.roles)
        built = f"{len(self.roles)} of {self.num_roles} roles" if len(self.roles) < self.num_roles else \
            f"{len(self.roles)} roles"
        lines.append(f"mesh {mesh} ({mesh.world_size} ranks): {built} built eager on meta under a fake process "
                     f"group in {seconds:.1f} s; memory overflow tolerance {self.tolerance:.0%}")
        lines.extend(self.notes)
        lines.append("all collectives match" + (", no role above its predicted memory" if self.memory_checked else "")
                     if self.ok else f"mismatch: {self.mismatch}")
        return "\n".join(lines)


def check_plan(plan: Plan, model: nn.Module, graph: ModelGraph, train: TrainSpec, *, cluster: Any = None,
               loss_fn: Callable | None = None, max_roles: int = MAX_ROLES, seed: int = 0,
               tolerance: float = TOLERANCE) -> CheckReport:
    """Build and step every role of ``plan`` under a fake process group and meta tensors (module docstring).

    ``model``: the plan's model, on any device (meta is best: nothing is read from it). ``graph``: its
    capture. ``train``: the step the plan was made for (``plan_reuse.train_of``). ``cluster``: the plan's
    cluster, for the shape of the CPU cluster the memory is predicted on (``None``: one node of
    ``world_size`` ranks). ``loss_fn(outputs, tokens)``: default cross-entropy on the first output plus
    the mean square of the second (the reference models' logits and values). Needs no process group
    initialised (it creates and destroys one per role).
    """
    if dist.is_initialized():
        raise AutoshardError("check_plan creates its own fake process groups; call it where torch.distributed "
                             "is not initialised (destroy_process_group first)")
    mesh = plan.mesh
    roles = plan_roles(graph, mesh)
    chosen = select_roles(roles, mesh, max_roles, seed)
    memory_checked = all(s.state != "offload" for s in plan.layers)
    predictions = _predict(plan, graph, train, cluster)
    exported = _export_once(plan, model, graph, train)
    records: dict[tuple, list[Issued]] = {}
    results = []
    for role in chosen:
        result, issued = _run_role(plan, model, graph, train, role, exported, loss_fn or default_loss, predictions)
        records[role.key] = issued
        results.append(result)
    mismatch = first_mismatch(records, RoleIndex(graph, mesh))
    overflow = _memory_overflow(results, tolerance) if memory_checked else None
    notes = () if memory_checked else ("memory not compared: offload layers keep host states on the CPU",)
    return CheckReport(plan, tuple(results), len(roles), mismatch, overflow, tolerance, memory_checked, notes)


def default_loss(outputs: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the first output (logits ``[b, S, V]``) on the next tokens, plus the mean square of the
    second (values), as the runtime tests train the reference models."""
    logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                       tokens[:, 1:].reshape(-1))
    if isinstance(outputs, (tuple, list)) and len(outputs) > 1:
        loss = loss + outputs[1].float().pow(2).mean()
    return loss


def _predict(plan: Plan, graph: ModelGraph, train: TrainSpec, cluster: Any) -> Any:
    """``predict`` on a CPU cluster of the plan's shape (module docstring, step 5)."""
    from autoshard.cluster import Cluster
    from autoshard.search.cost_model import predict

    nodes, per_node = (cluster.nodes, cluster.devices_per_node) if cluster is not None else (1, plan.mesh.world_size)
    return predict(graph, plan, Cluster.preset("cpu", nodes=nodes, devices_per_node=per_node), train)


def _export_once(plan: Plan, model: nn.Module, graph: ModelGraph, train: TrainSpec) -> torch.fx.GraphModule:
    """The model exported for the meta device in the compute dtype, copied for each role."""
    from autoshard.runtime.program import export_model

    mesh = plan.mesh
    ctx = RankContext(rank=0, world_size=mesh.world_size, mesh=mesh, coords=coords_of(0, mesh), device="meta",
                      compute_dtype=_DTYPES[train.precision])
    return export_model(model, graph, ctx)


def _run_role(plan: Plan, model: nn.Module, graph: ModelGraph, train: TrainSpec, role: Role,
              exported: torch.fx.GraphModule, loss_fn: Callable, predictions: Any) -> tuple[RoleResult, list[Issued]]:
    """Build and step ``role.rank``'s program under a fake world (module docstring, steps 1 and 3)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoshard.runtime.mesh import build_rank_context
    from autoshard.runtime.build_options import BuildOptions
    from autoshard.runtime.program import build_program

    start = time.perf_counter()
    mesh = plan.mesh
    dist.init_process_group(BACKEND, store=FakeStore(), rank=role.rank, world_size=mesh.world_size)
    try:
        ctx, _ = build_rank_context(mesh, device="meta", compute_dtype=_DTYPES[train.precision])
        gm = copy.deepcopy(exported)
        trace = Trace(axis_of_groups(ctx.group_names))
        with trace:
            program = build_program(model, graph, plan, train, ctx=dataclasses.replace(ctx), device="meta", exported=gm,
                                    options=BuildOptions(compile=False))
            del gm
        build_bytes, issued = trace.peak, list(trace.collectives)
        tokens = torch.zeros((train.global_batch // mesh.dp, train.seq_len), dtype=torch.long, device="meta")
        route_device_kernels(program.gm)  # SDPA as a device runs it (_check_trace, Kernels)
        with trace:
            program.step(tokens, loss_fn)  # the first step creates the optimizer state
            gc.collect()
            trace.reset_peak()
            del trace.collectives[:]
            program.step(tokens, loss_fn)
        issued += trace.collectives
        step_bytes = max(build_bytes, trace.peak)
        del program
    finally:
        dist.destroy_process_group()
    build = initialised_build_bytes(predictions, plan, graph)
    result = RoleResult(role, role.label(mesh), len(issued), build_bytes, step_bytes, build,
                        max(build, predictions.memory_by_stage[role.key[0]]), time.perf_counter() - start)
    return result, issued


def initialised_build_bytes(predictions: Any, plan: Plan, graph: ModelGraph) -> int:
    """The predicted build peak of a program whose shards are initialised, not read (module docstring):
    the cost model's ``build_peak_bytes`` (the largest stage's) plus the initializer's workspace for the
    largest region any rank of the plan initialises (``layer_terms.build_regions``, the cost model's own
    ``E(w)``; not the peak rank's ``build_transient``, which on a pipeline may be another stage's)."""
    from autoshard.init import ACCELERATOR_CHUNK_ELEMENTS, WORKSPACE_BYTES, CHUNK_ELEMENTS
    from autoshard.search.layer_terms import build_regions

    strategies = {s.layer: s for s in plan.layers}
    largest = max((e for layer in graph.layers for e in build_regions(layer, strategies[layer.name], plan.mesh)),
                  default=0)
    per_element = WORKSPACE_BYTES / CHUNK_ELEMENTS
    return int(predictions.build_peak_bytes + per_element * min(largest, ACCELERATOR_CHUNK_ELEMENTS))


def _memory_overflow(results: list[RoleResult], tolerance: float) -> str | None:
    """The first role whose traced build or step bytes exceed the prediction by more than ``tolerance``."""
    for r in results:
        for what, traced, predicted, error in (("build", r.build_bytes, r.predicted_build, r.build_error),
                                               ("step", r.step_bytes, r.predicted_step, r.step_error)):
            if error > tolerance:
                return (f"rank {r.role.rank}: {what} memory {format_bytes(traced)} traced, "
                        f"{format_bytes(predicted)} predicted ({error:+.1%}, over the {tolerance:.0%} tolerance)")
    return None


# ------------------------------------------------------------------------ CLI


def add_check_arguments(parser: Any) -> None:
    """``autoshard check PLAN.json [--max-roles N] [--tolerance F] [--seed S]``."""
    parser.add_argument("plan", metavar="PLAN.json", help="a plan file of a reference model (autoshard plan -o)")
    parser.add_argument("--max-roles", type=int, default=MAX_ROLES, dest="max_roles",
                        help=f"build at most this many rank roles; beyond, the corner roles and a seeded sample "
                             f"(default {MAX_ROLES})")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"a role overflows when its traced memory exceeds the prediction by more than this "
                             f"fraction (default {TOLERANCE})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the role sample (default 0)")


def cmd_check(args: Any, console: Any) -> int:
    """``autoshard check``: the table of ``CheckReport.table``; 0 when all match, 1 with the first mismatch."""
    from autoshard.cli_search import reference_spec
    from autoshard.models.source import load_model
    from autoshard.passes.capture import capture
    from autoshard.plan_reuse import cluster_of, train_of

    if args.max_roles < 1 or not 0 <= args.tolerance < 10:
        raise AutoshardError(f"--max-roles {args.max_roles} / --tolerance {args.tolerance}: give --max-roles >= 1 "
                             "and a tolerance in [0, 10)")
    plan = Plan.load(args.plan)
    spec = reference_spec(plan.model_name, source=str(args.plan))
    model, name = load_model(spec)  # on meta
    graph = capture(model, name=name)
    plan.check_compatible(graph=graph)
    try:
        cluster = cluster_of(plan)
    except AutoshardError:  # a hand-written plan: one node of world-size ranks
        cluster = None
    report = check_plan(plan, model, graph, train_of(plan), cluster=cluster,
                        max_roles=args.max_roles, seed=args.seed, tolerance=args.tolerance)
    console.print(report.table(), markup=False, highlight=False, soft_wrap=True)
    return 0 if report.ok else 1


__all__ = ["CheckReport", "MAX_ROLES", "RoleResult", "TOLERANCE", "check_plan", "default_loss"]
