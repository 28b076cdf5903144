"""The RL step priced whole, and training and rollout layouts chosen together.

An RL step (PPO or GRPO, ``runtime/ppo.py``) is::

    rl_step = generate + reshard + score + advantages + train

* **generate**: KV-cached sampling on the rollout layout (``runtime/rollout_engine.py``):
  groups of ``r`` consecutive ranks, each a Megatron shard of degree r of the policy
  (``runtime/rollout_tp.py``). A group samples ``b = k · S / dp`` sequences: S sequences
  per step over the job, dp the training plan's data-parallel degree, k the distinct
  prompt draws in the group (``max(1, r / (cp·tp))``: ranks of one training dp
  coordinate draw the same prompts, so a rollout group narrower than the training
  tp group duplicates work). Prefill of P prompt tokens, then R − 1 decode steps at
  the mean context ``c = P + R/2``; per forward, summed over the policy's layers::

      roof     = max(F / (peak · eff(F)), (W_r + KV_r(c)) / hbm)        W_r: weight bytes on a rank,
                                                                          KV_r: cache bytes read
      kernels  = K · g + SAMPLING_KERNELS · o
      comm     = 2·L · AR(b·h·p, r) + AR(b·h·p, r) + AG(b·V·p, r)       (o and down; embedding; head)

  K: the kernels of one decode step (``decode_ops``: counted on ``meta`` for a reference
  model, else the layers' forward kernels); g: per counted op of a replayed decode step on a
  GPU (``graph_compiled_kernel_s``, calibrated on a probe decode step compiled and captured as the
  rollout's is, ``runtime/rollout_graph.py``, else ``GRAPH_KERNEL_S``), the eager ``kernel_overhead_s``
  o on CPU ranks and for the prefill. In a captured step each collective costs ``graph_collective_s`` (calibrated)
  instead of the link's α.

  F = 2 · (matmul FLOPs per token / r) · tokens + attention FLOPs; eff(F) the GEMM knee for the eager
  prefill, the large-GEMM efficiency in the captured step (its GEMMs' fixed cost is in g: the probe's
  step has them; the knee's ~10–30 µs per GEMM is a timed eager matmul's launch and sync, and made the
  price of a 1.3B decode step swing 2× between calibrations of one machine).
  R is ``max_new_tokens`` (an upper bound: sequences that stop early shorten it).
* **reshard** (``sync``): per parameter, the gathers the runtime runs: ep, ZeRO-3 over
  dp_shard (output ``e/t``), Megatron tp (output ``e``) unless the rollout group is
  the tp group and both split the same dim; ring all-gather times (``search/comm.py``)
  on each group's link; with pp > 1 a broadcast of the slice over the pp group
  (``(pp − 1)·α + slice/β``); plus one copy of the slice through HBM.
* **score**: the old and the reference log-probs: two forwards of every sequence on
  the training plan, in its micro-batches, each the sum of the layers' forward times
  (``cost_model.plan_layer_costs``: compute and critical communication), plus about half
  of a step's exposed data-parallel communication (the forward's gathers) per mini-batch.
* **advantages**: rewards, KL and GAE on ``[b, R]`` tensors, host-bound: GAE's loop dispatches
  ``GAE_OPS`` ops per response token (counted), each at the calibrated eager per-op time
  ``kernel_overhead_s``; GRPO has no loop (``work.gae``). (Not the eager probe's ``eager_kernel_s``:
  that is a model step's time per counted kernel, module calls and autograd included.)
* **train**: ``epochs · mini_batches · step_time_s`` of the training plan.

Memory per rank: the training peak plus the rollout weights ``W_r`` and the KV
cache (both stay between steps: the decode graph reads them at fixed addresses) and the frozen KL reference (``reference_bytes``: a second program
of the plan, parameters and fp32 masters), and, while sampling, the training
peak less its activations + ``W_r`` + the reference + the KV cache
``2·L·b·(g/r)·(P+R)·d·p`` + the largest gathered parameter. ``co_plan`` searches
the training plan once per feasible r with ``W_r`` and the reference (as priced
for the previous plan) reserved
(``Constraints.max_memory_bytes``), drops layouts whose sampling peak does not
fit, and keeps the r with the smallest ``rl_step``; every option is recorded in
the plan (``RolloutPlan.options``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from autoshard.cluster import Cluster
from autoshard.data_parallel import data_parallel_form
from autoshard.errors import AutoshardError
from autoshard.graph import ROLLOUT_SHARD_DIM, LayerInfo, ModelGraph, ParamInfo, rollout_shard_dim, rollout_split_refusal
from autoshard.models import build, config_for
from autoshard.plan import Plan, RolloutOption, RolloutPlan
from autoshard.search import comm, layer_terms
from autoshard.search.cost_model import plan_layer_costs
from autoshard.search.space import Constraints, divisors
from autoshard.train import TrainSpec

SAMPLING_KERNELS = 22
"""Eager ops of one step of ``runtime/rollout.generate``'s loop outside the model (counted: the graph's input
copies and replay, temperature, log-softmax, multinomial, masks, gather, isin, cat, the all-done check)."""
GRAPH_KERNEL_S = 1.3e-6
"""Seconds per counted op of a replayed, compiled decode step where no calibration measured
``graph_compiled_kernel_s`` (``autoshard/calibrate.py``; 1.3–1.4 µs in the compiled steps of llama:1.3b and llama:7b
on an H200, less their weight and cache reads; the eager-captured steps' 3.4–3.7 µs is ``graph_kernel_s``)."""
BYTES = {"fp32": 4, "bf16": 2}
GAE_OPS = 14
"""Dispatched ops of one response token of ``runtime/ppo_losses.gae``'s loop, views included (each pays the eager
per-op host time): counted under a dispatch mode (6 selects, 4 muls, 2 adds, 1 sub, 1 copy; the test counts
them again)."""


@dataclass(frozen=True)
class RolloutWorkload:
    """What one RL step samples and trains on."""

    sequences: int
    """Responses sampled per RL step over the job (prompts × samples per prompt)."""
    prompt_len: int
    response_len: int
    """Most new tokens per response (``max_new_tokens``)."""
    epochs: int = 1
    mini_batches: int = 2
    forwards: int = 2
    """Scoring forwards per sequence: old log-probs (and values) and the KL reference."""
    gae: bool = True
    """Whether advantages come from PPO's GAE (a loop over the response tokens, ``runtime/ppo_losses.gae``);
    False for GRPO (group-relative, no loop)."""
    compiled: bool = False
    """Whether PPO's programs run compiled where the runtime compiles (``runtime/ppo_program`` note "compiled
    PPO"): scoring is then priced compiled too (``layer_terms.runs_compiled``)."""

    def __post_init__(self) -> None:
        for name in ("sequences", "prompt_len", "response_len", "epochs", "mini_batches"):
            if getattr(self, name) < 1:
                raise AutoshardError(f"RolloutWorkload.{name}={getattr(self, name)}: must be at least 1")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


def rollout_refusal(graph: ModelGraph, r: int) -> str | None:
    """Why the policy cannot roll out on groups of ``r`` (the rule ``runtime/rollout_tp.rollout_refusal`` applies
    to a model: ``graph.rollout_split_refusal``), or None."""
    experts = any(layer.kind == "moe" or any(p.tp_role == "expert" for p in layer.params) for layer in graph.layers)
    widths = []
    for layer in graph.layers:
        if layer.kind == "attention":
            widths += [("heads", layer.num_heads, f" of {layer.name}"),
                       ("key/value heads", layer.num_kv_heads, f" of {layer.name}")]
        if layer.kind == "mlp":
            widths.append(("MLP width", layer.ffn_hidden, f" of {layer.name}"))
    return rollout_split_refusal(r, widths, experts=experts)


def rollout_degrees(graph: ModelGraph, cluster: Cluster, stage_ranks: int) -> list[int]:
    """Rollout tp degrees to consider: powers of two up to a node that divide a pipeline stage's ranks."""
    out, r = [], 1
    while r <= min(cluster.devices_per_node, stage_ranks):
        if stage_ranks % r == 0 and rollout_refusal(graph, r) is None:
            out.append(r)
        r *= 2
    return out


def _shard_dim(param: ParamInfo, r: int) -> int | None:
    dim = rollout_shard_dim(param.tp_role, param.global_shape, r)
    return None if dim is None or param.global_shape[dim] % r else dim


def _params(graph: ModelGraph) -> list[tuple[LayerInfo, ParamInfo]]:
    return [(layer, p) for layer in graph.layers for p in layer.params]


def rollout_weight_bytes(graph: ModelGraph, r: int, bytes_per_element: int) -> float:
    """Bytes of the rollout replica on one rank of a group of ``r``."""
    total = 0.0
    for _, p in _params(graph):
        total += p.numel / (r if _shard_dim(p, r) is not None else 1)
    return total * bytes_per_element


def _attention_layers(graph: ModelGraph) -> list[LayerInfo]:
    return [layer for layer in graph.layers if layer.kind == "attention"]


def kv_cache_bytes(graph: ModelGraph, r: int, batch: float, length: float, bytes_per_element: int) -> float:
    """Keys and values of ``batch`` sequences of ``length`` tokens on one rank of a group of ``r``."""
    total = 0.0
    for layer in _attention_layers(graph):
        heads = layer.num_heads or 1
        kv = layer.num_kv_heads or heads
        head_dim = (layer.hidden or 0) / heads
        total += 2 * batch * (kv / r) * length * head_dim
    return total * bytes_per_element


def group_batch(plan: Plan, r: int, sequences: int) -> float:
    """Sequences a rollout group samples (module docstring: ``k · S / dp``)."""
    mesh = plan.mesh
    distinct = max(1, r // (mesh.cp * mesh.tp))
    return distinct * sequences / mesh.dp


@functools.lru_cache(maxsize=32)
def _counted_decode_ops(model_name: str) -> float | None:
    """Ops of one decode step of the reference model ``model_name`` (the step ``runtime/rollout_graph.py``
    captures), counted on ``meta`` with one and two blocks: stem + L · block. None for other models."""
    try:
        layers = config_for(model_name).num_layers
    except Exception:  # noqa: BLE001 - not a reference model: the training forward's kernel count instead
        return None
    one, two = (count_decode_ops(model_name, num_layers=blocks) for blocks in (1, 2))
    per_block = two - one
    return float(one - per_block + layers * per_block)


def count_decode_ops(model_name: str, **overrides: Any) -> int:
    """Ops (kernels but views) of one KV-cached decode step of the reference model ``model_name`` built with
    config ``overrides``, counted on ``meta`` (batch 1: the count does not depend on it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in _view_ops():
                self.ops += 1
            return func(*args, **(kwargs or {}))

    model = build(model_name, device="meta", **{"max_seq_len": 16, **overrides}).eval()
    cache = model.new_cache(1, model.config.max_seq_len)
    with torch.no_grad(), _Count() as count:
        model(torch.zeros(1, 1, dtype=torch.long, device="meta"), cache=cache,
              start_pos=torch.tensor(4, device="meta"))
    return count.ops


def decode_ops(graph: ModelGraph) -> float:
    """Kernels of one decode step of the policy: counted for a reference model, else its layers' forward kernels."""
    counted = _counted_decode_ops(graph.model_name)
    return counted if counted is not None else sum(layer_terms.forward_kernels(layer) for layer in graph.layers)


@functools.cache
def _view_ops() -> frozenset:
    """Ops that launch no kernel (views, aliases), not counted."""
    import torch

    aten = torch.ops.aten
    return frozenset(getattr(aten, name) for name in (
        "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "split",
        "detach", "alias", "as_strided", "_reshape_alias", "reshape", "permute", "split_with_sizes", "lift_fresh",
        "unbind"))


def _forward_s(graph: ModelGraph, cluster: Cluster, r: int, batch: float, tokens_per_seq: float, context: float,
               train: TrainSpec, p: int, kernel_s: float | None = None, collective_s: float | None = None
               ) -> dict[str, float]:
    """One forward of ``batch`` sequences × ``tokens_per_seq`` new tokens at ``context`` on a group of ``r``;
    ``kernel_s`` per kernel (default the eager ``kernel_overhead_s``), ``collective_s`` per collective in place of
    the link's α (a captured step's)."""
    peak, hbm = layer_terms.peak_flops(cluster, train), layer_terms.hbm_bandwidth(cluster)
    o = layer_terms.kernel_overhead_s(cluster) if kernel_s is None else kernel_s
    tokens = batch * tokens_per_seq
    gemm = sum(layer.matmul_flops_per_token for layer in graph.layers) * tokens / r
    attn = sum(2.0 * 2.0 * (layer.hidden or 0) * context for layer in _attention_layers(graph)) * tokens / r
    n_gemm = max(1, sum(layer_terms.gemm_count(layer) for layer in graph.layers))
    # The small-GEMM knee is a fixed cost per GEMM fitted to timed eager matmuls (launch, host sync); in a
    # captured step that cost is the calibrated per-op g, which the probe measured with its GEMMs inside.
    eff = layer_terms.gemm_efficiency(gemm / n_gemm, cluster) if kernel_s is None else layer_terms.matmul_efficiency(cluster)
    weights = rollout_weight_bytes(graph, r, p)
    cache = kv_cache_bytes(graph, r, batch, context, p)
    roof = max(gemm / (peak * eff) + attn / (peak * layer_terms.attention_efficiency(cluster)), (weights + cache) / hbm)
    kernels = decode_ops(graph) * o + SAMPLING_KERNELS * layer_terms.kernel_overhead_s(cluster)
    comm_s = 0.0
    if r > 1:
        link = comm.group_link(cluster, r, 1)
        if collective_s is not None:  # latency measured in a captured graph; the link's bandwidth terms stay
            link = dataclasses.replace(link, latency=0.0)
        hidden = max((layer.hidden or 0) for layer in graph.layers)
        vocab = max((layer.vocab or 0) for layer in graph.layers)
        row_layers = sum(1 for layer in graph.layers if any(q.tp_role == "row" for q in layer.params))
        act = tokens * hidden * p
        comm_s = (row_layers + 1) * comm.all_reduce_time(act, r, link) + comm.all_gather_time(tokens * vocab * p, r, link)
        comm_s += (row_layers + 2) * (collective_s or 0.0)
    return {"roof_s": roof, "kernels_s": kernels, "comm_s": comm_s}


def generate_s(graph: ModelGraph, cluster: Cluster, plan: Plan, r: int, work: RolloutWorkload) -> dict[str, float]:
    """Seconds of sampling one RL step's sequences on rollout groups of ``r`` (module docstring)."""
    train = TrainSpec(global_batch=1, seq_len=work.seq_len, precision=plan.precision)
    p = BYTES[plan.precision]
    batch = group_batch(plan, r, work.sequences)
    prefill = _forward_s(graph, cluster, r, batch, work.prompt_len, work.prompt_len, train, p)
    graphs = not cluster.runs_on_cpu  # GPUs replay the captured decode step (runtime/rollout_graph.py)
    gap = cluster.calibration.get("graph_compiled_kernel_s", GRAPH_KERNEL_S) if graphs else None
    in_graph = cluster.calibration.get("graph_collective_s") if graphs else None
    step = _forward_s(graph, cluster, r, batch, 1, work.prompt_len + work.response_len / 2, train, p, gap, in_graph)
    decode_steps = work.response_len - 1
    prefill_s = sum(prefill.values())
    decode_s = decode_steps * sum(step.values())
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_kernels_s": decode_steps * step["kernels_s"],
            "decode_comm_s": decode_steps * step["comm_s"], "generate_s": prefill_s + decode_s, "group_batch": batch}


def reshard(graph: ModelGraph, cluster: Cluster, plan: Plan, r: int, compiled: bool = False) -> dict[str, float]:
    """Seconds, bytes received per rank and the largest gathered tensor of the weight sync (module docstring).
    A layer is gathered over dp_shard where the program holds it sharded: ZeRO-3, and ZeRO-1/2 gathered inside a
    compiled forward (``compiled``: PPO compiles its programs; ``autoshard/data_parallel.py``)."""
    mesh, p = plan.mesh, BYTES[plan.precision]
    strategies = {s.layer: s for s in plan.layers}
    hbm = layer_terms.hbm_bandwidth(cluster)
    stride_dp = comm.axis_stride(mesh, "dp_shard")
    links = {"tp": comm.group_link(cluster, mesh.tp, 1), "dp_shard": comm.group_link(cluster, mesh.dp_shard, stride_dp),
             "ep": comm.group_link(cluster, mesh.ep, stride_dp), "pp": comm.group_link(cluster, mesh.pp, comm.axis_stride(mesh, "pp"))}
    seconds = received = largest = 0.0
    counts = {"ep": 0, "dp_shard": 0, "tp": 0, "pp": 0, "local": 0}
    keep_tp = r > 1 and r == mesh.tp
    for layer, param in _params(graph):
        s = strategies[layer.name]
        e = param.numel * p
        tp = mesh.tp if s.tp == "megatron" and mesh.tp > 1 and param.tp_role in ROLLOUT_SHARD_DIM else 1
        ep = mesh.ep if s.ep and param.tp_role == "expert" else 1
        held = data_parallel_form(s, mesh, plan.schedule.num_micro_batches,
                                  compiled and layer_terms.runs_compiled(mesh, cluster), layer.kind).held
        zero = mesh.dp_shard if held == "shard" and mesh.dp_shard > 1 else 1
        if param.tp_role == "expert":
            zero = max(1, zero // ep) if zero > 1 else 1
        rdim = _shard_dim(param, r)
        tdim = ROLLOUT_SHARD_DIM.get(param.tp_role) if tp > 1 else None
        skip_tp = keep_tp and tp > 1 and tdim == rdim
        size = e / (tp * zero * ep)
        gathered = False
        for axis, degree in (("ep", ep), ("dp_shard", zero), ("tp", 1 if skip_tp else tp)):
            if degree > 1:
                size *= degree
                seconds += comm.all_gather_time(size, degree, links[axis])
                received += size * (degree - 1) / degree
                counts[axis] += 1
                gathered = True
        counts["local"] += not gathered
        counts["pp"] += mesh.pp > 1
        largest = max(largest, size)
        piece = e / (r if rdim is not None else 1)
        if mesh.pp > 1:
            link = links["pp"]
            seconds += (mesh.pp - 1) * link.latency + piece / link.bandwidth
            received += piece * (mesh.pp - 1) / mesh.pp
        seconds += 2 * piece / hbm + 2 * layer_terms.kernel_overhead_s(cluster)
    steps = {"ep": f"all-gather over ep ({mesh.ep})", "dp_shard": f"all-gather over dp_shard ({mesh.dp_shard})",
             "tp": f"all-gather over tp ({mesh.tp})", "pp": f"broadcast over pp ({mesh.pp})", "local": "local slice only"}
    text = ", ".join(f"{steps[k]} ×{n}" for k, n in counts.items() if n)
    return {"reshard_s": seconds, "reshard_bytes": received, "reshard_transient_bytes": largest, "reshard_plan": text}


def score_s(graph: ModelGraph, cluster: Cluster, plan: Plan, work: RolloutWorkload) -> float:
    """Seconds of the scoring forwards (module docstring): the plan's per-layer forward times of one micro-batch
    (``cost_model.plan_layer_costs``, compiled or eager as ``work.compiled`` says PPO runs them), once per
    micro-batch of each rank's sequences."""
    sched = plan.schedule
    train = TrainSpec(global_batch=sched.micro_batch * sched.num_micro_batches * plan.mesh.dp, seq_len=plan.seq_len,
                      precision=plan.precision, compiled=work.compiled)
    # under no_grad: an eager layer's host floor is the inference one (layer_terms.eager_host_s; 0 compiled)
    forward = sum(cost.fwd_s - cost.detail["fwd_compute_s"]
                  + max(cost.detail["fwd_device_s"], cost.detail["fwd_inference_host_s"])
                  for cost in plan_layer_costs(graph, plan, cluster, train))
    chunks = work.sequences / (plan.mesh.dp * plan.schedule.micro_batch)
    return work.forwards * (chunks * forward + work.mini_batches * plan.predictions.exposed_comm_s / 2.0)


def advantages_s(cluster: Cluster, work: RolloutWorkload) -> float:
    """Seconds of the advantages phase (module docstring): GAE's ``GAE_OPS`` per response token, host-bound."""
    if not work.gae:
        return 0.0
    return work.response_len * GAE_OPS * layer_terms.kernel_overhead_s(cluster)


def train_s(plan: Plan, work: RolloutWorkload) -> float:
    """Seconds of the optimizer steps of one RL step."""
    return work.epochs * work.mini_batches * plan.predictions.step_time_s


def sampling_peak_bytes(graph: ModelGraph, plan: Plan, r: int, work: RolloutWorkload, transient: float) -> float:
    """Rank bytes while sampling: training state + rollout weights + KV cache + one gathered parameter."""
    pred = plan.predictions
    state = pred.peak_memory_bytes - pred.memory_breakdown.get("activations", 0)  # activations are free while sampling
    p = BYTES[plan.precision]
    batch = group_batch(plan, r, work.sequences)
    return state + rollout_weight_bytes(graph, r, p) + kv_cache_bytes(graph, r, batch, work.seq_len, p) + transient


def reference_bytes(plan: Plan) -> float:
    """The frozen KL reference on one rank: a second program of the plan, its parameters and an SGD optimizer's
    fp32 masters (4 of AdamW's 12 bytes of optimizer state per parameter; ``runtime/ppo_program`` note "the
    frozen reference")."""
    breakdown = plan.predictions.memory_breakdown
    return breakdown.get("params", 0) + breakdown.get("optimizer", 0) / 3.0


def price(graph: ModelGraph, cluster: Cluster, plan: Plan, r: int, work: RolloutWorkload) -> RolloutOption:
    """Every term of one RL step with training ``plan`` and rollout groups of ``r``."""
    gen = generate_s(graph, cluster, plan, r, work)
    sync = reshard(graph, cluster, plan, r, work.compiled)
    score, train, advantages = score_s(graph, cluster, plan, work), train_s(plan, work), advantages_s(cluster, work)
    p = BYTES[plan.precision]
    weights = rollout_weight_bytes(graph, r, p)
    kv = kv_cache_bytes(graph, r, gen["group_batch"], work.seq_len, p)
    ref = reference_bytes(plan)
    sampling = sampling_peak_bytes(graph, plan, r, work, sync["reshard_transient_bytes"]) + ref
    return RolloutOption(
        tp=r, rl_step_s=gen["generate_s"] + sync["reshard_s"] + score + advantages + train, generate_s=gen["generate_s"],
        reshard_s=sync["reshard_s"], reshard_plan=sync["reshard_plan"], score_s=score, train_s=train,
        train_step_s=plan.predictions.step_time_s, advantages_s=advantages,
        reshard_bytes=int(sync["reshard_bytes"]), weights_bytes=int(weights), kv_cache_bytes=int(kv),
        # the engine keeps its KV cache (and decode graph) between steps: it is there while training too
        peak_bytes=int(max(plan.predictions.peak_memory_bytes + weights + ref + kv, sampling)),
        training_mesh=_mesh_text(plan),
    )


def _mesh_text(plan: Plan) -> str:
    m = plan.mesh
    parts = [f"{a}={getattr(m, a)}" for a in ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp") if getattr(m, a) > 1]
    return " ".join(parts) or "1 rank"


Solve = Callable[..., Plan]


def co_plan(graph: ModelGraph, cluster: Cluster, train: TrainSpec, work: RolloutWorkload, *, solve: Solve,
            constraints: Any = None, degrees: list[int] | None = None) -> Plan:
    """The training plan and rollout layout with the smallest RL step (module docstring).

    ``solve(graph, cluster, train, constraints=...)`` searches one training plan (``search.solve``);
    it is called once per rollout degree with that degree's weights reserved. Returns the chosen
    training plan with its ``rollout`` section (every option considered, the infeasible ones with why).
    """
    constraints = constraints or Constraints()
    usable = layer_terms.usable_memory_bytes(cluster)
    limit = constraints.max_memory_bytes or cluster.device.memory_bytes
    p = BYTES[train.precision]
    candidates = degrees or rollout_degrees(graph, cluster, cluster.nodes * cluster.devices_per_node)
    best: tuple[float, Plan, RolloutOption] | None = None
    options: list[RolloutOption] = []
    reference = 0.0  # the reference program's bytes: known once a plan is searched; the first search omits them
    for r in candidates:
        reserve = rollout_weight_bytes(graph, r, p) + reference
        try:
            plan = solve_for_rollout(graph, cluster, train, r, solve=solve, constraints=dataclasses.replace(
                constraints, max_memory_bytes=int(limit - reserve)))
        except AutoshardError as err:
            options.append(RolloutOption(tp=r, refusal=f"no training plan fits beside the rollout weights: {err}"[:300]))
            continue
        reference = reference_bytes(plan)
        option = price(graph, cluster, plan, r, work)
        if option.peak_bytes > usable:
            option = dataclasses.replace(option, refusal=f"sampling peak {option.peak_bytes / 2**30:.1f} GiB is over "
                                                       f"the usable {usable / 2**30:.1f} GiB")
        options.append(option)
        if not option.refusal and (best is None or option.rl_step_s < best[0]):
            best = (option.rl_step_s, plan, option)
    if best is None:
        reasons = "; ".join(f"tp={o.tp}: {o.refusal}" for o in options)
        raise AutoshardError(f"no rollout layout fits this cluster ({reasons})")
    _, plan, chosen = best
    rollout = RolloutPlan(tp=chosen.tp, dp=plan.mesh.world_size // chosen.tp, sequences=work.sequences,
                          prompt_len=work.prompt_len, response_len=work.response_len, epochs=work.epochs,
                          mini_batches=work.mini_batches, chosen=chosen, options=tuple(options))
    return dataclasses.replace(plan, rollout=(rollout,))


def solve_for_rollout(graph: ModelGraph, cluster: Cluster, train: TrainSpec, r: int, *, solve: Solve,
                      constraints: Any = None) -> Plan:
    """The fastest training plan whose pipeline stages each hold whole rollout groups of ``r`` ranks (the groups
    are consecutive ranks inside one stage, ``runtime/rollout_engine.py``): the search's plan when its stages
    have a multiple of ``r`` ranks, else the fastest of the searches with ``pp`` fixed to each degree that
    leaves them one (a ``pp`` the caller fixed is kept). ``AutoshardError`` when none fits."""
    constraints = constraints or Constraints()
    plan = solve(graph, cluster, train, constraints=constraints)
    world = plan.mesh.world_size
    if (world // plan.mesh.pp) % r == 0:
        return plan
    fixed = constraints.mesh.get("pp")
    allowed = [pp for pp in divisors(world) if (world // pp) % r == 0 and fixed in (None, pp)]
    plans, errors = [], []
    for pp in allowed:
        try:
            plans.append(solve(graph, cluster, train, constraints=dataclasses.replace(
                constraints, mesh={**constraints.mesh, "pp": pp})))
        except AutoshardError as err:
            errors.append(f"pp={pp}: {err}")
    if not plans:
        raise AutoshardError(f"rollout tp={r} needs pipeline stages of a multiple of {r} ranks (pp in {allowed} of "
                             f"{world} ranks) and no training plan with one fits: {'; '.join(errors) or 'none allowed'}")
    return min(plans, key=lambda candidate: candidate.predictions.step_time_s)


def with_rollout(graph: ModelGraph, cluster: Cluster, plan: Plan, r: int, work: RolloutWorkload) -> Plan:
    """``plan`` with a rollout section for groups of ``r`` (priced, not searched): ``--rollout-tp N``."""
    reason = rollout_refusal(graph, r)
    if reason:
        raise AutoshardError(reason)
    option = price(graph, cluster, plan, r, work)
    rollout = RolloutPlan(tp=r, dp=plan.mesh.world_size // r, sequences=work.sequences, prompt_len=work.prompt_len,
                          response_len=work.response_len, epochs=work.epochs, mini_batches=work.mini_batches,
                          chosen=option, options=(option,))
    return dataclasses.replace(plan, rollout=(rollout,))


__all__ = ["RolloutWorkload", "co_plan", "generate_s", "kv_cache_bytes", "price", "reshard", "rollout_degrees",
           "rollout_refusal", "rollout_weight_bytes", "solve_for_rollout", "with_rollout"]
