"""Smoke test of ``make demo`` (``autoshard/demo.py``): every stage, 2 PPO steps on 2 CPU ranks via torchrun."""

from __future__ import annotations

import pytest

from autoshard import demo
from autoshard.runtime.metrics import read_metrics

pytestmark = pytest.mark.slow  # subprocess runs


def test_demo_runs_both_steps_on_two_ranks(tmp_path, capfd):
    code = demo.main(["--steps", "2", "--out", str(tmp_path)])
    out, err = capfd.readouterr()
    assert code == 0, out + err[-4000:]  # 1 would mean the single-process fallback ran
    for heading in ("1. capture llama:7b", "2. plan llama:7b", "3. train llama:tiny", "4. result"):
        assert heading in out
    assert "starting 2 ranks\n" in out  # torchrun's command line only with --debug
    assert "reward " in out.split("4. result")[1] and f"metrics: {tmp_path / 'metrics.jsonl'}" in out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1.0, 2.0]
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)
    curves = tmp_path / "curves.png"
    assert curves.stat().st_size > 0
    assert f"training curves: {curves}" in out
    assert "falling back" not in out


def test_demo_says_so_when_it_falls_back_to_one_process(tmp_path, capfd, monkeypatch):
    import autoshard.cli

    monkeypatch.setattr(autoshard.cli, "main", lambda argv: 1)  # the sharded run "failed"
    code = demo.main(["--steps", "2", "--out", str(tmp_path), "--skip-plan"])
    out = capfd.readouterr().out
    assert code == 1
    assert "falling back to the single-process reference run" in out and "NOT the sharded runtime" in out
    assert [row["step"] for row in read_metrics(tmp_path / "metrics_single_process.jsonl")] == [1.0, 2.0]
    assert (tmp_path / "curves_single_process.png").stat().st_size > 0
