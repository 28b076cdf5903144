"""Hand-written baselines that ``benchmarks/run.py`` measures autoshard against (docs/benchmarks.md).

| module | trainer | what it is |
| --- | --- | --- |
| ``fsdp2`` | ``FSDP2Trainer`` | ``fully_shard`` per block + root, bf16 ``MixedPrecisionPolicy``, reshard after forward or not |
| ``megatron`` | ``MegatronTPTrainer`` | Megatron-Core Column/RowParallelLinear TP (+ sequence parallel); GPU only |
| ``deepspeed_zero`` | ``DeepSpeedTrainer`` | ``deepspeed.initialize`` with ZeRO stage 2 or 3 |
| ``autoshard_trainer`` | ``AutoshardTrainer`` | autoshard's ``build_program`` for a plan, driven the same way |

Every trainer takes a ``common.RunSpec``, starts from the same seeded weights,
uses ``common.policy_loss`` and exposes ``step(global_tokens) -> loss``.
Megatron-Core and DeepSpeed are imported only when their trainer is built, so
this package imports without them.
"""

from benchmarks.baselines.common import BaselineError, BaselineUnavailable, RunSpec, policy_loss

__all__ = ["BaselineError", "BaselineUnavailable", "RunSpec", "policy_loss"]
