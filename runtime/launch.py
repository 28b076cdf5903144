"""``autoshard run``: launch a training script for a plan through torchrun.

    autoshard run [OPTIONS] PLAN.json -- SCRIPT [ARGS...]
    autoshard run [OPTIONS] PLAN.json -- -m MODULE [ARGS...]

What it does, in order, before any process starts:

1. loads and validates ``PLAN.json`` (``Plan.load``: a ``PlanError`` one-liner
   naming the file and the bad field);
2. derives the processes per node: ``nproc_per_node = plan world size /
   --nnodes`` (``LaunchError`` when it does not divide); ``--nproc-per-node``
   forces a value, checked with ``check_world`` against the plan (so a
   mismatch fails here, not as a hung collective);
3. builds the torchrun (``torch.distributed.run``) command: single node
   without ``--rdzv-endpoint`` uses ``--standalone`` (a free local port);
   multi-node needs ``--rdzv-endpoint HOST:PORT`` (same on every node) and
   passes ``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-id``
   through; ``--max-restarts`` is torchrun's elastic restart count;
4. runs it in a child process with ``AUTOSHARD_PLAN=<absolute plan path>`` in
   the environment and ``OMP_NUM_THREADS=1`` when no CUDA device is visible
   and the variable is unset (gloo ranks share the CPU cores; torchrun would
   otherwise pick the same value with a warning). Returns torchrun's exit code.

Inside the script, ``plan_from_env()`` reads ``AUTOSHARD_PLAN`` and checks the
plan against the launched ``WORLD_SIZE`` before ``init_process_group``.

The CLI registers the command from this module (``add_run_arguments`` +
``run_command``, the shape of a ``autoshard.cli.Command`` row), or through
``add_run_parser(subparsers)`` + ``run_main(args)``; ``python -m
autoshard.runtime.launch`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError, PlanError

PLAN_ENV = "AUTOSHARD_PLAN"
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
    from autoshard.plan import Plan

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


def build_launch(
    plan_path: str | os.PathLike,
    command: Sequence[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    nproc_per_node: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "autoshard",
    max_restarts: int = 0,
    cuda_available: bool | None = None,
) -> LaunchSpec:
    """Validate the plan and arguments and build the torchrun command (module docstring, steps 1-3)."""
    from autoshard.plan import Plan

    plan_path = Path(plan_path).absolute()
    plan = Plan.load(plan_path)
    _check_command(command)
    _check_nodes(nnodes, node_rank, rdzv_endpoint)
    nproc = _nproc_per_node(plan, nnodes, nproc_per_node)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if rdzv_endpoint is None:
        torchrun.append("--standalone")
    else:
        torchrun += ["--node-rank", str(node_rank), "--rdzv-endpoint", rdzv_endpoint]
        torchrun += ["--rdzv-backend", rdzv_backend, "--rdzv-id", rdzv_id]
    torchrun += ["--max-restarts", str(max_restarts)]
    if command[0] == "-m":
        torchrun += ["--module", *command[1:]]
    else:
        torchrun += list(command)
    env = {PLAN_ENV: str(plan_path)}
    if cuda_available is None:
        cuda_available = _cuda_available()
    if not cuda_available and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return LaunchSpec(argv=tuple(torchrun), env=env, nproc_per_node=nproc, nnodes=nnodes)


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise LaunchError(f"no script to run; usage: {_USAGE}")
    if command[0] == "-m":
        if len(command) < 2:
            raise LaunchError(f"'-m' needs a module name; usage: {_USAGE.replace('SCRIPT', '-m MODULE')}")
        return
    if not Path(command[0]).is_file():
        raise LaunchError(f"script {command[0]!r} is not a file; give the path of a Python script, or '-m MODULE'")


def _check_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes} must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} must be in [0, {nnodes}) for --nnodes {nnodes}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise LaunchError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node, e.g. the first node's "
            "address and a free port)"
        )
    if rdzv_endpoint is not None and ":" not in rdzv_endpoint:
        raise LaunchError(f"--rdzv-endpoint {rdzv_endpoint!r} must be HOST:PORT, e.g. node0:29400")


def _nproc_per_node(plan: Any, nnodes: int, forced: int | None) -> int:
    world = plan.mesh.world_size
    if forced is not None:
        if forced < 1:
            raise LaunchError(f"--nproc-per-node {forced} must be at least 1")
        check_world(plan, forced * nnodes)
        return forced
    if world % nnodes:
        raise LaunchError(
            f"the plan's world size {world} ({plan.mesh}) is not divisible by --nnodes {nnodes}; "
            f"use a node count that divides {world}, or search a plan for {nnodes} nodes"
        )
    return world // nnodes


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(spec: LaunchSpec) -> int:
    """Run the torchrun command of ``spec`` and return its exit code (Ctrl-C reaches it too)."""
    env = {**os.environ, **spec.env}
    return subprocess.run(list(spec.argv), env=env, check=False).returncode


# --------------------------------------------------------------------------- CLI


class _OptionParser(argparse.ArgumentParser):
    """Re-parses options written after PLAN.json; errors become ``LaunchError``."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise LaunchError(f"{message}; usage: {_USAGE}")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``autoshard run`` (without the positional arguments)."""
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1); processes per node = plan world size / N")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's index in [0, N) (multi-node)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="P", help="force processes per node; must give the plan's world size (checked)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous address, the same on every node (required with N > 1)")
    parser.add_argument("--rdzv-backend", default="c10d", metavar="NAME", help="torchrun rendezvous backend (default c10d)")
    parser.add_argument("--rdzv-id", default="autoshard", metavar="ID", help="job id shared by the nodes of one run (default 'autoshard')")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K", help="restart the workers up to K times on failure (torchrun elastic; default 0)")
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
        max_restarts=args.max_restarts,
    )
    if args.dry_run:
        env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
        print(f"{env} {subprocess.list2cmdline(spec.argv)}")
        return 0
    return launch(spec)


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
    "PLAN_ENV",
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
