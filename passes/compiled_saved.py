"""What a compiled training step saves for backward, for any model, on the meta device.

The runtime compiles the per-rank graph on CUDA (``BuildOptions.compile`` auto) and AOT
autograd then splits the joint graph with the min-cut partitioner, which recomputes cheap
elementwise chains (fp32 norms, RoPE, activations) in backward instead of saving them. Capture
measures saved activations as eager autograd keeps them (``passes/_capture_saved.py``), so a
compiled plan's block activations are smaller than capture's by a factor that depends on the
model's code, not on the machine.

``compiled_saved_scale(model, graph, seq_len, micro_batch)`` traces one training step of ``model``
(its parameters on meta; dropout and SDPA routed to the GPU kernels by ``GpuKernelProfile``) with
AOT autograd once and inductor's decompositions (``select_decomp_table``: a LayerNorm becomes
reductions and elementwise ops min-cut may recompute; kept whole, it is not on the recompute list
and its output is saved, 25% more than inductor saves on GPT-2), partitions the joint graph with
both partitioners (``default_partition``,
which saves what eager autograd saves, and ``min_cut_rematerialization_partition``, inductor's),
and attributes every saved tensor to the module that produced it (``nn_module_stack``). The scale
is Σ min-cut / Σ default over the saved bytes of the graph's block layers (``LayerInfo.block`` set:
attention, MLP, MoE, norms inside blocks), at most 1. What the two partitioners save at a block's
boundary is produced outside its layers, so it counts with the blocks too: a tensor made by a
block's own module (the residual adds of ``blocks.3``) or by the embedding (block 0's input, which
eager autograd saves inside block 0's first norm and min-cut saves as the embedding's output). The cost model multiplies
block activations by it when the runtime compiles the plan (``search/cost_model.compiled_activation_scale``).

The step's loss is the mean of every floating output (cast to fp32): it gives every output a
gradient; what it saves itself belongs to no block and is not counted. Views share their base's
storage and are counted once; placeholders (parameters, inputs) are not activations.

Cost: one AOT trace of the whole model on meta tensors (about 10 s for a 1.3B, 24-block model on a
2-core CPU), so callers run it only for plans a GPU compiles, and a process runs it once per model
structure, input shapes and block layers: later calls read the scale measured first (keyed by
``_graph_utils.structure_key``, as the export cache is; ``AUTOSHARD_EXPORT_CACHE=0`` turns both off).
A failed trace is not remembered.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
from torch import nn

from autoshard.errors import CaptureError
from autoshard.graph import ModelGraph
from autoshard.passes._capture_saved import GpuKernelProfile
from autoshard.passes._graph_utils import meta_twin, structure_key

_SCALES: dict[str, float] = {}  # structure key → scale (module docstring, "Cost")
_VIEW_OPS = ("view", "_unsafe_view", "t", "transpose", "detach", "permute", "reshape", "expand", "alias")


def _module_path(node: torch.fx.Node) -> str:
    """The dotted module path of ``node``'s innermost ``nn_module_stack`` entry ("" when none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)  # the traced function's local/global holding the model
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage a chain of views reads."""
    while node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEW_OPS:
        node = node.args[0]
    return node


def saved_by_layer(forward: torch.fx.GraphModule, layer_of: Callable[[str], str | None]) -> dict[str | None, int]:
    """Bytes of the tensors ``forward`` saves for backward, per layer (``layer_of(module path)``)."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    out: dict[str | None, int] = {}
    seen = set()
    for node in output.args[0]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        root = _base(node)
        if root.op == "placeholder" or root in seen:
            continue
        seen.add(root)
        layer = layer_of(_module_path(root))
        out[layer] = out.get(layer, 0) + value.numel() * value.element_size()
    return out


def compiled_saved_scale(model: nn.Module, graph: ModelGraph, seq_len: int, micro_batch: int = 1,
                         example_inputs: tuple | None = None, decompositions: dict | None = None) -> float:
    """Min-cut over default saved bytes of ``graph``'s block layers in one step of ``model`` (module docstring).

    ``model`` on any device: a model holding data is traced through its meta twin (nothing runs
    and nothing is allocated); ``example_inputs`` (shapes only) default: zero tokens
    ``[micro_batch, seq_len]``. Raises ``CaptureError`` when
    the trace fails or no block layer saves anything."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    blocks = [l.name for l in graph.layers if l.block is not None]
    embeddings = [l.name for l in graph.layers if l.kind == "embedding"]

    def layer_of(path: str) -> str | None:
        """The block bucket's key for ``path`` (module docstring), else None."""
        if not path:
            return None
        for name in blocks:
            if path == name or path.startswith(name + ".") or name.startswith(path + "."):
                return name
        for name in embeddings:
            if path == name or path.startswith(name + "."):
                return name
        return None

    totals: dict[str, dict[str | None, int]] = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        for label, fn in (("default", default_partition), ("min_cut", min_cut_rematerialization_partition)):
            forward, _ = fn(joint, joint_inputs, **kwargs)
            for layer, nbytes in saved_by_layer(forward, layer_of).items():  # summed over graph-break pieces
                totals.setdefault(label, {})[layer] = totals.get(label, {}).get(layer, 0) + nbytes
        return default_partition(joint, joint_inputs, **kwargs)

    from torch._inductor.decomposition import select_decomp_table

    what_if = decompositions is not None
    backend = aot_autograd(fw_compiler=lambda gm, _inputs: gm.forward, bw_compiler=lambda gm, _inputs: gm.forward,
                           partition_fn=partition,
                           decompositions=decompositions if what_if else select_decomp_table())
    if any(not p.is_meta for p in model.parameters()):
        model = meta_twin(model)
    inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in example_inputs) if example_inputs \
        else (torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"),)
    key = None if what_if else structure_key(model, inputs, blocks, embeddings)
    if key in _SCALES:
        return _SCALES[key]

    def step(*args: Any) -> torch.Tensor:
        outputs = model(*args)
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        losses = [o.float().mean() for o in flat if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return torch.stack(losses).sum()

    torch._dynamo.reset()
    try:
        with GpuKernelProfile():
            torch.compile(step, backend=backend, fullgraph=False)(*inputs)
    except Exception as exc:  # noqa: BLE001 - any trace failure means "no scale", said in one line
        raise CaptureError(f"{graph.model_name}: tracing one compiled step on meta failed "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    finally:
        torch._dynamo.reset()
    default = sum(v for k, v in totals.get("default", {}).items() if k is not None)
    min_cut = sum(v for k, v in totals.get("min_cut", {}).items() if k is not None)
    if default <= 0:
        raise CaptureError(f"{graph.model_name}: no block layer saved activations in the traced step "
                           "(module paths did not match the captured layers)")
    scale = min(min_cut / default, 1.0)
    if key is not None:
        _SCALES[key] = scale
    return scale


def with_compiled_saved_scale(graph: ModelGraph, model: nn.Module, seq_len: int, micro_batch: int = 1) -> ModelGraph:
    """``graph`` with ``compiled_saved_scale`` measured on ``model`` (``compiled_saved_scale``)."""
    return dataclasses.replace(graph, compiled_saved_scale=compiled_saved_scale(model, graph, seq_len, micro_batch))


__all__ = ["compiled_saved_scale", "saved_by_layer", "with_compiled_saved_scale"]
