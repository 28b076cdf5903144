"""``autoshard run`` on several nodes (runtime/launch.py): two node agents on this one machine, then bad launches.

The launch tests start two ``autoshard run`` processes, as two nodes would (``--nnodes 2``, a c10d
rendezvous on a free localhost port, gloo): world 4 = 2 nodes × 2 ranks, a data-parallel training loop
whose losses must equal a one-process full-batch run; then a user error on one rank, reported by its
node. Each launch takes 10-20 s on two cores (eight interpreters import torch); both are ``slow``. The
other tests start nothing: a launch whose world differs from the plan's, and node/rendezvous flags that
do not make a launch, are one line and exit 2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap

import pytest
import torch

from autoshard.cli import main as cli_main
from autoshard.runtime import launch
from test_launch import _plan_file
from test_launch_faults import _script, _start

STEPS = 3

# Every rank starts from the same weights and batch (seed 0) and trains on its quarter of the batch; the
# averaged gradient and loss make this full-batch gradient descent, rank for rank.
TRAIN = textwrap.dedent(
    f"""
    import json, os, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from autoshard.errors import PlanError
    from autoshard.runtime.launch import plan_from_env
    from autoshard.runtime.launch_child import timeout_s

    plan = plan_from_env()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s()))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x_local, y_local = x.chunk(world)[rank], y.chunk(world)[rank]  # (16 / world, 4), (16 / world, 1)
    if sys.argv[2:] == ["user-error"] and rank == world - 1:
        raise PlanError("the last rank refuses on purpose")  # its peers lose it in their first all-reduce
    losses = []
    for _ in range({STEPS}):
        loss = torch.nn.functional.mse_loss(model(x_local), y_local)
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        opt.step()
    result = {{"rank": rank, "world": world, "plan_world": plan.mesh.world_size, "losses": losses,
               "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}}
    with open(os.path.join(sys.argv[1], f"rank{{rank}}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _full_batch_losses() -> list[float]:
    """The loss curve of ``TRAIN`` in one process on the whole batch."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.slow
def test_two_node_agents_train_world_4(tmp_path):
    plan = _plan_file(tmp_path, dp_shard=4)
    script = _script(tmp_path, "train.py", TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    options = ["--nnodes", "2", "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "multinode-test"]
    agents = [_start(plan, [script, str(out)], timeout_s=60, options=options) for _ in range(2)]
    try:
        results = [agent.communicate(timeout=120) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], results
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["plan_world"] == 4 for r in ranks)
    # two ranks per node, numbered node by node (c10d numbers the nodes in the order they joined)
    assert [(r["node"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert ranks[0]["losses"] == pytest.approx(_full_batch_losses(), rel=1e-5)


@pytest.mark.slow
def test_a_rank_error_is_reported_by_its_own_node(tmp_path):
    """Each node's launcher reports its own ranks: the node of the failing rank prints its line and exits 2;
    the other node's ranks lose their peer mid-collective (gloo: connection closed), an internal error, exit 1."""
    plan = _plan_file(tmp_path, dp_shard=4)
    script = _script(tmp_path, "train.py", TRAIN)
    options = ["--nnodes", "2", "--rdzv-endpoint", f"localhost:{_free_port()}"]
    agents = [_start(plan, [script, str(tmp_path), "user-error"], timeout_s=60, options=options) for _ in range(2)]
    try:
        errs = {agent.returncode: err for agent in agents for _, err in [agent.communicate(timeout=120)]}
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert sorted(errs) == [1, 2], errs
    # the node says it once, last; torch's own C++ log may come before it when the other node's agent, which
    # hosts the rendezvous store, exits first ("[W ...] TCPStore ... recvVector failed", then its frames)
    lines = errs[2].splitlines()
    assert lines[-1] == "autoshard: error: rank 3: the last rank refuses on purpose", errs[2]
    assert not any(line.startswith("autoshard") or "Traceback" in line for line in lines[:-1]), errs[2]
    assert "autoshard: error: rank " in errs[1] and "ChildFailedError" not in errs[1], errs[1]


def _no_child(*args, **kwargs):
    raise AssertionError(f"a process was started: {args}")


def test_world_mismatch_exits_2_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch.subprocess, "Popen", _no_child)
    plan = _plan_file(tmp_path, dp_shard=2, tp=2)
    script = _script(tmp_path, "train.py", TRAIN)
    argv = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "localhost:1", plan, "--", script]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"autoshard: error: plan {plan} needs world 4 (mesh dp_shard=2 tp=2); this launch gives "
                   "2 nodes × 1 = 2; leave out --nproc-per-node (default: world / --nnodes), or search a plan "
                   "for 2 ranks\n")
    assert cli_main(["run", "--nnodes", "3", "--rdzv-endpoint", "localhost:1", plan, "--", script]) == 2
    assert "which --nnodes 3 does not divide" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--node-rank", "1"], "--node-rank 1 needs --nnodes N (N > 1"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], r"--node-rank 2 must be in [0, 2)"),
        (["--nnodes", "2", "--node-rank", "-1", "--master-addr", "h"], r"--node-rank -1 must be in [0, 2)"),
        (["--nnodes", "2"], "--nnodes 2 needs a rendezvous: --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--master-addr", "h"], "--master-addr h (static rendezvous) needs --node-rank R"),
        (["--nnodes", "2", "--master-addr", "h", "--rdzv-endpoint", "h:1"], "exclude each other"),
        (["--master-port", "29500"], "--master-port 29500 needs --master-addr HOST"),
        (["--nnodes", "0"], "--nnodes 0 must be at least 1"),
    ],
)
def test_bad_node_flags_are_one_line_errors(tmp_path, capsys, monkeypatch, options, message):
    monkeypatch.setattr(launch.subprocess, "Popen", _no_child)
    plan = _plan_file(tmp_path, dp_shard=4)
    script = _script(tmp_path, "train.py", TRAIN)
    assert cli_main(["run", *options, plan, "--", script]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and err.count("\n") == 1 and message in err, err


def test_static_rendezvous_command(tmp_path, capsys):
    plan = _plan_file(tmp_path, dp_shard=4)
    script = _script(tmp_path, "train.py", TRAIN)
    options = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "--dry-run"]
    assert cli_main(["run", *options, plan, "--", script]) == 0
    line = capsys.readouterr().out
    assert "--nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend static" in line
    assert "--master-addr node0 --master-port 29500" in line and "--standalone" not in line
