"""Per-layer cost terms: compute, critical-path comm, data-parallel comm, optimizer, memory.

The private building blocks of ``search/cost_model.py``, whose module docstring
writes every formula out with its units; each function here returns its terms
under the names that docstring (and ``LayerCost.detail``) uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard import model_parallel
from autoshard.cluster import Cluster
from autoshard.graph import LayerInfo
from autoshard.data_parallel import DataParallelForm, data_parallel_form, step_working_set
from autoshard.plan import LayerStrategy, Mesh, Schedule
from autoshard.search import comm, measured
from autoshard.search.memory import (
    TP_SPLIT_ROLES,
    STEP_GRAD_BYTES,
    MemoryBreakdown,
    StateBytes,
    activation_bytes,
    backward_buffer_bytes,
    backward_working_bytes,
    build_region_elements,
    build_transient_bytes,
    model_state_memory,
    sp_gathered_input_bytes,
    step_grad_bytes,
    step_pack_bytes,
    tp_shardable,
)
from autoshard.train import TrainSpec

OVERLAP_EFFICIENCY = 0.8  # fraction of a compute window a collective can hide behind
# Hidden communication is not free: NCCL kernels running beside GEMMs take SMs (ring kernels use
# 8–32 of an H100's 132) and HBM bandwidth (every ring step reads and writes its chunk), slowing the
# compute they hide behind. Each second of comm hidden under compute costs this many seconds.
OVERLAP_CONTENTION = 0.1
QUANT_KERNEL_EFFICIENCY = 0.9  # quantize/dequantize kernels vs raw HBM bandwidth (REFERENCES: ≥ 90% goal)
ATTENTION_SCORE_TRAFFIC = 2.0  # saved score tensors: written once, read once
ALLOCATOR_FRAGMENTATION = 0.05
RESERVED_BYTES = 2**30

# ---- the time a FLOP/byte roofline does not see (docs/cost-model.md, "Overheads") ----------------
# Per-kernel floor: CUDA launch (2–5 µs) + eager PyTorch dispatch (Python → ATen → stream, 4–10 µs
# per op on a server CPU). Eager kernels run back to back, so at small sizes the GPU idles for
# about this long per kernel. Measured by `autoshard cluster calibrate` (a chain of tiny ops).
KERNEL_OVERHEAD_S = 8e-6
# Forward CUDA kernels per layer of the reference (eager, Llama/GPT-style) models, by kind: capture
# does not record op counts per layer, so they are derived from autoshard/models/layers.py:
# RMSNorm 8 (cast, pow, mean, add, rsqrt, mul, cast, mul); attention 17 (q, k, v, o GEMMs, RoPE
# 5 × 2, head merge copy, SDPA, residual add); SwiGLU MLP 6 (3 GEMMs, silu, mul, residual add);
# head 1 GEMM (the loss kernels are LOSS_KERNELS); MoE 10 + 6 per expert (router, top-k, dispatch;
# per expert gather, 3 GEMMs, act, scatter-add; ep = 1, an upper bound under EP).
FORWARD_KERNELS = {"embedding": 1, "norm": 8, "attention": 17, "mlp": 6, "moe": 10, "head": 1,
                   "value_head": 2, "other": 4}
MOE_KERNELS_PER_EXPERT = 6
BACKWARD_KERNEL_FACTOR = 2.0  # dgrad + wgrad: each forward op has about two backward kernels
# Small GEMMs: efficiency(work) = eff · work / (work + knee), work = 2·M·N·K FLOP of one GEMM. With
# launch excluded, a 1024³ bf16 GEMM (2.1e9 FLOP) on an H100 runs at about half the large-GEMM
# rate (public cuBLAS sweeps), so knee ≈ 2e9 FLOP. Fitted by `autoshard cluster calibrate`.
GEMM_KNEE_FLOPS = 2e9
# Fused attention (SDPA flash / memory-efficient) on the captured dense attention FLOPs: FlashAttention-2
# reaches 300–350 TFLOP/s of an H100's 989 in bf16, forward and backward (Dao 2023).
ATTENTION_EFFICIENCY = 0.35
# Loss over the vocabulary: how Program.step runs the user's loss function on the head's logits, declared
# once per form (``LossForm``, ``loss_form``). Bytes per logit moved, and held at the loss's peak.
#
# Eager (CPU ranks, eager programs; runtime/ppo_losses.py's logits.float().log_softmax): forward upcast
# (read 2, write 4), log-softmax (max and sum-exp reads 4 + 4, write 4) = 18; backward softmax grad
# (read 4 + 4, write 4), downcast (read 4, write 2) = 18. Held: at the start of its backward the saved
# fp32 log-probabilities (4), the incoming fp32 gradient of the log-probabilities (4) and the fp32
# gradient of the logits being produced (4) are live together: 12. The bf16 logits are not: nothing
# saves them for backward and Program.step drops the model's outputs when the loss function returns.
# The forward side peaks lower, at about 8 (bf16 logits, their contiguous copy, the fp32 copy).
# Checked on the CPU by tracking live tensor bytes through the benchmarks' policy loss: 8.1 forward,
# 12.1 backward.
#
# Compiled (a program compiled by inductor on CUDA: Program.step compiles the loss function too, as
# torchtitan compiles its loss): the upcast, log-softmax and gather fuse into a reduction over each row
# that reads the bf16 logits (a max pass and a sum-exp pass: 4) and saves only them and a per-row
# log-sum-exp; the backward reads them once and writes the bf16 gradient of the logits (4). Held: the
# saved bf16 logits (2) and their gradient (2): 4 (the inductor-compiled benchmarks' policy loss on the
# CPU, allocations counted by torch.profiler: 4.00).
#
# Capture sees the model up to the logits only, so none of this is in the head's captured saved bytes.
LOSS_BYTES_PER_LOGIT_FWD = 18.0  # the eager form's (LossForm below)
LOSS_BYTES_PER_LOGIT_BWD = 18.0
LOSS_KERNELS = 4  # upcast, log-softmax, gather of the taken token, reduction (the eager count, both forms)
# Data-parallel collectives launch copy kernels on the compute stream besides the NCCL kernel (whose
# launch α covers): a gather copies out of its flat buffer (1), a reduction copies grads into the
# flat buffer and back out (2). They sit on the critical path: DP_KERNELS · kernel_overhead each.
DP_KERNELS = {"gather": 1, "reduce": 2}
# Optimizer (runtime/optimizer.py, one slot per parameter tensor). Passes over fp32 elements (a read
# or a write of 4 bytes per element): AdamW runs the fused kernel (torch._fused_adamw_: reads master,
# gradient and both moments, writes master and moments: 7), + the grad-norm read 1 (8; the foreach
# path it replaced made 21 + 1: measured on an H100, 7.1 ms against 19.6 ms for 650M parameters,
# benchmarks/results/runtime_h100x2_2026-11-26_run3/optimizer_h100.json); SGD mul_ 2, add_ 3, + 1.
# Write-back reads the fp32 master and writes the compute copy. Kernels per tensor: the update's ops
# + norm + write-back + grad cast.
OPTIMIZER_FP32_PASSES = {"adamw": 8, "sgd": 6}
OPTIMIZER_KERNELS_PER_TENSOR = {"adamw": 11, "sgd": 5}
# The runtime all-gathers vocab-parallel logits before the user's loss (passes/insert_collectives.py:
# vocab_shard → replicate), so every tp rank holds all V logits.
LOSS_PEAK_BYTES_PER_LOGIT = 12.0  # the eager form's


@dataclass(frozen=True)
class LossForm:
    """How the loss over the vocabulary runs (the comment above): bytes per logit of one micro-batch."""

    name: str
    fwd_bytes: float  # moved by the loss's forward
    bwd_bytes: float  # moved by its backward
    peak_bytes: float  # held at the loss's peak


EAGER_LOSS = LossForm("eager", LOSS_BYTES_PER_LOGIT_FWD, LOSS_BYTES_PER_LOGIT_BWD, LOSS_PEAK_BYTES_PER_LOGIT)
COMPILED_LOSS = LossForm("compiled", 4.0, 4.0, 4.0)


def loss_form(compiled: bool) -> LossForm:
    """The loss's form when the runtime compiles the plan (``runs_compiled``; runtime/program.py compiles the
    loss function exactly then: ``compiles_loss``) or not."""
    return COMPILED_LOSS if compiled else EAGER_LOSS

_QUANTIZED = ("fp8", "int8", "int4")
_SHARDED_STATES = ("zero1", "zero2", "zero3", "offload")


def comm_bytes_per_element(dtype: str, compute_bytes: float = 2.0) -> float:
    """Wire bytes per element of a collective on the ``dtype`` wire, scales included
    (``model_parallel.wire_bytes_per_element``: ``"bf16"`` is the compute dtype, ``compute_bytes``)."""
    return model_parallel.wire_bytes_per_element(dtype, compute_bytes)


def usable_memory_bytes(cluster: Cluster) -> float:
    """Device bytes the model may plan for: (memory − reserved) / (1 + fragmentation)."""
    return (cluster.device.memory_bytes - reserved_bytes(cluster)) / (1.0 + ALLOCATOR_FRAGMENTATION)


# ---- device rates ----------------------------------------------------------------------------


def peak_flops(cluster: Cluster, train: TrainSpec) -> float:
    """Dense peak FLOP/s of the device in the training precision."""
    return cluster.peak_flops(train.precision)


def matmul_efficiency(cluster: Cluster) -> float:
    """Achieved / peak for large GEMMs (calibration is applied into the device spec)."""
    return cluster.device.matmul_efficiency


def hbm_bandwidth(cluster: Cluster) -> float:
    """Achievable HBM bytes/s: peak · hbm_efficiency."""
    return cluster.device.achieved_hbm_bandwidth


def overlap_efficiency(cluster: Cluster) -> float:
    """Fraction of a compute window a collective hides behind (``OVERLAP_EFFICIENCY`` unless calibrated)."""
    return cluster.calibration.get("overlap_efficiency", OVERLAP_EFFICIENCY)


def overlap_contention(cluster: Cluster) -> float:
    """Seconds of compute slowdown per second of hidden comm (``OVERLAP_CONTENTION`` unless calibrated)."""
    return cluster.calibration.get("overlap_contention", OVERLAP_CONTENTION)


def _overlapped(comm_s: float, window_s: float, contention: float) -> float:
    """Cost of ``comm_s`` overlapped with a ``window_s`` compute window: the part that does not fit,
    plus ``contention`` × the part hidden (= comm − (1 − κ)·min(comm, window); monotone in comm)."""
    hidden = min(comm_s, max(window_s, 0.0))
    return comm_s - hidden + contention * hidden


def kernel_overhead_s(cluster: Cluster) -> float:
    """Seconds per eager kernel (launch + dispatch): ``KERNEL_OVERHEAD_S`` unless calibrated."""
    return cluster.calibration.get("kernel_overhead_s", KERNEL_OVERHEAD_S)


def eager_host_s(layer: LayerInfo, cluster: Cluster) -> tuple[float, float, float]:
    """Host seconds of the layer's (forward, backward, no_grad forward) in an eager program on a GPU: its
    counted kernels at the calibrated ``eager_kernel_s`` / ``eager_inference_kernel_s`` (``autoshard/calibrate.py``,
    the ``EAGER_PROBE``'s step: module calls, dispatch, autograd and the launch per op); zeros when not
    calibrated. An eager program launches asynchronously, so a layer takes the longer of its device time and
    this (``compute_terms``): the floor that binds for small per-rank work."""
    train = cluster.calibration.get("eager_kernel_s")
    if train is None or cluster.runs_on_cpu:
        return 0.0, 0.0, 0.0
    n = forward_kernels(layer)
    inference = cluster.calibration.get("eager_inference_kernel_s", train)
    return n * train, BACKWARD_KERNEL_FACTOR * n * train, n * inference


def gemm_knee_flops(cluster: Cluster) -> float:
    """GEMM work (FLOP) at which efficiency is half the large-GEMM value: ``GEMM_KNEE_FLOPS`` unless calibrated."""
    return cluster.calibration.get("gemm_knee_flops", GEMM_KNEE_FLOPS)


def attention_efficiency(cluster: Cluster) -> float:
    """Achieved / peak of fused attention: ``ATTENTION_EFFICIENCY`` unless calibrated."""
    return cluster.calibration.get("attention_efficiency", ATTENTION_EFFICIENCY)


def gemm_efficiency(work_flops: float, cluster: Cluster) -> float:
    """Achieved / peak of one GEMM of ``work_flops``: ``eff · work / (work + knee)``."""
    if work_flops <= 0:
        return matmul_efficiency(cluster)
    return matmul_efficiency(cluster) * work_flops / (work_flops + gemm_knee_flops(cluster))


def gemm_count(layer: LayerInfo) -> int:
    """GEMMs in the layer's forward: its ≥ 2-D parameters (a stacked expert weight counts once), or
    its tied weights; at least 1 when it has matmul FLOPs."""
    n = sum(1 for p in layer.params if len(p.global_shape) >= 2) + len(layer.tied_params)
    return max(n, 1 if layer.matmul_flops_per_token > 0 else 0)


def forward_kernels(layer: LayerInfo) -> float:
    """Forward CUDA kernels of the layer (``FORWARD_KERNELS`` by kind; loss kernels on the head)."""
    n = FORWARD_KERNELS.get(layer.kind, FORWARD_KERNELS["other"])
    if layer.kind == "moe":
        n += MOE_KERNELS_PER_EXPERT * (layer.num_experts or 1)
    if layer.kind == "head" and layer.vocab:
        n += LOSS_KERNELS
    return float(n)


def reserved_bytes(cluster: Cluster) -> float:
    """Device bytes outside the allocator: CUDA context, NCCL and cuBLAS workspaces."""
    return cluster.calibration.get("reserved_bytes", RESERVED_BYTES)


# ---- compute ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """How tensor/sequence parallelism divides one layer's work on one rank."""

    tokens: float  # T = b·s/cp
    seq_len: int
    tp_mm: int  # divides matmul/attention FLOPs
    tp_boundary: int  # divides boundary (replicated-under-TP) elementwise work: t under SP
    tp_interior: int  # divides interior elementwise work
    cp: int = 1  # context-parallel degree (tokens is already divided by it)

    def elementwise_split(self, layer: LayerInfo) -> float:
        """Fraction of the layer's elementwise work one rank does."""
        b, i = layer.saved_boundary_per_token, layer.saved_interior_per_token
        interior = i / (b + i) if b + i > 0 else (1.0 if self.tp_mm > 1 else 0.0)
        return (1.0 - interior) / self.tp_boundary + interior / self.tp_interior


def sharding(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, schedule: Schedule, seq_len: int) -> Sharding:
    """Tokens on this rank and the tp divisors of each kind of work."""
    sp = strategy.sp and mesh.tp > 1
    tp_mm = mesh.tp if strategy.tp == "megatron" and tp_shardable(layer) else 1
    tp_boundary = mesh.tp if sp else 1
    tokens = schedule.micro_batch * seq_len / mesh.cp
    return Sharding(tokens, seq_len, tp_mm, tp_boundary, max(tp_mm, tp_boundary), mesh.cp)


def compute_terms(layer: LayerInfo, strategy: LayerStrategy, sh: Sharding, cluster: Cluster,
                   train: TrainSpec, compiled: bool = False) -> dict[str, float]:
    """Forward/backward/recompute compute seconds of one micro-batch (module docstring).

    ``compiled`` (``runs_compiled``): the runtime compiles the plan, so elementwise chains are fused:
    the memory term moves the layer's inputs, outputs and saved activations once instead of every
    eager op's operands (capture's per-op traffic stays the upper bound). The per-kernel floor is
    the same eager count at the calibrated ``kernel_overhead_s`` either way: replacing it with the
    GPU's gap between kernels replayed from a CUDA graph (about 2 µs) under-predicts compiled steps
    of models the project did not write (docs/cost-model.md, "Compute")."""
    peak, hbm = peak_flops(cluster, train), hbm_bandwidth(cluster)
    t, s = sh.tokens, sh.seq_len
    split = sh.elementwise_split(layer)
    attn_flops = t * layer.attention_flops_per_token_seq * s / sh.tp_mm
    gemm_flops = t * layer.matmul_flops_per_token / sh.tp_mm
    n_gemm = gemm_count(layer)
    gemm_eff = gemm_efficiency(gemm_flops / n_gemm, cluster) if n_gemm else matmul_efficiency(cluster)
    attn_s = attn_flops / (peak * attention_efficiency(cluster))
    score_bytes = ATTENTION_SCORE_TRAFFIC * t * layer.saved_interior_per_token_seq * s / sh.tp_interior
    fwd_matmul = gemm_flops / (peak * gemm_eff) + attn_s + t * layer.elementwise_flops_per_token * split / peak
    if compiled:
        fused = (layer.input_bytes_per_token + layer.output_bytes_per_token + layer.saved_boundary_per_token
                 + layer.saved_interior_per_token)
        fwd_memory = (t * min(fused, layer.bytes_per_token) * split + score_bytes) / hbm
    else:
        fwd_memory = (t * layer.bytes_per_token * split + score_bytes) / hbm
    roofline = max(fwd_matmul, fwd_memory)
    overhead = forward_kernels(layer) * kernel_overhead_s(cluster)
    logits = t * (layer.vocab or 0) if layer.kind == "head" else 0.0  # all V on every tp rank (gathered logits)
    loss = loss_form(compiled)
    loss_fwd, loss_bwd = logits * loss.fwd_bytes / hbm, logits * loss.bwd_bytes / hbm
    fwd = roofline + overhead + loss_fwd
    bwd = 2.0 * roofline + BACKWARD_KERNEL_FACTOR * overhead + loss_bwd
    probed = probed_time(layer, strategy, sh, cluster, train)
    if probed is not None:
        fwd, bwd = probed.fwd_s, probed.bwd_s
    host_fwd, host_bwd, host_inference = (0.0, 0.0, 0.0) if compiled else eager_host_s(layer, cluster)
    device_fwd = fwd
    fwd, bwd = max(fwd, host_fwd), max(bwd, host_bwd)
    recompute = {
        "none": 0.0,
        "selective": max(attn_s, score_bytes / hbm),
        "full": fwd,
    }[strategy.recompute]
    return {
        "fwd_matmul_s": fwd_matmul,
        "fwd_memory_s": fwd_memory,
        "fwd_overhead_s": overhead,
        "loss_fwd_s": loss_fwd,
        "loss_bwd_s": loss_bwd,
        "gemm_efficiency": gemm_eff,
        "fwd_measured": 0.0 if probed is None else 1.0,
        "fwd_device_s": device_fwd,
        "fwd_host_s": host_fwd,
        "bwd_host_s": host_bwd,
        "fwd_inference_host_s": host_inference,
        "fwd_compute_s": fwd,
        "bwd_compute_s": bwd,
        "recompute_s": recompute,
    }


def probed_time(layer: LayerInfo, strategy: LayerStrategy, sh: Sharding, cluster: Cluster,
                train: TrainSpec) -> measured.LayerTime | None:
    """The layer's measured forward/backward seconds for this sharding (``search/measured.py``), or None.

    Layers TP splits were probed at their tp shard on all ``T`` tokens (SP gathers the sequence
    before them); the others see ``T/t`` tokens under SP. Not used (analytic terms instead) for
    attention under context parallelism and MoE under expert parallelism, whose per-rank work the
    probe does not reproduce.
    """
    if (layer.kind == "attention" and sh.cp > 1) or (layer.kind == "moe" and strategy.ep):
        return None
    tokens = sh.tokens if sh.tp_mm > 1 else sh.tokens / sh.tp_boundary
    return measured.measured_layer_time(layer, cluster, train.precision, sh.tp_mm, sh.seq_len, tokens)


# ---- critical-path communication -------------------------------------------------------------


_CRITICAL_GROUPS = {"tp": comm.tp_group, "ep": comm.ep_group, "cp": comm.cp_group}
_TIMED = {"all_gather": comm.all_gather_time, "reduce_scatter": comm.reduce_scatter_time,
          "all_reduce": comm.all_reduce_time, "all_to_all": comm.all_to_all_time}


def critical_terms(layer: LayerInfo, strategy: LayerStrategy, sh: Sharding, mesh: Mesh, cluster: Cluster,
                   compute_bytes: float = 2.0) -> dict[str, float]:
    """TP/SP, EP and CP seconds on the critical path of one micro-batch, by direction: one time per
    collective of the layer's declared form (``autoshard/model_parallel.py``) that runs per micro-batch,
    over its axis's group, of ``payload_bytes`` at ``compute_bytes`` per element (the training precision).
    The expert gradients' per-step all-reduce is priced with the data-parallel terms (``param_groups``)."""
    terms = dict.fromkeys(("tp_fwd_s", "tp_bwd_s", "ep_fwd_s", "ep_bwd_s", "cp_fwd_s", "cp_bwd_s"), 0.0)
    for c in model_parallel.model_parallel_form(layer, strategy, mesh):
        if not c.per_micro_batch:
            continue
        size, stride = _CRITICAL_GROUPS[c.axis](mesh)
        nbytes = model_parallel.payload_bytes(c, layer, strategy, mesh, sh.tokens, compute_bytes,
                                              seq_len=sh.seq_len / sh.cp)
        seconds = c.count * _TIMED[c.kind](nbytes / c.count, size, comm.group_link(cluster, size, stride))
        terms[f"{c.axis}_{'fwd' if c.phase == 'forward' else 'bwd'}_s"] += seconds
    fwd = terms["tp_fwd_s"] + terms["ep_fwd_s"] + terms["cp_fwd_s"]
    terms["recompute_comm_s"] = fwd if strategy.recompute == "full" else 0.0
    return terms


# ---- data-parallel communication, optimizer, model states --------------------------------------


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one layer that share a data-parallel group."""

    psi: float  # local elements after TP/EP sharding
    shard_group: tuple[int, int]  # (size, stride) that ZeRO shards over and reduces in
    replicate_group: tuple[int, int] | None = None  # HSDP outer all-reduce


def param_groups(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> list[ParamGroup]:
    """Dense parameters (dp group, or HSDP) and, under EP, expert parameters (expert-dp group)."""
    dense = expert = 0.0
    for param in layer.params:
        if param.tp_role == "expert" and strategy.ep and mesh.ep > 1:
            expert += param.numel / mesh.ep
        elif param.tp_role in TP_SPLIT_ROLES and strategy.tp == "megatron":
            dense += param.numel / mesh.tp
        else:
            dense += param.numel
    if strategy.state == "zero3" and mesh.dp_replicate > 1:
        groups = [ParamGroup(dense, comm.dp_shard_group(mesh), comm.dp_replicate_group(mesh))]
    else:
        groups = [ParamGroup(dense, comm.dp_group(mesh))]
    if expert:
        groups.append(ParamGroup(expert, comm.expert_dp_group(mesh)))
    return groups


def _shard_degree(group: ParamGroup, state: str) -> int:
    return group.shard_group[0] if state in _SHARDED_STATES else 1


def _dp_group_terms(group: ParamGroup, strategy: LayerStrategy, form: DataParallelForm, cluster: Cluster,
                    schedule: Schedule, sizes: StateBytes) -> dict[str, float]:
    """Per-step data-parallel comm of one parameter group: one time per collective of the layer's declared
    form (``autoshard/data_parallel.py``), in the term of its phase (module docstring table)."""
    m = schedule.num_micro_batches
    wire = {"weight": comm_bytes_per_element(strategy.weight_comm, sizes.param), "param": sizes.param,
            "grad": comm_bytes_per_element(strategy.grad_comm, sizes.grad)}
    timed = {"all_gather": comm.all_gather_time, "reduce_scatter": comm.reduce_scatter_time,
             "all_reduce": comm.all_reduce_time}
    terms = dict.fromkeys(("gather_fwd", "gather_bwd", "grad_per_mb", "grad_once", "grad_after", "post_step"), 0.0)
    kernels = 0.0
    for c in form.collectives:
        if c.axis == "dp_replicate":
            if group.replicate_group is None:
                continue
            (size, stride), payload = group.replicate_group, group.psi / group.shard_group[0]  # the shard's gradient
        else:
            (size, stride), payload = group.shard_group, group.psi
        seconds = (m if c.per_micro_batch else 1) * timed[c.kind](payload * wire[c.payload], size,
                                                                  comm.group_link(cluster, size, stride))
        if c.kind == "all_gather":
            key = "post_step" if not c.per_micro_batch else ("gather_fwd" if c.phase == "forward" else "gather_bwd")
        else:
            # once per step: under the backward where declared so, else after it (exposed)
            key = "grad_per_mb" if c.per_micro_batch else ("grad_once" if c.hides_under else "grad_after")
        terms[key] += seconds
        if group.shard_group[0] > 1:
            kernels += (m if c.per_micro_batch else 1) * DP_KERNELS["gather" if c.kind == "all_gather" else "reduce"]
    terms["quant"] = _quant_kernel_time(group, strategy, cluster, schedule, sizes)
    terms["kernels"] = kernels * kernel_overhead_s(cluster)
    return terms


def _quant_kernel_time(group: ParamGroup, strategy: LayerStrategy, cluster: Cluster, schedule: Schedule,
                       sizes: StateBytes) -> float:
    """Quantize/dequantize kernel seconds per step (module docstring)."""
    size, m = group.shard_group[0], schedule.num_micro_batches
    rate = cluster.device.hbm_bandwidth * QUANT_KERNEL_EFFICIENCY
    kernel_bytes = 0.0
    if strategy.state == "zero3" and strategy.weight_comm in _QUANTIZED and size > 1:
        w = comm_bytes_per_element(strategy.weight_comm)
        per_gather = group.psi / size * (sizes.param + w) + group.psi * (w + sizes.param)
        kernel_bytes += 2 * m * per_gather
    if strategy.grad_comm in _QUANTIZED and size > 1:
        reductions = m if strategy.state == "zero3" else 1  # ZeRO-2 / offload reduce once per step
        kernel_bytes += reductions * 2 * group.psi * (sizes.grad + comm_bytes_per_element(strategy.grad_comm))
    return kernel_bytes / rate


def layer_form(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, schedule: Schedule,
               cluster: Cluster, train: TrainSpec | None = None) -> DataParallelForm:
    """The declared data-parallel form of ``layer`` (``autoshard/data_parallel.py``) on a plan for ``cluster``."""
    return data_parallel_form(strategy, mesh, schedule.num_micro_batches, runs_compiled(mesh, cluster, train),
                              layer.kind)


def dp_terms(layer: LayerInfo, strategy: LayerStrategy, form: DataParallelForm, groups: list[ParamGroup],
             mesh: Mesh, cluster: Cluster, schedule: Schedule, sizes: StateBytes,
             compute: dict[str, float]) -> dict[str, float]:
    """All data-parallel comm terms of the layer (its declared ``form``) and their exposed part after overlap."""
    total = dict.fromkeys(("gather_fwd", "gather_bwd", "grad_per_mb", "grad_once", "grad_after", "post_step", "quant",
                           "kernels"),
                          0.0)
    for group in groups:
        for key, value in _dp_group_terms(group, strategy, form, cluster, schedule, sizes).items():
            total[key] += value
    f, m, kappa = overlap_efficiency(cluster), schedule.num_micro_batches, overlap_contention(cluster)
    bwd_window = compute["bwd_compute_s"] + compute["recompute_s"]
    # the ZeRO-1/2 parameter gather hides under the forward only where the runtime gathers the layer in
    # the compiled forward graph; elsewhere it runs after the update (module docstring)
    post_step_hidden = any(c.kind == "all_gather" and c.phase == "forward" and not c.per_micro_batch
                           for c in form.collectives)
    exposed = (
        _overlapped(total["gather_fwd"], f * m * compute["fwd_compute_s"], kappa)
        + _overlapped(total["gather_bwd"] + total["grad_per_mb"], f * m * bwd_window, kappa)
        + _overlapped(total["grad_once"], f * bwd_window, kappa)
        + total["grad_after"]
        + _overlapped(total["post_step"], f * compute["fwd_compute_s"] if post_step_hidden else 0.0, kappa)
        + total["quant"]
        + total["kernels"]
    )
    out = {f"dp_{key}_s": value for key, value in total.items()}
    out["dp_total_s"] = sum(total.values())
    out["dp_exposed_s"] = exposed
    return out


def optimizer_terms(layer: LayerInfo, groups: list[ParamGroup], strategy: LayerStrategy, cluster: Cluster,
                    train: TrainSpec, sizes: StateBytes) -> dict[str, float]:
    """Optimizer-update seconds per step (device HBM, or host copies + CPU Adam for offload).

    Each local parameter tensor costs ``max(its share of the update, kernels · kernel_overhead)``
    (memory- or host-bound, or dispatch-bound when small; offload's CPU update dispatches per tensor
    too); ``optimizer_overhead_s`` is what the per-tensor floor adds on top.
    """
    local = sum(g.psi / _shard_degree(g, strategy.state) for g in groups)
    name = train.optimizer if train.optimizer in OPTIMIZER_FP32_PASSES else "adamw"
    if strategy.state == "offload":
        host = cluster.host_bandwidth
        terms = {
            "optimizer_d2h_s": local * sizes.grad / host,
            "optimizer_cpu_s": local / cluster.cpu_adam_params_per_s,
            "optimizer_h2d_s": local * sizes.param / host,
        }
    elif (per_param := cluster.calibration.get(f"{name}_s_per_param")) is not None:
        terms = {"optimizer_hbm_s": local * per_param}  # measured by the calibration probe
    else:
        touched = 4.0 * OPTIMIZER_FP32_PASSES[name] + 4.0 + sizes.param  # + write-back: master read, copy write
        terms = {"optimizer_hbm_s": local * touched / hbm_bandwidth(cluster)}
    base = sum(terms.values())
    floor = cluster.calibration.get(f"{name}_s_per_tensor",
                                    OPTIMIZER_KERNELS_PER_TENSOR[name] * kernel_overhead_s(cluster))
    total = sum(p.numel for p in layer.params)
    per_tensor = sum(max(base * p.numel / total, floor) for p in layer.params) if total else 0.0
    terms["optimizer_overhead_s"] = max(per_tensor - base, 0.0)
    terms["optimizer_params_local"] = local
    return terms


def runs_compiled(mesh: Mesh, cluster: Cluster, train: TrainSpec | None = None) -> bool:
    """Whether the runtime compiles a plan on ``mesh`` made for ``cluster``: on a GPU cluster when
    ep = cp = 1 (``Plan.compilable``), never on CPU ranks, nor for a ``train`` whose runtime runs eager
    (``TrainSpec.compiled``: PPO's programs)."""
    return mesh.ep == 1 and mesh.cp == 1 and not cluster.runs_on_cpu and (train is None or train.compiled)


def memory_state(strategy: LayerStrategy, form: DataParallelForm) -> str:
    """The row of ``memory.model_state_memory`` the runtime's form of ``strategy.state`` occupies.

    ZeRO-1 and ZeRO-2 differ in this runtime only on quantized gradient wires
    (``runtime/optimizer.py``): both accumulate the full gradient through the step's micro-batches
    and reduce-scatter it once after the backward (the ``zero1`` row: full gradients), except where
    the layer is gathered in the compiled forward graph, whose backward reduce-scatters each layer's
    gradient as it is produced (the ``zero2`` row: sharded gradients, one layer's full gradient and
    its reduce-scatter copy-in as the buffer; ``layer_memory`` holds its parameters as the shard
    and the gathered ones as saved for backward). ZeRO-3 with dp = 1 holds everything, as replicate."""
    if strategy.state in ("zero1", "zero2"):
        return "zero2" if form.grads == "shard" else "zero1"
    if strategy.state == "zero3" and form.held == "full":  # dp = 1: nothing to shard or gather
        return "replicate"
    return strategy.state


def layer_memory(layer: LayerInfo, strategy: LayerStrategy, groups: list[ParamGroup], mesh: Mesh, sh: Sharding,
                 sizes: StateBytes, region_entry: bool, form: DataParallelForm, bucket_bytes: int,
                 host_is_device: bool, compiled: bool = False) -> MemoryBreakdown:
    """Model states of every parameter group (as the runtime holds them: ``memory_state``), one
    micro-batch of activations and the optimizer step's working set (``step_working_set``; memory.py,
    "Optimizer step"). ``host_is_device``: CPU ranks, whose host memory is their device memory.
    ``compiled`` (``runs_compiled``): the loss's form (``loss_bytes``)."""
    states = MemoryBreakdown()
    gathered_bytes = made_grads = made_elements = 0.0  # the gathered parameters, the gradient the backward makes
    state = memory_state(strategy, form)
    work = step_working_set(form, compute_fp32=sizes.grad == STEP_GRAD_BYTES)
    on_device = strategy.state != "offload" or host_is_device  # offload's step gradient is on the host
    # ZeRO-1/2 gathered in the forward graph: held as the dim-0 shard; the gathered parameters are kept
    # from the layer's forward to its backward, saved tensors like its activations (autoshard/data_parallel.py)
    kept = form.gathered == "kept"
    # per parameter: its local shard as held (a gathered-in-forward ZeRO-1/2 layer: ZeRO-3's), as the buckets hold it
    regions = build_regions(layer, replace(strategy, state="zero3") if form.build == "shard" else strategy, mesh)
    padded = _padded_dim0_psi(layer, strategy, mesh, groups, regions) if state == "zero3" or kept else None
    for index, group in enumerate(groups):
        degree = _shard_degree(group, strategy.state)
        # dim-0 shards: the first rank holds ⌈d₀/N⌉ rows of each parameter and gathers N of them (padded); ZeRO-3
        # keeps its gradient and optimizer shards at that shape too, ZeRO-1/2 as flat chunks (ψ/N)
        dim0 = padded[index] if padded is not None and degree > 1 else group.psi
        psi = dim0 if state == "zero3" else group.psi
        gathered_bytes += sizes.param * dim0
        made_grads += sizes.grad * dim0
        made_elements += dim0
        group_states = replace(model_state_memory(psi, state, degree, sizes),
                               buffers=backward_buffer_bytes(form.backward, dim0, sizes))
        if kept:
            gathered = sizes.param * dim0
            group_states = replace(group_states, params=gathered / degree, activations=gathered, kept_gathered=gathered)
        if host_is_device:
            group_states = replace(group_states, optimizer=group_states.optimizer + group_states.host, host=0.0)
        states = states + group_states + MemoryBreakdown(
            step_grads=step_grad_bytes(work.grad, psi, degree) if on_device else 0.0)
        if strategy.state == "zero3" and strategy.weight_comm in _QUANTIZED:
            states = states + MemoryBreakdown(buffers=group.psi * comm_bytes_per_element(strategy.weight_comm))
    # quantized wires are reduced one parameter at a time (qgZ), not in buckets; their own transients are not priced
    bucketed = work.pack and strategy.grad_comm not in _QUANTIZED and bucket_bytes > 0
    pack = step_pack_bytes(work.pack, [sizes.grad * n for n in regions], bucket_bytes if bucketed else 0)
    members = sizes.grad * sum(regions) if bucketed else 0.0
    states = states + MemoryBreakdown(step_bucketed=work.pack * members, step_bucket_members=members)
    acts = activation_bytes(layer, strategy, mesh.tp, sh.tokens, sh.seq_len, region_entry=region_entry)
    states = replace(states, buffers=backward_working_bytes(layer, strategy, mesh.tp, sh.tokens, form.backward,
                                                            states.buffers, gathered_bytes, made_grads,
                                                            min(made_elements / max(layer.param_count, 1), 1.0)))
    # SP's gathered inputs, saved whole: collective outputs, which a compiled graph keeps as they are (not scaled)
    gathered_inputs = sp_gathered_input_bytes(layer, strategy, mesh.tp, sh.tokens, sizes.param)
    return states + MemoryBreakdown(activations=acts + gathered_inputs + loss_bytes(layer, sh, compiled),
                                    kept_gathered=gathered_inputs,
                                    build_transient=build_transient_bytes(regions), step_transient=pack)


def _padded_dim0_psi(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, groups: list[ParamGroup],
                     regions: list[int]) -> list[float]:
    """Per group of ``param_groups``: ``N · Σ ⌈d₀/N⌉·d₁·…`` over its parameters (``regions``: each one's
    dim-0 chunk on the first rank, ``build_regions``), the elements a rank's dim-0 shards stand for.

    ZeRO-3 (and ZeRO-1/2 gathered in the forward) cut each parameter's dim 0 by ``torch.chunk``: the first
    rank holds ``⌈d₀/N⌉`` rows, not ``d₀/N``, and the all-gather moves ``N`` such chunks. Where ``d₀ ≫ N``
    the two agree; where ``d₀`` is near or below ``N`` (4 experts over 17 ranks: one whole expert on the
    first rank, 4.25 × ψ/N, and a gathered buffer of 17 experts) ``ψ/N`` under-prices the rank."""
    expert_group = bool(strategy.ep and mesh.ep > 1 and len(groups) > 1)
    chunks = [0.0] * len(groups)
    for param, elements in zip(layer.params, regions):
        chunks[len(groups) - 1 if expert_group and param.tp_role == "expert" else 0] += elements
    return [group.shard_group[0] * chunk for group, chunk in zip(groups, chunks)]


def build_regions(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> list[int]:
    """Per parameter of ``layer``, the elements one rank reads at once while building
    (``memory.build_region_elements``), with the ZeRO shard degree of its ``param_groups`` group."""
    dense = (comm.dp_shard_group(mesh) if mesh.dp_replicate > 1 else comm.dp_group(mesh))[0]
    expert = comm.expert_dp_group(mesh)[0] if strategy.ep and mesh.ep > 1 else dense
    return [build_region_elements(p, strategy, mesh.tp, mesh.ep, expert if p.tp_role == "expert" else dense)
            for p in layer.params]


def loss_bytes(layer: LayerInfo, sh: Sharding, compiled: bool = False) -> float:
    """Bytes of the loss over the head's logits of one micro-batch: ``T·V·loss_form(compiled).peak_bytes``.

    Full ``V`` whatever the tp degree (the runtime gathers the logits), all ``T`` tokens of the
    micro-batch (SP gathers the sequence before the head); any recompute policy (the loss is outside
    the layer's checkpoint). Counted with the activations, i.e. once per in-flight micro-batch: exact
    for one stage and for the last stage of 1F1B (one in flight), an over-estimate under GPipe,
    where only the 4-byte log-probabilities of the other micro-batches stay saved.
    """
    if layer.kind != "head" or not layer.vocab:
        return 0.0
    return sh.tokens * layer.vocab * loss_form(compiled).peak_bytes
