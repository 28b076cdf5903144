"""Expert parallelism on the MoE reference equals single-device training (dropless and with a capacity factor).

Experts are split over ep groups carved from dp ranks; tokens travel by
all-to-all (passes/_expert_parallel.py); expert gradients are reduced over the
expert-data-parallel group. 3 SGD steps, 4/dp micro-batches, clipping; losses
and full parameters (expert shards concatenated over ep) at rtol 1e-5. Every
forward sees the same 2 rows per rank as the reference's chunks, so capacity
drops (which depend on the tokens of one forward call) match.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _harness import fake_world, run_gloo_cases
from _tiers import sample
from _runtime_cases import BATCH, OPT, SEQ, batches, loss_fn
from autoshard.errors import PlanError
from autoshard.models import build
from autoshard.passes import capture
from autoshard.passes._expert_parallel import ep_combine, ep_dispatch
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import build_program
from autoshard.train import TrainSpec

MOE = "moe:tiny"
TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32")
MODELS = {"dropless": {}, "capacity": {"capacity_factor": 1.0}}


def _model(kind):
    return build(MOE, **MODELS[kind])


@functools.lru_cache(maxsize=None)
def _graph(kind):
    return capture(_model(kind), seq_lens=(8, 16))


def _stage(layer: str, mesh: Mesh) -> int:
    """pp = 2: block 1 and the tail on the second stage."""
    return int(mesh.pp > 1 and (layer.startswith("blocks.1") or not layer.startswith(("embed", "blocks.0"))))


def _plan(kind, mesh, choose):
    graph = _graph(kind)
    layers = tuple(LayerStrategy(layer=l.name, stage=_stage(l.name, mesh), **choose(l.name)) for l in graph.layers)
    micro = 4 // mesh.dp  # 2 rows per forward on every rank (batch 8 = dp × micro × 2), as the reference's chunks
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=micro))


def _ep_moe(layer):
    return {"ep": layer.endswith("moe")}


def _ep_moe_tp_attn(layer):
    return {"ep": True} if layer.endswith("moe") else {"tp": "megatron" if layer.endswith("attn") else "none"}


def _ep_moe_zero_rest(layer):
    return {"ep": True} if layer.endswith("moe") else {"state": "zero3" if layer.endswith("attn") else "zero2"}


def _recompute_moe(layer):
    return {"recompute": "full" if layer.endswith(("moe", "attn")) else "none"}


CASES_2 = {
    "ep2_dropless": ("dropless", Mesh(dp_shard=2, ep=2), _ep_moe),
    "ep2_capacity": ("capacity", Mesh(dp_shard=2, ep=2), _ep_moe),
    # MoE layers recomputed on two pipeline stages: the routing's shape arithmetic (a SymInt) stays outside the
    # checkpoint regions, where the second stage computes it again (passes/recompute.py, _shape_arithmetic)
    "pp2_recompute_capacity": ("capacity", Mesh(pp=2), _recompute_moe),
}
CASES_4 = {
    "ep2_dp4_dropless": ("dropless", Mesh(dp_shard=4, ep=2), _ep_moe_zero_rest),  # edp = 2
    "ep2_dp2_tp2_capacity": ("capacity", Mesh(dp_shard=2, tp=2, ep=2), _ep_moe_tp_attn),
    "ep2_hsdp_capacity": ("capacity", Mesh(dp_replicate=2, dp_shard=2, ep=2), _ep_moe),
}
# `make test` (tests/_tiers.py): dropless routing on EP 2 × DP 4 (expert-data-parallel 2) stands for it on DP 2;
# EP with HSDP (the experts' replica reduction) runs under `make test-full` only
CASES_2 = sample(CASES_2, ("ep2_capacity", "pp2_recompute_capacity"))
CASES_4 = sample(CASES_4, ("ep2_dp4_dropless", "ep2_dp2_tp2_capacity"))


def _train(rank, world_size, kind, plan):
    program = build_program(_model(kind), _graph(kind), plan, TRAIN, optimizer=OPT)
    losses = [program.step(program.local_batch(toks), loss_fn).loss for toks in batches()]
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "ep": program.ctx.coord("ep") if program.ctx.size("ep") > 1 else 0}


def _reference(kind):
    model = _model(kind)
    params = list(model.parameters())
    losses = []
    for toks in batches():
        total = 0.0
        for chunk in toks.chunk(4, 0):  # 2 rows per forward, as every rank's micro-batch below
            loss = loss_fn(model(chunk), chunk) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, OPT.max_grad_norm)
        with torch.no_grad():
            for p in params:
                p -= OPT.lr * p.grad
                p.grad = None
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _full_params(results, mesh):
    """Full parameters: tp pieces and ZeRO-3 chunks as in _runtime_cases, expert shards concatenated over ep;
    pp > 1 (whole parameters): each stage's own."""
    if mesh.pp > 1:
        return {fqn: value for r in results for fqn, value in r["shards"].items()}
    full = {}
    for fqn, p in results[0]["placements"].items():
        def piece(tp_rank, ep_rank):
            ranks = [r for r in results if r["coords"]["tp"] == tp_rank and r["coords"]["dp_replicate"] == 0 and r["ep"] == ep_rank]
            ranks.sort(key=lambda r: r["coords"]["dp_shard"])
            if p.dp_dim is not None:
                ranks = [r for r in results if r["coords"]["tp"] == tp_rank and r["coords"]["dp_replicate"] == 0]
                ranks.sort(key=lambda r: r["coords"]["dp_shard"])
                return torch.cat([r["shards"][fqn] for r in ranks], 0)
            return ranks[0]["shards"][fqn]

        if p.ep_dim is not None:
            full[fqn] = torch.cat([piece(0, e) for e in range(mesh.ep)], p.ep_dim)
        elif p.tp_dim is not None:
            full[fqn] = torch.cat([piece(t, 0) for t in range(mesh.tp)], p.tp_dim)
        else:
            full[fqn] = piece(0, 0)
    return full


def _jobs(cases):
    return {name: functools.partial(_train, kind=kind, plan=_plan(kind, mesh, choose)) for name, (kind, mesh, choose) in cases.items()}


@pytest.fixture(scope="module")
def references():
    return {kind: _reference(kind) for kind in MODELS}


@pytest.fixture(scope="module")
def results2():
    return run_gloo_cases(_jobs(CASES_2), 2, timeout_s=400)


@pytest.fixture(scope="module")
def results4():
    return run_gloo_cases(_jobs(CASES_4), 4, timeout_s=400)


def _check(results, reference, mesh):
    ref_losses, ref_params = reference
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = _full_params(results, mesh)
    assert set(full) == set(ref_params)
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_ep_world2(results2, references, name):
    kind, mesh, _ = CASES_2[name]
    _check(results2[name], references[kind], mesh)


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_ep_world4(results4, references, name):
    kind, mesh, _ = CASES_4[name]
    _check(results4[name], references[kind], mesh)


def test_capacity_model_drops_tokens():
    """The capacity case is not dropless in disguise: some assignments are dropped in a 2-row forward."""
    moe = _model("capacity").blocks[0].moe
    x = torch.randn(16, moe.router.in_features, generator=torch.Generator().manual_seed(0))
    assert not bool(moe.route(x).kept.all())


@pytest.mark.slow
def test_ep_graph_and_shapes():
    plan = _plan("dropless", Mesh(dp_shard=4, ep=2), _ep_moe)
    with fake_world(4, 3):
        program = build_program(_model("dropless"), _graph("dropless"), plan, TRAIN)
    targets = [n.target for n in program.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ep_dispatch) == targets.count(ep_combine) == 2  # one pair per MoE block
    assert program.ctx.coord("ep") == 1 and program.ctx.coord("edp") == 1
    w = program.param_placements["blocks.0.moe.w_gate"]
    assert w.global_shape == (4, 128, 64) and w.local_shape == (2, 128, 64) and w.ep_dim == 0
    assert program.param_placements["blocks.0.moe.router.weight"].ep_dim is None


@pytest.mark.slow
def test_ep_with_zero3_experts_is_refused():
    plan = _plan("dropless", Mesh(dp_shard=2, ep=2), lambda layer: {"ep": layer.endswith("moe"), "state": "zero3"})
    with fake_world(2, 0), pytest.raises(PlanError, match="expert parallelism with state='zero3'"):
        build_program(_model("dropless"), _graph("dropless"), plan, TRAIN)


@pytest.mark.slow
def test_expert_placement_is_a_dtensor_shard_when_ep_equals_dp_shard():
    from torch.distributed.tensor import Replicate, Shard

    from autoshard.passes.context import MESH_ORDER

    axis = MESH_ORDER.index("dp_shard")
    plan = _plan("dropless", Mesh(dp_shard=2, ep=2), _ep_moe)
    with fake_world(2, 1):
        placements = build_program(_model("dropless"), _graph("dropless"), plan, TRAIN).param_placements
    assert placements["blocks.1.moe.w_down"].placements[axis] == Shard(0)
    assert placements["blocks.1.moe.router.weight"].placements[axis] == Replicate()
