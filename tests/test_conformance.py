"""Conformance: the data-parallel collectives the runtime issues in a step are the declared ones.

Every state of ``autoshard/data_parallel.py`` runs one step on gloo (world 2, Llama tiny, fp32)
eager with two micro-batches and compiled (``aot_eager``: the same joint graph and partition as
inductor) with one, and HSDP (world 4: dp_replicate 2 × dp_shard 2) both ways; ``torch.profiler`` records every collective the process group runs
(kind and tensor sizes). Declared = Σ over the plan's layers of ``data_parallel_form(...)``: each
collective × (micro-batches when per micro-batch) with the bytes of the layer's full tensors as
the runtime pads them (ZeRO-3 and in-forward gathers: every parameter's dim 0 padded to a multiple
of the group; the optimizer's flat reductions: every parameter flattened and padded; the optimizer's HSDP replica
all-reduce: the rank's shards as held, unpadded), and the
optimizer's per-step reductions packed in buckets (one bucket here: ``bucket_bytes`` above the
model), plus two scalar all-reduces per step that are bookkeeping, not a layer's (the loss mean and
the clipping norm). The two must be equal: same kinds, same counts, same bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import tempfile

import pytest

from _harness import run_gloo_cases
from _tiers import sample_list
from _runtime_cases import BATCH, OPT, SEQ, batches, graph_of, loss_fn, make_plan

from autoshard.data_parallel import data_parallel_form
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime import BuildOptions, build_program
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # spawned gloo ranks

SPEC = "llama:tiny"
STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
MESH = Mesh(dp_shard=2)
HSDP = Mesh(dp_replicate=2, dp_shard=2)
BIG_BUCKET = 1 << 30


def _plan(state: str, micro_batches: int, mesh: Mesh = MESH):
    plan = make_plan(SPEC, mesh, lambda _name: {"state": state})
    return dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, num_micro_batches=micro_batches,
                                                                  bucket_bytes=BIG_BUCKET))


def _issued(rank, world_size, state, micro_batches, compiled, mesh=MESH):
    """Collectives of the second step, from the profiler: {kind: [count, bytes]}."""
    from torch.profiler import ProfilerActivity, profile

    program = build_program(build(SPEC), graph_of(SPEC), _plan(state, micro_batches, mesh),
                            TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT,
                            options=BuildOptions(compile=compiled, backend="aot_eager"))
    tokens = batches()[0]
    program.step(program.local_batch(tokens), loss_fn)  # the first step compiles
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        program.step(program.local_batch(tokens), loss_fn)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    dims = {e["name"]: [] for e in events if "name" in e}
    for e in events:
        if "Input Dims" in e.get("args", {}):
            dims[e["name"]].append(e["args"]["Input Dims"])
    numel = lambda shape: math.prod(shape)  # noqa: E731
    # eager gathers and the functional (compiled) ones: the output is the gathered tensor
    gathers = ([numel(d[0]) for d in dims.get("c10d::_allgather_base_", [])]
               + [numel(d[0][0]) for d in dims.get("c10d::allgather_into_tensor_coalesced_", [])])
    scatters = ([numel(d[1]) for d in dims.get("c10d::_reduce_scatter_base_", [])]  # eager
                + [numel(d[1][0]) for d in dims.get("c10d::reduce_scatter_tensor_coalesced_", [])])  # functional
    # gloo runs a reduce-scatter as an all-reduce of its input: those are not all-reduces of the step
    reduces = collections.Counter(numel(d[0]) for d in dims.get("gloo:all_reduce", []))
    reduces.subtract(collections.Counter(scatters))
    reduces = list(reduces.elements())
    return {"all_gather": [len(gathers), 4 * sum(gathers)], "reduce_scatter": [len(scatters), 4 * sum(scatters)],
            "all_reduce": [len(reduces), 4 * sum(reduces)], "compiled": program._run is not program.gm,
            "shard_coord": program.ctx.coord("dp_shard")}


def _padded(shape: tuple[int, ...], n: int, layout: str) -> int:
    if layout == "dim0":
        return -(-shape[0] // n) * n * math.prod(shape[1:])
    if layout == "flat":
        return -(-math.prod(shape) // n) * n
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], n: int, coord: int) -> int:
    """Elements of ``torch.chunk``'s piece ``coord`` of dim 0 in ``n`` (empty past the last)."""
    c = -(-shape[0] // n)
    return max(0, min(c, shape[0] - coord * c)) * math.prod(shape[1:])


def _declared(state: str, micro_batches: int, compiled: bool, mesh: Mesh = MESH,
              shard_coord: int = 0) -> dict[str, list[int]]:
    graph, plan = graph_of(SPEC), _plan(state, micro_batches, mesh)
    out = {kind: [0, 0] for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    bucketed = set()
    for layer in graph.layers:
        if not layer.params:
            continue
        form = data_parallel_form(plan.strategy(layer.name), plan.mesh, micro_batches, compiled, layer.kind)
        for c in form.collectives:
            times = micro_batches if c.per_micro_batch else 1
            # the optimizer's per-step reductions and gathers (outside the graph) go out in buckets
            in_buckets = not c.in_graph and c.phase in ("after_backward", "after_update")
            if c.axis == "dp_replicate" and c.in_graph:  # HSDP in the graph: the padded reduce-scatter output
                size = sum(_padded(tuple(p.global_shape), mesh.dp_shard, "dim0") // mesh.dp_shard
                           for p in layer.params)
            elif c.axis == "dp_replicate":  # HSDP, the optimizer's: this rank's shards as held
                size = sum(_shard_numel(tuple(p.global_shape), mesh.dp_shard, shard_coord) for p in layer.params)
            else:
                n = mesh.dp_shard if c.axis == "dp_shard" else mesh.dp
                layout = "plain" if c.kind == "all_reduce" else ("flat" if in_buckets else "dim0")
                size = sum(_padded(tuple(p.global_shape), n, layout) for p in layer.params)
            if in_buckets:
                bucketed.add(c.kind)
            elif c.kind == "all_reduce" and c.axis == "dp":  # in the graph: one per parameter
                out[c.kind][0] += times * len(layer.params)
            else:
                out[c.kind][0] += times
            out[c.kind][1] += times * 4 * size
    for kind in bucketed:
        out[kind][0] += 1  # one bucket: BIG_BUCKET holds the model
    out["all_reduce"][0] += 2  # bookkeeping: the loss mean and the clipping norm, one fp32 scalar each
    out["all_reduce"][1] += 2 * 4
    return out


CASES = [(state, 2, False) for state in STATES] + [(state, 1, True) for state in ("replicate", "zero1", "zero3")]
# world 4, dp_replicate 2 × dp_shard 2: HSDP's two-level reduction, and ZeRO-1 not gathered in forward
CASES_4 = [("zero3", 2, False), ("zero3", 1, True), ("zero1", 1, True)]
# `make test` (tests/_tiers.py): every state eager; compiled ZeRO-1 (gathered once, kept) and ZeRO-3
# (re-gathered); HSDP ZeRO-3 eager and ZeRO-1 compiled. Compiled replicate's in-graph all-reduces are counted
# in tests/test_compile_program.py (one micro-batch DP plan); here under `make test-full`, as HSDP ZeRO-3 compiled
CASES = sample_list(CASES, [(s, 2, False) for s in STATES] + [("zero1", 1, True), ("zero3", 1, True)])
CASES_4 = sample_list(CASES_4, [("zero3", 2, False), ("zero1", 1, True)])


@pytest.fixture(scope="module")
def issued():
    jobs = {f"{s}_m{m}_{'compiled' if c else 'eager'}": functools.partial(_issued, state=s, micro_batches=m, compiled=c)
            for s, m, c in CASES}
    return run_gloo_cases(jobs, 2, timeout_s=900)


@pytest.fixture(scope="module")
def issued4():
    jobs = {f"{s}_m{m}_{'compiled' if c else 'eager'}": functools.partial(_issued, state=s, micro_batches=m, compiled=c,
                                                                         mesh=HSDP)
            for s, m, c in CASES_4}
    return run_gloo_cases(jobs, 4, timeout_s=900)


@pytest.mark.parametrize("state, micro_batches, compiled", CASES)
def test_runtime_issues_the_declared_collectives(issued, state, micro_batches, compiled):
    declared = _declared(state, micro_batches, compiled)
    for r in issued[f"{state}_m{micro_batches}_{'compiled' if compiled else 'eager'}"]:
        assert r["compiled"] == compiled
        assert {k: r[k] for k in declared} == declared


@pytest.mark.parametrize("state, micro_batches, compiled", CASES_4)
def test_runtime_issues_the_declared_collectives_hsdp(issued4, state, micro_batches, compiled):
    """The profiler does not name the process group: kinds, counts and bytes are checked, and each
    case's collectives of one kind run over one axis (the declaration says which)."""
    for r in issued4[f"{state}_m{micro_batches}_{'compiled' if compiled else 'eager'}"]:
        declared = _declared(state, micro_batches, compiled, HSDP, r["shard_coord"])
        assert r["compiled"] == compiled
        assert {k: r[k] for k in declared} == declared
