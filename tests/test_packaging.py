"""Layout contract: the four stage folders install as autoshard.* subpackages, nothing top-level."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAGES = ("passes", "kernels", "search", "runtime")


def test_stage_folders_import_as_subpackages():
    for stage in STAGES:
        mod = importlib.import_module(f"autoshard.{stage}")
        assert Path(mod.__file__).resolve().parent == REPO / stage


def test_top_level_layout_exists():
    for name in ("autoshard", *STAGES, "tests", "benchmarks", "docs", "pyproject.toml", "README.md",
                 "Makefile", ".ci/run"):
        assert (REPO / name).exists(), name


@pytest.mark.slow
def test_built_wheel_maps_stage_folders(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("autoshard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"autoshard"}, f"unexpected top-level entries in the wheel: {sorted(top)}"
    for stage in STAGES:
        assert f"autoshard/{stage}/__init__.py" in names, stage
    assert "autoshard/search/cost_model.py" in names
    assert "autoshard/models/__init__.py" in names
