"""``autoshard plan`` on a GPU cluster prices compiled plans as the runtime compiles them: it traces the
model's compiled-activation scale (``cli_search.with_compiled_activations``, at most
``COMPILED_SCALE_BLOCKS`` blocks), so the plan's predictions carry no "compiled activations not
measured" caveat and the same memory ``autoshard.compile`` would predict; CPU clusters run eager and
trace nothing."""

from __future__ import annotations

import json

import pytest
import torch

from autoshard import cli_search
from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.models import build
from autoshard.passes.capture import capture_reference
from autoshard.passes.compiled_saved import with_compiled_saved_scale
from autoshard.plan import Plan
from autoshard.search.cost_model import predict
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # every case runs for seconds

ARGS = ("--batch", "16", "--seq", "128")


def _caveats(path) -> list[str]:
    return json.loads(path.read_text())["predictions"]["caveats"]


def test_gpu_plan_measures_compiled_activations(capsys, tmp_path, monkeypatch):
    traced = []
    original = cli_search.with_compiled_activations

    def spy(spec, graph, cluster, train, stages):
        out = original(spec, graph, cluster, train, stages)
        traced.append(out.compiled_saved_scale)
        return out

    monkeypatch.setattr(cli_search, "with_compiled_activations", spy)
    gpu, cpu = tmp_path / "gpu.json", tmp_path / "cpu.json"
    assert main(["plan", "llama:tiny", "--cluster", "h100-sxm:1x2", *ARGS, "-o", str(gpu)]) == 0
    assert main(["plan", "llama:tiny", "--cluster", "cpu:1x2", *ARGS, "-o", str(cpu)]) == 0
    capsys.readouterr()
    assert traced[0] is not None and 0.3 < traced[0] < 1.0 and traced[1] is None
    assert not any("compiled activations" in c for c in _caveats(gpu))

    # the printed memory is predict's with the whole model's scale (the traced blocks stand for all)
    plan = Plan.load(gpu)
    graph = capture_reference("llama:tiny")
    whole = with_compiled_saved_scale(graph, build("llama:tiny", device="meta", dtype=torch.bfloat16), 128)
    expected = predict(whole, plan, Cluster.load("h100-sxm:1x2"), TrainSpec(global_batch=16, seq_len=128))
    assert json.loads(gpu.read_text())["predictions"]["peak_memory_bytes"] == expected.peak_memory_bytes


def test_deep_models_trace_a_few_blocks_that_stand_for_all(monkeypatch):
    import io

    from rich.console import Console

    import autoshard.models as models

    calls = {}
    original = models.build

    def counting_build(spec, **kwargs):
        calls.update(kwargs)
        return original(spec, **kwargs)

    monkeypatch.setattr(models, "build", counting_build)
    graph = capture_reference("llama:125m", seq_lens=(16, 32))
    with cli_search.Stages(Console(file=io.StringIO())) as stages:
        out = cli_search.with_compiled_activations("llama:125m", graph, Cluster.load("h100-sxm:1x2"),
                                                   TrainSpec(global_batch=2, seq_len=32), stages)
    assert calls.get("num_layers") == cli_search.COMPILED_SCALE_BLOCKS < 12
    whole = with_compiled_saved_scale(graph, original("llama:125m", device="meta", dtype=torch.bfloat16), 32)
    assert abs(out.compiled_saved_scale - whole.compiled_saved_scale) < 0.02, (out.compiled_saved_scale,
                                                                                whole.compiled_saved_scale)


def test_scale_is_traced_once_per_structure_and_shape(monkeypatch):
    """A second model of the same structure and shapes reads the first's scale; another sequence length, or
    the cache turned off, traces again (here into a ``torch.compile`` that fails, so a trace is seen)."""
    from autoshard.errors import CaptureError
    from autoshard.passes import compiled_saved

    graph = capture_reference("gpt:tiny", seq_lens=(8, 16))
    first = compiled_saved.compiled_saved_scale(build("gpt:tiny", device="meta"), graph, 16)

    def no_trace(*args, **kwargs):
        raise RuntimeError("traced again")

    monkeypatch.setattr(torch, "compile", no_trace)
    assert compiled_saved.compiled_saved_scale(build("gpt:tiny", device="meta"), graph, 16) == first
    with pytest.raises(CaptureError, match="traced again"):
        compiled_saved.compiled_saved_scale(build("gpt:tiny", device="meta"), graph, 32)
    monkeypatch.setenv("AUTOSHARD_EXPORT_CACHE", "0")
    with pytest.raises(CaptureError, match="traced again"):
        compiled_saved.compiled_saved_scale(build("gpt:tiny", device="meta"), graph, 16)
