"""Property: the runtime accepts every plan the search returns.

Random reference models (dense, tied, MoE), cluster sizes and kinds, pins and communication
precision (seeded): whatever ``solve`` returns must build on every rank that the layout
distinguishes (``build_program`` under a fake process group: first and last rank), with no
``PlanError``. A search that refuses (``AutoshardError``: a contradictory pin, nothing fits) is
fine; a plan the runtime then refuses is the bug this test exists for.
"""

from __future__ import annotations

import random

import pytest

from _harness import fake_world
from autoshard.errors import AutoshardError
from autoshard.models import build
from autoshard.passes import capture
from autoshard.search import Constraints, solve
from autoshard.search.synthetic import synthetic_cluster
from autoshard.runtime import build_program
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # every case runs for seconds

MODELS = ("gpt:tiny", "llama:tiny", "moe:tiny")
PIN_CHOICES = {
    "state": ("replicate", "zero1", "zero2", "zero3", "offload"),
    "recompute": ("none", "selective", "full"),
    "tp": ("none", "megatron"),
    "grad_comm": ("bf16", "int8"),
}
SEEDS = range(8)


def _case(seed: int):
    rng = random.Random(seed)
    spec, world = rng.choice(MODELS), rng.choice((2, 4, 8))
    graph = capture(build(spec), seq_lens=(16, 32))
    pins = {}
    for _ in range(rng.randint(0, 2)):
        target = rng.choice([c.class_id for c in graph.layers] + [layer.name for layer in graph.layers])
        field = rng.choice(sorted(PIN_CHOICES))
        pins.setdefault(target, {})[field] = rng.choice(PIN_CHOICES[field])
    train = TrainSpec(global_batch=2 * world, seq_len=16, precision="fp32",
                      comm_precision=rng.choice(("exact", "auto")))
    cluster = synthetic_cluster(rng.choice(("cpu", "h100-sxm")), world)
    return spec, graph, cluster, train, Constraints(pin=pins)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_runtime_accepts_what_the_search_returns(seed):
    spec, graph, cluster, train, constraints = _case(seed)
    try:
        plan = solve(graph, cluster, train, constraints=constraints, time_limit_s=20)
    except AutoshardError:
        return  # refused with a reason: not a plan the runtime could refuse
    world = plan.mesh.world_size
    for rank in sorted({0, world - 1}):
        with fake_world(world, rank):
            build_program(build(spec), graph, plan, train)  # raises PlanError on a refused layout
