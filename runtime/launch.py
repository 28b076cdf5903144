"""``autoshard run``: launch a training script for a plan through torchrun.

    autoshard run [OPTIONS] PLAN.json -- SCRIPT [ARGS...]
    autoshard run [OPTIONS] PLAN.json -- -m MODULE [ARGS...]

What it does, in order, before any process starts:

1. loads and validates ``PLAN.json`` (``Plan.load``: a ``PlanError`` one-liner
   naming the file and the bad field);
2. derives the processes per node: ``nproc_per_node = plan world size /
   --nnodes`` (``LaunchError`` when it does not divide); ``--nproc-per-node``
   forces a value, and a launch whose ``nnodes × nproc_per_node`` differs
   from the plan's world is a one-line ``PlanError`` ("plan P needs world 4
   (mesh dp_shard=4); this launch gives 2 nodes × 1 = 2"): it fails here, not
   as a hung collective;
3. builds the torchrun (``torch.distributed.run``) command. One node without
   a rendezvous option uses ``--standalone`` (a free local port). Several
   nodes (``--nnodes N``, one ``autoshard run`` per node, the same arguments
   on each) rendezvous one of two ways:

   - c10d: ``--rdzv-endpoint HOST:PORT`` (the same on every node; the agent
     on HOST serves the store) with ``--rdzv-id`` naming the job;
     ``--rdzv-backend`` passes through. Nodes are numbered in the order they
     join, so a node's ranks are not fixed by its ``--node-rank``.
   - static: ``--master-addr HOST`` (and ``--master-port``, default 29500)
     with ``--node-rank R`` on each node; node R runs global ranks
     ``R * nproc_per_node`` onwards.

   ``--node-rank`` without ``--nnodes N > 1``, ``--node-rank`` outside
   ``[0, N)``, both rendezvous forms at once, neither with N > 1, or static
   without ``--node-rank`` are ``LaunchError`` one-liners. ``--max-restarts`` is torchrun's elastic
   restart count;
4. runs it in a child process with ``AUTOSHARD_PLAN=<absolute plan path>`` in
   the environment (and, with ``--calibration FILE``, checked here against the
   plan's recorded cluster, ``AUTOSHARD_CALIBRATION=<absolute path>``, which
   ``autoshard.compile`` on the ranks applies to the cluster it is given) and ``OMP_NUM_THREADS=1`` when no CUDA device is visible
   and the variable is unset (gloo ranks share the CPU cores; torchrun would
   otherwise pick the same value with a warning). The child is torchrun's
   agent and each rank a bootstrap around the script, both in
   ``runtime/launch_child.py`` (``--dry-run`` prints the exact command).

Errors (``launch``). Each rank's bootstrap records an exception that escapes
the script (or that it reports with ``launch_child.record_rank_error``) in a
per-rank file of a temporary directory the launcher passes as
``AUTOSHARD_RUN_DIR``; nothing is printed by the ranks. When the job ends the
launcher prints, on stderr:

- user errors (``AutoshardError``): ``autoshard: error: rank R: MESSAGE``,
  one line per distinct message (``ranks 0,1: ...`` when several ranks
  raised it); other ranks' errors, consequences of a peer leaving, are
  dropped. Exit code 2.
- internal errors (anything else): the earliest one's traceback, starting in
  the script, and its line (``... (N other ranks failed after it)``). Exit 1.
- a rank that died without an error (a signal, ``os._exit``, ``sys.exit(3)``):
  ``rank R: killed by SIGKILL`` / ``exited with code 3``, from torchrun's
  first failure. Exit 1.

torchrun's own log and its ``ChildFailedError`` traceback are hidden, and so
are other libraries' deprecation and torch-internal warnings in the agent and
every rank (``autoshard/quiet_warnings.py``: not printed once per rank);
``--debug`` (``AUTOSHARD_DEBUG=1`` in the ranks) shows them, and each rank
also prints its own line and traceback. Errors the parent can see coming are
raised before anything starts (plan, world size, script, nodes here;
``autoshard ppo`` also checks ``--batch``, ``--checkpoint`` and ``--resume``).

No hang, no orphan. ``AUTOSHARD_TIMEOUT_S`` (default 300 s, read by the
launcher, passed to the ranks):

- the watchdog: each rank's bootstrap touches ``rank-R.alive`` every
  ``min(1 s, timeout / 4)`` from a background thread; when one is older than
  the timeout and its process is still a live child of the agent (stopped by
  SIGSTOP, or stuck in C code that holds the GIL) the launcher SIGKILLs every
  rank and the agent and prints ``autoshard: error: rank R: no heartbeat for
  N s, its process P is stopped (SIGSTOP); stopped the job`` (exit 1). The
  launcher polls every ``min(0.5 s, timeout / 10)``.
- collectives: ``autoshard ppo``'s ranks and ``examples/train.py`` pass the
  same value as ``init_process_group(timeout=...)``, so a rank waiting on a
  peer that is alive but never joins the collective fails after it (an
  internal error; gloo honours the timeout). Your script: pass
  ``timeout=timedelta(seconds=launch_child.timeout_s())``.
- a rank that dies: torchrun sees it within 0.1 s and SIGTERMs the others.
- orphans: the agent and every rank set ``PR_SET_PDEATHSIG`` = SIGKILL
  (Linux, ``prctl`` through ctypes), so SIGKILL of the launcher takes the
  agent down at once and the agent's death takes its ranks (the signal
  follows the launcher thread that called ``launch``: call it from a thread
  that outlives the job). Ctrl-C or an error in the launcher SIGKILLs the
  job before it leaves.
- clean exit: the bootstrap destroys a process group the script left
  initialised, joins the heartbeat thread, runs ``atexit`` handlers and
  leaves through ``os._exit`` (no interpreter teardown, where a C++ thread
  destroyed at exit could SIGABRT a finished rank).

On several nodes each node's launcher watches and reports its own ranks.
Inside the script, ``plan_from_env()`` reads ``AUTOSHARD_PLAN`` and checks the
plan against the launched ``WORLD_SIZE`` before ``init_process_group``.

The CLI registers the command from this module (``add_run_arguments`` +
``run_command``, the shape of a ``autoshard.cli.Command`` row), or through
``add_run_parser(subparsers)`` + ``run_main(args)``; ``python -m
autoshard.runtime.launch`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.cluster import check_calibration
from autoshard.errors import AutoshardError, PlanError
from autoshard.plan import MESH_AXES, Plan
from autoshard.plan_reuse import cluster_of
from autoshard.runtime.launch_child import (
    AGENT_FILE,
    DEBUG_ENV,
    DEFAULT_TIMEOUT_S,
    RUN_DIR_ENV,
    TIMEOUT_ENV,
    die_with_parent,
    timeout_s,
)

PLAN_ENV = "AUTOSHARD_PLAN"
PROFILE_ENV = "AUTOSHARD_PROFILE"  # ``--profile DIR``: runtime/step_profile.py traces each rank's second step there
CALIBRATION_ENV = "AUTOSHARD_CALIBRATION"  # a calibration file autoshard.compile applies (``--calibration``)
CHILD_MODULE = "autoshard.runtime.launch_child"
_USAGE = "autoshard run [OPTIONS] PLAN.json -- SCRIPT [ARGS...]"


class LaunchError(AutoshardError):
    """``autoshard run`` cannot build a launch from its arguments (node count, script, rendezvous)."""


# --------------------------------------------------------------------------- world checks


def check_world(plan: Any, world_size: int | None = None) -> None:
    """Raise ``PlanError`` unless ``world_size`` equals the world size of ``plan``'s mesh.

    ``plan`` is a ``Plan`` or a ``plan.Mesh``. ``world_size=None`` reads the
    live job: ``torch.distributed``'s world size when initialised, else the
    ``WORLD_SIZE`` torchrun exports (so it can run before
    ``init_process_group``). Runs no collective: it cannot hang.
    """
    mesh = getattr(plan, "mesh", plan)
    if world_size is None:
        world_size = _live_world_size()
    if world_size != mesh.world_size:
        raise PlanError(
            f"plan mesh {mesh} needs {mesh.world_size} ranks but this job has world size {world_size}; "
            f"launch with `autoshard run PLAN.json -- SCRIPT` (which starts {mesh.world_size} processes), "
            f"or search a plan for {world_size} ranks"
        )


def _live_world_size() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        raise PlanError(
            "cannot tell this job's world size: torch.distributed is not initialised and WORLD_SIZE is unset; "
            "launch with `autoshard run` / torchrun, or pass world_size"
        )
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"WORLD_SIZE={text!r} is not an integer; launch with `autoshard run` / torchrun") from None


def plan_from_env(*, check: bool = True) -> Any:
    """The ``Plan`` named by ``AUTOSHARD_PLAN`` (set by ``autoshard run``), checked against the world size."""
    path = os.environ.get(PLAN_ENV)
    if not path:
        raise PlanError(f"{PLAN_ENV} is not set; start this script with `{_USAGE}`")
    plan = Plan.load(path)
    if check:
        check_world(plan)
    return plan


# --------------------------------------------------------------------------- launch spec


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one ``autoshard run`` resolves to: the command line and the extra environment."""

    argv: tuple[str, ...]  # the full child command: python -m torch.distributed.run ... SCRIPT ARGS
    env: dict[str, str]  # variables added to (or overriding) the parent's environment
    nproc_per_node: int
    nnodes: int
    timeout_s: float = DEFAULT_TIMEOUT_S  # a rank silent this long is stalled (module docstring)


def build_launch(
    plan_path: str | os.PathLike,
    command: Sequence[str],
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "autoshard",
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    cuda_available: bool | None = None,
    calibration: str | os.PathLike | None = None,
    profile: str | os.PathLike | None = None,
) -> LaunchSpec:
    """Validate the plan and arguments and build the torchrun command (module docstring, steps 1-4)."""
    plan_path = Path(plan_path).absolute()
    plan = Plan.load(plan_path)
    if calibration is not None:
        calibration = _check_calibration(plan, Path(calibration).absolute())
    _check_command(command)
    _check_nodes(nnodes, node_rank, rdzv_endpoint, master_addr, master_port)
    nproc = _nproc_per_node(plan, plan_path, nnodes, nproc_per_node)
    timeout = timeout_s()
    torchrun = [sys.executable, "-m", CHILD_MODULE, "agent", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if node_rank is not None:
        torchrun += ["--node-rank", str(node_rank)]
    if rdzv_endpoint is not None:
        torchrun += ["--rdzv-endpoint", rdzv_endpoint, "--rdzv-backend", rdzv_backend, "--rdzv-id", rdzv_id]
    elif master_addr is not None:
        torchrun += ["--rdzv-backend", "static", "--master-addr", master_addr]
        torchrun += ["--master-port", str(29500 if master_port is None else master_port)]
    else:
        torchrun.append("--standalone")
    torchrun += ["--max-restarts", str(max_restarts)]
    torchrun += ["--module", CHILD_MODULE, "rank", *command]
    env = {PLAN_ENV: str(plan_path), TIMEOUT_ENV: f"{timeout:g}"}
    if calibration is not None:
        env[CALIBRATION_ENV] = str(calibration)
    if profile is not None:  # runtime/step_profile.py: autoshard.compile traces each rank's second step there
        env[PROFILE_ENV] = str(Path(profile).absolute())
    if cuda_available is None:
        cuda_available = _cuda_available()
    if not cuda_available and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return LaunchSpec(argv=tuple(torchrun), env=env, nproc_per_node=nproc, nnodes=nnodes, timeout_s=timeout)


def _check_calibration(plan: Any, path: Path) -> Path:
    """``path`` once it reads as a calibration file whose figures are the ones the plan was searched with
    (its recorded cluster keeps its fingerprint; a hand-written plan records none: the file alone is checked).
    A bad file is a ``ClusterError``, a mismatch a ``PlanError``, here, before any rank starts."""
    if not plan.fingerprints.cluster_spec:
        check_calibration(path)
        return path
    try:
        plan.check_compatible(cluster=cluster_of(plan).with_calibration(path))
    except PlanError as err:
        raise PlanError(f"--calibration {path}: {err}; plan with `autoshard plan ... --calibration {path}` "
                        "first") from None
    return path


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise LaunchError(f"no script to run; usage: {_USAGE}")
    if command[0] == "-m":
        if len(command) < 2:
            raise LaunchError(f"'-m' needs a module name; usage: {_USAGE.replace('SCRIPT', '-m MODULE')}")
        return
    if not Path(command[0]).is_file():
        raise LaunchError(f"script {command[0]!r} is not a file; give the path of a Python script, or '-m MODULE'")


def _check_nodes(
    nnodes: int, node_rank: int | None, rdzv_endpoint: str | None, master_addr: str | None, master_port: int | None
) -> None:
    """The node and rendezvous options make one launch (module docstring, step 3), or a ``LaunchError``."""
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes} must be at least 1")
    if node_rank is not None and nnodes == 1:
        raise LaunchError(f"--node-rank {node_rank} needs --nnodes N (N > 1, the number of nodes); "
                          "a one-node launch takes neither")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} must be in [0, {nnodes}) for --nnodes {nnodes}")
    if rdzv_endpoint is not None and master_addr is not None:
        raise LaunchError("--rdzv-endpoint (c10d rendezvous) and --master-addr (static rendezvous) exclude each "
                          "other; give one")
    if master_port is not None and master_addr is None:
        raise LaunchError(f"--master-port {master_port} needs --master-addr HOST (the node of --node-rank 0)")
    if nnodes > 1 and rdzv_endpoint is None and master_addr is None:
        raise LaunchError(
            f"--nnodes {nnodes} needs a rendezvous: --rdzv-endpoint HOST:PORT (the same on every node, e.g. the "
            "first node's address and a free port), or --master-addr HOST with --node-rank R"
        )
    if master_addr is not None and nnodes > 1 and node_rank is None:
        raise LaunchError(f"--master-addr {master_addr} (static rendezvous) needs --node-rank R on each node, "
                          f"R in [0, {nnodes})")
    if rdzv_endpoint is not None and ":" not in rdzv_endpoint:
        raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint!r} must be HOST:PORT, e.g. node0:29400")


def _nproc_per_node(plan: Any, plan_path: Path, nnodes: int, forced: int | None) -> int:
    """Processes per node: ``forced``, or the plan's world over ``nnodes``; a launch of another world is refused."""
    world = plan.mesh.world_size
    if forced is not None:
        if forced < 1:
            raise LaunchError(f"--nproc-per-node {forced} must be at least 1")
        if forced * nnodes != world:
            nodes = f"{nnodes} node{'s' if nnodes > 1 else ''}"
            raise PlanError(
                f"plan {plan_path} needs world {world} (mesh {_mesh_axes(plan.mesh)}); this launch gives {nodes} "
                f"× {forced} = {forced * nnodes}; leave out --nproc-per-node (default: world / --nnodes), or "
                f"search a plan for {forced * nnodes} ranks"
            )
        return forced
    if world % nnodes:
        raise LaunchError(
            f"plan {plan_path} needs world {world} (mesh {_mesh_axes(plan.mesh)}), which --nnodes {nnodes} does "
            f"not divide; use a node count that divides {world}, or search a plan for {nnodes} nodes"
        )
    return world // nnodes


def _mesh_axes(mesh: Any) -> str:
    """The mesh axes of degree > 1, e.g. ``dp_shard=2 tp=2`` (``str(mesh)`` also lists the 1s)."""
    return " ".join(f"{axis}={getattr(mesh, axis)}" for axis in MESH_AXES if getattr(mesh, axis) > 1) or "1 rank"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


EXIT_INTERNAL = 1
EXIT_USER_ERROR = 2


def launch(spec: LaunchSpec, *, debug: bool = False) -> int:
    """Run the ranks of ``spec``, watch them, report their errors once; returns 0, 1 or 2 (module docstring).

    ``debug`` also shows torchrun's log and ``ChildFailedError`` and every
    rank's own traceback.
    """
    run_dir = Path(tempfile.mkdtemp(prefix="autoshard-run-"))
    env = {**os.environ, **spec.env, RUN_DIR_ENV: str(run_dir)}
    if debug:
        env[DEBUG_ENV] = "1"
    try:
        agent = subprocess.Popen(list(spec.argv), env=env, preexec_fn=die_with_parent)
        try:
            stalled = _supervise(agent, run_dir, spec.timeout_s)
        except BaseException:  # Ctrl-C or an error here: take the ranks down with us
            _stop_job(agent, run_dir)
            raise
        lines, code = _outcome(run_dir, agent.returncode, stalled, spec.timeout_s)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass(frozen=True)
class _Stall:
    """A rank whose heartbeat is older than the timeout."""

    rank: str
    pid: int
    silent_s: float
    state: str  # /proc state letter: T = stopped, D = uninterruptible sleep, ...


def _supervise(agent: subprocess.Popen, run_dir: Path, timeout: float) -> _Stall | None:
    """Wait for ``agent``; when a rank's heartbeat is older than ``timeout``, kill the job and return that rank."""
    poll_s = min(0.5, timeout / 10)
    while True:
        try:
            agent.wait(timeout=poll_s)
            return None
        except subprocess.TimeoutExpired:
            pass
        stall = _stalled_rank(run_dir, timeout, agent.pid)
        if stall is not None:
            _stop_job(agent, run_dir)
            return stall


def _rank_files(run_dir: Path) -> list[tuple[str, int, float]]:
    """(rank, pid, seconds since the last heartbeat) of every rank that has not finished."""
    ranks, now = [], time.time()
    for path in run_dir.glob("rank-*.alive"):
        try:
            pid, age = int(path.read_text()), now - path.stat().st_mtime
        except (OSError, ValueError):  # removed or being written: a rank that just finished or started
            continue
        ranks.append((path.name[len("rank-") : -len(".alive")], pid, age))
    return ranks


def _child_state(pid: int, parent: int) -> str | None:
    """The /proc state letter of ``pid`` when it is a live child of ``parent``; None otherwise (gone, zombie, reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    state, ppid = fields[0], int(fields[1])
    return None if ppid != parent or state in "ZX" else state


def _stalled_rank(run_dir: Path, timeout: float, agent_pid: int) -> _Stall | None:
    for rank, pid, age in sorted(_rank_files(run_dir), key=lambda r: -r[2]):
        if age <= timeout:
            break
        state = _child_state(pid, agent_pid)
        if state is not None:
            return _Stall(rank, pid, age, state)
    return None


def _stop_job(agent: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL every live rank of ``agent`` and ``agent`` itself (a stopped rank ignores anything milder)."""
    for _, pid, _ in _rank_files(run_dir):
        if _child_state(pid, agent.pid) is not None:
            os.kill(pid, signal.SIGKILL)
    agent.kill()
    agent.wait()


def _outcome(run_dir: Path, agent_code: int, stall: _Stall | None, timeout: float) -> tuple[list[str], int]:
    """The lines to print and the exit code of a finished job (module docstring, "errors")."""
    if stall is not None:
        how = "stopped (SIGSTOP)" if stall.state in "Tt" else "alive but not running Python"
        return [f"autoshard: error: rank {stall.rank}: no heartbeat for {stall.silent_s:.0f} s, its process "
                f"{stall.pid} is {how}; stopped the job ({TIMEOUT_ENV}={timeout:g})"], EXIT_INTERNAL
    errors = _read_errors(run_dir)
    user = [e for e in errors if e["user"]]
    if user:  # the other ranks' errors are consequences (a peer that left mid-collective)
        return _fold(user), EXIT_USER_ERROR
    if errors:  # the earliest is the cause; later ones are usually peers losing it mid-collective
        first = errors[0]
        lines = _fold([e for e in errors if e["message"] == first["message"]])
        others = len(errors) - sum(e["message"] == first["message"] for e in errors)
        if others:
            lines[0] += f" ({others} other rank{'s' if others > 1 else ''} failed after it; --debug shows each)"
        return [first["traceback"].rstrip(), *lines], EXIT_INTERNAL
    if agent_code == 0:
        return [], 0
    return [_failure_line(run_dir, agent_code)], EXIT_INTERNAL


def _read_errors(run_dir: Path) -> list[dict[str, Any]]:
    """The error records of the ranks, earliest first."""
    records = []
    for path in run_dir.glob("rank-*.error.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r["time"])


def _fold(errors: list[dict[str, Any]]) -> list[str]:
    """One line per distinct message, naming its ranks, in order of first occurrence."""
    ranks: dict[str, list[str]] = {}
    for record in errors:
        ranks.setdefault(record["message"], []).append(str(record["rank"]))
    lines = []
    for message, names in ranks.items():
        names = sorted(names, key=lambda r: int(r) if r.isdigit() else -1)
        label = f"rank {names[0]}" if len(names) == 1 else f"ranks {','.join(names)}"
        lines.append(f"autoshard: error: {label}: {message}")
    return lines


def _failure_line(run_dir: Path, agent_code: int) -> str:
    """A rank died without an error record (killed, or exited non-zero by itself): the first such, from torchrun."""
    try:
        failures = json.loads((run_dir / AGENT_FILE).read_text())["failures"]
    except (OSError, ValueError, KeyError):
        return f"autoshard: error: torchrun exited with code {agent_code} (rerun with --debug for its log)"
    first = min(failures, key=lambda f: (f["signal"] == "SIGTERM", f["time"]))  # torchrun SIGTERMs the rest
    how = f"killed by {first['signal']}" if first["signal"] else f"exited with code {first['exitcode']}"
    return f"autoshard: error: rank {first['rank']}: {how} (its own output, if any, is above)"


# --------------------------------------------------------------------------- CLI


class _OptionParser(argparse.ArgumentParser):
    """Re-parses options written after PLAN.json; errors become ``LaunchError``."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise LaunchError(f"{message}; usage: {_USAGE}")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``autoshard run`` (without the positional arguments)."""
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1); processes per node = plan world size / N")
    parser.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node's index in [0, N) (multi-node; static rendezvous needs it)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="P", help="force processes per node; must give the plan's world size (checked)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous address, the same on every node (required with N > 1)")
    parser.add_argument("--rdzv-backend", default="c10d", metavar="NAME", help="torchrun rendezvous backend (default c10d)")
    parser.add_argument("--rdzv-id", default="autoshard", metavar="ID", help="job id shared by the nodes of one run (default 'autoshard')")
    parser.add_argument("--master-addr", default=None, metavar="HOST", help="static rendezvous instead of c10d: the address of node 0 (with --node-rank on every node)")
    parser.add_argument("--master-port", type=int, default=None, metavar="PORT", help="static rendezvous port on --master-addr (default 29500)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K", help="restart the workers up to K times on failure (torchrun elastic; default 0)")
    parser.add_argument("--calibration", default=None, metavar="CAL.json", help="a file of 'autoshard cluster calibrate' that autoshard.compile on the ranks applies to its cluster (checked before the launch)")
    parser.add_argument("--profile", default=None, metavar="DIR", help="record each rank's second program.step with torch.profiler to DIR/step.rank<R>.trace.json (for 'autoshard report --measured')")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and environment, start nothing")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument of ``autoshard run`` (an ``autoshard.cli.Command`` ``arguments`` function)."""
    add_run_options(parser)
    parser.add_argument("plan", metavar="PLAN.json", help="the plan to run (written by 'autoshard plan')")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]", help="the training script and its arguments, after '--' ('-m MODULE' for a module)")


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``run`` on an argparse subparsers action; the handler is ``run_main``."""
    parser = subparsers.add_parser("run", help="launch a training script for a plan through torchrun", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.set_defaults(handler=run_command)
    return parser


def _split_command(args: argparse.Namespace) -> list[str]:
    """The script part of ``args.command``; options written between PLAN.json and '--' are parsed into ``args``."""
    command = list(args.command)
    if command[:1] == ["--"]:
        return command[1:]
    if command and command[0].startswith("-") and command[0] != "-m":
        if "--" not in command:
            raise LaunchError(f"put '--' between the options and the script: {_USAGE}")
        cut = command.index("--")
        parser = _OptionParser(prog="autoshard run", add_help=False)
        add_run_options(parser)
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
        parser.parse_args(command[:cut], namespace=args)
        return command[cut + 1 :]
    return command


def run_main(args: argparse.Namespace) -> int:
    """Handle parsed ``autoshard run`` arguments: validate, build, launch; returns the exit code."""
    command = _split_command(args)
    spec = build_launch(
        args.plan,
        command,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        calibration=args.calibration,
        profile=args.profile,
    )
    if args.dry_run:
        env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
        print(f"{env} {subprocess.list2cmdline(spec.argv)}")
        return 0
    return launch(spec, debug=getattr(args, "debug", False))


def run_command(args: argparse.Namespace, console: Any = None) -> int:
    """``run_main`` with the ``(args, console)`` signature of an ``autoshard.cli`` handler."""
    return run_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m autoshard.runtime.launch``); user errors print one line, exit 2."""
    parser = _OptionParser(prog="autoshard run", description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    try:
        return run_main(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except AutoshardError as err:
        print(f"autoshard: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "CALIBRATION_ENV",
    "CHILD_MODULE",
    "DEFAULT_TIMEOUT_S",
    "EXIT_INTERNAL",
    "EXIT_USER_ERROR",
    "PLAN_ENV",
    "TIMEOUT_ENV",
    "LaunchError",
    "LaunchSpec",
    "add_run_arguments",
    "add_run_options",
    "add_run_parser",
    "build_launch",
    "check_world",
    "launch",
    "main",
    "plan_from_env",
    "run_command",
    "run_main",
]
