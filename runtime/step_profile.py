"""One training step recorded with ``torch.profiler`` and exported as a Chrome trace.

``autoshard ppo --profile`` records one step on every rank and writes ``<metrics stem>.rank<R>.trace.json``
next to the metrics file (``trace_path``). ``autoshard run --profile DIR`` does the same for a user's
script: the launcher sets ``AUTOSHARD_PROFILE=DIR`` (``PROFILE_ENV``) and ``autoshard.compile`` wraps the
rank's ``program.step`` (``profile_program``), which writes ``DIR/step.rank<R>.trace.json``; ``autoshard report PLAN --measured FILE`` lays it beside the
predicted step. The step recorded is the run's second (``profiled_step``): the first pays one-time costs
(compilation, allocator warm-up, the first collectives' setup) that no later step repeats; a run of one
step records that one.

Activities: the CPU always (ATen ops, autoshard's collectives under ``autoshard::<name>``,
``kernels/collectives.py``), CUDA kernels too on a GPU rank. Nothing is recorded outside that step.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

import torch

from autoshard.runtime.launch import PROFILE_ENV  # set by ``autoshard run --profile DIR``


def trace_path(metrics: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace: ``run.jsonl`` → ``run.rank0.trace.json`` beside it."""
    metrics = Path(metrics)
    return metrics.with_name(f"{metrics.stem}.rank{rank}.trace.json")


def profiled_step(first_step: int, last_step: int) -> int:
    """The step to record of a run going from ``first_step`` to ``last_step`` (module docstring)."""
    return min(first_step + 1, last_step)


@contextlib.contextmanager
def record_step(path: str | Path, device: torch.device | str = "cpu") -> Iterator[None]:
    """Profile the body and export it as a Chrome trace at ``path`` (parents created)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))



def profile_program(program: Any, directory: str | Path, rank: int, device: torch.device | str = "cpu") -> Any:
    """``program`` with its ``step`` recording the second call (``profiled_step(1, 2)``: the first pays
    compilation) to ``directory/step.rank<rank>.trace.json``; every other call runs as before."""
    step = program.step
    path = Path(directory) / f"step.rank{rank}.trace.json"
    calls = 0

    @functools.wraps(step)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls != 2:
            return step(*args, **kwargs)
        with record_step(path, device):
            return step(*args, **kwargs)

    program.step = profiled
    return program


__all__ = ["PROFILE_ENV", "profile_program", "profiled_step", "record_step", "trace_path"]
