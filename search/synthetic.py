"""Analytic stand-ins for tests and benchmarks of the search: models, clusters, a toy cost.

Nothing here is used by ``solve`` itself. Three helpers:

* ``synthetic_graph(cfg)`` builds a ``ModelGraph`` for a GPT/Llama/MoE shape
  from closed-form per-token coefficients, without capturing anything. It lets
  the search be tested and timed on 70B and 1T-parameter models. Per block
  (h = hidden, a = heads, g = KV heads, d = h/a, f = FFN width, E experts, k
  routed per token, activations 2 bytes, dropout masks 1 byte, as in
  Korthikanti et al. 2022, Table 2):

  ======== ===================================== ========================== ===================
  layer    matmul FLOPs / token                  saved bytes / token         tp roles
  ======== ===================================== ========================== ===================
  norm     —                                     boundary 2h                 replicate
  attn     2(2h² + 2hgd)  (+ 4h·s scores)        boundary 3h, interior 8h,   q,k,v column, o row
                                                 interior·s 5a
  mlp      2·n_mat·h·f  (n_mat 3 SwiGLU, 2 GeLU) boundary 3h, interior 2·n_mat·f  up column, down row
  moe      k·(mlp) + 2hE (router)                boundary 3h, interior k·2·n_mat·f  experts expert
  embed    —                                     —                           vocab
  head     2hV                                   boundary 2h, interior 4V    vocab
  value    2h                                    boundary 2h                 replicate
  ======== ===================================== ========================== ===================

  which sums to Korthikanti's ``sbh(34 + 5as/h)`` per GPT block (f = 4h).
* ``synthetic_cluster(preset, nodes)`` builds a ``Cluster`` from the figures of
  ``autoshard/cluster_presets.py`` (so it does not depend on ``Cluster.preset``).
* ``toy_layer_cost`` is a small α-β / roofline / ZeRO-formula cost with the
  ``cost_model.layer_cost`` signature, so solver tests have a physical but
  simple oracle and benchmarks run before the real cost model exists. It is
  NOT the project's cost model and is never its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoshard.cluster import Cluster, DeviceSpec, LinkSpec
from autoshard.cluster_presets import PRESETS
from autoshard.graph import LayerInfo, ModelGraph, ParamInfo
from autoshard.plan import LayerStrategy, Mesh, Schedule
from autoshard.search.cost_model import LayerCost, MemoryBreakdown
from autoshard.train import TrainSpec


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """Shape of a decoder-only policy model (actor with a value head)."""

    name: str
    num_blocks: int
    hidden: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int = 32000
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs GeLU MLP (2)
    num_experts: int | None = None  # MoE when set
    top_k: int = 2


# Shapes used by the benchmarks and the textbook tests (public model cards).
LLAMA_7B = SyntheticConfig(name="llama-7b", num_blocks=32, hidden=4096, num_heads=32, ffn_hidden=11008)
LLAMA_70B = SyntheticConfig(
    name="llama-70b", num_blocks=80, hidden=8192, num_heads=64, num_kv_heads=8, ffn_hidden=28672
)
GPT_1T = SyntheticConfig(
    name="gpt-1t", num_blocks=128, hidden=25600, num_heads=160, ffn_hidden=102400, vocab=51200, gated_mlp=False
)
MIXTRAL_8X7B = SyntheticConfig(
    name="mixtral-8x7b", num_blocks=32, hidden=4096, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
    num_experts=8, top_k=2,
)


def _linear(name: str, out_features: int, in_features: int, role: str) -> ParamInfo:
    return ParamInfo(name, (out_features, in_features), "bf16", role)


def _norm(name: str, index: int, block: int | None, h: int) -> LayerInfo:
    return LayerInfo(
        name=name, kind="norm", index=index, block=block, class_id=f"norm:{h}",
        params=(ParamInfo(f"{name}.weight", (h,), "bf16"),), elementwise_flops_per_token=5.0 * h,
        bytes_per_token=4.0 * h, saved_boundary_per_token=2.0 * h, input_bytes_per_token=2.0 * h,
        output_bytes_per_token=2.0 * h, hidden=h,
    )


def _attention(cfg: SyntheticConfig, name: str, index: int, block: int) -> LayerInfo:
    h, a = cfg.hidden, cfg.num_heads
    g = cfg.num_kv_heads or a
    kv = g * (h // a)
    params = (
        _linear(f"{name}.wq", h, h, "column"), _linear(f"{name}.wk", kv, h, "column"),
        _linear(f"{name}.wv", kv, h, "column"), _linear(f"{name}.wo", h, h, "row"),
    )
    return LayerInfo(
        name=name, kind="attention", index=index, block=block, class_id=f"attention:{h}:{a}:{g}",
        params=params, matmul_flops_per_token=2.0 * (2 * h * h + 2 * h * kv),
        attention_flops_per_token_seq=4.0 * h, elementwise_flops_per_token=0.0, bytes_per_token=12.0 * h,
        saved_boundary_per_token=3.0 * h, saved_interior_per_token=8.0 * h,
        saved_interior_per_token_seq=5.0 * a, input_bytes_per_token=2.0 * h, output_bytes_per_token=2.0 * h,
        num_heads=a, num_kv_heads=g, hidden=h,
    )


def _mlp(cfg: SyntheticConfig, name: str, index: int, block: int) -> LayerInfo:
    h, f = cfg.hidden, cfg.ffn_hidden or 4 * cfg.hidden
    n_mat = 3 if cfg.gated_mlp else 2
    ups = ("w1", "w3") if cfg.gated_mlp else ("w1",)
    if cfg.num_experts:
        e = cfg.num_experts
        params = (ParamInfo(f"{name}.router", (e, h), "bf16"),) + tuple(
            ParamInfo(f"{name}.experts.{w}", (e, f, h), "bf16", "expert") for w in ups + ("w2",)
        )
        k = cfg.top_k
        return LayerInfo(
            name=name, kind="moe", index=index, block=block, class_id=f"moe:{h}:{f}:{e}:{k}", params=params,
            matmul_flops_per_token=k * 2.0 * n_mat * h * f + 2.0 * h * e, elementwise_flops_per_token=k * 4.0 * f,
            bytes_per_token=k * 6.0 * f, saved_boundary_per_token=3.0 * h,
            saved_interior_per_token=k * 2.0 * n_mat * f, input_bytes_per_token=2.0 * h,
            output_bytes_per_token=2.0 * h, num_experts=e, top_k=k, hidden=h, ffn_hidden=f,
        )
    params = tuple(_linear(f"{name}.{w}", f, h, "column") for w in ups) + (_linear(f"{name}.w2", h, f, "row"),)
    return LayerInfo(
        name=name, kind="mlp", index=index, block=block, class_id=f"mlp:{h}:{f}:{n_mat}", params=params,
        matmul_flops_per_token=2.0 * n_mat * h * f, elementwise_flops_per_token=4.0 * f,
        bytes_per_token=6.0 * f, saved_boundary_per_token=3.0 * h, saved_interior_per_token=2.0 * n_mat * f,
        input_bytes_per_token=2.0 * h, output_bytes_per_token=2.0 * h, hidden=h, ffn_hidden=f,
    )


def synthetic_graph(cfg: SyntheticConfig) -> ModelGraph:
    """A ``ModelGraph`` for ``cfg`` from closed-form coefficients (module docstring)."""
    h, v = cfg.hidden, cfg.vocab
    layers: list[LayerInfo] = [
        LayerInfo(
            name="embed", kind="embedding", index=0, block=None, class_id=f"embedding:{v}:{h}",
            params=(ParamInfo("embed.weight", (v, h), "bf16", "vocab"),), bytes_per_token=2.0 * h,
            output_bytes_per_token=2.0 * h, vocab=v, hidden=h,
        )
    ]
    for b in range(cfg.num_blocks):
        prefix = f"blocks.{b}"
        layers.append(_norm(f"{prefix}.attn_norm", len(layers), b, h))
        layers.append(_attention(cfg, f"{prefix}.attn", len(layers), b))
        layers.append(_norm(f"{prefix}.mlp_norm", len(layers), b, h))
        layers.append(_mlp(cfg, f"{prefix}.mlp", len(layers), b))
    layers.append(_norm("final_norm", len(layers), None, h))
    layers.append(
        LayerInfo(
            name="lm_head", kind="head", index=len(layers), block=None, class_id=f"head:{v}:{h}",
            params=(_linear("lm_head.weight", v, h, "vocab"),), matmul_flops_per_token=2.0 * h * v,
            elementwise_flops_per_token=5.0 * v, bytes_per_token=8.0 * v, saved_boundary_per_token=2.0 * h,
            saved_interior_per_token=4.0 * v, input_bytes_per_token=2.0 * h, output_bytes_per_token=4.0 * v,
            vocab=v, hidden=h,
        )
    )
    layers.append(
        LayerInfo(
            name="value_head", kind="value_head", index=len(layers), block=None, class_id=f"value_head:{h}",
            params=(_linear("value_head.weight", 1, h, "replicate"),), matmul_flops_per_token=2.0 * h,
            saved_boundary_per_token=2.0 * h, input_bytes_per_token=2.0 * h, output_bytes_per_token=4.0, hidden=h,
        )
    )
    names = [layer.name for layer in layers]
    edges = tuple(zip(names[:-1], names[1:]))
    return ModelGraph(
        model_name=cfg.name, layers=tuple(layers), edges=edges, dtype="bf16", hidden=h,
        num_blocks=cfg.num_blocks, vocab=v,
    )


def synthetic_cluster(preset: str = "h100-sxm", nodes: int = 1, *, devices_per_node: int | None = None,
                      inter_node_bandwidth: float | None = None, memory_bytes: int | None = None) -> Cluster:
    """A ``Cluster`` from ``cluster_presets.PRESETS[preset]`` with optional overrides."""
    spec = PRESETS[preset]
    device_fields = {f.name for f in dataclasses.fields(DeviceSpec)}
    device = DeviceSpec(**{k: v for k, v in spec["device"].items() if k in device_fields})
    if memory_bytes is not None:
        device = dataclasses.replace(device, memory_bytes=memory_bytes)
    inter = LinkSpec(spec["inter_node"]["bandwidth"], spec["inter_node"]["latency"])
    if inter_node_bandwidth is not None:
        inter = LinkSpec(inter_node_bandwidth, inter.latency)
    return Cluster(
        name=f"{preset}:{nodes}x{devices_per_node or spec['devices_per_node']}", nodes=nodes,
        devices_per_node=devices_per_node or spec["devices_per_node"], device=device,
        intra_node=LinkSpec(spec["intra_node"]["bandwidth"], spec["intra_node"]["latency"]),
        inter_node=inter, host_bandwidth=spec["host_bandwidth"], host_memory_bytes=spec["host_memory_bytes"],
        cpu_adam_params_per_s=spec["cpu_adam_params_per_s"],
    )


# ----------------------------------------------------------------------------- toy cost
_TP_ROLES = ("column", "row", "vocab")
_GRAD_BYTES = {"bf16": 2.0, "fp32": 4.0, "int8": 1.0, "int4": 0.5}
_WEIGHT_BYTES = {"bf16": 2.0, "int8": 1.0, "fp8": 1.0}


def _local_params(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh) -> float:
    total = 0.0
    for p in layer.params:
        if p.tp_role in _TP_ROLES and strategy.tp == "megatron":
            total += p.numel / mesh.tp
        elif p.tp_role == "expert" and strategy.ep:
            total += p.numel / mesh.ep
        else:
            total += p.numel
    return total


def _link(cluster: Cluster, span_ranks: int) -> tuple[float, float]:
    link = cluster.intra_node if span_ranks <= cluster.devices_per_node else cluster.inter_node
    return link.bandwidth, link.latency


def _ring(bytes_: float, n: int, link: tuple[float, float], factor: float) -> float:
    """α-β ring collective: factor 1 = all-gather / reduce-scatter, 2 = all-reduce."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    bw, lat = link
    return factor * ((n - 1) / n * bytes_ / bw + (n - 1) * lat)


def _toy_memory(layer: LayerInfo, s: LayerStrategy, mesh: Mesh, train: TrainSpec, sched: Schedule,
                local: float, shard: int) -> MemoryBreakdown:
    k = train.optimizer_state_bytes_per_param
    div = {"replicate": (1, 1, 1), "zero1": (1, 1, shard), "zero2": (1, shard, shard),
           "zero3": (shard, shard, shard), "offload": (1, shard, float("inf"))}[s.state]
    tokens = sched.micro_batch * train.seq_len
    t = mesh.tp if s.tp == "megatron" else 1
    boundary = layer.saved_boundary_per_token / (t if s.sp else 1)
    interior = layer.saved_interior_per_token / t
    seq = layer.saved_interior_per_token_seq * train.seq_len / t
    per_token = {"none": boundary + interior + seq, "selective": boundary + interior,
                 "full": layer.input_bytes_per_token / (t if s.sp else 1)}[s.recompute]
    return MemoryBreakdown(
        params=2 * local / div[0], grads=2 * local / div[1], optimizer=k * local / div[2],
        activations=tokens * per_token, buffers=(2 * local if s.state == "zero3" else 0.0),
    )


def toy_layer_cost(layer: LayerInfo, strategy: LayerStrategy, mesh: Mesh, cluster: Cluster,
                   train: TrainSpec, schedule: Schedule) -> LayerCost:
    """Toy per-layer cost (module docstring): roofline compute, α-β rings, ZeRO memory formulas.

    Ranks are laid out tp innermost, then dp_shard, dp_replicate, pp (torchtitan
    order), so a group of ``n`` ranks at stride ``s`` spans nodes when
    ``n * s > devices_per_node``.
    """
    s = strategy
    tp = mesh.tp if s.tp == "megatron" else 1
    tokens = schedule.micro_batch * train.seq_len
    dev = cluster.device
    flops = layer.forward_flops(schedule.micro_batch, train.seq_len)
    fwd = flops / tp / (dev.peak_flops["bf16"] * dev.matmul_efficiency) + tokens * layer.bytes_per_token / tp / dev.hbm_bandwidth
    recompute_extra = {"none": 0.0, "selective": tokens * layer.attention_flops_per_token_seq * train.seq_len / tp
                       / (dev.peak_flops["bf16"] * dev.matmul_efficiency), "full": fwd}[s.recompute]
    comm_tp = 0.0
    if tp > 1 and any(p.tp_role in _TP_ROLES for p in layer.params):
        comm_tp = _ring(tokens * 2.0 * (layer.hidden or 0), tp, _link(cluster, tp), 2.0)
    comm_ep = 0.0
    if layer.kind == "moe" and s.ep and mesh.ep > 1:
        a2a = tokens * (layer.top_k or 1) * 2.0 * (layer.hidden or 0) / tp
        comm_ep = 2 * _ring(a2a, mesh.ep, _link(cluster, mesh.ep * mesh.tp), 1.0)
    local = _local_params(layer, s, mesh)
    shard = mesh.dp_shard if mesh.dp_replicate > 1 else mesh.dp
    dp_ranks = mesh.dp // (mesh.ep if (layer.kind == "moe" and s.ep) else 1)
    m = schedule.num_micro_batches
    grad = _GRAD_BYTES[s.grad_comm] * local
    dp_link = _link(cluster, dp_ranks * tp)
    if s.state in ("replicate", "zero1"):
        comm = _ring(grad, dp_ranks, dp_link, 2.0)
    else:
        comm = _ring(grad, dp_ranks, dp_link, 1.0) + _ring(2.0 * local, dp_ranks, dp_link, 1.0)
    if s.state == "zero3":
        comm += 2 * m * _ring(_WEIGHT_BYTES[s.weight_comm] * local, shard, _link(cluster, shard * tp), 1.0)
    bwd = 2 * fwd + recompute_extra
    exposed = max(0.1 * comm, comm - m * bwd)
    k_bytes = train.optimizer_state_bytes_per_param + 4
    opt_div = 1 if s.state == "replicate" else shard
    if s.state == "offload":
        optimizer = local / shard / cluster.cpu_adam_params_per_s + 4 * local / shard / cluster.host_bandwidth
    else:
        optimizer = k_bytes * local / opt_div / dev.hbm_bandwidth
    memory = _toy_memory(layer, s, mesh, train, schedule, local, shard)
    return LayerCost(
        fwd_s=fwd + comm_tp / 2 + comm_ep / 2, bwd_s=bwd + comm_tp / 2 + comm_ep / 2, comm_exposed_s=exposed,
        comm_total_s=comm, optimizer_s=optimizer, memory=memory,
        detail={"compute_fwd_s": fwd, "recompute_s": recompute_extra, "tp_comm_s": comm_tp, "ep_comm_s": comm_ep,
                "dp_comm_s": comm},
    )
