"""What runs inside the processes ``autoshard run`` / ``autoshard ppo`` start (``runtime/launch.py``).

Two roles, one module, no torch import until the role needs it:

- ``python -m autoshard.runtime.launch_child agent TORCHRUN_ARGS...``: torchrun's
  agent (``torch.distributed.run``) in a wrapper that dies with the launcher
  (``PR_SET_PDEATHSIG`` = SIGKILL), keeps torchrun's log quiet and, when a
  rank fails, writes the failures (rank, exit code or signal, time) to
  ``$AUTOSHARD_RUN_DIR/agent.json`` instead of raising ``ChildFailedError``
  (its traceback and log only with ``AUTOSHARD_DEBUG=1``, i.e. ``--debug``).
- ``python -m autoshard.runtime.launch_child rank SCRIPT ARGS...`` (or ``rank -m
  MODULE ARGS...``; torchrun starts this as each rank): dies with the agent
  (SIGKILL), touches ``$AUTOSHARD_RUN_DIR/rank-<RANK>.alive`` every
  ``min(1 s, timeout / 4)`` from a background thread (the launcher's
  watchdog), runs the script as ``__main__`` (``runpy``, as ``python SCRIPT``
  would) and records an exception that escapes it in
  ``rank-<RANK>.error.json``: ``user`` (an ``AutoshardError``: exit 2) or
  internal (anything else: exit 1, the traceback kept for the launcher).
  At the end it destroys a process group the script left initialised, stops
  and joins the heartbeat thread, runs the ``atexit`` handlers, flushes and
  leaves with ``os._exit`` (a C++ thread torn down by the interpreter's exit
  can abort a finished rank: ``runtime/ppo_program.py``'s ``__main__``).

Both roles hide other libraries' deprecation and torch-internal warnings
(``autoshard/quiet_warnings.py``) unless ``AUTOSHARD_DEBUG=1`` or warning
options (``PYTHONWARNINGS``) are set, so one warning is not printed by every rank.

Scripts that catch their own errors report them with ``record_rank_error``.
Without ``AUTOSHARD_RUN_DIR`` (plain torchrun) nothing is written and
``record_rank_error`` prints the one line itself.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Sequence

from autoshard.errors import AutoshardError
from autoshard.quiet_warnings import filter_third_party_warnings

RUN_DIR_ENV = "AUTOSHARD_RUN_DIR"  # the launcher's temporary directory of heartbeats and error files
TIMEOUT_ENV = "AUTOSHARD_TIMEOUT_S"
DEBUG_ENV = "AUTOSHARD_DEBUG"
DEFAULT_TIMEOUT_S = 300.0
AGENT_FILE = "agent.json"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits; exit now if it already has.

    No-op where ``prctl`` is missing (not Linux): there the launcher's watchdog
    and torchrun's own shutdown remain.
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        os._exit(1)


def timeout_s() -> float:
    """``AUTOSHARD_TIMEOUT_S`` as seconds (default ``DEFAULT_TIMEOUT_S``); ``ValueError`` unless positive."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise AutoshardError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S:g})")
    return value


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _run_dir() -> Path | None:
    path = os.environ.get(RUN_DIR_ENV)
    return Path(path) if path else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the launcher never reads half a file


def record_rank_error(err: BaseException) -> None:
    """Report ``err`` (raised on this rank) to the launcher; under plain torchrun print one line instead.

    An ``AutoshardError`` is a user error (the launcher exits 2), anything
    else internal (exit 1; its traceback is kept for the launcher to print).
    """
    user = isinstance(err, AutoshardError)
    message = " ".join(str(err).split()) or type(err).__name__
    if not user:
        message = f"{type(err).__name__}: {message}"
    run_dir = _run_dir()
    if run_dir is None or os.environ.get(DEBUG_ENV) == "1":
        print(f"autoshard: error (rank {_rank()}): {message}", file=sys.stderr, flush=True)
    if run_dir is None:
        return
    trace = "".join(traceback.format_exception(type(err), err, _script_frames(err.__traceback__)))
    record = {"rank": _rank(), "user": user, "message": message, "traceback": trace, "time": time.time()}
    _write_json(run_dir / f"rank-{_rank()}.error.json", record)


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the leading frames of this module and ``runpy``: the traceback starts in the script."""
    while tb is not None and tb.tb_next is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or "runpy" in tb.tb_frame.f_code.co_filename
    ):
        tb = tb.tb_next
    return tb


class Heartbeat:
    """A daemon thread touching ``rank-<RANK>.alive`` (which holds the pid) every ``interval_s``."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        path.write_text(str(os.getpid()))
        self._thread = threading.Thread(target=self._beat, name="autoshard-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                os.utime(self.path)
            except OSError:  # the launcher removed the run directory: it is gone or done
                return

    def stop(self) -> None:
        """Stop and join the thread, then remove the file (a finished rank is not a stalled one)."""
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)


def _run_target(command: Sequence[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``, as the python executable would."""
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path[0] = str(Path(command[0]).resolve().parent)
        runpy.run_path(command[0], run_name="__main__")


def _destroy_process_group() -> None:
    """Destroy a process group the script left initialised (before the interpreter exits)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _filter_warnings() -> None:
    filter_third_party_warnings(debug=os.environ.get(DEBUG_ENV) == "1")


def rank_main(command: Sequence[str]) -> int:
    """One rank: heartbeat, run ``command``, record what escapes it; returns the exit code (module docstring)."""
    die_with_parent()
    _filter_warnings()
    run_dir = _run_dir()
    heartbeat = None
    if run_dir is not None:
        heartbeat = Heartbeat(run_dir / f"rank-{_rank()}.alive", min(1.0, timeout_s() / 4))
    code = 0
    try:
        _run_target(command)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int) and done.code is not None:
            print(done.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException as err:  # noqa: BLE001 - every failure is reported, then the rank exits
        record_rank_error(err)
        if run_dir is None or os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        code = 2 if isinstance(err, AutoshardError) else 1
    try:
        _destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed job's group may not tear down; the exit code says enough
        code = code or 1
    if heartbeat is not None:
        heartbeat.stop()
    return code


def _quiet_torchrun_logs() -> None:
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def agent_main(torchrun_args: Sequence[str]) -> int:
    """torchrun's agent; on a rank failure writes ``agent.json`` and returns 1 (module docstring)."""
    die_with_parent()
    _filter_warnings()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    debug = os.environ.get(DEBUG_ENV) == "1"
    if not debug:
        _quiet_torchrun_logs()
    try:
        run(parse_args(list(torchrun_args)))
    except ChildFailedError as failed:
        run_dir = _run_dir()
        if run_dir is not None:
            failures = [
                {"rank": rank, "exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else "",
                 "time": f.timestamp}
                for rank, f in failed.failures.items()
            ]
            _write_json(run_dir / AGENT_FILE, {"failures": failures})
        if debug or run_dir is None:
            raise
        return 1
    return 0


def _exit(code: int) -> None:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    if role == "rank":
        _exit(rank_main(rest))
    elif role == "agent":
        _exit(agent_main(rest))  # torch's teardown adds seconds on a loaded machine and nothing else
    else:
        sys.exit(f"usage: python -m autoshard.runtime.launch_child {{agent TORCHRUN_ARGS | rank SCRIPT ARGS}}; got {role!r}")
