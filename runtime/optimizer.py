"""Sharded optimizer: fp32 master shards, AdamW/SGD over local shards with ZeRO semantics, global-norm clipping.

Per parameter one ``_Slot`` holds the fp32 master, the moments and the
gradient reduction of its layer's ZeRO ``state`` (D = dp_replicate·dp_shard,
"dp" the combined group; ``avg`` = sum then ÷ group size, the mean of the
per-rank losses):

| state | master / moments layout | gradient sync after backward | after the update |
| --- | --- | --- | --- |
| replicate (DDP) | full local param | all-reduce(avg) over dp | copy master → compute param |
| zero1 | flat chunk 1/D | reduce-scatter(avg) over dp (quantized wire: all-reduce, keep own chunk) | all-gather chunks over dp → param |
| zero2 | flat chunk 1/D | reduce-scatter(avg) over dp | all-gather chunks over dp → param |
| zero3 | = the Shard(0) param shard | reduce-scatter(avg) over dp_shard in backward (graph); all-reduce(avg) over dp_replicate (HSDP) | copy master → shard |
| replicate + EP experts | the ep shard [E/ep, ...] | all-reduce(sum) over edp (dp ranks holding the same experts), ÷ D | copy master → compute param |
| offload | flat chunk 1/D on the host | reduce-scatter(avg), copy the chunk to the host | update on host, copy up, all-gather |

In-graph sync: a compiled program with one micro-batch on one stage all-reduces (mean over dp)
the gradients of its replicate / zero1 / zero2 parameters (unquantized wire) in its backward
graph, where they overlap the rest of the backward (``kernels/traced_collectives.py`` note
"gradient sync"); those slots take the gradient as reduced (flat slots keep their chunk) and
join no bucket. Same values as the reduce-scatter / all-reduce after backward.

Buckets (``runtime/_buckets.py``): the syncs above are not issued per
parameter. Slots with the same collective, group, op, dtype, device and an
unquantized wire ("none"/"fp32") are packed into flat buckets of about
``bucket_bytes`` (``plan.schedule.bucket_bytes``, 25 MiB default; 0 = one per
parameter), ONE all-reduce or reduce-scatter per bucket; after the update the
flat slots' chunks are re-gathered with ONE all-gather per bucket. The
reduce-scatter bucket is rank-major (row r = every member's chunk r), so each
rank still owns exactly its per-parameter flat chunk. Quantized wires
("int8"/"int4", per-tensor block scales) keep one qgZ per parameter. ZeRO-1
syncs like ZeRO-2 (reduce-scatter, half the all-reduce's bytes): the gradient
is still accumulated in full ``param.grad`` during backward, so in this runtime
ZeRO-1 and ZeRO-2 differ only in the quantized path.

Update and re-gather overlap: the flat slots are updated one gather bucket at a time, and each
bucket's all-gather is launched (``_buckets.all_gather_begin``: a side stream on CUDA) as soon
as its masters are updated, so it runs under the update of the following buckets; at most
``gathers_in_flight`` (2) gathers are alive, the oldest written into the compute params before
the next launch, so the step never holds a second copy of the parameters. The unreduced
``param.grad`` is freed as soon as the sync has reduced it. Same values as updating everything,
then gathering. Offloaded slots (masters on the host) are updated with the rest and gathered after.

Overlapped gradient sync (``enable_overlap``; ``Program`` turns it on with
``BuildOptions(overlap_grad_sync=True)`` when pp = 1, off by default because it was measured
slower on H100s, docs/runtime.md; DDP's ``Reducer`` does the same): a post-accumulate-grad hook on every bucketed parameter marks it
ready during the backward of the step's last micro-batch (``arm``); buckets are launched
(``_buckets.start``: packed, then the collective on a side stream) in one fixed order, the last
bucket first (backward produces the last layers' gradients first), each as soon as it and every
bucket before it in that order are ready, so every rank issues them in the same order. They run
under the rest of the backward; ``sync_grads`` completes them and reduces whatever was not
launched (a parameter without a gradient, and the HSDP all-reduce of ZeRO-3 shards, whose
``.grad`` a ``GradSink`` may still add to after autograd's accumulation fired the hook) with the
blocking path. Same packing, collective and values as the blocking path.

"Flat chunk": the parameter flattened, zero-padded to a multiple of D,
chunk ``coord("dp")``. The flat layout is internal: checkpoints see every state
at the parameter's local shape (``_Slot.local_state`` / ``load_state``: masters
through ``Program.local_state_dict``, AdamW moments through
``ShardedOptimizer.local_moments``), all-gathered over dp for flat slots, so
they carry the parameter's ``ParamPlacement`` and reshard like the weights. On
a CPU run the "host" is the same device; the code path is the real one:
separate host tensors, gradients copied down, params copied up.

Communication dtype of the gradient sync (``grad_comm`` per parameter, from
the ``quantize_comm`` pass via ``PassState.grad_comm``; the
values of ``runtime/quantized_collectives.GRAD_COMMS``): "none" (default)
reduces in the gradient's dtype as the table says; "fp32" upcasts, reduces and
rounds once; "int8"/"int4" use qgZ (``reduce_scatter_grad``: all-to-all of
quantized rank rows, local dequantize-and-sum in fp32) for the zero2/offload
reduce-scatter, and a qgZ reduce-scatter + quantized all-gather for the
all-reduces (HSDP's dp_replicate axis). Whatever the wire dtype, ``self.grad``
is fp32 and the masters stay fp32: quantization only changes what is sent.

Clipping (global norm, correct across shards): after sync each rank holds a
piece of each gradient that is replicated over some ranks; with ``rep(p)`` =
number of ranks holding the same piece (dp for DDP, dp_replicate for sharded
zero3, 1 for flat chunks; × tp when the param is not tp-split),

    ‖g‖² = all_reduce_sum_world( Σ_p ‖g_p,local‖² / rep(p) )

so every piece counts exactly once. Scale = min(1, max_norm / (‖g‖ + 1e-6)).

AdamW as ``torch.optim.AdamW`` (decoupled decay, bias-corrected, eps outside
the square root); SGD = plain ``p -= lr·g`` (+ decoupled decay). Learning rate
of the update with 0-based index k (``steps`` before it): ``lr · schedule.factor(k)``
(``autoshard.train.LRSchedule``: warm-up, then constant / linear / cosine), so the
schedule's position is ``steps``, which checkpoints save with the moments. Weight
decay applies to parameters whose global shape has two or more dims unless
``decay_norms_and_biases`` (``OptimizerConfig.decays``); the two groups are updated
by one kernel call each, the others with ``weight_decay=0``. The AdamW
update is ``torch.optim.AdamW(fused=True)``'s kernel (``torch._fused_adamw_``,
CUDA and CPU): one pass that reads master, gradient and both moments once and
writes them back, with no temporaries. The multi-tensor ``_foreach`` path
(``torch.optim``'s ``foreach``) is the fallback where the fused kernel is
missing; it makes about eight passes over the shard and allocates a
shard-sized ``denom`` (on a 1.3B model's ZeRO-2 half, ~2.6 GB), which is why
the fused kernel is the default (``update_kind``). The clipping norms and the write-back
of unflattened parameters run as multi-tensor kernels too: a few launches per
step instead of about ten per parameter, which made the step host-bound on GPUs
(about 390 parameters of a 1.3B GPT → ~4,000 optimizer kernels).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.passes.context import ParamPlacement, RankContext
from autoshard.kernels import collectives
from autoshard.runtime import _buckets
from autoshard.kernels.quantized_collectives import all_reduce_grad, reduce_scatter_grad
from autoshard.train import AdamW, LRSchedule, TrainSpec

FLAT_STATES = ("zero1", "zero2", "offload")
DEFAULT_BUCKET_BYTES = 25 * 2**20  # = Schedule.bucket_bytes default (DDP's bucket_cap_mb)
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's states per parameter, beside the fp32 master


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The runtime's resolved hyper-parameters (``from_train`` reads them from a ``TrainSpec``).

    name: "adamw" | "sgd"; lr: peak learning rate, scaled per step by ``schedule``
    (``autoshard.train.LRSchedule``); betas/eps: AdamW's; weight_decay: decoupled, applied to
    parameters of two or more dims only unless ``decay_norms_and_biases`` (1-D: norm gains,
    biases); max_grad_norm: global-norm clipping threshold, ``None`` disables clipping.
    """

    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    schedule: LRSchedule = field(default_factory=LRSchedule)
    decay_norms_and_biases: bool = False

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise AutoshardError(f"OptimizerConfig.name={self.name!r}: allowed ('adamw', 'sgd')")
        if not self.lr > 0:
            raise AutoshardError(f"OptimizerConfig.lr={self.lr!r}: must be > 0")

    @classmethod
    def from_train(cls, train: TrainSpec) -> OptimizerConfig:
        """The hyper-parameters ``train`` asks for: its optimizer, schedule and clipping."""
        spec = train.optimizer_config
        adam = {"betas": spec.betas, "eps": spec.eps} if isinstance(spec, AdamW) else {}
        return cls(name=spec.name, lr=spec.lr, weight_decay=spec.weight_decay, max_grad_norm=train.grad_clip,
                   schedule=train.lr_schedule, decay_norms_and_biases=spec.decay_norms_and_biases, **adam)

    def lr_at(self, step: int) -> float:
        """Learning rate of the step with 0-based index ``step`` (``step`` updates already taken)."""
        return self.lr * self.schedule.factor(step)

    def decays(self, global_shape: tuple[int, ...]) -> bool:
        """Whether weight decay applies to a parameter of ``global_shape`` (the same under every plan)."""
        return self.weight_decay > 0 and (self.decay_norms_and_biases or len(global_shape) >= 2)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-parameter optimizer states besides the master (what checkpoints save)."""
        return MOMENTS if self.name == "adamw" else ()


class _Slot:
    """One parameter's optimizer state and gradient reduction (module docstring table)."""

    def __init__(self, param: nn.Parameter, placement: ParamPlacement, master_local: torch.Tensor | None,
                 ctx: RankContext, grad_comm: str = "none", reduced_in_graph: bool = False):
        """``master_local``: the fp32 values at the parameter's local shape; ``None`` allocates the master
        uninitialised (``load_master`` fills it: sharded materialisation, ``runtime/materialize.py``).
        ``reduced_in_graph``: the compiled graph all-reduces this gradient (mean over dp) in backward."""
        self.param, self.placement, self.ctx = param, placement, ctx
        self.reduced_in_graph = reduced_in_graph
        self.grad_comm = grad_comm  # wire dtype of the gradient sync (module docstring)
        # a compiled ZeRO-1/2 layer held as a dim-0 shard (passes/context.py, gathers_in_graph) syncs as ZeRO-3
        self.flat = placement.state in FLAT_STATES and ctx.size("dp") > 1 and placement.dp_dim is None
        self.host = "cpu" if placement.state == "offload" else param.device
        self.numel = param.numel()
        if self.flat:
            self.chunk = -(-self.numel // ctx.size("dp"))
        if master_local is None:
            self.master = torch.empty(self.chunk if self.flat else param.shape, dtype=torch.float32, device=self.host)
        else:
            own = self._own_chunk(master_local.reshape(-1)) if self.flat else master_local
            self.master = own.detach().to(self.host, torch.float32).clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.grad: torch.Tensor | None = None

    def _own_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``flat`` zero-padded to ``chunk·dp``, as a new chunk-sized tensor: a view would
        keep the whole (padded) gradient alive through the update."""
        start = self.ctx.coord("dp") * self.chunk
        piece = flat[start:start + self.chunk]
        return F.pad(piece, (0, self.chunk - piece.numel())) if piece.numel() < self.chunk else piece.clone()

    @property
    def replication(self) -> int:
        """How many ranks hold the same piece of the synced gradient (clipping formula)."""
        ctx, p = self.ctx, self.placement
        rep = 1 if self.flat else (ctx.size("dp_replicate") if p.dp_dim is not None else ctx.size("dp"))
        if p.ep_dim is not None:
            rep = ctx.size("edp")  # expert shards are replicated over the expert-data-parallel group only
        return rep * (ctx.size("tp") if p.tp_dim is None else 1)

    def reduction(self) -> tuple[str, str, str] | None:
        """(collective, group, op) of the gradient sync (module docstring table); None: nothing to reduce."""
        ctx, p = self.ctx, self.placement
        if self.flat:
            return ("reduce_scatter", ctx.group("dp"), "avg")
        if p.dp_dim is not None:
            return ("all_reduce", ctx.group("dp_replicate"), "avg") if ctx.size("dp_replicate") > 1 else None
        if p.ep_dim is not None:  # EP experts: grad = Σ of the ep group's losses (all-to-all bwd)
            return ("all_reduce", ctx.group("edp"), "sum") if ctx.size("edp") > 1 else None
        return ("all_reduce", ctx.group("dp"), "avg") if ctx.size("dp") > 1 else None

    def bucket_key(self) -> tuple | None:
        """Key of the gradient bucket this slot joins (``_buckets.assign``); None: synced on its own."""
        reduction = self.reduction()
        if reduction is None or self.reduced_in_graph or self.grad_comm not in _buckets.BUCKETED_WIRES:
            return None
        return (*reduction, self.grad_comm, self.param.dtype, self.param.device)

    def wire_numel(self) -> int:
        """Elements this slot adds to a gradient bucket (padded to whole chunks when flat)."""
        return self.chunk * self.ctx.size("dp") if self.flat else self.numel

    def local_grad(self) -> torch.Tensor:
        """This rank's unreduced gradient (zeros when the parameter got none)."""
        return self.param.grad if self.param.grad is not None else torch.zeros_like(self.param)

    def set_grad(self, reduced: torch.Tensor) -> None:
        """Store the reduced gradient as ``self.grad`` (fp32, on the host; EP experts ÷ D)."""
        if self.placement.ep_dim is not None and not self.flat:
            reduced = reduced / self.ctx.size("dp")  # mean over all dp ranks' losses
        self.grad = reduced.to(self.host, torch.float32)

    def sync_grad(self) -> None:
        """Reduce ``param.grad`` into ``self.grad`` with a collective of its own (any ``grad_comm``)."""
        ctx, grad, wire = self.ctx, self.local_grad(), self.grad_comm
        if self.reduced_in_graph:  # already the mean over dp: flat slots keep their own chunk
            self.set_grad(self._own_chunk(grad.reshape(-1)) if self.flat else grad)
            return
        if self.flat:
            flat = F.pad(grad.reshape(-1), (0, self.chunk * ctx.size("dp") - self.numel))
            if self.placement.state == "zero1":
                grad = self._own_chunk(all_reduce_grad(flat, ctx.group("dp"), wire, "avg"))
            else:
                grad = reduce_scatter_grad(flat, ctx.group("dp"), wire, op="avg")
        elif (reduction := self.reduction()) is not None:
            grad = all_reduce_grad(grad, reduction[1], wire, reduction[2])
        self.set_grad(grad)

    def write_back(self, full: torch.Tensor | None = None) -> None:
        """Copy the updated master into the compute parameter.

        Flat slots take ``full``, the all-gathered padded flat parameter
        (``ShardedOptimizer`` gathers them in buckets); the others copy the master.
        """
        with torch.no_grad():
            if self.flat:
                assert full is not None and full.numel() == self.chunk * self.ctx.size("dp"), "flat slot needs its gather"
                self.param.copy_(full[: self.numel].view_as(self.param))
            else:
                self.param.copy_(self.master.to(self.param.device, self.param.dtype))
        self.param.grad = None
        self.grad = None

    def full_master(self) -> torch.Tensor:
        """The fp32 master at the parameter's local shape (all-gathers flat chunks over dp)."""
        return self.local_state("master")

    def local_state(self, name: str) -> torch.Tensor:
        """State ``name`` ("master", "exp_avg", "exp_avg_sq") as a new fp32 tensor at the parameter's local
        shape: flat chunks are all-gathered over dp (collective), so it carries the parameter's placement."""
        value = getattr(self, name)
        if not self.flat:
            return value.clone()
        full = collectives.all_gather(value.to(self.param.device), 0, self.ctx.group("dp"))
        return full[: self.numel].view(self.param.shape).clone()

    @torch.no_grad()
    def load_state(self, name: str, local: torch.Tensor) -> None:
        """Inverse of ``local_state``: set state ``name`` in place from fp32 values at the local shape;
        "master" also sets the compute param (``load_master``)."""
        if name == "master":
            self.load_master(local)
            return
        target = getattr(self, name)
        self._copy_own(target, local.detach().to(target.device, torch.float32))

    @torch.no_grad()
    def load_master(self, local: torch.Tensor) -> None:
        """Set the master (and the compute param) from fp32 values at the local shape, in place."""
        local = local.detach().to(self.param.device, torch.float32)
        self._copy_own(self.master, local)
        self.param.copy_(local)

    def _copy_own(self, target: torch.Tensor, local: torch.Tensor) -> None:
        """Copy ``local`` (local shape) into ``target``: flat slots take only their own chunk (zeros past the
        parameter's end; no padded copy is made), the others the whole tensor."""
        if not self.flat:
            target.copy_(local)
            return
        flat = local.reshape(-1)
        start = min(self.numel, self.ctx.coord("dp") * self.chunk)
        piece = flat[start:start + self.chunk]
        target[piece.numel():].zero_()
        target[:piece.numel()].copy_(piece)


class ShardedOptimizer:
    """AdamW / SGD over this rank's shards (module docstring: layouts, sync, buckets, clipping)."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        placements: dict[str, ParamPlacement],
        masters: Mapping[str, torch.Tensor] | None,
        ctx: RankContext,
        config: OptimizerConfig,
        grad_comm: dict[str, str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduced_in_graph: Iterable[str] = (),
    ) -> None:
        """``masters``: fqn → fp32 values at the local shape; ``None``: masters allocated uninitialised, filled
        afterwards through each slot's ``load_master`` (``runtime/materialize.py``).

        ``grad_comm``: fqn → wire dtype of its gradient sync ("none" when absent; module docstring).

        ``bucket_bytes``: target payload of one bucketed collective
        (``plan.schedule.bucket_bytes``); 0 = one collective per parameter.

        ``reduced_in_graph``: FQNs whose gradient the compiled graph already all-reduced (mean over dp)
        in backward (``passes/insert_collectives.py``, ``_insert_grad_syncs``): taken as reduced.
        """
        if bucket_bytes < 0:
            raise AutoshardError(f"bucket_bytes={bucket_bytes!r}: must be >= 0 (0 disables bucketing); "
                                 f"set Schedule.bucket_bytes to e.g. {DEFAULT_BUCKET_BYTES}")
        self.ctx, self.config, self.bucket_bytes = ctx, config, bucket_bytes
        wire, in_graph = grad_comm or {}, frozenset(reduced_in_graph)
        self.slots = {fqn: _Slot(p, placements[fqn], None if masters is None else masters[fqn], ctx, wire.get(fqn, "none"),
                                 fqn in in_graph)
                      for fqn, p in params.items()}
        self.steps = 0  # updates taken: Adam's bias-correction count and the schedule's position
        self.last_lr = config.lr_at(0)  # learning rate of the latest update (of the first one before any)
        slots = list(self.slots.values())
        self._grad_buckets = [[slots[i] for i in b] for b in _buckets.assign(
            [s.bucket_key() for s in slots], [s.wire_numel() * s.param.element_size() for s in slots], bucket_bytes)]
        flat = [s for s in slots if s.flat]
        self._gather_buckets = [[flat[i] for i in b] for b in _buckets.assign(
            [(s.param.dtype, s.param.device) for s in flat], [s.wire_numel() * s.param.element_size() for s in flat],
            bucket_bytes)]
        bucketed = {id(s) for b in self._grad_buckets for s in b}
        self._unbucketed = [s for s in slots if id(s) not in bucketed]  # quantized wires, or nothing to reduce
        # multi-tensor groups: slots whose masters live on one device (offload: the host) share the _foreach launches
        by_device: dict[str, list[_Slot]] = {}
        for s in slots:
            by_device.setdefault(str(s.master.device), []).append(s)
        # (slots, their replication counts for the clipping formula) per device
        self._groups = [(group, torch.tensor([float(s.replication) for s in group], dtype=torch.float64,
                                             device=ctx.device)) for group in by_device.values()]
        # overlapped gradient sync (module docstring): off until enable_overlap, launched only while armed
        self._hooks: list = []
        self._armed = False
        self._ready: set[int] = set()  # id() of the slots whose gradient is final this step
        self._launched: dict[int, tuple] = {}  # bucket index → _buckets.start handle
        # launch order: the buckets whose gradients only autograd accumulates, last first. ZeRO-3 shards
        # are left out: a GradSink may add to their .grad after autograd's accumulation has fired the hook.
        self._order = [i for i in reversed(range(len(self._grad_buckets)))
                       if all(s.placement.dp_dim is None for s in self._grad_buckets[i])]
        self._next = 0  # position in _order of the next bucket to launch
        self.overlap_launches = 0  # buckets launched from backward, over the optimizer's life (tests)
        self.gather_under_update = True  # False: update every slot, then gather (module docstring; A/B runs)
        self.gathers_in_flight = 2  # gathered buckets alive at once during the update (step)

    def enable_overlap(self) -> None:
        """Register the post-accumulate-grad hooks of the overlapped gradient sync (module docstring)."""
        if self._hooks:
            return
        for index in self._order:
            for slot in self._grad_buckets[index]:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(
                    lambda _param, slot=slot: self._on_grad(slot)))

    def arm(self) -> None:
        """The next backward is the step's last: launch each gradient bucket as soon as it is ready."""
        self._armed = bool(self._hooks)

    def _on_grad(self, slot: _Slot) -> None:
        if not self._armed:
            return
        self._ready.add(id(slot))
        while self._next < len(self._order) and all(id(s) in self._ready for s in self._grad_buckets[self._order[self._next]]):
            index = self._order[self._next]
            self._launched[index] = self._start_bucket(self._grad_buckets[index])
            self._next += 1
            self.overlap_launches += 1

    def _start_bucket(self, bucket: list[_Slot]) -> tuple:
        kind, group, op, wire, _dtype, _device = bucket[0].bucket_key()
        grads = [s.local_grad() for s in bucket]
        return _buckets.start(kind, grads, group, wire, op, [s.chunk for s in bucket] if kind != "all_reduce" else (),
                              self.ctx.size("dp"))

    def clip_scale(self) -> tuple[float, float]:
        """(global gradient norm, scale factor) from the synced gradients, as Python floats."""
        norm, scale = self._clip_tensors()
        return float(norm), float(scale)

    def _clip_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(global gradient norm, scale factor) as fp32 device tensors (one ``_foreach_norm`` per device):
        no host synchronisation, so the update is queued behind the gradient sync without a stall."""
        local = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for slots, replication in self._groups:
            norms = torch._foreach_norm([s.grad for s in slots])
            squares = torch.stack(norms).to(self.ctx.device, torch.float64).pow(2)
            local = local + (squares / replication).sum()
        total = local.to(torch.float32)
        if self.ctx.world_size > 1:
            total = collectives.all_reduce(total.reshape(1), self.ctx.group("world"), "sum")[0]
        norm = total.sqrt()
        limit = self.config.max_grad_norm
        scale = (limit / (norm + 1e-6)).clamp(max=1.0) if limit is not None else torch.ones_like(norm)
        return norm, scale

    @torch.no_grad()
    def step(self) -> float:
        """Sync gradients, clip, update masters, write back compute params; returns the global grad norm.

        The clip scale stays on the device (a multiply by 1.0 when not clipping leaves every value
        as it is); the norm is read back once, after the write-back is queued.
        """
        self.sync_grads()
        norm, scale = self._clip_tensors()
        self.last_lr = self.config.lr_at(self.steps)
        self.steps += 1
        if self.config.max_grad_norm is not None:
            for slots, _replication in self._groups:
                grads = [s.grad for s in slots]
                torch._foreach_mul_(grads, scale.to(grads[0].device) if grads else scale)
        # flat slots updated where they are gathered: bucket by bucket, each all-gather launched as soon as
        # its bucket is updated, so it runs under the update of the next ones (module docstring)
        # At most gathers_in_flight gathered buckets are alive: the oldest is written back before the next launch,
        # so the step never holds a second copy of the parameters (tests/test_step_memory.py)
        started, updated, written = {}, set(), set()
        for index, bucket in enumerate(self._gather_buckets if self.gather_under_update else ()):
            if all(s.master.device == s.param.device for s in bucket):
                self._update(bucket, [s.grad for s in bucket])
                updated.update(id(s) for s in bucket)
                while len(started) >= self.gathers_in_flight:
                    oldest = min(started)
                    self._write_bucket(self._gather_buckets[oldest], _buckets.all_gather_end(started.pop(oldest)))
                    written.add(oldest)
                chunks = [s.master.to(s.param.dtype) for s in bucket]
                started[index] = _buckets.all_gather_begin(chunks, self.ctx.size("dp"), self.ctx.group("dp"))
                del chunks
        for slots, _replication in self._groups:
            rest = [s for s in slots if id(s) not in updated]
            if rest:
                self._update(rest, [s.grad for s in rest])
        self.write_back(started, written)
        return float(norm)

    def sync_grads(self) -> None:
        """Reduce every slot's gradient: one collective per bucket, per-parameter for quantized wires.

        Buckets launched from backward (overlapped sync) are completed; the others run blocking here.
        """
        launched, self._launched = self._launched, {}
        self._armed, self._next = False, 0
        self._ready.clear()
        for index, bucket in enumerate(self._grad_buckets):
            kind, group, op, wire, _dtype, _device = bucket[0].bucket_key()
            if index in launched:
                reduced = _buckets.finish(launched[index])
            elif kind == "all_reduce":
                grads = [s.local_grad() for s in bucket]
                reduced = _buckets.all_reduce(grads, group, wire, op)
            else:
                grads = [s.local_grad() for s in bucket]
                reduced = _buckets.reduce_scatter(grads, [s.chunk for s in bucket], self.ctx.size("dp"), group, wire, op)
            for slot, grad in zip(bucket, reduced, strict=True):
                slot.set_grad(grad)
        for slot in self._unbucketed:
            slot.sync_grad()
        for slot in self.slots.values():  # reduced into slot.grad: the unreduced gradient is no longer needed
            slot.param.grad = None

    def _write_bucket(self, bucket: list[_Slot], fulls: list[torch.Tensor]) -> None:
        """Copy one gather bucket's gathered parameters into the compute params (one multi-tensor copy)."""
        torch._foreach_copy_([s.param.data for s in bucket],
                             [full[: s.numel].view_as(s.param) for s, full in zip(bucket, fulls, strict=True)])
        for slot in bucket:
            slot.param.grad = None
            slot.grad = None

    def write_back(self, started: dict[int, tuple] | None = None, written: set[int] = frozenset()) -> None:
        """Copy updated masters into the compute params: one all-gather per bucket of flat slots.

        ``started``: gather-bucket index → ``_buckets.all_gather_begin`` handle, for the buckets whose
        gather ``step`` already launched; ``written``: the buckets ``step`` already wrote back; the other
        buckets are gathered here.
        """
        started = started or {}
        for index, bucket in enumerate(self._gather_buckets):
            if index in written:
                continue
            handle = started.get(index)
            if handle is not None:
                fulls = _buckets.all_gather_end(handle)
            else:
                chunks = [s.master.to(s.param.device, s.param.dtype) for s in bucket]
                fulls = _buckets.all_gather(chunks, self.ctx.size("dp"), self.ctx.group("dp"))
            self._write_bucket(bucket, fulls)
        direct = [s for s in self.slots.values() if not s.flat and s.master.device == s.param.device]
        if direct:  # one multi-tensor copy (with the cast to the compute dtype) instead of one per parameter
            torch._foreach_copy_([s.param.data for s in direct], [s.master for s in direct])
            for slot in direct:
                slot.param.grad = None
                slot.grad = None
        for slot in self.slots.values():
            if not slot.flat and slot.master.device != slot.param.device:
                slot.write_back()

    def _update(self, slots: list[_Slot], grads: list[torch.Tensor]) -> None:
        """AdamW / SGD over one device's slots at this step's scheduled learning rate: the fused kernel, else
        multi-tensor (module docstring); decayed and undecayed parameters (``OptimizerConfig.decays``) in
        one call each."""
        for decays in (True, False):
            part = [i for i, s in enumerate(slots) if self.config.decays(s.placement.global_shape) == decays]
            if part:
                apply_update(self.config, self.steps, [slots[i].master for i in part], [grads[i] for i in part],
                             [slots[i].exp_avg for i in part], [slots[i].exp_avg_sq for i in part],
                             lr=self.last_lr, weight_decay=self.config.weight_decay if decays else 0.0)

    def local_moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """fqn → {state: fp32 tensor at the parameter's local shape} for ``config.state_names`` (AdamW's
        moments; nothing for SGD). Collective for ZeRO-1/2/offload (``_Slot.local_state``)."""
        return {fqn: {name: slot.local_state(name) for name in self.config.state_names}
                for fqn, slot in self.slots.items()}

    def load_local_moments(self, moments: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Inverse of ``local_moments``: every slot's states from values at the local shape (no collective)."""
        for fqn, slot in self.slots.items():
            for name, local in moments[fqn].items():
                if tuple(local.shape) != tuple(slot.param.shape):
                    raise AutoshardError(f"{fqn}.{name}: local shape {tuple(local.shape)} != the parameter's "
                                         f"{tuple(slot.param.shape)}; pass values at the parameter's local shape")
                slot.load_state(name, local)


def update_kind(cfg: OptimizerConfig, masters: list[torch.Tensor]) -> str:
    """``"fused"`` when ``torch._fused_adamw_`` serves this AdamW update (fp32/bf16/fp16 masters on CUDA or
    the CPU, torch's own condition for ``AdamW(fused=True)``; on meta too, where ``autoshard check`` builds for one of
    them), else ``"foreach"`` (SGD, other devices)."""
    if cfg.name != "adamw" or not masters:
        return "foreach"
    device = masters[0].device
    if device.type not in ("cuda", "cpu", "meta"):  # meta: a program built to be checked (autoshard/check.py)
        return "foreach"
    ok = all(m.device == device and m.dtype in (torch.float32, torch.bfloat16, torch.float16) for m in masters)
    return "fused" if ok else "foreach"


def apply_update(cfg: OptimizerConfig, step: int, masters: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], *, lr: float | None = None,
                 weight_decay: float | None = None) -> None:
    """One AdamW (or SGD) step of ``masters`` in place, as ``torch.optim.AdamW``; ``step`` ≥ 1.

    ``lr`` / ``weight_decay`` override ``cfg.lr`` / ``cfg.weight_decay`` (the scheduled learning rate, and
    0 for the parameters that do not decay).

    AdamW runs ``torch._fused_adamw_`` (``update_kind``), the kernel of ``AdamW(fused=True)``, with
    ``step`` as its step count (read, not incremented, by the kernel: torch.optim increments it
    before the call); else ``foreach_update``. Also what ``autoshard cluster calibrate --model`` times
    as the optimizer's cost (``autoshard/calibrate_probe.py``).
    """
    lr = cfg.lr if lr is None else lr
    weight_decay = cfg.weight_decay if weight_decay is None else weight_decay
    if update_kind(cfg, masters) == "foreach":
        foreach_update(cfg, step, masters, grads, exp_avg, exp_avg_sq, lr=lr, weight_decay=weight_decay)
        return
    beta1, beta2 = cfg.betas
    count = torch.full((), float(step), dtype=torch.float32, device=masters[0].device)
    torch._fused_adamw_(masters, grads, exp_avg, exp_avg_sq, [], [count] * len(masters), lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)


def foreach_update(cfg: OptimizerConfig, step: int, masters: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], *, lr: float | None = None,
                   weight_decay: float | None = None) -> None:
    """One AdamW (or SGD) step of ``masters`` in place, as ``torch.optim.AdamW``'s foreach path; ``step`` ≥ 1
    (``apply_update``'s fallback; ``lr`` / ``weight_decay`` as there)."""
    lr = cfg.lr if lr is None else lr
    weight_decay = cfg.weight_decay if weight_decay is None else weight_decay
    if weight_decay:
        torch._foreach_mul_(masters, 1 - lr * weight_decay)
    if cfg.name == "sgd":
        torch._foreach_add_(masters, grads, alpha=-lr)
        return
    beta1, beta2 = cfg.betas
    torch._foreach_lerp_(exp_avg, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, math.sqrt(bias2))
    torch._foreach_add_(denom, cfg.eps)
    torch._foreach_addcdiv_(masters, exp_avg, denom, value=-lr / bias1)


__all__ = ["DEFAULT_BUCKET_BYTES", "FLAT_STATES", "MOMENTS", "OptimizerConfig", "ShardedOptimizer", "apply_update", "foreach_update",
           "update_kind"]
