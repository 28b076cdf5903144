"""Readable comparisons: ``diff`` shows every field that differs with units and ratios B/A; ``explain``
shows the non-zero cost terms by group and says in words why each alternative lost; the plan header says
what the schedule means; the memory line wraps only between items; ``--help`` has the notation legend."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from autoshard.cli import main
from autoshard.cli_search import capture_spec
from autoshard.cluster import Cluster
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule
from autoshard.plan_format import NOTATION_LEGEND, describe_schedule
from autoshard.search import Constraints, diff_plans, explain_layer, format_diff, format_explanation, solve
from autoshard.train import TrainSpec

GiB = 2**30


def _text(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True)
    console.print(renderable)
    return console.export_text()


def _plan(batch: int, **predictions) -> Plan:
    layers = (LayerStrategy("embed"), LayerStrategy("blocks.0.mlp", state="zero2", grad_comm="int4"))
    values = dict(step_time_s=0.0785816, peak_memory_bytes=int(7.85816e10), tokens_per_s=52_000.0,
                  memory_breakdown={"params": 2 * GiB}) | predictions
    return Plan("llama:tiny", Mesh(dp_shard=8), layers, Schedule(micro_batch=2, num_micro_batches=batch // 16),
                Predictions(**values), global_batch=batch, seq_len=128)


def test_diff_shows_the_training_step_and_predictions_with_units():
    a, b = _plan(64), _plan(256, step_time_s=0.25, peak_memory_bytes=int(9.1e10), tokens_per_s=130_000.0)
    diff = diff_plans(a, b)
    assert ("global_batch", 64, 256) in diff.train and ("num_micro_batches", 4, 16) in diff.schedule
    text = _text(format_diff(diff))
    assert "training step: global_batch 64 → 256 (×4)" in text
    assert "num_micro_batches 4 → 16 (×4)" in text
    for needle in ("step time", "78.6 ms", "250 ms", "×3.18", "73.18 GiB", "84.75 GiB", "52,000 tokens/s",
                   "130,000 tokens/s", "×2.5"):
        assert needle in text, needle
    assert "e+10" not in text and "7.85816" not in text  # no raw floats


def test_diff_lists_cluster_precision_layers_and_identity():
    a = _plan(64)
    b = dataclasses.replace(a, precision="fp32", layers=(a.layers[0], dataclasses.replace(a.layers[1], state="zero3")))
    text = _text(format_diff(diff_plans(a, b)))
    assert "precision bf16 → fp32" in text and "state: zero2 → zero3" in text
    one = Plan.from_dict({**a.to_dict(), "fingerprints": {**a.to_dict()["fingerprints"],
                                                          "cluster_spec": {"device": {"memory_bytes": 80 * GiB}}}})
    two = Plan.from_dict({**a.to_dict(), "fingerprints": {**a.to_dict()["fingerprints"],
                                                          "cluster_spec": {"device": {"memory_bytes": 40 * GiB}}}})
    assert "cluster: device.memory_bytes 80.00 GiB → 40.00 GiB (×0.5)" in _text(format_diff(diff_plans(one, two)))
    same = _text(format_diff(diff_plans(a, a)))
    assert "plans make the same decisions" in same and "predictions: identical" in same


def test_schedule_in_words():
    assert describe_schedule(_plan(64)) == "no pipeline: 4 micro-batches of 2 sequences accumulated per step"
    one = dataclasses.replace(_plan(16), schedule=Schedule(micro_batch=2, num_micro_batches=1))
    assert describe_schedule(one) == "no pipeline: one batch of 2 sequences per step"
    piped = dataclasses.replace(_plan(64), mesh=Mesh(dp_shard=2, pp=4),
                                schedule=Schedule("interleaved_1f1b", 2, 8, virtual_stages=2))
    assert describe_schedule(piped) == ("interleaved_1f1b pipeline over 4 stages, 8 micro-batches of 2 sequences, "
                                        "2 virtual stages per rank")
    assert "1f1b m=4" not in str(_plan(64))


def test_memory_line_wraps_between_items_only():
    from autoshard.plan_format import format_bytes

    breakdown = {f"component_{i}": (i + 1) * 3 * 2**20 for i in range(12)}
    plan = _plan(64, memory_breakdown=breakdown, memory_by_stage=(int(7.85816e10),))
    for width in (60, 80, 100):
        lines = _text(plan.to_rich(), width).splitlines()
        for key, value in breakdown.items():  # every item whole on one line: no unit cut from its number
            line = next(line for line in lines if f"{key} " in line)
            assert f"{key} {format_bytes(value)}" in line, (width, line)
        assert max(len(line.rstrip()) for line in lines[:6]) <= width


@pytest.fixture(scope="module")
def explained():
    graph, cluster = capture_spec("llama:tiny"), Cluster.parse("h100-sxm:1x8")
    train = TrainSpec(global_batch=64, seq_len=128)
    plan = solve(graph, cluster, train, constraints=Constraints(mesh={"pp": 1}), time_limit_s=20)
    return plan, graph, cluster, dataclasses.replace(train, micro_batch=plan.schedule.micro_batch)


def test_explain_groups_nonzero_terms_and_says_why(explained):
    plan, graph, cluster, train = explained
    expl = explain_layer(plan, graph, cluster, train, "blocks.0.mlp", k=20)
    text = _text(format_explanation(expl))
    for group in ("compute (per micro-batch)", "data-parallel communication (per step)", "optimizer (per step)",
                  "memory per rank (this layer)"):
        assert group in text, group
    assert "tp_fwd_s" not in text and "TP/SP forward" not in text  # zero terms are left out (tp = 1)
    fitting = [a for a in expl.alternatives if a.over_memory_bytes == 0]
    assert fitting and all(a.reason.startswith("+") or "ties" in a.reason for a in fitting)
    assert any("exposed" in a.reason and " on " in a.reason for a in fitting)  # the collective and its link
    assert any("recompute" in a.reason for a in fitting if a.strategy.recompute != "none")
    assert all(a.reason != f"slower by {a.delta_s}" for a in fitting)
    alternatives = explain_layer(plan, graph, cluster, train, "blocks.0.attn", k=100).alternatives
    smallest = min(a.peak_memory_bytes for a in alternatives)  # as evaluate counts it: the others exceed it
    tight = Constraints(max_memory_bytes=int(smallest) + 1, memory_headroom=0.0)
    over = explain_layer(plan, graph, cluster, train, "blocks.0.attn", k=100, constraints=tight).alternatives
    needs = [a.reason for a in over if a.over_memory_bytes > 0]
    assert needs and all(r.startswith("needs ") and " > " in r and r.endswith("usable") for r in needs)


@pytest.mark.parametrize("command", ["plan", "explain", "inspect"])
def test_help_has_the_notation_legend(capsys, command):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "strategy notation" in out and "R(sel)" in out and "Z2·qG4" in out and "qG4" in NOTATION_LEGEND
