"""Typed, path-reporting validation for the plan dataclasses.

The plan records (``Mesh``, ``LayerStrategy``, ``Plan``, ...) derive from
``Record``. Each field's annotation *is* its schema; a field may add
``metadata={"choices": (...)}`` (an enum) or ``metadata={"minimum": n}``.
The same checks run in two places:

* ``Record.__post_init__``: a record built in code (by the solver, a test)
  is checked and normalised once: an ``Integral`` becomes ``int``, a ``Real``
  becomes a finite ``float``, a list becomes a tuple, a ``dict[str, Any]``
  becomes its JSON round trip. Then the record's ``_validate()`` checks
  cross-field rules.
* ``decode(cls, data, path)``: a JSON object is decoded field by field; every
  error names the JSON path of the bad value (``layers[3].state``). Unknown
  keys are refused (they are typos), and so are missing ones: a file holds
  every field (``Plan.save`` writes them all), so a missing ``global_batch``
  is a damaged file, not a request for the default. The exception is a
  record's ``OPTIONAL_ON_LOAD``: fields added after plan files were first
  written, which older files lack and which then take their defaults.
* ``transient`` fields (``SolverStats.wall_s``): facts of one run, not of the
  plan. ``encode`` leaves them out, so equal plans give equal bytes; ``decode``
  reads (and checks) them where older files hold them, else takes the default;
  they take no part in ``==`` (``compare=False``).

JSON types are strict: ``true`` is not an int, ``"3"`` is not an int, ``3.5``
is not an int; an int is accepted where a float is expected. Non-finite
floats (and ints too large for a float, ``10**400``) are refused because
standard JSON cannot hold them; ints must fit in 64 bits (``file_io.MAX_INT``).

Errors are ``PlanFieldError`` (a ``PlanError``) carrying ``path`` and
``reason``, so an error raised inside a nested record can be re-rooted under
the path of that record (``under``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import typing
from typing import Any

from autoshard.errors import PlanError
from autoshard.file_io import MAX_INT


class PlanFieldError(PlanError):
    """One bad field of a plan: ``path`` is its JSON path, ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}" if path else reason)

    def under(self, prefix: str) -> PlanFieldError:
        """The same error with ``prefix`` prepended to its path."""
        return PlanFieldError(join_path(prefix, self.path), self.reason)


def join_path(prefix: str, name: str) -> str:
    """``join_path("layers[3]", "stage") == "layers[3].stage"``; empty parts vanish."""
    if not prefix:
        return name
    if not name or name.startswith("["):
        return prefix + name
    return f"{prefix}.{name}"


def choice(default: Any, choices: tuple) -> Any:
    """A dataclass field whose value must be one of ``choices``."""
    return dataclasses.field(default=default, metadata={"choices": choices})


def at_least(default: Any, minimum: int) -> Any:
    """A dataclass field whose value must be ``>= minimum``."""
    return dataclasses.field(default=default, metadata={"minimum": minimum})


def transient(default: Any, minimum: int) -> Any:
    """A field ``>= minimum`` kept in memory only: not encoded, not compared, optional on load (module docstring)."""
    return dataclasses.field(default=default, compare=False, metadata={"minimum": minimum, "transient": True})


class Record:
    """Base of the plan dataclasses: checks and normalises fields on construction."""

    OPTIONAL_ON_LOAD: typing.ClassVar[frozenset[str]] = frozenset()
    """Fields ``decode`` lets a file omit (added after files were first written); others are required."""

    def __post_init__(self) -> None:
        for name, annotation, metadata in _field_specs(type(self)):
            value = getattr(self, name)
            # An exact str/int/bool or record type needs no normalising (a float may be inf/nan).
            if type(value) is not annotation or annotation is float:
                value = _check_type(value, annotation, name, decoding=False)
                object.__setattr__(self, name, value)
            if metadata:
                _check_metadata(value, metadata, name)
        self._validate()

    def _validate(self) -> None:
        """Cross-field rules; raise ``PlanFieldError`` with a path relative to this record."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _field_specs(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, annotation, metadata) of each field of record ``cls``."""
    hints = _hints(cls)
    return tuple((f.name, hints[f.name], f.metadata) for f in dataclasses.fields(cls))


def _describe(value: Any) -> str:
    """A short rendering of a bad value for an error message."""
    kind = {dict: "object", list: "array", tuple: "array", bool: "bool", type(None): "null"}.get(type(value))
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} {text}" if kind else text


def decode(cls: type, data: Any, path: str = "") -> Any:
    """Build record ``cls`` from a JSON object, reporting bad fields by JSON path."""
    if not isinstance(data, dict):
        raise PlanFieldError(path, f"expected an object, got {_describe(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PlanFieldError(path, f"unknown field {unknown[0]!r}; allowed: {tuple(fields)}")
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        sub = join_path(path, name)
        if name not in data:
            if name not in cls.OPTIONAL_ON_LOAD and not f.metadata.get("transient"):
                raise PlanFieldError(sub, "missing (required field)")
            continue
        kwargs[name] = _check_type(data[name], hints[name], sub, decoding=True)
        _check_metadata(kwargs[name], f.metadata, sub)
    try:
        return cls(**kwargs)
    except PlanFieldError as err:
        raise err.under(path) from None


def _check_metadata(value: Any, metadata: Any, path: str) -> None:
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise PlanFieldError(path, f"{value!r} not in {choices}")
    minimum = metadata.get("minimum")
    if minimum is not None and value < minimum:
        raise PlanFieldError(path, f"{value!r} must be >= {minimum}")


def _check_type(value: Any, annotation: Any, path: str, *, decoding: bool) -> Any:
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return _check_tuple(value, typing.get_args(annotation), path, decoding)
    if origin is dict:
        return _check_dict(value, typing.get_args(annotation), path, decoding)
    if annotation is Any:
        return _check_json_value(value, path)
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if decoding:
            return decode(annotation, value, path)
        raise PlanFieldError(path, f"expected {annotation.__name__}, got {_describe(value)}")
    return _check_scalar(value, annotation, path)


def _check_scalar(value: Any, annotation: Any, path: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            if not -MAX_INT - 1 <= value <= MAX_INT:
                raise PlanFieldError(path, f"{_describe(value)} is outside the 64-bit integer range")
            return int(value)
    elif annotation is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int such as 10**400
                number = math.inf
            if not math.isfinite(number):
                raise PlanFieldError(path, f"{_describe(value)} is not finite (JSON cannot hold it)")
            return number
    elif annotation is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema bug, not a user error
        raise AssertionError(f"unsupported annotation {annotation!r} at {path}")
    return _type_error(value, annotation.__name__, path)


def _type_error(value: Any, expected: str, path: str) -> typing.NoReturn:
    raise PlanFieldError(path, f"expected {expected}, got {_describe(value)}")


def _check_tuple(value: Any, args: tuple, path: str, decoding: bool) -> tuple:
    if not isinstance(value, (list, tuple)):
        _type_error(value, "an array", path)
    assert len(args) == 2 and args[1] is Ellipsis, f"only tuple[X, ...] is supported, got {args}"
    return tuple(_check_type(v, args[0], f"{path}[{i}]", decoding=decoding) for i, v in enumerate(value))


def _check_dict(value: Any, args: tuple, path: str, decoding: bool) -> dict:
    if not isinstance(value, dict):
        _type_error(value, "an object", path)
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise PlanFieldError(path, f"key {key!r} is not a string")
        out[key] = _check_type(item, args[1], join_path(path, key), decoding=decoding)
    return out


def _check_json_value(value: Any, path: str) -> Any:
    """Any JSON value; returned as its JSON round trip (tuples become lists)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False, sort_keys=True))
    except (TypeError, ValueError) as err:
        raise PlanFieldError(path, f"not representable as JSON: {err}") from None


def encode(value: Any) -> Any:
    """Record (or nested value) → plain JSON data: dicts, lists, scalars."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("transient")}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value
