"""Traces on disk: a process that captures a model already captured (by another rank, an earlier CLI
run, another test) reads its ``ModelGraph`` instead of exporting the model again; the runtime's own
exports can be kept here too (``runtime/export_cache.py``, note "on disk", which uses this module's
key, lock and atomic writes).

Capture is the slowest step of planning a small model (two ``torch.export`` traces and a measured
forward/backward on meta: 4-8 s of a CPU core for a 2-layer model), and every rank of a launch runs
the same capture before its deterministic search. Compilers keep such results across processes too
(inductor's FX graph cache); this one holds one pickled ``ModelGraph`` per key.

[Note: the key]
A SHA-256 of what capture's result depends on:
- the model's structure: its meta twin pickled as the export cache pickles it (every module's class
  and ``__dict__``: sizes, flags, the training flag, meta parameters and buffers with their dtypes),
  and the device type of its parameters (the saved-activation measurement runs on meta, or on the
  model's device when meta fails);
- the code: for every class in the module tree and its bases, the SHA-256 of the source file that
  defines it, the ``__version__`` of the top-level package it comes from (``transformers`` models
  call functions defined in other files), and every source file of autoshard itself;
- ``torch.__version__``, the example inputs (as meta tensors: shapes and dtypes) and capture's
  options (name, sequence lengths, batch, dynamic, whole-stack export).
What the key cannot see: code a ``forward`` calls that lives in a file other than its class's (a
helper module of the user's) and process-global state it reads. A stale entry misprices a plan; it
cannot change what a rank computes (the runtime exports the model itself). A class without a
source file (defined in ``exec`` or a notebook cell) and a twin that does not pickle get no key.

[Note: one process traces]
Ranks on one machine start together and capture the same model: each takes the entry's lock (an
``flock`` on ``KEY.lock`` beside it) before it traces, so the first traces and writes the entry while
the others wait, then read it. A process that dies releases its lock with its files. Without
``fcntl`` (Windows) there is no lock and each rank traces as before.

[Note: where]
``AUTOSHARD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/autoshard``, else ``~/.cache/autoshard``), folder
``capture/`` (``export/`` for the runtime's exports). ``AUTOSHARD_EXPORT_CACHE=0`` turns this off
with the per-process caches. Entries are written to a temporary name and renamed, so concurrent
ranks never read half a file; an entry that does not read back is ignored (and overwritten by the
next trace). Nothing is ever evicted: a capture entry is under 1 kB per layer (6 kB for the 12
layers of `llama:tiny`), an export entry the saved program (265 kB for `llama:tiny`).
Entries are pickles, so the folder is trusted as the code is (as inductor's cache is): do not point
``AUTOSHARD_CACHE_DIR`` at a folder that others can write.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, ranks may trace the same model at once
    fcntl = None

import torch
from torch import nn

from autoshard.graph import ModelGraph
from autoshard.passes._graph_utils import STRUCTURE_CACHE_ENV, meta_twin

log = logging.getLogger(__name__)

DIR_ENV = "AUTOSHARD_CACHE_DIR"
_FORMAT = 2  # bump when the entry's layout changes


def cache_dir(kind: str = "capture") -> Path | None:
    """The folder of ``kind``'s entries (note "where"): ``capture``, or ``export`` for the runtime's exports
    (``runtime/export_cache.py``, note "on disk"); None when caching is off."""
    if os.environ.get(STRUCTURE_CACHE_ENV, "1") == "0":
        return None
    root = os.environ.get(DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autoshard")
    return Path(root) / kind


def _file_digest(path: str) -> str:
    """SHA-256 of the file's bytes, read again when its size or modification time changed (an edited model file
    in a long-lived process, a notebook, is a new key)."""
    stat = os.stat(path)
    return _digest_of(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _digest_of(path: str, _mtime_ns: int, _size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def _own_source_digest() -> str:
    """SHA-256 over every source file of autoshard's five packages (their folders sit side by side)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in ("autoshard", "passes", "runtime", "search", "kernels"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(_file_digest(str(path)).encode())
    return digest.hexdigest()


def _class_code(cls: type) -> tuple[str, str, str, str | None] | None:
    """(module, qualname, source file digest, its package's version) of ``cls``; None without a source file."""
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None
    if path is None or not os.path.isfile(path):
        return None
    top = sys.modules.get(cls.__module__.split(".")[0])
    return cls.__module__, cls.__qualname__, _file_digest(path), str(getattr(top, "__version__", None))


def model_key(model: nn.Module, *extra: Any) -> str | None:
    """SHA-256 of ``model``'s structure and code (note "the key") and ``extra`` (inputs as meta tensors, options),
    the same in every process; None when a class has no source file or something does not pickle."""
    classes = {cls for module in model.modules() for cls in type(module).__mro__
               if cls not in (nn.Module, object) and cls.__module__ != "builtins"}
    code = []
    for cls in classes:
        found = _class_code(cls)
        if found is None:
            return None
        code.append(found)
    extra = torch.utils._pytree.tree_map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, extra)
    devices = sorted({t.device.type for t in [*model.parameters(), *model.buffers()]})
    try:
        blob = pickle.dumps((_FORMAT, meta_twin(model), devices, extra, sorted(code),
                             torch.__version__, _own_source_digest()), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything unpicklable: no key, so no cache
        return None
    return hashlib.sha256(blob).hexdigest()


def capture_key(model: nn.Module, example_inputs: Any, options: tuple) -> str | None:
    """The key of capturing ``model`` with these inputs and options (note "the key"), or None: not cached."""
    if cache_dir() is None:
        return None
    return model_key(model, example_inputs, options)


@contextlib.contextmanager
def locked(key: str | None, kind: str = "capture") -> Iterator[None]:
    """Hold the lock of ``key`` (note "one process traces"): ranks that trace the same model at once wait for the
    first, then read its entry. No lock without a key, a writable folder or ``fcntl`` (not on Windows)."""
    folder = cache_dir(kind)
    if key is None or folder is None or fcntl is None:
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / f"{key}.lock", "a+b")  # noqa: SIM115 - closed below, after the lock is released
    except OSError as exc:
        log.info("%s cache: no lock in %s (%s)", kind, folder, exc)
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # releases the lock (also when the process dies)


def load_bytes(key: str | None, kind: str, suffix: str) -> bytes | None:
    """The bytes stored under ``key``, or None (no key, caching off, no entry)."""
    folder = cache_dir(kind)
    if key is None or folder is None:
        return None
    try:
        return (folder / f"{key}{suffix}").read_bytes()
    except OSError:
        return None


def store_with(key: str | None, kind: str, suffix: str, write: Callable[[Any], None]) -> None:
    """``write(file)`` into the entry of ``key``, atomically (a temporary name renamed); a folder that cannot be
    written, or a ``write`` that fails, leaves no entry and a log line."""
    folder = cache_dir(kind)
    if key is None or folder is None:
        return
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:12]}-", suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, folder / f"{key}{suffix}")
    except Exception as exc:  # noqa: BLE001 - an entry that cannot be written is only a later miss
        log.info("%s cache: could not write %s (%s)", kind, key[:12], exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def load(key: str | None) -> ModelGraph | None:
    """The graph stored under ``key``, or None (no key, no entry, or an entry that does not read back)."""
    blob = load_bytes(key, "capture", ".pkl")
    if blob is None:
        return None
    try:
        graph = pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign entry is a miss
        log.info("capture cache: entry %s unreadable (%s); capturing again", key[:12], exc)
        return None
    return graph if isinstance(graph, ModelGraph) else None


def store(key: str | None, graph: ModelGraph) -> None:
    """Write ``graph`` under ``key`` (atomically; a folder that cannot be written is skipped with a log line)."""
    store_with(key, "capture", ".pkl", lambda handle: pickle.dump(graph, handle, protocol=pickle.HIGHEST_PROTOCOL))


__all__ = ["DIR_ENV", "cache_dir", "capture_key", "load", "load_bytes", "locked", "model_key", "store", "store_with"]
