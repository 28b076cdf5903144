"""``autoshard run`` (runtime/launch.py): one real 2-process torchrun launch, then argument checks.

The launch test starts torchrun once (2 gloo workers that read AUTOSHARD_PLAN,
all-reduce and write a result file each); every other test builds the command
without starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

import pytest

from autoshard.errors import AutoshardError, PlanError
from autoshard.plan import LayerStrategy, Mesh, Plan
from autoshard.runtime import launch

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from autoshard.runtime.launch import plan_from_env

    plan = plan_from_env()  # checks WORLD_SIZE against the plan before any collective
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    result = {
        "sum": total.item(),
        "world": dist.get_world_size(),
        "plan_world": plan.mesh.world_size,
        "plan_env": os.environ["AUTOSHARD_PLAN"],
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "argv": sys.argv[2:],
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    """
)


def _plan_file(tmp_path, **mesh) -> str:
    plan = Plan(model_name="toy", mesh=Mesh(**mesh), layers=(LayerStrategy("blk"),))
    return str(plan.save(tmp_path / "plan.json"))


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


@pytest.mark.slow
def test_run_launches_two_gloo_ranks_with_plan_env(tmp_path, script, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = _plan_file(tmp_path, dp_shard=2)
    out = tmp_path / "out"
    out.mkdir()
    rc = launch.main([plan, "--", script, str(out), "--lr", "0.1"])
    assert rc == 0
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["sum"] == 3.0 and result["world"] == 2 and result["plan_world"] == 2
        assert result["plan_env"] == os.path.abspath(plan)
        assert result["omp"] == "1"
        assert result["argv"] == ["--lr", "0.1"]


def test_forced_nproc_that_mismatches_plan_fails_before_launch(tmp_path, script, capsys):
    plan = _plan_file(tmp_path, dp_shard=2, tp=2)
    with pytest.raises(PlanError, match=r"needs world 4 \(mesh .*\); this launch gives 1 node × 3 = 3"):
        launch.build_launch(plan, [script], nproc_per_node=3)
    assert launch.main([plan, "--nproc-per-node", "2", "--", script]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 node × 2 = 2" in err and "tp=2" in err


def test_check_world_reads_plan_mesh_and_env(tmp_path, monkeypatch):
    plan = Plan.load(_plan_file(tmp_path, dp_shard=2, tp=2))
    launch.check_world(plan, 4)
    launch.check_world(plan.mesh, 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(PlanError, match=r"dp_shard=2 tp=2 .* needs 4 ranks but this job has world size 8"):
        launch.check_world(plan)
    monkeypatch.setenv(launch.PLAN_ENV, str(tmp_path / "plan.json"))
    with pytest.raises(PlanError, match="world size 8"):
        launch.plan_from_env()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.plan_from_env().mesh.world_size == 4


def test_corrupt_plan_is_one_line_error(tmp_path, script, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "autoshard.plan", "version": 1, "mesh": ')
    with pytest.raises(PlanError, match="not a valid JSON plan"):
        launch.build_launch(bad, [script])
    assert launch.main([str(bad), "--", script]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and err.count("\n") == 1 and str(bad) in err
    with pytest.raises(PlanError, match="cannot read plan file"):
        launch.build_launch(tmp_path / "missing.json", [script])


def test_multi_node_command(tmp_path, script, monkeypatch):
    monkeypatch.delenv(launch.TIMEOUT_ENV, raising=False)
    plan = _plan_file(tmp_path, dp_shard=4, tp=2)
    spec = launch.build_launch(
        plan, [script, "x"], nnodes=2, node_rank=1, rdzv_endpoint="node0:29400", cuda_available=True
    )
    argv = list(spec.argv)
    assert argv[1:4] == ["-m", launch.CHILD_MODULE, "agent"] and spec.nproc_per_node == 4
    flags = dict(zip(argv[4:-5:2], argv[5:-5:2]))
    assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "4" and flags["--node-rank"] == "1"
    assert flags["--rdzv-endpoint"] == "node0:29400" and flags["--rdzv-backend"] == "c10d"
    assert argv[-5:] == ["--module", launch.CHILD_MODULE, "rank", script, "x"] and "--standalone" not in argv
    # no OMP default on a GPU machine; the ranks get the launcher's timeout
    assert spec.env == {launch.PLAN_ENV: plan, launch.TIMEOUT_ENV: "300"} and spec.timeout_s == 300


def test_single_node_is_standalone_and_module_form(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.TIMEOUT_ENV, "7.5")
    plan = _plan_file(tmp_path, dp_shard=2)
    spec = launch.build_launch(plan, ["-m", "pkg.train", "--steps", "3"], cuda_available=False)
    assert "--standalone" in spec.argv and "--rdzv-endpoint" not in spec.argv
    assert list(spec.argv[-7:]) == ["--module", launch.CHILD_MODULE, "rank", "-m", "pkg.train", "--steps", "3"]
    assert spec.timeout_s == 7.5 and spec.env[launch.TIMEOUT_ENV] == "7.5"
    monkeypatch.setenv(launch.TIMEOUT_ENV, "0")
    with pytest.raises(AutoshardError, match="AUTOSHARD_TIMEOUT_S='0' must be a positive number of seconds"):
        launch.build_launch(plan, ["-m", "pkg.train"], cuda_available=False)


def test_profile_dir_reaches_the_ranks_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan_file(tmp_path, dp_shard=2)
    assert launch.PROFILE_ENV not in launch.build_launch(plan, ["-m", "pkg.train"], cuda_available=False).env
    spec = launch.build_launch(plan, ["-m", "pkg.train"], cuda_available=False, profile="traces")
    assert spec.env[launch.PROFILE_ENV] == str(tmp_path / "traces")


def _records(tmp_path, *records, agent=None):
    """A run directory as the ranks and the agent leave it."""
    for i, (rank, user, message) in enumerate(records):
        record = {"rank": rank, "user": user, "message": message, "traceback": f"Traceback: {message}", "time": i}
        (tmp_path / f"rank-{rank}.error.json").write_text(json.dumps(record))
    if agent is not None:
        (tmp_path / "agent.json").write_text(json.dumps({"failures": agent}))
    return tmp_path


def test_outcome_folds_user_errors_and_drops_their_consequences(tmp_path):
    run_dir = _records(tmp_path, ("1", True, "bad batch"), ("0", True, "bad batch"), ("2", False, "peer closed"))
    assert launch._outcome(run_dir, 1, None, 300) == (["autoshard: error: ranks 0,1: bad batch"], 2)


def test_outcome_internal_error_shows_the_first_traceback(tmp_path):
    run_dir = _records(tmp_path, ("0", False, "RuntimeError: boom"), ("1", False, "RuntimeError: peer closed"))
    lines, code = launch._outcome(run_dir, 1, None, 300)
    assert code == 1 and lines == [
        "Traceback: RuntimeError: boom",
        "autoshard: error: rank 0: RuntimeError: boom (1 other rank failed after it; --debug shows each)",
    ]


def test_outcome_rank_killed_without_a_record(tmp_path):
    agent = [{"rank": 0, "exitcode": -15, "signal": "SIGTERM", "time": 5},
             {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "time": 5}]
    lines, code = launch._outcome(_records(tmp_path, agent=agent), 1, None, 300)
    assert code == 1 and lines == ["autoshard: error: rank 1: killed by SIGKILL (its own output, if any, is above)"]
    assert launch._outcome(tmp_path / "none", 0, None, 300) == ([], 0)


@pytest.mark.parametrize(
    ("kwargs", "command", "message"),
    [
        ({"nnodes": 3, "rdzv_endpoint": "h:1"}, None, r"needs world 4 \(mesh dp_shard=4\), which --nnodes 3 does not divide"),
        ({"nnodes": 2}, None, "--nnodes 2 needs a rendezvous: --rdzv-endpoint"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, None, r"--node-rank 2 must be in \[0, 2\)"),
        ({"rdzv_endpoint": "nohost"}, None, "must be HOST:PORT"),
        ({}, [], "no script to run"),
        ({}, ["missing.py"], "'missing.py' is not a file"),
        ({}, ["-m"], "'-m' needs a module name"),
    ],
)
def test_bad_launch_arguments(tmp_path, script, kwargs, command, message):
    plan = _plan_file(tmp_path, dp_shard=4)
    with pytest.raises(launch.LaunchError, match=message):
        launch.build_launch(plan, [script] if command is None else command, **kwargs)


def test_cli_parser_forms(tmp_path, script, capsys):
    root = argparse.ArgumentParser(prog="autoshard")
    launch.add_run_parser(root.add_subparsers(dest="command_name"))
    plan = _plan_file(tmp_path, dp_shard=4)
    for argv in (
        ["run", "--nnodes", "2", "--rdzv-endpoint", "h:1", plan, "--", script, "--nnodes", "9"],
        ["run", plan, "--nnodes", "2", "--rdzv-endpoint", "h:1", "--dry-run", "--", script, "--nnodes", "9"],
    ):
        args = root.parse_args(argv)
        args.dry_run = True
        assert args.handler(args, None) == 0
        line = capsys.readouterr().out
        assert "--nproc-per-node 2" in line and line.rstrip().endswith(f"{script} --nnodes 9")
        assert f"AUTOSHARD_PLAN={plan}" in line
    args = root.parse_args(["run", plan, "--nnodes", "2", script])
    with pytest.raises(launch.LaunchError, match="put '--' between the options and the script"):
        launch.run_main(args)


@pytest.mark.slow
def test_ppo_refuses_what_its_ranks_would_in_the_parent(tmp_path, capsys):
    """`autoshard ppo`: a --checkpoint that is a file, and a --batch the plan's ranks cannot split, are one line,
    exit 2, before any rank starts (they used to be raised on every rank)."""
    from autoshard.cli import main

    afile = tmp_path / "ckpt"
    afile.write_text("")
    assert main(["ppo", "llama:tiny", "--cluster", "cpu:1x2", "--checkpoint", str(afile)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["ppo", "llama:tiny", "--cluster", "cpu:1x2", "--batch", "3", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoshard: error: --batch 3 cannot be split") and "\n" not in err
