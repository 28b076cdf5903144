"""The backward's working set: measured by capture on meta (``passes/_capture_grad.py``), priced by
``search/memory.backward_working_bytes``, and the two pieces of pipeline and region memory found with it
(rematerialised bytes of a layer inside a checkpoint region; the stage outputs a sender keeps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard.graph import LayerInfo, ParamInfo
from autoshard.passes._capture_grad import measure_grad_working
from autoshard.passes._capture_layers import LayerSpec
from autoshard.plan import LayerStrategy
from autoshard.search.memory import backward_working_bytes, rematerialised_bytes


def test_two_linears_hold_their_activation_gradients():
    """x → Linear(h, 4h) → Linear(4h, h) → sum, fp32, B·S = T tokens. The loss's gradient is a broadcast of
    one element, so the second linear's backward makes dX = [T, 4h] (16·T·h bytes) and frees its saved input
    (the same size) when it ends; the first one starts holding that dX as its output's gradient and, its
    input needing none, makes only its weight gradient (not counted in W)."""
    h, batch, seq = 8, 2, 8
    tokens = batch * seq
    model = nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False))
    layers = [LayerSpec("0", "linear", 0, model[0]), LayerSpec("1", "linear", 0, model[1])]
    found = measure_grad_working(model, layers, (torch.zeros(batch, seq, h),))
    dx = 4 * tokens * 4 * h
    assert found["1"].peak == pytest.approx(dx, abs=16)  # a few bytes: the scalar loss's gradient
    assert found["1"].end == pytest.approx(0, abs=16)  # dX made, the saved input freed
    assert found["0"].peak == pytest.approx(dx, abs=16)
    assert 0.0 <= found["1"].param_fraction <= 1.0


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_identical_blocks_share_one_working_set():
    """Capture gives structurally identical layers one price (the largest member's), and a dropless MoE's
    weight-shaped copy is the fixed part, not a per-token one."""
    from autoshard.models import build
    from autoshard.passes import capture

    config = dict(hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=4, num_layers=3, vocab_size=128,
                  max_seq_len=64)
    graph = capture(build("moe:tiny", device="meta", dtype=torch.bfloat16, **config), seq_lens=(8, 16))
    for members in graph.classes().values():
        assert len({(m.grad_working_per_token, m.grad_working_fixed_bytes, m.grad_working_end_per_token)
                    for m in members}) == 1
    norm = next(l for l in graph.layers if l.kind == "norm")
    assert norm.grad_working_per_token >= 4 * 64  # at least the fp32 gradient of its input
    moe = next(l for l in graph.layers if l.kind == "moe")
    assert moe.grad_working_fixed_bytes > 0 and moe.grad_working_per_token > 0


def _layer(params: int, **working) -> LayerInfo:
    return LayerInfo(name="blocks.0.mlp", kind="mlp", index=0, block=0, class_id="mlp",
                     params=(ParamInfo("blocks.0.mlp.w", (params,), "bfloat16", "column"),), **working)


@pytest.mark.parametrize("backward, buffers, gathered, expected", [
    # eager ZeRO-3: max(p + 2g + end, p + W + f·g) = max(300 − 500, 100 + 1000 + 50)
    ("gather_grad_copy", 300.0, 100.0, 1150.0),
    # no buffers, nothing gathered: W + f·g
    ("none", 0.0, 100.0, 1050.0),
    # compiled, gathered weights kept as activations: held 0
    ("graph_kept", 100.0, 100.0, 1050.0),
])
def test_backward_working_bytes_by_hand(backward, buffers, gathered, expected):
    """10 tokens at W = 100 B/token, end = −50 B/token, f = 0.5 of a 100-byte gradient."""
    layer = _layer(50, grad_working_per_token=100.0, grad_working_end_per_token=-50.0,
                   grad_working_param_fraction=0.5)
    got = backward_working_bytes(layer, LayerStrategy(layer=layer.name), 1, 10, backward, buffers, gathered,
                                 100.0, 1.0)
    assert got == pytest.approx(expected)


def test_working_set_shards_with_megatron_tp_and_its_fixed_part_with_the_local_share():
    """tp 2 on a column layer halves the per-token part; the fixed 400 B is weight-shaped: half of it for a
    rank holding half the parameters. 10 tokens · 100 / 2 + 400 · 0.5 = 700; f·g = 0."""
    layer = _layer(50, grad_working_per_token=100.0, grad_working_fixed_bytes=400.0)
    got = backward_working_bytes(layer, LayerStrategy(layer=layer.name, tp="megatron"), 2, 10, "none", 0.0, 0.0,
                                 50.0, 0.5)
    assert got == pytest.approx(700.0)


def test_a_region_member_rematerialises_all_it_saved():
    """Full recompute: a region's entry keeps its input (saved − input again in the backward); a layer that
    continues the region keeps nothing, so its backward holds all it saved again."""
    layer = LayerInfo(name="blocks.0.mlp", kind="mlp", index=0, block=0, class_id="mlp", params=(),
                      saved_boundary_per_token=2.0, saved_interior_per_token=16.0, input_bytes_per_token=2.0)
    full = LayerStrategy(layer=layer.name, recompute="full")
    assert rematerialised_bytes(layer, full, 1, 100, 64) == pytest.approx(1600.0)
    assert rematerialised_bytes(layer, full, 1, 100, 64, region_entry=False) == pytest.approx(1800.0)


def test_a_sending_stage_keeps_its_in_flight_outputs():
    """1F1B on 2 stages, 4 micro-batches of 2 × 32 tokens, h 64, bf16: each rank has 4 receive buffers of one
    boundary value (2·32·64·2 bytes: gradients on the first, activations on the last), and the first also
    keeps the outputs of the 2 micro-batches it has in flight until their backward."""
    from autoshard.cluster import Cluster
    from autoshard.models import build
    from autoshard.passes import capture
    from autoshard.plan import Mesh, Plan, Schedule
    from autoshard.search.cost_model import boundary_terms
    from autoshard.train import TrainSpec

    config = dict(hidden=64, ffn_hidden=128, num_heads=4, num_kv_heads=4, num_layers=2, vocab_size=128,
                  max_seq_len=64)
    graph = capture(build("llama:tiny", device="meta", dtype=torch.bfloat16, **config), seq_lens=(8, 16))
    stage = lambda name: 0 if name.startswith(("embed", "blocks.0.")) else 1  # noqa: E731
    plan = Plan(model_name=graph.model_name, mesh=Mesh(pp=2), precision="bf16", global_batch=8, seq_len=32,
                layers=tuple(LayerStrategy(layer=l.name, stage=stage(l.name)) for l in graph.layers),
                schedule=Schedule(name="1f1b", micro_batch=2, num_micro_batches=4))
    _, buffers = boundary_terms(graph, plan, Cluster.parse("cpu:1x2"), TrainSpec(global_batch=8, seq_len=32,
                                                                                 precision="bf16"))
    one = 2 * 32 * 64 * 2
    assert buffers == pytest.approx([(4 + 2) * one, 4 * one])


def test_one_bucket_holds_a_small_models_gradients():
    """Two DDP layers of 3 MiB of gradients each (one all-reduced copy of a bucket: pack 1): with 25 MiB
    buckets both fill one bucket, 6 MiB of copies, not either layer's 3; with 4 MiB buckets they do not fit
    one, and buckets close on member boundaries the layers' own price bounds (3 MiB); without bucketing,
    each layer's own."""
    from autoshard.search.memory import MemoryBreakdown, optimizer_step_peak_bytes

    mib = 2**20
    layer = MemoryBreakdown(params=10 * mib, step_transient=3 * mib, step_bucketed=3 * mib,
                            step_bucket_members=3 * mib)
    assert optimizer_step_peak_bytes([layer, layer], 25 * mib) == 20 * mib + 6 * mib
    assert optimizer_step_peak_bytes([layer, layer], 4 * mib) == 20 * mib + 3 * mib
    assert optimizer_step_peak_bytes([layer, layer], 0) == 20 * mib + 3 * mib
