"""Live bytes of model-parallel and mixed plans against the cost model's memory (gloo, world 2 and 4).

The data-parallel states are ``tests/test_live_memory.py``'s; here TP, SP, PP, EP and their mixes with
ZeRO. Each case builds one rank's program (fp32 AdamW, one bucket per layer group) from the model's own
parameters, runs a warm-up step and a measured step under one ``autoshard/live_bytes.LiveBytes``: the
build's peak and the step's (forward, backward and optimizer step). The prediction is
``search.cost_model.predict`` for the same plan on CPU ranks (``cpu`` preset): per pipeline rank k,
``Predictions.memory_by_stage[k]`` is the largest of its forward/backward, optimizer-step and build
peaks; ``Predictions.build_peak_bytes`` the largest build. Asserted within ``TOLERANCE``, per pipeline
rank the largest measured step of its ranks, and the largest build.

Plans: world 2 TP, TP + SP, PP (1F1B, GPipe, interleaved), EP (dp = ep = 2, capacity factor 1); world 4
DP × TP with ZeRO-3, DP × TP + SP with ZeRO-1, PP × TP + SP, PP × DP with ZeRO-2, PP × DP × EP (the dense
layers ZeRO-1). Models: the 3.4M-parameter Llama of ``test_live_memory`` (4 blocks; 4 heads, 2 KV heads) and a
mixture-of-experts model of the same width (4 experts, top-2, capacity factor 1: the all-to-all
exchanges fixed-size buffers).
"""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch

from _harness import run_gloo_cases
from _tiers import sample
from _runtime_cases import loss_fn
from autoshard.cluster import Cluster
from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes.context import coords_of
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import build_program
from autoshard.live_bytes import LiveBytes
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.search.cost_model import predict
from autoshard.train import TrainSpec

pytestmark = pytest.mark.slow  # spawned gloo ranks

MODELS = {
    "llama": ("llama:tiny", dict(hidden=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=768,
                                 vocab_size=512)),
    "moe": ("moe:tiny", dict(hidden=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=384, vocab_size=512,
                             num_experts=4, top_k=2, capacity_factor=1.0)),
}
BATCH, SEQ, BUCKET = 8, 32, 1 << 20
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    mesh: Mesh
    strategy: tuple = ()  # (field, value) pairs for every layer
    blocks_only: tuple = ()  # (field, value) pairs for block layers only
    micro_batches: int = 2
    schedule: str = "1f1b"
    virtual: int = 1

    def plan(self, graph) -> Plan:
        pp = self.mesh.pp * self.virtual  # (virtual) stages
        blocks = 1 + max(layer.block for layer in graph.layers if layer.block is not None)
        layers = []
        for layer in graph.layers:
            fields = dict(self.strategy)
            if layer.block is not None:
                fields.update(self.blocks_only)
            if fields.get("ep") and layer.kind != "moe":
                fields.pop("ep")
            elif fields.get("ep"):
                fields.pop("state", None)  # expert layers under EP run replicated (the other layers keep it)
            stage = 0 if layer.block is None and layer.kind == "embedding" else (
                pp - 1 if layer.block is None else layer.block * pp // blocks)
            layers.append(LayerStrategy(layer=layer.name, stage=stage, **fields))
        dp = self.mesh.dp
        schedule = Schedule(name=self.schedule, micro_batch=BATCH // dp // self.micro_batches,
                            num_micro_batches=self.micro_batches, virtual_stages=self.virtual, bucket_bytes=BUCKET)
        return Plan(model_name=graph.model_name, mesh=self.mesh, layers=tuple(layers), schedule=schedule)


CASES_2 = {
    "tp2": Case("llama", Mesh(tp=2), (("tp", "megatron"),)),
    "tp2_sp": Case("llama", Mesh(tp=2), (("tp", "megatron"), ("sp", True))),
    "pp2": Case("llama", Mesh(pp=2)),
    "pp2_gpipe": Case("llama", Mesh(pp=2), schedule="gpipe"),
    "pp2_interleaved": Case("llama", Mesh(pp=2), micro_batches=4, schedule="interleaved_1f1b", virtual=2),
    "ep2": Case("moe", Mesh(dp_shard=2, ep=2), (("ep", True),)),
}
CASES_4 = {
    "dp2_tp2_zero3": Case("llama", Mesh(dp_shard=2, tp=2), (("tp", "megatron"), ("state", "zero3"))),
    "dp2_tp2_sp_zero1": Case("llama", Mesh(dp_shard=2, tp=2), (("tp", "megatron"), ("sp", True), ("state", "zero1"))),
    "pp2_tp2_sp": Case("llama", Mesh(pp=2, tp=2), (("tp", "megatron"), ("sp", True))),
    "pp2_dp2_zero2": Case("llama", Mesh(pp=2, dp_shard=2), (("state", "zero2"),)),
    "pp2_dp2_ep2": Case("moe", Mesh(pp=2, dp_shard=2, ep=2), (("ep", True), ("state", "zero1"))),
}
# `make test` (tests/_tiers.py): TP 2 + SP runs every path of TP 2, 1F1B and interleaved 1F1B the stage
# code GPipe runs; DP × TP + SP with ZeRO-1 is priced by the terms of PP × TP + SP and the dense ZeRO-1
# layers of PP × DP × EP, PP × DP with ZeRO-2 by those of PP × DP × EP and tests/test_live_memory.py's ZeRO-2
CASES_2 = sample(CASES_2, ("tp2_sp", "pp2", "pp2_interleaved", "ep2"))
CASES_4 = sample(CASES_4, ("dp2_tp2_zero3", "pp2_tp2_sp", "pp2_dp2_ep2"))


@functools.lru_cache(maxsize=None)
def _graph(model: str):
    spec, dims = MODELS[model]
    return capture(build(spec, device="meta", **dims), seq_lens=(8, 16))


def _measure(rank, world_size, case: Case, graph):
    spec, dims = MODELS[case.model]
    model = build(spec, **dims)
    plan = case.plan(graph)
    live = LiveBytes()
    with live:
        program = build_program(model, graph, plan, TRAIN, optimizer=OptimizerConfig(name="adamw"))
    build_peak = live.peak
    tokens = torch.randint(0, dims["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with live:
        program.step(program.local_batch(tokens), loss_fn)  # warm-up
        gc.collect()
        live.reset_peak()
        program.step(program.local_batch(tokens), loss_fn)
    return {"build": build_peak, "step": live.peak, "pp": coords_of(rank, case.mesh).get("pp", 0)}


def _jobs(cases):
    return {name: functools.partial(_measure, case=case, graph=_graph(case.model)) for name, case in cases.items()}


@pytest.fixture(scope="module")
def measured2():
    return run_gloo_cases(_jobs(CASES_2), 2, timeout_s=600)


@pytest.fixture(scope="module")
def measured4():
    return run_gloo_cases(_jobs(CASES_4), 4, timeout_s=600)


def errors(case: Case, results: list[dict]) -> dict[str, tuple[float, float, float]]:
    """(measured, predicted, measured / predicted − 1) per pipeline rank's peak and for the build."""
    graph = _graph(case.model)
    pred = predict(graph, case.plan(graph), Cluster.parse(f"cpu:1x{case.mesh.world_size}"), TRAIN)
    out = {}
    for k, predicted in enumerate(pred.memory_by_stage):
        measured = max(max(r["step"], r["build"]) for r in results if r["pp"] == k)
        out[f"stage{k}"] = (measured, predicted, measured / predicted - 1)
    measured = max(r["build"] for r in results)
    out["build"] = (measured, pred.build_peak_bytes, measured / pred.build_peak_bytes - 1)
    return out


def _check(case: Case, results: list[dict]) -> None:
    report = {key: f"measured {m / 2**20:.2f} MiB, predicted {p / 2**20:.2f} MiB, {e:+.1%}"
              for key, (m, p, e) in errors(case, results).items()}
    assert all(abs(e) <= TOLERANCE for _, _, e in errors(case, results).values()), report


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_live_memory_world2(measured2, name):
    _check(CASES_2[name], measured2[name])


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_live_memory_world4(measured4, name):
    _check(CASES_4[name], measured4[name])
