"""The one place autoshard tests touch PyTorch's private distributed test helpers.

Three tiers of distributed tests (DESIGN.md, "Tests"), one entry point each:

| entry point | processes | ranks | computes? | use for |
| --- | --- | --- | --- | --- |
| ``fake_world(n, rank)`` | 1 | 1 real, n pretended | no (collectives return garbage) | building per-rank programs, meshes and shapes at 8-1024 ranks |
| ``local_ranks(n)`` | 1 | n simulated | yes (``LocalTensorMode``) | sharded numerics of DTensor / functional-collective code |
| ``run_gloo(fn, n)`` | n | n real | yes (gloo) | anything that needs real processes (FSDP2, custom collectives, hangs) |
| ``run_nccl(fn, n)`` | n | n real, one GPU each | yes (NCCL) | GPU tests only (marker ``gpu``); skips without n GPUs |

Only this file imports ``torch.testing._internal`` and ``torch.distributed._local_tensor``
for tests: when they move, only this file changes. (``kernels/collectives.py``
registers its ops' ``LocalTensorMode`` rules itself, guarded.) Test modules
import it as ``from _harness import run_gloo``: pytest's default ``prepend``
import mode puts ``tests/`` on ``sys.path``; keep ``tests/`` free of an
``__init__.py``.

[Note: spawned jobs are expensive]
A spawned gloo job costs a process per rank (start-up under a second with the
forkserver, note "forkserver"), a rendezvous and the results pickled back. Group
many checks into one job with ``run_gloo_cases`` and fan the results out to
small pytest tests with a module-scoped fixture (see ``tests/test_harness.py``).

[Note: importing ``fn`` in the child]
``fn`` and every argument are pickled by reference: ``fn`` must be a module-level
function (``functools.partial`` of one works). The child takes the parent's
``sys.path`` and environment as they are when the job starts, before it
unpickles ``fn``; under pytest's default ``prepend`` import mode the ``tests/``
folder is on that path, so functions defined in ``tests/test_*.py`` import in
the child as they do in the parent.

[Note: forkserver]
Workers are started by the ``forkserver`` method: one server process per test
session imports torch, ``torch.distributed``, dynamo and autoshard once
(``_PRELOAD``), and every rank of every job is a fork of it that has not run a
single op (no intra-op threads yet, no process group, no CUDA). A fresh
``spawn`` paid that import in every rank of every job (about 2.5 s of CPU each,
more than most cases) and the interpreter's teardown after it (seconds for a
process that compiled graphs); a forked rank leaves with ``os._exit`` once
multiprocessing has flushed its queue, as fork children do. The server also
exports the reference models most jobs build (``_export_warm``), so a rank's
``build_program`` of them copies that graph instead of running ``torch.export``
(``runtime/export_cache.py``; ~90% of a tiny model's build). What ``spawn``
gave a child fresh is handed over per job instead: ``sys.path``, the
environment (``OMP_NUM_THREADS=1`` among it) and ``fn`` pickled by the parent.

[Note: kernels in ranks]
Ranks run the quantization kernels' pure-torch reference, not the Triton kernels under the
interpreter (``TRITON_INTERPRET=0`` in their environment; ``kernels/ops.py`` decides per call): the
interpreter costs about 0.1-0.3 s of a core per launch, most of a quantized job's time, and the two
are bit-identical (``tests/test_kernels.py`` checks it over sizes, formats and NaN policies). A job
that tests the Triton kernels themselves across ranks opts in with ``with interpreted_kernels():``.

[Note: deadlines]
``timeout_s`` is both the gloo timeout of every collective (a hung collective
raises inside the child, whose traceback then reaches the parent) and the
wall-clock limit of ``fn`` itself, counted once every rank has joined the
process group; the parent allows ``_GRACE_S`` more before it kills the job and
raises ``TimeoutError``. Start-up (interpreter, imports, the wait for every
rank in the file store) has its own limit, ``_STARTUP_S``, so a short
``timeout_s`` cannot fail a slow start on a loaded machine. Nothing here can
hang CI.

[Note: where a job's time goes]
With ``AUTOSHARD_TEST_CPU_LOG=FILE`` every rank appends one JSON line per case of a ``run_gloo_cases``
job (the CPU seconds the case took on that rank) and one per finished job (the rank's CPU seconds since
its fork), each with the pytest test that started the job. CPU time, not wall: two cores shared by two
pytest workers and their ranks stretch every wall clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:  # torch >= 2.11: backend "fake" is registered by importing this module.
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError:  # pragma: no cover - depends on the installed torch
    FakeStore = None

try:  # Present in torch 2.11 and 2.13 (both tested); private, so it may move.
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
except ImportError:  # pragma: no cover - depends on the installed torch
    LocalTensor = LocalTensorMode = None

HAS_FAKE_PG = FakeStore is not None
HAS_LOCAL_TENSOR = LocalTensorMode is not None

CPU_LOG_ENV = "AUTOSHARD_TEST_CPU_LOG"  # note "where a job's time goes"
_STARTUP_S = 180.0  # spawn + import torch + rendezvous, on two busy cores; a session's first job also waits
# for the forkserver's preload (imports and ``_export_warm``: ~30 s on an idle core)
_GRACE_S = 10.0  # lets gloo's own timeout error (more informative) arrive first
_POLL_S = 0.05


# --------------------------------------------------------------------------- fake world


def _require_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists in this process; "
            "fake_world/local_ranks need a fresh one: exit the enclosing world first"
        )


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world_size`` ranks in this one process.

    Initialises the default process group with the ``fake`` backend over a
    ``FakeStore``: groups, ``DeviceMesh`` and DTensor placement logic work at any
    size, collectives return without communicating (their outputs are garbage).
    Use it to build per-rank programs and check shapes; destroys the group on exit.
    """
    if not HAS_FAKE_PG:
        pytest.skip("this torch has no fake process group (torch.testing._internal.distributed.fake_pg)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, {world_size}); pick a rank below world_size")
    _require_no_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- local ranks


@dataclass(frozen=True)
class LocalRanks:
    """All ``world_size`` ranks held in one process by ``LocalTensorMode``.

    A "per-rank tensor" is a ``LocalTensor``: one plain tensor per simulated rank.
    Every op on it runs once per rank; collectives (c10d and functional) combine
    the ranks' tensors as a real process group would.
    """

    world_size: int
    mode: Any  # LocalTensorMode; typed loosely because older torch lacks it

    def per_rank(self, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """A per-rank tensor whose shard on rank ``r`` is ``make(r)`` (built outside the mode)."""
        return self.mode.rank_map(make)

    def replicated(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-rank tensor holding an independent copy of ``tensor`` on every rank."""
        return self.per_rank(lambda _rank: tensor.detach().clone())

    def shards(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The plain tensors each rank holds, in rank order (waits on async collective results)."""
        wait = getattr(tensor, "wait", None)  # AsyncCollectiveTensor from functional collectives
        if wait is not None:
            tensor = wait()
        if not isinstance(tensor, LocalTensor):
            raise TypeError(f"expected a per-rank LocalTensor, got {type(tensor).__name__}")
        return [tensor._local_tensors[r] for r in range(self.world_size)]


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[LocalRanks]:
    """Simulate ``world_size`` ranks in this process: fake process group + ``LocalTensorMode``.

    Skips the calling test when this torch has no ``LocalTensorMode``. Build
    models outside the context and give each parameter per-rank copies before
    building an optimizer (else one update applies once per simulated rank).
    """
    if not HAS_LOCAL_TENSOR:
        pytest.skip("this torch has no torch.distributed._local_tensor.LocalTensorMode")
    with fake_world(world_size, rank=0):
        with LocalTensorMode(world_size) as mode:
            yield LocalRanks(world_size=world_size, mode=mode)


# --------------------------------------------------------------------------- real gloo jobs


class RankFailedError(RuntimeError):
    """A spawned rank died or raised an exception that could not be sent back as itself."""


class _RemoteTraceback(Exception):
    """Carries a child's formatted traceback as the ``__cause__`` of the re-raised error."""

    def __str__(self) -> str:
        return self.args[0]


def _join_world(rank: int, world_size: int, backend: str, init_file: str, timeout_s: float) -> None:
    """Wait (up to ``_STARTUP_S``) until every rank has started, then init ``backend`` with ``timeout_s``.

    Ranks start seconds apart on a loaded machine; waiting on the store first
    keeps a short collective timeout from failing the rendezvous itself.
    """
    store = dist.FileStore(init_file, world_size)
    store.set_timeout(timedelta(seconds=_STARTUP_S))
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(world_size)])
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, as torchrun's LOCAL_RANK would pick
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def _worker(rank, world_size, backend, init_file, timeout_s, results, parent, job) -> None:
    """Child body: take the parent's path and environment, join the process group, run ``fn``, post
    ``(rank, kind, payload)``. ``parent`` is ``(sys.path, os.environ)``; ``job`` is ``(fn, args, kwargs)``
    pickled (note "importing ``fn`` in the child")."""
    sys.path[:], environ = parent
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    try:
        fn, args, kwargs = pickle.loads(job)
        _join_world(rank, world_size, backend, init_file, timeout_s)
        results.put((rank, "ready", None))
        value = fn(rank, world_size, *args, **kwargs)
        _log_cpu(rank, world_size, job=getattr(fn, "__name__", repr(fn)), cpu_s=time.process_time())
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        text = f"rank {rank} of {world_size}:\n{traceback.format_exc()}"
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001 - unpicklable exception: send text only
            blob = None
        results.put((rank, "error", (text, blob)))
        return
    # A failed rank skips this: it exits at once so its peers' collectives fail fast.
    dist.destroy_process_group()


_RANKS_INTERPRET_KERNELS = False


@contextlib.contextmanager
def interpreted_kernels() -> Iterator[None]:
    """Jobs started inside run the Triton kernels under the interpreter when the parent does (note "kernels in ranks")."""
    global _RANKS_INTERPRET_KERNELS
    saved, _RANKS_INTERPRET_KERNELS = _RANKS_INTERPRET_KERNELS, True
    try:
        yield
    finally:
        _RANKS_INTERPRET_KERNELS = saved


def _child_environ() -> dict[str, str]:
    """The environment a job's ranks take (note "kernels in ranks")."""
    environ = dict(os.environ)
    if not _RANKS_INTERPRET_KERNELS:
        environ["TRITON_INTERPRET"] = "0"
    return environ


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    """Children inherit ``OMP_NUM_THREADS=1`` (read when they import torch), and the forkserver this
    folder on ``PYTHONPATH``: Python 3.11's forkserver ignores the parent's ``sys.path``, and its
    preload skips a module it cannot import (``_harness``, ``_export_warm``) without a word."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH")
    changes = {"OMP_NUM_THREADS": "1", "PYTHONPATH": here if not path else f"{here}{os.pathsep}{path}"}
    old = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _raise_rank_error(text: str, blob: bytes | None) -> None:
    if blob is None:
        raise RankFailedError(text)
    exc = pickle.loads(blob)
    raise exc from _RemoteTraceback(text)


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    """Drain the result queue until every rank answered, one failed, or a deadline passed."""
    start = time.monotonic()
    deadline = start + _STARTUP_S + timeout_s
    ready: set[int] = set()
    values: dict[int, Any] = {}
    while len(values) < world_size:
        if time.monotonic() > deadline:
            phase = "running fn" if len(ready) == world_size else f"starting ({len(ready)} ready)"
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(
                f"{world_size}-rank job exceeded its deadline while {phase}; "
                f"ranks {missing} never returned (timeout_s={timeout_s}): raise timeout_s "
                "if the job is legitimately long, else look for a collective some rank skipped"
            )
        try:
            rank, kind, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            _check_alive(procs, values)
            continue
        if kind == "ready":
            ready.add(rank)
            if len(ready) == world_size:
                deadline = time.monotonic() + timeout_s + _GRACE_S
        elif kind == "ok":
            values[rank] = pickle.loads(payload)
        else:
            _raise_rank_error(*payload)
    return [values[r] for r in range(world_size)]


def _check_alive(procs, values: Mapping[int, Any]) -> None:
    for rank, proc in enumerate(procs):
        if proc.exitcode not in (None, 0) and rank not in values:
            raise RankFailedError(
                f"rank {rank} exited with code {proc.exitcode} before returning a result "
                "(a negative code is a signal: -6 abort, -9 kill, -11 segfault)"
            )


def _stop(procs, *, graceful: bool) -> None:
    """After success, let the children finish their exit; after a failure, kill them at once."""
    if graceful:
        for proc in procs:
            proc.join(timeout=10.0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()


# What the forkserver imports once for every rank (note "forkserver"): an import that fails is skipped.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "autoshard.models", "autoshard.passes",
            "autoshard.runtime", "autoshard.search.cost_model", "_harness", "_export_warm"]


def _context():
    """The ``forkserver`` context; the server starts (and preloads) with the first job, under
    ``_single_threaded_children``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _spawn(fn, world_size: int, backend: str, args, kwargs, timeout_s: float) -> list[Any]:
    """Start ``world_size`` children of ``_worker``, collect their results, always clean up."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx = _context()
    results = ctx.Queue()
    job = pickle.dumps((fn, args, kwargs))
    procs = []
    with tempfile.TemporaryDirectory(prefix="autoshard_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ok = False
        try:
            with _single_threaded_children():
                for rank in range(world_size):
                    proc = ctx.Process(
                        target=_worker,
                        args=(rank, world_size, backend, init_file, timeout_s, results,
                              (list(sys.path), _child_environ()), job),
                        daemon=True,
                    )
                    proc.start()
                    procs.append(proc)
            values = _collect(procs, results, world_size, timeout_s)
            ok = True
            return values
        finally:
            _stop(procs, graceful=ok)
            results.close()


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` real gloo processes.

    Returns each rank's (picklable) result in rank order. The first exception
    raised by any rank is re-raised here with its original type when it pickles
    (``RankFailedError`` otherwise); its ``__cause__`` carries that rank's
    traceback text. A rank that dies silently raises ``RankFailedError``; a job
    past its deadline (module note "deadlines") raises ``TimeoutError``. Every
    child is joined or killed before this returns.
    """
    return _spawn(fn, world_size, "gloo", args, kwargs, timeout_s)


def run_nccl(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120, **kwargs: Any) -> list[Any]:
    """``run_gloo`` on NCCL, rank r on ``cuda:r`` (the current device); GPU tests only.

    Skips the calling test when fewer than ``world_size`` CUDA devices exist.
    Return CPU tensors from ``fn``: the parent need not touch the children's GPUs.
    """
    _require_gpus(world_size)
    return _spawn(fn, world_size, "nccl", args, kwargs, timeout_s)


def _require_gpus(world_size: int) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < world_size or not dist.is_nccl_available():
        pytest.skip(f"needs {world_size} CUDA devices and NCCL; this machine has {available} devices")


# --------------------------------------------------------------------------- many cases, one job


class CaseFailedError(RuntimeError):
    """One named case of a ``run_gloo_cases`` job raised; the job stops there."""


def _log_cpu(rank: int, world_size: int, **fields: Any) -> None:
    """One line of note "where a job's time goes", when ``AUTOSHARD_TEST_CPU_LOG`` names a file."""
    path = os.environ.get(CPU_LOG_ENV)
    if path:
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST"), "rank": rank, "world": world_size, **fields}
        with open(path, "a") as log:
            log.write(json.dumps(line) + "\n")


def _run_cases(rank: int, world_size: int, cases: Mapping[str, Callable[[int, int], Any]]) -> dict[str, Any]:
    """Child body of ``run_gloo_cases``: every case in order, in lockstep on every rank."""
    out = {}
    for name, case in cases.items():
        try:
            start = time.process_time()
            out[name] = case(rank, world_size)
            _log_cpu(rank, world_size, case=name, cpu_s=time.process_time() - start)
        except Exception as exc:
            # The other ranks may be blocked in this case's collectives: stop the job.
            raise CaseFailedError(f"case {name!r} failed on rank {rank}: {type(exc).__name__}: {exc}") from exc
    return out


def run_gloo_cases(
    cases: Mapping[str, Callable[[int, int], Any]], world_size: int, *, timeout_s: float = 120
) -> dict[str, list[Any]]:
    """Run many named cases in ONE spawned gloo job; return ``{name: [result per rank]}``.

    Each case is called as ``case(rank, world_size)`` on every rank, in the
    mapping's order, so their collectives line up. The first failing case stops
    the job and raises ``CaseFailedError`` naming it. Cases must be picklable by
    reference (module-level functions or ``functools.partial`` of them).
    """
    per_rank = run_gloo(_run_cases, world_size, dict(cases), timeout_s=timeout_s)
    return _by_case(cases, per_rank)


def run_nccl_cases(
    cases: Mapping[str, Callable[[int, int], Any]], world_size: int, *, timeout_s: float = 180
) -> dict[str, list[Any]]:
    """``run_gloo_cases`` on NCCL (GPU tests only; skips without ``world_size`` GPUs)."""
    per_rank = run_nccl(_run_cases, world_size, dict(cases), timeout_s=timeout_s)
    return _by_case(cases, per_rank)


def _by_case(cases: Mapping[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {name: [rank_results[name] for rank_results in per_rank] for name in cases}


__all__ = [
    "HAS_FAKE_PG",
    "HAS_LOCAL_TENSOR",
    "CaseFailedError",
    "LocalRanks",
    "RankFailedError",
    "fake_world",
    "interpreted_kernels",
    "local_ranks",
    "run_gloo",
    "run_gloo_cases",
    "run_nccl",
    "run_nccl_cases",
]


@contextlib.contextmanager
def no_hang(seconds: int = 10):
    """Fail (instead of hanging the suite) when the body blocks, e.g. opening a FIFO: SIGALRM after ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Tiny matmuls: one intra-op thread is ~10x faster than two on a shared 2-core machine. A module that
    imports this fixture (``from _harness import one_intra_op_thread``) runs every test with one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
