"""Capture, part 2: forward FLOPs and activation bytes of one export-graph node.

Counted on the training IR of ``torch.export`` (``aten.linear`` and
``aten.scaled_dot_product_attention`` whole), from the shapes in
``node.meta["val"]`` evaluated at one concrete (batch, sequence) point: symbolic
dims are substituted (``SizeEval``), so one dynamic export is priced at any size.

FLOPs (multiply-add = 2):

* matmul family (``MATMUL_OPS``): ``2·M·N·K``. ``linear(x[..., K], W[N, K])``:
  ``M = numel(x)/K``; ``mm``/``bmm``/``matmul``: ``2·numel(out)·K`` with ``K`` the
  last dim of the first operand (``_grouped_mm(x[S, K], W[E, K, N], offs)``, each
  row through one group's weight: ``2·S·N·K``); ``einsum`` of two operands: ``2·Π(sizes of all
  indices)``. A bias (``linear``, ``addmm``, ``baddbmm``) adds ``numel(out)``
  elementwise FLOPs.
* SDPA (``aten.scaled_dot_product_attention`` and its fused variants):
  ``2·B·Sq·Skv·(d_qk + d_v)`` (``QKᵀ`` plus ``·V``; ``= 4·b·h·s²·d`` for self
  attention). Causal attention is counted in full, as Megatron's and the PaLM
  MFU conventions do; the kernel skips about half of it, which calibration of
  the attention efficiency absorbs.
* elementwise: ``ELEMENTWISE_FLOPS[op] · numel(out)`` (reductions:
  ``REDUCTION_FLOPS[op] · numel(input)``). The constants are approximate
  operation counts per element (``gelu`` ≈ 8 for its tanh form, ``softmax`` = 5:
  max, subtract, exp, sum, divide; ``layer_norm`` = 8, ``rms_norm`` = 5,
  ``dropout`` = 2: compare and scale); these ops are memory-bound, so the bytes
  below matter more than these constants.
* zero-FLOP ops: views (``VIEW_OPS``, no bytes either) and data movement
  (``MOVE_OPS``: copies, gathers, factories; bytes only).
* anything else is *unaccounted*: the caller lists it in ``OpCoverage``; it
  adds no cost. A node whose shape depends on data (unbacked symbols) is
  unaccounted too, under ``"<op> (data-dependent shape)"``.

Which matmul FLOPs are "attention" (∝ tokens·seq) is decided by the caller's
two-point fit, not here: the nodes report FLOPs, the fit splits them.

Bytes: activation bytes read + written = sum of the node's tensor inputs that
are not weight-like (parameters, buffers and nodes computed only from them) plus
its outputs; views move nothing. ``scaled_dot_product_attention`` reads q, k, v
and writes its output only (a fused kernel never materialises the scores).
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import sympy
import torch
from torch import fx

MATMUL_OPS = frozenset(
    {"aten.linear", "aten.mm", "aten.bmm", "aten.matmul", "aten.addmm", "aten.baddbmm", "aten.einsum",
     "aten._grouped_mm"}
)
SDPA_OPS = frozenset(
    {
        "aten.scaled_dot_product_attention",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
    }
)
_BIAS_ARG = {"aten.linear": 2, "aten.addmm": 0, "aten.baddbmm": 0}

VIEW_OPS = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.transpose", "aten.permute", "aten.expand",
        "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.t", "aten.split",
        "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.alias", "aten.detach", "aten.as_strided",
        "aten.unflatten", "aten.flatten", "aten.view_as", "aten.expand_as", "aten.narrow", "aten.movedim",
        "aten.sym_size", "aten.sym_numel", "aten.sym_stride", "aten.sym_storage_offset", "aten.lift_fresh_copy",
        "aten._assert_scalar", "aten._assert_tensor_metadata", "aten.sym_constrain_range_for_size",
        "_operator.getitem", "_operator.mul", "_operator.add", "_operator.sub", "_operator.floordiv",
        "torch.sym_max", "torch.sym_min", "torch.sym_int",
    }
)
MOVE_OPS = frozenset(
    {
        "aten.clone", "aten.contiguous", "aten._to_copy", "aten.to", "aten.copy", "aten.copy_", "aten.cat",
        "aten.stack", "aten.embedding", "aten.index_select", "aten.gather", "aten.index", "aten.repeat",
        "aten.repeat_interleave", "aten.zeros", "aten.ones", "aten.full", "aten.arange", "aten.empty",
        "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros",
        "aten.new_ones", "aten.new_empty", "aten.new_full", "aten.scalar_tensor", "aten.type_as",
        "aten.one_hot", "aten.tensor_split", "aten.pad", "aten.constant_pad_nd", "aten.flip", "aten.roll",
    }
)
ELEMENTWISE_FLOPS = {
    **dict.fromkeys(
        (
            "aten.add", "aten.add_", "aten.sub", "aten.rsub", "aten.mul", "aten.mul_", "aten.div", "aten.neg",
            "aten.pow", "aten.sqrt", "aten.rsqrt", "aten.reciprocal", "aten.abs", "aten.maximum", "aten.minimum",
            "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.where", "aten.masked_fill", "aten.eq",
            "aten.ne", "aten.lt", "aten.gt", "aten.le", "aten.ge", "aten.logical_and", "aten.logical_or",
            "aten.logical_not", "aten.bitwise_not", "aten.bitwise_and", "aten.bitwise_or", "aten.exp",
            "aten.log", "aten.tanh", "aten.sin", "aten.cos", "aten.relu", "aten.tril", "aten.triu",
            "aten.square", "aten.erf", "aten.sign", "aten.scatter", "aten.scatter_add", "aten.index_add",
            "aten.index_put", "aten.masked_scatter", "aten.lerp", "aten.clamp_", "aten.div_", "aten.masked_fill_",
            "aten.index_put_", "aten.floor_divide",
        ),
        1,
    ),
    "aten.sigmoid": 3,
    "aten.silu": 4,
    "aten.gelu": 8,
    "aten.softmax": 5,
    "aten._softmax": 5,
    "aten.log_softmax": 5,
    "aten._log_softmax": 5,
    "aten.layer_norm": 8,
    "aten.native_layer_norm": 8,
    "aten.rms_norm": 5,
    "aten._fused_rms_norm": 5,
    "aten.dropout": 2,
    "aten.native_dropout": 2,
    "aten.bernoulli": 2,
}
REDUCTION_FLOPS = {
    **dict.fromkeys(
        ("aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.cumsum",
         "aten.argmax", "aten.argmin", "aten.topk", "aten.sort", "aten.any", "aten.all", "aten.histc"),
        1,
    ),
    "aten.var": 3,
    "aten.var_mean": 3,
    "aten.std": 3,
    "aten.logsumexp": 4,
    "aten.linalg_vector_norm": 2,
}


class UnresolvedShape(Exception):
    """A shape that cannot be evaluated at a concrete point (data-dependent size)."""


@dataclass(frozen=True)
class NodeCost:
    """Forward cost of one node at one (batch, sequence) point."""

    matmul_flops: float = 0.0  # matmul family and SDPA; split into matmul/attention by the caller
    elementwise_flops: float = 0.0
    bytes: float = 0.0


class SizeEval:
    """Evaluates (possibly symbolic) sizes of fake tensors at fixed symbol values."""

    def __init__(self, bindings: dict[sympy.Symbol, int]):
        self._bindings = {sym: sympy.Integer(v) for sym, v in bindings.items()}
        self._cache: dict[sympy.Expr, int] = {}

    def dim(self, size: int | torch.SymInt) -> int:
        if isinstance(size, int):
            return size
        expr = size.node.expr
        if expr not in self._cache:
            value = expr.xreplace(self._bindings)
            if not value.is_number:
                raise UnresolvedShape(str(expr))
            self._cache[expr] = int(value)
        return self._cache[expr]

    def shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(self.dim(d) for d in t.shape)

    def numel(self, t: torch.Tensor) -> int:
        n = 1
        for d in self.shape(t):
            n *= d
        return n

    def nbytes(self, t: torch.Tensor) -> int:
        return self.numel(t) * t.dtype.itemsize


def op_name(node: fx.Node) -> str:
    """Stable op name without the overload: ``aten.linear``, ``mylib.mystery``, ``_operator.getitem``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.replace("::", ".")  # "aten::linear": the packet, overload dropped
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def tensors_of(value: object) -> list[torch.Tensor]:
    """Tensors in a node's ``meta["val"]`` (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def is_known(name: str) -> bool:
    """Whether ``name`` (from ``op_name``) is priced by this module."""
    return (
        name in MATMUL_OPS or name in SDPA_OPS or name in VIEW_OPS or name in MOVE_OPS
        or name in ELEMENTWISE_FLOPS or name in REDUCTION_FLOPS
    )


def node_cost(node: fx.Node, size: SizeEval, weight_like: AbstractSet[fx.Node]) -> NodeCost:
    """Cost of a known op (``is_known``) at the point ``size`` evaluates. May raise ``UnresolvedShape``."""
    name = op_name(node)
    if name in VIEW_OPS:
        return NodeCost()
    outputs = tensors_of(node.meta.get("val"))
    out_bytes = sum(size.nbytes(t) for t in outputs)
    in_tensors = _activation_inputs(node, weight_like)
    if name in SDPA_OPS:
        return NodeCost(matmul_flops=_sdpa_flops(node, size), bytes=out_bytes + _nbytes(in_tensors[:3], size))
    moved = out_bytes + _nbytes(in_tensors, size)
    if name in MOVE_OPS:
        return NodeCost(bytes=moved)
    if name in MATMUL_OPS:
        flops = _matmul_flops(node, name, size)
        return NodeCost(matmul_flops=flops, elementwise_flops=_bias_flops(node, name, size), bytes=moved)
    if name in REDUCTION_FLOPS:
        inputs = [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        largest = max((size.numel(t) for t in inputs), default=0)
        return NodeCost(elementwise_flops=REDUCTION_FLOPS[name] * largest, bytes=moved)
    numel_out = sum(size.numel(t) for t in outputs[:1])
    return NodeCost(elementwise_flops=ELEMENTWISE_FLOPS[name] * numel_out, bytes=moved)


def _activation_inputs(node: fx.Node, weight_like: AbstractSet[fx.Node]) -> list[torch.Tensor]:
    vals = []
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if arg not in weight_like and isinstance(val, torch.Tensor):
            vals.append(val)
    return vals


def _nbytes(tensors: list[torch.Tensor], size: SizeEval) -> int:
    return sum(size.nbytes(t) for t in tensors)


def _arg_val(node: fx.Node, index: int) -> torch.Tensor | None:
    if index >= len(node.args) or not isinstance(node.args[index], fx.Node):
        return None
    val = node.args[index].meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _matmul_flops(node: fx.Node, name: str, size: SizeEval) -> int:
    if name == "aten.einsum":
        return _einsum_flops(node, size)
    first = 1 if name in ("aten.addmm", "aten.baddbmm") else 0
    a = _arg_val(node, first)
    out = node.meta["val"]
    assert a is not None and isinstance(out, torch.Tensor), f"malformed {name} node {node.name}"
    k = size.dim(a.shape[-1])
    return 2 * size.numel(out) * k


def _bias_flops(node: fx.Node, name: str, size: SizeEval) -> int:
    index = _BIAS_ARG.get(name)
    if index is None or _arg_val(node, index) is None:
        return 0
    return size.numel(node.meta["val"])


def _einsum_flops(node: fx.Node, size: SizeEval) -> int:
    equation, operands = node.args[0], node.args[1]
    inputs = equation.split("->")[0].split(",")
    if "..." in equation or len(inputs) != len(operands):
        raise UnresolvedShape(f"einsum {equation!r}")
    extent: dict[str, int] = {}
    for letters, operand in zip(inputs, operands):
        for letter, d in zip(letters.strip(), operand.meta["val"].shape):
            extent[letter] = size.dim(d)
    total = 2
    for value in extent.values():
        total *= value
    return total


def _sdpa_flops(node: fx.Node, size: SizeEval) -> int:
    q, k, v = (_arg_val(node, i) for i in range(3))
    assert q is not None and k is not None and v is not None, f"malformed SDPA node {node.name}"
    sq, d_qk = size.dim(q.shape[-2]), size.dim(q.shape[-1])
    skv, d_v = size.dim(k.shape[-2]), size.dim(v.shape[-1])
    batch_heads = size.numel(q) // (sq * d_qk)
    return 2 * batch_heads * sq * skv * (d_qk + d_v)


def weight_like_nodes(graph: fx.Graph, constant_names: set[str]) -> set[fx.Node]:
    """Nodes computed only from parameters, buffers and constants (placeholder names given)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in constant_names:
                out.add(node)
        elif node.op == "get_attr":
            out.add(node)
        elif node.op == "call_function":
            inputs = node.all_input_nodes
            if inputs and all(i in out for i in inputs):
                out.add(node)
    return out


__all__ = [
    "NodeCost",
    "SizeEval",
    "UnresolvedShape",
    "is_known",
    "node_cost",
    "op_name",
    "tensors_of",
    "weight_like_nodes",
]
