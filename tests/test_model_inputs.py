"""Models whose forward takes more than the tokens — a padding mask, position ids, segment ids of packed
rows — capture, plan and train under autoshard like plain PyTorch (``passes/_capture_inputs.py``, [Note:
model inputs]; ``Program.step``'s dict batch and ``normalize_by``).

One gloo job (2 ranks) trains ``tests/_input_models.MaskedLM`` 3 SGD steps (fp32, 2 micro-batches, clipping
on) on padded (right, left) and packed batches under DDP, ZeRO-3, Megatron TP (with SP) and a 2-stage
pipeline; the loss is the token mean over the global batch (``normalize_by="loss_mask"``), compared with one
plain PyTorch process at rtol 1e-5. Bad inputs are refused naming the input.
"""

from __future__ import annotations

import functools

import pytest
import torch

import autoshard
from _harness import run_gloo_cases
from _input_models import masked_lm, packed_batch, padded_batch, token_loss_sum
from _runtime_cases import check_against_reference
from autoshard.errors import AutoshardError, CaptureError, PlanError
from autoshard.passes import capture
from autoshard.passes.capture import bind_example
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime import build_program
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.search.space import Constraints, is_tp_able
from autoshard.train import TrainSpec

OPT = OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=1.0)
STEPS, MICRO, BATCH, SEQ = 3, 2, 8, 16
INPUTS = ("input_ids", "attention_mask", "position_ids", "segment_ids")  # MaskedLM.forward's parameters


def batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches: ``"right"`` / ``"left"`` padded, ``"packed"`` documents, or ``"shared"``: right
    padded with one ``position_ids`` row ``[1, S]`` broadcast over the batch."""
    if kind == "packed":
        return [packed_batch(BATCH, SEQ, seed=10 + i) for i in range(STEPS)]
    out = [padded_batch(BATCH, SEQ, left=kind == "left", seed=20 + i) for i in range(STEPS)]
    if kind == "shared":
        for batch in out:
            batch["position_ids"] = torch.arange(SEQ)[None]
    return out


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k in INPUTS}


@functools.lru_cache(maxsize=None)
def captured(kind: str):
    """(graph, ModelInputs) of MaskedLM captured with ``kind``'s inputs (a keyword dict)."""
    example = model_inputs(batches(kind)[0])
    return capture(masked_lm(), example, seq_lens=(8, 16)), bind_example(masked_lm(), example)[1]


def make_plan(kind: str, mesh: Mesh, state: str = "replicate", tp: bool = False, sp: bool = False) -> Plan:
    graph, _ = captured(kind)
    half = len(graph.layers) // 2
    layers = tuple(
        LayerStrategy(layer=layer.name, state=state, tp="megatron" if tp and is_tp_able(layer) else "none", sp=sp,
                      stage=int(i >= half) if mesh.pp > 1 else 0)
        for i, layer in enumerate(graph.layers)
    )
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=MICRO))


def single_device(kind: str):
    """Losses, final parameters and final logits of plain PyTorch on the global batches (token-mean loss)."""
    model = masked_lm()
    params = list(model.parameters())
    losses = []
    for batch in batches(kind):
        loss = token_loss_sum(model(**model_inputs(batch)), batch) / batch["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPT.max_grad_norm)
        with torch.no_grad():
            for p in params:
                p -= OPT.lr * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    with torch.no_grad():
        logits = model(**model_inputs(batches(kind)[0]))[0]
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, logits


TRAIN = TrainSpec(global_batch=BATCH, seq_len=SEQ, precision="fp32", optimizer=autoshard.SGD(lr=OPT.lr),
                  grad_clip=OPT.max_grad_norm)


def searched_plan(kind: str) -> Plan:
    """``autoshard.compile``'s plan (plan mode) for 2 CPU ranks, DDP pinned on every layer."""
    graph, _ = captured(kind)
    pin = {layer.name: {"state": "replicate", "tp": "none"} for layer in graph.layers}
    return autoshard.compile(masked_lm(), "cpu:1x2", example_inputs=model_inputs(batches(kind)[0]), train=TRAIN,
                             constraints=Constraints(pin=pin, mesh={"dp_shard": 2}), time_limit_s=10).plan


def train_case(rank, world_size, kind: str, plan: Plan, graph, inputs, via_compile: bool = False):
    """Build ``plan`` (through ``autoshard.compile`` with ``via_compile``), train, and run ``forward``."""
    del rank, world_size
    train = TRAIN
    if via_compile:
        example = model_inputs(batches(kind)[0])
        program = autoshard.compile(masked_lm(), "cpu:1x2", example_inputs=example, train=train, plan=plan).program
    else:
        program = build_program(masked_lm(), graph, plan, train, optimizer=OPT, inputs=inputs)
    losses = [program.step(program.local_batch(b), token_loss_sum, normalize_by="loss_mask").loss
              for b in batches(kind)]
    with torch.no_grad():
        logits = program(**model_inputs(program.local_batch(batches(kind)[0])))[0]
    return {"losses": losses, "shards": program.local_state_dict(), "placements": program.param_placements,
            "coords": program.ctx.coords, "logits": logits, "dp": (program.ctx.coord("dp"), program.ctx.size("dp")),
            "errors": _bad_calls(program, kind) if via_compile else None}


def _bad_calls(program, kind: str) -> list[str]:
    """The messages of a built program's refusals of bad inputs."""
    batch = program.local_batch(batches(kind)[0])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    calls = [
        lambda: program(ids, attention_mask=mask[:1], position_ids=batch["position_ids"]),  # batch differs
        lambda: program(ids, attention_mask=mask),  # position_ids missing
        lambda: program(ids, mask, batch["position_ids"], segment_ids=ids),  # not captured
        lambda: program(ids, mask.bool(), batch["position_ids"]),  # dtype
        lambda: program.step({**batch, "loss_mask": batch["loss_mask"][:1]}, token_loss_sum),  # a loss entry's rows
        lambda: program.step(batch, token_loss_sum, normalize_by="weights"),
    ]
    messages = []
    for call in calls:
        try:
            call()
        except AutoshardError as err:
            messages.append(str(err))
        else:
            messages.append("accepted")
    return messages


CASES = {
    "ddp_right": ("right", dict(mesh=Mesh(dp_shard=2)), True),
    "zero3_left": ("left", dict(mesh=Mesh(dp_shard=2), state="zero3"), False),
    "ddp_packed": ("packed", dict(mesh=Mesh(dp_shard=2)), False),
    "zero3_shared_positions": ("shared", dict(mesh=Mesh(dp_shard=2), state="zero3"), False),
    "zero3_packed": ("packed", dict(mesh=Mesh(dp_shard=2), state="zero3"), False),
    "tp2_right": ("right", dict(mesh=Mesh(tp=2), tp=True), False),
    "tp2_sp_packed": ("packed", dict(mesh=Mesh(tp=2), tp=True, sp=True), False),
    "pp2_right": ("right", dict(mesh=Mesh(pp=2)), False),
    "pp2_packed": ("packed", dict(mesh=Mesh(pp=2)), False),
}


@pytest.fixture(scope="module")
def results():
    jobs = {}
    for name, (kind, fields, via) in CASES.items():
        plan = searched_plan(kind) if via else make_plan(kind, **fields)
        graph, inputs = captured(kind)
        jobs[name] = functools.partial(train_case, kind=kind, plan=plan, graph=graph, inputs=inputs, via_compile=via)
    return run_gloo_cases(jobs, 2, timeout_s=400)


@pytest.fixture(scope="module")
def references():
    return {kind: single_device(kind) for kind in ("right", "left", "packed", "shared")}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_world2_matches_single_device(results, references, name):
    kind, fields, _ = CASES[name]
    losses, params, logits = references[kind]
    check_against_reference(results[name], (losses, params), fields["mesh"])
    for r in results[name]:  # forward with the extra inputs, on the trained parameters
        coord, dp = r["dp"]
        torch.testing.assert_close(r["logits"], logits.chunk(dp, 0)[coord], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bad_inputs_to_a_program_name_the_input(results):
    messages = results["ddp_right"][0]["errors"]
    expected = ["input 'attention_mask' is torch.int64 (1, 16)", "input 'position_ids' is missing",
                "input 'segment_ids' was not in example_inputs", "input 'attention_mask' is torch.bool",
                "batch['loss_mask'] has 1 rows", "normalize_by='weights' is not a key of the batch"]
    for message, start in zip(messages, expected):
        assert message.startswith(start), message
        assert "\n" not in message


def test_bad_example_inputs_name_the_input():
    batch = batches("right")[0]
    model = masked_lm()
    with pytest.raises(CaptureError, match="example input 'attention_mask' has 3 rows .* the tokens have 8"):
        bind_example(model, (batch["input_ids"], batch["attention_mask"][:3]))
    with pytest.raises(CaptureError, match="example_inputs has no 'input_ids'"):
        bind_example(model, {"attention_mask": batch["attention_mask"]})
    with pytest.raises(CaptureError, match="example input 'mask' is not a positional parameter"):
        bind_example(model, {"input_ids": batch["input_ids"], "mask": batch["attention_mask"]})
    positional, inputs = bind_example(model, {"input_ids": batch["input_ids"], "segment_ids": batch["input_ids"]})
    assert positional[1:3] == (None, None) and inputs.names == ("input_ids", "segment_ids")
    assert [s.dims for s in inputs.tensors] == [("batch", "seq")] * 2 and inputs.tensors[1].keyword


def test_a_pipeline_refuses_an_input_broadcast_over_the_batch():
    graph, _ = captured("right")
    ids = batches("right")[0]["input_ids"]
    _, inputs = bind_example(masked_lm(), (ids, None, torch.arange(SEQ)[None]))  # position_ids [1, S]
    assert not inputs.tensors[1].batched
    with pytest.raises(PlanError, match="input 'position_ids' is broadcast over the batch"):
        build_program(masked_lm(), graph, make_plan("right", Mesh(pp=2)), inputs=inputs)
