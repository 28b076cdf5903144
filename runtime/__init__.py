"""Runtime: mesh and process groups, per-rank program, sharded optimizer (``build_program``).

``build_program``, ``Program`` and ``StepResult`` are imported lazily: importing one runtime
module (the launcher, checkpoints, metrics) does not load the passes and the program behind them.
``BuildOptions`` and its enums (``runtime/build_options.py``) import no torch.
"""

from autoshard.runtime.build_options import BuildOptions, Compile, Overlap, Regions

_LAZY = {"Program", "StepResult", "build_program", "compile_allowed"}


def __getattr__(name: str):
    if name in _LAZY:
        from autoshard.runtime import program

        return getattr(program, name)
    raise AttributeError(f"module 'autoshard.runtime' has no attribute {name!r}")


__all__ = ["BuildOptions", "Compile", "Overlap", "Program", "Regions", "StepResult", "build_program", "compile_allowed"]
