"""How ``build_program`` builds and runs a rank's program, beyond the plan: ``BuildOptions``.

| field | values | default | what |
| --- | --- | --- | --- |
| ``compile`` | ``Compile.AUTO`` / ``ON`` / ``OFF`` | ``AUTO`` | trace forward and backward jointly with ``torch.compile``; ``AUTO`` compiles where ``compile_allowed`` (a CUDA device, a plan with ep = cp = 1) |
| ``regions`` | ``Regions.STEM`` / ``BLOCK`` / ``GRAPH`` | ``STEM`` | where the compiled graph is cut (``runtime/compile_regions.py``) |
| ``overlap`` | ``Overlap.PLAN`` / ``SCHEDULER`` / ``REORDER`` / ``NONE`` | ``PLAN`` | the compiled graph's communication overlap: what ``schedule_overlap`` chose for the plan, or a fixed mode |
| ``backend`` | a ``torch.compile`` backend name or callable | ``"inductor"`` | the CPU tests use ``"aot_eager"`` (the same joint graph and partition, no code generation) |
| ``overlap_grad_sync`` | bool | False | reduce DP gradient buckets during the last micro-batch's backward (pp = 1; ``runtime/optimizer.py``) |
| ``track_memory`` | bool | False | on a CPU, count live bytes during the build (``Program.memory_report``; CUDA builds always report) |
| ``release_model`` | bool | False | swap each model parameter for a meta tensor once read |

The enums are ``str`` enums: ``BuildOptions(compile="off", regions="graph")`` is the same as passing the
members, and ``compile=True`` / ``False`` mean ``ON`` / ``OFF``. Anything else raises ``PlanError`` naming
the allowed values. No torch import here: the CLI reads these before torch loads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoshard.errors import PlanError


class Compile(str, enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Regions(str, enum.Enum):
    STEM = "stem"
    BLOCK = "block"
    GRAPH = "graph"


class Overlap(str, enum.Enum):
    PLAN = "plan"
    SCHEDULER = "scheduler"
    REORDER = "reorder"
    NONE = "none"


def _member(kind: type[enum.Enum], value: Any, field: str) -> Any:
    if kind is Compile and isinstance(value, bool):
        return Compile.ON if value else Compile.OFF
    try:
        return kind(value)
    except ValueError:
        allowed = [m.value for m in kind] + (["True", "False"] if kind is Compile else [])
        raise PlanError(f"BuildOptions.{field}={value!r}: allowed {allowed}") from None


@dataclass(frozen=True)
class BuildOptions:
    """``build_program``'s options (module docstring)."""

    compile: Compile = Compile.AUTO
    regions: Regions = Regions.STEM
    overlap: Overlap = Overlap.PLAN
    backend: str | Callable = "inductor"
    overlap_grad_sync: bool = False
    track_memory: bool = False
    release_model: bool = False

    def __post_init__(self) -> None:
        for field, kind in (("compile", Compile), ("regions", Regions), ("overlap", Overlap)):
            object.__setattr__(self, field, _member(kind, getattr(self, field), field))


__all__ = ["BuildOptions", "Compile", "Overlap", "Regions"]
