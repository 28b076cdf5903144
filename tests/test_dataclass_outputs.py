"""A forward that returns a plain (unregistered) ``@dataclass`` is captured and trained as it is.

Capture registers the output's dataclass types as pytree nodes itself (``passes/_capture_export.py``,
"Output dataclasses"): here a frozen dataclass holding the logits and a nested dataclass with the
values and a field left ``None``, neither registered by the test. In process: capture registers both
(and only those), the exported program returns the same classes, and an unknown class that is no
dataclass is still refused with the registration hint. On 2 gloo ranks (one job; each rank captures
for itself, so its registration is the one capture made there): plain DDP (``Mesh(dp_shard=2)``) and
pp=2 (the last stage rebuilds the dataclass from the export's ``out_spec``) train 3 SGD steps like
single-device PyTorch (losses, final parameters, an inference forward's values and type, rtol 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
import torch.utils._pytree as pytree

from _harness import run_gloo_cases
from _hf_tp_cases import reassemble
from _runtime_cases import BATCH, OPT, SEQ, batches, single_device
from _user_models import NanoPolicy
from autoshard.errors import CaptureError
from autoshard.passes import capture
from autoshard.passes._capture_export import unregistered_dataclasses
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import BuildOptions, build_program
from autoshard.train import TrainSpec

TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
MESHES = {"ddp": Mesh(dp_shard=2), "pp2": Mesh(pp=2)}


@dataclasses.dataclass
class Critic:
    value: torch.Tensor
    baseline: torch.Tensor | None = None  # left None: no leaf, rebuilt as None


@dataclasses.dataclass(frozen=True)
class PolicyStep:
    logits: torch.Tensor
    critic: Critic


class DataclassPolicy(NanoPolicy):
    def forward(self, tokens):
        logits, values = super().forward(tokens)
        return PolicyStep(logits, Critic(values))


class Opaque:
    """An output class that is no dataclass: capture does not guess how to flatten it."""

    def __init__(self, logits):
        self.logits = logits


class OpaquePolicy(NanoPolicy):
    def forward(self, tokens):
        return Opaque(super().forward(tokens)[0])


def build(_spec: str = "") -> DataclassPolicy:
    torch.manual_seed(0)
    return DataclassPolicy(layers=2)


def loss_fn(out, tokens):
    assert isinstance(out, PolicyStep) and isinstance(out.critic, Critic) and out.critic.baseline is None
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce + out.critic.value.pow(2).mean()


def _probe():
    return batches()[0][:2, :6]


def _registered() -> tuple[bool, bool]:
    return PolicyStep in pytree.SUPPORTED_NODES, Critic in pytree.SUPPORTED_NODES


def _plan(graph, mesh: Mesh) -> Plan:
    def stage(name: str) -> int:
        block = re.match(r"blocks\.(\d+)\.", name)
        if block:
            return int(block.group(1)) * mesh.pp // 2
        return 0 if name in ("tok", "pos") else mesh.pp - 1

    layers = tuple(LayerStrategy(layer=l.name, stage=stage(l.name)) for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=2))


def _train(rank, world_size, mesh: Mesh):
    del rank, world_size
    before = _registered()
    graph = capture(build(), seq_lens=(8, 16))
    program = build_program(build(), graph, _plan(graph, mesh), TRAIN, optimizer=OPT,
                            options=BuildOptions(compile=False))
    forward = program(_probe())
    losses = [program.step(program.local_batch(tokens), loss_fn).loss for tokens in batches()]
    return {"before": before, "after": _registered(), "losses": losses, "shards": program.local_state_dict(),
            "placements": program.param_placements, "coords": program.ctx.coords,
            "forward": (type(forward), type(forward.critic), forward.critic.baseline,
                        forward.logits.detach(), forward.critic.value.detach())}


@pytest.fixture(scope="module")
def results():
    cases = {name: functools.partial(_train, mesh=mesh) for name, mesh in MESHES.items()}
    return run_gloo_cases(cases, 2, timeout_s=300)


@functools.lru_cache(maxsize=None)
def _reference():
    out = build()(_probe())
    losses, params = single_device("", builder=build, loss=loss_fn)
    return losses, params, (out.logits.detach(), out.critic.value.detach())


# --------------------------------------------------------------------------- in process


def test_capture_registers_the_output_dataclasses_and_export_returns_them():
    assert _registered() == (False, False)  # only this test captures the model in this process
    assert unregistered_dataclasses(build()(_probe())) == (PolicyStep, Critic)  # outermost first, nested found
    capture(build(), seq_lens=(8, 16))
    assert _registered() == (True, True)
    assert unregistered_dataclasses(build()(_probe())) == ()
    exported = torch.export.export(build(), (_probe(),), strict=False).module()(_probe())
    assert type(exported) is PolicyStep and type(exported.critic) is Critic and exported.critic.baseline is None
    torch.testing.assert_close(exported.logits, _reference()[2][0])


def test_unregistered_dataclasses_skips_known_pytree_nodes():
    transformers = pytest.importorskip("transformers")
    hf = transformers.modeling_outputs.CausalLMOutput(logits=torch.ones(1))
    assert unregistered_dataclasses({"a": (hf, [torch.ones(1)]), "b": None}) == ()


def test_an_output_class_that_is_no_dataclass_is_refused_with_the_hint():
    with pytest.raises(CaptureError, match=r"Opaque.*not a known type.*a dataclass is registered as a pytree node for "
                                           r"you.*register_pytree_node"):
        capture(OpaquePolicy(layers=1), seq_lens=(8, 16))
    assert Opaque not in pytree.SUPPORTED_NODES


# --------------------------------------------------------------------------- 2 gloo ranks


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.slow
def test_dataclass_output_trains_like_single_device(results, name):
    ref_losses, ref_params, ref_forward = _reference()
    for r in results[name]:
        assert r["after"] == (True, True)
        if name == "ddp":  # the job's first case: capture registered them on the rank
            assert r["before"] == (False, False)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        kind, critic, baseline, logits, values = r["forward"]
        assert (kind, critic, baseline) == (PolicyStep, Critic, None)
        torch.testing.assert_close((logits, values), ref_forward, rtol=1e-5, atol=1e-6)
    full = reassemble(results[name], MESHES[name])
    assert set(full) == set(ref_params)
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
