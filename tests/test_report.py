"""``autoshard report`` and ``autoshard plot``: the laid-out step against the cost model, the Chrome trace's
schema, the HTML page's elements, a measured trace, the CLI, and the plot's title and smoothing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.plan_reuse import train_of
from autoshard.report import build_report, chrome_trace, classify, load_measured
from autoshard.report_html import render_html
from autoshard.report_model import STREAMS, lay_out_step, rank_op_order, simulate
from autoshard.search import Constraints, solve
from autoshard.search.cost_model import predict
from autoshard.train import TrainSpec

CLUSTER = "h100-sxm:1x8"


@pytest.fixture(scope="module")
def graph():
    from autoshard.cli_search import capture_spec

    return capture_spec("llama:tiny")


def _plan(graph, mesh, micro_batch):
    cluster = Cluster.load(CLUSTER)
    train = TrainSpec(global_batch=32, seq_len=128, micro_batch=micro_batch)
    plan = solve(graph, cluster, train, constraints=Constraints(mesh=mesh), time_limit_s=5)
    return plan, cluster, train_of(plan)


@pytest.fixture(scope="module")
def pipelined(graph):
    """tp=2, pp=2, dp=2 with 1F1B over 8 micro-batches."""
    return _plan(graph, {"pp": 2, "tp": 2}, 2)


@pytest.fixture(scope="module")
def one_stage(graph):
    return _plan(graph, {"pp": 1}, None)


@pytest.mark.parametrize("fixture", ["one_stage", "pipelined"])
@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_memory_timeline_peaks_are_the_predictions(request, graph, fixture):
    plan, cluster, train = request.getfixturevalue(fixture)
    layout = lay_out_step(graph, plan, cluster, train)
    predicted = predict(graph, plan, cluster, train).memory_by_stage
    assert len(layout.ranks) == plan.mesh.pp
    for rank in layout.ranks:
        assert rank.peak_bytes <= predicted[rank.rank] * (1 + 1e-9)
        assert rank.peak_bytes == pytest.approx(predicted[rank.rank], rel=1e-6)  # 1F1B: the ordered timeline too
        assert all(s.total >= 0 and len(s.bytes_by_kind) == 5 for s in rank.memory)


@pytest.mark.parametrize("fixture", ["one_stage", "pipelined"])
def test_timeline_sums_to_the_cost_model_terms(request, graph, fixture):
    from autoshard.search.cost_model import plan_layer_costs

    plan, cluster, train = request.getfixturevalue(fixture)
    layout = lay_out_step(graph, plan, cluster, train)
    costs = dict(zip((layer.name for layer in graph.layers), plan_layer_costs(graph, plan, cluster, train)))
    m = plan.schedule.num_micro_batches
    stage_of = {s.layer: s.stage for s in plan.layers}
    for rank in layout.ranks:
        mine = [c for name, c in costs.items() if stage_of[name] in rank.stages]
        work = sum(s.dur_s for s in rank.spans if s.category in ("forward", "backward", "tp comm"))
        assert work == pytest.approx(m * sum(c.fwd_s + c.bwd_s for c in mine), rel=1e-9)
        dp = sum(s.dur_s for s in rank.spans if s.stream == "dp comm")
        assert dp == pytest.approx(sum(c.comm_total_s for c in mine), rel=1e-9, abs=1e-15)
        optimizer = sum(s.dur_s for s in rank.spans if s.category == "optimizer")
        assert optimizer == pytest.approx(sum(c.optimizer_s for c in mine), rel=1e-9)
        by_stream = {}
        for span in sorted(rank.spans, key=lambda s: (s.stream, s.start_s)):  # no overlap within a stream
            assert span.start_s >= by_stream.get(span.stream, 0.0) - 1e-12 and span.dur_s >= 0
            by_stream[span.stream] = span.end_s
    # laid out at each rank's own stage time: never after the prediction, and near it
    assert layout.step_s <= plan.predictions.step_time_s * (1 + 1e-9)
    assert layout.step_s >= 0.7 * plan.predictions.step_time_s


def test_one_stage_step_equals_the_prediction(graph, one_stage):
    plan, cluster, train = one_stage
    layout = lay_out_step(graph, plan, cluster, train)
    assert layout.step_s == pytest.approx(predict(graph, plan, cluster, train).step_time_s, rel=1e-9)
    assert not [s for s in layout.ranks[0].spans if s.category == "bubble"]


@pytest.mark.parametrize("name,pp,v,m", [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("interleaved_1f1b", 2, 2, 4),
                                         ("interleaved_1f1b", 4, 2, 6), ("1f1b", 1, 1, 3)])
def test_schedules_run_every_op_once_and_bubble_as_narayanan(name, pp, v, m):
    orders = [rank_op_order(name, pp, v, m, k) for k in range(pp)]
    stages = pp * v
    assert sorted(op for order in orders for op in order) == sorted(
        (kind, s, j) for kind in "FB" for s in range(stages) for j in range(m))
    times = simulate({(kind, s): 1.0 / v for kind in "FB" for s in range(stages)}, orders, stages)
    makespan = max(end for _, end in times.values())
    if v == 1:  # balanced stages of F = B = 1: (m + p − 1)·(F + B)
        assert makespan == pytest.approx(2 * (m + pp - 1))


def test_chrome_trace_schema(graph, pipelined):
    plan, cluster, train = pipelined
    layout = lay_out_step(graph, plan, cluster, train)
    trace = json.loads(json.dumps(chrome_trace(layout, plan)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(r.spans) for r in layout.ranks)
    for event in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= event.keys()
        assert event["pid"] in range(plan.mesh.pp) and event["tid"] in range(len(STREAMS))
        assert event["ts"] >= 0 and event["dur"] >= 0
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(set(names.values())) == sorted(STREAMS)
    end_us = max(e["ts"] + e["dur"] for e in complete)
    assert end_us == pytest.approx(layout.step_s * 1e6, rel=1e-9)
    assert trace["otherData"]["predicted_step_s"] == plan.predictions.step_time_s


def test_html_has_a_cell_per_layer_and_memory_series(graph, pipelined):
    plan, cluster, train = pipelined
    page = render_html(build_report(plan, graph, cluster, train))
    assert page.count('class="layer"') == len(graph.layers)
    assert page.count('class="memory-rank"') == plan.mesh.pp
    assert page.count('class="mem-area"') == 5 * plan.mesh.pp
    assert "<script" not in page and "http://" not in page and "https://" not in page


def test_measured_trace_beside_the_prediction(graph, one_stage, tmp_path):
    plan, cluster, train = one_stage
    events = [{"name": "aten::mm", "cat": "cpu_op", "ph": "X", "ts": 1000.0, "dur": 500.0, "pid": 7, "tid": 1},
              {"name": "autoshard::all_reduce", "cat": "user_annotation", "ph": "X", "ts": 1500.0, "dur": 250.0,
               "pid": 7, "tid": 1},
              {"name": "ProfilerStep", "ph": "i", "ts": 900.0, "pid": 7, "tid": 1}]
    path = tmp_path / "rank0.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    measured = load_measured([path])
    assert measured.event_count == 2 and measured.end_s - measured.start_s == pytest.approx(750e-6)
    assert dict(measured.seconds_by_category()) == pytest.approx(
        {"compute": 500e-6, "communication": 250e-6, "other": 0.0})
    page = render_html(build_report(plan, graph, cluster, train, measured))
    assert page.count('class="measured-span"') == 2
    assert classify("ncclKernel_AllReduce_RING", "kernel") == "communication"


@pytest.mark.slow
def test_cli_report_writes_page_and_trace(tmp_path, capsys):
    plan_path, html, trace = tmp_path / "p.json", tmp_path / "out" / "p.html", tmp_path / "p.trace.json"
    assert main(["plan", "llama:tiny", "--cluster", CLUSTER, "--batch", "16", "--seq", "64", "--time-limit", "5",
                 "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["report", str(plan_path), "-o", str(html), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "report written to" in out and html.stat().st_size > 10_000
    assert all(e["ph"] in ("X", "M") for e in json.loads(trace.read_text())["traceEvents"])


def test_cli_report_refusals_are_one_line(tmp_path, capsys):
    bad = tmp_path / "t.json"
    bad.write_text('{"traceEvents": []}')
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json"), "-o", "/dev/full"]) == 2
    assert "cannot write report file" in capsys.readouterr().err


def test_plot_title_smoothing_and_band(tmp_path):
    from autoshard.runtime.plot import ema, min_max_band, plot_main, run_title
    from autoshard.runtime.metrics import write_run_info

    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    smoothed = ema([0.0, 10.0, float("nan"), 10.0], 0.5)
    assert smoothed[1] == pytest.approx(10 * 0.5 / 0.75) and smoothed[2] == smoothed[1]
    assert ema([3.0, 5.0], 0.0) == [3.0, 5.0]
    low, high = min_max_band([1.0, 5.0, 2.0, 8.0], 0.5)  # window 2 → ±1
    assert low == [1.0, 1.0, 2.0, 2.0] and high == [5.0, 5.0, 8.0, 8.0]
    metrics = tmp_path / "run.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "reward/mean": math.sin(i)}) + "\n" for i in range(1, 30)))
    assert run_title(metrics) == "run.jsonl"
    write_run_info(metrics, {"model": "llama:tiny", "task": "arithmetic", "world_size": 2,
                             "mesh": "dp_shard=2", "precision": "fp32"})
    assert run_title(metrics) == "llama:tiny · arithmetic · 2 ranks (dp_shard=2) · fp32"
    assert plot_main([str(metrics), "-o", str(tmp_path / "c.png"), "--smooth", "0.8"]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_cli_plot_refuses_a_bad_smooth(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "reward/mean": 0.5}\n')
    assert main(["plot", str(metrics), "--smooth", "1.5"]) == 2
    assert "--smooth 1.5" in capsys.readouterr().err


def test_profile_program_records_the_second_step_only(tmp_path):
    """``autoshard run --profile DIR``'s wrapper: call 2 is traced to DIR/step.rank<R>.trace.json, others run plain."""
    from autoshard.runtime.step_profile import profile_program

    class Program:
        def __init__(self):
            self.calls = []

        def step(self, batch):
            self.calls.append(batch)
            return (torch.ones(4) * batch).sum()

    program = profile_program(Program(), tmp_path, rank=3)
    path = tmp_path / "step.rank3.trace.json"
    assert float(program.step(1)) == 4.0 and not path.exists()
    assert float(program.step(2)) == 8.0 and path.exists()
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    path.unlink()
    assert float(program.step(3)) == 12.0 and not path.exists()
    assert program.calls == [1, 2, 3]
