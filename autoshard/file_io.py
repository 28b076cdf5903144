"""Strict reading and atomic writing of the files autoshard owns.

Every file autoshard reads (plans, cluster and calibration files, metrics
JSON lines, checkpoint sidecars) goes through ``read_bounded_text`` and one of
the strict parsers; every small file it writes (plans, plots, calibration files) goes through
``atomic_write``. A refusal is one line, raised as the ``AutoshardError``
subclass of the file's kind (``FileKind.error``), so the CLI prints it and
exits 2; nothing here lets an ``OSError``, ``UnicodeDecodeError`` or
``RecursionError`` out.

Reading rules (``read_bounded_text``, ``parse_json_strict``, ``parse_yaml_strict``):

1. Regular files only. The path is ``os.stat``-ed (following symlinks) before
   it is opened: a directory, FIFO, socket or device (``/dev/zero``, or a
   symlink to one) is refused by name; it is never opened, so a FIFO cannot
   hang the reader. It is then opened ``O_NONBLOCK`` and ``fstat``-ed again,
   in case it was swapped in between.
2. A size limit per kind (table below); at most ``limit + 1`` bytes are read,
   so a file that grows while read is refused too.
3. UTF-8, strictly; the refusal names the first bad byte and its offset.
4. Nesting at most ``MAX_DEPTH`` (64) arrays/objects deep; deeper input is
   refused, never a ``RecursionError``.
5. Duplicate keys are refused (JSON: ``object_pairs_hook``; YAML: a
   ``SafeLoader`` subclass), as are JSON's non-standard ``NaN``/``Infinity``
   and YAML aliases (``*name``, which can multiply a small file into a huge
   value; autoshard's files never need them).

| kind | limit | why |
| --- | --- | --- |
| plan file | 16 MiB | a 1,000-layer plan with its fingerprints is well under 1 MiB |
| cluster / calibration file | 16 MiB | a few KiB; a calibration's layer samples well under 1 MiB |
| checkpoint sidecar | 64 MiB | one record per saved tensor plus the plan: ~100 B per tensor |
| metrics JSON lines | 256 MiB | ~1 KiB per step: 250k steps |

Required fields and value ranges are the readers' own checks (the plan
schema, ``Cluster.from_dict``); the one range shared by plans and clusters is
``MAX_WORLD_SIZE`` (2**20 ranks), far above any real job, so a mesh degree of
10**30 is refused as a typo instead of being multiplied out; a cluster's
``nodes × devices_per_node`` is bounded by it too. Integers (a plan's batch,
a cluster's bytes) are at most ``MAX_INT`` (2**63 - 1): what torch and numpy
index with.

Writing rules (``check_output_path``, ``atomic_write``): the target must be a
regular file or not exist, in an existing writable directory; a directory, a
FIFO, a device (``/dev/full``), an empty path or a missing/unwritable parent
is refused before anything is written, and a command checks its output path
this way before it starts its work (``autoshard plan -o``, ``cluster calibrate
--out``, ``ppo --metrics/--plot``). The data goes to
a unique temporary sibling (mode ``0o666`` minus the umask, as ``open`` would
create it), is fsync-ed and ``os.replace``-d over the target, so a reader
never sees half a file; a symlink to a regular file is written through (the
link is kept).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autoshard.errors import AutoshardError, ClusterError, PlanError

MiB = 2**20
MAX_DEPTH = 64  # arrays/objects nested in any file autoshard reads
MAX_WORLD_SIZE = 2**20  # ranks a plan's mesh or a cluster may describe
MAX_INT = 2**63 - 1  # largest integer any file autoshard reads may hold (torch and numpy index with int64)


@dataclass(frozen=True)
class FileKind:
    """One kind of file autoshard reads: its name in messages, its size limit and its error class."""

    noun: str
    """How messages name it: ``"plan file"``."""
    max_bytes: int
    """Largest accepted size (module table)."""
    error: type[AutoshardError]
    """Raised for every refusal, so callers keep their own error class."""
    hint: str
    """The next step, appended to every refusal."""
    syntax: str = "invalid {format}: {detail}"
    """How a parse error reads; ``{format}`` is JSON or YAML, ``{detail}`` the parser's message."""


PLAN_FILE = FileKind(
    "plan file", 16 * MiB, PlanError, "pass a plan JSON written by `autoshard plan -o` or Plan.save",
    syntax="not a valid JSON plan ({detail}); the file may be truncated",
)
CLUSTER_FILE = FileKind(
    "cluster file", 16 * MiB, ClusterError,
    "pass a .json/.yaml cluster file (schema: Cluster.from_dict), a calibration file written by "
    "`autoshard cluster calibrate`, or a preset string such as 'h100-sxm:2x8'",
)
CALIBRATION_FILE = FileKind(
    "calibration file", 16 * MiB, ClusterError,
    "pass the JSON file `autoshard cluster calibrate --out FILE` wrote (format: Cluster.with_calibration)",
)
METRICS_FILE = FileKind(
    "metrics file", 256 * MiB, AutoshardError, "pass the JSON-lines file a PPO run wrote (--metrics)",
)


class _Refusal(Exception):
    """Raised inside a parser hook; the strict parsers turn it into ``kind.error``."""


# ------------------------------------------------------------------- reading
def read_bounded_text(path: str | os.PathLike, kind: FileKind) -> str:
    """The UTF-8 text of the regular file ``path``, refused (``kind.error``) when it is not one,
    is larger than ``kind.max_bytes`` or is not UTF-8 (module rules 1-3)."""
    name = os.fspath(path)
    label = f"{kind.noun} {name!r}"
    data = _read_bounded_bytes(name, label, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise kind.error(f"cannot read {label}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                         f"{err.start}); save it as UTF-8; {kind.hint}") from None


def _read_bounded_bytes(name: str, label: str, kind: FileKind) -> bytes:
    if not name:
        raise kind.error(f"cannot read {kind.noun}: the path is empty; {kind.hint}")
    try:
        info = os.stat(name)  # before opening: opening a FIFO would block
    except FileNotFoundError:
        what = "it is a symbolic link to a missing file" if os.path.islink(name) else "it does not exist"
        raise kind.error(f"cannot read {label}: {what}; {kind.hint}") from None
    except OSError as err:
        raise kind.error(f"cannot read {label}: {err.strerror or err}; {kind.hint}") from None
    _check_regular(info.st_mode, info.st_size, label, kind)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            _check_regular(info.st_mode, info.st_size, label, kind)  # swapped since the stat
            data = f.read(kind.max_bytes + 1)
    except OSError as err:
        raise kind.error(f"cannot read {label}: {err.strerror or err}; {kind.hint}") from None
    if len(data) > kind.max_bytes:  # grew while read
        _too_large(len(data), label, kind)
    return data


def _check_regular(mode: int, size: int, label: str, kind: FileKind) -> None:
    if not stat.S_ISREG(mode):
        raise kind.error(f"cannot read {label}: it is {_describe_mode(mode)}, not a regular file; {kind.hint}")
    if size > kind.max_bytes:
        _too_large(size, label, kind)


def _too_large(size: int, label: str, kind: FileKind) -> None:
    raise kind.error(f"cannot read {label}: {size} bytes is over the {kind.max_bytes // MiB} MiB limit of a "
                     f"{kind.noun}; check that it is the right file; {kind.hint}")


def _describe_mode(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "a special file"


def load_json_strict(path: str | os.PathLike, kind: FileKind) -> Any:
    """``read_bounded_text`` + ``parse_json_strict``; messages name ``kind.noun`` and the path."""
    return parse_json_strict(read_bounded_text(path, kind), source=f"{kind.noun} {os.fspath(path)!r}", kind=kind)


def load_yaml_strict(path: str | os.PathLike, kind: FileKind) -> Any:
    """``read_bounded_text`` + ``parse_yaml_strict``; messages name ``kind.noun`` and the path."""
    return parse_yaml_strict(read_bounded_text(path, kind), source=f"{kind.noun} {os.fspath(path)!r}", kind=kind)


def parse_json_strict(text: str | bytes, *, source: str, kind: FileKind) -> Any:
    """Parse standard JSON (module rules 3-5); refusals read ``"{source}: {reason}; {hint}"``."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as err:
            raise kind.error(f"{source}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                             f"{err.start}); {kind.hint}") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _Refusal as err:
        raise kind.error(f"{source}: {err}; {kind.hint}") from None
    except RecursionError:
        raise kind.error(f"{source}: {_too_deep()}; {kind.hint}") from None
    except ValueError as err:  # JSONDecodeError; an integer over Python's digit limit
        detail = " ".join(str(err).split())
        raise kind.error(f"{source}: {kind.syntax.format(format='JSON', detail=detail)}; {kind.hint}") from None
    _check_depth(data, source, kind)
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refusal(f"duplicate key {key!r} in one object; give each key once")
            seen.add(key)
    return result


def _no_constant(name: str) -> Any:
    raise _Refusal(f"{name} is not standard JSON; write a finite number")


def _too_deep() -> str:
    return f"nested deeper than {MAX_DEPTH} levels of arrays/objects"


def _check_depth(data: Any, source: str, kind: FileKind) -> None:
    """Refuse a value nested deeper than ``MAX_DEPTH`` (iteratively: no recursion to overflow)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_DEPTH:
                    raise kind.error(f"{source}: {_too_deep()}; {kind.hint}")
                stack.append((child, depth + 1))


class _StrictYamlLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate keys, aliases and nesting deeper than ``MAX_DEPTH``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refusal(f"line {event.start_mark.line + 1}: the alias *{event.anchor} is not accepted; "
                           "write the value out")
        nested = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        self._depth += nested
        try:
            if self._depth > MAX_DEPTH:
                raise _Refusal(f"line {self.peek_event().start_mark.line + 1}: {_too_deep()}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= nested

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader refuses it below
                continue
            if duplicate:
                raise _Refusal(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}; give each key once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml_strict(text: str, *, source: str, kind: FileKind) -> Any:
    """Parse YAML with ``SafeLoader``'s types (module rules 4-5); refusals as ``parse_json_strict``'s."""
    try:
        return yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except _Refusal as err:
        raise kind.error(f"{source}: {err}; {kind.hint}") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise kind.error(f"{source}: {_too_deep()}; {kind.hint}") from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an int over Python's digit limit, a bad date
        detail = " ".join(str(err).split())
        raise kind.error(f"{source}: {kind.syntax.format(format='YAML', detail=detail)}; {kind.hint}") from None


# ------------------------------------------------------------------- writing
_WRITE_HINT = "give the path of a regular file (new or existing) in a writable directory"


def check_output_path(path: str | os.PathLike, *, noun: str = "file", error: type[AutoshardError] = AutoshardError,
                      parents: bool = False) -> Path:
    """The path ``atomic_write`` will replace (a symlink's target), refused now when it could not be
    written (module "Writing rules"). With ``parents``, missing directories are allowed when the
    nearest existing one is writable (``atomic_write`` creates them)."""
    name = os.fspath(path)
    if not name:
        raise error(f"cannot write {noun}: the path is empty; {_WRITE_HINT}")
    target = Path(os.path.realpath(name)) if os.path.islink(name) else Path(name)
    label = f"{noun} {name!r}"
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # the directory check says which
        mode = None
    except OSError as err:
        raise error(f"cannot write {label}: {err.strerror or err}; {_WRITE_HINT}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise error(f"cannot write {label}: it is {_describe_mode(mode)}, not a regular file; {_WRITE_HINT}")
    _check_directory(target.parent, label, error, parents)
    return target


def _check_directory(directory: Path, label: str, error: type[AutoshardError], parents: bool) -> None:
    directory = directory if str(directory) else Path(".")
    while parents and not os.path.lexists(directory) and directory != directory.parent:
        directory = directory.parent
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        raise error(f"cannot write {label}: its directory {str(directory)!r} does not exist; create it first, "
                    f"or {_WRITE_HINT}") from None
    except OSError as err:
        raise error(f"cannot write {label}: {err.strerror or err}; {_WRITE_HINT}") from None
    if not stat.S_ISDIR(mode):
        raise error(f"cannot write {label}: {str(directory)!r} is not a directory; {_WRITE_HINT}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise error(f"cannot write {label}: directory {str(directory)!r} is not writable; {_WRITE_HINT}")


def atomic_write(path: str | os.PathLike, data: str | bytes, *, noun: str = "file",
                 error: type[AutoshardError] = AutoshardError, parents: bool = False) -> Path:
    """Write ``data`` (text as UTF-8 with ``\\n`` newlines) to ``path`` atomically: a temporary
    sibling, fsync, ``os.replace`` (module "Writing rules"); returns ``path``."""
    target = check_output_path(path, noun=noun, error=error, parents=parents)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        if parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        # mode 0o666 minus the umask, as open() would; tempfile.mkstemp would make it owner-only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            check_output_path(target, noun=noun, error=error)  # still a regular file or nothing
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as err:
        raise error(f"cannot write {noun} {os.fspath(path)!r}: {err.strerror or err}; the file is unchanged "
                    "(nothing was replaced); free space or fix the directory and retry") from None
    _fsync_directory(target.parent)
    return Path(path)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable where the platform allows it (best effort)."""
    try:
        fd = os.open(directory if str(directory) else ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = [
    "CALIBRATION_FILE", "CLUSTER_FILE", "MAX_DEPTH", "MAX_INT", "MAX_WORLD_SIZE", "METRICS_FILE", "PLAN_FILE",
    "FileKind", "atomic_write", "check_output_path", "load_json_strict", "load_yaml_strict", "parse_json_strict",
    "parse_yaml_strict", "read_bounded_text",
]
