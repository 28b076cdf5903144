"""Per-rank memory formulas: model states (ZeRO) and activations (Korthikanti).

Units: bytes. ``Ψ`` = parameters of a layer a rank holds after tensor/expert
sharding; ``N`` = the degree the ZeRO stage shards over (1 for replicate).

Model states (Rajbhandari et al. 2020, "ZeRO", §3 and Table 1), with ``p`` =
parameter bytes, ``g`` = gradient bytes, ``K`` = optimizer-state bytes per
parameter:

    state       params   grads    optimizer   buffers (transient)   gathered   host
    replicate   pΨ       gΨ       KΨ          0                     0          0
    zero1       pΨ       gΨ       KΨ/N        0                     0          0
    zero2       pΨ       gΨ/N     KΨ/N        2gΨ                   0          0
    zero3       pΨ/N     gΨ/N     KΨ/N        (p+2g)Ψ               pΨ         0
    offload     pΨ       gΨ       0           0                     0          KΨ/N

These are the paper's rows, with the runtime's buffers. The cost model uses them for the runtime's form of each state
(``search/layer_terms.memory_state``): its ZeRO-2 accumulates full gradients and reduces once per
step (the ``zero1`` row), except for a layer gathered in the compiled forward graph, where ZeRO-1
and ZeRO-2 both reduce-scatter in the backward (the ``zero2`` row), hold the parameters as the
dim-0 shard (pΨ/N) and keep the gathered ones (pΨ) from the forward to the backward: saved
tensors, priced with the activations (``kept_gathered``; not scaled for compiled graphs).

Mixed precision (``precision="bf16"``): p = g = 2, K = 12 for AdamW (fp32
master 4 + momentum 4 + variance 4; ``TrainSpec.optimizer_state_bytes_per_param``),
4 for SGD (fp32 master). Full fp32 (``precision="fp32"``): p = g = 4 and K is
the same: the runtime keeps its fp32 master apart from the compute parameters
(``runtime/optimizer.py``: the update writes the master, the write-back copies
it into the parameter). ``buffers`` is what one layer holds while its backward runs, as its form declares
(``DataParallelForm.backward``, ``backward_buffer_bytes``): the table's column is the eager ZeRO-3
packed layer's (re-gathered parameters, unsharded gradient, the reduce-scatter's copy-in,
``passes/_zero3.py``); a compiled graph frees each gathered weight before the copy-in exists.
``gathered`` is a layer's gathered parameters in the forward, where ``schedule.prefetch`` more heavy
layers' gathers are in flight and one gather's flat all-gather output is live beside its copy-out
(``passes/_zero3.py``: the per-parameter tensors are copied out of it), so ``2 + prefetch`` of them
(``gather_copies``); its backward re-gather likewise holds ``2p`` for a moment (``backward_working_bytes``).
The forward/backward peak places them on the backward's timeline (``step_peak_bytes``); a pipelined rank takes ``max(max buffers, (2 + prefetch)·max gathered)``
over its layers (``live_buffers``), never a sum. The backward prefetch (one layer ahead) and the
reduce-scatter still pending from the layer after (``passes/recompute.py``, ``passes/_zero3.py``)
are the neighbouring norms of an attention or MLP layer, which capture makes layers of their own:
light, so not priced.

Backward working set (``backward_working_bytes``). Besides the activations of the layers before it and
the gradients of those after it, a layer's backward holds the gradient of its output (and of the residual
stream beside it), the activation gradients it makes inside (an RMSNorm's fp32 copies, a SwiGLU's ``[T, ffn]``
gradients) and, by then, a share ``f`` of its own gradient: ``W + f·g``, measured by capture on meta
(``passes/_capture_grad.py``). The form's buffers come at the backward's end, when the layer has freed its
saved activations and left its input's gradient (``end``, per token, negative when it freed more), so::

    G_l = max(buffers + end, held + W + f·g, 2·held)   held: the gathered parameters (ZeRO-3, graph gathers)

A model capture could not run backward on meta has ``W = end = 0``: ``G_l`` is the form's buffers.

Activations of one micro-batch (Korthikanti et al. 2022, Table 2), from the
captured per-token coefficients of ``LayerInfo`` (B = saved_boundary, I =
saved_interior, Iₛ = saved_interior_seq, all bytes/token; T = b·s/cp tokens
on this rank; t = tensor-parallel degree):

    recompute none, no TP      T · (B + I + Iₛ·s)
    TP (no SP)                 T · (B + (I + Iₛ·s)/t)
    TP + SP                    T · (B + I + Iₛ·s)/t
    selective                  the same with Iₛ dropped
    full                       T · input_bytes_per_token (/t under SP), for the
                               first layer of a checkpoint region; 0 for the rest

A *checkpoint region* is a maximal run of consecutive full-recompute layers of
one block (and one stage): it keeps only its input, so a fully recomputed
transformer block holds ``2sbh`` (Korthikanti's "full recompute" row). A layer
priced alone (``region_entry=True``, the default) is its own region.

Activation bytes are at the dtype the model was captured in (capture in the
training dtype); dropout masks are counted by capture at 1 byte.

Build (materialization) peak of one rank. The runtime builds a rank's program
shard by shard (from the meta device, a checkpoint or safetensors files): it
reads one parameter's region at a time, in the file's dtype (at most 4 bytes
per element), makes its fp32 copy, and keeps only the compute-dtype shard and
the optimizer states. With ``E(w)`` = elements of the rank's region of
parameter ``w`` (``build_region_elements``: the tp/ep-local parameter for
replicate, zero1, zero2 and offload layers; its ZeRO-3 chunk for zero3 ones,
``⌈d₀/N⌉·d₁·…`` of the tp/ep-local shape, as ``torch.chunk`` on tensor dim 0
gives the first rank)::

    build_transient = BUILD_BYTES_PER_ELEMENT · max_w E(w)     (= 2 × 4 bytes: the region, its fp32 copy)
    build_peak      = Σ params + Σ optimizer + build_transient  (over the rank's layers: every virtual
                                                                 stage it runs, no other stage's)

``params`` and ``optimizer`` are the table's device columns (offload's
optimizer states are on the host); gradients, activations and gather buffers
do not exist yet. Only one parameter is read at a time, so layers combine the
transient by a max, never a sum (``MemoryBreakdown.__add__``).

Optimizer step (the working set ``autoshard/data_parallel.step_working_set`` declares per layer).
From the gradient sync to the write-back a rank holds its params, optimizer states and the
backward's gradients (freed once every bucket is reduced), plus the fp32 gradient the update reads
where it is a tensor of its own (``step_grads``: 4 bytes × Ψ for "full", Ψ/N for "chunk" and
"shard", 0 for "none"), plus the copies of the bucket being packed (``step_transient``: ``pack`` ×
the largest bucket, ``max(largest member, min(bucket_bytes, Σ members))`` over the layer's
gradients in their dtype; one bucket is packed at a time, so a max over layers)::

    optimizer_step = Σ (params + grads + optimizer + step_grads) + max(max step_transient, buckets)

A bucket fills with the gradients of consecutive layers (``runtime/_buckets.assign``), so where a
rank's bucketed gradients all fit one bucket (``Σ members ≤ bucket_bytes``: small models) that bucket
holds every layer's, and its copies exceed any one layer's: ``buckets = Σ pack · members``
(``rank_bucket_bytes``; every form's members summed, where the runtime keys buckets by collective: an
upper bound on a rank mixing forms). Otherwise buckets close at up to ``bucket_bytes`` on member
boundaries the layers' own ``step_transient`` already bound, and ``buckets`` is 0.

The update itself (fused AdamW, SGD) allocates nothing. Offload's chunk is on the host on a GPU
(not counted), on the device on CPU ranks, where host and device are the same memory: there the
host column counts as device optimizer states (``layer_terms.layer_memory``). The rank's predicted
peak is ``max(step peak, optimizer step, build peak)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from autoshard.graph import LayerInfo, ParamInfo
from autoshard.plan import LayerStrategy
from autoshard.train import TrainSpec

STATES = ("replicate", "zero1", "zero2", "zero3", "offload")
# While building, one parameter region is live twice: as read (file dtype, at most 4 bytes/element)
# and as its fp32 copy (4 bytes/element).
BUILD_BYTES_PER_ELEMENT = 2 * 4
# Tensor dim Megatron TP splits per role (the runtime's ``passes/context.TP_ROLE_DIM``); experts split dim 0 by ep.
TP_ROLE_TENSOR_DIM = {"column": 0, "row": 1, "vocab": 0}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds for one layer (or a whole stage when summed)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0  # for ONE micro-batch in flight
    kept_gathered: float = 0.0  # of activations: gathered tensors the forward keeps for backward (parameters, SP inputs)
    buffers: float = 0.0  # collective / gather buffers of the layer's backward
    gathered: float = 0.0  # the layer's gathered parameters in forward (ZeRO-3); prefetch keeps more alive
    host: float = 0.0  # bytes in host memory (ZeRO-Offload optimizer states); not device memory
    build_transient: float = 0.0  # while building: the largest parameter region, read + fp32 copy (a max)
    step_grads: float = 0.0  # optimizer step: fp32 gradients the update reads, when tensors of their own
    step_transient: float = 0.0  # optimizer step: copies of the gradient bucket being packed (a max)
    step_bucketed: float = 0.0  # optimizer step: pack × the bytes of the gradients that go into buckets (summed)
    step_bucket_members: float = 0.0  # optimizer step: the bytes of those gradients (summed)

    @property
    def total_static(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def model_states(self) -> float:
        """params + grads + optimizer on the device: the quantity of ZeRO's Table 1."""
        return self.params + self.grads + self.optimizer

    @property
    def build_resident(self) -> float:
        """params + optimizer on the device: what the build leaves resident (module docstring)."""
        return self.params + self.optimizer

    @property
    def optimizer_step_resident(self) -> float:
        """params + grads + optimizer + step_grads: what the optimizer step holds besides its bucket."""
        return self.model_states + self.step_grads

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """Field-wise sum, except ``build_transient`` and ``step_transient``: one parameter is built, one
        bucket packed at a time, so a max."""
        return MemoryBreakdown(
            params=self.params + other.params,
            grads=self.grads + other.grads,
            optimizer=self.optimizer + other.optimizer,
            activations=self.activations + other.activations,
            kept_gathered=self.kept_gathered + other.kept_gathered,
            buffers=self.buffers + other.buffers,
            gathered=self.gathered + other.gathered,
            host=self.host + other.host,
            build_transient=max(self.build_transient, other.build_transient),
            step_grads=self.step_grads + other.step_grads,
            step_transient=max(self.step_transient, other.step_transient),
            step_bucketed=self.step_bucketed + other.step_bucketed,
            step_bucket_members=self.step_bucket_members + other.step_bucket_members,
        )


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter: ``param`` (p), ``grad`` (g), ``optimizer`` (K)."""

    param: int
    grad: int
    optimizer: int


def state_bytes(train: TrainSpec) -> StateBytes:
    """p, g and K for ``train``'s precision and optimizer (module docstring)."""
    k = train.optimizer_state_bytes_per_param
    if train.precision == "fp32":
        return StateBytes(param=4, grad=4, optimizer=k)  # the fp32 master is a copy of its own
    return StateBytes(param=2, grad=2, optimizer=k)


def model_state_memory(psi: float, state: str, shard_degree: int, sizes: StateBytes) -> MemoryBreakdown:
    """ZeRO model-state bytes of ``psi`` parameters under ``state`` sharded over ``shard_degree`` ranks."""
    if state not in STATES:
        raise ValueError(f"state={state!r}: allowed {STATES}")
    n = max(1, shard_degree)
    p, g, k = sizes.param * psi, sizes.grad * psi, sizes.optimizer * psi
    if state == "replicate":
        return MemoryBreakdown(params=p, grads=g, optimizer=k)
    if state == "zero1":
        return MemoryBreakdown(params=p, grads=g, optimizer=k / n)
    if state == "zero2":
        return MemoryBreakdown(params=p, grads=g / n, optimizer=k / n, buffers=2 * g)
    if state == "zero3":
        return MemoryBreakdown(params=p / n, grads=g / n, optimizer=k / n, buffers=p + 2 * g, gathered=p)
    return MemoryBreakdown(params=p, grads=g, optimizer=0.0, host=k / n)  # offload


def backward_buffer_bytes(backward: str, psi: float, sizes: StateBytes) -> float:
    """Bytes one layer of ``psi`` local parameters holds while its backward runs, for the form's
    ``DataParallelForm.backward`` (``autoshard/data_parallel.py``, the table's why): replaces the
    ``buffers`` column of ``model_state_memory``, which is the eager ZeRO-3 one."""
    p, g = sizes.param * psi, sizes.grad * psi
    if backward == "gather_grad_copy":
        return p + 2 * g
    if backward == "graph_gather":
        return max(p + g, 2 * g)
    if backward == "graph_kept":
        return max(g, 2 * g - p)
    if backward == "none":
        return 0.0
    raise ValueError(f"backward={backward!r}: allowed none, gather_grad_copy, graph_gather, graph_kept")


# the forms whose backward holds the layer's gathered parameters throughout (re-gathered, or gathered in the graph)
_HOLDS_GATHERED = ("gather_grad_copy", "graph_gather")


def backward_working_bytes(layer: LayerInfo, strategy: LayerStrategy, tp: int, tokens: float, backward: str,
                           buffers: float, gathered: float, grads: float, local_share: float) -> float:
    """``G_l``: what one layer's backward holds beside the activations and the other layers' gradients
    (module docstring, "Backward working set"): ``max(buffers + end, held + W + f·grads, 2·held)``, the last
    the re-gather's flat output beside its copy-out.

    ``buffers`` is the form's (``backward_buffer_bytes``, summed over the layer's groups), ``gathered`` its
    gathered parameter bytes (held through the backward by the gathering forms), ``grads`` the bytes of the
    gradient its backward makes (the local, unsharded one), ``local_share`` that gradient's share of the
    layer's parameters (tp and ep shards); ``W``, ``f`` and ``end`` are capture's (``LayerInfo.grad_working_*``)
    at ``tokens``, sharded by tp as the layer's interior activations are, and W's fixed, weight-shaped part
    by ``local_share``."""
    tp_interior = tp if ((strategy.tp == "megatron" and tp_shardable(layer)) or (strategy.sp and tp > 1)) else 1
    working = tokens * layer.grad_working_per_token / tp_interior + layer.grad_working_fixed_bytes * local_share
    end = tokens * layer.grad_working_end_per_token / tp_interior
    held = gathered if backward in _HOLDS_GATHERED else 0.0
    return max(buffers + end, held + working + layer.grad_working_param_fraction * grads, 2 * held)


TP_SPLIT_ROLES = ("column", "row", "vocab")


def tp_shardable(layer: LayerInfo) -> bool:
    """Whether Megatron TP splits this layer's work: it has column/row/vocab parameters, or it
    is the LM head (vocab-parallel even when its weight is tied to the embedding and listed there)."""
    return layer.kind == "head" or any(p.tp_role in TP_SPLIT_ROLES for p in layer.params)


def rematerialised_bytes(layer: LayerInfo, strategy: LayerStrategy, tp: int, tokens: float, seq_len: int,
                         region_entry: bool = True) -> float:
    """Bytes a recomputed layer's backward holds again: what it saves without recompute less what it keeps
    (its input under full recompute where it enters its checkpoint region, nothing where it continues one
    (``region_entry`` False), all but the attention scores under selective). ``plan``-level pricing
    (``cost_model.plan_layer_costs``) puts a whole checkpoint region's sum on the region's last layer,
    where its backward recomputes the region at once; the search prices each layer's own."""
    if strategy.recompute == "none":
        return 0.0
    saved = activation_bytes(layer, replace(strategy, recompute="none"), tp, tokens, seq_len)
    return max(saved - activation_bytes(layer, strategy, tp, tokens, seq_len, region_entry=region_entry), 0.0)


def activation_bytes(
    layer: LayerInfo,
    strategy: LayerStrategy,
    tp: int,
    tokens: float,
    seq_len: int,
    *,
    region_entry: bool = True,
) -> float:
    """Saved-activation bytes of one micro-batch of ``tokens`` tokens (module docstring table).

    ``tp`` is the mesh's tensor-parallel degree; it shards only when the
    strategy uses Megatron TP on a layer with tp-split parameters (interior
    tensors) or SP (all of them).
    """
    sp = strategy.sp and tp > 1
    tp_interior = tp if ((strategy.tp == "megatron" and tp_shardable(layer)) or sp) else 1
    tp_boundary = tp if sp else 1
    if strategy.recompute == "full":
        return tokens * layer.input_bytes_per_token / tp_boundary if region_entry else 0.0
    interior = layer.saved_interior_per_token
    if strategy.recompute == "none":
        interior += layer.saved_interior_per_token_seq * seq_len
    return tokens * (layer.saved_boundary_per_token / tp_boundary + interior / tp_interior)


def sp_gathered_input_bytes(layer: LayerInfo, strategy: LayerStrategy, tp: int, tokens: float,
                            element_bytes: float) -> float:
    """Bytes SP adds to ``activation_bytes`` (which prices the layer's input at ``1/t``): the column projections
    (and the vocab-parallel head) save their all-gathered, whole-sequence input for the weight gradient, and
    the runtime does not re-gather it in the backward as Megatron-LM does, so ``T·h·(1 − 1/t)`` more at the
    compute dtype's ``element_bytes`` (capture's input bytes per token where it recorded no ``hidden``;
    ``autoshard/model_parallel.py``, SP notes). None under full recompute (the region keeps only its input)."""
    if not (strategy.sp and tp > 1) or strategy.recompute == "full":
        return 0.0
    if layer.kind != "head" and not any(p.tp_role == "column" for p in layer.params):
        return 0.0
    per_token = layer.hidden * element_bytes if layer.hidden else layer.input_bytes_per_token
    return tokens * per_token * (1.0 - 1.0 / tp)


def gather_copies(prefetch: int) -> int:
    """Gathered-parameter buffers of one layer's size live at a forward gather (module docstring): the layer's
    gathered parameters, the flat all-gather output of the one being copied out (freed once its copy-out
    ends), and ``prefetch`` more in flight."""
    return 2 + prefetch


def live_buffers(max_buffers: float, max_gathered: float, prefetch: int) -> float:
    """Gather / collective buffers live at once on a rank (module docstring): the largest layer's backward
    buffers, or ``2 + prefetch`` of its forward gathers (``gather_copies``), whichever is larger."""
    return max(max_buffers, gather_copies(prefetch) * max_gathered)


def rank_memory(static: float, grads: float, buffers: float, activations: float, grads_beside_activations: bool) -> float:
    """Peak bytes of one pipelined rank (``step_peak_bytes``' bound, no layer order): ``static`` (params
    + grads + optimizer) + buffers + activations, or, when gradients are not live beside activations
    (``grads_beside_activations`` False), ``static − grads + buffers + max(grads, activations)``."""
    if grads_beside_activations:
        return static + buffers + activations
    return static - grads + buffers + max(grads, activations)


@dataclass(frozen=True)
class LayerLive:
    """What one layer adds to a rank's forward/backward timeline (``step_peak_bytes``): bytes."""

    activations: float  # one micro-batch (A'_l inside a checkpoint region)
    grads: float  # its gradients once its backward has run
    buffers: float  # while its backward runs (G_l)
    gathered: float  # while its forward runs (H_l)


def step_peak_bytes(static: float, layers: Sequence[LayerLive], prefetch: int, in_flight: float, micro_batches: int,
                    order_free: bool = False) -> float:
    """Forward/backward peak of one rank, bytes. ``static`` is Σ (params + grads + optimizer) of its layers,
    ``layers`` its layers in forward order, ``in_flight`` (f) the micro-batches whose activations it holds at
    once (``pipeline.in_flight``: 1 on one stage), ``micro_batches`` (m) those of the step.

    The rank runs forwards and backwards of whole micro-batches (one stage, or one stage of a 1F1B or GPipe
    pipeline). A forward reaching layer i holds its in-flight micro-batches' activations and ``(1 +
    prefetch)·H_i`` of gathers; a backward reaching layer i (in reverse) still holds the activations of
    layers ≤ i, the gradients of layers > i (all of them once an earlier backward of the step ran) and
    layer i's buffers ``G_i``. Gradients exist only from the step's first backward on. With ``Gr`` the
    gradients and ``A`` the activations of one micro-batch::

        forward       (f − 1)·ΣA + max_i [A≤i + (2 + prefetch)·H_i] + [m > f]·ΣGr   (a forward after a backward)
        1st backward  (f − 1)·ΣA + max_i [A≤i + Gr>i + max(G_i, Gr_i)]
        later ones    (f − 1 − [m ≤ f])·ΣA + ΣGr + max_i [A≤i + G_i]                (m ≥ 2)
        peak = static − ΣGr + the largest

    ``order_free``: the bound without layer order or schedule, ``rank_memory(static, ΣGr, live_buffers(max
    G, max H), f·ΣA)``, never below the above; the search takes it for pipelines (``search/evaluate.py``), and
    ``predict`` replays an interleaved schedule's order instead (``interleaved_peak_bytes``: a rank's virtual
    stages interleave their micro-batches)."""
    total_grads = sum(layer.grads for layer in layers)
    total_acts = sum(layer.activations for layer in layers)
    if order_free:
        buffers = live_buffers(max((layer.buffers for layer in layers), default=0.0),
                               max((layer.gathered for layer in layers), default=0.0), prefetch)
        return rank_memory(static, total_grads, buffers, in_flight * total_acts, True)
    forward = first = later = acts = 0.0
    grads_after = total_grads
    for layer in layers:
        acts += layer.activations
        grads_after = max(grads_after - layer.grads, 0.0)
        forward = max(forward, acts + gather_copies(prefetch) * layer.gathered)
        # layer i holds its buffers (which hold its unsharded gradient) or, with none, its own gradient
        first = max(first, acts + grads_after + max(layer.buffers, layer.grads))
        later = max(later, acts + layer.buffers)
    others = (in_flight - 1) * total_acts
    peaks = [others + forward + (total_grads if micro_batches > in_flight else 0.0), others + first]
    if micro_batches >= 2:
        peaks.append(max(in_flight - 1 - (micro_batches <= in_flight), 0.0) * total_acts + total_grads + later)
    return static - total_grads + max(peaks)


def interleaved_peak_bytes(static: float, chunks: Sequence[Sequence[LayerLive]], order: Sequence[tuple[str, int, int]],
                           prefetch: int) -> float:
    """Forward/backward peak of one rank of an interleaved pipeline, bytes: its actions replayed in the
    schedule's order (``pipeline.interleaved_order``), ``chunks`` the layers of each local chunk in forward order.

    Each forward of chunk c leaves ``ΣA_c`` live until its micro-batch's backward of c; an action holds the
    other live micro-batch chunks' activations plus its own working set, as ``step_peak_bytes`` prices one
    stage's: a forward ``max_i [A≤i + (2 + prefetch)·H_i]``, a backward ``max_i [A≤i + max(B_i, Gr_i)]`` (over
    c's layers; B_i the layer's backward buffers, Gr_i its gradients).
    A chunk's gradients are live from its first backward on (during it, all of them)::

        peak = static − ΣGr + max over actions [Gr of the chunks backed so far + others' A + working set]"""
    total_grads = sum(layer.grads for chunk in chunks for layer in chunk)
    acts, fwd, bwd, grads = [], [], [], []
    for chunk in chunks:
        running = f = b = 0.0
        for layer in chunk:
            running += layer.activations
            f = max(f, running + gather_copies(prefetch) * layer.gathered)
            b = max(b, running + max(layer.buffers, layer.grads))
        acts.append(running)
        fwd.append(f)
        bwd.append(b)
        grads.append(sum(layer.grads for layer in chunk))
    live: dict[tuple[int, int], float] = {}
    backed: set[int] = set()
    peak = 0.0
    for kind, c, k in order:
        if kind == "F":
            peak = max(peak, sum(grads[i] for i in backed) + sum(live.values()) + fwd[c])
            live[(c, k)] = acts[c]
        else:
            backed.add(c)
            live.pop((c, k), None)  # its activations are in the working set
            peak = max(peak, sum(grads[i] for i in backed) + sum(live.values()) + bwd[c])
    return static - total_grads + peak


def build_region_elements(param: ParamInfo, strategy: LayerStrategy, tp: int, ep: int, zero3_degree: int) -> int:
    """Elements of ``param`` one rank reads at once while building (module docstring, ``E(w)``).

    ``tp``/``ep`` are the mesh degrees: tp splits column/row/vocab parameters of a Megatron layer,
    ep the expert dim of an EP layer's expert parameters (as ``search/layer_terms.param_groups``);
    ``zero3_degree`` is the ZeRO shard degree ``N`` of the parameter's group, used only when the
    layer is zero3: the largest ``torch.chunk`` of tensor dim 0 over ``N`` ranks.
    """
    shape = list(param.global_shape)
    if param.tp_role == "expert":
        split = (0, ep) if strategy.ep and ep > 1 and shape else None
    else:
        dim = TP_ROLE_TENSOR_DIM.get(param.tp_role)
        split = (dim, tp) if strategy.tp == "megatron" and tp > 1 and dim is not None and dim < len(shape) else None
    if split is not None:
        shape[split[0]] = math.ceil(shape[split[0]] / split[1])
    if strategy.state == "zero3" and zero3_degree > 1 and shape:
        shape[0] = math.ceil(shape[0] / zero3_degree)
    return math.prod(shape)


def build_transient_bytes(region_elements: Iterable[int]) -> float:
    """``BUILD_BYTES_PER_ELEMENT · max E(w)`` bytes over the regions a rank reads (0 for none)."""
    return float(BUILD_BYTES_PER_ELEMENT * max(region_elements, default=0))


# The update reads fp32 gradients (``runtime/optimizer.py``, ``_Slot.set_grad``).
STEP_GRAD_BYTES = 4
_STEP_GRAD_FRACTION = {"none": 0.0, "full": 1.0}  # "chunk" / "shard": 1/N


def step_grad_bytes(grad: str, psi: float, shard_degree: int) -> float:
    """Bytes of the fp32 gradient the optimizer step holds for ``psi`` parameters (module docstring):
    ``grad`` is ``StepWorkingSet.grad``; "chunk" and "shard" are 1/``shard_degree`` of them."""
    return STEP_GRAD_BYTES * psi * _STEP_GRAD_FRACTION.get(grad, 1.0 / max(1, shard_degree))


def step_pack_bytes(pack: int, member_bytes: Iterable[float], bucket_bytes: int) -> float:
    """``pack`` copies of the largest gradient bucket the members fill (module docstring): a bucket holds
    members up to ``bucket_bytes``, a larger member a bucket of its own; ``bucket_bytes`` 0: one per member."""
    sizes = list(member_bytes)
    if not pack or not sizes:
        return 0.0
    largest = max(sizes)
    return float(pack * (largest if bucket_bytes <= 0 else max(largest, min(bucket_bytes, sum(sizes)))))


def rank_bucket_bytes(bucketed: float, members: float, bucket_bytes: int) -> float:
    """Bucket copies of a rank whose bucketed gradients all fit one bucket (module docstring): ``Σ pack ·
    members`` when ``Σ members ≤ bucket_bytes``, else 0 (the layers' own ``step_transient`` price them)."""
    return bucketed if 0 < members <= bucket_bytes else 0.0


def optimizer_step_peak_bytes(layers: Iterable[MemoryBreakdown], bucket_bytes: int = 0) -> float:
    """Optimizer-step peak of one rank, bytes: ``Σ (params + grads + optimizer + step_grads) + max(max
    step_transient, rank_bucket_bytes)`` over the ``MemoryBreakdown`` of every layer the rank holds (module
    docstring); ``bucket_bytes`` is the schedule's."""
    total = sum(layers, MemoryBreakdown())
    return total.optimizer_step_resident + max(total.step_transient,
                                               rank_bucket_bytes(total.step_bucketed, total.step_bucket_members,
                                                                 bucket_bytes))


def build_peak_bytes(layers: Iterable[MemoryBreakdown]) -> float:
    """Build (materialization) peak of one rank, bytes: ``Σ params + Σ optimizer + max build_transient``
    over the ``MemoryBreakdown`` of every layer the rank holds (module docstring). Device bytes only:
    offload's host states, gradients, activations and buffers are not counted."""
    total = sum(layers, MemoryBreakdown())
    return total.build_resident + total.build_transient
