"""Capture, part 6: attention, MLP and value-head structure of hand-written layers, read from the exported graph.

Kinds and tensor-parallel roles come from module names first (``_capture_layers``): the ``attn``
and ``mlp`` modules of the reference and Hugging Face models. A user's block may hold raw
projections instead (nanoGPT: ``qkv``, ``proj``, ``fc``, ``out`` are children of the block, so
each is a layer of kind ``other``, all replicated) and the search would never tensor-parallelise
it. For layers of kind ``other``, capture reads the structure from the dataflow of the exported
graph. A *projection* is a ``shard_parameters.PROJECTIONS`` op whose weight is a parameter
(``linear(x, W)``, transformers' ``Conv1D`` as ``addmm`` / ``mm``); its width is the last dim of
its output, its input width that of its activation operand.

    attention  for each ``scaled_dot_product_attention``: every projection reached backwards
               from q, k or v is column-parallel (one feeding several of them is fused,
               ``[q | k | v]``: ``passes/context.py``); the walk goes through any op (views,
               splits, RoPE) and stops at projections, SDPA, graph inputs, norm ops over the
               hidden width and nodes of ``norm`` / ``embedding`` layers. Every projection whose
               activation operand is reached forwards from SDPA's output through single-input
               ops (transpose, reshape) is row-parallel.
               num_heads = dim 1 of q ``[B, H, S, d]``; num_kv_heads from the k projection's
               width: ``(width − H·d·[it feeds q]) / (d · how many of k, v it feeds)``.
    MLP        a projection B whose activation operand is reached backwards, through tensors as
               wide as B's input and at least one op that is not a view or copy (the activation:
               GELU, SiLU·up), from projections A: each A column-parallel, B row-parallel;
               ffn_hidden = B's input width. Attention is matched first.

A structure counts only when it is complete (q, k and v each come from a projection and one
consumes the output; an MLP has both sides), *closed* (every tensor computed from its
column-parallel outputs is used only on the way to SDPA / the row projection: a tp-sharded value
leaking elsewhere would need a gather the runtime does not insert), and all its projections lie
in layers of kind ``other`` (named layers keep the name heuristic). Such a layer then takes the
kind (``attention`` when it holds an attention projection, else ``mlp``), the roles of its
projections (column: weight and bias ``column``; row: weight ``row``, bias ``replicate``; any
other parameter ``replicate``) and the shape metadata. A nanoGPT block thus gives two
``attention`` layers (``qkv`` column, ``proj`` row) and two ``mlp`` layers (``fc``, ``out``), as a
Llama block gives one of each. Not recognised: attention written as matmul + softmax (no SDPA
node), an attention output gated before its projection, MLP intermediates combined with a
full-width tensor that no projection computed (those layers stay ``other``, replicated).

Two more facts about a layer's output that names and per-token bytes do not show, read for every
layer from the same graph:

    value head   a layer of kind ``other`` that is one projection of width 1 (a critic, whatever its
                 name: nanoGPT's ``critic``) whose activation operand is the output of a root-level
                 ``norm`` layer (the final norm; reached back through views, copies and dropout) and
                 whose result reaches a graph output through single-input ops (``squeeze``). It takes
                 kind ``value_head``, as the reference models' named one has, so SP declares the
                 all-gather of its sequence-sharded output (``autoshard/model_parallel.py``); its
                 parameters stay replicated. The LM head is a projection on the same norm output,
                 wider than 1.
    batch-free   the layer's module returns only tensors without the batch dim: a positional table
    output       looked up at ``arange(S)`` (nanoGPT's ``pos``) returns ``[S, h]``, broadcast over the
                 batch by the add after it. ``LayerInfo.batch_free_output``: the tp collectives on
                 that output (vocab-parallel all-reduce; SP's reduce-scatter and all-gather) move
                 ``s·h`` per micro-batch, not ``T·h``. A module output is a node inside the module
                 (``nn_module_stack``) that a node outside it, or the graph output, uses; it has the
                 batch dim when a dim of its shape contains the tokens' batch symbol (a static
                 export: when its dim 0 equals the batch). ``output_bytes_per_token`` is unchanged: it
                 counts what leaves the *layer*, root-level ops attributed to it included (the
                 ``tok + pos`` add, ``[B, S, h]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from autoshard.passes._capture_costs import MOVE_OPS, SDPA_OPS, VIEW_OPS, op_name, tensors_of
from autoshard.passes._capture_export import Exported, module_path
from autoshard.passes._capture_layers import LayerSpec, is_projection, out_features
from autoshard.passes.shard_parameters import PROJECTIONS

aten = torch.ops.aten
_NORM_OPS = frozenset({"aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm", "aten._fused_rms_norm",
                       "aten.group_norm"})
_STOP_KINDS = ("norm", "embedding")  # layers the backward walk never enters (residual stream side)
_NOT_ACTIVATIONS = VIEW_OPS | MOVE_OPS | {"aten.dropout", "aten.native_dropout"}
_MAX_WALK = 256  # nodes one backward walk may visit: a block's q/k/v or MLP path is a few dozen


@dataclass(frozen=True)
class Found:
    """One recognised projection: its role, the structure it belongs to and that structure's shape metadata."""

    role: str  # "column" | "row"
    kind: str  # "attention" | "mlp"
    meta: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Recognised:
    """What dataflow recognition changes: layers (new kinds), roles by ``id(parameter)``, ``LayerInfo`` fields
    per layer (shape metadata, ``batch_free_output``)."""

    layers: list[LayerSpec]
    roles: dict[int, str]
    meta: dict[str, dict[str, int | bool]]


def recognise_layers(layers: list[LayerSpec], exported: Exported, rename: Callable[[str], str],
                     hidden: int, batch: int) -> Recognised:
    """Kinds, roles and shape metadata of the ``other`` layers whose projections form attention or an
    MLP or that are a value head, and which layers' outputs are batch-free (module docstring). ``rename``
    maps a full-model module name to its name in the exported module (the three-block proxy's,
    ``_capture_proxy``; identity otherwise); ``batch``: the example's (a static export's batch dim)."""
    kind_of = {rename(spec.name): spec.kind for spec in layers}
    graph = _Graph(exported, kind_of, hidden)
    unnamed = {spec.name for spec in layers if spec.kind == "other" and not spec.direct_only
               and any(is_projection(m) for m in spec.module.modules())}
    candidates = {rename(f"{spec.name}.{local}" if local else spec.name) for spec in layers if spec.name in unnamed
                  for local, module in spec.module.named_modules() if is_projection(module)}
    # every projection in a named layer (the reference and Hugging Face models): no structure to look for
    found = graph.structures(candidates) if candidates else {}
    final_norms = {rename(spec.name) for spec in layers if spec.kind == "norm" and spec.block is None}
    out_layers, roles, meta = [], {}, {}
    for spec in layers:
        meta[spec.name] = {"batch_free_output": True} if graph.batch_free(rename(spec.name), batch) else {}
        hits = _layer_hits(spec, found, rename) if spec.name in unnamed else []
        if not hits:
            head = spec.name in unnamed and graph.value_head(spec, rename(spec.name), final_norms)
            out_layers.append(replace(spec, kind="value_head") if head else spec)
            continue
        kind = "attention" if any(f.kind == "attention" for _, f in hits) else "mlp"
        out_layers.append(replace(spec, kind=kind))
        roles.update({id(p): "replicate" for _, p in spec.own_parameters()})
        for module, f in hits:
            roles[id(module.weight)] = f.role
            if getattr(module, "bias", None) is not None:
                roles[id(module.bias)] = "column" if f.role == "column" else "replicate"
            meta[spec.name].update(f.meta)
    return Recognised(out_layers, roles, {name: fields for name, fields in meta.items() if fields})


def _layer_hits(spec: LayerSpec, found: dict[str, Found], rename) -> list[tuple[torch.nn.Module, Found]]:
    hits = []
    for local, module in spec.module.named_modules():
        name = f"{spec.name}.{local}" if local else spec.name
        if is_projection(module) and rename(name) in found:
            hits.append((module, found[rename(name)]))
    return hits


class _Graph:
    """The exported graph seen as projections and attention cores (module docstring)."""

    def __init__(self, exported: Exported, kind_of: dict[str, str], hidden: int) -> None:
        self.owner, self.weight_like, self.hidden = exported.owner, exported.weight_like, hidden
        self.kind_of, self.batch_symbol = kind_of, exported.batch_symbol
        self.returned = _module_outputs(exported.owner)
        params = exported.program.graph_signature.inputs_to_parameters  # placeholder name → fqn
        self.graph = exported.program.graph
        self.module_of: dict[fx.Node, str] = {}  # projection node → module path of its weight
        for node in self.graph.nodes:
            weight_at = PROJECTIONS.get(node.target, (None,))[0]
            weight = node.args[weight_at] if weight_at is not None and weight_at < len(node.args) else None
            if isinstance(weight, fx.Node) and weight.op == "placeholder" and weight.name in params:
                self.module_of[node] = params[weight.name].rsplit(".", 1)[0]

    # ------------------------------------------------------------------ structures
    def structures(self, candidates: set[str]) -> dict[str, Found]:
        """Module path → ``Found`` for every projection of a complete, closed structure whose projections
        are all ``candidates`` (module paths: the projections of the ``other`` layers)."""
        found: dict[fx.Node, Found] = {}
        for node in self.graph.nodes:
            if op_name(node) in SDPA_OPS and len(node.args) >= 3:
                self._claim(found, self._attention(node), candidates)
        for node in self.graph.nodes:
            if self.module_of.get(node) in candidates and node not in found:
                self._claim(found, self._mlp(node), candidates)
        modules = {}
        for node, f in found.items():
            modules.setdefault(self.module_of[node], f)
        return modules

    def _claim(self, found: dict[fx.Node, Found], structure: dict[fx.Node, Found] | None,
               candidates: set[str]) -> None:
        """Record ``structure`` unless one of its projections belongs to another or is not a candidate."""
        if structure and all(node not in found and self.module_of[node] in candidates for node in structure):
            found.update(structure)

    def _attention(self, sdpa: fx.Node) -> dict[fx.Node, Found] | None:
        sources, region = {}, set()
        for name, x in zip("qkv", sdpa.args[:3]):
            columns, seen = self._walk_back(x, width=None)
            if not columns:
                return None
            sources[name] = columns
            region |= seen
        rows = self._walk_forward(sdpa)
        columns = set().union(*sources.values())
        if not rows or not self._closed(columns, region, {sdpa}):
            return None
        meta = self._head_counts(sdpa, sources)
        out = {node: Found("column", "attention", meta) for node in columns}
        out.update({node: Found("row", "attention", meta) for node in rows})
        return out

    def _mlp(self, row: fx.Node) -> dict[fx.Node, Found] | None:
        x = self._activation(row)
        width = _last_dim(x)
        if width is None:
            return None
        columns, seen = self._walk_back(x, width=width)
        interior = seen - columns
        if not columns or not any(op_name(n) not in _NOT_ACTIVATIONS for n in interior):
            return None
        if not self._closed(columns, seen, {row}):
            return None
        meta = {"ffn_hidden": width}
        return {**{node: Found("column", "mlp", meta) for node in columns}, row: Found("row", "mlp", meta)}

    # ------------------------------------------------------------------ outputs
    def value_head(self, spec: LayerSpec, path: str, final_norms: set[str]) -> bool:
        """``spec`` (module path ``path`` in the export) is one width-1 projection reading a final norm's
        output, whose result reaches a graph output (module docstring)."""
        if not (is_projection(spec.module) and out_features(spec.module) == 1):
            return False
        nodes = [node for node, module in self.module_of.items() if module == path]
        return len(nodes) == 1 and self._from(self._activation(nodes[0]), final_norms) \
            and self._reaches_output(nodes[0])

    def _from(self, node: fx.Node, layers: set[str]) -> bool:
        """``node`` is computed in one of ``layers``, or from such a node through views, copies and dropout."""
        for _ in range(_MAX_WALK):
            if self.owner.get(node) in layers:
                return True
            inputs = self._activation_inputs(node)
            if node.op != "call_function" or op_name(node) not in _NOT_ACTIVATIONS or len(inputs) != 1:
                return False
            node = inputs[0]
        return False

    def _reaches_output(self, node: fx.Node) -> bool:
        """A graph output is ``node`` or computed from it alone (single-input ops: ``squeeze``, casts)."""
        stack = [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if user.op == "output":
                    return True
                if user.op == "call_function" and self._activation_inputs(user) == [current]:
                    stack.append(user)
        return False

    def batch_free(self, path: str, batch: int) -> bool:
        """Every tensor the module at ``path`` returns lacks the batch dim (module docstring)."""
        tensors = [t for node in self.returned.get(path, ()) for t in tensors_of(node.meta.get("val"))]
        return bool(tensors) and not any(self._has_batch(t, batch) for t in tensors)

    def _has_batch(self, t: torch.Tensor, batch: int) -> bool:
        if self.batch_symbol is None:  # a static export: the batch dim is dim 0 (model inputs: B != S)
            return t.dim() > 0 and isinstance(t.shape[0], int) and t.shape[0] == batch
        return any(isinstance(d, torch.SymInt) and self.batch_symbol in d.node.expr.free_symbols for d in t.shape)

    # ------------------------------------------------------------------ walks
    def _walk_back(self, start: fx.Node, width: int | None) -> tuple[set[fx.Node], set[fx.Node]]:
        """Projections reached backwards from ``start`` and every node visited (module docstring). With
        ``width`` (an MLP), only through tensors of that last dim; reaching a full-width tensor that no
        projection computed (a replicated operand of the sharded intermediate) gives no projections."""
        columns: set[fx.Node] = set()
        seen: set[fx.Node] = set()
        stack = [start]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.module_of:
                columns.add(node)
                continue
            if len(seen) > _MAX_WALK:
                return set(), seen
            if self._stops(node):
                if width is not None and _last_dim(node) == width:
                    return set(), seen
                continue
            for source in self._activation_inputs(node):
                # with a width, a narrower or wider operand (a broadcast scale) is not part of the intermediate;
                # a split's list output (a fused gate/up) and a projection are
                if width is None or source in self.module_of or _last_dim(source) == width \
                        or isinstance(source.meta.get("val"), (list, tuple)):
                    stack.append(source)
        return columns, seen

    def _stops(self, node: fx.Node) -> bool:
        name = op_name(node)
        if node.op != "call_function" or name in SDPA_OPS:
            return True
        if self.kind_of.get(self.owner.get(node, ""), "") in _STOP_KINDS:
            return True
        return name in _NORM_OPS and _last_dim(node) == self.hidden

    def _walk_forward(self, sdpa: fx.Node) -> set[fx.Node]:
        """Projections consuming SDPA's output through single-input ops; none if the output leaks elsewhere."""
        rows: set[fx.Node] = set()
        stack = [sdpa]
        while stack:
            node = stack.pop()
            for user in node.users:
                if not isinstance(user.meta.get("val"), torch.Tensor):
                    continue  # sizes read from the output
                if user in self.module_of and self._activation(user) is node:
                    rows.add(user)
                elif user.op == "call_function" and self._activation_inputs(user) == [node] \
                        and op_name(user) not in SDPA_OPS and user not in self.module_of:
                    stack.append(user)
                else:
                    return set()
        return rows

    def _closed(self, columns: set[fx.Node], seen: set[fx.Node], sinks: set[fx.Node]) -> bool:
        """Every tensor computed from the column outputs (inside ``seen``) is used only inside or by ``sinks``."""
        region, stack = set(columns), list(columns)
        while stack:
            node = stack.pop()
            for user in node.users:
                if user in sinks or user in region or not isinstance(user.meta.get("val"), (torch.Tensor, list,
                                                                                               tuple)):
                    continue
                if user not in seen:
                    return False
                region.add(user)
                stack.append(user)
        return True

    def _head_counts(self, sdpa: fx.Node, sources: dict[str, set[fx.Node]]) -> dict[str, int]:
        q, k = (x.meta.get("val") for x in sdpa.args[:2])
        heads, head_dim = (_int(q.shape[1]), _int(q.shape[-1])) if isinstance(q, torch.Tensor) and q.dim() == 4 \
            else (None, None)
        if heads is None or head_dim is None:
            return {}
        kv = _int(k.shape[1]) if isinstance(k, torch.Tensor) and k.dim() == 4 else None
        if len(sources["k"]) == 1:
            (k_proj,) = sources["k"]
            feeds = {name for name, nodes in sources.items() if k_proj in nodes}
            width = _last_dim(k_proj)
            kv_share = width - heads * head_dim * ("q" in feeds) if width is not None else None
            per = head_dim * len(feeds & {"k", "v"})
            if kv_share is not None and kv_share > 0 and kv_share % per == 0:
                kv = kv_share // per
        return {"num_heads": heads, "num_kv_heads": kv or heads}

    # ------------------------------------------------------------------ operands
    def _activation(self, projection: fx.Node) -> fx.Node:
        return projection.args[1 if projection.target == aten.addmm.default else 0]

    def _activation_inputs(self, node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes
                if a not in self.weight_like and isinstance(a.meta.get("val"), (torch.Tensor, list, tuple))]


def _module_outputs(nodes) -> dict[str, list[fx.Node]]:
    """Module path → the nodes run inside that module (``nn_module_stack``) that a node outside it, or the
    graph output, uses: what the module returns."""
    paths = {node: frozenset(module_path(entry[0]) for entry in node.meta["nn_module_stack"].values())
             for node in nodes if node.meta.get("nn_module_stack")}
    out: dict[str, list[fx.Node]] = {}
    for node, inside in paths.items():
        for path in inside:
            if any(user.op == "output" or path not in paths.get(user, ()) for user in node.users):
                out.setdefault(path, []).append(node)
    return out


def _int(size) -> int | None:
    return int(size) if isinstance(size, int) else None


def _last_dim(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return _int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None
