"""Rollout on a layout of its own (``runtime/rollout_engine.py``, ``runtime/rollout_tp.py``) on 4 real gloo ranks.

One spawned job runs every case. For each training plan and each rollout tp:

* the reshard delivers each rank exactly its rollout slice of the program's
  weights (the slices, gathered over the rollout group, equal the program's
  weights bitwise) and no rank holds more than 1/tp of a split parameter;
* the sharded replica's logits equal the whole model's at rtol 1e-5;
* KV-cached sampling on the layout returns this rank's own prompts, and the
  log-probs it recorded equal the whole model's log-probs of the drawn tokens
  (the union batch, the group's generator and the local-head KV cache are
  right, not merely self-consistent);
* with pp = 2 the stage owning a parameter broadcasts each rank's slice over pp;
* a PPO run whose rollout layout differs from the training plan
  (ZeRO-3 over 4 ranks, rollout tp = 2) trains with a rollout-vs-training
  log-prob gap of numerics only.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _harness import run_gloo_cases
from autoshard.plan import LayerStrategy, Mesh, Plan, Schedule
from autoshard.kernels import collectives
from autoshard.runtime.ppo_program import PPORun, capture_policy, sharded_trainer, train_loop
from autoshard.runtime.rollout import SamplingConfig

WORLD = 4
VOCAB = 16


def _model(spec: str):
    from autoshard.models import build

    overrides = {"num_kv_heads": 4} if spec.startswith("llama") else {}
    return build(spec, seed=0, vocab_size=VOCAB, max_seq_len=32, **overrides)


def _plan(graph, mesh: Mesh, state: str, tp_layers: bool) -> Plan:
    def tp(name: str) -> str:
        return "megatron" if tp_layers and name.endswith(("attn", "mlp", "embed", "head")) and name != "value_head" else "none"

    n = len(graph.layers)  # pp > 1: the first half of the layers on stage 0, the rest on stage 1
    layers = tuple(LayerStrategy(layer=l.name, state=state, tp=tp(l.name), stage=int(i >= n // 2) if mesh.pp > 1 else 0)
                   for i, l in enumerate(graph.layers))
    return Plan(model_name=graph.model_name, mesh=mesh, layers=layers, schedule=Schedule(num_micro_batches=1),
                precision="fp32")


class _Sampler:
    """What ``generate`` decodes through: the engine's replica with its KV cache."""

    max_seq_len = 32

    def __init__(self, engine) -> None:
        self.engine = engine

    def forward(self, tokens, *, cache=None, start_pos=0):
        return self.engine.forward(tokens, cache, start_pos)

    def new_cache(self, batch, max_len):
        return self.engine.new_cache(batch, max_len)


def _layouts(rank, world_size, spec, mesh, state, tp_layers, rollouts):
    from autoshard.runtime.rollout_engine import RolloutEngine, unshard

    torch.set_num_threads(1)
    model = _model(spec)
    graph = capture_policy(model, spec)
    trainer = sharded_trainer(PPORun(steps=1, global_batch=16), _plan(graph, mesh, state, tp_layers), model=model,
                              graph=graph)
    program = trainer.policy.program
    whole = _model(spec).eval()  # the program was built from these weights (a pipeline stage holds some of them)
    full = dict(whole.named_parameters())
    for fqn, slot in program.optimizer.slots.items():  # ... and this rank's shards are theirs
        assert torch.equal(unshard(slot.param, program.param_placements[fqn], program.ctx), full[fqn]), fqn
    dp = program.ctx.coord("dp")
    prompts = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(100 + dp))
    out = {}
    for tp in rollouts:
        engine = RolloutEngine.for_program(program, model, tp=tp)
        engine.sync(1)
        exact, largest = True, 0.0
        for name, param in engine.replica.named_parameters():
            dim = engine.dims[name]
            gathered = param if dim is None else collectives.all_gather(param.contiguous(), dim, engine.group)
            exact &= torch.equal(gathered, full[name])
            largest = max(largest, param.numel() / full[name].numel() if dim is not None else 0.0)
        common = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(99))  # a group feeds one batch
        with torch.no_grad():
            logits_err = (engine.replica(common)[0] - whole(common)[0]).abs().max().item()
        generator = torch.Generator().manual_seed(7 + dp)
        rollout = engine.generate(_Sampler(engine), prompts, SamplingConfig(max_new_tokens=6), eos_id=0, pad_id=1,
                                  generator=generator)
        with torch.no_grad():
            logp = whole(rollout.tokens)[0][:, prompts.shape[1] - 1:-1].log_softmax(-1)
        picked = logp.gather(-1, rollout.responses[..., None]).squeeze(-1) * rollout.response_mask
        out[tp] = {"exact": exact, "largest_share": largest, "logits_err": logits_err,
                   "own_prompts": torch.equal(rollout.prompts, prompts),
                   "logp_err": (picked - rollout.sample_logprobs).abs().max().item(),
                   "tokens": int(rollout.response_mask.sum()), "group_prompts": len(engine._unique)}
    return out


def _ppo(rank, world_size):
    from autoshard.runtime.rollout_engine import RolloutEngine

    torch.set_num_threads(1)
    model = _model("llama:tiny")
    graph = capture_policy(model, "llama:tiny")
    trainer = sharded_trainer(PPORun(steps=2, global_batch=16), _plan(graph, Mesh(dp_shard=4), "zero3", False),
                              model=model, graph=graph)
    trainer.policy.rollout = RolloutEngine.for_program(trainer.policy.program, model, tp=2)
    curve = train_loop(trainer, 2)
    return {"gap": max(m["mismatch/logp_max"] for m in curve), "syncs": trainer.policy.rollout.syncs,
            "finite": all(torch.isfinite(torch.tensor(m["policy/loss"])) for m in curve)}


CASES = {
    "zero3_dp4": ("llama:tiny", Mesh(dp_shard=4), "zero3", False, (1, 2, 4)),
    "tp2_dp2": ("llama:tiny", Mesh(dp_shard=2, tp=2), "zero3", True, (2, 4, 1)),
    "gpt_ddp4": ("gpt:tiny", Mesh(dp_replicate=4), "replicate", False, (4,)),
    "pp2_dp2": ("llama:tiny", Mesh(pp=2, dp_shard=2), "zero3", False, (1, 2)),
}


@pytest.fixture(scope="module")
def results():
    cases = {name: functools.partial(_layouts, spec=spec, mesh=mesh, state=state, tp_layers=tp_layers, rollouts=r)
             for name, (spec, mesh, state, tp_layers, r) in CASES.items()}
    cases["ppo"] = _ppo
    return run_gloo_cases(cases, WORLD, timeout_s=400)


def _each(results):
    for name, (_, _, _, _, rollouts) in CASES.items():
        for rank in results[name]:
            for tp in rollouts:
                yield name, tp, rank[tp]


@pytest.mark.slow
def test_reshard_gives_each_rank_exactly_its_slice(results):
    for name, tp, r in _each(results):
        assert r["exact"], (name, tp)
        assert r["largest_share"] <= 1.0 / tp + 1e-9, (name, tp, r["largest_share"])


@pytest.mark.slow
def test_sharded_replica_logits_equal_the_whole_model(results):
    for name, tp, r in _each(results):
        assert r["logits_err"] < 1e-5, (name, tp, r["logits_err"])


@pytest.mark.slow
def test_sampling_on_the_layout_keeps_own_prompts_and_true_logprobs(results):
    for name, tp, r in _each(results):
        assert r["own_prompts"], (name, tp)
        assert r["tokens"] > 3
        assert r["logp_err"] < 1e-5, (name, tp, r["logp_err"])
    # a rollout group wider than the training tp group samples several ranks' prompts together
    assert results["zero3_dp4"][0][4]["group_prompts"] == 4
    assert results["tp2_dp2"][0][4]["group_prompts"] == 2 and results["tp2_dp2"][0][2]["group_prompts"] == 1


@pytest.mark.slow
def test_ppo_trains_with_a_rollout_layout_unlike_training(results):
    for rank in results["ppo"]:
        assert rank["syncs"] == 2 and rank["finite"]
        assert rank["gap"] < 1e-4, rank["gap"]
