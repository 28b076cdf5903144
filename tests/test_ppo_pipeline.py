"""PPO and GRPO on pipeline-parallel programs (pp > 1, ``runtime/ppo_program.py`` note "PPO on pipeline stages").

The tiny Llama of the reference run (``ppo_demo``), fp32, the same seed; every case
must reproduce its pp = 1 counterpart step for step (``COMPARED`` metrics: reward, KL,
losses, entropy, gradient norm) at rtol 1e-5:

* one 2-rank gloo job: ``Mesh(pp=2)`` under 1F1B (4 micro-batches per mini-batch) and
  under interleaved 1F1B (2 virtual stages per rank), against single-process PPO
  (``ModuleEngine``, same 64 prompts); ``Mesh(pp=2)`` GPipe with GRPO (k3 KL in the loss,
  4 responses per prompt), against single-process GRPO with the same ``PPOConfig``. Both
  pp ranks must report bitwise-equal metrics (the last stage's statistics reach both).
  The 1F1B case runs a second time compiled (``PPORun(compile="on")``, backend ``aot_eager``): the
  stages on padded fixed shapes (``ppo_program`` note "compiled PPO") reproduce it too.
* one 4-rank gloo job: ``Mesh(pp=2, dp_shard=2)`` with ZeRO-3 attention and ZeRO-2 MLPs
  under 1F1B, against data-parallel ``ModuleEngine`` PPO over two ranks (full replicas,
  gradients summed), run on ranks {0, 1} and {2, 3} of the same job.

In process: how many pipeline micro-batches a mini-batch is cut into.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from _harness import run_gloo_cases
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime.ppo_engine import EngineError
from autoshard.runtime.ppo_program import PPORun, build_policy_model, capture_policy, sharded_trainer, train_loop
from autoshard.runtime.rl_options import RLOptions

STEPS = 3
COMPARED = ("reward/mean", "kl/k1", "kl/k3", "policy/loss", "value/loss", "policy/entropy", "policy/clip_frac",
            "grad/norm")
GRPO = RLOptions(algo="grpo")  # 4 responses per prompt, k3 KL in the loss


def _stage_of(name: str, num_stages: int) -> int:
    """Embedding and block 0 first, block 1 and the heads last; with 4 stages one piece of the model each."""
    order = ("embed", "blocks.0.", "blocks.1.", "norm")
    rank = next((i for i, prefix in enumerate(order) if name.startswith(prefix)), len(order) - 1)
    return rank * num_stages // len(order)


def _plan(graph, mesh: Mesh, schedule: str, *, micro_batches: int = 4, virtual: int = 1, choose=None) -> Plan:
    num_stages = mesh.pp * virtual
    layers = tuple(LayerStrategy(layer=l.name, stage=_stage_of(l.name, num_stages), **(choose or _ddp)(l.name))
                   for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, precision="fp32",
                schedule=Schedule(name=schedule, num_micro_batches=micro_batches, virtual_stages=virtual))


def _ddp(_name: str) -> dict:
    return {"state": "replicate"}


def _mixed(name: str) -> dict:
    return {"state": "zero3" if name.endswith("attn") else "zero2" if name.endswith("mlp") else "replicate"}


def _train(rank, world_size, plan, graph, rl=RLOptions(), compile="auto"):
    torch.set_num_threads(1)
    trainer = sharded_trainer(PPORun(steps=STEPS, rl=rl, compile=compile, compile_backend="aot_eager"), plan, graph=graph)
    assert trainer.policy.pipelined
    return {"metrics": train_loop(trainer, STEPS), "config": trainer.config,
            "compiled": trainer.policy.program.compile_options is not None and trainer.policy.fixed_shapes}


def _refused(rank, world_size, plan, graph):
    """A forward with autograd through a pipeline engine is refused (its backward lives in the schedule)."""
    torch.set_num_threads(1)
    trainer = sharded_trainer(PPORun(steps=1), plan, graph=graph)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with torch.no_grad():
        logits, values = trainer.policy.forward(tokens)
    try:
        trainer.policy.forward(tokens)
    except EngineError as err:
        return {"message": str(err), "shapes": (tuple(logits.shape), tuple(values.shape))}
    return {"message": None}


def _module_ddp_pairs(rank, world_size):
    """Data-parallel ``ModuleEngine`` PPO over 2 ranks, on ranks {0, 1} and {2, 3} alike."""
    import torch.distributed as dist

    from autoshard.runtime.ppo_demo import demo_trainer
    from autoshard.runtime.ppo_engine import DistReducer

    torch.set_num_threads(1)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    trainer = demo_trainer(seed=0, dp=DistReducer(groups[rank // 2]))
    trainer.config = dataclasses.replace(trainer.config, rollout_batch=32)  # 64 prompts over 2 dp ranks
    return train_loop(trainer, STEPS)


@pytest.fixture(scope="module")
def graph():
    return capture_policy(build_policy_model("llama:tiny", 0), "llama:tiny")


@pytest.fixture(scope="module")
def results2(graph):
    pp2 = Mesh(pp=2)
    cases = {
        "refused": functools.partial(_refused, plan=_plan(graph, pp2, "gpipe"), graph=graph),
        "1f1b": functools.partial(_train, plan=_plan(graph, pp2, "1f1b"), graph=graph),
        # compiled stages on padded shapes (ppo_program note "compiled PPO"; aot_eager: the same joint graphs)
        "1f1b_compiled": functools.partial(_train, plan=_plan(graph, pp2, "1f1b"), graph=graph, compile="on"),
        "interleaved": functools.partial(_train, plan=_plan(graph, pp2, "interleaved_1f1b", virtual=2), graph=graph),
        "grpo": functools.partial(_train, plan=_plan(graph, pp2, "gpipe", micro_batches=2), graph=graph, rl=GRPO),
    }
    return run_gloo_cases(cases, 2, timeout_s=600)


@pytest.fixture(scope="module")
def results4(graph):
    plan = _plan(graph, Mesh(pp=2, dp_shard=2), "1f1b", choose=_mixed)
    cases = {
        "module_ddp": _module_ddp_pairs,
        "pp2_dp2": functools.partial(_train, plan=plan, graph=graph),
    }
    return run_gloo_cases(cases, 4, timeout_s=600)


def _single(config=None):
    """Single-process PPO (``ModuleEngine``) of the reference run, with ``config`` when given."""
    from autoshard.runtime.ppo_demo import demo_trainer

    torch.set_num_threads(1)
    trainer = demo_trainer(seed=0)
    if config is not None:
        trainer.config = config
    return train_loop(trainer, STEPS)


def _series(history, key):
    return torch.tensor([m[key] for m in history], dtype=torch.float64)


def _assert_same_run(got, want, what):
    assert len(got) == len(want) == STEPS
    for key in COMPARED:
        torch.testing.assert_close(_series(got, key), _series(want, key), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, key=key: f"{what} {key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "1f1b_compiled"])
def test_pp2_ppo_matches_single_process(results2, name):
    assert results2[name][0]["compiled"] == name.endswith("compiled")
    _assert_same_run(results2[name][0]["metrics"], _single(), name)


@pytest.mark.slow
def test_pp2_grpo_matches_single_process(results2):
    run = results2["grpo"][0]
    assert run["config"].algo == "grpo" and run["config"].kl_mode == "loss"
    _assert_same_run(run["metrics"], _single(run["config"]), "grpo")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "grpo"])
def test_pp_ranks_report_the_same_metrics(results2, name):
    first, second = (r["metrics"] for r in results2[name])
    for key in COMPARED:
        assert _series(first, key).tolist() == _series(second, key).tolist(), key


@pytest.mark.slow
def test_forward_with_autograd_is_refused_on_pipeline_engines(results2):
    for result in results2["refused"]:
        assert result["message"] is not None and "accumulate" in result["message"]
        assert result["shapes"] == ((2, 5, 16), (2, 5))  # under no_grad both ranks get the outputs


@pytest.mark.slow
def test_pp2_dp2_matches_data_parallel_ppo(results4):
    reference = results4["module_ddp"]
    for key in COMPARED:  # both pairs ran the same data-parallel run
        assert _series(reference[0], key).tolist() == _series(reference[2], key).tolist(), key
    for rank, result in enumerate(results4["pp2_dp2"]):
        _assert_same_run(result["metrics"], reference[0], f"rank {rank}")


# --------------------------------------------------------------------------- in process


def _engine_of(num_micro_batches: int, pp: int, schedule: str = "1f1b", virtual: int = 1):
    """A ``ProgramEngine`` over a stand-in program: only what ``_micro_batches`` reads (the plan's schedule, mesh)."""
    from types import SimpleNamespace

    from autoshard.runtime.ppo_program import ProgramEngine

    plan = SimpleNamespace(schedule=Schedule(name=schedule, num_micro_batches=num_micro_batches,
                                             virtual_stages=virtual), mesh=Mesh(pp=pp))
    engine = ProgramEngine.__new__(ProgramEngine)
    engine.program = SimpleNamespace(plan=plan)
    return engine


@pytest.mark.parametrize("rows, planned, pp, schedule, micro_batch, want", [
    (32, 4, 2, "1f1b", None, 4),   # the plan's count when it splits the rows
    (16, 6, 2, "1f1b", None, 8),   # else the nearest divisor (8 and 4 are as near: the larger, a smaller bubble)
    (18, 5, 2, "1f1b", None, 6),   # 6 is the nearest divisor of 18 to 5
    (6, 1, 4, "1f1b", None, 6),    # 1F1B needs m >= pp where a divisor reaches it
    (3, 4, 4, "1f1b", None, 3),    # none does: the nearest of all divisors
    (6, 1, 4, "gpipe", None, 1),   # GPipe takes any count
    (32, 2, 2, "interleaved_1f1b", None, 2),  # v=4 virtual stages: still the plan's 2 (m % pp == 0), not 8
    (12, 3, 2, "interleaved_1f1b", None, 4),  # 3 is odd: 2 and 4 are as near (multiples of pp dividing 12): 4
    (32, 4, 2, "1f1b", 8, 4),      # PPOConfig.micro_batch rows each
])
def test_pipeline_micro_batch_count(rows, planned, pp, schedule, micro_batch, want):
    virtual = 4 if schedule == "interleaved_1f1b" else 1
    assert _engine_of(planned, pp, schedule, virtual)._micro_batches(rows, micro_batch) == want


@pytest.mark.parametrize("schedule, pp, admitted", [
    ("1f1b", 4, [4, 5, 8]), ("gpipe", 4, [1, 2, 3, 4, 5, 8]), ("interleaved_1f1b", 4, [4, 8]),
    ("1f1b", 1, [1, 2, 3, 4, 5, 8]),
])
def test_schedule_admits(schedule, pp, admitted):
    assert [m for m in (1, 2, 3, 4, 5, 8) if Schedule(name=schedule).admits(m, pp)] == admitted


def test_pipeline_micro_batch_must_divide_the_rows():
    with pytest.raises(EngineError, match="micro_batch=5 does not divide the 32 rows"):
        _engine_of(4, 2)._micro_batches(32, 5)
