"""Your own training loop (examples/train.py): typed optimizer config, schedule, exact resume.

Two spawned 2-rank gloo jobs run the example's ``main`` (fresh processes each):

1. per plan (DDP, ZeRO-2, ZeRO-3, offload): 6 uninterrupted steps, and the same run stopped
   after step 3 with a checkpoint at step 3;
2. fresh processes resume each stopped run for steps 4-6 under the same plan, and the DDP
   checkpoint under ZeRO-3 (another layout of masters and moments);
3. one fresh rank resumes the ZeRO-2 checkpoint (another world size).

Same plan: the resumed records (loss, grad norm, learning rate) equal the uninterrupted ones
bit for bit (fp32 on the CPU; masters, AdamW moments and step, schedule position and data
position are all restored exactly). Another plan or world size: equal to rtol 1e-5 (reductions
differ in order). The DDP run also equals single-device ``torch.optim.AdamW`` + ``LambdaLR`` +
``clip_grad_norm_`` with weight decay on ≥2-D parameters only. The rest runs in this process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from _harness import run_gloo_cases
from autoshard import SGD, AdamW, AutoshardError, LRSchedule, TrainSpec
from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime.optimizer import OptimizerConfig

REPO = Path(__file__).resolve().parents[1]


def _load_example():
    """examples/train.py as module ``examples_train`` (also in the gloo children, which import this file)."""
    if "examples_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("examples_train", REPO / "examples" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["examples_train"] = module
        spec.loader.exec_module(module)
    return sys.modules["examples_train"]


example = _load_example()

STEPS, HALF = 6, 3
STATES = ("replicate", "zero2", "zero3", "offload")
COMMON = ["--steps", str(STEPS), "--warmup", "2", "--samples", "32", "--global-batch", "8", "--seq-len", "16",
          "--ckpt-every", str(HALF), "--log-every", "100", "--precision", "fp32"]


# --------------------------------------------------------------------------- gloo jobs


def _run(argv: list[str], rank: int, world_size: int) -> dict:
    return example.main(COMMON + argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_loop")
    first = {}
    for state in STATES:
        first[f"full_{state}"] = functools.partial(_run, ["--state", state, "--ckpt-dir", str(root / f"full_{state}")])
        first[f"half_{state}"] = functools.partial(
            _run, ["--state", state, "--ckpt-dir", str(root / f"half_{state}"), "--stop-after", str(HALF)])
    one = run_gloo_cases(first, world_size=2, timeout_s=240)
    shutil.copytree(root / "half_replicate" / f"step_{HALF:06d}", root / "cross" / f"step_{HALF:06d}")
    second = {f"resume_{state}": functools.partial(
        _run, ["--state", state, "--ckpt-dir", str(root / f"half_{state}"), "--resume"]) for state in STATES}
    second["cross"] = functools.partial(_run, ["--state", "zero3", "--ckpt-dir", str(root / "cross"), "--resume"])
    two = run_gloo_cases(second, world_size=2, timeout_s=240)
    shutil.copytree(root / "half_zero2" / f"step_{HALF:06d}", root / "resize" / f"step_{HALF:06d}")
    three = run_gloo_cases({"resize": functools.partial(_run, ["--ckpt-dir", str(root / "resize"), "--resume"])},
                           world_size=1, timeout_s=240)
    return {"root": root, **{k: v[0] for k, v in {**one, **two, **three}.items()}}  # rank 0's (every rank agrees)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.slow
def test_resume_equals_uninterrupted_bit_for_bit(runs, state):
    full, half, resumed = runs[f"full_{state}"], runs[f"half_{state}"], runs[f"resume_{state}"]
    assert runs[f"full_{state}"]["plan_states"] == [state]
    assert [r["step"] for r in full["history"]] == list(range(1, STEPS + 1))
    assert half["history"] == full["history"][:HALF]
    assert resumed["start"] == HALF
    assert resumed["history"] == full["history"][HALF:]  # loss, grad_norm and lr: exact floats


@pytest.mark.parametrize("case, saved", [("cross", "full_replicate"), ("resize", "full_zero2")])
@pytest.mark.slow
def test_resume_under_another_plan_or_world_size(runs, case, saved):
    """cross: a DDP checkpoint (moments whole on every rank) resumed under ZeRO-3 (moments row-sharded);
    resize: a 2-rank ZeRO-2 checkpoint (flat moment chunks) resumed on 1 rank."""
    resumed, full = runs[case], runs[saved]
    assert resumed["start"] == HALF
    for name in ("loss", "grad_norm", "lr"):
        got = torch.tensor([r[name] for r in resumed["history"]], dtype=torch.float64)
        want = torch.tensor([r[name] for r in full["history"][HALF:]], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_checkpoint_holds_moments_step_and_data_position(runs):
    path = runs["root"] / "half_zero2" / f"step_{HALF:06d}"
    info = ckpt.read_info(path)
    assert info.step == HALF and info.extras["optimizer_steps"] == HALF
    assert info.extras["sampler"] == {"epoch": 0, "batch": HALF}
    assert info.tensors["optim.lm_head.weight.exp_avg"].shape == info.tensors["model.lm_head.weight"].shape
    assert {"optim.blocks.0.ln1.weight.exp_avg_sq", "rng.cpu.0", "rng.cpu.1"} <= set(info.tensors)


def _reference_history() -> list[dict]:
    """Single-device torch: AdamW (decay on ≥2-D params), LambdaLR warm-up + cosine, clip_grad_norm_."""
    args = example.parse_args(COMMON)
    with torch.device("meta"):
        model = example.TinyLM(example.TinyConfig(max_seq_len=max(64, args.seq_len)))
    torch.manual_seed(args.seed)  # = Initialize(seed)'s module-init fallback (runtime/materialize.py)
    model.to_empty(device="cpu")
    model.apply(lambda m: m.reset_parameters() if callable(getattr(m, "reset_parameters", None)) else None)
    spec = example.train_spec(args)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    adamw = spec.optimizer_config
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": adamw.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=adamw.lr, betas=adamw.betas,
                            eps=adamw.eps, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, spec.lr_schedule.factor)
    corpus = example.synthetic_corpus(args.samples, args.seq_len, example.TinyConfig.vocab_size, args.seed)
    sampler = example.ShardedSampler(len(corpus), args.global_batch, 0, 1, args.seed)
    history = []
    for step in range(1, STEPS + 1):
        tokens = corpus[sampler.next_rows()]
        loss = example.loss_fn(model(tokens), tokens)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        schedule.step()
        history.append({"step": step, "loss": float(loss), "grad_norm": float(norm), "lr": lr})
    return history


@pytest.mark.slow
def test_ddp_run_equals_torch_adamw_with_schedule(runs):
    reference = _reference_history()
    for state in ("replicate", "zero3"):
        for name in ("loss", "grad_norm", "lr"):
            got = torch.tensor([r[name] for r in runs[f"full_{state}"]["history"]], dtype=torch.float64)
            want = torch.tensor([r[name] for r in reference], dtype=torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{state} {name}")


# --------------------------------------------------------------------------- one process: config


def test_optimizer_strings_keep_working_and_typed_configs_normalise():
    plain = TrainSpec(global_batch=8, seq_len=16)
    assert plain.optimizer == "adamw" and plain.optimizer_config == AdamW() and plain.optimizer_state_bytes_per_param == 12
    sgd = TrainSpec(global_batch=8, seq_len=16, optimizer="sgd")
    assert sgd.optimizer_config == SGD() and sgd.optimizer_state_bytes_per_param == 4
    typed = TrainSpec(global_batch=8, seq_len=16, optimizer=AdamW(lr=3e-4, betas=[0.9, 0.95], weight_decay=0.1))
    assert typed.optimizer == "adamw" and typed.optimizer_config.betas == (0.9, 0.95)
    assert dataclasses.replace(typed, seq_len=32).optimizer_config == typed.optimizer_config
    assert TrainSpec(global_batch=8, seq_len=16, optimizer=AdamW()) == plain


@pytest.mark.parametrize("kwargs, words", [
    ({"optimizer": "adam"}, ["'adam'", "('adamw', 'sgd')", "AdamW(...)"]),
    ({"optimizer": "sgd", "optimizer_config": AdamW()}, ["optimizer='sgd'", "SGD(...)"]),
    ({"optimizer": AdamW(), "optimizer_config": AdamW(lr=1.0)}, ["disagree"]),
    ({"grad_clip": 0.0}, ["grad_clip=0.0", "> 0"]),
    ({"lr_schedule": "cosine"}, ["lr_schedule='cosine'", "LRSchedule("]),
])
def test_train_spec_refusals_name_value_and_fix(kwargs, words):
    with pytest.raises(AutoshardError) as err:
        TrainSpec(global_batch=8, seq_len=16, **kwargs)
    assert all(word in str(err.value) for word in words), str(err.value)


@pytest.mark.parametrize("make, words", [
    (lambda: AdamW(lr=0), ["AdamW.lr=0", "> 0"]),
    (lambda: AdamW(betas=(0.9, 1.0)), ["AdamW.betas", "[0, 1)"]),
    (lambda: AdamW(weight_decay=-0.1), ["AdamW.weight_decay=-0.1", ">= 0"]),
    (lambda: SGD(lr=float("nan")), ["SGD.lr=nan"]),
    (lambda: LRSchedule(decay="step"), ["decay='step'", "('constant', 'linear', 'cosine')"]),
    (lambda: LRSchedule(decay="cosine", warmup_steps=10, total_steps=10), ["total_steps=10", "warmup_steps=10"]),
    (lambda: LRSchedule(warmup_steps=-1), ["warmup_steps=-1"]),
    (lambda: LRSchedule(min_lr_ratio=2.0), ["min_lr_ratio=2.0", "[0, 1]"]),
])
def test_optimizer_and_schedule_refusals(make, words):
    with pytest.raises(AutoshardError) as err:
        make()
    assert all(word in str(err.value) for word in words), str(err.value)


def test_schedule_shapes():
    cosine = LRSchedule(warmup_steps=4, decay="cosine", total_steps=14, min_lr_ratio=0.1)
    assert [cosine.factor(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.factor(9) == pytest.approx(0.55) and cosine.factor(14) == cosine.factor(99) == pytest.approx(0.1)
    linear = LRSchedule(decay="linear", total_steps=10)
    assert [linear.factor(k) for k in (0, 5, 10, 20)] == [1.0, 0.5, 0.0, 0.0]
    assert LRSchedule(warmup_steps=2).factor(1) == 1.0 and LRSchedule().factor(10**6) == 1.0


def test_runtime_config_from_train_and_decay_groups():
    train = TrainSpec(global_batch=8, seq_len=16, optimizer=AdamW(lr=2e-3, weight_decay=0.1, eps=1e-6),
                      lr_schedule=LRSchedule(warmup_steps=2), grad_clip=None)
    cfg = OptimizerConfig.from_train(train)
    assert (cfg.name, cfg.lr, cfg.eps, cfg.weight_decay, cfg.max_grad_norm) == ("adamw", 2e-3, 1e-6, 0.1, None)
    assert cfg.lr_at(0) == pytest.approx(1e-3) and cfg.lr_at(5) == 2e-3 and cfg.state_names == ("exp_avg", "exp_avg_sq")
    assert cfg.decays((8, 4)) and not cfg.decays((8,))
    assert OptimizerConfig.from_train(dataclasses.replace(
        train, optimizer=AdamW(weight_decay=0.1, decay_norms_and_biases=True), optimizer_config=None)).decays((8,))
    sgd = OptimizerConfig.from_train(TrainSpec(global_batch=8, seq_len=16, optimizer=SGD(lr=0.5)))
    assert sgd.name == "sgd" and sgd.state_names == () and sgd.max_grad_norm == 1.0


# --------------------------------------------------------------------------- one process: data


def test_sampler_splits_global_batches_and_resumes():
    def rows(dp_size, steps, state=None):
        samplers = [example.ShardedSampler(20, 8, r, dp_size, seed=3) for r in range(dp_size)]
        for s in samplers:
            if state:
                s.load_state_dict(state)
        return [torch.cat([s.next_rows() for s in samplers]).tolist() for _ in range(steps)], samplers[0].state_dict()

    one, _ = rows(1, 5)
    two, _ = rows(2, 5)
    assert one == two  # the ranks' slices make the global batch, whatever the dp size
    assert all(len(set(batch)) == 8 for batch in one) and one[0] != one[2]  # 2 batches per epoch, new order per epoch
    first, state = rows(2, 3)
    rest, _ = rows(2, 2, state)
    assert state == {"epoch": 1, "batch": 1} and first + rest == one


def test_checkpoint_names_exclude_saves_in_flight(tmp_path):
    for name in ("step_000003", "step_000010", "step_000012.tmp-abc", "notes"):
        (tmp_path / name).mkdir()
    assert example.newest_checkpoint(tmp_path).name == "step_000010"
    assert example.newest_checkpoint(tmp_path / "absent") is None

