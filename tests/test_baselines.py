"""Baselines and the benchmark runner on CPU (gloo, world 2, tiny models).

One spawned job trains, from the same seeded weights and batches, autoshard's
ZeRO-3 plan and the hand-written FSDP2 baseline (reshard after forward and
not) for 3 steps with 2 micro-batches and clipping, in fp32:

- SGD: losses, gradient norms and final full parameters agree at rtol 1e-5
  (the same arithmetic up to reduction order);
- AdamW: losses agree at rtol 1e-4. Adam divides by ``sqrt(v) + eps``, so a
  parameter whose true gradient is ~0 (an attention key bias: softmax is
  shift-invariant) moves by round-off-sized steps that differ with reduction
  order (PLATFORM_NOTES, "Equality tests"); the losses stay within 1e-4.

A second job runs ``benchmarks/run.py``'s ``main`` on 2 gloo ranks (tiny
sizes, two forced autoshard plans, FSDP2, Megatron and DeepSpeed skipped) and checks the JSON and
markdown it writes.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from _harness import run_gloo, run_gloo_cases
from _runtime_cases import graph_of, reassemble
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime.optimizer import OptimizerConfig
from benchmarks.baselines.autoshard_trainer import AutoshardTrainer, uniform_plan
from benchmarks.baselines.common import BaselineError, RunSpec, make_batches, policy_loss
from benchmarks.baselines.fsdp2 import FSDP2Options, FSDP2Trainer

STEPS = 3
SGD = OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=1.0)
ADAMW = OptimizerConfig(name="adamw", lr=1e-3, max_grad_norm=1.0)


def _spec(model: str, optimizer: OptimizerConfig) -> RunSpec:
    return RunSpec(model=model, global_batch=8, seq_len=8, num_micro_batches=2, precision="fp32",
                   optimizer=optimizer, device="cpu")


def _autoshard_case(rank, world_size, model, optimizer):
    spec = _spec(model, optimizer)
    graph = graph_of(model)
    plan = uniform_plan(graph, Mesh(dp_shard=world_size), state="zero3", num_micro_batches=2, global_batch=8,
                        seq_len=8, precision="fp32", optimizer=optimizer.name)
    trainer = AutoshardTrainer(spec, torch.device("cpu"), graph, plan)
    losses, norms = [], []
    for tokens in make_batches(128, spec, STEPS):
        losses.append(trainer.step(tokens))
        norms.append(trainer.last_grad_norm)
    return {"losses": losses, "norms": norms, "shards": trainer.local_state(),
            "placements": trainer.program.param_placements, "coords": trainer.program.ctx.coords}


def _fsdp2_case(rank, world_size, model, optimizer, reshard):
    spec = _spec(model, optimizer)
    trainer = FSDP2Trainer(spec, torch.device("cpu"), FSDP2Options(reshard_after_forward=reshard))
    losses, norms = [], []
    for tokens in make_batches(128, spec, STEPS):
        losses.append(trainer.step(tokens))
        norms.append(trainer.last_grad_norm)
    return {"losses": losses, "norms": norms, "full": trainer.full_state()}


CASES = {
    "autoshard_sgd": functools.partial(_autoshard_case, model="gpt:tiny", optimizer=SGD),
    "fsdp2_sgd": functools.partial(_fsdp2_case, model="gpt:tiny", optimizer=SGD, reshard=True),
    "fsdp2_noreshard_sgd": functools.partial(_fsdp2_case, model="gpt:tiny", optimizer=SGD, reshard=False),
    "autoshard_adamw": functools.partial(_autoshard_case, model="gpt:tiny", optimizer=ADAMW),
    "fsdp2_adamw": functools.partial(_fsdp2_case, model="gpt:tiny", optimizer=ADAMW, reshard=True),
}


@pytest.fixture(scope="module")
def results():
    return run_gloo_cases(CASES, 2, timeout_s=300)


@pytest.mark.parametrize("baseline", ["fsdp2_sgd", "fsdp2_noreshard_sgd"])
def test_fsdp2_matches_autoshard_zero3_sgd(results, baseline):
    ours, theirs = results["autoshard_sgd"], results[baseline]
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(theirs[rank]["losses"]), torch.tensor(ours[rank]["losses"]),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(theirs[rank]["norms"]), torch.tensor(ours[rank]["norms"]),
                                   rtol=1e-5, atol=1e-6)
    full = reassemble(ours, Mesh(dp_shard=2))
    assert set(full) == set(theirs[0]["full"])
    for name, value in full.items():
        torch.testing.assert_close(theirs[0]["full"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_training_moved_the_weights(results):
    """Guards the comparison above: the steps changed most parameters and every loss differs."""
    initial = dict(build("gpt:tiny").named_parameters())
    moved = [n for n, v in results["fsdp2_sgd"][0]["full"].items() if not torch.allclose(v, initial[n].detach())]
    assert len(moved) > len(initial) // 2
    assert len(set(results["fsdp2_sgd"][0]["losses"])) == STEPS


def test_fsdp2_matches_autoshard_zero3_adamw_losses(results):
    ours, theirs = results["autoshard_adamw"], results["fsdp2_adamw"]
    torch.testing.assert_close(torch.tensor(theirs[0]["losses"]), torch.tensor(ours[0]["losses"]), rtol=1e-4, atol=1e-5)


def test_policy_loss_is_ce_plus_value_mse():
    torch.manual_seed(0)
    logits, values, tokens = torch.randn(2, 5, 7), torch.randn(2, 5), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(policy_loss((logits, values), tokens), expected + values.pow(2).mean())


def test_run_spec_rejects_bad_values():
    with pytest.raises(BaselineError, match="precision='fp16'"):
        RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, precision="fp16")
    with pytest.raises(BaselineError, match="device='tpu'"):
        RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, device="tpu")


# --------------------------------------------------------------------------- benchmarks/run.py smoke


def _run_main(rank, world_size, out, calibration):
    from benchmarks import run

    argv = ["--device", "cpu", "--model", "gpt:tiny", "--batch", "4", "--seq", "16", "--steps", "2", "--warmup", "1",
            "--precision", "fp32", "--plans", "forced", "--max-plans", "2", "--calibration", calibration,
            "--configs", "autoshard,fsdp2,megatron-tp,deepspeed-z3", "--out", out]
    return run.main(argv)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    calibration = tmp / "cal.json"
    calibration.write_text(json.dumps({"matmul_efficiency": 0.05, "hbm_efficiency": 0.5}))
    run_gloo(_run_main, 2, str(tmp / "out"), str(calibration), timeout_s=240)
    return json.loads((tmp / "out" / "results.json").read_text()), (tmp / "out" / "results.md").read_text()


def test_run_measures_forced_plans_and_baselines(bench):
    data, _ = bench
    rows = {r["config"]: r for r in data["rows"]}
    autoshard = [r for r in data["rows"] if r["config"].startswith("autoshard")]
    assert len(autoshard) == 2 and len({r["plan"] for r in autoshard}) == 2
    for row in autoshard + [rows["fsdp2"]]:
        assert row["status"] == "ok", row["status"]
        assert len(row["losses"]) == 2 and len(row["step_times_s"]) == 1
        assert row["tokens_per_s"] == pytest.approx(4 * 16 / row["median_step_s"])
        assert row["predicted"]["step_time_s"] > 0 and row["predicted_step_error"] is not None
    # Same weights and batches: every config starts from the same step-1 loss.
    first = [r["losses"][0] for r in autoshard + [rows["fsdp2"]]]
    assert max(first) - min(first) < 1e-4 * abs(first[0])
    assert rows["megatron-tp"]["status"].startswith("skipped")
    assert rows["deepspeed-z3"]["status"].startswith(("skipped", "ok"))


def test_run_reports_calibrated_predictions(bench):
    data, text = bench
    row = data["rows"][0]
    # matmul_efficiency 0.05 makes the calibrated cluster slower: a longer predicted step.
    assert row["predicted_calibrated"]["step_time_s"] > row["predicted"]["step_time_s"]
    assert data["meta"]["world_size"] == 2 and data["meta"]["calibration"].endswith("cal.json")
    assert "| autoshard |" in text and "mean |error| (calibrated)" in text
