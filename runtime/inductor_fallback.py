"""Inductor with a way back from its distributed overlap passes.

The compiled runtime turns on inductor's overlap scheduler for plans with collectives in the graph
(``passes/schedule_overlap.compile_options``). Those passes are young: torch 2.11's fail on some
backward graphs in their own asserts (``merge_reduce_scatter_bucket``;
``_stable_topological_sort_impl`` with the scheduler's extra dependencies; the plans are in
``benchmarks/results/zoo_h200_2026-11-27/``), which stopped a run at its first backward with nothing
wrong in the plan.

``overlap_safe_backend(options, record)`` is a ``torch.compile`` backend equal to inductor with
``options``, except that each graph (forward and backward alike: compile_fx hands both to the
same ``inner_compile``) that fails inside one of those passes is compiled again without them
(``OVERLAP_OFF``), from a copy taken before the first attempt (a failed pass may have half rewritten
the graph). The graph then runs with inductor's default order: its collectives still start
asynchronously, only the reordering and bucketing are lost. Each fallback is logged as a warning
and appended to ``record`` (``Program.compile_options["fallbacks"]``), so a benchmark row shows it.
A failure anywhere else is raised as it was. Tested on the CPU with a stand-in compiler that fails
the same way (``tests/test_inductor_fallback.py``); not yet re-run on a GPU.
"""

from __future__ import annotations

import copy
import logging
import traceback
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# the files of inductor's distributed overlap passes: a failure raised from one of them is theirs
_OVERLAP_FILES = ("fx_passes/overlap_scheduling", "fx_passes/overlap_preserving_bucketer",
                  "fx_passes/overlap_manual_scheduling", "fx_passes/bucketing", "_inductor/comms.py")
OVERLAP_OFF = {"aten_distributed_optimizations.enable_overlap_scheduling": False,
               "aten_distributed_optimizations.collective_bucketing": False,
               "reorder_for_compute_comm_overlap": False}


def overlap_on(options: dict) -> bool:
    """Whether ``options`` turn on any of the passes ``OVERLAP_OFF`` turns off."""
    return any(options.get(key) for key in OVERLAP_OFF)


def raised_in_overlap_pass(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) was raised while one of inductor's overlap passes ran:
    a frame of its traceback is in one of their files."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame in traceback.extract_tb(exc.__traceback__):
            path = frame.filename.replace("\\", "/")
            if "torch/_inductor" in path and any(part in path for part in _OVERLAP_FILES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def overlap_safe_backend(options: dict, record: list, *, inner_compile: Callable | None = None) -> Callable:
    """A ``torch.compile`` backend: inductor with ``options`` and the fallback of the module docstring.

    ``inner_compile`` (tests): what compiles each graph, default ``compile_fx_inner``."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    compile_one = inner_compile or compile_fx_inner
    known_off = {key: value for key, value in OVERLAP_OFF.items() if _known(key)}

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if not overlap_on(_current(known_off)):
            return compile_one(gm, example_inputs, **kwargs)
        backup = copy.deepcopy(gm)
        try:
            return compile_one(gm, example_inputs, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is the overlap passes' own failure
            if not raised_in_overlap_pass(exc):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            graph = "backward" if kwargs.get("is_backward") else "forward"
            log.warning("inductor's overlap passes failed on a %s graph (%s: %s); compiling it without them "
                        "(collectives keep inductor's default order)", graph, type(exc).__name__, first)
            record.append(f"{graph}: {type(exc).__name__}: {first}"[:300])
            with torch._inductor.config.patch(known_off):
                return compile_one(backup, example_inputs, **kwargs)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=dict(options))

    return backend


def _known(key: str) -> bool:
    import torch._inductor.config as inductor_config

    return key in inductor_config.get_config_copy()


def _current(keys: dict) -> dict:
    import torch._inductor.config as inductor_config

    now = inductor_config.get_config_copy()
    return {key: now.get(key) for key in keys}


__all__ = ["OVERLAP_OFF", "overlap_on", "overlap_safe_backend", "raised_in_overlap_pass"]
