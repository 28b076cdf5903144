"""Pipeline stages compiled (``BuildOptions(compile=True)`` with pp > 1) train as the eager pipeline.

The 4-block tiny Llama of ``test_runtime_pp.py`` (fp32, 3 SGD steps of 2 micro-batches, clipping
on), each plan eager and compiled in the same gloo job (two jobs in all); every rank's losses,
trained local shards and an inference ``forward`` (another shape than training, without autograd)
must agree at rtol 1e-5. World 2 (pp=2): GPipe, 1F1B and interleaved 1F1B (2 virtual stages per
rank) through ``aot_eager`` (the joint graph and its partition, no code generation); 1F1B through
inductor (each stage one graph, no ``forward``: C++ builds are slow); 1F1B with a model returning a
dict, eager and ``aot_eager`` (stages return flat tuples, ``passes/split_pipeline.py``). World 4
(pp=2 × dp_shard=2, ZeRO-3 layers, 1F1B): the stage graphs are recorded (AOT autograd with
inductor's partitioner, run eager) and hold the ZeRO-3 gathers, re-gathers and reduce-scatters.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from _harness import run_gloo_cases
from _tiers import FULL
from _runtime_cases import RecordGraphs, functional_ops
from test_runtime_pp import BATCH, OPT, SEQ, _batches, _graph, _model, loss_fn, make_plan
from autoshard.models.transformer import LlamaModel
from autoshard.passes._zero3 import Zero3Gather
from autoshard.plan import Mesh
from autoshard.runtime import BuildOptions, build_program
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # spawned gloo ranks

# inductor's CPU backend compiles C++ (the inductor case)
HAS_CXX = any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))

# name: (mesh, schedule, virtual stages, strategy fields, compiled backends); each plan also runs eager
CASES_2 = {
    "gpipe": (Mesh(pp=2), "gpipe", 1, {}, ("aot_eager",)),
    "1f1b": (Mesh(pp=2), "1f1b", 1, {}, ("aot_eager", "inductor", "eager_dict", "aot_eager_dict")),
    "interleaved_1f1b": (Mesh(pp=2), "interleaved_1f1b", 2, {}, ("aot_eager",)),
}
# `make test` (tests/_tiers.py): 1F1B compiled with dict outputs (the tuple-output 1F1B runs the same stage
# code with fewer outputs to flatten) and interleaved 1F1B (two stages a rank); GPipe differs only in
# torch.distributed.pipelining's schedule, inductor's stage code generation is `make test-full`'s
# (tests/test_compile_numerics.py compiles with inductor), and eager dict outputs run in
# tests/test_pipeline_user_models.py
CI_RUNS = {("1f1b", "aot_eager_dict"), ("interleaved_1f1b", "aot_eager")}
if not FULL:
    CASES_2 = {name: (*case[:-1], tuple(b for b in case[-1] if (name, b) in CI_RUNS))
               for name, case in CASES_2.items() if any(run[0] == name for run in CI_RUNS)}
CASES_4 = {
    "pp2_dp2_zero3_1f1b": (Mesh(pp=2, dp_shard=2), "1f1b", 1, {"state": "zero3"}, ("record",)),
}


class _DictOutputs(LlamaModel):
    """The same model returning ``{"logits", "values"}`` (a dict out of the last stage)."""

    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return {"logits": logits, "values": values}


def _model_of(dict_outputs: bool):
    model = _model()
    if dict_outputs:
        model.__class__ = _DictOutputs
    return model


def _dict_loss(out, tokens):
    return loss_fn((out["logits"], out["values"]), tokens)


def train_case(rank, world_size, plan, graph, backend=None):
    """Build (eager when ``backend`` is None), train; losses, local shards, an inference forward.

    Inductor (C++ code generation, the slow case) compiles each stage as one graph and skips the forward.
    """
    record = RecordGraphs() if backend == "record" else None
    dict_outputs = backend is not None and backend.endswith("_dict")
    backend = backend and backend.removesuffix("_dict")
    options = BuildOptions() if backend in (None, "eager") else BuildOptions(
        compile=True, backend=record.backend if record else backend, regions="graph" if backend == "inductor" else "stem")
    program = build_program(_model_of(dict_outputs), graph, plan,
                            TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT, options=options)
    before = ()
    if backend != "inductor":
        probe = _batches()[0][:2, :6]  # another shape than training (and no autograd): another compiled graph
        before = program.forward(probe)
        if dict_outputs:
            assert set(before) == {"logits", "values"}
            before = (before["logits"], before["values"])
    loss = _dict_loss if dict_outputs else loss_fn
    losses = [program.step(program.local_batch(toks), loss).loss for toks in _batches()]
    out = {"losses": losses, "shards": program.local_state_dict(), "forward": tuple(t.detach() for t in before),
           "compiled": [w.run[0] is not w.stage for w in program.pipeline.stages.values()],
           "hooks": program.regather is not None}
    if record is not None:
        out["graphs"] = {"forward": functional_ops(record.forward), "backward": functional_ops(record.backward),
                         "layers": sum(isinstance(m, Zero3Gather) for m in program.gm.modules()),
                         "embed": "embed.weight" in program.param_placements}
    return out


def _jobs(cases):
    jobs = {}
    for name, (mesh, sched, v, fields, backends) in cases.items():
        plan = make_plan(mesh, sched, v, **fields)
        jobs[f"{name}_eager"] = functools.partial(train_case, plan=plan, graph=_graph())  # not captured per rank
        for backend in backends:
            if backend != "inductor" or HAS_CXX:
                jobs[f"{name}_{backend}"] = functools.partial(train_case, plan=plan, graph=_graph(), backend=backend)
    return jobs


@pytest.fixture(scope="module")
def results2():
    return run_gloo_cases(_jobs(CASES_2), 2, timeout_s=600)


@pytest.fixture(scope="module")
def results4():
    return run_gloo_cases(_jobs(CASES_4), 4, timeout_s=600)


def _check(results, name, backend):
    if f"{name}_{backend}" not in results:
        pytest.skip("torch.compile's CPU backend needs a C++ compiler")
    for compiled, eager in zip(results[f"{name}_{backend}"], results[f"{name}_eager"], strict=True):
        assert compiled["compiled"] and all(compiled["compiled"]) == (not backend.startswith("eager"))
        assert not any(eager["compiled"])
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6)
        for got, want in zip(compiled["forward"], eager["forward"][:len(compiled["forward"])], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert set(compiled["shards"]) == set(eager["shards"])
        for fqn, want in eager["shards"].items():
            torch.testing.assert_close(compiled["shards"][fqn], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn: f"{name} {fqn}: {m}")


@pytest.mark.parametrize("name, backend", [(n, b) for n, case in CASES_2.items() for b in case[-1]])
def test_compiled_stages_train_as_eager_world2(results2, name, backend):
    _check(results2, name, backend)


@pytest.mark.parametrize("name, backend", [(n, b) for n, case in CASES_4.items() for b in case[-1]])
def test_compiled_stages_train_as_eager_world4(results4, name, backend):
    _check(results4, name, backend)


def test_zero3_stage_gathers_are_graph_nodes(results4):
    """Per ZeRO-3 layer of a rank's stage: a gather in its training and its inference forward graphs, a
    reduce-scatter and (but the embedding's: its backward needs no weight) a re-gather in its backward
    graph. The eager program has re-gather hooks, the compiled one none."""
    for eager, compiled in zip(results4["pp2_dp2_zero3_1f1b_eager"], results4["pp2_dp2_zero3_1f1b_record"]):
        assert eager["hooks"] and not compiled["hooks"]
        graphs, layers = compiled["graphs"], compiled["graphs"]["layers"]
        assert layers > 0
        assert graphs["forward"].get("all_gather_into_tensor") == 2 * layers
        assert graphs["backward"].get("reduce_scatter_tensor") == layers
        assert graphs["backward"].get("all_gather_into_tensor") == layers - graphs["embed"]
