"""DeepSpeed ZeRO-2 / ZeRO-3 baseline: ``deepspeed.initialize`` with a config dict.

Config (``ds_config``): ``train_micro_batch_size_per_gpu = B/(world·m)``,
``gradient_accumulation_steps = m``, ``gradient_clipping = max_grad_norm``,
``bf16.enabled`` for bf16 runs (fp32 master weights inside the ZeRO optimizer),
``zero_optimization.stage`` 2 or 3 with overlapped communication and
contiguous gradients (DeepSpeed's recommended settings), and
``zero_allow_untested_optimizer``: the optimizer is the client
``torch.optim.AdamW`` of ``common.torch_optimizer`` rather than DeepSpeed's
``FusedAdam``, whose first use JIT-compiles a CUDA extension (needs ``nvcc``
and ~1 min; an air-gapped image may lack the toolchain).

The step: ``engine(micro)`` → ``policy_loss`` → ``engine.backward(loss)``
(DeepSpeed divides by ``gradient_accumulation_steps`` itself) → ``engine.step()``
for every micro-batch; the optimizer steps at the accumulation boundary. The
reported loss is the mean over micro-batches and ranks, as the other trainers'.

GPU path primary; DeepSpeed also runs on the CPU with gloo (PLATFORM_NOTES) but
JIT-builds C++ ops on first use (~35 s), so CI does not run it. Untested here
(no DeepSpeed in the CPU venv): first GPU run may need fixes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.baselines.common import (
    BaselineError,
    BaselineUnavailable,
    RunSpec,
    local_rows,
    mean_over,
    micro_batches,
    policy_loss,
    reference_model,
    torch_optimizer,
)


def ds_config(spec: RunSpec, world: int, stage: int) -> dict:
    """The DeepSpeed config dict of this run (module docstring)."""
    if stage not in (2, 3):
        raise BaselineError(f"DeepSpeed ZeRO stage={stage}: allowed (2, 3)")
    per_rank = spec.global_batch // world
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": 5e8}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=5e8, stage3_param_persistence_threshold=1e5)
    else:
        zero.update(allgather_bucket_size=5e8, reduce_scatter=True)
    return {
        "train_batch_size": spec.global_batch,
        "train_micro_batch_size_per_gpu": per_rank // spec.num_micro_batches,
        "gradient_accumulation_steps": spec.num_micro_batches,
        "gradient_clipping": spec.optimizer.max_grad_norm or 0.0,
        "bf16": {"enabled": spec.precision == "bf16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    """ZeRO-2/3 data-parallel training of a reference policy through a DeepSpeed engine."""

    def __init__(self, spec: RunSpec, device: torch.device, *, stage: int, name: str | None = None):
        try:
            import deepspeed
        except ImportError as err:
            raise BaselineUnavailable(f"deepspeed is not installed ({err}); install the carried wheel") from err
        self.name = name or f"deepspeed-z{stage}"
        self.spec, self.device = spec, device
        world = dist.get_world_size()
        local_rows(torch.empty(spec.global_batch, 1), world, 0)  # divisibility check, before any collective
        model = reference_model(spec, device)
        optimizer = torch_optimizer(model.parameters(), spec.optimizer)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=ds_config(spec, world, stage))
        self.last_grad_norm = float("nan")

    def step(self, global_tokens: torch.Tensor) -> float:
        """One optimizer step: every micro-batch through the engine (module docstring)."""
        rows = local_rows(global_tokens, dist.get_world_size(), dist.get_rank()).to(self.device)
        chunks = micro_batches(rows, self.spec.num_micro_batches)
        total = torch.zeros((), device=self.device)
        for micro in chunks:
            loss = policy_loss(self.engine(micro), micro)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float() / len(chunks)
        norm = self.engine.get_global_grad_norm()
        self.last_grad_norm = float(norm) if norm is not None else float("nan")
        return mean_over(total)

    def close(self) -> None:
        """Release the engine's partitioned parameters and optimizer state."""
        if hasattr(self.engine, "destroy"):  # DeepSpeed >= 0.14 frees ZeRO-3 hooks and buffers
            self.engine.destroy()
        del self.engine


__all__ = ["DeepSpeedTrainer", "ds_config"]
