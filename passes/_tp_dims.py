"""Where the tp split goes: the tensor dim of each ``shard`` activation that tp splits, and the local
form of the static sizes the exported graph carries for it (used by ``passes/insert_collectives.py``).

``torch.export`` writes every static size as a
literal: HF's attention reshapes carry the *global* head counts (``repeat_kv``'s
``expand(B, kv, n_rep, S, d)`` and ``reshape(B, kv·n_rep, S, d)``), GPT-2 its
fused width (``view(B, S, 3h)``, ``split(h)``). Each ``shard`` activation
carries the tensor dim that tp splits, followed through the graph by one rule
per op family, and each literal on that dim is rewritten to its tp-local
value, so the rule works for any model written with these ops:

    column projection          the last dim (its fused parts: ``TpLayout.parts``)
    view / reshape / flatten   dims grouped by equal products (sympy over the symbolic
                               batch and sequence); the split dim must be the outermost
                               of its group and goes to the outermost output dim of the
                               group (``[.., 64] → [.., 4, 16]``: the 4 heads), whose
                               literal is divided by tp; fused ``[.., 3·H·d] → [.., 3, H, d]``
                               splits H
    expand                     same dim, its literal divided by tp
    split / chunk on it        only the fused parts (sizes divided by tp), then not fused
    transpose / permute / (un)squeeze / slice / select   moved; slicing or indexing
                               the split dim is refused
    scaled_dot_product_attention   q, k and v split on the heads dim (1); no per-head mask
    anything else              the split dim keeps its right-aligned place and global
                               size; a replicated operand may only broadcast along it
    row projection             the split dim must be the contracted last dim

"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import tag
from autoshard.passes.shard_parameters import PROJECTIONS, RESHAPES

NAME = "insert_collectives"  # the pass whose nodes these rewrites tag
aten = torch.ops.aten


_SHAPE_ARG = {aten.view.default: (1, 0), aten.reshape.default: (1, 0), aten._unsafe_view.default: (1, 0),
              aten.unflatten.int: (2, None)}  # op → (arg holding output sizes, first output dim it covers)
_SDPA = (aten.scaled_dot_product_attention.default,)


def split_param_misuse(param: fx.Node) -> fx.Node | None:
    """The first user of a tp-split parameter that takes it other than as a projection's weight or bias
    or an embedding's table (``x @ W.t()``, a weight sliced by hand: it would see this rank's piece as if
    it were whole), or None. One rule for the runtime (``insert_collectives``) and capture
    (``LayerInfo.tp_refusal``); ``param`` is a ``get_attr`` or a lifted placeholder."""
    for user in param.users:
        weight_at, bias_at, _ = PROJECTIONS.get(user.target, (None, None, False))
        positions = {weight_at, bias_at} if user.target in PROJECTIONS else {0}
        known = user.target in PROJECTIONS or user.target == aten.embedding.default
        if not known or not any(i is not None and i < len(user.args) and user.args[i] is param for i in positions):
            return user
    return None


class ShardDims:
    """Which tensor dim of each ``shard`` activation is split over tp, and the local form of the static
    sizes the exported graph carries for it (module docstring, "Static sizes").

    ``set``/``follow`` record ``(dim, parts)`` per node: ``parts`` > 1 while the dim still holds the
    blocks of a fused projection (``[q_r | k_r | v_r]``). A node whose rule cannot say where the split
    dim went, or that would compute something else on the local piece, raises ``PlanError``.
    """

    def __init__(self, tp: int, layer_of) -> None:
        self.tp, self.layer_of = tp, layer_of
        self.dims: dict[fx.Node, tuple[int, int]] = {}

    def set(self, node: fx.Node, dim: int, parts: int = 1) -> None:
        self.dims[node] = (dim, parts)

    def refuse(self, node: fx.Node, why: str) -> PlanError:
        return PlanError(f"layer {self.layer_of(node)!r}: {why} at node {node.name} ({node.target}); the "
                         "tensor-parallel runtime cannot run this layout: use tp='none' for the layer")

    def follow(self, node: fx.Node, sharded: set[fx.Node]) -> None:
        """Record the split dim of ``node``'s output from its sharded inputs, rewriting its static sizes."""
        first = node.args[0] if node.args else None
        source = first if isinstance(first, fx.Node) and first in sharded else min(sharded, key=lambda n: n.name)
        dim, parts = self.dims[source]
        val = node.meta.get("val")
        if node.target in RESHAPES:
            self.set(node, *self.reshape(node, source, dim, parts))
        elif node.target == aten.expand.default:
            self.set(node, self.expand(node, source, dim), parts)
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            self.set(node, *self.split(node, source, dim, parts))
        elif node.target is operator.getitem and isinstance(source.meta.get("val"), (list, tuple)):
            self.set(node, dim, parts)
        elif node.target in _SDPA:
            self.set(node, self.attention(node, sharded), 1)
        elif node.target in _MOVES:
            self.set(node, _MOVES[node.target](node, dim, source.meta["val"].dim(), self), parts)
        elif isinstance(val, torch.Tensor):
            self.set(node, self.elementwise(node, sharded), parts)
        elif val is not None and not isinstance(val, (int, torch.SymInt, bool)):
            raise self.refuse(node, "a tp-sharded input gives a non-tensor output")

    def check_contracted(self, node: fx.Node, x: fx.Node, is_shard: bool) -> None:
        """A row-parallel projection contracts the split dim: it must be the last, with no fused parts."""
        last = x.meta["val"].dim() - 1
        if not is_shard or self.dims.get(x, (None, 1)) != (last, 1):
            raise self.refuse(node, f"the row-parallel input {x.name} is not split over tp on its last dim "
                                    f"(split: {self.dims.get(x)})")

    def local(self, node: fx.Node, size, what: str) -> int:
        if not isinstance(size, int) or size % self.tp:
            raise self.refuse(node, f"{what} of size {size} is split over tp={self.tp}, which does not divide it "
                                    "(heads, key/value heads or fused parts; choose a tp degree that divides them)")
        return size // self.tp

    def reshape(self, node: fx.Node, source: fx.Node, dim: int, parts: int) -> tuple[int, int]:
        """view / reshape: the split dim is the outermost dim of its group of merged / split dims."""
        ins, outs = list(source.meta["val"].shape), list(node.meta["val"].shape)
        groups = _reshape_groups(ins, outs)
        group = next((g for g in groups or () if dim in g[0]), None)
        if group is None or any(ins[d] != 1 for d in group[0][:group[0].index(dim)]):
            raise self.refuse(node, f"reshape {ins} → {outs} moves the tp-split dim {dim} inside other dims")
        gin, gout = group
        out_dim, out_parts = gout[0], parts
        if len(gin) != 1 or len(gout) != 1 or ins[dim] != outs[out_dim]:
            out_parts = 1
            if parts > 1 and outs[gout[0]] == parts and len(gout) > 1:
                out_dim = gout[1]  # [.., 3·H·d] → [.., 3, H, d]: the heads are split, each of q, k, v whole
            elif parts > 1:
                raise self.refuse(node, f"reshape {ins} → {outs} mixes the {parts} fused parts of dim {dim}")
        local = self.local(node, outs[out_dim], f"dim {out_dim} of the reshape's output")
        at, first = _SHAPE_ARG.get(node.target, (None, 0))  # the literal output sizes: args[at] from dim first
        if node.target == aten.unflatten.int:
            first = node.args[1] % source.meta["val"].dim()
        shape = list(node.args[at]) if at is not None else []
        if not 0 <= out_dim - first < len(shape) or shape[out_dim - first] == -1:
            return out_dim, out_parts
        if not isinstance(shape[out_dim - first], int):
            raise self.refuse(node, f"the tp-split size of the reshape is symbolic ({shape[out_dim - first]})")
        shape[out_dim - first] = local
        node.update_arg(at, shape)
        tag(node, NAME, "tp-local size of the split dim", dim=out_dim)
        return out_dim, out_parts

    def expand(self, node: fx.Node, source: fx.Node, dim: int) -> int:
        out_dim = dim + node.meta["val"].dim() - source.meta["val"].dim()
        shape = list(node.args[1])
        if isinstance(shape[out_dim], int) and shape[out_dim] != -1:
            shape[out_dim] = self.local(node, shape[out_dim], f"dim {out_dim} of the expand")
            node.update_arg(1, shape)
            tag(node, NAME, "tp-local size of the split dim (e.g. GQA's key/value heads)", dim=out_dim)
        return out_dim

    def split(self, node: fx.Node, source: fx.Node, dim: int, parts: int) -> tuple[int, int]:
        """split / chunk along the split dim: only a fused projection's parts, each then tp-local."""
        ndim = source.meta["val"].dim()
        at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if at % ndim != dim:
            return dim, parts
        pieces = len(node.meta["val"])
        if pieces != parts:
            raise self.refuse(node, f"dim {dim} is split into {pieces} pieces but holds {parts} fused part(s)")
        if node.target == aten.split.Tensor:
            node.update_arg(1, self.local(node, node.args[1], "the split size"))
        elif node.target == aten.split_with_sizes.default:
            node.update_arg(1, [self.local(node, s, "a split size") for s in node.args[1]])
        tag(node, NAME, "tp-local sizes of a fused projection's parts")
        return dim, 1

    def attention(self, node: fx.Node, sharded: set[fx.Node]) -> int:
        """SDPA runs per head: q, k and v must be split on the heads dim (1); a per-head mask cannot be."""
        q, k, v = node.args[:3]
        for x in (q, k, v):
            if x not in sharded or self.dims.get(x) != (1, 1):
                raise self.refuse(node, f"attention input {x.name} is not split over tp on its heads dim "
                                        f"(split: {self.dims.get(x)})")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mask_val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if mask_val is not None and mask_val.dim() >= 3 and mask_val.shape[-3] != 1:
            raise self.refuse(node, "a per-head attention mask / bias is not split over tp")
        return 1

    def elementwise(self, node: fx.Node, sharded: set[fx.Node]) -> int:
        """Any other op: the split dim keeps its (right-aligned) place and global size in the output, for
        every sharded input; a replicated operand may only broadcast along it."""
        out = node.meta["val"]
        found = set()
        for x in sharded:
            dim, _ = self.dims[x]
            here = dim + out.dim() - x.meta["val"].dim()
            if here < 0 or out.shape[here] != x.meta["val"].shape[dim]:
                raise self.refuse(node, f"the op changes or removes the tp-split dim {dim} of {x.name}")
            found.add(here)
        if len(found) != 1:
            raise self.refuse(node, f"its sharded inputs are split on different dims {sorted(found)}")
        here = found.pop()
        for x in node.all_input_nodes:
            val = x.meta.get("val")
            at = here + (val.dim() - out.dim()) if isinstance(val, torch.Tensor) else -1
            if x not in sharded and at >= 0 and val.shape[at] != 1:
                raise self.refuse(node, f"replicated operand {x.name} {tuple(val.shape)} spans the tp-split dim")
        return here


def _transpose(node: fx.Node, dim: int, ndim: int, _dims) -> int:
    a, b = (d % ndim for d in node.args[1:3])
    return b if dim == a else a if dim == b else dim


def _permute(node: fx.Node, dim: int, ndim: int, _dims) -> int:
    return [d % ndim for d in node.args[1]].index(dim)


def _unsqueeze(node: fx.Node, dim: int, ndim: int, _dims) -> int:
    return dim + (node.args[1] % (ndim + 1) <= dim)


def _squeeze(node: fx.Node, dim: int, ndim: int, dims) -> int:
    at = node.args[1] if len(node.args) > 1 else range(ndim)
    removed = [d % ndim for d in (at if isinstance(at, (list, tuple, range)) else [at])
               if node.args[0].meta["val"].shape[d % ndim] == 1]
    return dim - sum(d < dim for d in removed)


def _slice(node: fx.Node, dim: int, ndim: int, dims) -> int:
    at, start, end = (list(node.args[1:4]) + [0, None, None])[:3]
    size = node.args[0].meta["val"].shape[dim]
    if at % ndim == dim and ((start or 0) != 0 or (end is not None and end < size)):
        raise dims.refuse(node, f"a slice of the tp-split dim {dim}")
    return dim


def _select(node: fx.Node, dim: int, ndim: int, dims) -> int:
    at = node.args[1] % ndim
    if at == dim:
        raise dims.refuse(node, f"an index into the tp-split dim {dim}")
    return dim - (at < dim)


_MOVES = {aten.transpose.int: _transpose, aten.permute.default: _permute, aten.unsqueeze.default: _unsqueeze,
          aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze, aten.squeeze.default: _squeeze,
          aten.slice.Tensor: _slice, aten.select.int: _select}


def _sym(size) -> sympy.Expr:
    return sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _reshape_groups(ins: list, outs: list) -> list[tuple[list[int], list[int]]] | None:
    """Input dims and output dims of a reshape in groups of equal products, smallest groups first
    (``[B, S, 64] → [B, S, 4, 16]``: ``([0], [0]), ([1], [1]), ([2], [2, 3])``); None when none fit."""
    a, b = [_sym(s) for s in ins], [_sym(s) for s in outs]
    i = j = 0
    groups = []
    while i < len(a) and j < len(b):
        match = next(((m, n) for total in range(2, len(a) - i + len(b) - j + 1) for m in range(1, total)
                      if (n := total - m) <= len(b) - j and m <= len(a) - i
                      and sympy.expand(sympy.Mul(*a[i:i + m]) - sympy.Mul(*b[j:j + n])) == 0), None)
        if match is None:
            return None
        groups.append((list(range(i, i + match[0])), list(range(j, j + match[1]))))
        i, j = i + match[0], j + match[1]
    if any(s != 1 for s in a[i:] + b[j:]):
        return None
    return groups
