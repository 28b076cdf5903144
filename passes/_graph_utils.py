"""Small FX helpers shared by the passes: layer lookup, rebuilding a module purely, tagging nodes."""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
from typing import Any

import torch
from torch import fx, nn

from autoshard.passes.context import pass_state
from autoshard.plan import Plan

META_KEY = "autoshard"  # the one node.meta / gm.meta key the passes write (STYLE.md)
# "0" turns off every per-process cache keyed by ``structure_key`` (the export cache, compiled-activation scales)
STRUCTURE_CACHE_ENV = "AUTOSHARD_EXPORT_CACHE"


def layer_of_path(path: str, layer_names: list[str]) -> str | None:
    """The longest plan layer name equal to ``path`` or a dotted prefix of it."""
    best = None
    for name in layer_names:
        if (path == name or path.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def node_layer(node: fx.Node, plan: Plan) -> str | None:
    """The plan layer a call node belongs to, from its innermost ``nn_module_stack`` entry."""
    stack = node.meta.get("nn_module_stack") or {}
    names = [s.layer for s in plan.layers]
    for path, _type in reversed(list(stack.values())):
        found = layer_of_path(path, names)
        if found:
            return found
    return None


def copy_module(gm: fx.GraphModule, replace: dict[str, torch.nn.Module | torch.Tensor] | None = None) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm.graph``; attributes in ``replace`` (by target) are swapped.

    Modules and parameters not replaced are shared with ``gm`` (a pass that
    changes one passes a replacement); ``gm`` itself is left unchanged.
    """
    graph = copy.deepcopy(gm.graph)
    return rebuild(gm, graph, replace)


def rebuild(gm: fx.GraphModule, graph: fx.Graph, replace: dict | None = None) -> fx.GraphModule:
    """GraphModule of ``graph`` whose attribute targets come from ``replace`` or else ``gm``."""
    replace = dict(replace or {})
    root: dict = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target not in root:
            root[node.target] = replace[node.target] if node.target in replace else _fetch(gm, node.target)
    out = fx.GraphModule(root, graph, class_name=type(gm).__name__)
    out.meta = copy.copy(getattr(gm, "meta", {}))
    state = pass_state(gm).copy()
    out.meta[META_KEY] = state
    extra = state.regather  # referenced by the runtime, not by a node
    if extra and extra not in root:
        out.add_submodule(extra, replace.get(extra, gm.get_submodule(extra)))
    return out


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def tag(node: fx.Node, pass_name: str, why: str, **extra) -> fx.Node:
    """Record in ``node.meta["autoshard"]`` which pass inserted/moved ``node`` and why."""
    node.meta[META_KEY] = {"pass": pass_name, "why": why, **extra}
    return node


def retarget_device(gm: fx.GraphModule, traced: torch.device, target: torch.device) -> int:
    """Point every ``device=`` argument equal to ``traced`` at ``target``; returns how many were changed.

    ``torch.export`` bakes the device it traced on into factory calls (``arange``), casts and
    ``_assert_tensor_metadata`` checks. The runtime exports on the meta device (no weights are
    read) and runs on ``ctx.device``, so those constants must follow.
    """
    changed = 0

    def swap(value):
        nonlocal changed
        if isinstance(value, torch.device) and value == traced:
            changed += 1
            return target
        return value

    for module in gm.modules():  # higher-order ops (autocast, no_grad regions) keep subgraphs as submodules
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function":
                node.args = tuple(swap(a) for a in node.args)
                node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
        module.recompile()
    return changed


def structure_key(twin: nn.Module, *extra: Any) -> str | None:
    """SHA-256 of what a trace of the meta twin ``twin`` depends on besides process-global state: every
    module's class by name and identity and its ``__dict__`` (sizes, flags, meta parameters and buffers),
    and ``extra`` (example inputs as meta tensors, shape specs, options), pickled: the key of the per-process
    caches of traces (``runtime/export_cache.py``, whose note "the key" says what it cannot see). None, so no
    caching, when that does not pickle (a lambda or a hook on a module) or ``STRUCTURE_CACHE_ENV`` is "0"."""
    if os.environ.get(STRUCTURE_CACHE_ENV, "1") == "0":
        return None
    classes = sorted({(type(m).__module__, type(m).__qualname__, id(type(m))) for m in twin.modules()})
    try:
        blob = pickle.dumps((twin, *extra, classes), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything unpicklable: no key, so no cache
        return None
    return hashlib.sha256(blob).hexdigest()


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes (ties kept).

    No data is copied: ``deepcopy`` is given a memo mapping each tensor to its meta stand-in.
    """
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)
