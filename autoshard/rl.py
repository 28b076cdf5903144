"""Reinforcement learning on your own prompts and rewards: PPO or GRPO on a sharded policy.

    from autoshard import rl

    history = rl.train("llama:tiny", "prompts.jsonl", rl.arithmetic_reward,
                       options=rl.RLOptions(algo="grpo", samples_per_prompt=4), steps=50)

What each argument is:

| argument | what | details |
| --- | --- | --- |
| ``model`` | the policy: a reference model (``"llama:tiny"``), ``package.module:factory`` / ``file.py:factory``, or a Hugging Face config directory | ``runtime/ppo_policy.py`` (the loader ``autoshard ppo`` uses) |
| ``prompts`` | a JSONL file of ``{"prompt": ..., "reference": ...}`` or an iterable of such dicts / strings | ``runtime/rl_data.py`` |
| ``reward`` | ``fn(prompts, responses, references, response_ids) -> one float per response``, or ``"module:function"`` | ``runtime/rl_reward.py``; ``arithmetic_reward`` is a rule-based example |
| ``tokenizer`` | ``"char"`` (the tasks' 16 characters, default), ``"bytes"``, a tokenizer directory or object (encode/decode, e.g. Hugging Face) | reference models are built with its vocabulary |
| ``options`` | ``RLOptions``: ``algo`` ("ppo" / "grpo"), ``samples_per_prompt``, ``loss_agg``, ``kl_mode``, ``entropy_coef``, ``clip``, ``temperature``, ``top_p``, ``max_new_tokens``, ``stop``, ``reference`` (a separate KL reference model) | objective: ``runtime/ppo.py``'s docstring |

``train`` searches a plan for ``cluster`` as ``autoshard ppo`` does (or takes
``plan``), and trains on the ranks of this process: alone, it starts a
one-rank gloo group for the run; under torchrun, every rank calls it. For
several ranks from one command line use ``autoshard ppo MODEL --prompts
FILE.jsonl --reward module:function --algo grpo --cluster cpu:1x2``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

from autoshard.errors import AutoshardError
from autoshard.runtime.rl_data import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    PromptDataError,
    PromptExample,
    PromptTask,
    Tokenizer,
    as_tokenizer,
    load_prompts,
)
from autoshard.runtime.rl_options import PromptSource, RLOptions
from autoshard.runtime.rl_reward import RewardError, arithmetic_reward, load_reward


def train(
    model: str,
    prompts: str | Path | Iterable[Any],
    reward: str | Callable[..., Any],
    *,
    steps: int = 50,
    options: RLOptions | None = None,
    tokenizer: Any = "char",
    long_prompts: str = "refuse",
    cluster: str = "cpu:1x1",
    plan: Any = None,
    batch: int = 64,
    seed: int = 0,
    lr: float = 1e-3,
    kl_coef: float = 0.05,
    metrics: str | Path | None = None,
    live: bool = True,
    checkpoint: str | Path | None = None,
    save_every: int = 0,
    resume: bool = False,
    context: int | None = None,
    compile: str = "auto",
) -> list[dict[str, float]]:
    """Train ``model`` on ``prompts`` scored by ``reward`` for ``steps`` steps (module docstring); the per-step
    metrics (``runtime/metrics.py``: ``reward/mean`` and the rest) of this rank.

    ``checkpoint``: a directory the run saves to at its end (and every ``save_every`` steps); with
    ``resume=True`` the run continues from it up to ``steps`` in total, drawing the prompts and samples an
    uninterrupted run draws (``runtime/ppo_checkpoint.py``: generators re-seeded from seed, dp rank and step).
    ``context``: a reference model's positions, prompt + response (default 32). ``compile``: ``"auto"`` runs
    the programs compiled on a GPU (padded to fixed shapes; ``runtime/ppo_program`` note "compiled PPO"),
    ``"off"`` eager (a policy that is not causal), ``"on"`` compiled everywhere."""
    import torch.distributed as dist

    from autoshard.runtime.ppo_program import PPORun, init_distributed, run_ppo, worker_device

    source = PromptSource(prompts=prompts, reward=reward, tokenizer=tokenizer, long_prompts=long_prompts)
    if resume and checkpoint is None:
        raise AutoshardError("resume=True needs checkpoint=DIR (the directory a previous run saved to)")
    run = PPORun(model=model, steps=steps, seed=seed, global_batch=batch, lr=lr, kl_coef=kl_coef, live=live,
                 metrics=None if metrics is None else str(metrics), data=source, rl=options or RLOptions(),
                 checkpoint=None if checkpoint is None else str(checkpoint), save_every=save_every, resume=resume,
                 context=context, compile=compile)
    plan, graph = _plan(run, cluster, plan)
    if dist.is_initialized() or "RANK" in os.environ:
        created = init_distributed(plan)
        store_dir = None
    else:
        if plan.mesh.world_size != 1:
            raise AutoshardError(f"plan for {plan.mesh.world_size} ranks, and this process is one; call train() on "
                                 "every rank under torchrun, or run `autoshard ppo MODEL --prompts ... --reward ...`")
        store_dir = tempfile.TemporaryDirectory(prefix="autoshard-rl-")
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir.name, "store"), 1),
                                rank=0, world_size=1)
        created = True
    try:
        return run_ppo(run, plan, graph=graph, device=worker_device())
    finally:
        if created:
            dist.destroy_process_group()
        if store_dir is not None:
            store_dir.cleanup()


def _plan(run: Any, cluster: str, plan: Any) -> tuple[Any, Any]:
    """(the plan: given, loaded, or searched for ``cluster`` as ``autoshard ppo`` does; the policy's graph)."""
    from autoshard.cli_ppo import rollout_workload, search_plan
    from autoshard.cli_search import load_cluster
    from autoshard.plan import Plan
    from autoshard.runtime.ppo_program import capture_policy, load_policy, policy_context, rollout_cache_unsupported
    from autoshard.runtime.rl_data import build_task, run_tokenizer

    tokenizer = run_tokenizer(run.data)
    policy = load_policy(run.model, run.seed, "meta", vocab_size=tokenizer.vocab_size, context=run.context)
    graph = capture_policy(policy.module, policy.name)
    if plan is None:  # the training plan and the rollout layout together, as `autoshard ppo` searches them
        task, sampling = build_task(run.task, run.data, run.rl, context=policy_context(policy.module), tokenizer=tokenizer)
        workload = None if rollout_cache_unsupported(policy.module) else rollout_workload(
            run.global_batch, task.prompt_len, sampling, run.mini_batches, compiled=run.compile != "off", algo=run.rl.algo)
        plan = search_plan(graph, load_cluster(cluster, None), run.global_batch, workload=workload,
                           rollout_cache=run.rollout_cache, compiled=run.compile != "off")
    elif not isinstance(plan, Plan):
        plan = Plan.load(plan)
    return plan, graph


__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "PromptDataError",
    "PromptExample",
    "PromptSource",
    "PromptTask",
    "RLOptions",
    "RewardError",
    "Tokenizer",
    "arithmetic_reward",
    "as_tokenizer",
    "load_prompts",
    "load_reward",
    "train",
]
