"""Rollout engine: an eager full replica of the policy, fed by a weight sync from the sharded ``Program``.

Sampling through the sharded ``Program`` has no KV cache: each decode step
re-runs the whole prefix, so a response of R tokens after a prompt of P costs
Σ_t (P + t) ≈ R·P + R²/2 token-forwards instead of P + R. As verl and OpenRLHF
do, rollout instead runs on a separate inference copy of the policy that
receives the trainer's weights once per PPO step:

1. **Weight sync** (``RolloutEngine.sync``, the ``weight_sync`` metric phase).
   For every parameter, this rank's compute-dtype shard (the ``Program``'s
   parameter at ``ParamPlacement.local_shape``) is un-sharded in the reverse
   order of ``ParamPlacement.shard``:

       ep gather   along ep_dim  over "ep"        (even chunks)
       ZeRO-3      along dp_dim  over "dp_shard"  (torch.chunk rule, uneven: pad to ceil(n/k), gather, trim)
       Megatron TP along tp_dim  over "tp"        (even chunks)

   and copied into the replica's parameter. Cost per step: one all-gather per
   sharded parameter and mesh axis (``runtime/collectives.all_gather``), i.e.
   every rank receives the model's bytes once in the compute dtype; replicated
   parameters are copied locally. The gathered values are exactly what the
   ``Program`` computes with, so the replica's logits equal the ``Program``'s up
   to the numerics of cached vs full attention.
2. **Sampling** (``forward(tokens, cache=, start_pos=)``, ``new_cache``): the
   model's own KV cache (``autoshard.models.layers.KVCache``); the prompt is fed
   once, then one token per step.

[Note: staleness]
``ProgramEngine`` bumps a weights version on every optimizer step and state
load; ``sync(version)`` is a no-op when the replica already holds that
version, so calling it both from the trainer (timed) and lazily from
``new_cache`` (safety) costs one sync per step. Every rank of the job must
call ``sync`` together (it holds collectives); rollout runs on every rank at
the same time, so the lazy path is collective-safe.

[Note: rank consistency]
All-gather delivers bitwise-identical full weights to every rank of a tp group
(and of a dp_shard group), and each rank runs the same eager replica on the
same prompts with the same generator seed (``ppo_program.reseed``), so the tp
ranks of one dp coordinate sample identical tokens.

Limitation (memory): the replica is a full, unsharded copy of the policy on
every rank, in the compute dtype, plus its KV cache. Models whose full weights
do not fit next to their training shards need a TP-sharded rollout engine
(future work; opt out with ``rollout_cache=False`` / ``--no-rollout-cache``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard.passes.context import ParamPlacement, RankContext, chunk_size
from autoshard.runtime import collectives


def unshard(local: torch.Tensor, placement: ParamPlacement, ctx: RankContext) -> torch.Tensor:
    """The global tensor of ``local`` (this rank's shard under ``placement``); collective over its sharded axes.

    Inverse of ``ParamPlacement.shard``: every rank of the involved groups must
    call it with its own shard. local [local_shape] → [global_shape].
    """
    full = local.detach()
    if placement.ep_dim is not None and ctx.size("ep") > 1:
        full = collectives.all_gather(full, placement.ep_dim, ctx.group("ep"))
    if placement.dp_dim is not None and ctx.size("dp_shard") > 1:
        full = _gather_uneven(full, placement, ctx)
    if placement.tp_dim is not None and ctx.size("tp") > 1:
        tp, parts, dim = ctx.size("tp"), getattr(placement, "tp_parts", 1), placement.tp_dim
        full = collectives.all_gather(full, dim, ctx.group("tp"))  # rank-major
        if parts > 1:  # a fused projection: each rank held its block of every part; make it part-major
            full = full.unflatten(dim, (tp, parts, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    assert tuple(full.shape) == placement.global_shape, (placement.fqn, full.shape, placement.global_shape)
    return full


def _gather_uneven(local: torch.Tensor, placement: ParamPlacement, ctx: RankContext) -> torch.Tensor:
    """Undo the ZeRO-3 ``torch.chunk`` split of ``dp_dim`` over dp_shard (pad each chunk to ceil(n/k), gather, trim)."""
    dim, k = placement.dp_dim, ctx.size("dp_shard")
    size = placement.global_shape[dim]
    if placement.tp_dim == dim:
        size //= ctx.size("tp")  # tp split first, then ZeRO-3 (ParamPlacement.shard)
    piece = chunk_size(size, k)
    pad = piece - local.shape[dim]
    if pad:
        padding = local.new_zeros((*local.shape[:dim], pad, *local.shape[dim + 1 :]))
        local = torch.cat([local, padding], dim)
    return collectives.all_gather(local.contiguous(), dim, ctx.group("dp_shard")).narrow(dim, 0, size)


def build_replica(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """An uninitialised copy of ``model``'s architecture (same class and config) on ``device`` in ``dtype``.

    Built on ``meta`` and materialised with ``to_empty`` (no initialisation
    cost); its weights are garbage until the first ``RolloutEngine.sync``.
    """
    with torch.device("meta"):
        replica = type(model)(model.config)
    replica = replica.to(dtype).to_empty(device=device)
    replica.tie_weights()
    replica.requires_grad_(False)
    return replica.eval()


class RolloutEngine:
    """Eager full replica of a sharded ``Program``'s model for KV-cached sampling (module docstring).

    ``program``: the policy's per-rank ``Program`` (pp == 1). ``replica``: a
    model of the same architecture whose ``named_parameters`` names match the
    program's parameter FQNs (``build_replica``).
    """

    def __init__(self, program: Any, replica: nn.Module) -> None:
        self.program, self.replica = program, replica
        self._targets = dict(replica.named_parameters())
        sources = program.optimizer.slots
        missing = sorted(set(sources) ^ set(self._targets))
        assert not missing, f"replica and program parameters differ: {missing[:5]}"
        self.synced_version: int | None = None
        self.syncs = 0

    @classmethod
    def for_program(cls, program: Any, model: nn.Module) -> "RolloutEngine":
        """A replica of ``model`` (same class and config) on the program's device, in its compute dtype."""
        ctx = program.ctx
        return cls(program, build_replica(model, ctx.device, ctx.compute_dtype))

    @torch.no_grad()
    def sync(self, version: int) -> bool:
        """Copy the program's current weights into the replica unless it holds ``version``; True when it copied.

        Collective over the program's ep / dp_shard / tp groups: every rank calls it together.
        """
        if self.synced_version == version:
            return False
        ctx, placements = self.program.ctx, self.program.param_placements
        for fqn, slot in self.program.optimizer.slots.items():
            full = unshard(slot.param, placements[fqn], ctx)  # [global_shape], compute dtype
            self._targets[fqn].copy_(full)
        self.synced_version = version
        self.syncs += 1
        return True

    def forward(self, tokens: torch.Tensor, cache: Any, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] at positions start_pos.. → (logits [B, S, V], values [B, S]) through the replica."""
        return self.replica(tokens.to(self.program.ctx.device), cache=cache, start_pos=start_pos)

    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache of the replica for ``batch`` sequences of up to ``max_len`` tokens."""
        return self.replica.new_cache(batch, max_len)


__all__ = ["RolloutEngine", "build_replica", "unshard"]
