"""Expert parallelism on Hugging Face MoE blocks: refused at plan time, with the reason, until the EP pass
can exchange their experts. Hugging Face's Mixtral computes its experts with ``_grouped_mm`` over
token-sorted rows (data-dependent group sizes); the EP pass all-to-alls fixed ``[E, C, h]`` capacity
buffers around ``bmm`` expert matmuls (``passes/_expert_parallel.py``). Capture records why
(``LayerInfo.ep_refusal``), the search never proposes ep > 1 for such a model (``ep_runs/experts``), a
forced plan is refused by ``Plan.check_compatible`` before anything is built, and the EP pass itself
refuses a split layer it has no matmul to dispatch at. Tier 1: meta, one process."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import fx

transformers = pytest.importorskip("transformers")

from autoshard.cluster import Cluster  # noqa: E402
from autoshard.errors import PlanError  # noqa: E402
from autoshard.models import build  # noqa: E402
from autoshard.models.hf import actor_critic  # noqa: E402
from autoshard.passes import capture  # noqa: E402
from autoshard.plan import LayerStrategy, Mesh, Plan  # noqa: E402
from autoshard.search.space import enumerate_meshes  # noqa: E402
from autoshard.train import TrainSpec  # noqa: E402

MIXTRAL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=256, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
TRAIN = TrainSpec(global_batch=8, seq_len=16)


@functools.lru_cache(maxsize=None)
def _graphs():
    hf = capture(actor_critic(transformers.MixtralConfig(**MIXTRAL)), seq_lens=(8, 16))  # bf16: grouped_mm's dtype
    ours = capture(build("moe:tiny", device="meta"), seq_lens=(8, 16))
    return hf, ours


@pytest.mark.slow
def test_capture_says_why_hf_experts_cannot_run_expert_parallel():
    hf, ours = _graphs()
    moe = [layer for layer in hf.layers if layer.kind == "moe"]
    assert len(moe) == 2 and all("aten._grouped_mm" in layer.ep_refusal for layer in moe)
    assert all(layer.ep_refusal == "" for layer in ours.layers)


@pytest.mark.slow
def test_the_search_offers_no_expert_parallel_mesh_for_them():
    hf, ours = _graphs()
    cluster = Cluster.parse("h100-sxm:1x4")
    found = enumerate_meshes(hf, cluster, TRAIN)
    assert found.meshes and all(mesh.ep == 1 for mesh in found.meshes)
    record = next(r for r in found.pruned if r.constraint == "ep_runs/experts")
    assert "model.layers.0.mlp" in record.detail and "_grouped_mm" in record.detail
    assert any(mesh.ep > 1 for mesh in enumerate_meshes(ours, cluster, TRAIN).meshes)


@pytest.mark.slow
def test_a_forced_expert_parallel_plan_is_refused_naming_the_layer():
    hf, _ = _graphs()
    layers = tuple(LayerStrategy(layer=layer.name, ep=layer.kind == "moe") for layer in hf.layers)
    plan = Plan(model_name=hf.model_name, mesh=Mesh(dp_shard=2, ep=2), layers=layers)
    with pytest.raises(PlanError, match=r"layer 'model.layers.0.mlp' cannot run expert-parallel: its matmuls are "
                                        r"aten._grouped_mm.*ep = 1"):
        plan.check_compatible(graph=hf)
    Plan(model_name=hf.model_name, mesh=Mesh(dp_shard=2),
         layers=tuple(LayerStrategy(layer=layer.name) for layer in hf.layers)).check_compatible(graph=hf)


def test_the_ep_pass_refuses_a_split_layer_without_expert_bmm():
    from autoshard.passes._expert_parallel import insert_expert_parallel

    graph = fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("moe.experts.w")
    graph.output(graph.call_function(torch.ops.aten._grouped_mm.default, (x, weight)))
    placements = {"moe.experts.w": SimpleNamespace(layer="moe", ep_dim=0)}
    ctx = SimpleNamespace(size=lambda axis: 2, group=lambda axis: "ep")
    with pytest.raises(PlanError, match="layer 'moe': expert parallelism splits its experts"):
        insert_expert_parallel(graph, placements, ctx, "insert_collectives")
