"""Capture, part 0: the forward's inputs — which are tensors, and which of their dims are batch and sequence.

[Note: model inputs]
A forward may take tensors besides the tokens: a padding mask, position ids, the document
(segment) ids of packed rows. The contract, shared by capture and the runtime's ``Program``:

* ``example_inputs`` is a tuple (``model(*example_inputs)``) or a dict of keywords
  (``model(**example_inputs)``), bound against ``forward``'s signature. The value of
  forward's first parameter is the tokens ``[B, S]`` (dim 0 batch, dim 1 sequence).
* Every other tensor input is per row, dim 0 of size ``B`` (the program splits it over
  data-parallel ranks and micro-batches with the tokens' rows), or broadcast over the batch,
  dim 0 of size 1 or no dims (every rank and micro-batch gets it whole; not with pp > 1). Any
  dim >= 1 of size ``S`` is a sequence dim (resized by capture, dynamic in the program); every
  other dim is static. Keep ``B != S`` in the example, or a ``[B, ...]`` input reads as ``[S, ...]``.
* ``None`` and defaults are not inputs: the program is built for the example's set of tensors
  and refuses a call without one of them or with a tensor the example did not have, naming it.
  Other non-tensor values (flags) are captured as given but cannot reach a program: make them
  the model's default.

Decision: capture passes every input positionally (defaults filled in for keywords the example
skipped) because its saved-activation measurement calls ``model(*inputs)``; the runtime exports
the leading tensors positionally and the rest by keyword, so a skipped ``None`` never becomes a
graph input (``export_call``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from autoshard.errors import AutoshardError, CaptureError, PlanError

BATCH, SEQ = "batch", "seq"


@dataclass(frozen=True)
class InputSpec:
    """One tensor input: forward parameter ``name``, dtype (``None``: any; the default tokens), and per dim
    ``"batch"``, ``"seq"`` or a static size."""

    name: str
    dtype: torch.dtype | None
    dims: tuple[int | str, ...]
    keyword: bool = False  # passed by keyword (it follows a skipped parameter)

    @property
    def batched(self) -> bool:
        """Whether dim 0 is the batch (split with the tokens' rows); else broadcast over the batch."""
        return bool(self.dims) and self.dims[0] == BATCH

    def meta_example(self, batch: int, seq: int) -> torch.Tensor:
        """A zero tensor on meta with ``batch`` rows and sequence ``seq``."""
        shape = [batch if d == BATCH else seq if d == SEQ else d for d in self.dims]
        return torch.zeros(shape, dtype=self.dtype or torch.long, device="meta")

    def dynamic_shape(self) -> dict[int, Any] | None:
        dynamic = {d: Dim.AUTO for d, kind in enumerate(self.dims) if kind in (BATCH, SEQ)}
        return dynamic or None

    def check(self, value: Any, batch: int, seq: int) -> None:
        """``AutoshardError`` naming this input when ``value`` does not fit it for tokens ``[batch, seq]``."""
        if not isinstance(value, torch.Tensor):
            raise AutoshardError(f"input {self.name!r} is a {type(value).__name__}; the program was captured with a "
                                 f"{self._shape_text()} {self.dtype} tensor there")
        want = [batch if d == BATCH else seq if d == SEQ else d for d in self.dims]
        if list(value.shape) != want or self.dtype not in (None, value.dtype):
            raise AutoshardError(
                f"input {self.name!r} is {value.dtype} {tuple(value.shape)}; for tokens [{batch}, {seq}] the program "
                f"takes {self.dtype} {tuple(want)} ({self._shape_text()}, as in example_inputs)"
            )

    def _shape_text(self) -> str:
        return "[" + ", ".join("B" if d == BATCH else "S" if d == SEQ else str(d) for d in self.dims) + "]"


@dataclass(frozen=True)
class ModelInputs:
    """The tensor inputs of a forward, in signature order; ``tensors[0]`` is the tokens (module docstring)."""

    tensors: tuple[InputSpec, ...]
    params: tuple[str, ...] = ()  # forward's positional parameter names (binding a call)
    flags: tuple[str, ...] = ()  # non-tensor example values other than the parameter's default

    @property
    def tokens(self) -> InputSpec:
        return self.tensors[0]

    @property
    def names(self) -> tuple[str, ...]:
        """The tensor inputs' names: the program's (and each pipeline stage's) user inputs, in order."""
        return tuple(spec.name for spec in self.tensors)

    @staticmethod
    def tokens_only(model: nn.Module) -> ModelInputs:
        """The default: a forward of token ids ``[B, S]`` alone (forward's first parameter)."""
        params = _positional_params(model)
        return ModelInputs((InputSpec(params[0] if params else "tokens", None, (BATCH, SEQ)),), params)

    def export_call(self, batch: int, seq: int) -> tuple[tuple, dict, tuple]:
        """``(args, kwargs, dynamic_shapes)`` for ``torch.export.export`` on meta zeros of ``batch`` rows and ``seq``;
        ``PlanError`` for an example the program cannot take (a flag, a skipped unnamed input)."""
        if self.flags:
            raise PlanError(f"example input {self.flags[0]!r} is not a tensor and not forward's default: a program's "
                            "inputs are tensors; make the value the model's default (or an attribute)")
        unnamed = [s.name for s in self.tensors if s.keyword and s.name not in self.params]
        if unnamed:
            raise PlanError(f"example input {unnamed[0]!r} follows a None and has no parameter name to pass it by; "
                            "give forward named parameters")
        args = tuple(s.meta_example(batch, seq) for s in self.tensors if not s.keyword)
        kwargs = {s.name: s.meta_example(batch, seq) for s in self.tensors if s.keyword}
        return args, kwargs, tuple(s.dynamic_shape() for s in self.tensors)  # args, then kwargs: the tensors' order

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The call ``forward(*args, **kwargs)`` as ``{input name: tensor}``, checked (``check``)."""
        names = self.params or self.names
        if len(args) > len(names):
            raise AutoshardError(f"{len(args)} positional inputs; the program takes {len(self.tensors)}: "
                                 f"{', '.join(self.names)}")
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in given:
                raise AutoshardError(f"input {name!r} given twice (by position and by keyword)")
            given[name] = value
        return self.check({name: value for name, value in given.items() if value is not None})

    def check(self, given: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``given`` ({name: tensor}) in input order, after checking it holds exactly the captured tensor inputs,
        each of the captured dtype and shape for the tokens' ``[B, S]``."""
        tokens = given.get(self.tokens.name)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise AutoshardError(f"the tokens {self.tokens.name!r} [B, S] are missing; the program takes "
                                 f"{', '.join(self.names)}")
        missing = [name for name in self.names if name not in given]
        extra = [name for name in given if name not in self.names]
        if missing:
            raise AutoshardError(f"input {missing[0]!r} is missing: the program was captured with "
                                 f"{', '.join(self.names)} (pass all of them)")
        if extra:
            raise AutoshardError(f"input {extra[0]!r} was not in example_inputs: the program takes "
                                 f"{', '.join(self.names)}; capture with {extra[0]!r} to use it")
        batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
        for spec in self.tensors:
            spec.check(given[spec.name], batch, seq)
        return {name: given[name] for name in self.names}

    def check_pipeline(self) -> None:
        """``PlanError`` unless every input can be split into micro-batches by a pipeline schedule."""
        broadcast = [s.name for s in self.tensors if not s.batched]
        if broadcast:
            raise PlanError(f"input {broadcast[0]!r} is broadcast over the batch (dim 0 is not B): a pipeline "
                            "schedule (pp > 1) splits every input into micro-batches; expand it to [B, ...] "
                            "or search with pp=1")


def bind_example(model: nn.Module, example_inputs: tuple | Mapping) -> tuple[tuple, ModelInputs]:
    """``example_inputs`` (a tuple or a dict of keywords) as positional values for capture, and their
    ``ModelInputs``; ``CaptureError`` naming what does not fit the contract (module docstring)."""
    params = _positional_params(model)
    if isinstance(example_inputs, Mapping):
        values, names = _from_keywords(model, params, dict(example_inputs))
    else:
        values = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        names = tuple(params[i] if i < len(params) else f"input_{i}" for i in range(len(values)))
    tokens = values[0] if values else None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        got = f"tensor of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise CaptureError(
            f"example_inputs[0] is a {got}; capture needs tokens [B, S] as the first input "
            "(dim 0 batch, dim 1 sequence): pass example_inputs=(tokens,)"
        )
    batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
    defaults = _defaults(model)
    specs, flags, skipped = [], [], False
    for name, value in zip(names, values):
        if isinstance(value, torch.Tensor):
            specs.append(InputSpec(name, value.dtype, _dims(name, value, batch, seq, first=not specs), keyword=skipped))
            continue
        skipped = True
        if value is not None and not _is_default(value, defaults.get(name, inspect.Parameter.empty)):
            flags.append(name)
    return values, ModelInputs(tuple(specs), params, tuple(flags))


def _dims(name: str, value: torch.Tensor, batch: int, seq: int, first: bool) -> tuple[int | str, ...]:
    if first:
        return (BATCH, SEQ, *value.shape[2:])
    rows = int(value.shape[0]) if value.dim() else 1
    if rows not in (batch, 1):
        raise CaptureError(
            f"example input {name!r} has {rows} rows (dim 0) but the tokens have {batch}: every tensor input is "
            f"[B, ...] with the tokens' B (or [1, ...] to broadcast over the batch); pass {name!r} for every row"
        )
    head = (BATCH,) if value.dim() and rows == batch else tuple(value.shape[:1])
    return (*head, *(SEQ if size == seq else int(size) for size in value.shape[1:]))


def _positional_params(model: nn.Module) -> tuple[str, ...]:
    """Names of ``model.forward``'s parameters that can be given by position (``()`` without a signature)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in signature.parameters.values() if p.kind in kinds)


def _defaults(model: nn.Module) -> dict[str, Any]:
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _is_default(value: Any, default: Any) -> bool:
    plain = (bool, int, float, str, type(None))
    return value is default or (isinstance(value, plain) and isinstance(default, plain) and value == default)


def _from_keywords(model: nn.Module, params: tuple[str, ...], given: dict) -> tuple[tuple, tuple[str, ...]]:
    """Keyword example inputs in signature order, with defaults for the parameters skipped before the last one."""
    unknown = [name for name in given if name not in params]
    if unknown:
        raise CaptureError(
            f"example input {unknown[0]!r} is not a positional parameter of {type(model).__name__}.forward "
            f"({', '.join(params) or 'no signature'}); name the parameters forward takes"
        )
    if not params or params[0] not in given:
        first = params[0] if params else "the tokens"
        raise CaptureError(f"example_inputs has no {first!r}: forward's first parameter is the tokens [B, S]; "
                           f"pass it in the dict")
    signature = inspect.signature(model.forward).parameters
    last = max(params.index(name) for name in given)
    values = []
    for name in params[: last + 1]:
        default = signature[name].default
        if name not in given and default is inspect.Parameter.empty:
            raise CaptureError(f"example_inputs has no {name!r}, which {type(model).__name__}.forward requires")
        values.append(given.get(name, default))
    return tuple(values), params[: last + 1]


__all__ = ["InputSpec", "ModelInputs", "bind_example"]
