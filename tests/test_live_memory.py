"""Live bytes of a training step against the cost model's memory, for every state strategy (gloo).

Each case builds one rank's program of a 3.4M-parameter Llama (fp32 AdamW, 1 MiB buckets) from the
model's own parameters, runs a warm-up step (it compiles) and a measured step, all under one
``autoshard/live_bytes.LiveBytes``: the build's peak, the live bytes when the measured step starts
(the model states), the peak of its forward and backward and the peak of its optimizer step
(``ShardedOptimizer.step``: gradient sync, update, write-back). Eager cases run two micro-batches,
compiled ones (``aot_eager``: the joint graph and partition inductor gets, every op seen by the
mode) one; world 4 is HSDP (dp_replicate 2 × dp_shard 2). The prediction is
``search.cost_model.predict`` for the same plan and ``TrainSpec``: on CPU ranks (``cpu`` preset) for
the eager programs, which is how the runtime runs a CPU cluster's plans; on a GPU preset of the same
world size for the compiled ones, the only clusters whose plans the cost model prices compiled
(their memory terms differ from the CPU's only in offload's host states, not compiled here).

Asserted per case, for the rank with the largest shards, within ``TOLERANCE`` of the prediction:
the optimizer step's peak (params + grads + optimizer + ``step_grads`` + ``step_transient`` of
``Predictions.memory_breakdown``), the build's (``Predictions.build_peak_bytes``) and the step's
(``Predictions.peak_memory_bytes``: max of forward/backward, ``search/memory.step_peak_bytes``, optimizer
step and build; compiled cases priced with the model's compiled-activation scale, as ``autoshard.compile``
prices GPU plans). Measuring a compiled program needs ``LiveBytes.ignore_compile_internals``:
under any other dispatch mode ``torch.compile`` runs its frames eagerly.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from _harness import run_gloo_cases
from _tiers import sample_list
from _runtime_cases import loss_fn
from autoshard.cluster import Cluster
from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes.compiled_saved import with_compiled_saved_scale
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.live_bytes import LiveBytes
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.search.cost_model import predict
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # spawned gloo ranks

SPEC = "llama:tiny"
MODEL = dict(hidden=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=768, vocab_size=512)  # 3.4M params
BATCH, SEQ, BUCKET = 8, 32, 1 << 20
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
TOLERANCE = 0.05
DP = Mesh(dp_shard=2)
HSDP = Mesh(dp_replicate=2, dp_shard=2)
STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
# (state, micro-batches, compiled) per world size
CASES_2 = [(s, 2, False) for s in STATES] + [(s, 1, True) for s in ("replicate", "zero1", "zero3")]
CASES_4 = [("zero3", 2, False), ("zero1", 2, False), ("zero3", 1, True), ("zero1", 1, True)]
# `make test` (tests/_tiers.py): every state eager on world 2; compiled, ZeRO-1 (gathered once, kept) and
# ZeRO-3 (re-gathered) on world 2; HSDP ZeRO-3 eager. Compiled replicate, HSDP ZeRO-1 eager and HSDP compiled
# (the costliest case of the suite: four ranks compile a 4-layer model; its memory terms are world 2's compiled
# ZeRO-1, its collectives are counted in tests/test_conformance.py) are measured under `make test-full` only
CASES_2 = sample_list(CASES_2, [(s, 2, False) for s in STATES] + [("zero1", 1, True), ("zero3", 1, True)])
CASES_4 = sample_list(CASES_4, [("zero3", 2, False)])


@functools.lru_cache(maxsize=None)
def _graph():
    return capture(build(SPEC, device="meta", **MODEL), seq_lens=(8, 16))


def _plan(state: str, micro_batches: int, mesh: Mesh, graph=None) -> Plan:
    graph = graph or _graph()
    layers = tuple(LayerStrategy(layer=layer.name, state=state) for layer in graph.layers)
    schedule = Schedule(micro_batch=BATCH // mesh.dp // micro_batches, num_micro_batches=micro_batches,
                        bucket_bytes=BUCKET)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=schedule)


def _measure(rank, world_size, state, micro_batches, compiled, mesh, graph):
    """Build, warm up, measure one step (module docstring); bytes on this rank. ``graph`` is the parent's
    capture (``_graph()``): no rank exports the model again."""
    model = build(SPEC, **MODEL)  # weights read from the model: each region's fp32 copy is all the build allocates
    live = LiveBytes()
    with live:
        program = build_program(model, graph, _plan(state, micro_batches, mesh, graph), TRAIN,
                                optimizer=OptimizerConfig(name="adamw"),
                                options=BuildOptions(compile=compiled, backend="aot_eager"))
    build_peak = live.peak
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    phases = {}
    optimizer_step = program.optimizer.step

    def split_step():  # the optimizer step's own peak, from the live bytes it starts with
        phases["backward"] = live.peak
        live.reset_peak()
        norm = optimizer_step()
        phases["optimizer"] = live.peak
        return norm

    with live:
        program.step(program.local_batch(tokens), loss_fn)  # warm-up: compiles
        gc.collect()  # what the warm-up left to the collector is not the measured step's
        live.reset_peak()
        program.optimizer.step = split_step  # an instance attribute over the method, for this step only
        program.step(program.local_batch(tokens), loss_fn)
        del program.optimizer.step
    return {"build": build_peak, **phases, "compiled": program._run is not program.gm}


@functools.lru_cache(maxsize=None)
def _compiled_graph():
    """The graph as ``autoshard.compile`` prices it for a GPU cluster: with the compiled step's activation
    scale (``passes/compiled_saved.py``)."""
    return with_compiled_saved_scale(_graph(), build(SPEC, device="meta", **MODEL), SEQ)


def _predicted(state: str, micro_batches: int, compiled: bool, mesh: Mesh) -> dict[str, float]:
    cluster = Cluster.parse(f"{'h100-sxm' if compiled else 'cpu'}:1x{mesh.world_size}")
    pred = predict(_compiled_graph() if compiled else _graph(), _plan(state, micro_batches, mesh), cluster, TRAIN)
    b = pred.memory_breakdown
    states = b["params"] + b["grads"] + b["optimizer"]
    return {"step": pred.peak_memory_bytes, "build": pred.build_peak_bytes,
            "backward": b["step_peak"],
            "optimizer": states + b["step_grads"] + b["step_transient"]}


def _name(state, micro_batches, compiled):
    return f"{state}_m{micro_batches}_{'compiled' if compiled else 'eager'}"


def _jobs(cases, mesh):
    return {_name(*case): functools.partial(_measure, state=case[0], micro_batches=case[1], compiled=case[2], mesh=mesh,
                                            graph=_graph())
            for case in cases}


@pytest.fixture(scope="module")
def measured2():
    return run_gloo_cases(_jobs(CASES_2, DP), 2, timeout_s=600)


@pytest.fixture(scope="module")
def measured4():
    return run_gloo_cases(_jobs(CASES_4, HSDP), 4, timeout_s=600)


def _errors(results: list[dict], state: str, micro_batches: int, compiled: bool, mesh: Mesh) -> tuple[dict, dict]:
    """(relative error per phase, a readable report). The cost model prices the rank with the largest
    shards: the largest measured bytes of each phase are compared."""
    assert all(r["compiled"] == compiled for r in results)
    pred = _predicted(state, micro_batches, compiled, mesh)
    meas = {key: max(r[key] for r in results) for key in ("build", "backward", "optimizer")}
    meas["step"] = max(meas.values())
    errors = {key: (meas[key] - pred[key]) / pred[key] for key in meas}
    report = {key: f"measured {meas[key] / 2**20:.2f} MiB, predicted {pred[key] / 2**20:.2f} MiB, {errors[key]:+.1%}"
              for key in meas}
    return errors, report


def _check(results: list[dict], case: tuple, mesh: Mesh, keys: tuple[str, ...]) -> None:
    errors, report = _errors(results, *case, mesh)
    for key in keys:
        assert abs(errors[key]) <= TOLERANCE, (key, report)


@pytest.mark.parametrize("state, micro_batches, compiled", CASES_2)
def test_optimizer_step_and_build_memory(measured2, state, micro_batches, compiled):
    case = (state, micro_batches, compiled)
    _check(measured2[_name(*case)], case, DP, ("optimizer", "build"))


@pytest.mark.parametrize("state, micro_batches, compiled", CASES_4)
def test_optimizer_step_and_build_memory_hsdp(measured4, state, micro_batches, compiled):
    case = (state, micro_batches, compiled)
    _check(measured4[_name(*case)], case, HSDP, ("optimizer", "build"))


@pytest.mark.parametrize("state, micro_batches, compiled", CASES_2)
def test_step_peak_memory(measured2, state, micro_batches, compiled):
    case = (state, micro_batches, compiled)
    _check(measured2[_name(*case)], case, DP, ("step",))


@pytest.mark.parametrize("state, micro_batches, compiled", CASES_4)
def test_step_peak_memory_hsdp(measured4, state, micro_batches, compiled):
    case = (state, micro_batches, compiled)
    _check(measured4[_name(*case)], case, HSDP, ("step",))
