"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B; × ZeRO, × TP, × TP+SP) equals single-device training.

A 4-block tiny Llama (untied head) is split into 2 stages (pp=2) or 4 virtual
stages on 2 ranks (interleaved, v=2). Each case trains 3 SGD steps (fp32, 2
micro-batches, clipping on) and returns the losses every rank reports, the
rank's local fp32 shards and an inference ``forward``; the parent rebuilds
full parameters from the shards of every stage and compares them with plain
single-device training at rtol 1e-5. One gloo job per world size.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _harness import fake_world, run_gloo_cases
from autoshard.models import build
from autoshard.passes import capture
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import build_program
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.train import TrainSpec

SPEC, OVERRIDES = "llama:tiny", {"num_layers": 4}
OPT = OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=1.0)
STEPS, MICRO, BATCH, SEQ = 3, 2, 8, 8


def _model():
    return build(SPEC, **OVERRIDES)


@functools.lru_cache(maxsize=None)
def _graph():
    return capture(_model(), seq_lens=(8, 16))


def loss_fn(out, tokens):
    logits, values = out
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce + values.pow(2).mean()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _stage_of(layer: str, num_stages: int) -> int:
    """Blocks spread evenly; embed with the first block, final norm and heads with the last."""
    if layer.startswith("blocks."):
        return int(layer.split(".")[1]) * num_stages // OVERRIDES["num_layers"]
    return 0 if layer == "embed" else num_stages - 1


def make_plan(mesh: Mesh, schedule: str, virtual: int = 1, **fields) -> Plan:
    num_stages = mesh.pp * virtual
    layers = tuple(LayerStrategy(layer=l.name, stage=_stage_of(l.name, num_stages), **fields) for l in _graph().layers)
    sched = Schedule(name=schedule, num_micro_batches=MICRO, virtual_stages=virtual)
    return Plan(model_name=_graph().model_name, mesh=mesh, layers=layers, schedule=sched)


def train_case(rank, world_size, plan, graph=None):
    """Build, train STEPS steps; return losses, local shards, placements, coords and a forward's outputs.
    ``graph``: the parent's ``_graph()`` (no rank exports the model again)."""
    program = build_program(_model(), graph or _graph(), plan, TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"), optimizer=OPT)
    probe = _batches()[0][:2, :6]  # another shape than training: forward must not reuse the schedule's
    before = program.forward(probe)
    losses = [program.step(program.local_batch(toks), loss_fn).loss for toks in _batches()]
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "forward": tuple(t.detach() for t in before)}


def single_device():
    """Losses, final parameters and the initial forward of plain training (4 equal slices per batch)."""
    model = _model()
    probe = model(_batches()[0][:2, :6])
    params = list(model.parameters())
    losses = []
    for toks in _batches():
        total = 0.0
        for chunk in toks.chunk(4, 0):
            loss = loss_fn(model(chunk), chunk) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, OPT.max_grad_norm)
        with torch.no_grad():
            for p in params:
                p -= OPT.lr * p.grad
                p.grad = None
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, tuple(t.detach() for t in probe)


def reassemble(results: list[dict], mesh: Mesh) -> dict[str, torch.Tensor]:
    """Full parameters from every rank's shards: each pp rank contributes its stages' parameters."""
    full = {}
    fqns = {fqn for r in results for fqn in r["placements"]}
    for fqn in sorted(fqns):
        holders = [r for r in results if fqn in r["placements"] and r["coords"]["dp_replicate"] == 0]
        placement = holders[0]["placements"][fqn]
        tp_pieces = []
        for t in range(mesh.tp):
            ranks = sorted((r for r in holders if r["coords"]["tp"] == t), key=lambda r: r["coords"]["dp_shard"])
            if placement.dp_dim is not None:
                tp_pieces.append(torch.cat([r["shards"][fqn] for r in ranks], 0))
            else:
                tp_pieces.append(ranks[0]["shards"][fqn])
        full[fqn] = torch.cat(tp_pieces, placement.tp_dim) if placement.tp_dim is not None else tp_pieces[0]
    return full


CASES_2 = {
    "gpipe": (Mesh(pp=2), "gpipe", 1, {}),
    "1f1b": (Mesh(pp=2), "1f1b", 1, {}),
    "interleaved_1f1b": (Mesh(pp=2), "interleaved_1f1b", 2, {}),
}
CASES_4 = {
    "pp2_dp2_zero3_1f1b": (Mesh(pp=2, dp_shard=2), "1f1b", 1, {"state": "zero3"}),
    "pp2_dp2_zero1_interleaved": (Mesh(pp=2, dp_shard=2), "interleaved_1f1b", 2, {"state": "zero1"}),
    "pp2_tp2_gpipe": (Mesh(pp=2, tp=2), "gpipe", 1, {"tp": "megatron"}),
    # sequence-parallel boundaries: each tp rank sends its sequence chunk (passes/split_pipeline.py)
    "pp2_tp2_sp_1f1b": (Mesh(pp=2, tp=2), "1f1b", 1, {"tp": "megatron", "sp": True}),
}


def _run(cases, world_size):
    jobs = {name: functools.partial(train_case, plan=make_plan(mesh, sched, v, **fields), graph=_graph())
            for name, (mesh, sched, v, fields) in cases.items()}
    return run_gloo_cases(jobs, world_size, timeout_s=400)


@pytest.fixture(scope="module")
def reference():
    return single_device()


@pytest.fixture(scope="module")
def results2():
    return _run(CASES_2, 2)


@pytest.fixture(scope="module")
def results4():
    return _run(CASES_4, 4)


def _check(results, reference, mesh):
    ref_losses, ref_params, ref_forward = reference
    for r in results:  # every rank reports the same loss, equal to single-device
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for got, want in zip(r["forward"], ref_forward):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    full = reassemble(results, mesh)
    assert set(full) == set(ref_params)
    for fqn, value in full.items():
        torch.testing.assert_close(value, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


@pytest.mark.parametrize("name", list(CASES_2))
@pytest.mark.slow
def test_pp_world2_matches_single_device(results2, reference, name):
    _check(results2[name], reference, CASES_2[name][0])


@pytest.mark.parametrize("name", list(CASES_4))
@pytest.mark.slow
def test_pp_world4_matches_single_device(results4, reference, name):
    _check(results4[name], reference, CASES_4[name][0])


@pytest.mark.slow
def test_each_rank_holds_only_its_stages(results2):
    """pp=2, interleaved: rank 0 runs virtual stages 0 and 2, rank 1 stages 1 and 3; no parameter on both."""
    rank0, rank1 = (set(r["placements"]) for r in results2["interleaved_1f1b"])
    assert not rank0 & rank1
    assert {"embed.weight", "blocks.0.attn.q.weight", "blocks.2.attn.q.weight"} <= rank0
    assert {"blocks.1.attn.q.weight", "blocks.3.attn.q.weight", "head.weight", "value_head.bias"} <= rank1


# --------------------------------------------------------------------------- build only (fake process group)


@pytest.mark.slow
def test_rank_builds_only_its_stage():
    """pp rank 1 of pp2×dp2 (ZeRO-3): one stage, the second half's parameters, one boundary tensor in."""
    plan = make_plan(Mesh(pp=2, dp_shard=2), "1f1b", state="zero3")
    with fake_world(4, 2):
        program = build_program(_model(), _graph(), plan, TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"))
    layout = program.pipeline.layout
    assert (layout.num_stages, layout.local_stages, layout.input_names) == (2, (1,), ("tokens",))
    assert len(layout.boundaries[1]) == 1  # the residual stream; RoPE tables are recomputed from tokens
    expected = {f for f, _ in _model().named_parameters() if not f.startswith(("embed.", "blocks.0.", "blocks.1."))}
    assert set(program.param_placements) == set(program.optimizer.slots) == expected
    assert not any(p.is_meta for p in program.gm.local_parameters().values())


@pytest.mark.slow
def test_tied_embedding_on_two_pp_ranks_is_mirrored():
    """gpt:tiny's tied embedding/head on stages 0 and 1: pp rank 0 owns it, rank 1 holds a mirror outside its
    optimizer and placements (passes/split_pipeline.py, [Note: parameters shared between pp ranks])."""
    graph = capture(build("gpt:tiny"), seq_lens=(8, 16))
    names = [l.name for l in graph.layers]
    layers = tuple(LayerStrategy(layer=n, stage=int(i >= len(names) // 2)) for i, n in enumerate(names))
    plan = Plan(model_name=graph.model_name, mesh=Mesh(pp=2), layers=layers, schedule=Schedule(num_micro_batches=2))
    for rank in (0, 1):
        with fake_world(2, rank):
            program = build_program(build("gpt:tiny"), graph, plan,
                                    TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32"))
        assert [(s.fqn, s.owner, s.mirrors) for s in program.pipeline.layout.shared] == [("embed.weight", 0, (1,))]
        assert ("embed.weight" in program.param_placements) == (rank == 0)
        assert ("embed.weight" in program.optimizer.slots) == (rank == 0)
