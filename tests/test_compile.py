"""``autoshard.compile`` in plan mode: capture + search into a ``Compiled``;
reuse of a saved plan (fingerprints and training step checked, no search);
mismatches refused with ``PlanError``.

Captures are memoised per model object (``_cached_capture``), so each test
pays only for what it checks.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import autoshard
import autoshard.search as search
from autoshard.errors import AutoshardError, PlanError
from autoshard.models import build
from autoshard.plan import Plan
from autoshard.plan_reuse import cluster_of, train_of
from autoshard.train import TrainSpec

capture_module = importlib.import_module("autoshard.passes.capture")  # the package re-exports a function of that name
_REAL_CAPTURE = capture_module.capture
_GRAPHS: dict[tuple, object] = {}
TRAIN = TrainSpec(global_batch=16, seq_len=128)


def _cached_capture(model, example_inputs=None, *, name=None, **options):
    """``capture`` once per (model, input shape); only the recorded name differs between calls."""
    key = (id(model), tuple(example_inputs[0].shape) if example_inputs else None)
    if key not in _GRAPHS:
        _GRAPHS[key] = _REAL_CAPTURE(model, example_inputs, **options)
    return dataclasses.replace(_GRAPHS[key], model_name=name or type(model).__name__)


@pytest.fixture(autouse=True)
def _memoised_capture(monkeypatch):
    monkeypatch.setattr(capture_module, "capture", _cached_capture)


@pytest.fixture(scope="module")
def gpt():
    return build("gpt:tiny", device="meta")


@pytest.fixture(scope="module")
def compiled(gpt):
    return autoshard.compile(gpt, "h100-sxm:1x8", train=TRAIN, name="gpt:tiny", time_limit_s=20)


@pytest.fixture
def no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a reused plan must not be searched")

    monkeypatch.setattr(search, "solve", refuse)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_plan_mode_captures_and_searches(compiled):
    assert isinstance(compiled, autoshard.Compiled) and compiled.program is None
    assert compiled.train == TRAIN and compiled.cluster.world_size == 8
    assert compiled.plan.model_name == "gpt:tiny" == compiled.graph.model_name
    assert compiled.plan.fingerprints.model == compiled.graph.fingerprint()
    assert [s.layer for s in compiled.plan.layers] == [layer.name for layer in compiled.graph.layers]
    assert (compiled.plan.global_batch, compiled.plan.seq_len) == (16, 128)
    assert str(compiled) == str(compiled.plan)


@pytest.mark.slow
def test_default_train_is_the_example_inputs_shape(gpt):
    tokens = torch.zeros(4, 32, dtype=torch.long, device="meta")
    result = autoshard.compile(gpt, autoshard.Cluster.preset("h100-sxm", devices_per_node=2), example_inputs=(tokens,))
    assert result.train == TrainSpec(global_batch=4, seq_len=32)
    assert result.plan.model_name == "GPTModel"  # no name: the class name


@pytest.mark.slow
def test_saved_plan_is_reused_without_search(gpt, compiled, tmp_path, no_search):
    path = compiled.plan.save(tmp_path / "plan.json")
    for given in (str(path), path, Plan.load(path)):
        reused = autoshard.compile(gpt, "h100-sxm:1x8", plan=given, name="gpt:tiny")
        assert reused.plan == compiled.plan
        assert reused.train == train_of(compiled.plan)  # the plan's step, not the example inputs'
    assert autoshard.compile(gpt, "h100-sxm:1x8", plan=path, train=TRAIN, name="gpt:tiny").plan == compiled.plan


@pytest.mark.slow
def test_mismatched_plan_is_refused(gpt, compiled, tmp_path, no_search):
    path = compiled.plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=r"plan.json: plan does not match cluster .*'nodes': plan has 1, cluster has 2"):
        autoshard.compile(gpt, "h100-sxm:2x8", plan=path, name="gpt:tiny")
    with pytest.raises(PlanError, match=r"does not match model 'GPTModel'"):
        autoshard.compile(gpt, "h100-sxm:1x8", plan=path)  # another name: another model fingerprint
    llama = build("llama:tiny", device="meta")
    with pytest.raises(PlanError, match=r"does not match model 'gpt:tiny': layer"):
        autoshard.compile(llama, "h100-sxm:1x8", plan=path, name="gpt:tiny")
    with pytest.raises(PlanError, match=r"global_batch=16 .* 32"):
        autoshard.compile(gpt, "h100-sxm:1x8", plan=path, train=TrainSpec(global_batch=32, seq_len=128), name="gpt:tiny")
    with pytest.raises(PlanError, match=r"plan=42: expected an autoshard.Plan"):
        autoshard.compile(gpt, "h100-sxm:1x8", plan=42)
    with pytest.raises(AutoshardError, match=r"cluster=8: expected an autoshard.Cluster"):
        autoshard.compile(gpt, 8)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_recorded_cluster_rebuilds_with_the_same_fingerprint(compiled):
    rebuilt = cluster_of(compiled.plan)
    assert rebuilt.fingerprint() == compiled.cluster.fingerprint()
    compiled.plan.check_compatible(graph=compiled.graph, cluster=rebuilt)


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_under_a_process_group_every_rank_builds_its_program(gpt, compiled, monkeypatch, no_search):
    import torch.distributed as dist

    calls = []
    runtime = importlib.import_module("autoshard.runtime")
    monkeypatch.setattr(runtime, "build_program", lambda *args, **kwargs: calls.append((args, kwargs)) or "program",
                        raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = autoshard.compile(gpt, "h100-sxm:1x8", plan=compiled.plan, name="gpt:tiny")
    finally:
        dist.destroy_process_group()
    assert result.program == "program"
    # gloo: the program lives on the CPU (an NCCL group would put it on the rank's current CUDA device)
    # a model holding data is read, then released to the meta device (runtime/materialize.py)
    assert calls == [((gpt, result.graph, compiled.plan, result.train),
                      {"device": "cpu", "weights": None, "options": runtime.BuildOptions(release_model=True)})]
