"""Pipeline execution of a ``PipelineSplit``: training steps with ``torch.distributed.pipelining`` schedules, and inference.

``PipelineEngine(split, ctx, schedule)`` owns this rank's stages
(``passes/split_pipeline.py``: stage ``k`` on pp rank ``k % pp``) and runs:

* ``train_step(tokens, loss_fn)``: one ``PipelineStage`` per local stage and
  the plan's schedule (``gpipe`` → ``ScheduleGPipe``, ``1f1b`` →
  ``Schedule1F1B``, ``interleaved_1f1b`` → ``ScheduleInterleaved1F1B``) over
  ``num_micro_batches`` micro-batches of the rank's local batch (or the
  caller's count: PPO's, ``runtime/ppo_program.py``). The user
  inputs reach every stage as keyword arguments (split into micro-batches by
  the schedule) and the last stage calls ``loss_fn(outputs, micro_tokens)``
  (``target=`` of ``schedule.step``). Each micro-batch loss is divided by
  ``m`` before backward (``scale_grads=False``), which is the single-stage
  program's convention: gradients = d(mean of micro-batch losses). Returns
  that mean on every pp rank (the last stage's value, all-reduced over pp
  with zeros elsewhere). ``mean=False`` back-propagates each micro-batch
  loss as it is (PPO's losses are shares of a globally normalised sum).
* ``forward(tokens)``: inference without autograd: stages run in order
  0..K-1, activations sent point-to-point to the next stage's pp rank, and
  the model outputs broadcast from the last stage, so every rank returns the
  full outputs (what a PPO rollout needs). It is a serial pass (no
  micro-batching): K stage latencies per call.

Decisions: stage input/output shapes are given to ``PipelineStage``
statically (``input_args``/``output_args``), evaluated from the symbolic
shapes the export recorded for the concrete micro-batch (no metadata
round-trip; schedules are cached per micro-batch shape, so a new sequence
length builds new stages). Every stage returns a flat tuple of tensors, the
last one the model's tensor output leaves, rebuilt in the model's own output
structure (a dict, a ``ModelOutput``, a dataclass, ...; constant leaves put back:
``PipelineSplit.outputs``) before ``loss_fn`` and ``forward`` see them.
Floating boundary tensors travel in the compute dtype. Eager, the ZeRO-3 re-gather hooks
(``passes/recompute.py``) wrap every stage forward, and are reset after the
step. Stage ranks exchange activations on the ``pp`` process group of their
(dp, tp) coordinate; ZeRO/TP collectives inside a stage use groups whose ranks
all run the same stage in lockstep. A parameter used on several pp ranks (a
tied embedding and LM head: ``PipelineLayout.shared``) is sent from its owner
to its mirrors before every ``train_step`` and ``forward``, and the mirrors'
gradients are sent back and added into the owner's after the step's backward
(``passes/split_pipeline.py``, [Note: parameters shared between pp ranks]),
point-to-point on the same group, in the layout's order on every rank.

Compiled stages (``BuildOptions.compile``, ``compile``): each local
stage (each virtual stage too) is its own ``torch.compile`` module with the
options of the pp = 1 path (``dynamic=False``, ``BuildOptions.regions`` per stage);
the schedule calls it once per micro-batch and runs autograd from its outputs,
through the compiled backward. Its ZeRO-3 gathers are functional collectives
of its graph, re-gathered in its backward (``passes/_zero3.py`` note "compiled
gather"; no hooks). One graph per stage, region and grad mode: a micro-batch
shape compiles once for training, ``forward`` once more.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from autoshard.errors import PlanError
from autoshard.passes.context import RankContext
from autoshard.passes.split_pipeline import PipelineSplit
from autoshard.plan import Schedule
from autoshard.kernels import collectives

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
# torch >= 2.12 can skip merging the last stage's outputs, which a training step does not use.
_NO_OUTPUTS = {"return_outputs": False} if "return_outputs" in inspect.signature(ScheduleGPipe.step).parameters else {}
# Schedules kept per (micro-batch count, shape); the least recently used beyond this are dropped with their
# stages' buffers. A training run has one shape; a PPO run one per response length.
SCHEDULE_CACHE_SIZE = 8


class _StageForward(nn.Module):
    """A stage submodule, or its compiled form (``run``), inside the ZeRO-3 re-gather hooks (eager programs with them)."""

    def __init__(self, stage: nn.Module, regather: nn.Module | None) -> None:
        super().__init__()
        self.stage = stage
        self.regather = [regather]  # a list: not a registered child (it is not this stage's module)
        self.run: list[Callable] = [stage]  # what forward calls: the stage or its compiled form (a list, as above)

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        regather, run = self.regather[0], self.run[0]
        if regather is None:
            return run(*args, **kwargs)
        with regather.hooks():
            return run(*args, **kwargs)


class PipelineEngine:
    """Runs this rank's pipeline stages (module docstring)."""

    def __init__(self, split: PipelineSplit, ctx: RankContext, schedule: Schedule, regather: nn.Module | None) -> None:
        if schedule.name not in SCHEDULES:
            raise PlanError(f"pipeline schedule {schedule.name!r}: allowed {tuple(SCHEDULES)}; choose one of them")
        self.split, self.ctx, self.schedule = split, ctx, schedule
        self.layout = split.layout
        self.regather = regather
        self.group = collectives._group(ctx.group("pp"))
        self.stages = {k: _StageForward(split.stage(k), regather) for k in self.layout.local_stages}
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()

    def compile(self, compile_fn: Callable[[nn.Module], Callable]) -> None:
        """Run every local stage as ``compile_fn(stage)`` (``torch.compile``; module docstring)."""
        if self.regather is not None:
            raise RuntimeError("compiled stages run without re-gather hooks: build the program with ctx.compiled")
        for wrapper in self.stages.values():
            wrapper.run[0] = compile_fn(wrapper.stage)

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss and the outputs)."""
        return self.layout.num_stages - 1 in self.layout.local_stages

    def _global_rank(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.layout.rank_of(stage))

    def _stage_args(self, k: int, inputs: dict[str, torch.Tensor], outputs: bool) -> tuple[torch.Tensor, ...]:
        """Empty example tensors of stage ``k``'s positional inputs (or, ``outputs``, of what it sends on)."""
        if outputs and k == self.layout.num_stages - 1:
            vals, shapes = self.split.output_vals, self.split.output_shapes(inputs)
        else:
            j = k + 1 if outputs else k
            vals, shapes = self.split.boundary_vals[j], self.split.boundary_shapes(j, inputs)
        # requires_grad marks what carries gradients back: the stage's recv buffers copy it.
        return tuple(
            torch.empty(s, dtype=self._dtype(v), device=self.ctx.device).requires_grad_(v.dtype.is_floating_point)
            for v, s in zip(vals, shapes)
        )

    def _dtype(self, val: torch.Tensor) -> torch.dtype:
        return self.ctx.compute_dtype if val.dtype.is_floating_point else val.dtype

    def _build(self, micro: dict[str, torch.Tensor], m: int, loss_fn: Callable) -> Any:
        stages = [
            PipelineStage(
                self.stages[k],
                k,
                self.layout.num_stages,
                torch.device(self.ctx.device),
                input_args=self._stage_args(k, micro, outputs=False),
                output_args=self._stage_args(k, micro, outputs=True),
                group=self.group,
            )
            for k in self.layout.local_stages
        ]
        cls = SCHEDULES[self.schedule.name]
        try:
            return cls(stages if cls is ScheduleInterleaved1F1B else stages[0], m, loss_fn=loss_fn, scale_grads=False)
        except ValueError as err:  # the schedule's own limits on m (1F1B: m >= stages; interleaved: rounds)
            raise PlanError(f"pipeline schedule {self.schedule.name!r} with {m} micro-batches: {err}; pass a batch "
                            "whose rows split into a count the schedule takes, or choose another schedule") from err

    def train_step(self, inputs: dict[str, torch.Tensor], target: torch.Tensor, loss_fn: Callable, *,
                   num_micro_batches: int | None = None, mean: bool = True) -> torch.Tensor:
        """Forward + backward of every micro-batch; the mean micro-batch loss on every pp rank ([] fp32).

        ``num_micro_batches``: how many micro-batches the rows split into (default: the plan's).
        ``mean=False``: each micro-batch's ``loss_fn`` is back-propagated as it is, not divided by m (a
        caller whose losses are already shares of a normalised sum, as PPO's), and the sum is returned.
        """
        m = num_micro_batches or self.schedule.num_micro_batches
        micro = {name: t.chunk(m, 0)[0] for name, t in inputs.items()}
        key = (m, *((name, tuple(t.shape)) for name, t in sorted(micro.items())))
        # The schedule keeps the loss function it was built with: route it through a mutable cell.
        self._loss_fn = (lambda out, tgt: loss_fn(out, tgt) / m) if mean else loss_fn
        if key not in self._schedules:
            self._schedules[key] = self._build(micro, m, lambda out, tgt: self._loss_fn(self._outputs(out), tgt))
            if len(self._schedules) > SCHEDULE_CACHE_SIZE:  # every pp rank sees the same shapes: same eviction
                self._schedules.popitem(last=False)
        self._schedules.move_to_end(key)
        losses: list[torch.Tensor] = []
        kwargs = {name: t.to(self.ctx.device) for name, t in inputs.items()}
        step_kw = dict(target=target.to(self.ctx.device), losses=losses) if self.is_last else {}
        self._refresh_mirrors()
        self._schedules[key].step(**kwargs, **step_kw, **_NO_OUTPUTS)
        if self.regather is not None:
            self.regather.reset()
        self._reduce_mirror_grads()
        total = torch.zeros(1, dtype=torch.float32, device=self.ctx.device)
        if self.is_last:
            total += sum(loss.detach().float() for loss in losses)
        return collectives.all_reduce(total, self.group, "sum")[0]

    @torch.no_grad()
    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """Model outputs for ``inputs`` on every pp rank (serial stage order; module docstring)."""
        inputs = {name: t.to(self.ctx.device) for name, t in inputs.items()}
        self._refresh_mirrors()
        carry: tuple[torch.Tensor, ...] = ()
        out = None
        for k in range(self.layout.num_stages):
            here = k in self.stages
            if here and k > 0 and k - 1 not in self.stages:
                carry = self._recv(self._stage_args(k, inputs, outputs=False), k - 1)
            if here:
                out = self.stages[k](*carry, **inputs)
                carry = out if isinstance(out, tuple) else (out,)
                if k + 1 < self.layout.num_stages and k + 1 not in self.stages:
                    for t in carry:
                        dist.send(t.contiguous(), self._global_rank(k + 1), group=self.group)
        if self.regather is not None:
            self.regather.reset()
        return self._broadcast_outputs(out, inputs)

    # ------------------------------------------------------------------ parameters shared between pp ranks

    def _refresh_mirrors(self) -> None:
        """Copy each shared parameter's values from its owner into its mirrors (module docstring)."""
        me = self.layout.pp_rank
        for shared in self.layout.shared:
            if me == shared.owner:
                values = self.split.stage_parameter(shared.fqn).detach().contiguous()
                for mirror in shared.mirrors:
                    dist.send(values, dist.get_global_rank(self.group, mirror), group=self.group)
            elif me in shared.mirrors:
                param = self.split.stage_parameter(shared.fqn)
                buffer = torch.empty_like(param.detach(), memory_format=torch.contiguous_format)
                dist.recv(buffer, dist.get_global_rank(self.group, shared.owner), group=self.group)
                with torch.no_grad():
                    param.copy_(buffer)

    def _reduce_mirror_grads(self) -> None:
        """Add every mirror's gradient into its owner's (zeros for a mirror that got none); mirrors keep none."""
        me = self.layout.pp_rank
        for shared in self.layout.shared:
            param = self.split.stage_parameter(shared.fqn) if me == shared.owner or me in shared.mirrors else None
            if me == shared.owner:
                for mirror in shared.mirrors:
                    buffer = torch.empty_like(param.detach(), memory_format=torch.contiguous_format)
                    dist.recv(buffer, dist.get_global_rank(self.group, mirror), group=self.group)
                    param.grad = buffer if param.grad is None else param.grad.add_(buffer)
            elif me in shared.mirrors:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.send(grad.contiguous(), dist.get_global_rank(self.group, shared.owner), group=self.group)
                param.grad = None

    def _recv(self, buffers: tuple[torch.Tensor, ...], src_stage: int) -> tuple[torch.Tensor, ...]:
        for t in buffers:
            dist.recv(t, self._global_rank(src_stage), group=self.group)
        return buffers

    def _outputs(self, leaves: tuple[torch.Tensor, ...]) -> Any:
        """The model's outputs from the last stage's flat tuple of leaves (``passes/split_pipeline.py``)."""
        return self.split.outputs(leaves)

    def _broadcast_outputs(self, out: Any, inputs: dict[str, torch.Tensor]) -> Any:
        last = self.layout.num_stages - 1
        leaves = out if self.is_last else self._stage_args(last, inputs, outputs=True)
        for t in leaves:
            dist.broadcast(t, self._global_rank(last), group=self.group)
        return self._outputs(leaves)


__all__ = ["SCHEDULES", "PipelineEngine"]
