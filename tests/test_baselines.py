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

A second job runs ``benchmarks/run.py``'s ``main`` on 2 gloo ranks (llama:tiny):
``--plans forced --list-plans`` lists ≥ 10 distinct plans with predictions (pp,
SP, recompute and quantized-comm variants among them), then a measured run of
the first 2 forced plans, FSDP2, and Megatron / DeepSpeed skipped checks the
JSON and markdown it writes.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from _harness import run_gloo, run_gloo_cases
from _tiers import FULL
from _runtime_cases import graph_of, reassemble
from autoshard.models import build
from autoshard.plan import Mesh
from autoshard.runtime.optimizer import OptimizerConfig
from benchmarks.baselines.autoshard_trainer import AutoshardTrainer, uniform_plan
from benchmarks.baselines.common import BaselineError, RunSpec, make_batches, policy_loss
from benchmarks.baselines.fsdp2 import FSDP2Options, FSDP2Trainer

STEPS = 3
HAS_CXX = any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))  # torch.compile on CPU
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


def _fsdp2_case(rank, world_size, model, optimizer, reshard, compile=False):
    spec = _spec(model, optimizer)
    trainer = FSDP2Trainer(spec, torch.device("cpu"), FSDP2Options(reshard_after_forward=reshard, compile=compile))
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
# each block torch.compile'd (the fsdp2-noreshard-compiled config): inductor's C++ builds, `make test-full` only
# (tests/_tiers.py); the uncompiled FSDP2 baselines run the same comparison
if HAS_CXX and FULL:
    CASES["fsdp2_noreshard_compiled_sgd"] = functools.partial(_fsdp2_case, model="gpt:tiny", optimizer=SGD,
                                                              reshard=False, compile=True)


@pytest.fixture(scope="module")
def results():
    return run_gloo_cases(CASES, 2, timeout_s=300)


@pytest.mark.parametrize("baseline", ["fsdp2_sgd", "fsdp2_noreshard_sgd", pytest.param(
    "fsdp2_noreshard_compiled_sgd", marks=[pytest.mark.full,
                                        pytest.mark.skipif(not HAS_CXX, reason="torch.compile needs a C++ compiler")])])
@pytest.mark.slow
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


@pytest.mark.slow
def test_training_moved_the_weights(results):
    """Guards the comparison above: the steps changed most parameters and every loss differs."""
    initial = dict(build("gpt:tiny").named_parameters())
    moved = [n for n, v in results["fsdp2_sgd"][0]["full"].items() if not torch.allclose(v, initial[n].detach())]
    assert len(moved) > len(initial) // 2
    assert len(set(results["fsdp2_sgd"][0]["losses"])) == STEPS


@pytest.mark.slow
def test_fsdp2_matches_autoshard_zero3_adamw_losses(results):
    ours, theirs = results["autoshard_adamw"], results["fsdp2_adamw"]
    torch.testing.assert_close(torch.tensor(theirs[0]["losses"]), torch.tensor(ours[0]["losses"]), rtol=1e-4, atol=1e-5)


def test_policy_loss_is_ce_plus_value_mse():
    torch.manual_seed(0)
    logits, values, tokens = torch.randn(2, 5, 7), torch.randn(2, 5), torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(policy_loss((logits, values), tokens), expected + values.pow(2).mean())


@pytest.mark.slow
def test_attn_override_reaches_reference_model_and_capture():
    """``--attn sdpa`` (RunSpec.attn_impl): every config's reference model and the searched graph use it."""
    from benchmarks import run
    from benchmarks.baselines.common import reference_model

    default = RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, precision="fp32", device="cpu")
    fused = RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, precision="fp32", device="cpu", attn_impl="sdpa")
    impls = lambda m: {a.attn_impl for a in m.modules() if hasattr(a, "attn_impl")}  # noqa: E731
    plain, sdpa = reference_model(default, "cpu"), reference_model(fused, "cpu")
    assert impls(plain) == {"math"} and impls(sdpa) == {"sdpa"}
    for (name, a), b in zip(plain.state_dict().items(), sdpa.state_dict().values()):
        assert torch.equal(a, b), name  # the same seeded weights whatever the attention path
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(sdpa(tokens)[0], plain(tokens)[0], rtol=1e-5, atol=1e-5)
    # the math path keeps the S²-sized scores/probabilities for backward, fused SDPA does not
    quadratic = [sum(layer.saved_interior_per_token_seq for layer in run._capture(spec).layers) for spec in (default, fused)]
    assert quadratic[0] > 0 and quadratic[1] < quadratic[0], quadratic


def test_run_spec_rejects_bad_values():
    with pytest.raises(BaselineError, match="precision='fp16'"):
        RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, precision="fp16")
    with pytest.raises(BaselineError, match="device='tpu'"):
        RunSpec(model="gpt:tiny", global_batch=2, seq_len=8, device="tpu")


# --------------------------------------------------------------------------- benchmarks/run.py smoke


def _run_main(rank, world_size, out, calibration):
    """``--list-plans`` (search only, every forced plan), then a measured run of the first 3 plans."""
    from benchmarks import run

    common = ["--device", "cpu", "--model", "llama:tiny", "--batch", "4", "--seq", "16", "--precision", "fp32",
              "--plans", "forced", "--calibration", calibration]
    run.main([*common, "--list-plans", "--max-plans", "30", "--out", out + "/list"])
    argv = [*common, "--steps", "2", "--warmup", "1", "--max-plans", "2",
            "--configs", "autoshard,fsdp2,megatron-tp,deepspeed-z3", "--out", out]
    return run.main(argv)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    calibration = tmp / "cal.json"
    calibration.write_text(json.dumps({"matmul_efficiency": 0.05, "hbm_efficiency": 0.5}))
    run_gloo(_run_main, 2, str(tmp / "out"), str(calibration), timeout_s=240)
    listed = json.loads((tmp / "out" / "list" / "plans.json").read_text())
    return json.loads((tmp / "out" / "results.json").read_text()), (tmp / "out" / "results.md").read_text(), listed


@pytest.mark.slow
def test_repredict_searched_reproduces_the_recorded_prediction(bench, tmp_path):
    """benchmarks/repredict_searched.py: the search run again on a run's meta, with the run's calibration,
    finds the recorded plan and its recorded calibrated prediction."""
    from benchmarks import repredict_searched

    data, _, _ = bench
    calibrations = tmp_path / "cal"
    calibrations.mkdir()
    (calibrations / "llama_tiny.json").write_text(json.dumps({"matmul_efficiency": 0.05, "hbm_efficiency": 0.5}))
    results = tmp_path / "run" / "results.json"
    results.parent.mkdir()
    results.write_text(json.dumps(data))
    env = dict(os.environ)
    rows = repredict_searched.repredict(repredict_searched.result_files([tmp_path / "run"]), calibrations)
    assert dict(os.environ) == env  # run.py's WORLD_SIZE & co. must not leak into later tests' launches
    recorded = next(r for r in data["rows"] if r["config"] == "autoshard")
    assert len(rows) == 1 and rows[0]["same_plan"], rows
    assert rows[0]["predicted_s"] == pytest.approx(recorded["predicted_calibrated"]["step_time_s"], rel=1e-9)
    assert rows[0]["predicted_bytes"] == recorded["predicted_calibrated"]["peak_memory_bytes"]
    text = repredict_searched.markdown(rows)
    assert "| run | llama:tiny |" in text and "median |error| step" in text


@pytest.mark.slow
def test_list_plans_covers_ten_distinct_forced_plans(bench):
    from autoshard.plan import Plan
    from benchmarks.baselines.plans import decision_key

    _, _, listed = bench
    plans = {row["config"]: Plan.from_json(row["plan_json"]) for row in listed["plans"]}
    assert len(plans) == len(listed["plans"]) >= 10
    assert len({decision_key(p) for p in plans.values()}) == len(plans)
    assert next(iter(plans)) == "autoshard"
    for row in listed["plans"]:
        assert row["predicted"]["step_time_s"] > 0 and row["predicted"]["peak_memory_bytes"] > 0, row
        assert row["predicted_calibrated"]["step_time_s"] > 0, row
    # The forced families the runtime now executes are all there on 2 ranks.
    assert any(p.mesh.pp == 2 and p.schedule.name == "1f1b" for p in plans.values())
    assert any(p.mesh.tp == 2 and any(s.sp for s in p.layers) for p in plans.values())
    assert any(any(s.recompute == "selective" for s in p.layers) for p in plans.values())
    assert any(any(s.weight_comm == "int8" for s in p.layers) for p in plans.values())
    assert any(any(s.grad_comm == "int8" for s in p.layers) for p in plans.values())
    assert any(p.schedule.num_micro_batches == 2 and p.mesh.pp == 1 for p in plans.values())


@pytest.mark.slow
def test_runtime_refusal_and_variants():
    from benchmarks.baselines.plans import runtime_refusal, variants

    gpt, llama = graph_of("gpt:tiny"), graph_of("llama:tiny")
    assert "tied" in runtime_refusal(uniform_plan(gpt, Mesh(pp=2), state="replicate"), gpt)
    assert runtime_refusal(uniform_plan(gpt, Mesh(dp_shard=2), state="zero3"), gpt) is None
    assert runtime_refusal(uniform_plan(llama, Mesh(pp=2), state="replicate"), llama) is None
    names2, names4 = [v.name for v in variants(2)], [v.name for v in variants(4)]
    assert names2[:4] == ["replicate", "zero3", "tp2", "pp2-1f1b"] and "tp4" not in names2
    assert {"tp4", "zero3-rep2", "tp2-zero3"} <= set(names4) and len(set(names4)) == len(names4)
    # one device: the variants a single rank can differ in (a state that shards nothing is replicate's)
    assert [v.name for v in variants(1)] == ["replicate", "full-recompute", "replicate-mbH", "offload"]


@pytest.mark.slow
def test_run_measures_forced_plans_and_baselines(bench):
    data, _, listed = bench
    rows = {r["config"]: r for r in data["rows"]}
    autoshard = [r for r in data["rows"] if r["config"].startswith("autoshard")]
    # --max-plans truncates the listed order: the run measures its first 2 plans.
    assert [r["config"] for r in autoshard] == [p["config"] for p in listed["plans"][:2]]
    assert len({r["plan"] for r in autoshard}) == 2
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


@pytest.mark.slow
def test_run_reports_calibrated_predictions(bench):
    data, text, _ = bench
    row = data["rows"][0]
    # matmul_efficiency 0.05 makes the calibrated cluster slower: a longer predicted step.
    assert row["predicted_calibrated"]["step_time_s"] > row["predicted"]["step_time_s"]
    assert data["meta"]["world_size"] == 2 and data["meta"]["calibration"].endswith("cal.json")
    assert "| autoshard |" in text and "mean |error| (calibrated)" in text


# --------------------------------------------------------------------------- Megatron vocabulary, ties; loss pairs


def test_megatron_padded_vocab_follows_megatron_lm():
    from benchmarks.baselines.megatron import padded_vocab

    assert padded_vocab(32000, 4) == 32000  # divisible: kept (llama)
    assert padded_vocab(128, 2) == 128
    assert padded_vocab(50257, 2) == 50432  # GPT: next multiple of 128·tp
    assert padded_vocab(50257, 4) == 50688
    assert padded_vocab(127, 2) == 256


def test_megatron_vocab_shards_reassemble_the_padded_weight():
    from benchmarks.baselines.megatron import vocab_shard

    weight = torch.randn(127, 8)
    shards = [vocab_shard(weight, 2, rank, 256) for rank in range(2)]
    assert [tuple(s.shape) for s in shards] == [(128, 8), (128, 8)]
    full = torch.cat(shards)
    torch.testing.assert_close(full[:127], weight, rtol=0, atol=0)
    assert not full[127:].any()
    with pytest.raises(BaselineError, match="divisible by tp=4"):
        vocab_shard(weight, 4, 0, 130)


def _emulated_megatron_loss(shards, x_ids, tokens, vocab):
    """The tied, padded vocab-parallel path in plain torch: per-rank shards, summed lookups, masked logits."""
    from benchmarks.baselines.megatron import mask_padded_logits

    per_rank = shards[0].shape[0]
    hidden = 0
    for rank, shard in enumerate(shards):  # VocabParallelEmbedding: masked local lookup + all-reduce (sum)
        local = x_ids - rank * per_rank
        inside = (local >= 0) & (local < per_rank)
        hidden = hidden + torch.nn.functional.embedding(local.clamp(0, per_rank - 1), shard) * inside[..., None]
    logits = torch.cat([mask_padded_logits(hidden @ shard.t(), vocab, rank) for rank, shard in enumerate(shards)], -1)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def test_megatron_tied_padded_head_matches_the_reference():
    """One shard per rank serves the embedding and the head: same loss, and its gradient is the sum of both uses."""
    from benchmarks.baselines.megatron import padded_vocab, vocab_shard

    torch.manual_seed(0)
    vocab, tp = 127, 2
    weight = torch.randn(vocab, 16, requires_grad=True)
    ids, tokens = torch.randint(0, vocab, (3, 5)), torch.randint(0, vocab, (3, 5))
    hidden = torch.nn.functional.embedding(ids, weight)
    reference = torch.nn.functional.cross_entropy((hidden @ weight.t()).reshape(-1, vocab), tokens.reshape(-1))
    reference.backward()
    padded = padded_vocab(vocab, tp)
    shards = [vocab_shard(weight.detach(), tp, r, padded).clone().requires_grad_(True) for r in range(tp)]
    loss = _emulated_megatron_loss(shards, ids, tokens, vocab)
    loss.backward()
    torch.testing.assert_close(loss, reference)
    grads = torch.cat([s.grad for s in shards])
    torch.testing.assert_close(grads[:vocab], weight.grad)
    assert not grads[vocab:].any()  # padded rows: no gradient, so clipping and the update ignore them


def test_reference_model_is_a_fresh_copy_of_one_seeded_build():
    from benchmarks.baselines.common import reference_model

    spec = _spec("gpt:tiny", SGD)
    first, second = reference_model(spec, "cpu"), reference_model(spec, "cpu")
    assert first.head.weight is first.embed.weight  # the tie survives the copy
    assert first.embed.weight.data_ptr() != second.embed.weight.data_ptr()
    expected = build("gpt:tiny").state_dict()
    for name, value in first.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_loss_agreement_pairs_megatron_with_autoshard_tp():
    from benchmarks.baselines import report

    def row(config, losses, tp=1, sp=False, status="ok"):
        return {"config": config, "status": status, "losses": losses, "tp": tp, "sp": sp}

    rows = [row("autoshard", [10.0, 9.0]), row("autoshard-tp2", [10.0, 9.01], tp=2),
            row("autoshard-tp4-sp", [10.0, 9.02], tp=4, sp=True), row("megatron-tp", [10.001, 9.0]),
            row("megatron-tp-sp", [10.0, 9.5]), row("fsdp2", [10.0, 9.0]), row("deepspeed-z3", [10.0, 9.0]),
            row("deepspeed-z2", [], status="failed: boom")]
    pairs = {c["config"]: c for c in report.loss_agreement(rows)}
    assert pairs["megatron-tp"]["reference"] == "autoshard-tp2" and pairs["megatron-tp"]["within_tolerance"]
    assert pairs["megatron-tp"]["max_rel_diff"] == pytest.approx(0.01 / 9.01)
    assert pairs["megatron-tp-sp"]["reference"] == "autoshard-tp4-sp"
    assert not pairs["megatron-tp-sp"]["within_tolerance"]  # 9.5 vs 9.02: 5%
    assert pairs["deepspeed-z3"]["reference"] == "fsdp2" and pairs["deepspeed-z3"]["max_rel_diff"] == 0
    assert "deepspeed-z2" not in pairs
    # No autoshard TP plan (GPT): the searched plan stands in, and the report says so.
    no_tp = report.loss_agreement([row("autoshard", [10.0, 9.0]), row("megatron-tp", [10.0, 9.0])])
    assert no_tp[0]["reference"] == "autoshard" and "no autoshard TP plan" in no_tp[0]["basis"]
    text = report.markdown({"model": "m", "global_batch": 1, "seq_len": 2, "precision": "bf16", "world_size": 2,
                            "device_name": "d", "cluster": "c", "torch": "t", "date": "now"}, rows)
    assert "Loss agreement" in text and "| megatron-tp-sp | autoshard-tp4-sp |" in text and "| NO |" in text


def _megatron_gloo_case(rank, world_size):
    """Megatron-Core on gloo (no SP: its SP path needs CUDA): gpt:tiny with an odd vocabulary, tied, padded."""
    from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel

    from benchmarks.baselines.common import SEED
    from benchmarks.baselines.megatron import MegatronPolicy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    config = ModelParallelConfig(tensor_model_parallel_size=world_size, params_dtype=torch.float32,
                                 use_cpu_initialization=True, perform_initialization=False,
                                 gradient_accumulation_fusion=False)
    ref = build("gpt:tiny", vocab_size=127, seed=SEED)
    policy = MegatronPolicy(build("gpt:tiny", vocab_size=127, seed=SEED), config, tensor_parallel, world_size, rank)
    tokens = torch.randint(0, 127, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = policy.loss(policy(tokens), tokens)
    loss.backward()
    expected = policy_loss(ref(tokens), tokens)
    expected.backward()
    parallel_state.destroy_model_parallel()
    return {"loss": float(loss), "expected": float(expected), "tied": policy.head_weight() is policy.embed.weight,
            "vocab": policy.vocab, "grad": policy.embed.weight.grad, "ref_grad": ref.embed.weight.grad}


def test_megatron_gpt_tied_padded_matches_reference_on_gloo():
    pytest.importorskip("megatron.core", reason="megatron-core is installed on GPU machines only")
    results = run_gloo(_megatron_gloo_case, 2, timeout_s=240)
    assert all(r["tied"] and r["vocab"] == 256 for r in results)
    for r in results:
        assert r["loss"] == pytest.approx(r["expected"], rel=1e-5)
    grads = torch.cat([r["grad"] for r in results])
    torch.testing.assert_close(grads[:127], results[0]["ref_grad"], rtol=1e-4, atol=1e-6)
    assert not grads[127:].any()
