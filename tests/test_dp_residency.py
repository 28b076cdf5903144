"""The residency a data-parallel form declares (``autoshard/data_parallel.py``, "Resident when") is what the
cost model prices: for every state, mesh, micro-batch count and compiled flag, the optimizer state,
the gathered parameters and the build region of ``search/layer_terms.layer_memory`` follow the form's
``optimizer``, ``gathered`` and ``build`` fields, and the passes' gathered-in-forward decision reads the
same field. (That the runtime holds these bytes is measured in ``tests/test_live_memory.py``.)"""

from __future__ import annotations

import itertools

import pytest

from autoshard.data_parallel import data_parallel_form
from autoshard.plan import LayerStrategy, Mesh
from autoshard.search import layer_terms
from autoshard.search.memory import StateBytes, model_state_memory

MESHES = [Mesh(dp_shard=1), Mesh(dp_shard=2), Mesh(dp_shard=4), Mesh(dp_shard=2, dp_replicate=2)]
STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
SIZES = StateBytes(param=2, grad=2, optimizer=12)
PSI = 1_000_000


def _cases():
    for state, mesh, m, compiled in itertools.product(STATES, MESHES, (1, 2), (False, True)):
        yield pytest.param(state, mesh, m, compiled, id=f"{state}-dp{mesh.dp_shard}x{mesh.dp_replicate}-m{m}-{'c' if compiled else 'e'}")


@pytest.mark.parametrize("state,mesh,m,compiled", list(_cases()))
def test_cost_model_prices_the_declared_residency(state, mesh, m, compiled):
    strategy = LayerStrategy(layer="l", state=state)
    form = data_parallel_form(strategy, mesh, m, compiled)
    n = mesh.dp_shard if form.held == "shard" or form.optimizer == "shard" else mesh.dp
    row = model_state_memory(PSI, layer_terms.memory_state(strategy, form), n, SIZES)
    k = SIZES.optimizer * PSI
    expected_device, expected_host = {"full": (k, 0.0), "chunk": (k / n, 0.0), "shard": (k / n, 0.0),
                                      "host": (0.0, k / n)}[form.optimizer]
    assert row.optimizer == pytest.approx(expected_device) and row.host == pytest.approx(expected_host), form
    assert (row.gathered > 0) == (form.gathered == "transient"), form
    assert (row.params < SIZES.param * PSI) == (form.held == "shard" and form.gathered == "transient"), form
    if form.gathered == "kept":  # held as the shard, the gathered copy saved for backward (layer_memory)
        assert form.held == "shard" and form.grads == "shard" and state in ("zero1", "zero2")
    if form.build == "shard":
        assert form.held == "shard"


def test_every_form_declares_known_residency():
    for state, mesh, m, compiled in itertools.product(STATES, MESHES, (1, 2), (False, True)):
        form = data_parallel_form(LayerStrategy(layer="l", state=state), mesh, m, compiled)
        assert form.optimizer in ("full", "chunk", "shard", "host")
        assert form.gathered in ("none", "kept", "transient")
        assert form.build in ("full", "shard")
        if mesh.dp == 1:
            assert form.gathered == "none" and form.optimizer == ("host" if state == "offload" else "full")
