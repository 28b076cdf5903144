"""Smoke tests of tests/_harness.py: fake worlds, simulated ranks, real gloo jobs.

The gloo tests spawn five jobs in all (about 15 s on two cores); the many-case
job shows the intended pattern: one spawn, results fanned out to small tests
by a module-scoped fixture.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from _harness import (
    CPU_LOG_ENV,
    CaseFailedError,
    RankFailedError,
    fake_world,
    local_ranks,
    run_gloo,
    run_gloo_cases,
)

# --------------------------------------------------------------------------- fake world


def _chunk_len(global_len: int, num_chunks: int, index: int) -> int:
    """Length of chunk ``index`` under torch.chunk semantics (what DTensor Shard uses)."""
    size = math.ceil(global_len / num_chunks)
    return max(0, min(size, global_len - index * size))


@pytest.mark.parametrize("rank", [0, 1023])
def test_fake_world_1024_ranks_builds_2d_mesh_and_dtensor(rank):
    with fake_world(1024, rank=rank):
        mesh = init_device_mesh("cpu", (32, 32), mesh_dim_names=("dp_shard", "tp"))
        dp, tp = mesh.get_coordinate()
        assert (dp, tp) == divmod(rank, 32)
        dt = distribute_tensor(torch.randn(64, 70), mesh, [Shard(0), Shard(1)])
        assert tuple(dt.shape) == (64, 70)
        assert tuple(dt.to_local().shape) == (_chunk_len(64, 32, dp), _chunk_len(70, 32, tp))
    assert not dist.is_initialized()


def test_fake_world_refuses_to_nest():
    with fake_world(8):
        with pytest.raises(RuntimeError, match="already exists"):
            with fake_world(8):
                pass
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- local ranks

# torch 2.13 renamed the functional ``*_tensor`` collectives to ``*_single``.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def test_local_ranks_functional_all_reduce_and_all_gather():
    world = 4
    with local_ranks(world) as lr:
        x = lr.per_rank(lambda r: torch.arange(3, dtype=torch.float32) + 10 * r)
        group = dist.group.WORLD
        summed = funcol.all_reduce(x, "sum", group)
        gathered = _all_gather_single(x, 0, group)
        shards = lr.shards(summed)
        everything = lr.shards(gathered)
    expected_sum = sum(torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world))
    expected_cat = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world)])
    assert len(shards) == world
    for r in range(world):
        torch.testing.assert_close(shards[r], expected_sum)
        torch.testing.assert_close(everything[r], expected_cat)
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- gloo jobs


def _all_reduce_rank_plus_one(rank: int, world_size: int) -> list[float]:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def _raise_on_rank(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def _die_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _rank_1_skips_the_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(60)
    else:
        dist.all_reduce(torch.ones(1))


@pytest.mark.slow
def test_run_gloo_world_2_all_reduce():
    assert run_gloo(_all_reduce_rank_plus_one, 2) == [[3.0, 3.0]] * 2


def _spin(rank: int, world_size: int, seconds: float) -> int:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return rank


@pytest.mark.slow
def test_cpu_log_has_a_line_per_case_and_per_job(tmp_path, monkeypatch):
    """Note "where a job's time goes": the CPU each case took on each rank, and each rank's whole job."""
    log = tmp_path / "cpu.jsonl"
    monkeypatch.setenv(CPU_LOG_ENV, str(log))
    run_gloo_cases({"short": functools.partial(_spin, seconds=0.0), "long": functools.partial(_spin, seconds=0.3)}, 2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    cases = {(r["case"], r["rank"]): r["cpu_s"] for r in lines if "case" in r}
    jobs = {r["rank"]: r["cpu_s"] for r in lines if "job" in r}
    assert set(cases) == {(c, r) for c in ("short", "long") for r in (0, 1)} and set(jobs) == {0, 1}
    assert all(cases["long", r] >= 0.3 > cases["short", r] and jobs[r] >= cases["long", r] for r in (0, 1))
    assert all(r["world"] == 2 and "test_cpu_log_has_a_line" in r["test"] for r in lines)


@pytest.mark.slow
def test_run_gloo_exception_on_rank_1_surfaces_with_its_traceback():
    with pytest.raises(ValueError, match="deliberate failure on rank 1") as info:
        run_gloo(_raise_on_rank, 2, bad_rank=1)
    remote = str(info.value.__cause__)
    assert "rank 1 of 2" in remote
    assert "_raise_on_rank" in remote  # the child's own frame, not the parent's


@pytest.mark.slow
def test_run_gloo_dead_rank_fails_fast():
    with pytest.raises(RankFailedError, match="rank 1 exited with code 3"):
        run_gloo(_die_on_rank_1, 2)


@pytest.mark.slow
def test_run_gloo_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        run_gloo(_rank_1_skips_the_collective, 2, timeout_s=3)
    elapsed = time.monotonic() - start
    assert "rank 0 of 2" in str(info.value) + str(info.value.__cause__)
    # Rank 1 sleeps 60 s: finishing well before that proves the parent did not wait for it
    # (the margin is start-up on a loaded two-core machine).
    assert elapsed < 50, f"a 3 s collective timeout took {elapsed:.1f} s to surface"


# --------------------------------------------------------------------------- many cases, one job


def _case_all_reduce(rank: int, world_size: int) -> float:
    return _all_reduce_rank_plus_one(rank, world_size)[0]


def _case_all_gather(rank: int, world_size: int) -> list[int]:
    out = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([rank * rank]))
    return [int(t) for t in out]


def _case_subgroup(rank: int, world_size: int, size: int) -> int:
    """All-reduce within consecutive groups of ``size`` ranks (every rank creates every group)."""
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world_size, size)]
    t = torch.tensor([rank])
    dist.all_reduce(t, group=groups[rank // size])
    return int(t)


def _case_threads(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


CASES = {
    "threads": _case_threads,
    "all_reduce": _case_all_reduce,
    "all_gather": _case_all_gather,
    "subgroup_pairs": functools.partial(_case_subgroup, size=2),
}


@pytest.fixture(scope="module")
def world4_cases():
    return run_gloo_cases(CASES, 4)


@pytest.mark.slow
def test_cases_workers_are_single_threaded(world4_cases):
    assert world4_cases["threads"] == [("1", 1)] * 4


@pytest.mark.slow
def test_cases_all_reduce(world4_cases):
    assert world4_cases["all_reduce"] == [10.0] * 4


@pytest.mark.slow
def test_cases_all_gather(world4_cases):
    assert world4_cases["all_gather"] == [[0, 1, 4, 9]] * 4


@pytest.mark.slow
def test_cases_subgroup(world4_cases):
    assert world4_cases["subgroup_pairs"] == [1, 1, 5, 5]


def _case_fails_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("missing")
    dist.barrier()  # rank 0 waits in a collective rank 1 never joins


@pytest.mark.slow
def test_cases_failure_names_the_case():
    with pytest.raises(CaseFailedError, match="case 'broken' failed on rank 1: KeyError"):
        run_gloo_cases({"broken": _case_fails_on_rank_1}, 2)
