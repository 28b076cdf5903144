"""``BuildOptions`` (``runtime/build_options.py``): enum fields that take their members, their values or (for
``compile``) a bool, and refuse anything else naming the allowed values; ``build_program`` takes nothing else."""

from __future__ import annotations

import inspect

import pytest

from autoshard.errors import PlanError
from autoshard.runtime import BuildOptions, Compile, Overlap, Regions


def test_defaults_are_the_products():
    options = BuildOptions()
    assert (options.compile, options.regions, options.overlap, options.backend) == (
        Compile.AUTO, Regions.STEM, Overlap.PLAN, "inductor")
    assert not (options.overlap_grad_sync or options.track_memory or options.release_model)


@pytest.mark.parametrize("given, want", [(True, Compile.ON), (False, Compile.OFF), ("off", Compile.OFF),
                                         (Compile.AUTO, Compile.AUTO)])
def test_compile_takes_members_values_and_bools(given, want):
    assert BuildOptions(compile=given).compile is want


def test_strings_become_members():
    options = BuildOptions(regions="graph", overlap="reorder")
    assert options.regions is Regions.GRAPH and options.overlap is Overlap.REORDER


@pytest.mark.parametrize("field, value, allowed", [
    ("compile", "yes", "['auto', 'on', 'off', 'True', 'False']"),
    ("regions", "layer", "['stem', 'block', 'graph']"),
    ("overlap", None, "['plan', 'scheduler', 'reorder', 'none']"),
])
def test_bad_values_name_the_allowed_ones(field, value, allowed):
    with pytest.raises(PlanError, match=f"BuildOptions.{field}={value!r}: allowed {allowed}".replace("[", r"\[")):
        BuildOptions(**{field: value})


def test_build_program_takes_options_not_loose_keywords():
    from autoshard.runtime.program import build_program

    parameters = inspect.signature(build_program).parameters
    assert "options" in parameters and "cluster" not in parameters
    assert not {"compile_graph", "compile_regions", "compile_overlap", "compile_backend", "overlap_grad_sync",
                "track_memory", "release_model"} & set(parameters)
