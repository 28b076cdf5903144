"""End to end, no mocks: ``autoshard.compile`` on 2 real gloo ranks trains like one plain PyTorch process.

Each rank calls ``autoshard.compile(model, "cpu:1x2", example_inputs=...)`` with the whole front door:
capture, the CP-SAT search (no pins, no given plan) and the per-rank build under the process group. The
built program trains 3 SGD steps (fp32, clipping on) of a tiny reference model; every rank's losses and
the parameters reassembled from the ranks' shards must equal single-device training of the same model on
the same batches (``tests/_runtime_cases.single_device``) at rtol 1e-5.
"""

from __future__ import annotations

import pytest

import autoshard
from _harness import run_gloo
from _runtime_cases import BATCH, OPT, SEQ, batches, check_against_reference, loss_fn, single_device
from autoshard.models import build
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # two spawned ranks, each capturing and searching

SPEC = "llama:tiny"
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32", optimizer=autoshard.SGD(lr=OPT.lr),
                  grad_clip=OPT.max_grad_norm)


def compile_and_train(rank, world_size):
    """One rank: compile from the model alone, train the steps; losses, local shards and the plan."""
    del rank, world_size
    steps = batches()
    compiled = autoshard.compile(build(SPEC), "cpu:1x2", example_inputs=(steps[0],), train=TRAIN,
                                 time_limit_s=20)
    program = compiled.program
    losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in steps]
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "plan": compiled.plan}


@pytest.fixture(scope="module")
def ranks():
    return run_gloo(compile_and_train, 2, timeout_s=300)


def test_every_rank_searched_the_same_plan(ranks):
    """The search is deterministic, so the ranks agree without communicating (``autoshard/api.py``)."""
    chosen = [(r["plan"].mesh, r["plan"].layers, r["plan"].schedule) for r in ranks]
    assert chosen[0][0].world_size == 2
    assert chosen[1] == chosen[0]


def test_compiled_training_equals_single_device(ranks):
    assert [len(r["losses"]) for r in ranks] == [len(batches())] * 2
    check_against_reference(ranks, single_device(SPEC), ranks[0]["plan"].mesh)
