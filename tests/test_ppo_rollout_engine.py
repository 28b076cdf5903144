"""KV-cached rollout through a weight-synced replica (``runtime/rollout_engine.py``) on 2 real gloo ranks.

One spawned job runs every case (``_harness`` note "spawned jobs are expensive"):

* ``zero3`` (``Mesh(dp_shard=2)``, every layer ZeRO-3, so ``value_head.weight``
  [1, h] is split 1 + 0 rows: the uneven chunk rule) and ``tp``
  (``Mesh(tp=2)``, Megatron attention/MLP/embedding/head): a trainer with the
  cache engine and one without (``rollout_cache=False``, the recompute path)
  from the same seed. Checked: the first sync reproduces the initial weights (the tp plan's replica holds halves: gathered over its group)
  bitwise; the rollouts of both paths have the same tokens and log-probs
  before training and again after ``STEPS`` PPO steps (a stale replica would
  sample other tokens); the training curves agree at rtol 1e-5; the metrics
  carry ``time/weight_sync``; the replica synced once per step.
* ``timing``: one PPO step with and without the cache at long responses (a
  128-position model, up to ``LONG_TOKENS`` new tokens) under the TP plan; the
  numbers are printed, not asserted (two shared cores). Not under ZeRO-3: the
  recompute path runs collectives in every decode step and ``generate`` stops
  when this rank's sequences are done, so dp ranks whose responses end at
  different steps would wait on each other forever (the cached path decodes
  locally and has no such hazard).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch

from _harness import run_gloo_cases
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.runtime.ppo_program import PPORun, build_policy_model, capture_policy, reseed, sharded_trainer, train_loop
from autoshard.kernels import collectives
from autoshard.runtime.rollout import SamplingConfig

STEPS = 3
LONG_TOKENS = 96
COMPARED = ("reward/mean", "kl/k1", "policy/loss", "value/loss", "policy/entropy", "grad/norm", "response/length")


def _plan(graph, mesh: Mesh, choose) -> Plan:
    layers = tuple(LayerStrategy(layer=l.name, **choose(l.name)) for l in graph.layers)
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=1), precision="fp32")


def _zero3(_name: str) -> dict:
    return {"state": "zero3"}


def _tp(name: str) -> dict:
    return {"tp": "megatron" if name.endswith(("attn", "mlp", "embed", "head")) and name != "value_head" else "none"}


def _sample(trainer, seed_step: int):
    reseed(trainer, seed_step)
    rollout = trainer.rollout()
    return {"tokens": rollout.tokens.cpu(), "logp": rollout.sample_logprobs.cpu(), "mask": rollout.response_mask.cpu()}


def _compare(rank, world_size, plan, graph):
    torch.set_num_threads(1)
    run = PPORun(steps=STEPS, global_batch=16)
    cached = sharded_trainer(run, plan, graph=graph)
    recompute = sharded_trainer(dataclasses.replace(run, rollout_cache=False), plan, graph=graph)
    assert cached.policy.rollout is not None and recompute.policy.rollout is None
    assert cached.reference.rollout is None
    cached.policy.sync_rollout_weights()
    initial = dict(build_policy_model(run.model, run.seed).named_parameters())
    engine = cached.policy.rollout  # the plan's tp by default: a tp=2 plan's replica holds halves
    replica = {name: p if engine.dims[name] is None else collectives.all_gather(p.contiguous(), engine.dims[name], engine.group)
               for name, p in engine.replica.named_parameters()}
    synced_exactly = sorted(replica) == sorted(initial) and all(torch.equal(replica[k], initial[k]) for k in initial)
    before = {"cached": _sample(cached, 0), "recompute": _sample(recompute, 0)}
    curves = {"cached": train_loop(cached, STEPS), "recompute": train_loop(recompute, STEPS)}
    after = {"cached": _sample(cached, 99), "recompute": _sample(recompute, 99)}
    return {"synced_exactly": synced_exactly, "before": before, "after": after, "curves": curves,
            "syncs": cached.policy.rollout.syncs}


def _timing(rank, world_size, plan_for):
    torch.set_num_threads(1)
    from autoshard.models import build
    from autoshard.runtime.tasks import VOCAB

    model = build("llama:tiny", seed=0, vocab_size=len(VOCAB), max_seq_len=128)
    graph = capture_policy(model, "llama:tiny")
    plan = plan_for(graph)
    out = {}
    for name, cache in (("cached", True), ("recompute", False)):
        run = PPORun(steps=1, global_batch=16, rollout_cache=cache)
        trainer = sharded_trainer(run, plan, model=model, graph=graph)
        trainer.config = dataclasses.replace(trainer.config, sampling=SamplingConfig(max_new_tokens=LONG_TOKENS))
        start = time.perf_counter()
        metrics = train_loop(trainer, 1)[0]
        out[name] = {"step_s": time.perf_counter() - start, **metrics}
    return out


def _tp_plan(graph):
    return _plan(graph, Mesh(tp=2), _tp)


def _zero3_plan(graph):
    return _plan(graph, Mesh(dp_shard=2), _zero3)


@pytest.fixture(scope="module")
def results():
    graph = capture_policy(build_policy_model("llama:tiny", 0), "llama:tiny")
    cases = {
        "zero3": functools.partial(_compare, plan=_zero3_plan(graph), graph=graph),
        "tp": functools.partial(_compare, plan=_tp_plan(graph), graph=graph),
        "timing": functools.partial(_timing, plan_for=_tp_plan),
    }
    return run_gloo_cases(cases, 2, timeout_s=300)


@pytest.mark.parametrize("plan", ["zero3", "tp"])
@pytest.mark.slow
def test_first_sync_reproduces_the_initial_weights(results, plan):
    assert all(rank["synced_exactly"] for rank in results[plan])


@pytest.mark.parametrize("plan", ["zero3", "tp"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.slow
def test_cached_rollout_matches_recompute(results, plan, when):
    for rank in results[plan]:
        cached, recompute = rank[when]["cached"], rank[when]["recompute"]
        assert torch.equal(cached["tokens"], recompute["tokens"]), (plan, when)
        assert torch.equal(cached["mask"], recompute["mask"])
        assert cached["mask"].sum(1).float().mean() > 1  # several decode steps, not one token
        torch.testing.assert_close(cached["logp"], recompute["logp"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plan", ["zero3", "tp"])
@pytest.mark.slow
def test_training_curve_matches_recompute(results, plan):
    for rank in results[plan]:
        cached, recompute = rank["curves"]["cached"], rank["curves"]["recompute"]
        assert len(cached) == len(recompute) == STEPS
        for key in COMPARED:
            torch.testing.assert_close(
                torch.tensor([m[key] for m in cached], dtype=torch.float64),
                torch.tensor([m[key] for m in recompute], dtype=torch.float64),
                rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{plan} {key}: {m}",
            )


@pytest.mark.parametrize("plan", ["zero3", "tp"])
@pytest.mark.slow
def test_weight_sync_is_a_metric_phase_once_per_step(results, plan):
    for rank in results[plan]:
        assert all("time/weight_sync" in m and m["time/weight_sync"] >= 0 for m in rank["curves"]["cached"])
        assert all("time/weight_sync" not in m for m in rank["curves"]["recompute"])
        assert rank["syncs"] == STEPS + 1  # initial weights, then once after each step's updates


@pytest.mark.slow
def test_tp_ranks_sample_the_same_tokens(results):
    first, second = results["tp"]
    for when in ("before", "after"):
        assert torch.equal(first[when]["cached"]["tokens"], second[when]["cached"]["tokens"])


@pytest.mark.slow
def test_timing_at_long_responses(results):
    rank0 = results["timing"][0]
    for name in ("cached", "recompute"):
        m = rank0[name]
        assert m["response/length"] > 0 and m["time/generate"] > 0
        print(f"{name}: step {m['step_s']:.2f} s, generate {m['time/generate']:.2f} s, "
              f"weight_sync {m.get('time/weight_sync', 0.0):.3f} s, response length {m['response/length']:.1f}")


def test_no_rollout_cache_flag_reaches_the_worker():
    import argparse
    from pathlib import Path

    from autoshard import cli_ppo
    from autoshard.runtime.ppo_program import run_from_args, worker_arguments

    cli = argparse.ArgumentParser()
    cli_ppo.add_ppo_arguments(cli)
    worker = argparse.ArgumentParser()
    worker_arguments(worker)
    for extra, cache in (([], True), (["--no-rollout-cache"], False)):
        args = cli.parse_args(["llama:tiny", "--cluster", "cpu:1x2", *extra])
        flags = cli_ppo._worker_flags(args, "llama:tiny", Path("plan.json"))
        assert ("--no-rollout-cache" in flags) is not cache
        assert run_from_args(worker.parse_args(flags)).rollout_cache is cache
    for extra, mode in (([], "auto"), (["--compile", "off"], "off"), (["--compile", "on"], "on")):
        args = cli.parse_args(["llama:tiny", "--cluster", "cpu:1x2", *extra])
        assert run_from_args(worker.parse_args(cli_ppo._worker_flags(args, "llama:tiny", Path("plan.json")))).compile == mode
