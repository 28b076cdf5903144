"""``autoshard ppo MODEL`` on the user's own models (``runtime/ppo_program.py`` note "user models").

* ``test_ppo_launches_on_a_user_factory``: ``autoshard ppo tests/_user_models.py:nano_policy`` outside
  torchrun searches a plan, starts 2 gloo ranks and trains 2 PPO steps on the nanoGPT-style
  actor-critic (vocabulary 256, restricted to the task's 16 ids; no KV-cache API, so rollout
  recomputes prefixes and rank 0 says why).
* One 2-rank gloo job: ``hf_cli`` joins the job with a tiny Hugging Face Llama config directory and
  ``--weights`` (its safetensors), saving a checkpoint; ``hf_numerics`` checks the sharded programs
  (ZeRO-3) start from those files and return the HF model's logits over ids 0-15; ``rank_dependent``
  refuses a factory whose weights differ between ranks. Resume on ``nano_policy`` through the CLI:
  ``nano_full`` trains ``RESUME_STEPS`` steps, ``nano_half`` the first ``HALF`` of them into a
  checkpoint, ``nano_resume`` resumes it (``--resume``) up to ``RESUME_STEPS``: the resumed
  metrics file's steps equal the uninterrupted run's (``COMPARED``, the reference-model resume
  test's keys and tolerance, ``test_ppo_sharded.py``).
* In process: a vocabulary smaller than the task's is refused in one line (exit 2); ``--weights``
  with a factory too; ``--weights`` reaches the workers as an absolute path. ``--resume`` from the
  nano checkpoint with another model (a factory, an HF config), or with ``--steps`` it already
  reached, is refused in one line (exit 2) before any search or launch; an HF checkpoint resumed
  by an edited config of the same directory names the first parameter whose shape changed.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
from pathlib import Path

import pytest
import torch

from autoshard.cli import main as cli_main
from autoshard.runtime.metrics import read_metrics

transformers = pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
NANO = f"{HERE / '_user_models.py'}:nano_policy"
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
FINITE = ("reward/mean", "policy/loss", "value/loss", "kl/k1", "grad/norm")
COMPARED = ("reward/mean", "kl/k1", "policy/loss", "value/loss", "policy/entropy", "grad/norm")  # test_ppo_sharded's
RESUME_STEPS, HALF = 3, 2


def small_vocab_policy(device="cpu", dtype=torch.float32):
    """A factory whose vocabulary (8) is smaller than the tasks' 16 tokens."""
    from _user_models import NanoPolicy

    with torch.device(device):
        return NanoPolicy(vocab=8).to(dtype)


def rank_dependent_policy(device="cpu", dtype=torch.float32):
    """A factory that seeds from the rank, not from torch's global RNG: every rank builds other weights."""
    from _user_models import NanoPolicy

    model = NanoPolicy(layers=1)
    generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    with torch.no_grad():
        model.critic.weight.normal_(generator=generator)
    return model.to(device=device, dtype=dtype)


def _assert_trained(rows, steps):
    assert [row["step"] for row in rows] == [float(s) for s in range(1, steps + 1)]
    for row in rows:
        for key in FINITE:
            assert math.isfinite(row[key]), (key, row)


def _tokens():
    return torch.tensor([[3, 5, 7, 12, 9, 12], [2, 2, 4, 12, 6, 12]])  # "1,3,5," ‖ ... : task ids < 16


# --------------------------------------------------------------------------- torchrun (outside an existing job)


@pytest.mark.slow
def test_ppo_launches_on_a_user_factory(tmp_path, capfd):
    metrics = tmp_path / "nano.jsonl"
    code = cli_main(["ppo", NANO, "--cluster", "cpu:1x2", "--steps", "2", "--batch", "8", "--quiet",
                     "--metrics", str(metrics)])
    out = capfd.readouterr().out
    assert code == 0, out
    _assert_trained(read_metrics(metrics), 2)
    assert "rollout: no KV cache, recomputing each prefix through the program: NanoPolicy has no new_cache" in out
    assert (tmp_path / "nano.plan.json").is_file()


# --------------------------------------------------------------------------- one gloo job


def _cli_join(rank, world_size, argv):
    """``autoshard ppo ARGV`` joining this job (RANK and WORLD_SIZE set); (exit code, what it printed)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = cli_main(["ppo", *argv, "--cluster", "cpu:1x2", "--batch", "8", "--quiet"])
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    return code, printed.getvalue()


def _hf_cli(rank, world_size, directory, out):
    return _cli_join(rank, world_size, [directory, "--weights", directory, "--steps", "2", "--metrics",
                                        f"{out}/hf.jsonl", "--checkpoint", f"{out}/hf_ckpt"])


def _nano_cli(rank, world_size, out, steps, metrics, checkpoint=None, resume=False):
    saving = ["--checkpoint", f"{out}/{checkpoint}"] if checkpoint else []
    return _cli_join(rank, world_size, [NANO, "--steps", str(steps), "--metrics", f"{out}/{metrics}", *saving,
                                        *(["--resume"] if resume else [])])


def _hf_numerics(rank, world_size, directory):
    from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
    from autoshard.runtime.ppo_program import PPORun, capture_policy, load_policy, sharded_trainer

    del rank
    policy = load_policy(directory, 0, weights=directory)
    graph = capture_policy(policy.module, policy.name)
    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=world_size), precision="fp32",
                layers=tuple(LayerStrategy(layer=layer.name, state="zero3") for layer in graph.layers),
                schedule=Schedule(num_micro_batches=1))
    trainer = sharded_trainer(PPORun(model=directory, weights=directory, global_batch=4), plan, model=policy, graph=graph)
    with torch.no_grad():
        logits, values = trainer.policy.forward(_tokens())
        reference_logits, _ = trainer.reference.forward(_tokens())
    return {"logits": logits, "values": values, "reference": reference_logits, "rollout": trainer.policy.rollout}


def _rank_dependent(rank, world_size):
    from autoshard.errors import ModelError
    from autoshard.runtime.ppo_program import check_same_weights, load_policy

    os.environ["RANK"] = str(rank)
    try:
        policy = load_policy(f"{Path(__file__).resolve()}:rank_dependent_policy", 0)
        check_same_weights(policy.module, policy.name)
    except ModelError as err:
        return str(err)
    finally:
        del os.environ["RANK"]
    return None


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, vocab_size=64)).eval()
    model.save_pretrained(directory)
    with torch.no_grad():
        expected = model(_tokens()).logits[..., :16]
    return directory, expected


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory):
    from _harness import run_gloo_cases

    directory, _ = hf_dir
    out = tmp_path_factory.mktemp("hf_out")
    cases = {
        "rank_dependent": _rank_dependent,
        "hf_numerics": functools.partial(_hf_numerics, directory=str(directory)),
        "hf_cli": functools.partial(_hf_cli, directory=str(directory), out=str(out)),
        "nano_full": functools.partial(_nano_cli, out=str(out), steps=RESUME_STEPS, metrics="full.jsonl"),
        "nano_half": functools.partial(_nano_cli, out=str(out), steps=HALF, metrics="resumed.jsonl",
                                       checkpoint="nano_ckpt"),
        "nano_resume": functools.partial(_nano_cli, out=str(out), steps=RESUME_STEPS, metrics="resumed.jsonl",
                                         checkpoint="nano_ckpt", resume=True),
    }
    return {"out": out, **run_gloo_cases(cases, 2, timeout_s=300)}


@pytest.mark.slow
def test_hf_config_dir_with_weights_trains_through_the_cli(results):
    (code0, printed0), (code1, _) = results["hf_cli"]
    assert (code0, code1) == (0, 0)
    _assert_trained(read_metrics(results["out"] / "hf.jsonl"), 2)
    assert "recomputing each prefix through the program: HFLlamaPolicy has no new_cache" in printed0


@pytest.mark.slow
def test_hf_weights_fill_the_programs_and_logits_are_restricted_to_the_task_ids(results, hf_dir):
    _, expected = hf_dir
    for out in results["hf_numerics"]:
        assert out["logits"].shape == (2, 6, 16) and out["values"].shape == (2, 6)
        torch.testing.assert_close(out["logits"], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["reference"], expected, atol=1e-5, rtol=1e-5)
        assert out["rollout"] is None


@pytest.mark.slow
def test_a_resumed_user_model_continues_the_uninterrupted_run(results):
    for case in ("nano_full", "nano_half", "nano_resume"):
        assert [code for code, _ in results[case]] == [0, 0], (case, results[case][0][1])
    assert f"resumed from {results['out']}/nano_ckpt at step {HALF} (saved with dp=2)" in results["nano_resume"][0][1]
    full, resumed = read_metrics(results["out"] / "full.jsonl"), read_metrics(results["out"] / "resumed.jsonl")
    _assert_trained(full, RESUME_STEPS)
    _assert_trained(resumed, RESUME_STEPS)  # the first run's steps, then the resumed one's appended
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([r[key] for r in resumed], dtype=torch.float64),
                                   torch.tensor([r[key] for r in full], dtype=torch.float64),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.slow
def test_a_factory_with_rank_dependent_weights_is_refused(results):
    for message in results["rank_dependent"]:
        assert message is not None and "built different initial weights on different ranks" in message


# --------------------------------------------------------------------------- in process


def _one_line_error(capsys, argv):
    code = cli_main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("autoshard: error: "), err
    return err


def test_a_vocabulary_smaller_than_the_task_is_refused_in_one_line(capsys, tmp_path):
    transformers.LlamaConfig(**LLAMA, vocab_size=8).save_pretrained(tmp_path / "small")
    err = _one_line_error(capsys, ["ppo", str(tmp_path / "small"), "--cluster", "cpu:1x2"])
    assert "vocab_size=8 is smaller than the 16 tokens of task 'arithmetic'" in err and "small" in err
    err = _one_line_error(capsys, ["ppo", f"{Path(__file__).resolve()}:small_vocab_policy", "--cluster", "cpu:1x2"])
    assert "small_vocab_policy' vocab_size=8 is smaller than the 16 tokens" in err


def test_weights_are_refused_for_a_factory_and_reach_the_workers_absolute(capsys, tmp_path, monkeypatch):
    err = _one_line_error(capsys, ["ppo", NANO, "--weights", str(tmp_path), "--cluster", "cpu:1x2"])
    assert "only a Hugging Face config MODEL" in err

    from autoshard.cli_ppo import _worker_flags, add_ppo_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_ppo_arguments(parser)
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["cfg", "--weights", "w", "--cluster", "cpu:1x2"])
    flags = _worker_flags(args, "/abs/cfg", tmp_path / "plan.json")
    assert flags[flags.index("--weights") + 1] == str(tmp_path / "w")
    assert flags[flags.index("--model") + 1] == "/abs/cfg"


@pytest.mark.slow
def test_resuming_with_another_model_or_no_step_left_is_refused_in_one_line(capsys, results, hf_dir):
    checkpoint = str(results["out"] / "nano_ckpt")
    resume = ["--cluster", "cpu:1x2", "--checkpoint", checkpoint, "--resume", "--steps", str(RESUME_STEPS + 2)]
    llama = f"{HERE / '_user_models.py'}:llama_style_policy"
    err = _one_line_error(capsys, ["ppo", llama, *resume])
    assert f"checkpoint {checkpoint!r} was saved from model {NANO!r}, not {llama!r}" in err
    hf = str(hf_dir[0].resolve())
    err = _one_line_error(capsys, ["ppo", hf, *resume])
    assert f"was saved from model {NANO!r}, not {hf!r}; resume with the MODEL it was saved from" in err
    err = _one_line_error(capsys, ["ppo", NANO, *resume[:-1], str(RESUME_STEPS)])
    assert f"is at step {RESUME_STEPS}, and --steps {RESUME_STEPS} counts the steps of the whole run" in err


@pytest.mark.slow
def test_an_edited_model_of_the_same_name_names_the_changed_parameter(results, hf_dir):
    from autoshard.models.hf import actor_critic, load_hf_config
    from autoshard.runtime._checkpoint_files import CheckpointError
    from autoshard.runtime.ppo_checkpoint import check_resumable
    from autoshard.runtime.ppo_program import capture_policy

    name = str(hf_dir[0].resolve())
    config = load_hf_config(name)
    config.intermediate_size = 96  # the directory's config.json edited since the checkpoint
    graph = capture_policy(actor_critic(config, device="meta", dtype=torch.float32), name)
    with pytest.raises(CheckpointError, match=rf"saved from another version of model '{re.escape(name)}': parameter "
                                              r"'model\.layers\.0\.mlp\.gate_proj\.weight' is \[64, 32\] in the "
                                              r"checkpoint and \[96, 32\] now"):
        check_resumable(results["out"] / "hf_ckpt", graph)
