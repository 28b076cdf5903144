"""Capture, part 4: run ``torch.export``, attribute nodes to layers, price them per layer.

Attribution rule (also in ``capture``'s docstring): a ``call_function`` node
belongs to the deepest module of ``node.meta["nn_module_stack"]`` that is a
layer; otherwise to the layer of the nearest preceding node; nodes before the
first layer node go to that first layer. A higher-order op that runs a
subgraph under another grad or autocast mode (``wrap_with_set_grad_enabled``:
a ``torch.no_grad()`` region inside the model, such as Hugging Face's rotary
table) is priced by the ops of its subgraph, in the wrapper's layer.

An export failure becomes a ``CaptureError`` naming the module and op: the
module is the innermost traceback frame whose first argument (``self``) is a
module of the model, preferring frames outside torch itself; the op is the last
``torch.ops.<op>`` the exception text mentions (export prints the graph traced
so far, ending at the failing op), else the source line of that frame.

Output dataclasses (decision): a forward that returns a plain ``@dataclass`` (or
nests one in a tuple, a dict or another dataclass) is captured as it is. Export
can only flatten an output whose type is a pytree node, so while ``export`` traces,
a forward hook on the root module registers every dataclass type of the output
that pytree does not know with ``torch.export.register_dataclass`` (each init
field a child; a field left ``None`` rides in the context), before export
flattens it. Registration is what the error hint used to ask of the user, done
for them: once per class and process-wide (torch keeps one registry; it cannot
be undone), only for a class a captured forward returned, and never for a type
pytree already handles (tuples, dicts, ``ModelOutput``, namedtuples, a class the
user registered). The export's ``out_spec`` then names the class, so the
runtime gives it back: the program's ``torch.export`` of its meta twin
(``runtime/program.py``) and a pipeline's last stage (``split_pipeline``: the
model's structure from ``out_spec``) rebuild the dataclass, and ``loss_fn``
receives it as the model returns it. The registration lives in the process
that ran it; the program's own export registers the classes again (``runtime/program.py``),
so a graph captured in another process builds as well. Any other unknown output class is refused
as before, the hint naming ``register_pytree_node``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import sympy
import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import Dim, ExportedProgram

from autoshard.errors import CaptureError
from autoshard.passes import _capture_costs as costs

_TORCH_DIR = os.path.dirname(torch.__file__)
_STRICT_PATH = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


@dataclass(frozen=True)
class Exported:
    """One exported program with its node → layer attribution."""

    program: ExportedProgram
    owner: dict[fx.Node, str]
    weight_like: frozenset[fx.Node]
    layer_order: tuple[str, ...]  # layers by their first node
    batch_symbol: sympy.Symbol | None
    seq_symbol: sympy.Symbol | None
    hints: dict[sympy.Symbol, int]  # example value of every backed symbol

    @property
    def dynamic_dims(self) -> tuple[str, ...]:
        named = (("batch", self.batch_symbol), ("seq", self.seq_symbol))
        return tuple(label for label, sym in named if sym is not None)

    def size_at(self, seq: int | None) -> costs.SizeEval:
        """Evaluator of this graph's shapes with the sequence symbol set to ``seq`` (None: the example's)."""
        bindings = dict(self.hints)
        if seq is not None and self.seq_symbol is not None:
            bindings[self.seq_symbol] = seq
        return costs.SizeEval(bindings)


@dataclass
class Accum:
    """Per-layer cost totals at one (batch, sequence) point (an accumulator, internal)."""

    matmul_flops: float = 0.0
    elementwise_flops: float = 0.0
    bytes: float = 0.0
    attention_op_flops: float = 0.0  # SDPA + activation×activation matmuls (cross-check)
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    counted: Counter = field(default_factory=Counter)  # op name → nodes priced
    unaccounted: Counter = field(default_factory=Counter)  # op name → nodes not priced


@dataclass(frozen=True)
class GraphView:
    """What capture takes from export: layer order, layer edges, per-layer costs at (s1, s2)."""

    layer_order: tuple[str, ...]
    edges: frozenset[tuple[str, str]]
    costs: tuple[dict[str, Accum], dict[str, Accum]]
    dynamic_dims: tuple[str, ...]


def export(model: nn.Module, inputs: tuple, dynamic: bool, layer_names: list[str], model_name: str) -> Exported:
    """``torch.export.export(strict=False)`` (``Dim.AUTO`` on every dim if ``dynamic``) + attribution."""
    shapes = None
    if dynamic:
        shapes = tuple({d: Dim.AUTO for d in range(x.dim())} if isinstance(x, torch.Tensor) else None for x in inputs)
    try:
        with registering_output_dataclasses(model):
            program = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:  # every export failure is reported as a CaptureError
        raise export_error(model, model_name, exc) from exc
    graph = program.graph
    owner, order = _attribute(graph, set(layer_names))
    if not owner:
        raise CaptureError(
            f"the export of {model_name} has no operations in any layer ({', '.join(layer_names[:5])}, ...); "
            "capture needs the forward pass to call the model's submodules"
        )
    sig = program.graph_signature
    constants = {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}
    batch_sym, seq_sym, hints = _symbols(graph, sig.user_inputs)
    weight_like = frozenset(costs.weight_like_nodes(graph, constants))
    return Exported(program, owner, weight_like, order, batch_sym, seq_sym, hints)


@contextlib.contextmanager
def registering_output_dataclasses(model: nn.Module) -> Iterator[None]:
    """While open, every call of ``model`` registers the unknown dataclass types of its output as pytree nodes
    (module docstring, "Output dataclasses"): a forward hook, which runs before export flattens the output."""
    def hook(_module: nn.Module, _args: tuple, output: object) -> None:  # None: the output stays as it is
        register_output_dataclasses(output)

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def register_output_dataclasses(output: object) -> tuple[type, ...]:
    """Register each dataclass type in ``output`` that pytree does not know (``torch.export.register_dataclass``);
    returns the types registered now (none when every one was known)."""
    found = unregistered_dataclasses(output)
    for cls in found:
        torch.export.register_dataclass(cls)
    return found


def unregistered_dataclasses(value: object) -> tuple[type, ...]:
    """Dataclass types pytree would take for leaves in ``value``, outermost first, searched through pytree nodes
    and through the init fields of those dataclasses themselves."""
    found: list[type] = []
    pending = [value]
    while pending:
        for leaf in pytree.tree_leaves(pending.pop()):
            cls = type(leaf)
            if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and cls not in found:
                found.append(cls)
                pending.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init)
    return tuple(found)


def _symbols(graph: fx.Graph, user_inputs) -> tuple[sympy.Symbol | None, sympy.Symbol | None, dict]:
    """Symbols of the tokens' batch and sequence dims, and every backed symbol's example value."""
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    tokens = placeholders[user_inputs[0]].meta["val"]
    dims = []
    for size in tokens.shape[:2]:
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        dims.append(expr if isinstance(expr, sympy.Symbol) else None)
    if dims[0] is not None and dims[0] == dims[1]:
        dims = [None, None]  # duck-sized: batch == seq at the example; the caller exports statically
    shape_env = _shape_env(placeholders.values())
    hints = {sym: int(v) for sym, v in _backed_values(shape_env).items()}
    return dims[0], dims[1], hints


def _backed_values(shape_env) -> dict:
    """Example value of every backed symbol (``backed_var_to_val`` from torch 2.13, ``var_to_val`` before)."""
    if shape_env is None:
        return {}
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


def _shape_env(nodes):
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def module_path(path: str) -> str:
    """``"L['self'].blocks[0].attn"`` (strict export) or ``"blocks.0.attn"`` → ``"blocks.0.attn"``."""
    path = path.removeprefix("L['self']").removeprefix("L__self__")
    path = _STRICT_PATH.sub(lambda m: "." + m.group(1), path)
    return path.lstrip(".").replace("..", ".")


def _stack_owner(node: fx.Node, layer_names: set[str]) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        path = module_path(entry[0])
        if path in layer_names:
            return path
    return None


def _attribute(graph: fx.Graph, layer_names: set[str]) -> tuple[dict[fx.Node, str], tuple[str, ...]]:
    owner: dict[fx.Node, str] = {}
    pending: list[fx.Node] = []
    order: list[str] = []
    last: str | None = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = _stack_owner(node, layer_names) or last
        if layer is None:
            pending.append(node)
            continue
        if layer not in order:
            order.append(layer)
        for early in pending:
            owner[early] = layer
        pending.clear()
        owner[node] = layer
        last = layer
    return owner, tuple(order)


def price(exported: Exported, size: costs.SizeEval) -> dict[str, Accum]:
    """Per-layer FLOPs, bytes, boundary bytes and op counts of ``exported`` at the point ``size`` evaluates."""
    out: dict[str, Accum] = {}
    for node, layer in exported.owner.items():
        acc = out.setdefault(layer, Accum())
        body = _wrapped_subgraph(node, exported)
        if body is not None:  # a grad-mode / autocast region: its ops are priced one by one
            acc.counted[costs.op_name(node)] += 1
            sub, weight_like = body
            for inner in sub.graph.nodes:
                if inner.op == "call_function":
                    _price_node(inner, size, weight_like, acc)
            continue
        _price_node(node, size, exported.weight_like, acc)
    _boundary_bytes(exported, size, out)
    return out


def _price_node(node: fx.Node, size: costs.SizeEval, weight_like: frozenset[fx.Node], acc: Accum) -> None:
    name = costs.op_name(node)
    if not costs.is_known(name):
        acc.unaccounted[name] += 1
        return
    try:
        cost = costs.node_cost(node, size, weight_like)
    except costs.UnresolvedShape:
        acc.unaccounted[f"{name} (data-dependent shape)"] += 1
        return
    acc.counted[name] += 1
    acc.matmul_flops += cost.matmul_flops
    acc.elementwise_flops += cost.elementwise_flops
    acc.bytes += cost.bytes
    if name in costs.SDPA_OPS or (name in costs.MATMUL_OPS and _activation_product(node, weight_like)):
        acc.attention_op_flops += cost.matmul_flops


# Higher-order ops that run a subgraph (a ``get_attr`` argument) in place under another grad or
# autocast mode: export keeps ``with torch.no_grad():`` inside a model (Hugging Face's rotary
# embedding) as ``wrap_with_set_grad_enabled(False, submod, *operands)``.
_WRAPPERS = frozenset({"torch.ops.higher_order.wrap_with_set_grad_enabled",
                       "torch.ops.higher_order.wrap_with_autocast"})


def _wrapped_subgraph(node: fx.Node, exported: Exported) -> tuple[fx.GraphModule, frozenset[fx.Node]] | None:
    """The subgraph a wrapper ``node`` runs and its weight-like nodes (operands bound to weight-like
    nodes outside, and what is computed only from them); ``None`` for any other node."""
    if costs.op_name(node) not in _WRAPPERS:
        return None
    position = next((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"), None)
    if position is None:
        return None
    sub = getattr(exported.program.graph_module, node.args[position].target)
    operands = node.args[position + 1:]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    weights = {p.name for p, a in zip(placeholders, operands) if isinstance(a, fx.Node) and a in exported.weight_like}
    return sub, frozenset(costs.weight_like_nodes(sub.graph, weights))


def _activation_product(node: fx.Node, weight_like: frozenset[fx.Node]) -> bool:
    operands = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return len(operands) >= 2 and not any(a in weight_like for a in operands)


def _boundary_bytes(exported: Exported, size: costs.SizeEval, layers: dict[str, Accum]) -> None:
    """Bytes of distinct tensors entering / leaving each layer (parameters and constants excluded)."""
    inputs: dict[str, set[fx.Node]] = {}
    outputs: dict[str, set[fx.Node]] = {}
    owner = exported.owner
    for node, layer in owner.items():
        for source in _activation_sources(node, exported.weight_like):
            if owner.get(source) != layer:
                inputs.setdefault(layer, set()).add(source)
        if any(user.op == "output" or owner.get(user) != layer for user in node.users):
            outputs.setdefault(layer, set()).add(node)
    for layer, acc in layers.items():
        acc.input_bytes = _nodes_bytes(inputs.get(layer, ()), size)
        acc.output_bytes = _nodes_bytes(outputs.get(layer, ()), size)


def _activation_sources(node: fx.Node, weight_like: frozenset[fx.Node]) -> list[fx.Node]:
    """Inputs of ``node`` that carry activation tensors (not sizes, parameters or constants)."""
    return [
        source for source in node.all_input_nodes
        if source not in weight_like and costs.tensors_of(source.meta.get("val"))
    ]


def _nodes_bytes(nodes, size: costs.SizeEval) -> float:
    total = 0
    for node in nodes:
        for t in costs.tensors_of(node.meta.get("val")):
            try:
                total += size.nbytes(t)
            except costs.UnresolvedShape:
                continue
    return float(total)


def edges(exported: Exported) -> frozenset[tuple[str, str]]:
    """(producer layer, consumer layer) pairs of activation data flow."""
    found: set[tuple[str, str]] = set()
    for node, layer in exported.owner.items():
        for source in _activation_sources(node, exported.weight_like):
            producer = exported.owner.get(source)
            if producer is not None and producer != layer:
                found.add((producer, layer))
    return frozenset(found)


def root_nodes_in(exported: Exported, prefix: str) -> bool:
    """Whether a node from outside every module under ``prefix`` was attributed to a layer under it."""
    for node, layer in exported.owner.items():
        if layer.startswith(prefix):
            stack = node.meta.get("nn_module_stack") or {}
            if not any(module_path(entry[0]).startswith(prefix) for entry in stack.values()):
                return True
    return False


def export_error(model: nn.Module, model_name: str, exc: BaseException) -> CaptureError:
    """A ``CaptureError`` naming the module and op where ``torch.export`` failed."""
    module, where = _failing_frame(model, exc)
    traced = f"{exc}\n{getattr(exc, 'partial_fx_graph', '')}"  # export attaches the graph traced so far
    ops = re.findall(r"torch\.ops\.([A-Za-z_]\w*\.[\w.]+?)(?:\(|\s|$)", traced)
    op = ops[-1] if ops else (where or "unknown op")
    first_line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return CaptureError(
        f"cannot capture {model_name}: torch.export failed in module {module!r} at op {op}"
        f"{f' ({where})' if where and where != op else ''}: {type(exc).__name__}: {first_line[:300]}. "
        f"Next step: {_hint(exc)}"
    )


_HINTS = (
    ("which is not a known type", "return a tuple, a dict or a dataclass of tensors (a dataclass is registered as "
                                  "a pytree node for you), or register the output class as one "
                                  "(torch.utils._pytree.register_pytree_node)"),
    ("object is not callable", "a field of the output class hides a method its pytree flattening calls (a "
                               "ModelOutput field named 'values', 'keys' or 'items'): rename the field"),
    ("data-dependent", "replace Python branching on tensor values (.item(), `if tensor:`) with torch.where "
                       "or torch.cond; capture supports control flow that depends only on shapes"),
    ("fake", "give the custom op a fake kernel (torch.library.register_fake) so export can trace it"),
    ("device", "create tensors on the input's device (device=tokens.device), never on a fixed one"),
)


def _hint(exc: BaseException) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    for key, hint in _HINTS:
        if key in text:
            return hint
    return "reproduce with torch.export.export(model, example_inputs, strict=False) and fix the op it names"


def _failing_frame(model: nn.Module, exc: BaseException) -> tuple[str, str | None]:
    names = {id(m): (n or "<root>") for n, m in model.named_modules()}
    best: tuple[str, str | None] | None = None
    best_user: tuple[str, str | None] | None = None
    tb = exc.__traceback__
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        first = code.co_varnames[0] if code.co_argcount else None
        candidate = frame.f_locals.get(first) if first else None
        if candidate is not None and id(candidate) in names:
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            here = (names[id(candidate)], f"{os.path.basename(code.co_filename)}:{tb.tb_lineno}: {line}")
            best = here
            if not code.co_filename.startswith(_TORCH_DIR):
                best_user = here
        tb = tb.tb_next
    return best_user or best or ("<unknown>", None)
