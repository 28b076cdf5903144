"""Faults of launched jobs (runtime/launch.py, runtime/launch_child.py): real torchrun launches of 2 gloo ranks.

- short jobs in a row (4; 20 under `make test-full`) all exit cleanly (rc 0, no SIGABRT at teardown);
- a user error on one rank: one line naming it, exit 2, no torchrun traceback;
- a SIGSTOPped rank: the launcher stops the job within AUTOSHARD_TIMEOUT_S (4 s here) and names the rank;
- a SIGKILLed launcher: its agent and ranks are gone within seconds.

Each launch costs ~2-4 s on 2 idle cores (three interpreters import torch), ~8 s on busy ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _tiers import FULL
from autoshard.plan import LayerStrategy, Mesh, Plan
from autoshard.runtime import launch

pytestmark = [
    pytest.mark.slow,  # subprocess runs
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux"),
]

TINY = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0
    dist.destroy_process_group()
    """
)

# Writes its pid once the group is up, then all-reduces for up to a minute (the fault tests end it sooner).
LOOP = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from autoshard.errors import PlanError

    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the launcher's watchdog must act first
    if sys.argv[2:] == ["user-error"]:
        raise PlanError("every rank refuses on purpose")  # the same line on each: folded into one
    with open(os.path.join(out, f"pid{dist.get_rank()}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid{dist.get_rank()}.tmp"), os.path.join(out, f"pid{dist.get_rank()}"))
    total, end = torch.ones(1), time.time() + 60
    while time.time() < end:
        dist.all_reduce(total)
        time.sleep(0.01)
    """
)


@pytest.fixture
def plan(tmp_path) -> str:
    return str(Plan(model_name="toy", mesh=Mesh(dp_shard=2), layers=(LayerStrategy("blk"),)).save(tmp_path / "plan.json"))


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _start(plan: str, command: list[str], timeout_s: float | None = None, options: list[str] = ()) -> subprocess.Popen:
    """``autoshard run OPTIONS PLAN -- COMMAND`` as its own process (``python -m autoshard.runtime.launch``)."""
    env = {**os.environ}
    if timeout_s is not None:
        env[launch.TIMEOUT_ENV] = str(timeout_s)
    argv = [sys.executable, "-m", "autoshard.runtime.launch", *options, plan, "--", *command]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_pids(out: Path, proc: subprocess.Popen, deadline_s: float = 90) -> list[int]:
    end = time.time() + deadline_s
    while time.time() < end and proc.poll() is None:
        if all((out / f"pid{r}").exists() for r in range(2)):
            return [int((out / f"pid{r}").read_text()) for r in range(2)]
        time.sleep(0.1)
    raise AssertionError(f"ranks did not start: rc={proc.poll()} stderr={proc.stderr.read() if proc.poll() is not None else ''}")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


# `make test` (tests/_tiers.py) launches 4 jobs (~8 s each on two cores), `make test-full` 20
SHORT_JOBS = 20 if FULL else 4


def test_short_jobs_exit_cleanly(tmp_path, plan, capfd):
    """The real launcher path (``build_launch`` + ``launch``, as ``autoshard run``) again and again: rc 0, no abort."""
    script = _script(tmp_path, "tiny.py", TINY)
    spec = launch.build_launch(plan, [script])
    codes = []
    for _ in range(SHORT_JOBS):
        codes.append(launch.launch(spec))
        err = capfd.readouterr().err
        assert "Abort" not in err and "SIGABRT" not in err, err
    assert codes == [0] * SHORT_JOBS


def test_user_error_on_a_rank_is_one_line_exit_2(tmp_path, plan):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(plan, [_script(tmp_path, "loop.py", LOOP), str(out), "user-error"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(lines) == 1 and "ChildFailedError" not in err, err
    assert lines[0].startswith("autoshard: error: rank") and "refuses on purpose" in lines[0]


def test_stopped_rank_stops_the_job_within_the_timeout(tmp_path, plan):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(plan, [_script(tmp_path, "loop.py", LOOP), str(out)], timeout_s=4)
    try:
        pids = _wait_for_pids(out, proc)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.time()
        _, err = proc.communicate(timeout=30)
        waited = time.time() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    # the heartbeat is older than the timeout: its last touch came up to min(1 s, T/4) = 1 s before the stop,
    # and the launcher then needs a poll and a loaded machine's slack
    assert 4 - 1 <= waited < 4 + 8, (waited, err)
    assert "autoshard: error: rank 1: no heartbeat for" in err and "stopped (SIGSTOP)" in err, err
    assert "Traceback" not in err, err
    deadline = time.time() + 5
    while any(map(_alive, pids)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))


def test_killed_launcher_leaves_no_rank_behind(tmp_path, plan):
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(plan, [_script(tmp_path, "loop.py", LOOP), str(out)])
    try:
        pids = _wait_for_pids(out, proc)
        agent = _parent(pids[0])
        proc.kill()  # SIGKILL: the launcher cannot clean up; PR_SET_PDEATHSIG must
        proc.communicate(timeout=10)
        deadline = time.time() + 5
        while any(map(_alive, [agent, *pids])) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, [agent, *pids]))
    finally:
        for pid in pids if "pids" in locals() else ():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
