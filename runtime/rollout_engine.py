"""Rollout engine: the policy on a layout of its own, fed by a reshard of the trainer's weights.

Sampling through the sharded ``Program`` has no KV cache: each decode step
re-runs the whole prefix, so a response of R tokens after a prompt of P costs
Σ_t (P + t) ≈ R·P + R²/2 token-forwards instead of P + R. As verl and OpenRLHF
do, rollout instead runs on an inference copy of the policy that receives the
trainer's weights once per PPO step; unlike them, the copy's layout is chosen
by the search together with the training plan (``search/rollout.py``) and is
itself sharded:

1. **Layout** (``RolloutEngine.for_program(program, model, tp=r)``): groups of
   ``r`` consecutive ranks, each holding a Megatron shard of degree r of the
   policy (``runtime/rollout_tp.py``); r = 1 is a whole copy per rank. The
   default (a plan without a rollout section) is the training plan's tp.
2. **Reshard** (``RolloutEngine.sync``, the ``weight_sync`` metric phase). For
   every parameter, this rank's compute-dtype training shard
   (``ParamPlacement.local_shape``) is gathered over the axes the two layouts
   do not share, in the reverse order of ``ParamPlacement.shard``:

       ep gather   along ep_dim  over "ep"        (even chunks)
       ZeRO-3      along dp_dim  over "dp_shard"  (torch.chunk rule, uneven: pad to ceil(n/k), gather, trim)
       Megatron TP along tp_dim  over "tp"        (skipped when the rollout group is the training tp
                                                   group and both split the same dim: the shard is already this rank's)

   then this rank's rollout slice is cut and copied in. With pp > 1 the stage
   that owns a parameter cuts the slice and broadcasts it over the "pp" group
   (r divides a stage's ranks, so its pp peers hold the same slice). One
   parameter at a time: the transient is one gathered tensor, never the model;
   nothing goes through the host. Every rank receives the bytes of the
   parameters it lacks once (``search/rollout.py`` prices the same steps).
3. **Sampling** (``generate``): a group whose members draw different prompts
   (different data-parallel coordinates of the training plan) all-gathers them,
   samples the union as one batch through the sharded replica with its own KV
   cache, and each member keeps its rows. The group's random generator is
   seeded from its first member's; a group whose members share their prompts
   samples with the caller's generator, exactly as one rank would.

[Note: staleness]
``ProgramEngine`` bumps a weights version on every optimizer step and state
load; ``sync(version)`` is a no-op when the replica already holds that
version, so calling it both from the trainer (timed) and lazily from
``new_cache`` (safety) costs one sync per step. Every rank of the job must
call ``sync`` together (it holds collectives); rollout runs on every rank at
the same time, so the lazy path is collective-safe.

[Note: rank consistency]
All-gather delivers bitwise-identical tensors to every rank of a group, and
all-reduce (ring: the reduced chunks are copied out) identical sums, so the
members of a rollout group, fed the same tokens with the same generator, draw
the same tokens and stop at the same step.

Memory per rank: the rollout shard in the compute dtype, its KV cache while
sampling, one gathered parameter during the reshard (priced in
``search/rollout.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import PlanError
from autoshard.passes.context import ParamPlacement, RankContext, chunk_size, coords_of
from autoshard.kernels import collectives
from autoshard.runtime.rollout import Rollout, SamplingConfig, generate
from autoshard.runtime.rollout_graph import DecodeGraph
from autoshard.runtime.rollout_tp import build_sharded_replica, new_cache, rollout_refusal

log = logging.getLogger(__name__)


def unshard(local: torch.Tensor, placement: ParamPlacement, ctx: RankContext, *, keep_tp: bool = False) -> torch.Tensor:
    """The global tensor of ``local`` (this rank's shard under ``placement``); collective over its sharded axes.

    Inverse of ``ParamPlacement.shard``: every rank of the involved groups must
    call it with its own shard. local [local_shape] → [global_shape]; with
    ``keep_tp`` the tp split is kept (this rank's tp shard of the global tensor).
    """
    full = local.detach()
    if placement.ep_dim is not None and ctx.size("ep") > 1:
        full = collectives.all_gather(full, placement.ep_dim, ctx.group("ep"))
    if placement.dp_dim is not None and ctx.size("dp_shard") > 1:
        full = _gather_uneven(full, placement, ctx)
    if placement.tp_dim is not None and ctx.size("tp") > 1 and not keep_tp:
        tp, parts, dim = ctx.size("tp"), getattr(placement, "tp_parts", 1), placement.tp_dim
        full = collectives.all_gather(full, dim, ctx.group("tp"))  # rank-major
        if parts > 1:  # a fused projection: each rank held its block of every part; make it part-major
            full = full.unflatten(dim, (tp, parts, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    if not keep_tp:
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
    """The policy on its rollout layout, synced from a sharded ``Program`` (module docstring).

    ``program``: the policy's per-rank ``Program``. ``replica``: the rollout
    model; its ``named_parameters`` names match the program's parameter FQNs.
    ``tp``/``group``/``dims``: the rollout group (``None`` for tp = 1) and each
    parameter's split dim (``runtime/rollout_tp.py``); the defaults are a
    whole copy.
    """

    def __init__(self, program: Any, replica: nn.Module, *, tp: int = 1, group: str | None = None,
                 dims: dict[str, int | None] | None = None, model: nn.Module | None = None,
                 graphs: bool | None = None) -> None:
        self.program, self.replica, self.tp, self.group = program, replica, tp, group
        self.model = model if model is not None else replica
        self._targets = dict(replica.named_parameters())
        self.dims = dims if dims is not None else {name: None for name in self._targets}
        ctx = program.ctx
        self.rank_in_group = ctx.rank % tp
        self._keep_tp = tp > 1 and tp == ctx.size("tp")  # the rollout group is the training tp group
        self._owner = self._owners()
        self._members = [ctx.rank - self.rank_in_group + i for i in range(tp)]
        keys = [_prompt_key(rank, ctx) for rank in self._members]
        self._unique = sorted(set(keys), key=keys.index)  # distinct prompt draws in the group, in rank order
        self._first_of = [keys.index(k) for k in self._unique]
        self._slot = self._unique.index(keys[self.rank_in_group])
        self.synced_version: int | None = None
        self.syncs = 0
        self.bytes_received = 0
        on_gpu = torch.device(ctx.device).type == "cuda"
        self.graphs = on_gpu and os.environ.get("AUTOSHARD_ROLLOUT_GRAPHS", "1") != "0" if graphs is None else graphs
        self._cache: Any = None  # the cache of the last (batch, length), kept so its decode graph can replay
        self._graph: Any = None

    @classmethod
    def for_program(cls, program: Any, model: nn.Module, tp: int | None = None) -> "RolloutEngine":
        """A rollout replica of ``model`` on ``tp`` ranks per group (default: the plan's tp), on the program's
        device in its compute dtype. Creates the rollout groups when they are not the training tp groups
        (collective over the world: every rank calls it together)."""
        ctx = program.ctx
        tp = ctx.size("tp") if tp is None else tp
        if tp > 1 and rollout_refusal(model, tp):  # the plan's tp may not suit the replica: a whole copy
            tp = 1
        group = _rollout_group(ctx, tp)
        replica, dims = build_sharded_replica(model, tp, ctx.rank % tp, group, device=ctx.device,
                                              dtype=ctx.compute_dtype)
        return cls(program, replica, tp=tp, group=group, dims=dims, model=model)

    def _owners(self) -> dict[str, int]:
        """Pipeline stage (pp coordinate) owning each replica parameter; all 0 without a pipeline."""
        ctx = self.program.ctx
        local = sorted(self.program.optimizer.slots)
        missing = sorted(set(local) - set(self._targets))
        assert not missing, f"program parameters the replica lacks: {missing[:5]}"
        if ctx.size("pp") == 1:
            absent = sorted(set(self._targets) - set(local))
            assert not absent, f"replica parameters the program lacks: {absent[:5]}"
            return {name: 0 for name in self._targets}
        gathered: list[Any] = [None] * ctx.size("pp")
        dist.all_gather_object(gathered, (ctx.coord("pp"), local), group=collectives._group(ctx.group("pp")))
        owner = {name: stage for stage, names in gathered for name in names}
        absent = sorted(set(self._targets) - set(owner))
        assert not absent, f"replica parameters no stage holds: {absent[:5]}"
        return owner

    @torch.no_grad()
    def sync(self, version: int) -> bool:
        """Reshard the program's current weights into the replica unless it holds ``version``; True when it did.

        Collective over the program's ep / dp_shard / tp (and pp) groups: every rank calls it together.
        """
        if self.synced_version == version:
            return False
        ctx, placements, slots = self.program.ctx, self.program.param_placements, self.program.optimizer.slots
        pp_group = collectives._group(ctx.group("pp")) if ctx.size("pp") > 1 else None
        for fqn, target in self._targets.items():
            if fqn in slots:
                piece = self._slice(slots[fqn].param, placements[fqn], self.dims[fqn])
                target.copy_(piece)
            if pp_group is not None:
                source = dist.get_global_rank(pp_group, self._owner[fqn])
                dist.broadcast(target, src=source, group=pp_group)
        self.synced_version = version
        self.syncs += 1
        return True

    def _slice(self, local: torch.Tensor, placement: ParamPlacement, dim: int | None) -> torch.Tensor:
        """This rank's rollout slice of the parameter whose training shard is ``local``."""
        keep = self._keep_tp and placement.tp_dim is not None and placement.tp_dim == dim \
            and getattr(placement, "tp_parts", 1) == 1
        if keep:
            return unshard(local, placement, self.program.ctx, keep_tp=True)
        full = unshard(local, placement, self.program.ctx)
        if dim is None:
            return full
        size = full.shape[dim] // self.tp
        return full.narrow(dim, self.rank_in_group * size, size)

    def forward(self, tokens: torch.Tensor, cache: Any, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, S] at positions start_pos.. → (logits [B, S, V], values [B, S]) through the replica; one-token
        steps on a GPU replay the captured decode step (``runtime/rollout_graph.py``)."""
        tokens = tokens.to(self.program.ctx.device)
        if self.graphs and cache is not None and cache is self._cache and tokens.shape[1] == 1:
            graph = self._decode_graph(tokens.shape[0])
            if graph is not None:
                return graph.run(tokens, start_pos)
        return self.replica(tokens, cache=cache, start_pos=start_pos)

    def _decode_graph(self, batch: int) -> Any:
        """The decode graph of the current cache, captured at its first step; None (eager) if capture fails."""
        if self._graph is None or self._graph.cache is not self._cache:
            try:
                self._graph = DecodeGraph(self.replica, self._cache, batch, self.program.ctx.device)
            except Exception as err:  # noqa: BLE001 - any capture failure: decode eagerly, say why once
                log.warning("rollout: decoding eagerly, the CUDA graph capture failed: %s", str(err).splitlines()[0])
                self.graphs, self._graph = False, None
        return self._graph

    def new_cache(self, batch: int, max_len: int) -> Any:
        """An empty KV cache of the replica (its local key/value heads) for ``batch`` sequences of ``max_len``;
        with decode graphs, the same cache for the same shape (its stale entries are masked and overwritten)."""
        ctx = self.program.ctx
        cache = self._cache
        if not self.graphs or cache is None or cache.max_len != max_len or cache.keys[0].shape[0] != batch:
            cache = new_cache(self.model, self.tp, batch, max_len, device=ctx.device, dtype=ctx.compute_dtype)
        self._cache = cache if self.graphs else None
        return cache

    @torch.no_grad()
    def generate(self, sampler: Any, prompts: torch.Tensor, sampling: SamplingConfig, *, eos_id: int, pad_id: int,
                 generator: torch.Generator | None = None) -> Rollout:
        """Sample one response per row of ``prompts`` [n, P] on the rollout layout (module docstring, 3).

        ``sampler``: what decodes (the policy engine, whose ``forward(cache=)`` runs this replica and keeps
        the task's logits). Collective over the rollout group when its members draw different prompts.
        """
        if len(self._unique) == 1:
            return generate(sampler, prompts, sampling, eos_id=eos_id, pad_id=pad_id, generator=generator)
        n = prompts.shape[0]
        shape = torch.tensor(prompts.shape, device=prompts.device)
        shapes = collectives.all_gather(shape[None], 0, self.group)
        if not bool((shapes == shape).all()):
            raise RuntimeError(f"rollout group ranks {self._members} hold prompt batches of shapes "
                               f"{shapes.tolist()}; they must match to be sampled together")
        every = collectives.all_gather(prompts.contiguous(), 0, self.group).view(self.tp, n, -1)
        batch = torch.cat([every[i] for i in self._first_of])  # [u·n, P]
        group_generator = self._group_generator(generator, prompts.device)
        out = generate(sampler, batch, sampling, eos_id=eos_id, pad_id=pad_id, generator=group_generator)
        rows = slice(self._slot * n, (self._slot + 1) * n)
        return Rollout(prompts, out.responses[rows], out.response_mask[rows], out.sample_logprobs[rows])

    def _group_generator(self, generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
        """A generator equal on every member: seeded with a draw of the group's first member's generator."""
        draw = torch.randint(0, 2**62, (1,), generator=generator, device=generator.device if generator else device)
        seed = collectives.all_gather(draw.to(device), 0, self.group)[0]
        return torch.Generator(device=device).manual_seed(int(seed))


def _prompt_key(rank: int, ctx: RankContext) -> int:
    """What decides the prompts ``rank`` draws: its coordinate in the training plan's data-parallel group."""
    coords = coords_of(rank, ctx.mesh)
    return coords["dp_replicate"] * ctx.mesh.dp_shard + coords["dp_shard"]


def _rollout_group(ctx: RankContext, tp: int) -> str | None:
    """Name of this rank's rollout group of ``tp`` consecutive ranks (the training tp group when it is one)."""
    if tp == 1:
        return None
    if tp == ctx.size("tp"):
        return ctx.group("tp")
    if (ctx.world_size // ctx.size("pp")) % tp:
        raise PlanError(f"rollout tp={tp} must divide the ranks of one pipeline stage "
                         f"({ctx.world_size // ctx.size('pp')})")
    mine = None
    for first in range(0, ctx.world_size, tp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + tp)))
        if first <= ctx.rank < first + tp:
            mine = group.group_name
    return mine


__all__ = ["RolloutEngine", "build_replica", "unshard"]
