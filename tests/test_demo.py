"""Smoke test of ``make demo`` (``autoshard/demo.py``): both steps, 2 PPO steps on 2 CPU ranks via torchrun."""

from __future__ import annotations

from autoshard import demo
from autoshard.runtime.metrics import read_metrics


def test_demo_runs_both_steps_on_two_ranks(tmp_path, capfd):
    code = demo.main(["--steps", "2", "--out", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out  # 1 would mean the single-process fallback ran
    assert "1. plan llama:7b" in out and "2. PPO" in out
    assert "starting 2 ranks" in out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1.0, 2.0]
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)
    curves = tmp_path / "curves.png"
    assert curves.stat().st_size > 0
    assert f"training curves: {curves}" in out
    assert "falling back" not in out
