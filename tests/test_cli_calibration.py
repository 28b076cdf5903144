"""Calibration closes the loop: ``--calibration FILE`` on ``plan``, ``explain``, ``ppo`` and ``run``,
``calibration: PATH`` in a cluster file (relative to it), ``cluster show`` of a calibration file and of a
calibrated cluster, and every bad calibration input as one line on stderr with exit code 2."""

from __future__ import annotations

import json

import pytest

from autoshard import cli_search
from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.plan import Plan

CALIBRATION = {
    "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T10:00:00Z", "matmul_efficiency": 0.7,
    "hbm_efficiency": 0.88, "intra_node": {"bandwidth": 3.1e11, "latency": 7e-6}, "kernel_overhead_s": 9e-6,
    "gemm_knee_flops": 2e9, "adamw_s_per_param": 1e-10, "adamw_s_per_tensor": 5e-5,
}
PLAN = ("plan", "llama:tiny", "--batch", "16", "--seq", "64", "--time-limit", "20")
_GRAPHS: dict[str, object] = {}
_CAPTURE = cli_search.capture_spec


@pytest.fixture(autouse=True)
def _memoised_capture(monkeypatch):
    """One capture of each model for the file (the CLI would capture it for every command)."""
    def capture(spec: str, **options):
        options.pop("progress", None)
        if options:
            return _CAPTURE(spec, **options)
        if spec not in _GRAPHS:
            _GRAPHS[spec] = _CAPTURE(spec)
        return _GRAPHS[spec]

    monkeypatch.setattr(cli_search, "capture_spec", capture)


@pytest.fixture
def files(tmp_path):
    """cal.json, a cluster file sub/cluster.yaml naming it as ../cal.json, and a few wrong files."""
    (tmp_path / "cal.json").write_text(json.dumps(CALIBRATION))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cluster.yaml").write_text("preset: h100-sxm\ncalibration: ../cal.json\n")
    (tmp_path / "sub" / "lost.yaml").write_text("preset: h100-sxm\ncalibration: nowhere.json\n")
    (tmp_path / "garbled.json").write_text('{"matmul_efficiency": 0.7,')
    (tmp_path / "bad_value.json").write_text('{"matmul_efficiency": 3}')
    (tmp_path / "a100.json").write_text(json.dumps({**CALIBRATION, "device": "NVIDIA A100-SXM4-80GB"}))
    return tmp_path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("autoshard: error: "), err
    return err


def test_cluster_file_names_a_calibration_relative_to_itself(files, monkeypatch):
    monkeypatch.chdir(files / "sub")  # the path is the cluster file's, not the working directory's
    cluster = Cluster.from_file(files / "sub" / "cluster.yaml")
    assert cluster == Cluster.parse("h100-sxm:1x8").with_calibration(files / "cal.json")
    assert cluster.device.matmul_efficiency == 0.7 and cluster.calibration["kernel_overhead_s"] == 9e-6


def test_cluster_show_of_a_calibration_file(files, capsys):
    code, out, err = _run(capsys, "cluster", "show", files / "cal.json")
    assert code == 0 and err == ""
    for needle in ("calibration file", "NVIDIA H100 80GB HBM3", "2026-11-26T10:00:00Z", "matmul efficiency",
                   "0.7", "310 GB/s", "7 µs", "9 µs", "100 ps", "--calibration"):
        assert needle in out, needle


def test_cluster_show_of_a_calibrated_cluster_has_readable_rows(files, capsys):
    code, out, _ = _run(capsys, "cluster", "show", files / "sub" / "cluster.yaml")
    assert code == 0
    for needle in ("calibrated on", "NVIDIA H100 80GB HBM3", "intra-node bandwidth", "310 GB/s", "kernel overhead"):
        assert needle in out, needle
    assert "intra_node.bandwidth=" not in out  # not the raw record


@pytest.mark.slow
def test_plan_and_explain_with_calibration(files, capsys):
    flag, in_file = files / "flag.json", files / "in_file.json"
    code, out, _ = _run(capsys, *PLAN, "--cluster", "h100-sxm:1x8", "--calibration", files / "cal.json", "-o", flag)
    assert code == 0 and f"calibration {files / 'cal.json'}: measured on NVIDIA H100 80GB HBM3" in out
    assert "uncalibrated cluster" not in out
    assert Plan.load(flag).fingerprints.cluster_spec["device"]["matmul_efficiency"] == 0.7
    assert _run(capsys, *PLAN, "--cluster", files / "sub" / "cluster.yaml", "-o", in_file)[0] == 0
    assert flag.read_bytes() == in_file.read_bytes()  # the flag and the cluster file apply the same figures

    code, out, _ = _run(capsys, "explain", flag, "--layer", "blocks.0.mlp", "--calibration", files / "cal.json")
    assert code == 0 and "why it lost" in out and "measured on NVIDIA H100" in out
    other = files / "other.json"
    other.write_text(json.dumps({**CALIBRATION, "matmul_efficiency": 0.6}))
    err = _error(capsys, "explain", flag, "--layer", "blocks.0.mlp", "--calibration", other)
    assert "device.matmul_efficiency" in err  # not the figures the plan was searched with


@pytest.mark.parametrize("name, needle", [
    ("missing.json", "does not exist"),
    ("garbled.json", "invalid JSON"),
    ("bad_value.json", "matmul_efficiency=3"),
    ("sub/cluster.yaml", "is a cluster file, not a calibration file"),
    ("a100.json", "does not fit this cluster's device"),
])
def test_bad_calibration_is_one_line(files, capsys, name, needle):
    err = _error(capsys, *PLAN, "--cluster", "h100-sxm:1x8", "--calibration", files / name)
    assert needle in err and "calibration" in err


@pytest.mark.slow
def test_wrong_kinds_and_references_are_one_line(files, capsys, tmp_path):
    plan = files / "p.json"
    assert _run(capsys, *PLAN, "--cluster", "h100-sxm:1x8", "-o", plan)[0] == 0
    assert "is a plan file, not a calibration file" in _error(
        capsys, *PLAN, "--cluster", "h100-sxm:1x8", "--calibration", plan)
    assert "is a calibration file, not a cluster file" in _error(capsys, *PLAN, "--cluster", files / "cal.json")
    err = _error(capsys, "cluster", "show", files / "sub" / "lost.yaml")
    assert "lost.yaml" in err and "nowhere.json" in err and "does not exist" in err
    assert "matmul_efficiency=3" in _error(capsys, "cluster", "show", files / "bad_value.json")


def test_ppo_refuses_a_bad_calibration_before_any_search(files, capsys):
    err = _error(capsys, "ppo", "llama:tiny", "--cluster", "cpu:1x2", "--calibration", files / "garbled.json",
                 "--steps", "1")
    assert "garbled.json" in err


@pytest.mark.slow
def test_run_checks_and_passes_the_calibration(files, capsys, monkeypatch):
    plan, uncalibrated, script = files / "p.json", files / "u.json", files / "train.py"
    script.write_text("")
    (files / "other.json").write_text(json.dumps({**CALIBRATION, "matmul_efficiency": 0.6}))
    assert _run(capsys, *PLAN, "--cluster", "h100-sxm:1x8", "--calibration", files / "cal.json", "-o", plan)[0] == 0
    assert _run(capsys, *PLAN, "--cluster", "h100-sxm:1x8", "-o", uncalibrated)[0] == 0
    code, out, _ = _run(capsys, "run", "--calibration", files / "cal.json", "--dry-run", plan, "--", script)
    assert code == 0 and f"AUTOSHARD_CALIBRATION={files / 'cal.json'}" in out
    for path, calibration in ((plan, "other.json"), (uncalibrated, "cal.json")):  # not the plan's figures
        err = _error(capsys, "run", "--calibration", files / calibration, "--dry-run", path, "--", script)
        assert "plan does not match cluster" in err and "efficiency" in err and "--calibration" in err
    assert "invalid JSON" in _error(capsys, "run", "--calibration", files / "garbled.json", plan, "--", script)

    from autoshard.api import _resolve_cluster  # what autoshard.compile does on the ranks
    from autoshard.runtime.launch import CALIBRATION_ENV

    monkeypatch.setenv(CALIBRATION_ENV, str(files / "cal.json"))
    assert _resolve_cluster("h100-sxm:1x8").device.matmul_efficiency == 0.7
