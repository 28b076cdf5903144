"""PPO on sharded programs: a ``PolicyEngine`` over a per-rank ``Program``, and the worker entry point.

``ProgramEngine(program, vocab_size=..., max_seq_len=...)`` implements the
``runtime/ppo_engine.py`` protocol over this rank's ``Program``:

| member | over the program |
| --- | --- |
| ``forward(tokens)`` | ``Program.forward`` (ZeRO-3 gathers, Megatron TP with all-gathered logits): (logits [B, S, V], values [B, S]) on every rank of the tp group; under ``no_grad`` the ZeRO-3 re-gather records are dropped at once; with pp > 1 only under ``no_grad`` (the stages in order, outputs broadcast to the pp group) |
| ``forward(tokens, cache=, start_pos=)``, ``new_cache`` | with a ``RolloutEngine`` (default for the policy): KV-cached sampling on the rollout layout (groups of r ranks, each a Megatron shard of degree r; r = 1 a whole copy), resharded from the program's shards once per step (``runtime/rollout_engine.py``); without one (``rollout_cache=False``, the reference): ``new_cache`` is None and rollout recomputes the prefix each decode step through the program |
| ``sync_rollout_weights()`` | reshard the current weights onto the rollout layout (collective; no-op when already fresh); ``PPOTrainer`` times it as the ``weight_sync`` phase |
| ``backward(loss)`` | ``(D · loss).backward()`` with D = dp size, then the re-gather cache reset |
| ``pipelined``, ``accumulate(tokens, loss_fn, stats)`` | pp > 1: forward and backward of a whole mini-batch through the plan's schedule (note: PPO on pipeline stages) |
| ``step()`` | ``ShardedOptimizer.step()``: gradient sync over dp, global-norm clip, update, write back |
| ``dp`` | ``GroupReducer`` over the plan's combined ``"dp"`` group (dp_replicate × dp_shard) |

[Note: SUM over dp from an averaging optimizer]
PPO divides each rank's loss by the GLOBAL token count, so the engine must
SUM gradients over dp (``ppo_engine`` note). The runtime's gradient sync
averages (all-reduce / reduce-scatter with ``avg``, in the optimizer for
DDP/ZeRO-1/2/offload and inside the graph's backward for ZeRO-3 and HSDP).
Back-propagating D · loss makes every rank's gradient D × its share, and the
average over D ranks of D × share is the sum of the shares: exact for every
ZeRO state without touching ``runtime/program.py``. Clipping sees the synced
(summed) gradient, so the global norm is the single-process one. tp ranks
back-propagate the same replicated loss; the Megatron f/g ops keep their
gradients equal to single-device ones, so no tp factor enters.

[Note: rank-consistent sampling]
``PPOTrainer`` seeds its prompt and sampling generators with
``seed + 7919 · dp.rank``; ``dp.rank`` here is the rank's coordinate in the
dp group, so all ranks of one tp group (same dp coordinate) draw the same
prompts and, given bitwise-equal logits (all-gathered vocab shards;
``reduce_from_tp`` sums in the same order on every rank), the same tokens.
Different dp ranks get different prompts. ``train_loop`` re-seeds both
generators from (seed, dp rank, step) before every step, so the random
stream of step k does not depend on how the run got there: a resumed run
draws what an uninterrupted one draws.

[Note: the frozen reference]
The reference policy is a second ``Program`` built from the same initial
weights, sharded by its own plan (default: the policy's) on the policy's
``RankContext`` (same mesh and groups; a reference plan must have the
policy's mesh). Its parameters get ``requires_grad=False`` and the engine
refuses ``backward``/``step``. ``build_program`` always builds an optimizer;
the reference's is built as SGD and never stepped (its fp32 masters and zero
moments are dead memory, a known cost of this simple design; a weights-only
program build would remove it).

[Note: the rollout engine]
The policy engine owns a ``RolloutEngine`` unless built with
``rollout_cache=False``: the policy on its own layout in the compute dtype
(groups of r ranks, a Megatron shard of degree r each; r from the plan's
rollout section, else the plan's tp), fed by a reshard of the program's
shards whenever the weights changed (``_weights_version`` counts optimizer
steps and state loads). The log-probs PPO trains on still come from the
program (``_score``), so the rollout copy only decides which tokens are
drawn; ``mismatch/logp_*`` measures the gap. Memory: 1/r of the compute-dtype
model per rank plus the KV cache (``rollout_engine`` docstring), priced by
``search/rollout.py``.

[Note: compiled PPO]
Where ``build_program`` compiles (``PPORun.compile="auto"``: a GPU, ep = cp = 1), the policy and
reference programs run through ``torch.compile`` (``dynamic=False``), and PPO's shapes vary: responses
stop early, the last scoring chunk is short, a prefix grows per decode step without a rollout engine.
So the engine pads every input on the right to a fixed shape before the program sees it and cuts the
outputs back (``fixed_width``): the sequence to the plan's ``seq_len`` (what the plan was searched and
priced for; a longer one to the next multiple of 64, at most the model's context), the rows to the
fewest this engine already compiled (in that grad mode) that hold them: a short last chunk reuses the
full chunk's graph. A pipelined mini-batch pads its width only (its rows are the same every step).
A causal policy's outputs at the real positions do not read the padded ones, and padded rows and
positions get no gradient, so the step is the eager one up to the padded GEMMs' rounding (tested
against it on gloo). An engine compiles one graph per grad mode and row count: the training
micro-batch; the scoring chunk (the same rows); and, without a rollout engine, the rollout batch.
A policy that is not causal, or a mixture of experts whose routing capacity counts padded tokens,
would change under padding: run those with ``compile="off"``.

Which models a run takes (reference, factory, Hugging Face config), their initial weights, vocabulary
and rollout: ``runtime/ppo_policy.py``.

[Note: PPO on pipeline stages]
With pp > 1 the backward runs inside the ``torch.distributed.pipelining``
schedule, so ``PPOTrainer.accumulate_gradients`` hands the engine the whole
mini-batch (``accumulate``): the schedule's target is the row indices, and
on the last stage PPO's loss of each micro-batch reads those rows of the
experience (advantages, old and reference log-probs, masks, returns, old
values: every rank of a pp group holds the same experience, as it sampled
the same tokens). Each loss is back-propagated as it is, times D (not
divided by the micro-batch count: it is already a share of the global
normaliser), and the statistics are summed over pp (zeros off the last
stage), so every rank reports the same metrics. Micro-batches:
``PPOConfig.micro_batch`` rows each when set, else the divisor of the
mini-batch rows nearest the plan's ``num_micro_batches`` that the plan's
schedule admits over the pp ranks (``Schedule.admits``: 1F1B m >= pp,
interleaved m % pp == 0, the counts the search prices; logged when it
differs). Old, reference and
rollout log-probs come from ``forward`` under ``no_grad``: the stages one
after the other over the whole chunk (no micro-batching), the outputs
broadcast from the last stage. Rollout samples on its own layout as with
pp = 1 (``runtime/rollout_engine.py``: the stage owning a parameter cuts
this rank's slice and broadcasts it over ``pp``).

Partial: scoring and rollout forwards with pp > 1 are serial (one stage busy
at a time) and broadcast full logits. With pp = 1, PPO micro-batches itself
(``PPOConfig.micro_batch``): the plan's micro-batch when the plan was searched
for the RL workload (it has a rollout section), else the whole mini-batch.

The worker entry point ``python -m autoshard.runtime.ppo_program`` (started by
``autoshard ppo`` through torchrun, ``autoshard/cli_ppo.py``) joins the
process group, builds both programs from ``--plan``, trains ``--steps`` PPO
steps and, on rank 0, writes metric JSON lines, the live line and the plot.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from autoshard.errors import AutoshardError, PlanError
from autoshard.kernels import collectives
from autoshard.plan import Plan
from autoshard.plan_reuse import cluster_of
from autoshard.runtime.build_options import BuildOptions, Compile
from autoshard.runtime.launch import check_world
from autoshard.runtime.launch_child import record_rank_error, timeout_s
from autoshard.runtime.metrics import LiveSummary, MetricsWriter, truncate_metrics, write_run_info
from autoshard.runtime.optimizer import OptimizerConfig
from autoshard.runtime.plot import plot_metrics
from autoshard.runtime.ppo import PPOConfig, PPOTrainer
from autoshard.runtime.ppo_checkpoint import load_ppo, save_ppo
from autoshard.runtime.ppo_engine import EngineError
from autoshard.runtime.ppo_policy import (  # noqa: F401  (re-exported: the run's model)
    MODEL_MAX_SEQ_LEN,
    PolicyModel,
    build_policy_model,
    capture_policy,
    check_policy_vocab,
    check_same_weights,
    load_policy,
    load_reference,
    policy_context,
    policy_vocab,
    rollout_cache_unsupported,
)
from autoshard.runtime.program import build_program
from autoshard.runtime.rl_data import build_task, run_tokenizer
from autoshard.runtime.rl_options import (
    RLOptions,
    add_rl_arguments,
    options_from_args,
    rl_config_fields,
    source_from_args,
)
from autoshard.runtime.rollout import SamplingConfig
from autoshard.runtime.rollout_engine import RolloutEngine
from autoshard.runtime.step_profile import profiled_step, record_step, trace_path
from autoshard.runtime.tasks import VOCAB, task_vocab_size
from autoshard.train import TrainSpec

log = logging.getLogger(__name__)


PAD_MULTIPLE = 64
"""A compiled engine pads a sequence longer than the plan's ``seq_len`` to a multiple of this (module note: compiled PPO)."""


def fixed_width(width: int, planned: int, longest: int) -> int:
    """The padded width of a ``width``-token input of a compiled engine: the plan's ``planned`` sequence
    length when it fits, else the next multiple of ``PAD_MULTIPLE``, at most ``longest`` (the model's
    context) and never less than ``width`` (a model refuses what is too long for it itself)."""
    if width <= planned:
        return planned
    return max(width, min(longest, -(-width // PAD_MULTIPLE) * PAD_MULTIPLE))


class GroupReducer:
    """``Reducer`` over a named process group of the runtime (SUM all-reduce, in place)."""

    def __init__(self, group_name: str, rank: int, world_size: int, device: torch.device | str = "cpu") -> None:
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        self.device = torch.device(device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it (identity for a group of one).

        The collective runs on the program's device: NCCL has no CPU backend,
        and PPO's token counts and metrics live on the CPU.
        """
        if self.world_size > 1:
            moved = tensor.to(self.device)
            tensor.copy_(collectives.all_reduce(moved, self.group_name, "sum").to(tensor.device))
        return tensor


class ProgramEngine:
    """``PolicyEngine`` over a sharded ``Program`` (module docstring: members, SUM note, reference note).

    ``frozen=True`` makes a reference engine: parameters do not require grad
    and ``zero_grad``/``backward``/``step`` raise ``EngineError``. ``vocab_size``
    is PPO's action count: wider logits are restricted to their first
    ``vocab_size`` ids (``runtime/ppo_policy.py``).
    """

    def __init__(
        self, program: Any, *, vocab_size: int, max_seq_len: int, frozen: bool = False, rollout: Any = None
    ) -> None:
        self.program, self.frozen = program, frozen
        self.vocab_size, self.max_seq_len = int(vocab_size), int(max_seq_len)
        ctx = program.ctx
        self.device = torch.device(ctx.device)
        self.dp = GroupReducer(ctx.group("dp"), ctx.coord("dp"), ctx.size("dp"), ctx.device)
        if frozen and rollout is not None:
            raise EngineError("a frozen reference engine never samples; build it without a rollout engine")
        self.rollout = rollout
        self._weights_version = 0  # bumped by step() and load_state_dict() (rollout engine note)
        self.fixed_shapes = program.compile_options is not None  # module note: compiled PPO
        self._row_buckets: dict[bool, list[int]] = {True: [], False: []}  # per grad mode: row counts compiled
        if frozen:
            program.gm.requires_grad_(False)

    # ------------------------------------------------------------------ forward

    def forward(self, tokens: torch.Tensor, *, cache: Any = None, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] → (logits [B, S, V], values [B, S]), identical on every rank of a tp group.

        With ``cache`` (from ``new_cache``) the tokens sit at positions
        ``start_pos``.. and run through the rollout layout (no autograd);
        without it, through the sharded program.
        """
        if cache is not None or start_pos:
            if self.rollout is None or cache is None:
                raise EngineError(
                    f"forward(cache={type(cache).__name__}, start_pos={start_pos}): a nonzero start_pos needs a cache "
                    "from new_cache, and new_cache is None without a rollout engine (rollout_cache=False, reference); "
                    "call forward(tokens) on the whole prefix"
                )
            return self._actions(*self.rollout.forward(tokens, cache, start_pos))
        if self.pipelined and torch.is_grad_enabled():
            raise EngineError(
                f"forward with autograd on a pipeline program (pp={self.program.plan.mesh.pp}): its backward runs "
                "inside the schedule; train through accumulate(tokens, loss_fn, stats), or call forward under no_grad"
            )
        rows, width = tokens.shape
        logits, values = self.program.forward(self._padded(tokens, rows=True))
        if not torch.is_grad_enabled():
            self._reset_regather()  # no backward will consume the ZeRO-3 records of this forward
        return self._actions(logits[:rows, :width], values[:rows, :width])

    def _padded(self, tokens: torch.Tensor, *, rows: bool) -> torch.Tensor:
        """``tokens`` on a compiled program's fixed shape (module note: compiled PPO; ``rows``: pad the rows
        too); as they are on an eager one."""
        if not self.fixed_shapes:
            return tokens
        count, width = tokens.shape
        pad_rows = self._row_bucket(count) - count if rows else 0
        target = fixed_width(width, self.program.plan.seq_len, self.max_seq_len)
        return torch.nn.functional.pad(tokens, (0, target - width, 0, pad_rows))

    def _row_bucket(self, count: int) -> int:
        """The fewest rows already compiled (in this grad mode) that hold ``count``, else ``count`` (a new one)."""
        buckets = self._row_buckets[torch.is_grad_enabled()]
        fits = [bucket for bucket in buckets if bucket >= count]
        if fits:
            return min(fits)
        buckets.append(count)
        return count

    def _actions(self, logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, S, V] restricted to the first ``vocab_size`` ids, values) (``runtime/ppo_policy.py``)."""
        width = logits.shape[-1]
        if width < self.vocab_size:
            raise EngineError(f"the model's logits have {width} ids, fewer than the {self.vocab_size} PPO samples "
                              "from; give the model a vocabulary of at least that size")
        return (logits[..., : self.vocab_size] if width > self.vocab_size else logits), values

    def new_cache(self, batch: int, max_len: int) -> Any:
        """The rollout layout's KV cache (resharding its weights first when stale), or None without a rollout engine.

        Collective when the rollout weights are stale: every rank calls it together (rollout does).
        """
        if self.rollout is None:
            return None
        self.sync_rollout_weights()
        return self.rollout.new_cache(batch, max_len)

    def sync_rollout_weights(self) -> None:
        """Reshard the program's current weights onto the rollout layout (collective; no-op when fresh or absent)."""
        if self.rollout is not None:
            self.rollout.sync(self._weights_version)

    def train_mode(self) -> None:
        self._set_mode(True)

    def eval_mode(self) -> None:
        self._set_mode(False)

    def _set_mode(self, training: bool) -> None:
        try:
            self.program.gm.train(training)
        except NotImplementedError:
            # Exported modules refuse train()/eval() in some torch versions; the reference policies
            # have no dropout by default, so the exported graph is already mode-free.
            pass

    def _reset_regather(self) -> None:
        if self.program.regather is not None:
            self.program.regather.reset()

    # ------------------------------------------------------------------ update

    def _require_trainable(self, what: str) -> None:
        if self.frozen:
            raise EngineError(f"cannot {what} a frozen reference engine (built with frozen=True); use the policy engine")

    def zero_grad(self) -> None:
        self._require_trainable("zero_grad")
        for param in self.program.gm.parameters():
            param.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate D · ``loss`` (D = dp size; module note: SUM over dp from an averaging optimizer)."""
        self._require_trainable("backward through")
        (loss * self.dp.world_size).backward()
        self._reset_regather()

    @property
    def pipelined(self) -> bool:
        """Whether the program runs pipeline stages (pp > 1): PPO then trains through ``accumulate``."""
        return self.program.pipeline is not None

    def accumulate(self, tokens: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any],
                   stats: dict[str, torch.Tensor], *, micro_batch: int | None = None) -> None:
        """Forward/backward of tokens [B, S] through the plan's pipeline schedule (pp > 1; module note: PPO on
        pipeline stages).

        On the last stage, ``loss_fn(logits, values, rows)`` of each micro-batch (``rows``: its row indices
        into ``tokens``) returns ``(loss, parts)``: ``loss`` is back-propagated as ``backward`` would (times the
        dp size), each ``parts[key]`` is added into ``stats[key]`` (float64 scalars, the same keys on every
        rank), and on return ``stats`` holds the sums on every rank of the pp group. ``micro_batch``: rows per
        micro-batch (default: module note).
        """
        self._require_trainable("accumulate gradients of")
        rows, scale = tokens.shape[0], self.dp.world_size  # D · loss: SUM over dp from an averaging optimizer
        # on the device (stays zero off the last stage): one host read per mini-batch, in _sum_over_pp
        sums = {key: torch.zeros_like(value, device=self.device) for key, value in stats.items()}

        width = tokens.shape[1]

        def micro_loss(outputs: Any, index: torch.Tensor) -> torch.Tensor:
            logits, values = outputs
            loss, parts = loss_fn(*self._actions(logits[:, :width], values[:, :width]), index)
            for key, value in parts.items():
                sums[key] += value.detach().double()
            return loss * scale

        index = torch.arange(rows, device=self.device)
        # a mini-batch's rows are the same every step: only the width is padded (module note: compiled PPO)
        self.program.pipeline.train_step(self._stage_inputs(self._padded(tokens, rows=False)), index, micro_loss, mean=False,
                                         num_micro_batches=self._micro_batches(rows, micro_batch))
        for key, value in self._sum_over_pp(sums).items():
            stats[key] += value

    def _stage_inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``tokens`` as the pipeline stages take them (by their placeholder name)."""
        bound = self.program.inputs.bind((tokens.to(self.device),), {})
        return dict(zip(self.program.pipeline.layout.input_names, bound.values()))

    def _micro_batches(self, rows: int, micro_batch: int | None) -> int:
        """Micro-batches of a pipeline step over ``rows`` sequences (module note: PPO on pipeline stages)."""
        if micro_batch is not None:
            if rows % micro_batch:
                raise EngineError(f"micro_batch={micro_batch} does not divide the {rows} rows of the batch; "
                                  "pick a divisor of the mini-batch size")
            return rows // micro_batch
        schedule, pp = self.program.plan.schedule, self.program.plan.mesh.pp
        divisors = [d for d in range(1, rows + 1) if rows % d == 0]
        divisors = [d for d in divisors if schedule.admits(d, pp)] or divisors
        chosen = min(divisors, key=lambda d: (abs(d - schedule.num_micro_batches), -d))
        if chosen != schedule.num_micro_batches:
            log.info("pipeline: %d micro-batches of %d rows: the divisor of %d rows nearest the plan's %d "
                     "that %s takes over %d pp ranks", chosen, rows // chosen, rows, schedule.num_micro_batches,
                     schedule.name, pp)
        return chosen

    def _sum_over_pp(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` (scalars) summed over the pp group: the last stage's on every stage (zeros elsewhere)."""
        keys = sorted(values)
        local = torch.stack([values[key] for key in keys]).to(self.device)
        total = collectives.all_reduce(local, self.program.ctx.group("pp"), "sum").cpu()
        return dict(zip(keys, total))

    def step(self) -> float:
        """Sync (sum) gradients over dp, clip by global norm, update; the pre-clip global norm."""
        self._require_trainable("step")
        norm = float(self.program.optimizer.step())
        self._weights_version += 1
        return norm

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master shards at their local shapes (``Program.local_state_dict``; collective for ZeRO-1/2)."""
        return self.program.local_state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.program.load_local_state_dict(state)
        self._weights_version += 1


# --------------------------------------------------------------------------- building a sharded PPO run



@dataclass(frozen=True, kw_only=True)
class PPORun:
    """What one sharded PPO run trains; the worker's arguments (``autoshard ppo`` flags)."""

    model: str = "llama:tiny"
    """MODEL of the CLI: a reference spec (built with the task vocabulary and ``MODEL_MAX_SEQ_LEN``),
    ``package.module:factory``, ``file.py:factory`` or a Hugging Face config (``runtime/ppo_policy.py``)."""
    weights: str | None = None
    """Hugging Face safetensors directory the initial weights come from (HF config models only)."""
    task: str = "arithmetic"
    """Task name (``runtime/tasks``); ``tasks.TASK_PRESETS`` holds its options."""
    steps: int = 150
    """PPO steps to run in total (a resumed run continues up to this count)."""
    seed: int = 0
    """Model initialisation, prompts, sampling and shuffles."""
    global_batch: int = 64
    """Prompts per step over all dp ranks; each dp rank samples global_batch / dp."""
    mini_batches: int = 2
    """Optimizer steps per PPO step (as the reference run)."""
    lr: float = 1e-3
    """AdamW learning rate (betas 0.9, 0.99, no weight decay, clip 1.0: the reference run)."""
    kl_coef: float = 0.05
    """β of the k1 KL penalty in the reward."""
    metrics: str | None = None
    """JSON-lines metrics file written by rank 0 (on resume: cut to the checkpoint's step, then appended)."""
    checkpoint: str | None = None
    """Directory of the PPO checkpoint, saved at the end of the run (and every ``save_every`` steps)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    resume: bool = False
    """Resume from ``checkpoint`` (any plan, any world size)."""
    plot: str | None = None
    """PNG of the training curves written by rank 0 at the end (needs ``metrics``)."""
    live: bool = True
    """Rank 0 prints one summary line per step."""
    profile: bool = False
    """Record one step with torch.profiler: a Chrome trace per rank next to ``metrics`` (``runtime/step_profile.py``)."""
    rollout_cache: bool = True
    compile: str = "auto"
    """The policy's and reference's programs: ``"auto"`` compiles them where ``build_program`` would (a GPU,
    ep = cp = 1) on fixed padded shapes (module note: compiled PPO), ``"on"`` everywhere, ``"off"`` eager."""
    compile_backend: str = "inductor"
    """``torch.compile`` backend of compiled programs (the CPU tests use ``"aot_eager"``)."""
    context: int | None = None
    """A reference model's positions (prompt + response); None: ``MODEL_MAX_SEQ_LEN`` (32, what the tasks need)."""
    """Sample on the KV-cached rollout layout resharded from the training shards each step
    (``runtime/rollout_engine.py``); False: recompute every prefix through the sharded program (no rollout copy)."""
    data: Any = None
    """User prompts and reward (``runtime/rl_options.PromptSource``) instead of ``task``."""
    rl: RLOptions = field(default_factory=RLOptions)
    """Algorithm (PPO / GRPO), generation and reference-model options (``runtime/rl_options.py``)."""


def build_engines(
    model: torch.nn.Module,
    graph: Any,
    plan: Any,
    *,
    lr: float,
    reference_plan: Any = None,
    device: str = "cpu",
    rollout_cache: bool | None = None,
    weights: Any = None,
    vocab_size: int | None = None,
    reference_model: PolicyModel | None = None,
    options: Any = None,
) -> tuple[ProgramEngine, ProgramEngine]:
    """(policy, frozen reference) engines over ``plan`` (and ``reference_plan``, default ``plan``).

    Both programs start from ``weights`` (``build_program``'s source; None: ``model``'s own
    values), the reference from ``reference_model``'s instead when given (a separate model of the
    same architecture, ``ppo_policy.load_reference``); the reference reuses the policy's
    ``RankContext`` (module note: the frozen reference). ``vocab_size``: PPO's action count (default: the tasks' ``len(VOCAB)``; wider
    logits are restricted to it, ``runtime/ppo_policy.py``). ``rollout_cache`` (default: on
    when the plan has pp == 1) gives the policy a ``RolloutEngine`` (module note: the rollout
    engine); a model without the reference models' cache API recomputes instead (logged). ``options``: both
    programs' ``BuildOptions`` (default ``Compile.AUTO``; module note: compiled PPO).
    """
    reference_plan = plan if reference_plan is None else reference_plan
    if reference_plan.mesh != plan.mesh:
        raise PlanError(
            f"reference plan mesh {reference_plan.mesh} differs from the policy plan mesh {plan.mesh}; "
            "the reference shares the policy's process groups: search it with --mesh matching the policy"
        )
    actions = len(VOCAB) if vocab_size is None else vocab_size
    train = TrainSpec(global_batch=plan.global_batch, seq_len=plan.seq_len, precision=plan.precision)
    adamw = OptimizerConfig(name="adamw", lr=lr, betas=(0.9, 0.99), weight_decay=0.0, max_grad_norm=1.0)
    options = options or BuildOptions(compile=Compile.AUTO)  # compiled: ProgramEngine pads to fixed shapes
    policy_program = build_program(model, graph, plan, optimizer=adamw, device=device, options=options, weights=weights)
    ref_module, ref_weights = (model, weights) if reference_model is None else (reference_model.module,
                                                                                 reference_model.weights)
    reference_program = build_program(
        ref_module, graph, reference_plan, ctx=policy_program.ctx, weights=ref_weights,
        optimizer=OptimizerConfig(name="sgd", lr=1.0, max_grad_norm=None), device=device, options=options,
    )
    use_cache = True if rollout_cache is None else rollout_cache  # pp > 1 too: the stages' owners broadcast the reshard
    unsupported = rollout_cache_unsupported(model)
    if use_cache and unsupported:
        log.info("rollout: recomputing prefixes through the program: %s", unsupported)
        use_cache = False
    rollout_tp = plan.rollout[0].tp if plan.rollout else None  # the plan's rollout layout (search/rollout.py)
    rollout = RolloutEngine.for_program(policy_program, model, tp=rollout_tp) if use_cache else None
    context = policy_context(model)
    policy = ProgramEngine(policy_program, vocab_size=actions, max_seq_len=context, rollout=rollout)
    reference = ProgramEngine(reference_program, vocab_size=actions, max_seq_len=context, frozen=True)
    return policy, reference


def ppo_config(run: PPORun, dp: int, max_new_tokens: int, sampling: Any = None, plan: Any = None) -> Any:
    """The reference run's ``PPOConfig`` with ``run.global_batch`` split over ``dp`` ranks and ``run.rl``'s
    options; ``sampling`` (default: ``max_new_tokens`` at temperature 1) from ``rl_data.build_task``.
    A ``plan`` searched for this RL workload (one with a rollout section, ``search/rollout.py``) sets the
    micro-batch to the one it was priced and fitted with, when that divides a rank's mini-batch."""
    if run.global_batch % dp:
        raise PlanError(
            f"global batch {run.global_batch} is not divisible by the plan's dp={dp}; "
            f"use a multiple of {dp} (--batch)"
        )
    micro_batch = None
    if plan is not None and plan.rollout and plan.mesh.pp == 1:
        rows = run.global_batch // dp // max(run.mini_batches, 1)
        micro_batch = plan.schedule.micro_batch if rows and rows % plan.schedule.micro_batch == 0 else None
    return PPOConfig(
        rollout_batch=run.global_batch // dp, mini_batches=run.mini_batches, kl_coef=run.kl_coef, micro_batch=micro_batch,
        sampling=sampling or SamplingConfig(max_new_tokens=max_new_tokens), seed=run.seed, **rl_config_fields(run.rl),
    )


def sharded_trainer(
    run: PPORun,
    plan: Any,
    *,
    model: torch.nn.Module | PolicyModel | None = None,
    graph: Any = None,
    reference_plan: Any = None,
    device: str = "cpu",
    on_metrics: Callable[[dict[str, float]], None] | None = None,
) -> Any:
    """A ``PPOTrainer`` over ``ProgramEngine``s of ``plan`` for ``run`` (every rank calls it).

    ``model`` (default ``load_policy(run.model, run.seed, weights=run.weights)``; an
    ``nn.Module`` brings its own values) gives the initial weights of policy and reference;
    ``graph`` (default: captured from it) is what ``plan`` was searched against.
    """
    tokenizer = run_tokenizer(run.data)
    if model is None:
        model = load_policy(run.model, run.seed, device, weights=run.weights, vocab_size=tokenizer.vocab_size,
                            context=run.context, on_shards=True)
    policy_model = model if isinstance(model, PolicyModel) else PolicyModel(model, run.model)
    task, sampling = build_task(run.task, run.data, run.rl, context=policy_context(policy_model.module),
                                tokenizer=tokenizer)
    check_policy_vocab(policy_model.module, policy_model.name, task)
    if policy_model.user and policy_model.weights is None:
        check_same_weights(policy_model.module, policy_model.name, device)
    module = policy_model.module
    graph = graph if graph is not None else capture_policy(module, policy_model.name)
    reference_model = None
    if run.rl.reference is not None:
        reference_model = load_reference(run.rl.reference, module, run.seed, device, vocab_size=tokenizer.vocab_size)
    policy, reference = build_engines(
        module, graph, plan, lr=run.lr, reference_plan=reference_plan, device=device, rollout_cache=run.rollout_cache,
        weights=policy_model.weights, vocab_size=task_vocab_size(task), reference_model=reference_model,
        options=BuildOptions(compile=run.compile, backend=run.compile_backend),
    )
    config = ppo_config(run, policy.dp.world_size, sampling.max_new_tokens, sampling, plan)
    flops_per_token = 6.0 * sum(p.numel() for p in module.parameters())
    return PPOTrainer(
        policy, reference, task, config, flops_per_token=flops_per_token, peak_flops=_replica_peak_flops(plan),
        on_metrics=on_metrics,
    )


def _replica_peak_flops(plan: Any) -> float | None:
    """Peak FLOP/s of the devices that hold one model replica (tp × pp × cp of them), in the
    plan's precision, from the cluster the plan recorded; ``None`` (MFU reported as NaN) when
    the plan records no cluster. MFU then counts 6·params FLOPs per trained token of this
    data-parallel rank against the replica's peak, so tensor/pipeline ranks are not counted twice."""
    try:
        device_peak = cluster_of(plan).peak_flops(plan.precision)
    except AutoshardError:
        return None
    return device_peak * (plan.mesh.world_size // plan.mesh.dp)


def reseed(trainer: Any, step: int) -> None:
    """Seed the trainer's prompt and sampling generators from (seed, dp rank, ``step``) (rank-consistent note)."""
    base = trainer.config.seed + 7919 * trainer.dp.rank + 1_000_003 * step
    trainer.cpu_generator.manual_seed(base)
    trainer.sample_generator.manual_seed(base + 1)


def train_loop(trainer: Any, steps: int, *, on_step: Callable[[int], None] | None = None,
               around_step: Callable[[int], Any] | None = None) -> list[dict[str, float]]:
    """Run PPO steps ``trainer.step_count + 1 .. steps``, re-seeding before each; returns their metrics.

    ``on_step(step)`` runs after each step (e.g. a periodic checkpoint); ``around_step(step)`` returns a
    context manager the step runs in (e.g. a profiler on one of them).
    """
    history = []
    while trainer.step_count < steps:
        reseed(trainer, trainer.step_count)
        with around_step(trainer.step_count + 1) if around_step is not None else contextlib.nullcontext():
            history.append(trainer.step())
        if on_step is not None:
            on_step(trainer.step_count)
    return history


# --------------------------------------------------------------------------- one run on this rank


def _reporter(run: PPORun, rank: int) -> tuple[Callable[[dict[str, float]], None] | None, Callable[[int], None],
                                               Callable[[], None]]:
    """(on_metrics, start(step), close) for this rank: rank 0 writes JSON lines and reports each step's
    progress (``metrics.LiveSummary``: ``step i/N``, elapsed, ETA, tokens/s and the headline metrics),
    others nothing."""
    if rank != 0:
        return None, lambda step: None, lambda: None

    writer = MetricsWriter(run.metrics) if run.metrics else None
    summary = LiveSummary(run.steps) if run.live else None  # one line per step in a log, a live row on a terminal

    def report(metrics: dict[str, float]) -> None:
        if writer is not None:
            writer.write(metrics)
        if summary is not None:
            summary(metrics)

    def start(step: int) -> None:
        if summary is not None:
            summary.start(step)

    def close() -> None:
        if writer is not None:
            writer.close()
        if summary is not None:
            summary.close()

    return report, start, close


def run_ppo(run: PPORun, plan: Any, *, graph: Any = None, device: str = "cpu") -> list[dict[str, float]]:
    """Train ``run`` under ``plan`` on this rank (every rank of an initialised process group calls it).

    Resumes from ``run.checkpoint`` when ``run.resume``; saves there every
    ``run.save_every`` steps and at the end; rank 0 reports metrics and, with
    ``run.plot``, writes the curves PNG and prints its path. Returns this
    run's per-step metrics (the steps it ran, not the resumed ones).
    """
    import torch.distributed as dist

    if run.resume and not run.checkpoint:
        raise AutoshardError("resume=True needs a checkpoint directory; pass --checkpoint DIR")
    if run.plot and not run.metrics:
        raise AutoshardError(f"plot {run.plot!r} needs a metrics file to plot from; pass --metrics FILE.jsonl")
    rank = dist.get_rank()
    report, start, close = _reporter(run, rank)
    if rank == 0 and run.metrics:
        task_name = run.task if run.data is None else f"prompts:{run.data.prompts}"
        write_run_info(run.metrics, {"model": run.model, "task": task_name, "algo": run.rl.algo,
                                     "world_size": plan.mesh.world_size,
                                     "mesh": str(plan.mesh), "schedule": str(plan.schedule),
                                     "precision": plan.precision, "global_batch": run.global_batch})

    model = load_policy(run.model, run.seed, device, weights=run.weights, vocab_size=run_tokenizer(run.data).vocab_size,
                        context=run.context, on_shards=True)
    graph = graph if graph is not None else capture_policy(model.module, model.name)
    trainer = sharded_trainer(run, plan, model=model, graph=graph, device=device, on_metrics=report)
    unsupported = rollout_cache_unsupported(model.module)
    if rank == 0 and run.rollout_cache and unsupported:
        print(f"rollout: no KV cache, recomputing each prefix through the program: {unsupported}", flush=True)
    if rank == 0:  # said once: prompts cut to the budget, defaults chosen from the algorithm
        for line in filter(None, [getattr(trainer.task, "notice", None), *run.rl.defaults_said()]):
            print(line, flush=True)
    if run.resume:
        loaded = load_ppo(run.checkpoint, trainer, graph)
        if rank == 0:
            print(f"resumed from {run.checkpoint} at step {loaded.step} (saved with dp={loaded.extras.get('dp')})")
            if run.metrics:  # the rows after the checkpoint are written again: none twice
                truncate_metrics(run.metrics, loaded.step)

    def checkpoint(step: int) -> None:
        if run.checkpoint and run.save_every and step % run.save_every == 0 and step < run.steps:
            save_ppo(run.checkpoint, trainer, graph)

    try:
        start(trainer.step_count)
        history = train_loop(trainer, run.steps, on_step=checkpoint, around_step=_profiler(run, rank, trainer, device))
    finally:
        close()
    if run.checkpoint:
        save_ppo(run.checkpoint, trainer, graph)
    if rank == 0 and run.plot:
        print(f"training curves: {plot_metrics(run.metrics, run.plot)}")
    return history


def _profiler(run: PPORun, rank: int, trainer: Any, device: str) -> Callable[[int], Any] | None:
    """With ``run.profile``: record one step of this run (``step_profile.profiled_step``) to this rank's trace."""
    if not run.profile:
        return None

    if not run.metrics:
        raise AutoshardError("profile=True writes its trace next to the metrics file; pass --metrics FILE.jsonl")
    target = profiled_step(trainer.step_count + 1, run.steps)
    path = trace_path(run.metrics, rank)

    def around(step: int) -> Any:
        if step != target:
            return contextlib.nullcontext()
        if rank == 0:
            print(f"profiling step {step}: {path}", flush=True)
        return record_step(path, device)

    return around


# --------------------------------------------------------------------------- worker entry point (torchrun)


def worker_device() -> str:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return "cpu"


def init_distributed(plan: Any, collective_timeout_s: float | None = None) -> bool:
    """Join the torchrun job (env ``RANK``/``WORLD_SIZE``) unless a process group exists; True when it created one.

    Checks the plan's world size against ``WORLD_SIZE`` first, so a mismatch
    fails here instead of hanging in a collective. ``collective_timeout_s``: each collective's limit, by
    default ``AUTOSHARD_TIMEOUT_S`` (``launch_child.timeout_s``), as the launcher's watchdog.
    """
    import torch.distributed as dist

    check_world(plan)
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    limit = timeout_s() if collective_timeout_s is None else collective_timeout_s
    dist.init_process_group(backend, timeout=timedelta(seconds=limit))
    return True


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags (``autoshard ppo`` passes them through torchrun)."""
    parser.add_argument("--plan", required=True, help="plan JSON for this model and world size")
    parser.add_argument("--model", default=PPORun.model,
                        help="MODEL: reference spec, package.module:factory, file.py:factory or HF config (default %(default)s)")
    parser.add_argument("--weights", default=None, help="HF safetensors directory of an HF config MODEL's initial weights")
    parser.add_argument("--task", default=PPORun.task, help="task name (default %(default)s)")
    parser.add_argument("--steps", type=int, default=PPORun.steps)
    parser.add_argument("--context", type=int, default=None, help="a reference model's positions (default 32)")
    parser.add_argument("--seed", type=int, default=PPORun.seed)
    parser.add_argument("--batch", type=int, default=PPORun.global_batch, help="prompts per step over all dp ranks")
    parser.add_argument("--metrics", default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-live", action="store_true")
    parser.add_argument("--profile", action="store_true", help="record one step's Chrome trace per rank next to --metrics")
    parser.add_argument("--no-rollout-cache", action="store_true",
                        help="sample by recomputing prefixes through the sharded program (no rollout copy of the weights)")
    parser.add_argument("--compile", choices=[mode.value for mode in Compile], default=PPORun.compile,
                        help="compile the programs on fixed padded shapes (auto: on a GPU; default %(default)s)")
    add_rl_arguments(parser)


def run_from_args(args: argparse.Namespace) -> PPORun:
    """The ``PPORun`` of parsed worker flags."""
    return PPORun(
        model=args.model, weights=args.weights, task=args.task, steps=args.steps, seed=args.seed,
        global_batch=args.batch, metrics=args.metrics, checkpoint=args.checkpoint, save_every=args.save_every,
        resume=args.resume, plot=args.plot, live=not args.no_live, rollout_cache=not args.no_rollout_cache,
        profile=args.profile, data=source_from_args(args), rl=options_from_args(args), context=args.context,
        compile=args.compile,
    )


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``python -m autoshard.runtime.ppo_program --plan PLAN.json ...`` on every torchrun rank."""
    parser = argparse.ArgumentParser(prog="python -m autoshard.runtime.ppo_program", description=__doc__.split("\n\n")[0])
    worker_arguments(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    plan = Plan.load(args.plan)
    created = init_distributed(plan)
    try:
        run_ppo(run_from_args(args), plan, device=worker_device())
    except AutoshardError as err:
        record_rank_error(err)  # to the launcher, which prints it once for all ranks (runtime/launch.py)
        return 2
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


__all__ = [
    "MODEL_MAX_SEQ_LEN",
    "GroupReducer",
    "PPORun",
    "PolicyModel",
    "ProgramEngine",
    "build_engines",
    "build_policy_model",
    "capture_policy",
    "check_policy_vocab",
    "check_same_weights",
    "init_distributed",
    "load_policy",
    "policy_context",
    "policy_vocab",
    "ppo_config",
    "reseed",
    "rollout_cache_unsupported",
    "run_from_args",
    "run_ppo",
    "sharded_trainer",
    "train_loop",
    "worker_arguments",
    "worker_device",
    "worker_main",
]


if __name__ == "__main__":
    # Leave without the interpreter's teardown: under load a rank aborted there after a clean run
    # ("terminate called without an active exception", SIGABRT from a C++ thread destroyed at exit),
    # which torchrun reports as a failed run. Outputs are written and the process group destroyed by now.
    code = worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
