"""``runtime/compile_regions.py``: where the per-rank graph is cut into compiled regions (no compiler needed)."""

from __future__ import annotations

import copy

import pytest
import torch

from _harness import run_gloo_cases
from _runtime_cases import graph_of, make_plan
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime import BuildOptions, build_program
from autoshard.runtime.compile_regions import insert_region_breaks, region_of
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # spawned gloo ranks

SPEC = "llama:tiny"  # 2 blocks


def _regions(rank, world_size):
    plan = make_plan(SPEC, Mesh(dp_shard=2), lambda _name: {"state": "zero2"})
    program = build_program(build(SPEC), graph_of(SPEC), plan, TrainSpec(global_batch=8, seq_len=8),
                            options=BuildOptions(compile=False))
    tokens = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    expected = program.gm(tokens)
    out = {}
    for mode in ("stem", "block"):
        gm = copy.deepcopy(program.gm)
        breaks = insert_region_breaks(gm, mode)
        nodes = list(gm.graph.nodes)
        cuts = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target is torch._dynamo.graph_break]
        after = [next(region_of(n) for n in nodes[i + 1:] if n.op == "call_function" and region_of(n) is not False)
                 for i in cuts]
        same = all(torch.equal(a, b) for a, b in zip(gm(tokens), expected, strict=True))
        out[mode] = {"breaks": breaks, "after": after, "same": same, "again": insert_region_breaks(gm, mode)}
    return out


@pytest.fixture(scope="module")
def regions():
    return run_gloo_cases({"regions": _regions}, 2, timeout_s=300)["regions"][0]


def test_stem_cuts_once_before_the_first_block(regions):
    assert regions["stem"]["breaks"] == 1 and regions["stem"]["after"] == ["blocks.0"]


def test_block_cuts_before_every_block_and_after_the_last(regions):
    assert regions["block"]["breaks"] == 3 and regions["block"]["after"] == ["blocks.0", "blocks.1", None]


@pytest.mark.parametrize("mode", ["stem", "block"])
def test_breaks_change_nothing_eager_and_are_inserted_once(regions, mode):
    assert regions[mode]["same"] and regions[mode]["again"] == 0
