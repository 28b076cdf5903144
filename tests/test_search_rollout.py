"""The RL step's pricing and the co-planning of training and rollout layouts (``search/rollout.py``).

Expected values are counted by hand from the models' configs (llama:tiny: vocab 16, h 64, 2 blocks,
4 heads of 16, 2 key/value heads, MLP 128, untied) and, for the replica and its cache, measured on the
runtime's own objects (``runtime/rollout_tp.py``): what the cost model prices is what the runtime holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.errors import AutoshardError, PlanError
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, RolloutPlan
from autoshard.runtime.ppo_program import build_policy_model, capture_policy
from autoshard.runtime.rollout_tp import build_sharded_replica, new_cache
from autoshard.search import rollout as R

# llama:tiny elements, by hand: embed 16·64, per block q 64·64, k and v 32·64, o 64·64, gate/up/down 128·64,
# two norms of 64; final norm 64; head 16·64; value head 64 + 1
BLOCK_SPLIT = 4096 + 2048 + 2048 + 4096 + 3 * 8192
WHOLE = 1024 + 2 * (BLOCK_SPLIT + 128) + 64 + 1024 + 65


@pytest.fixture(scope="module")
def tiny():
    model = build_policy_model("llama:tiny", 0)
    return model, capture_policy(model, "llama:tiny")


def _plan(graph, mesh: Mesh, state: str = "replicate", tp: str = "none", **pred) -> Plan:
    layers = tuple(LayerStrategy(layer=l.name, state=state, tp=tp if l.kind in ("attention", "mlp", "embedding", "head")
                                 else "none") for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, precision="fp32",
                predictions=Predictions(**pred))


def test_rollout_weights_by_hand_and_as_the_runtime_builds_them(tiny):
    model, graph = tiny
    assert R.rollout_weight_bytes(graph, 1, 4) == WHOLE * 4
    assert R.rollout_weight_bytes(graph, 2, 4) == (512 + 2 * (BLOCK_SPLIT // 2 + 128) + 64 + 512 + 65) * 4
    for r in (1, 2):
        replica, _ = build_sharded_replica(model, r, 0, "unused", device="meta", dtype=torch.float32)
        held = sum(p.numel() for p in replica.parameters()) * 4
        assert R.rollout_weight_bytes(graph, r, 4) == held


def test_kv_cache_by_hand_and_as_the_runtime_allocates_it(tiny):
    model, graph = tiny
    # 2 blocks × (k, v) × 3 sequences × 2/r heads × 10 positions × 16 dims × 4 bytes
    for r in (1, 2):
        assert R.kv_cache_bytes(graph, r, 3, 10, 4) == 2 * 2 * 3 * (2 // r) * 10 * 16 * 4
        cache = new_cache(model, r, 3, 10, device="meta", dtype=torch.float32)
        assert sum(t.numel() * 4 for t in cache.keys + cache.values) == R.kv_cache_bytes(graph, r, 3, 10, 4)


def test_reshard_bytes_follow_the_gathers_the_runtime_runs(tiny):
    _, graph = tiny
    zero3 = _plan(graph, Mesh(dp_shard=4), state="zero3")
    # every parameter gathered over 4 ranks: 3/4 of it arrives
    assert R.reshard(graph, _cluster(), zero3, 2)["reshard_bytes"] == pytest.approx(WHOLE * 4 * 3 / 4)
    ddp = _plan(graph, Mesh(dp_replicate=4))
    assert R.reshard(graph, _cluster(), ddp, 4)["reshard_bytes"] == 0  # replicated: a local slice
    tp2 = _plan(graph, Mesh(dp_replicate=2, tp=2), tp="megatron")
    # rollout tp = training tp: split parameters are already this rank's slice, the rest replicated
    assert R.reshard(graph, _cluster(), tp2, 2)["reshard_bytes"] == 0
    # rollout tp=1 from training tp=2: each split parameter gathered over 2 ranks (half arrives)
    split = 1024 + 2 * BLOCK_SPLIT + 1024
    assert R.reshard(graph, _cluster(), tp2, 1)["reshard_bytes"] == pytest.approx(split * 4 / 2)
    # ZeRO-1 in a compiled program with one micro-batch is held as ZeRO-3's shard (autoshard/data_parallel.py):
    # gathered like it when PPO compiles (on a GPU), a local slice when eager or on CPU ranks (never compiled)
    zero1 = _plan(graph, Mesh(dp_shard=4), state="zero1")
    assert R.reshard(graph, _cluster(), zero1, 1, compiled=True)["reshard_bytes"] == pytest.approx(WHOLE * 4 * 3 / 4)
    assert R.reshard(graph, _cluster(), zero1, 1)["reshard_bytes"] == 0
    from autoshard.cli_search import load_cluster

    assert R.reshard(graph, load_cluster("cpu:1x4", None), zero1, 1, compiled=True)["reshard_bytes"] == 0


def test_advantages_are_priced_per_response_token_of_gae():
    """GAE's loop: its dispatched ops per response token counted again here, each at the calibrated eager per-op
    time; GRPO has no loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.runtime.ppo_losses import gae

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for length in (8, 16):
        rewards = torch.randn(4, length)
        with Count() as count:
            gae(rewards, torch.randn(4, length), torch.ones(4, length), 1.0, 0.95)
        counts.append(count.ops)
    assert (counts[1] - counts[0]) / 8 == R.GAE_OPS
    cluster = _cluster().with_calibration({"kernel_overhead_s": 7e-6, "eager_kernel_s": 3e-5})
    work = R.RolloutWorkload(sequences=64, prompt_len=128, response_len=128)
    assert R.advantages_s(cluster, work) == pytest.approx(128 * R.GAE_OPS * 7e-6)
    assert R.advantages_s(cluster, dataclasses.replace(work, gae=False)) == 0.0


def _cluster(memory_gib: float = 80):
    from autoshard.cli_search import load_cluster

    cluster = load_cluster("h100-sxm:1x4", None)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=int(memory_gib * 2**30)))


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_refusals(tiny):
    _, graph = tiny
    assert R.rollout_refusal(graph, 2) is None
    assert "key/value heads (2)" in R.rollout_refusal(graph, 4)
    assert R.rollout_degrees(graph, _cluster(), 4) == [1, 2]
    moe = capture_policy(build_policy_model("moe:tiny", 0), "moe:tiny")
    assert "expert" in R.rollout_refusal(moe, 2)


def test_group_batch_counts_distinct_prompt_draws(tiny):
    _, graph = tiny
    dp4 = _plan(graph, Mesh(dp_shard=4))
    assert [R.group_batch(dp4, r, 64) for r in (1, 2, 4)] == [16, 32, 64]
    tp2 = _plan(graph, Mesh(dp_shard=2, tp=2))
    assert [R.group_batch(tp2, r, 64) for r in (1, 2, 4)] == [32, 32, 64]  # tp ranks share their prompts


def test_co_plan_keeps_the_fastest_fitting_layout_and_records_the_rest(tiny):
    _, graph = tiny
    from autoshard.train import TrainSpec

    calls = []

    def solve(graph, cluster, train, constraints):
        calls.append(constraints.max_memory_bytes)
        return _plan(graph, Mesh(dp_shard=4), state="zero3", step_time_s=0.01, compute_s=0.009,
                     peak_memory_bytes=2**30, memory_breakdown={"activations": 2**29, "params": 3000, "optimizer": 9000})

    work = R.RolloutWorkload(sequences=64, prompt_len=8, response_len=16)
    plan = R.co_plan(graph, _cluster(), TrainSpec(global_batch=16, seq_len=24, precision="fp32"), work, solve=solve)
    rollout = plan.rollout[0]
    assert [o.tp for o in rollout.options] == [1, 2]
    # each search left room for that layout's rollout weights, and (once a plan is known) for the frozen
    # reference: its parameters and SGD masters, a third of AdamW's optimizer bytes (3000 + 9000 / 3)
    assert calls == [int(80 * 2**30 - R.rollout_weight_bytes(graph, 1, 4)),
                     int(80 * 2**30 - R.rollout_weight_bytes(graph, 2, 4) - 6000)]
    best = min(rollout.options, key=lambda o: o.rl_step_s)
    assert rollout.tp == best.tp and rollout.chosen == best and rollout.dp == 4 // best.tp
    for o in rollout.options:
        assert o.rl_step_s == pytest.approx(o.generate_s + o.reshard_s + o.score_s + o.advantages_s + o.train_s)
        assert o.advantages_s == R.advantages_s(_cluster(), work) > 0
        assert o.train_s == pytest.approx(2 * 0.01)  # 1 epoch × 2 mini-batches
    # a device too small for any sampling peak: every layout refused, with why
    with pytest.raises(AutoshardError, match="no rollout layout fits"):
        R.co_plan(graph, _cluster(memory_gib=1.5), TrainSpec(global_batch=16, seq_len=24, precision="fp32"), work,
                  solve=solve)


def test_plan_file_round_trips_the_rollout_and_omits_it_when_absent(tiny):
    _, graph = tiny
    plan = _plan(graph, Mesh(dp_shard=4), step_time_s=0.01)
    assert "rollout" not in plan.to_dict()  # plans without RL layouts keep their bytes
    with_r = R.with_rollout(graph, _cluster(), plan, 2, R.RolloutWorkload(sequences=8, prompt_len=4, response_len=4))
    again = Plan.from_json(with_r.to_json())
    assert again == with_r and again.rollout[0].tp == 2 and again.rollout[0].dp == 2
    assert "rollout tp=2 × 2 groups" in str(again) and "predicted RL step" in str(again)
    # a plan written before the advantages term loads, its advantages priced at 0
    import json

    data = json.loads(with_r.to_json())
    for option in (data["rollout"][0]["chosen"], *data["rollout"][0]["options"]):
        del option["advantages_s"]
    assert Plan.from_json(json.dumps(data)).rollout[0].chosen.advantages_s == 0.0
    with pytest.raises(PlanError, match="world size"):
        dataclasses.replace(plan, rollout=(RolloutPlan(tp=2, dp=3),))


def test_cli_rollout_tp_must_be_auto_or_a_power_of_two():
    import argparse

    from autoshard.cli_ppo import _rollout_tp

    assert _rollout_tp("auto") == "auto" and _rollout_tp("4") == 4
    with pytest.raises(argparse.ArgumentTypeError):
        _rollout_tp("3")


def test_decode_op_count_is_stem_plus_blocks_and_width_free():
    """The priced count (one and two blocks extrapolated) equals a direct count at the model's depth, and the
    calibration probe's count does not depend on the width it is built at."""
    from autoshard.calibrate import DECODE_PROBE

    direct = R.count_decode_ops("llama:tiny", num_layers=6)
    one, two = R.count_decode_ops("llama:tiny", num_layers=1), R.count_decode_ops("llama:tiny", num_layers=2)
    assert direct == one + 5 * (two - one) > 0
    assert R._counted_decode_ops("llama:tiny") == R.count_decode_ops("llama:tiny")
    narrow = {**DECODE_PROBE, "hidden": 64, "ffn_hidden": 128}
    assert R.count_decode_ops("llama:tiny", **narrow) == R.count_decode_ops("llama:tiny", **DECODE_PROBE)


def test_graph_kernel_probe_is_gpu_only():
    from autoshard.calibrate import measure_graph_kernel

    assert measure_graph_kernel(torch.device("cpu"), 1, 1e9) is None


def test_solve_for_rollout_keeps_rollout_groups_inside_a_pipeline_stage(tiny):
    """A searched plan whose stages are narrower than the rollout group is searched again with pp fixed to the
    degrees that leave whole groups per stage; the fastest of those is kept, a fixed pp is honoured."""
    from autoshard.search.space import Constraints

    _, graph = tiny
    cluster = None
    calls = []

    def solve(graph, cluster, train, constraints):  # stands in for search.solve: pp=4 unless pp is fixed
        pp = constraints.mesh.get("pp", 4)
        calls.append(pp)
        if pp == 1 and constraints.mesh.get("tp") == 8:
            raise AutoshardError("nothing fits")
        return _plan(graph, Mesh(pp=pp, dp_shard=8 // pp), step_time_s=1.0 + pp)

    train = None
    assert R.solve_for_rollout(graph, cluster, train, 2, solve=solve).mesh.pp == 4 and calls == [4]  # 2 of 8 per stage
    calls.clear()
    plan = R.solve_for_rollout(graph, cluster, train, 4, solve=solve)  # stages of 2 ranks: pp 1 or 2 instead
    assert calls == [4, 1, 2] and plan.mesh.pp == 1
    with pytest.raises(AutoshardError, match="rollout tp=8 needs pipeline stages of a multiple of 8 ranks"):
        R.solve_for_rollout(graph, cluster, train, 8, solve=solve, constraints=Constraints(mesh={"tp": 8}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_kernel_probe_on_cuda():
    """The calibration's decode probe replays a captured step: microseconds per counted op, not zero, not ms."""
    from autoshard.calibrate import measure_graph_kernel

    seconds = measure_graph_kernel(torch.device("cuda"), 5, 2e12)
    assert 2e-7 < seconds < 1e-4


def test_eager_host_floor(tiny):
    """Calibrated eager host time per counted kernel: an eager layer takes the longer of its device time and its
    host time (forward: its counted kernels × eager_kernel_s, backward twice that); compiled layers and CPU ranks
    are unaffected, and the scoring forwards (no_grad) take the inference floor."""
    from autoshard.cluster import Cluster
    from autoshard.search import layer_terms as LT
    from autoshard.search.cost_model import plan_layer_costs
    from autoshard.train import TrainSpec

    _, graph = tiny
    attn = next(layer for layer in graph.layers if layer.kind == "attention")
    base = Cluster.parse("h100-sxm:1x2")
    slow = base.with_calibration({"eager_kernel_s": 1e-3, "eager_inference_kernel_s": 3e-3})
    train = TrainSpec(global_batch=2, seq_len=16, precision="bf16", compiled=False)
    strategy = LayerStrategy(layer=attn.name)
    sh = LT.sharding(attn, strategy, Mesh(dp_shard=2), Plan(model_name="m", mesh=Mesh(dp_shard=2), layers=(),
                     global_batch=2, seq_len=16).schedule, 16)
    device = LT.compute_terms(attn, strategy, sh, base, train)
    eager = LT.compute_terms(attn, strategy, sh, slow, train)
    compiled = LT.compute_terms(attn, strategy, sh, slow, train, compiled=True)
    # llama:tiny's attention: q, k, v, o GEMMs, RoPE 5 x 2, head merge, SDPA, residual add = 17 counted kernels
    assert eager["fwd_host_s"] == pytest.approx(17e-3) and eager["bwd_host_s"] == pytest.approx(34e-3)
    assert eager["fwd_inference_host_s"] == pytest.approx(51e-3)
    assert device["fwd_compute_s"] < 17e-3  # a tiny layer: the host floor binds
    assert eager["fwd_compute_s"] == pytest.approx(17e-3) and eager["bwd_compute_s"] == pytest.approx(34e-3)
    assert compiled["fwd_compute_s"] == pytest.approx(device["fwd_compute_s"])
    assert device["fwd_host_s"] == 0.0
    cpu = Cluster.parse("cpu:1x2").with_calibration({"eager_kernel_s": 1e-3})
    assert LT.eager_host_s(attn, cpu) == (0.0, 0.0, 0.0)

    plan = _plan(graph, Mesh(dp_shard=2), step_time_s=0.0, exposed_comm_s=0.0)
    plan = dataclasses.replace(plan, global_batch=2, seq_len=16)
    work = R.RolloutWorkload(sequences=2, prompt_len=8, response_len=8, mini_batches=1)
    forward_kernels = sum(LT.forward_kernels(layer) for layer in graph.layers)
    costs = plan_layer_costs(graph, plan, slow, dataclasses.replace(train, compiled=False))
    assert sum(c.fwd_s for c in costs) == pytest.approx(forward_kernels * 1e-3)  # the training floor
    # two scoring forwards (policy and reference) of one micro-batch each, at the inference floor
    assert R.score_s(graph, slow, plan, work) == pytest.approx(2 * forward_kernels * 3e-3)
    # PPO's programs compiled (runtime/ppo_program note "compiled PPO"): no host floor in the scoring forwards
    compiled_work = dataclasses.replace(work, compiled=True)
    compiled_costs = plan_layer_costs(graph, plan, slow, dataclasses.replace(train, compiled=True, precision=plan.precision))
    assert R.score_s(graph, slow, plan, compiled_work) == pytest.approx(2 * sum(c.fwd_s for c in compiled_costs))
    assert R.score_s(graph, slow, plan, compiled_work) < 0.1 * R.score_s(graph, slow, plan, work)


def test_eager_probe_is_gpu_only():
    from autoshard.calibrate import measure_eager_kernel

    assert measure_eager_kernel(torch.device("cpu"), 1) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eager_probe_on_cuda():
    """The eager probe's step is host time per counted kernel: microseconds, not zero, not milliseconds."""
    from autoshard.calibrate import measure_eager_kernel

    train, inference = measure_eager_kernel(torch.device("cuda"), 3)
    assert 1e-6 < train < 1e-3 and 1e-6 < inference < 1e-3
