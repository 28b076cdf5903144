"""Topology cost model: the time and memory of one layer under one strategy, and of a plan.

The solver (``search/solver.py``) prices every (layer class, strategy) with
``layer_cost`` / ``layer_cost_table`` and checks whole plans with ``predict``.
Units: seconds, bytes, FLOP, bytes/s, FLOP/s. Collective formulas and the rank
layout are in ``search/comm.py``, memory formulas in ``search/memory.py``, the
pipeline schedule in ``search/pipeline.py``, the per-layer terms in
``search/layer_terms.py``; this docstring is the summary that ``explain``
refers to, and every term below appears by name in ``LayerCost.detail``.

Per micro-batch on one rank: ``b`` = micro_batch, ``s`` = seq_len,
``T = b·s/cp`` tokens; ``t`` = mesh.tp; ``m`` = micro-batches per step.

Compute (``fwd_matmul_s``, ``fwd_memory_s``, ``fwd_overhead_s``, ``loss_*_s``,
``fwd_compute_s``; docs/cost-model.md "Overheads" gives the sources)::

    F_gemm = T·matmul_flops_per_token / t_mm     (n_gemm GEMMs: the ≥2-D params, w = F_gemm/n_gemm)
    F_attn = T·attention_flops_per_token_seq·s / t_mm
    F_ew   = T·elementwise_flops_per_token · split
    bytes  = T·(bytes_per_token·split + 2·saved_interior_per_token_seq·s/t_int)
    eff(w) = eff · w/(w + knee)                                     (small GEMMs)
    roof   = max(F_gemm/(peak·eff(w)) + F_attn/(peak·attn_eff) + F_ew/peak, bytes/(hbm·hbm_eff))
    fwd_compute = roof + k·o + loss_fwd        (k = FORWARD_KERNELS[kind], o = per-kernel floor)
    bwd_compute = 2·roof + 2·k·o + loss_bwd    (dgrad + wgrad; 2× the bytes and kernels too)
    loss_fwd|bwd = T·vocab · b / (hbm·hbm_eff)      (head only, all V on every tp rank; b per logit:
                                                     eager fp32 log-softmax 18, compiled 4; layer_terms.LossForm)
    recompute   = fwd_compute (full) | attention core (selective) | 0
    eager (PPO's programs, on a GPU): fwd_compute = max(fwd_compute, k·h), bwd_compute = max(bwd_compute, 2·k·h)
                (h = calibration["eager_kernel_s"]: host seconds per counted kernel, layer_terms.eager_host_s)

Measured (v4): when ``cluster.calibration`` holds the model probe's samples for the layer's
signature, the training precision, ``t_mm`` and ``s`` (``search/measured.py``), ``fwd_compute`` and
``bwd_compute`` are the interpolated measured seconds at ``T`` tokens (``T/t`` under SP for layers
TP does not split) instead of the formulas; ``detail["fwd_measured"]`` is 1 then. Not for attention
with cp > 1 or MoE with EP.

``o`` = ``calibration["kernel_overhead_s"]`` or ``KERNEL_OVERHEAD_S`` (8 µs),
``knee`` = ``calibration["gemm_knee_flops"]`` or ``GEMM_KNEE_FLOPS`` (2e9),
``attn_eff`` = ``calibration["attention_efficiency"]`` or ``ATTENTION_EFFICIENCY`` (0.35).

``peak`` = ``device.peak_flops[train.precision]``, ``eff`` =
``device.matmul_efficiency``, ``hbm·hbm_eff`` = ``device.achieved_hbm_bandwidth``
(``Cluster.with_calibration`` writes measured values into the device). ``t_mm = t``
when the layer runs Megatron TP and has column/row/vocab parameters, or is
the LM head (vocab-parallel even with its weight tied to the embedding), else
1. The elementwise split follows the saved-activation split: the boundary
fraction ``B/(B+I)`` is divided by t only under SP, the interior
fraction by ``t_int = max(t_mm, t_sp)``. The score tensors of a math attention
(the ``*_seq`` saved bytes) are written once and read once: the ``2·`` term.
The selective-recompute attention core is
``max(F_attn/(peak·attn_eff), 2·T·Iₛ·s/t_int/hbm)``.
MoE: ``matmul_flops_per_token`` holds the routed (top-k) expert FLOPs; with
balanced routing EP leaves per-rank FLOPs unchanged (each rank runs E/ep experts
on ep× the tokens); expert parameters are not split by tp.

Critical-path communication per micro-batch (``tp_fwd_s`` … ``cp_bwd_s``; not
overlapped): the layer's declared TP/SP, EP and CP collectives (``autoshard/model_parallel.py``,
``model_parallel_form``; its table lists them), each priced over its axis's group at its
``payload_bytes`` (``p`` bytes per element: ``T·h`` hidden activations, ``T·V`` gathered logits,
``E·C·h`` MoE capacity buffer)::

    block (attention, mlp, …)  fwd AR(T·h·p) | SP: AG + RS;  bwd AR(T·h·p) | SP: RS + AG
    embedding (vocab-parallel) fwd AR(T·h·p) | SP: RS;       bwd 0 | SP: AG
    head (vocab-parallel)      fwd AG(T·V·p) (+ SP: AG(T·h·p)); bwd AR(T·h·p) | SP: RS
    SP, tp-replicated params   bwd AR(gradient) per parameter
    MoE with EP                fwd 2·A2A(E·C·h·p) over ep, bwd the same
    attention with cp > 1      fwd AG(K,V), bwd RS(dK,dV) over cp (priced only: not run)

Full recompute repeats the forward critical-path comm in backward. A stage boundary
(``boundary_send_s``) is the declared ``stage_boundary_form``: ``send_recv(T·h·p)`` forward and
back (``/t`` under SP).

Data-parallel communication per optimizer step (``dp_*``), over the gradient
group of ``N`` ranks (``comm.dp_group``; HSDP: ``dp_shard_group`` then
``dp_replicate_group``), ``Ψ`` = local parameters after TP/EP, ``w``/``q`` =
bytes per element of ``weight_comm``/``grad_comm`` (bf16: the compute dtype, 2 or 4 in fp32
training; fp32 4, int8/fp8 1, int4 0.5; quantized types add a 4-byte scale per block of up to 512
elements: ``model_parallel.wire_bytes_per_element``), ``p`` = param bytes::

    replicate  grad_once  = AR(qΨ)                                  (DDP, no_sync: last micro-batch)
    zero1      grad_once  = RS(qΨ);            post_step = AG(pΨ)
    zero2      like zero1                                            (the runtime accumulates full
    offload    like zero1                                            gradients and reduces once per
                                                                     step; ZeRO-1 and -2 differ only
                                                                     on quantized gradient wires)
    zero3      gather_fwd = m·AG(wΨ); gather_bwd = m·AG(wΨ); grad_per_mb = m·RS(qΨ)
    HSDP       zero3 inside dp_shard + grad_once = AR(qΨ/N_shard) across dp_replicate

Every collective also launches copy kernels on the compute stream
(``dp_kernels_s``, never hidden; 0 without data parallelism): ``o`` × (1 per
gather, 2 per reduction) = replicate 2, zero1/zero2/offload 3, zero3 4m
(+ 2 for the HSDP all-reduce) per step.

Quantized collectives add kernel time ``quant_s`` (never hidden; it occupies the
device): per zero3 gather, quantize the shard and dequantize the result,
``Ψ/N·(p+w) + Ψ·(w+p)`` bytes; per quantized gradient reduction ``2Ψ·(g+q)``
bytes; both at ``hbm · QUANT_KERNEL_EFFICIENCY`` (0.9).

Overlap (``f`` = ``OVERLAP_EFFICIENCY`` = 0.8 unless ``cluster.calibration``
holds a measured ``"overlap_efficiency"``):
the zero3 gather of layer i+1 is prefetched during layer i, gradient reduction
runs under the backward of earlier layers. With that layer's own compute as the
window (a homogeneous-neighbour approximation; ``Schedule.prefetch`` only sizes
buffers)::

    ov(c, w) = c − (1 − κ)·min(c, w)        (the part that does not fit + κ × the part hidden)
    exposed = ov(gather_fwd, f·m·fwd_compute)
            + ov(gather_bwd + grad_per_mb, f·m·(bwd_compute + recompute))
            + ov(grad_once, f·(bwd_compute + recompute))   (declared under the backward: graph nodes)
            + grad_after                         (declared after the backward: the optimizer's sync)
            + ov(post_step, f·fwd_compute)       (under the next step's forward where the runtime
                                                  gathers the layer in the compiled forward graph,
                                                  ``data_parallel_form``; else after the
                                                  update: ov(post_step, 0), all exposed)
            + quant_s + dp_kernels_s

monotone in every comm term and in compute. ``κ`` = ``OVERLAP_CONTENTION`` = 0.1
(or ``calibration["overlap_contention"]``): hidden comm is not free, NCCL
kernels take SMs and HBM bandwidth from the compute they hide behind. This is
what makes DDP/ZeRO-1 beat ZeRO-3 for a small model with a big batch (ZeRO-3
moves 1.5× the bytes, and once per micro-batch).

Nothing is fitted per model or per plan: a calibration measures the machine (``autoshard cluster
calibrate``: GEMM, attention, copy bandwidth, kernel floor, collectives, optimizer), and the
optional model probe (``--model``) times one model's layers, used only for that model.

Optimizer step (``optimizer_*``): ``Ψ_opt`` = Ψ/N for sharded states, Ψ for
replicate; the update of ``runtime/optimizer.py`` makes
``P`` fp32 passes (AdamW 8 with the fused kernel, SGD 6) and the write-back reads the master and
writes the compute copy: ``optimizer_hbm_s = Ψ_opt·(4P + 4 + p)/(hbm·hbm_eff)``
(38 B/param for bf16 AdamW), or ``Ψ_opt·calibration["adamw_s_per_param"]`` when measured. Offload: ``Ψ_opt·g/host_bw`` (grads down) ``+
Ψ_opt/cpu_adam_params_per_s`` ``+ Ψ_opt·p/host_bw`` (params up). Each
parameter tensor costs at least ``OPTIMIZER_KERNELS_PER_TENSOR·o`` (AdamW 11; measured:
``calibration["adamw_s_per_tensor"]``):
``optimizer_overhead_s`` = Σ_tensors max(share, floor) − the sum above.

Memory per rank: ``search/memory.py`` (ZeRO model states with shard degree N,
Korthikanti activations). Whole plan (``predict``): per pipeline rank k, the forward/backward
peak ``memory.step_peak_bytes``: it follows the rank's schedule through its layers. A forward reaching
layer i holds the other in-flight micro-batches' activations, ``A≤i`` and ``(2 + prefetch)·H_i`` of
gathers; the step's first backward reaching layer i (in reverse) holds ``A≤i``, the gradients of the
layers after i (``Gr>i``) and layer i's buffers ``G_i`` (or, without buffers, its own gradient ``Gr_i``); later backwards hold every
gradient. With f_k = ``pipeline.in_flight`` (1 on one stage) and m micro-batches::

    peak_k = Σ (params + optimizer) + max( (f − 1)·Σ A + max_i [A≤i + (2 + prefetch)·H_i] + [m > f]·Σ Gr,
                                           (f − 1)·Σ A + max_i [A≤i + Gr>i + max(G_i, Gr_i)],
                                           (f − 1 − [m ≤ f])·Σ A + Σ Gr + max_i [A≤i + G_i]  (m ≥ 2) )

Gradients exist only from the step's first backward on (the runtime, like
``zero_grad(set_to_none=True)``, drops them after each update). An interleaved rank keeps the
order-free bound ``Σ (params + grads + optimizer) + max(max G, (2 + prefetch)·max H) + f_k·Σ A``,
never below the timeline, and so does the search for every pipeline (``search/evaluate.py``: its
CP-SAT rows have no layer order across stage boundaries); on one stage the search prices the timeline
too (docs/cost-model.md, "Memory per rank"). A pipeline rank adds its receive buffers, ``m`` per boundary its
stages cross, each way (``boundary_buffer_bytes``).

Building the rank's program (``search/memory.py``, "Build"; ``memory.build_peak_bytes``) holds
the same params and device optimizer states, no gradients, activations or buffers, plus the
largest parameter region being read, twice in fp32::

    build_k = Σ (params + optimizer) + 8·max_w E(w)

The optimizer step (``search/memory.py``, "Optimizer step"; the working set each layer's form
declares, ``autoshard/data_parallel.step_working_set``) holds the model states, the backward's
gradients until the sync ends, the fp32 gradients the update reads where they are tensors of their
own (``step_grads``) and the copies of the bucket being packed (``step_transient``, a max, or the one
bucket all the rank's gradients fit, ``memory.rank_bucket_bytes``)::

    opt_k  = Σ (params + grads + optimizer + step_grads) + max(max step_transient, buckets)
    rank k's peak = max(peak_k, opt_k, build_k)  (``Predictions.memory_by_stage``; the search's limit)

``Predictions.build_peak_bytes`` = max_k build_k; ``memory_breakdown["build_transient"]`` is the
peak rank's ``8·max E``, ``["step_grads"]`` and ``["step_transient"]`` its optimizer-step terms.
On CPU ranks (``cluster.runs_on_cpu``) offload's host states are the rank's own memory and count.

Peaks are bytes of live tensors (``torch.cuda.max_memory_allocated``). When the runtime compiles
the plan (a GPU cluster, ep = cp = 1) and the graph carries the model's ``compiled_saved_scale``
(``passes/compiled_saved.py``: min-cut over eager saved bytes of the blocks, traced on meta),
block activations are scaled by it (``compiled_activation_scale``; ``predict`` only, the search
keeps eager activations: a conservative bound). The head's activations include the
loss, ``T·V·`` 12 B per logit eager, 4 compiled (``layer_terms.loss_bytes``, ``LossForm``). Fragmentation
(``ALLOCATOR_FRAGMENTATION = 0.05``) and ``reserved`` = ``calibration["reserved_bytes"]`` or
``RESERVED_BYTES`` = 1 GiB (CUDA context, NCCL) are headroom in the limit
(``usable_memory_bytes``), not part of the peak. MFU counts model FLOPs from the graph,
``3·Σ forward_flops`` per sequence (no recompute), over ``world·peak``;
``tokens_per_s`` is the whole job's (global_batch·seq_len/step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoshard import model_parallel
from autoshard.cluster import COMPILED_SAVED_SCALE_KEY, Cluster
from autoshard.errors import PlanError
from autoshard.graph import LayerInfo, ModelGraph
from autoshard.plan import LayerStrategy, Mesh, Plan, Predictions, Schedule
from autoshard.search import comm, layer_terms
from autoshard.search.layer_terms import (
    ALLOCATOR_FRAGMENTATION,
    ATTENTION_SCORE_TRAFFIC,
    OVERLAP_EFFICIENCY,
    RESERVED_BYTES,
    comm_bytes_per_element,
    usable_memory_bytes,
)
from autoshard.search.memory import (
    LayerLive,
    MemoryBreakdown,
    build_peak_bytes,
    interleaved_peak_bytes,
    live_buffers,
    optimizer_step_peak_bytes,
    rank_bucket_bytes,
    rematerialised_bytes,
    state_bytes,
    step_peak_bytes,
)
from autoshard.search.pipeline import in_flight, interleaved_order, pipeline_time, stage_rank, virtual_stages
from autoshard.train import TrainSpec

__all__ = [
    "ALLOCATOR_FRAGMENTATION",
    "ATTENTION_SCORE_TRAFFIC",
    "COST_MODEL_VERSION",
    "OVERLAP_EFFICIENCY",
    "RESERVED_BYTES",
    "LayerCost",
    "MemoryBreakdown",
    "comm_bytes_per_element",
    "layer_cost",
    "layer_cost_table",
    "lower_bound_step_time",
    "boundary_send_s",
    "boundary_terms",
    "plan_layer_costs",
    "predict",
    "usable_memory_bytes",
]

COST_MODEL_VERSION = "12"  # plans record it (fingerprints); bump when a prediction of the same plan changes


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer under one strategy, per micro-batch unless stated.

    ``fwd_s + bwd_s == compute_s + critical_comm_s``.
    """

    fwd_s: float  # forward compute time (incl. TP/SP/EP comm on the critical path)
    bwd_s: float  # backward compute (incl. recompute) time
    comm_exposed_s: float  # per optimizer step: data-parallel comm not hidden by overlap
    comm_total_s: float  # per optimizer step: all data-parallel comm, hidden or not
    optimizer_s: float  # per optimizer step: optimizer update time (incl. offload)
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    detail: dict[str, float] = field(default_factory=dict)  # named terms, for `explain`
    compute_s: float = 0.0  # per micro-batch: fwd + bwd + recompute compute, no comm
    critical_comm_s: float = 0.0  # per micro-batch: TP/SP/EP/CP comm on the critical path


# ---- public API ------------------------------------------------------------------------------


def layer_cost(
    layer: LayerInfo,
    strategy: LayerStrategy,
    mesh: Mesh,
    cluster: Cluster,
    train: TrainSpec,
    schedule: Schedule,
    *,
    region_entry: bool = True,
) -> LayerCost:
    """Cost of ``layer`` under ``strategy`` on ``mesh`` (formulas: module docstring).

    Times ``fwd_s``/``bwd_s`` are per micro-batch of ``schedule.micro_batch``
    sequences of ``train.seq_len``; data-parallel comm and the optimizer are per
    optimizer step of ``schedule.num_micro_batches`` micro-batches. Activation
    memory is for one micro-batch. ``region_entry=False`` marks a full-recompute
    layer that is not the first of its checkpoint region (it then keeps no
    input; ``search/memory.py``).
    """
    return _layer_cost(layer, strategy, mesh, cluster, train, schedule, region_entry, {})


def _layer_cost(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, cluster: Cluster, train: TrainSpec,
                schedule: Schedule, region_entry: bool, memo: dict) -> LayerCost:
    """``layer_cost`` with ``memo`` sharing the terms that do not depend on every strategy field
    (compute and critical comm depend on tp/sp/ep/recompute only, parameter groups on state/tp/ep)."""
    sizes = state_bytes(train)
    shape_key = ("sh", strategy.tp, strategy.sp, strategy.ep, strategy.recompute)
    if shape_key not in memo:
        sh = layer_terms.sharding(layer, strategy, mesh, schedule, train.seq_len)
        memo[shape_key] = (sh, layer_terms.compute_terms(layer, strategy, sh, cluster, train,
                                                         layer_terms.runs_compiled(mesh, cluster, train)),
                           layer_terms.critical_terms(layer, strategy, sh, mesh, cluster, sizes.param))
    sh, compute, critical = memo[shape_key]
    group_key = ("groups", strategy.state, strategy.tp, strategy.ep)
    if group_key not in memo:
        memo[group_key] = layer_terms.param_groups(layer, strategy, mesh)
    groups = memo[group_key]
    form = layer_terms.layer_form(layer, strategy, mesh, schedule, cluster, train)
    dp = layer_terms.dp_terms(layer, strategy, form, groups, mesh, cluster, schedule, sizes, compute)
    optimizer_key = ("optimizer", strategy.state, strategy.tp, strategy.ep)
    if optimizer_key not in memo:
        memo[optimizer_key] = layer_terms.optimizer_terms(layer, groups, strategy, cluster, train, sizes)
    optimizer = memo[optimizer_key]
    fwd_comm = critical["tp_fwd_s"] + critical["ep_fwd_s"] + critical["cp_fwd_s"]
    bwd_comm = critical["tp_bwd_s"] + critical["ep_bwd_s"] + critical["cp_bwd_s"] + critical["recompute_comm_s"]
    bwd_compute = compute["bwd_compute_s"] + compute["recompute_s"]
    memory = layer_terms.layer_memory(layer, strategy, groups, mesh, sh, sizes, region_entry, form,
                                      schedule.bucket_bytes, cluster.runs_on_cpu,
                                      layer_terms.runs_compiled(mesh, cluster, train))
    # a recomputed layer's backward holds its activations again (memory.rematerialised_bytes)
    remat = rematerialised_bytes(layer, strategy, mesh.tp, sh.tokens, sh.seq_len, region_entry)
    return LayerCost(
        fwd_s=compute["fwd_compute_s"] + fwd_comm,
        bwd_s=bwd_compute + bwd_comm,
        comm_exposed_s=dp["dp_exposed_s"],
        comm_total_s=dp["dp_total_s"],
        optimizer_s=sum(v for k, v in optimizer.items() if k.endswith("_s")),
        memory=replace(memory, buffers=memory.buffers + remat),
        detail={**compute, **critical, **dp, **optimizer, "tokens": sh.tokens, "rematerialised_bytes": remat},
        compute_s=compute["fwd_compute_s"] + bwd_compute,
        critical_comm_s=fwd_comm + bwd_comm,
    )


def layer_cost_table(
    layer: LayerInfo,
    strategies: list[LayerStrategy] | tuple[LayerStrategy, ...],
    mesh: Mesh,
    cluster: Cluster,
    train: TrainSpec,
    schedule: Schedule,
    *,
    region_entry: bool = True,
) -> list[LayerCost]:
    """``layer_cost`` of ``layer`` under each strategy, in order (one row per solver choice).

    Equal to calling ``layer_cost`` per strategy; the terms shared by strategies that differ only
    in ZeRO state or comm dtype are computed once.
    """
    memo: dict = {}
    return [_layer_cost(layer, s, mesh, cluster, train, schedule, region_entry, memo) for s in strategies]


def lower_bound_step_time(graph: ModelGraph, mesh: Mesh, cluster: Cluster, train: TrainSpec) -> float:
    """A step time no plan on ``mesh`` can beat: the model's compute spread perfectly over all ranks.

    Σ over layers of 3·roofline(layer, all global tokens) / world, GEMMs at the large-GEMM
    efficiency and attention at ``attention_efficiency``, plus the per-kernel floor and the vocab
    loss: every plan does at least this work (TP, CP and the data split divide the FLOPs and bytes
    by at most tp·cp·dp; every micro-batch runs all of a stage's kernels, and the slowest of pp
    stages runs at least 1/pp of them; recompute, comm, bubbles, small-GEMM losses and optimizer
    only add). Used to prune meshes before CP-SAT.
    """
    peak, eff = layer_terms.peak_flops(cluster, train), layer_terms.matmul_efficiency(cluster)
    attn_eff, hbm = layer_terms.attention_efficiency(cluster), layer_terms.hbm_bandwidth(cluster)
    compiled = layer_terms.runs_compiled(mesh, cluster, train)  # fused elementwise traffic
    overhead = (1.0 + layer_terms.BACKWARD_KERNEL_FACTOR) * layer_terms.kernel_overhead_s(cluster)
    loss = layer_terms.loss_form(compiled)
    loss_bytes = loss.fwd_bytes + loss.bwd_bytes
    tokens, s = train.global_batch * train.seq_len, train.seq_len
    spread = kernels = 0.0
    for layer in graph:
        matmul = (tokens * layer.matmul_flops_per_token / (peak * eff)
                  + tokens * layer.attention_flops_per_token_seq * s / (peak * attn_eff)
                  + tokens * layer.elementwise_flops_per_token / peak)
        score_bytes = ATTENTION_SCORE_TRAFFIC * tokens * layer.saved_interior_per_token_seq * s
        moved = layer.bytes_per_token
        if compiled:
            moved = min(moved, layer.input_bytes_per_token + layer.output_bytes_per_token
                        + layer.saved_boundary_per_token + layer.saved_interior_per_token)
        memory = (tokens * moved + score_bytes) / hbm
        spread += 3.0 * max(matmul, memory)
        if layer.kind == "head":
            spread += tokens * (layer.vocab or 0) * loss_bytes / hbm
        kernels += layer_terms.forward_kernels(layer)
    return spread / mesh.world_size + kernels * overhead / mesh.pp


def predict(graph: ModelGraph, plan: Plan, cluster: Cluster, train: TrainSpec) -> Predictions:
    """Whole-plan prediction: stage times, pipeline bubble, exposed comm, peak memory per rank.

    ``step_time_s = compute_s + exposed_comm_s + bubble_s + optimizer_s``, where
    the slowest pipeline rank sets the pipelined part (``search/pipeline.py``),
    then the rank with the longest tail of exposed data-parallel comm and
    optimizer update finishes the step. Memory: module docstring.
    """
    strategies = _strategies_in_graph_order(graph, plan)
    mesh, schedule = plan.mesh, plan.schedule
    ranks = [stage_rank(s.stage, mesh.pp, schedule) for s in strategies]
    costs = plan_layer_costs(graph, plan, cluster, train)
    p2p = _boundary_p2p(graph, strategies, ranks, mesh, cluster, schedule, train)
    receive = _boundary_buffers(graph, strategies, ranks, mesh, schedule, train)
    chunks = [s.stage // mesh.pp for s in strategies]  # the local chunk of each layer (interleaved schedules)
    stages = [_RankTotals.of(k, costs, ranks, p2p[k], plan, mesh, receive[k], chunks) for k in range(mesh.pp)]
    slow = max(stages, key=lambda r: r.micro_batch_s)
    tail = max(stages, key=lambda r: r.dp_exposed_s + r.optimizer_s)
    _, bubble = pipeline_time(slow.micro_batch_s, mesh.pp, schedule)
    m = schedule.num_micro_batches
    compute_s = m * slow.compute_s
    exposed_s = m * (slow.critical_comm_s + slow.p2p_s) + tail.dp_exposed_s
    step = compute_s + exposed_s + bubble + tail.optimizer_s
    peak = max(stages, key=lambda r: r.peak_bytes(cluster))
    peak_flops = layer_terms.peak_flops(cluster, train)
    model_flops = 3.0 * sum(layer.forward_flops(train.global_batch, train.seq_len) for layer in graph)
    return Predictions(
        step_time_s=step,
        compute_s=compute_s,
        exposed_comm_s=exposed_s,
        bubble_s=bubble,
        optimizer_s=tail.optimizer_s,
        peak_memory_bytes=int(peak.peak_bytes(cluster)),
        memory_by_stage=tuple(int(r.peak_bytes(cluster)) for r in stages),
        memory_breakdown=peak.breakdown(cluster),
        build_peak_bytes=int(max(r.build_bytes for r in stages)),
        tokens_per_s=train.global_batch * train.seq_len / step if step > 0 else 0.0,
        mfu=model_flops / (step * mesh.world_size * peak_flops) if step > 0 else 0.0,
        caveats=pricing_caveats(graph, cluster),
    )


def plan_layer_costs(graph: ModelGraph, plan: Plan, cluster: Cluster, train: TrainSpec) -> list[LayerCost]:
    """``LayerCost`` of every layer of ``graph`` under ``plan``, in graph order, as ``predict`` sums them:
    checkpoint regions priced, block activations scaled when the runtime compiles the plan
    (``compiled_activation_scale``). ``autoshard/report.py`` lays them out on the step's timeline."""
    strategies = _strategies_in_graph_order(graph, plan)
    _check_batch(plan, train)
    entries = _region_entries(graph, strategies)
    costs = _region_rematerialisation([
        layer_cost(layer, s, plan.mesh, cluster, train, plan.schedule, region_entry=entry)
        for layer, s, entry in zip(graph.layers, strategies, entries)
    ], strategies, entries)
    scale = compiled_activation_scale(graph, plan, cluster) if train.compiled else 1.0
    if scale < 1.0:  # the runtime compiles this plan: inductor saves less in the blocks (not fewer gathered weights)
        costs = [replace(c, memory=replace(c.memory, activations=(c.memory.activations - c.memory.kept_gathered) * scale
                                           + c.memory.kept_gathered))
                 if layer.block is not None else c for layer, c in zip(graph.layers, costs)]
    return costs


def boundary_terms(graph: ModelGraph, plan: Plan, cluster: Cluster, train: TrainSpec) -> tuple[list[float], list[float]]:
    """Per pipeline rank: (send/recv seconds per micro-batch it pays at the boundaries it sends from, bytes of
    the step's receive buffers), as ``predict`` adds them."""
    strategies = _strategies_in_graph_order(graph, plan)
    ranks = [stage_rank(s.stage, plan.mesh.pp, plan.schedule) for s in strategies]
    return (_boundary_p2p(graph, strategies, ranks, plan.mesh, cluster, plan.schedule, train),
            _boundary_buffers(graph, strategies, ranks, plan.mesh, plan.schedule, train))


def pricing_caveats(graph: ModelGraph, cluster: Cluster) -> tuple[str, ...]:
    """What makes a prediction for ``graph`` on ``cluster`` less certain, one sentence each (``inspect``
    prints them): ops capture could not price, a GPU cluster without calibration, and calibration
    measured on another model (its layer times are then not used)."""
    out = []
    unpriced = graph.coverage.unaccounted
    if unpriced:
        top = ", ".join(name for name, _ in sorted(unpriced.items(), key=lambda kv: -kv[1])[:3])
        out.append(f"{sum(unpriced.values())} op(s) capture could not price ({top}): their time and memory "
                   "are not in the prediction")
    calibration = cluster.calibration
    if not calibration and not cluster.runs_on_cpu:
        out.append("uncalibrated cluster: GEMM efficiency, links and overlap are the preset's "
                   "(`autoshard cluster calibrate` measures them)")
    if not cluster.runs_on_cpu and graph.compiled_saved_scale is None and \
            calibration.get("layer_times.model") != graph.model_name:
        out.append("compiled activations not measured for this model (passes.compiled_saved.with_compiled_saved_scale): "
                   "a compiled plan's block activations are priced as eager autograd saves them")
    measured_on = calibration.get("layer_times.model")
    if measured_on is not None and measured_on != graph.model_name:
        out.append(f"layer times were measured on {measured_on}, not {graph.model_name}: compute is the roofline's")
    return tuple(out)


def compiled_activation_scale(graph: ModelGraph, plan: Plan, cluster: Cluster) -> float:
    """Scale of block activations in ``predict`` when the runtime compiles ``plan`` (a GPU cluster,
    ``Plan.compilable``): the model's own ``graph.compiled_saved_scale`` (``passes/compiled_saved.py``,
    measured on meta for any model), else a calibration's model-probe ``compiled_saved_scale`` for
    this model; else 1. The search keeps the eager activations (a conservative bound)."""
    if cluster.runs_on_cpu or not plan.compilable:
        return 1.0
    if graph.compiled_saved_scale is not None:
        return float(graph.compiled_saved_scale)
    scale = cluster.calibration.get(COMPILED_SAVED_SCALE_KEY)
    if scale is None or cluster.calibration.get("layer_times.model") != graph.model_name:
        return 1.0
    return float(scale)


def _live(cost: LayerCost) -> LayerLive:
    return LayerLive(cost.memory.activations, cost.memory.grads, cost.memory.buffers, cost.memory.gathered)


def _interleaved_peak(static: float, costs: list[LayerCost], ranks: list[int], chunks: list[int], rank: int, v: int,
                      plan: Plan, mesh: Mesh) -> float:
    """``memory.interleaved_peak_bytes`` of pipeline rank ``rank``: its layers by local chunk, the schedule's order."""
    by_chunk: list[list[LayerLive]] = [[] for _ in range(v)]
    for cost, k, c in zip(costs, ranks, chunks):
        if k == rank:
            by_chunk[c].append(_live(cost))
    order = interleaved_order(mesh.pp, v, plan.schedule.num_micro_batches, rank)
    return interleaved_peak_bytes(static, by_chunk, order, plan.schedule.prefetch)


@dataclass(frozen=True)
class _RankTotals:
    """One pipeline rank's per-micro-batch time, per-step tail and memory."""

    compute_s: float  # per micro-batch
    critical_comm_s: float  # per micro-batch
    p2p_s: float  # per micro-batch
    dp_exposed_s: float  # per step
    optimizer_s: float  # per step
    static: MemoryBreakdown  # params, grads, optimizer, host summed; buffers = the live gather buffers
    activations: float  # all in-flight micro-batches
    grads_beside_activations: bool = True  # False: one micro-batch on one stage (module docstring)
    build_bytes: float = 0.0  # build (materialization) peak: search/memory.build_peak_bytes
    optimizer_step_bytes: float = 0.0  # gradient sync to write-back: search/memory.optimizer_step_peak_bytes
    step_peak: float = 0.0  # forward/backward peak: search/memory.step_peak_bytes

    @property
    def micro_batch_s(self) -> float:
        return self.compute_s + self.critical_comm_s + self.p2p_s

    @classmethod
    def of(cls, rank: int, costs: list[LayerCost], ranks: list[int], p2p_s: float, plan: Plan,
           mesh: Mesh, receive_bytes: float = 0.0, chunks: list[int] | None = None) -> _RankTotals:
        mine = [c for c, k in zip(costs, ranks) if k == rank]
        v = virtual_stages(plan.schedule)
        summed = sum((c.memory for c in mine), MemoryBreakdown())
        buffers = live_buffers(max((c.memory.buffers for c in mine), default=0.0),
                               max((c.memory.gathered for c in mine), default=0.0), plan.schedule.prefetch)
        static = MemoryBreakdown(params=summed.params, grads=summed.grads, optimizer=summed.optimizer, buffers=buffers,
                                 host=summed.host, build_transient=summed.build_transient, step_grads=summed.step_grads,
                                 step_transient=max(summed.step_transient, rank_bucket_bytes(
                                     summed.step_bucketed, summed.step_bucket_members, plan.schedule.bucket_bytes)))
        return cls(
            compute_s=sum(c.compute_s for c in mine),
            critical_comm_s=sum(c.critical_comm_s for c in mine),
            p2p_s=p2p_s,
            dp_exposed_s=sum(c.comm_exposed_s for c in mine),
            optimizer_s=sum(c.optimizer_s for c in mine),
            static=static,
            activations=summed.activations * in_flight(plan.schedule, mesh.pp, rank),
            grads_beside_activations=plan.schedule.num_micro_batches > 1 or mesh.pp > 1,
            build_bytes=build_peak_bytes(c.memory for c in mine),
            optimizer_step_bytes=optimizer_step_peak_bytes((c.memory for c in mine), plan.schedule.bucket_bytes),
            step_peak=(_interleaved_peak(static.model_states, costs, ranks, chunks, rank, v, plan, mesh)
                       if v > 1 and chunks is not None else
                       step_peak_bytes(static.model_states, [_live(c) for c in mine], plan.schedule.prefetch,
                                       in_flight(plan.schedule, mesh.pp, rank), plan.schedule.num_micro_batches,
                                       v > 1))
            + receive_bytes,
        )

    def step_bytes(self) -> float:
        """Peak bytes of the forward and backward (``memory.step_peak_bytes``, ``memory.interleaved_peak_bytes``)."""
        return self.step_peak

    def allocated_bytes(self) -> float:
        """The rank's peak: the largest of the forward/backward's, the optimizer step's and the build's."""
        return max(self.step_bytes(), self.optimizer_step_bytes, self.build_bytes)

    def peak_bytes(self, cluster: Cluster) -> float:
        """Peak bytes of live tensors (what ``torch.cuda.max_memory_allocated`` reports); the allocator's
        fragmentation and the reserved bytes are headroom the memory limit keeps (``usable_memory_bytes``)."""
        return self.allocated_bytes()

    def breakdown(self, cluster: Cluster) -> dict[str, int]:
        s = self.static
        return {
            "params": int(s.params),
            "grads": int(s.grads),
            "optimizer": int(s.optimizer),
            "activations": int(self.activations),
            "buffers": int(s.buffers),
            "headroom_fragmentation": int(self.allocated_bytes() * ALLOCATOR_FRAGMENTATION),  # not in the peak
            "headroom_reserved": int(layer_terms.reserved_bytes(cluster)),  # not in the peak
            "host": int(s.host),
            "build_transient": int(s.build_transient),  # build peak = params + optimizer + this
            # optimizer-step peak = params + grads + optimizer + these two
            "step_grads": int(s.step_grads),
            "step_transient": int(s.step_transient),
            "step_peak": int(self.step_peak),  # forward/backward peak (the other two peaks: build, optimizer step)
        }


def _strategies_in_graph_order(graph: ModelGraph, plan: Plan) -> list[LayerStrategy]:
    by_name = {s.layer: s for s in plan.layers}
    missing = [layer.name for layer in graph if layer.name not in by_name]
    extra = sorted(set(by_name) - {layer.name for layer in graph})
    if missing or extra:
        raise PlanError(
            f"plan {plan.model_name!r} does not match graph {graph.model_name!r}: "
            f"no strategy for {missing[:5]}, unknown layers {extra[:5]}; re-run the search for this model"
        )
    return [by_name[layer.name] for layer in graph]


def _check_batch(plan: Plan, train: TrainSpec) -> None:
    s, dp = plan.schedule, plan.mesh.dp
    if s.micro_batch * s.num_micro_batches * dp != train.global_batch:
        raise PlanError(
            f"micro_batch {s.micro_batch} × num_micro_batches {s.num_micro_batches} × dp {dp} = "
            f"{s.micro_batch * s.num_micro_batches * dp} sequences, but TrainSpec.global_batch="
            f"{train.global_batch}; choose a schedule whose product equals the global batch"
        )


def _region_rematerialisation(costs: list[LayerCost], strategies: list[LayerStrategy],
                              entries: list[bool]) -> list[LayerCost]:
    """``costs`` with each full-recompute checkpoint region's rematerialised bytes (``memory.rematerialised_bytes``)
    summed onto the buffers of its last layer, where the region's backward starts by recomputing all of it,
    instead of each layer's own on its own buffers (``_layer_cost``); with them, the other layers' gathered
    parameters (ZeRO-3: the recomputed forward gathers each again and keeps it for that layer's backward)."""
    out = list(costs)
    start = 0
    for i, s in enumerate(strategies):
        if entries[i]:
            start = i
        last = i + 1 == len(costs) or entries[i + 1] or strategies[i + 1].recompute != "full"
        if s.recompute != "full" or not last or i == start:
            continue
        held = 0.0  # rematerialised by the region's recompute and not yet freed, when layer j's backward runs
        for j in range(start, i + 1):
            held += costs[j].detail.get("rematerialised_bytes", 0.0) + (costs[j - 1].memory.gathered if j > start else 0.0)
            own = costs[j].detail.get("rematerialised_bytes", 0.0)
            out[j] = replace(costs[j], memory=replace(costs[j].memory, buffers=costs[j].memory.buffers - own + held))
    return out


def _region_entries(graph: ModelGraph, strategies: list[LayerStrategy]) -> list[bool]:
    """Whether each layer keeps its input under full recompute: False inside a checkpoint region.

    A region is a maximal run of consecutive full-recompute layers of one block and one stage.
    """
    entries = []
    for i, (layer, s) in enumerate(zip(graph.layers, strategies)):
        prev, prev_s = (graph.layers[i - 1], strategies[i - 1]) if i else (None, None)
        inside = (
            prev is not None
            and s.recompute == "full"
            and prev_s.recompute == "full"
            and layer.block is not None
            and layer.block == prev.block
            and s.stage == prev_s.stage
        )
        entries.append(not inside)
    return entries


def boundary_send_s(layer: LayerInfo, sp: bool, mesh: Mesh, cluster: Cluster, schedule: Schedule,
                    train: TrainSpec) -> float:
    """Send/recv seconds per micro-batch on the rank sending across a stage boundary that follows ``layer``:
    the declared sender side (``model_parallel.stage_boundary_form``: the activation forward, its gradient
    back), each ``send_recv(b·s/cp · h · p / (t if SP))`` over the pipeline group's link."""
    if mesh.pp == 1:
        return 0.0
    size, stride = comm.pp_group(mesh)
    link = comm.group_link(cluster, size, stride)
    tokens = schedule.micro_batch * train.seq_len / mesh.cp
    strategy = LayerStrategy(layer=layer.name, sp=sp)
    compute_bytes = state_bytes(train).param
    return sum(comm.send_recv_time(model_parallel.payload_bytes(c, layer, strategy, mesh, tokens, compute_bytes), link)
               for c in model_parallel.stage_boundary_form(sends=True))


def boundary_buffer_bytes(layer: LayerInfo, sp: bool, mesh: Mesh, schedule: Schedule, train: TrainSpec) -> float:
    """Bytes of one value crossing a stage boundary that follows ``layer`` (one micro-batch): what each side
    keeps a receive buffer of, per micro-batch, for the whole step (torch.distributed.pipelining allocates
    one per micro-batch: the activation on the receiving rank, its gradient on the sending rank)."""
    if mesh.pp == 1:
        return 0.0
    tokens = schedule.micro_batch * train.seq_len / mesh.cp
    strategy = LayerStrategy(layer=layer.name, sp=sp)
    return model_parallel.payload_bytes(model_parallel.stage_boundary_form(sends=True)[0], layer, strategy, mesh,
                                        tokens, state_bytes(train).param)


def _boundary_buffers(graph: ModelGraph, strategies: list[LayerStrategy], ranks: list[int], mesh: Mesh,
                      schedule: Schedule, train: TrainSpec) -> list[float]:
    """Per pipeline rank, the boundary buffers of the step: ``m`` receive buffers per boundary it sends across
    (gradients) and ``m`` per boundary it receives across (activations), each ``boundary_buffer_bytes``; and,
    where it sends, the outputs it keeps for their backward (torch.distributed.pipelining holds a stage's
    output until its micro-batch's backward): ``in_flight`` of them, which no layer saves (a checkpoint
    region keeps only its input)."""
    out = [0.0] * mesh.pp
    for i in range(len(strategies) - 1):
        if strategies[i].stage != strategies[i + 1].stage:
            one = boundary_buffer_bytes(graph.layers[i], strategies[i].sp, mesh, schedule, train)
            out[ranks[i]] += (schedule.num_micro_batches + in_flight(schedule, mesh.pp, ranks[i])) * one
            out[ranks[i + 1]] += schedule.num_micro_batches * one
    return out


def _boundary_p2p(graph: ModelGraph, strategies: list[LayerStrategy], ranks: list[int], mesh: Mesh,
                  cluster: Cluster, schedule: Schedule, train: TrainSpec) -> list[float]:
    """Per pipeline rank, send/recv seconds per micro-batch at each stage boundary it sends from."""
    out = [0.0] * mesh.pp
    for i in range(len(strategies) - 1):
        if strategies[i].stage != strategies[i + 1].stage:
            out[ranks[i]] += boundary_send_s(graph.layers[i], strategies[i].sp, mesh, cluster, schedule, train)
    return out
