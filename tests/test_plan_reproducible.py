"""Reproducible plan files: identical inputs give identical bytes.

A plan file holds no run facts (``autoshard/plan.py``, "Reproducible files"): the search's wall time
(``SolverStats.wall_s``) stays in memory, takes no part in ``==`` and is not written; old files that hold
it are still read. The search itself is deterministic (``search/solver.py``, "Determinism"): the same
small model planned twice, in process and through the CLI, gives the same bytes, and so do the CP-SAT
worker counts 1 and 2 (fixed seed, unique optimum).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoshard.cli import main
from autoshard.cli_search import capture_spec
from autoshard.cluster import Cluster
from autoshard.errors import PlanError
from autoshard.plan import Plan
from autoshard.search import solve
from autoshard.train import TrainSpec

PLAN_ARGS = ("plan", "llama:tiny", "--cluster", "h100-sxm:2x8", "--batch", "64", "--seq", "128", "--time-limit", "20")


@pytest.fixture(scope="module")
def problem():
    return capture_spec("llama:tiny"), Cluster.parse("h100-sxm:2x8"), TrainSpec(global_batch=64, seq_len=128)


def test_two_solves_give_the_same_bytes(problem, tmp_path):
    graph, cluster, train = problem
    first, second = (solve(graph, cluster, train, time_limit_s=20) for _ in range(2))
    assert first.solver.status == "OPTIMAL"  # a search cut short by its time limit is not reproducible
    assert first == second and first.to_json() == second.to_json()
    assert first.save(tmp_path / "a.json").read_bytes() == second.save(tmp_path / "b.json").read_bytes()


def test_worker_counts_agree(problem):
    graph, cluster, train = problem
    one, two = (solve(graph, cluster, train, time_limit_s=20, num_workers=n) for n in (1, 2))
    assert one.to_json() == two.to_json()


def test_wall_time_is_not_in_the_file_nor_compared(problem):
    graph, cluster, train = problem
    plan = solve(graph, cluster, train, time_limit_s=20)
    slower = dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, wall_s=plan.solver.wall_s + 5.0))
    assert slower == plan and slower.to_json() == plan.to_json()
    assert "wall_s" not in json.loads(plan.to_json())["solver"]
    assert Plan.from_json(plan.to_json()).solver.wall_s == 0.0


def test_old_files_with_wall_time_are_read(problem, tmp_path):
    graph, cluster, train = problem
    plan = solve(graph, cluster, train, time_limit_s=20)
    data = json.loads(plan.to_json())
    data["solver"]["wall_s"] = 3.25  # as files written before the decision hold it
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data, indent=2, sort_keys=True))
    loaded = Plan.load(old)
    assert loaded.solver.wall_s == 3.25 and loaded == plan
    assert loaded.to_json() == plan.to_json()  # re-saved without it
    data["solver"]["wall_s"] = -1.0  # still checked where present
    old.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"solver\.wall_s"):
        Plan.load(old)


@pytest.mark.slow
def test_cli_plans_twice_byte_for_byte(tmp_path, capsys):
    paths = [tmp_path / f"p{i}.json" for i in range(2)]
    for path in paths:
        assert main([*PLAN_ARGS, "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert "search " in out  # the wall time goes to the console, not the file
