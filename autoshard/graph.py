"""``ModelGraph``: what capture learns about a model, and all that search needs.

A ``ModelGraph`` is data: frozen dataclasses plus a ``networkx.DiGraph`` whose
nodes are layer names (in execution order) and whose edges carry the tensors
flowing between layers. It holds no live tensors or modules, so it can be
fingerprinted, serialised and handed to the solver.

Granularity (a decision recorded in docs/architecture.md): a *layer* is one
module instance at the level the strategy space talks about: the embedding,
each block's norms, its attention, its MLP (or MoE), the final norm, the LM
head and the value head. ``LayerInfo.block`` groups the layers of one
transformer block; pipeline stage boundaries and full recompute act on blocks.

Shape-dependent quantities are stored *per token* with a separate term that
grows with the sequence length (attention), so the cost model can evaluate any
(micro-batch, sequence) without capturing again:

    flops(b, s)       = b*s * (flops_per_token + flops_per_token_seq * s)
    saved_bytes(b, s) = b*s * (saved_*_per_token + saved_*_per_token_seq * s)

Capture measures these at two sequence lengths and solves for both terms.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import networkx as nx

LAYER_KINDS = ("embedding", "norm", "attention", "mlp", "moe", "head", "value_head", "other")

# How a parameter is split by Megatron tensor parallelism:
#   column: output features split (tensor_dim 0 of an nn.Linear weight)
#   row:    input features split (tensor_dim 1 of an nn.Linear weight)
#   vocab:  vocabulary rows split (embedding / LM head)
#   expert: experts split over the ep axis (tensor_dim 0 of stacked expert weights)
#   replicate: never split by tp (norms, router, value head)
TP_ROLES = ("column", "row", "vocab", "expert", "replicate")

ROLLOUT_SHARD_DIM = {"column": 0, "row": 1, "vocab": 0}
"""The dimension a rollout shard of degree r splits, per TP role (absent: replicated). One table for the
layout ``runtime/rollout_tp.py`` builds and the one ``search/rollout.py`` prices."""


def rollout_shard_dim(role: str, shape: tuple[int, ...], r: int) -> int | None:
    """The dimension a ``role`` parameter of ``shape`` is split along on ``r`` rollout ranks, or None
    (r = 1, a replicated role, or a row linear's bias, added once after the all-reduce). Divisibility
    is the caller's: the runtime replicates an uneven vocabulary and refuses anything else uneven."""
    dim = ROLLOUT_SHARD_DIM.get(role)
    if r == 1 or dim is None or len(shape) <= dim or (role == "row" and len(shape) == 1):
        return None
    return dim


def rollout_split_refusal(r: int, widths: list[tuple[str, int | None, str]], *, experts: bool) -> str | None:
    """Why a policy cannot roll out on groups of ``r``, or None: expert weights are not split for rollout,
    and r must divide every width (name, count, where: attention heads, key/value heads, MLP width)."""
    if r == 1:
        return None
    if experts:
        return "expert parameters are not split for rollout (MoE policies roll out with tp=1)"
    for name, count, where in widths:
        if count and count % r:
            return f"rollout tp={r} does not divide the {name} ({count}){where}"
    return None


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: fully-qualified name, global shape, dtype and tp role."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    tp_role: str = "replicate"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.global_shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerInfo:
    """One layer of the captured model, with its measured costs.

    FLOPs are forward FLOPs (multiply-add = 2). Bytes are at the dtype the
    model was captured in. ``saved_boundary_*`` are saved activations that
    Megatron TP leaves replicated (inputs of column-parallel linears, norm
    inputs, masks after the row-parallel output; sequence parallelism shards
    them); ``saved_interior_*`` are the ones TP shards. The ``*_seq`` terms are
    the part that grows with sequence length (attention scores), which
    selective recompute drops.
    """

    name: str
    kind: str
    index: int
    block: int | None
    class_id: str
    params: tuple[ParamInfo, ...]
    matmul_flops_per_token: float = 0.0
    attention_flops_per_token_seq: float = 0.0
    elementwise_flops_per_token: float = 0.0
    bytes_per_token: float = 0.0  # activation bytes read + written in forward
    saved_boundary_per_token: float = 0.0
    saved_interior_per_token: float = 0.0
    saved_interior_per_token_seq: float = 0.0
    input_bytes_per_token: float = 0.0  # bytes of the layer's input activation
    output_bytes_per_token: float = 0.0  # bytes of the layer's output activation
    num_heads: int | None = None
    num_kv_heads: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    hidden: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    # Added by capture (defaults keep older constructors valid):
    bytes_per_token_seq: float = 0.0  # bytes_per_token's part growing with sequence length (scores)
    elementwise_flops_per_token_seq: float = 0.0  # elementwise FLOPs on scores (mask, softmax, dropout)
    tied_params: tuple[str, ...] = ()  # FQNs used here but owned (counted) by an earlier layer
    # why expert parallelism cannot run on this moe layer ("" when it can; ``passes/capture.py``)
    ep_refusal: str = ""
    # why Megatron tp cannot split this layer at any degree ("" when it can; ``passes/_capture_tp.py``); the
    # degree-dependent rules (num_heads, num_kv_heads, ffn_hidden, vocab divisible by tp) are
    # ``Plan.check_compatible``'s, from the counts above
    tp_refusal: str = ""
    # the layer module returns no batch dim: ``[S, h]``, a positional table looked up at ``arange(S)``; its tp
    # collectives move s·h per micro-batch, not T·h (``passes/_capture_blocks.py``). ``output_bytes_per_token``
    # still counts what leaves the layer (the root-level ``tok + pos`` add attributed to it: ``[B, S, h]``)
    batch_free_output: bool = False
    # the backward's working set beside the saved activations and the other layers' gradients, measured on meta
    # (``passes/_capture_grad.py``): its peak (W = per token · T + fixed), the share of the layer's own gradient bytes made by
    # then (f), and what is left when its backward ends (negative: it freed more than it made); per class, the
    # largest member's, so structurally identical layers keep one price
    grad_working_per_token: float = 0.0
    grad_working_fixed_bytes: float = 0.0  # W's part that does not grow with the tokens (weight-shaped copies)
    grad_working_param_fraction: float = 0.0
    grad_working_end_per_token: float = 0.0

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    def param_bytes(self, bytes_per_element: int) -> int:
        return self.param_count * bytes_per_element

    def forward_flops(self, micro_batch: int, seq_len: int) -> float:
        tokens = micro_batch * seq_len
        return tokens * (
            self.matmul_flops_per_token
            + self.elementwise_flops_per_token
            + (self.attention_flops_per_token_seq + self.elementwise_flops_per_token_seq) * seq_len
        )

    def saved_bytes(self, micro_batch: int, seq_len: int) -> float:
        tokens = micro_batch * seq_len
        return tokens * (
            self.saved_boundary_per_token
            + self.saved_interior_per_token
            + self.saved_interior_per_token_seq * seq_len
        )


@dataclass(frozen=True)
class OpCoverage:
    """Which ops capture priced, and which it saw but could not account for."""

    counted: dict[str, int] = field(default_factory=dict)
    unaccounted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelGraph:
    """The captured model: ordered layers, the layer DAG, and model metadata."""

    model_name: str
    layers: tuple[LayerInfo, ...]
    edges: tuple[tuple[str, str], ...]
    dtype: str
    hidden: int
    num_blocks: int
    vocab: int
    coverage: OpCoverage = field(default_factory=OpCoverage)
    capture_seq_lens: tuple[int, ...] = ()
    dynamic_dims: tuple[str, ...] = ()  # input dims exported dynamic: "batch", "seq"
    # block activations a compiled step saves / what eager autograd saves (passes/compiled_saved.py);
    # None until measured (``passes.compiled_saved.with_compiled_saved_scale``)
    compiled_saved_scale: float | None = None

    def __iter__(self) -> Iterator[LayerInfo]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    def classes(self) -> dict[str, list[LayerInfo]]:
        """Layer-class id → layers of that class, in order."""
        out: dict[str, list[LayerInfo]] = {}
        for layer in self.layers:
            out.setdefault(layer.class_id, []).append(layer)
        return out

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for layer in self.layers:
            g.add_node(layer.name, info=layer)
        g.add_edges_from(self.edges)
        return g

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Stable hash of structure and shapes (not of costs or weights)."""
        skeleton = [
            (l.name, l.kind, l.block, [(p.name, list(p.global_shape), p.dtype) for p in l.params])
            for l in self.layers
        ]
        blob = json.dumps([self.model_name, self.dtype, skeleton], sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]
