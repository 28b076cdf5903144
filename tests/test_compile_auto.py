"""``compile_allowed``: what ``BuildOptions.compile`` auto (the default) compiles.

CUDA devices with ep = cp = 1 compile, ZeRO-3, mixed and pipeline (pp > 1) plans included; the CPU,
expert and context parallelism stay eager. The compiled paths themselves are tested in
``test_compile_program.py`` and (pipelines) ``test_compile_pipeline.py``.
"""

from __future__ import annotations

import pytest

from _runtime_cases import make_plan
from autoshard.plan import Mesh
from autoshard.runtime import compile_allowed

SPEC = "llama:tiny"


@pytest.mark.parametrize("mesh, state, device, expected", [
    (Mesh(dp_shard=2), "zero2", "cuda", True),
    (Mesh(dp_shard=2), "zero2", "cuda:1", True),
    (Mesh(dp_shard=2), "zero2", "cpu", False),
    (Mesh(dp_shard=2), "zero3", "cuda", True),
    (Mesh(dp_shard=2), "zero3", "cpu", False),
    (Mesh(dp_shard=2), "offload", "cuda", True),
    (Mesh(pp=2), "replicate", "cuda", True),
    (Mesh(pp=2), "replicate", "cpu", False),
    (Mesh(pp=2, dp_shard=2), "zero3", "cuda", True),
    (Mesh(pp=2, dp_shard=2, ep=2), "replicate", "cuda", False),
    (Mesh(dp_shard=2, ep=2), "replicate", "cuda", False),
    (Mesh(cp=2), "replicate", "cuda", False),
])
def test_compile_allowed(mesh, state, device, expected):
    plan = make_plan(SPEC, mesh, lambda _name: {"state": state})
    assert compile_allowed(plan, device) is expected


def test_mixed_zero3_plan_compiles():
    plan = make_plan(SPEC, Mesh(dp_shard=2), lambda name: {"state": "zero3" if name.endswith("mlp") else "zero1"})
    assert compile_allowed(plan, "cuda")
