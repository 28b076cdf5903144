"""CLI fixes: a plan's recorded cluster keeps what it was searched on (a CPU cluster stays CPU, a calibration
stays applied), ``report --quiet`` shows no progress, a GPU calibration is refused for CPU ranks, and the PPO
output is short (about 20 step lines; ``starting N ranks`` without torchrun's command line unless ``--debug``)."""

from __future__ import annotations

import json

import pytest

from autoshard.cli import main
from autoshard.cluster import Cluster
from autoshard.errors import ClusterError
from autoshard.plan import Fingerprints, LayerStrategy, Mesh, Plan
from autoshard.plan_reuse import RECORDED_CLUSTER_NAME, calibration_warning, cluster_of
from autoshard.progress import Lines

GPU_CALIBRATION = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T10:00:00Z", "matmul_efficiency": 0.7,
                   "kernel_overhead_s": 9e-6}
CPU_CALIBRATION = {"device": "Intel(R) Xeon(R) Platinum 8480+ (1 core(s)/rank)", "date": "2026-11-26T10:00:00Z",
                   "matmul_efficiency": 0.6}


def _saved_plan(tmp_path, cluster: Cluster) -> Plan:
    """A two-rank plan recording ``cluster``, through its file form."""
    plan = Plan("m", Mesh(dp_shard=2), (LayerStrategy("a"),), fingerprints=Fingerprints.of(cluster=cluster))
    return Plan.load(plan.save(tmp_path / "plan.json"))


# ------------------------------------------------------------------- recorded cluster
def test_recorded_cpu_cluster_stays_a_cpu_cluster(tmp_path):
    cpu = Cluster.parse("cpu:1x2")
    rebuilt = cluster_of(_saved_plan(tmp_path, cpu))
    assert rebuilt == cpu and rebuilt.runs_on_cpu


def test_recorded_cluster_keeps_its_calibration_and_warns_without_it(tmp_path):
    (tmp_path / "cal.json").write_text(json.dumps(GPU_CALIBRATION))
    calibrated = Cluster.parse("h100-sxm:1x2").with_calibration(tmp_path / "cal.json")
    plan = _saved_plan(tmp_path, calibrated)
    assert cluster_of(plan) == calibrated and cluster_of(plan).calibration["kernel_overhead_s"] == 9e-6
    assert calibration_warning(plan, calibrated) is None
    warning = calibration_warning(plan, Cluster.parse("h100-sxm:1x2"))
    assert warning == ("warning: plan was searched with calibration measured on NVIDIA H100 80GB HBM3 "
                       "2026-11-26T10:00:00Z; pass --calibration FILE to price it as searched")
    assert calibration_warning(_saved_plan(tmp_path, Cluster.parse("h100-sxm:1x2")), Cluster.parse("h100")) is None


def test_plan_without_the_recorded_context_still_loads(tmp_path):
    cpu = Cluster.parse("cpu:1x2")
    data = json.loads(_saved_plan(tmp_path, cpu).save(tmp_path / "new.json").read_text())
    del data["fingerprints"]["cluster_context"]  # a plan file written before it was recorded
    (tmp_path / "old.json").write_text(json.dumps(data))
    rebuilt = cluster_of(Plan.load(tmp_path / "old.json"))
    assert rebuilt.name == RECORDED_CLUSTER_NAME and rebuilt.fingerprint() == cpu.fingerprint()


def test_cpu_plan_is_priced_as_searched():
    """The compiled-activation pricing of GPU clusters changes this plan's predicted memory: the recorded
    cluster must price it as the CPU cluster it was searched on."""
    from autoshard.passes.capture import capture_reference
    from autoshard.plan_reuse import train_of
    from autoshard.search import solve
    from autoshard.search.cost_model import predict
    from autoshard.train import TrainSpec

    graph = capture_reference("gpt:tiny", seq_lens=(8, 16))
    plan = solve(graph, Cluster.parse("cpu:1x2"), TrainSpec(global_batch=8, seq_len=16), time_limit_s=10)
    plan = Plan.from_json(plan.to_json())
    predicted = predict(graph, plan, cluster_of(plan), train_of(plan))
    assert (predicted.step_time_s, predicted.peak_memory_bytes) == (
        plan.predictions.step_time_s, plan.predictions.peak_memory_bytes)


@pytest.mark.slow
def test_explain_prices_a_calibrated_plan_as_searched(tmp_path, capsys, monkeypatch):
    """Without --calibration: the recorded calibration, said so; with a --cluster lacking it: one warning line."""
    from autoshard import cli_search

    graphs: dict[str, object] = {}
    capture = cli_search.capture_spec
    monkeypatch.setattr(cli_search, "capture_spec",
                        lambda spec, **options: graphs.get(spec) or graphs.setdefault(spec, capture(spec)))
    constants = {key: GPU_CALIBRATION[key] for key in ("device", "date", "kernel_overhead_s")}  # no fingerprinted figure
    (tmp_path / "cal.json").write_text(json.dumps(constants))
    plan = tmp_path / "p.json"
    assert main(["plan", "llama:tiny", "--batch", "16", "--seq", "64", "--time-limit", "20", "--cluster",
                 "h100-sxm:1x8", "--calibration", str(tmp_path / "cal.json"), "-o", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["explain", str(plan), "--layer", "blocks.0.mlp"]) == 0
    out = capsys.readouterr().out
    assert "calibration (recorded in the plan): measured on NVIDIA H100 80GB HBM3" in out and "warning" not in out
    assert main(["explain", str(plan), "--layer", "blocks.0.mlp", "--cluster", "h100-sxm:1x8"]) == 0
    out = capsys.readouterr().out
    assert out.count("warning: plan was searched with calibration measured on NVIDIA H100 80GB HBM3") == 1


# ------------------------------------------------------------------------- report
@pytest.mark.parametrize("quiet", [False, True])
def test_report_progress_follows_quiet(monkeypatch, quiet):
    import autoshard.report

    seen = []
    monkeypatch.setattr(autoshard.report, "report_main", lambda args, console, progress: seen.append(progress) or 0)
    assert main(["report", "plan.json", *(["--quiet"] if quiet else [])]) == 0
    assert (seen[0] is None) == quiet


# -------------------------------------------------------------------- calibration
@pytest.mark.parametrize("calibration, cluster, needle", [
    (GPU_CALIBRATION, "cpu:1x2", "'NVIDIA H100 80GB HBM3' (a GPU) does not fit this cluster's device 'CPU core' (a CPU)"),
    (CPU_CALIBRATION, "h100-sxm:1x8", "(a CPU) does not fit this cluster's device 'H100 SXM 80GB' (a GPU)"),
])
def test_calibration_of_other_hardware_kind_is_refused(tmp_path, capsys, calibration, cluster, needle):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration))
    assert main(["plan", "llama:tiny", "--cluster", cluster, "--calibration", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and needle in err and str(path) in err


def test_cpu_calibration_fits_cpu_ranks(tmp_path):
    from autoshard.cluster_presets import device_kind

    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CPU_CALIBRATION))
    assert Cluster.parse("cpu:1x2").with_calibration(path).device.matmul_efficiency == 0.6
    assert device_kind(CPU_CALIBRATION["device"]) == device_kind("CPU core") == "cpu"
    assert device_kind("NVIDIA H200") == "gpu" and device_kind("my accelerator") is None
    with pytest.raises(ClusterError, match="a GPU"):
        Cluster.parse("cpu").with_calibration({"device": "NVIDIA H200"})


# ---------------------------------------------------------------------------- PPO
def test_ppo_keeps_about_twenty_step_lines(tmp_path):
    import io

    from autoshard.runtime.metrics import LiveSummary

    stream, ticks = io.StringIO(), iter(range(1000))
    clock = lambda: 0.2 * next(ticks)  # noqa: E731  (a 0.2 s step: 30 s in all, no heartbeat line)
    summary = LiveSummary(150, progress=Lines(stream=stream, interval_s=60.0, clock=clock))
    summary.start(0)
    for step in range(1, 151):
        summary({"step": float(step), "reward/mean": 0.5})
    steps = [line.split()[1] for line in stream.getvalue().splitlines()]
    assert steps[0] == "1/150" and steps[-1] == "150/150" and len(steps) == 20
    resumed = LiveSummary(150, progress=lambda update: None)
    resumed.start(140)
    assert [s for s in range(141, 151) if resumed.kept(s)] == list(range(141, 151))


@pytest.mark.parametrize("debug", [False, True])
def test_ppo_start_line_names_torchrun_only_with_debug(tmp_path, monkeypatch, capsys, debug):
    from rich.console import Console

    import autoshard.runtime.launch as launch
    from autoshard import cli_ppo
    from autoshard.cli import build_parser

    plan_path = _saved_plan(tmp_path, Cluster.parse("cpu:1x2")).save(tmp_path / "p.json")
    monkeypatch.setattr(launch, "launch", lambda spec, debug=False: 0)
    args = build_parser().parse_args(["ppo", "llama:tiny", "--cluster", "cpu:1x2", "--plan", str(plan_path),
                                      *(["--debug"] if debug else [])])
    assert cli_ppo._launch(args, "llama:tiny", plan_path, Console(highlight=False)) == 0
    out = capsys.readouterr().out
    assert out.startswith("starting 2 ranks") and ("launch_child" in out) == debug
