"""examples/train.py as a user runs it: plan, `autoshard run` on 2 gloo ranks, interrupt, resume, export.

The plan is searched in this process without a process group (``--plan-out``, ZeRO-2
pinned); then two launches of 2 ranks each (about 45 s on two busy cores): a launch stops after step 3 of 6 (as if interrupted, with the
step-3 checkpoint on disk), and a second launch with ``--resume`` finishes and exports. The
exactness of the resumed curve is ``tests/test_train_loop.py``'s (in-process gloo jobs); here:
the commands, the files they leave, and that the export is the model's state dict.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.runtime import checkpoint as ckpt

pytestmark = pytest.mark.slow  # subprocess runs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
ARGS = ["--steps", "6", "--ckpt-every", "3", "--samples", "32", "--seq-len", "16", "--log-every", "1",
        "--precision", "fp32"]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_plan_run_interrupt_resume_export(tmp_path):
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("examples_train_cli", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)  # the example's own model class, for the exported weights

    plan = tmp_path / "plan.json"
    # = python examples/train.py --plan-out plan.json ... (in this process: one interpreter start less)
    example.main(["--plan-out", str(plan), "--cluster", "cpu:1x2", "--state", "zero2", *ARGS])
    launch = [sys.executable, "-m", "autoshard.cli", "run", str(plan), "--", str(SCRIPT), *ARGS,
              "--ckpt-dir", "ckpt", "--metrics", "metrics.jsonl"]
    first = _run([*launch, "--stop-after", "3"], tmp_path)
    assert "step     3" in first.stdout and "step     4" not in first.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000003"]
    second = _run([*launch, "--resume", "--export", "model.safetensors"], tmp_path)
    assert "resumed from" in second.stdout and "at step 3" in second.stdout

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[1]["lr"] > records[0]["lr"]  # warm-up
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000003", "step_000006"]
    assert ckpt.read_info(tmp_path / "ckpt" / "step_000006").extras["optimizer_steps"] == 6

    exported = load_file(str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = example.TinyLM(example.TinyConfig())
    model.load_state_dict(exported, strict=True, assign=True)  # every parameter, at its global shape
    logits, values = model(torch.zeros(1, 16, dtype=torch.long))
    assert logits.shape == (1, 16, example.TinyConfig.vocab_size) and values.shape == (1, 16)
