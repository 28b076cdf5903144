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

from autoshard.errors import PlanError
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
    with pytest.raises(PlanError, match=r"needs 4 ranks but this job has world size 3"):
        launch.build_launch(plan, [script], nproc_per_node=3)
    assert launch.main([plan, "--nproc-per-node", "2", "--", script]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "world size 2" in err and "tp=2" in err


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


def test_multi_node_command(tmp_path, script):
    plan = _plan_file(tmp_path, dp_shard=4, tp=2)
    spec = launch.build_launch(
        plan, [script, "x"], nnodes=2, node_rank=1, rdzv_endpoint="node0:29400", cuda_available=True
    )
    argv = list(spec.argv)
    assert argv[1:3] == ["-m", "torch.distributed.run"] and spec.nproc_per_node == 4
    flags = dict(zip(argv[3:-2:2], argv[4:-2:2]))
    assert flags["--nnodes"] == "2" and flags["--nproc-per-node"] == "4" and flags["--node-rank"] == "1"
    assert flags["--rdzv-endpoint"] == "node0:29400" and flags["--rdzv-backend"] == "c10d"
    assert argv[-2:] == [script, "x"] and "--standalone" not in argv
    assert spec.env == {launch.PLAN_ENV: plan}  # no OMP default on a GPU machine


def test_single_node_is_standalone_and_module_form(tmp_path):
    plan = _plan_file(tmp_path, dp_shard=2)
    spec = launch.build_launch(plan, ["-m", "pkg.train", "--steps", "3"], cuda_available=False)
    assert "--standalone" in spec.argv and "--rdzv-endpoint" not in spec.argv
    assert list(spec.argv[-4:]) == ["--module", "pkg.train", "--steps", "3"]


@pytest.mark.parametrize(
    ("kwargs", "command", "message"),
    [
        ({"nnodes": 3, "rdzv_endpoint": "h:1"}, None, "world size 4 .* not divisible by --nnodes 3"),
        ({"nnodes": 2}, None, "--nnodes 2 needs --rdzv-endpoint"),
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
