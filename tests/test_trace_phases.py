"""``benchmarks/trace_phases.py``: per-phase device and host time from a ``--profile`` trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import trace_phases  # noqa: E402
from autoshard.runtime.metrics import PhaseTimer  # noqa: E402


def test_device_kernels_are_split_by_phase_into_compute_collectives_and_idle():
    events = [
        {"ph": "X", "name": "ppo::score", "ts": 0, "dur": 100, "tid": 1, "cat": "user_annotation"},
        {"ph": "X", "name": "ppo::train", "ts": 100, "dur": 50, "tid": 1, "cat": "user_annotation"},
        {"ph": "X", "name": "ampere_gemm", "ts": 10, "dur": 30, "cat": "kernel"},
        {"ph": "X", "name": "ncclDevKernel_AllGather", "ts": 20, "dur": 40, "cat": "kernel"},  # overlaps the gemm
        {"ph": "X", "name": "elementwise", "ts": 110, "dur": 10, "cat": "kernel"},
        {"ph": "X", "name": "aten::mm", "ts": 5, "dur": 7, "tid": 1, "cat": "cpu_op"},
        {"ph": "X", "name": "aten::mm", "ts": 50, "dur": 3, "tid": 1, "cat": "cpu_op"},
    ]
    out = trace_phases.summarize(events)
    assert list(out) == ["score", "train"]
    score, train = out["score"], out["train"]
    assert (score["kernels"], score["compute_us"], score["collective_us"]) == (2, 30, 40)
    assert score["idle_us"] == 100 - 50  # kernels cover [10, 60)
    assert score["cpu_ops"] == {"aten::mm": 10}
    assert (train["kernels"], train["idle_us"]) == (1, 40)


def test_a_cpu_trace_of_the_phase_timer_names_its_phases_and_operators(tmp_path):
    timer = PhaseTimer()
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with timer.phase("logprobs"):
            (a @ a).sum()
        with timer.phase("train"):
            torch.relu(a).mean()
    path = tmp_path / "run.rank0.trace.json"
    prof.export_chrome_trace(str(path))
    out = trace_phases.summarize(trace_phases.load_trace(path))
    assert set(out) == {"logprobs", "train"}
    assert any("mm" in op for op in out["logprobs"]["cpu_ops"]) and out["logprobs"]["kernels"] == 0
    assert trace_phases.main([str(path), "--json", str(tmp_path / "p.json")]) == 0
    assert set(json.loads((tmp_path / "p.json").read_text())[str(path)]) == {"logprobs", "train"}
