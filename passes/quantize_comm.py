"""Pass ``quantize_comm``: move each layer's parameter gathers and gradient reductions in its chosen dtype.

Pre-conditions: ``insert_collectives``, ``recompute`` and ``schedule_overlap``
ran (``Zero3Gather`` call nodes exist for ZeRO-3 layers, at top level or
inside ``CheckpointRegion`` bodies; a ``Regather`` may be installed;
``schedule_overlap`` left quantized layers' gathers blocking). Post-conditions:

* every ``Zero3Gather`` of a layer whose ``weight_comm`` or ``grad_comm`` is not
  the default, including those inside checkpoint regions, is replaced by one
  whose ``GatherSpec`` carries the wire dtypes (``passes/_zero3.py``); its call
  node records why in ``node.meta["autoshard"]`` (the earlier record is kept
  under ``"earlier"``);
* ``PassState.grad_comm`` maps each parameter whose layer
  reduces gradients in a non-default dtype to that dtype; the runtime hands it
  to the ``ShardedOptimizer`` (the DDP / ZeRO-1/2 / offload / HSDP-replicate
  reductions act on ``.grad`` after backward, not on graph nodes).

Mapping from the plan (DESIGN.md strategy space; ZeRO++ qwZ / qgZ):

| plan field | value | rewrite |
| --- | --- | --- |
| ``weight_comm`` | ``bf16`` | nothing: the gather moves the compute dtype (fp32 in an fp32 run) |
| | ``int8`` / ``fp8`` | ZeRO-3 forward gather AND backward re-gather: quantize the local shard, one all-gather of payload+scales, dequantize fused with the cast to the compute dtype (qwZ) |
| ``grad_comm`` | ``bf16`` | nothing: reductions in the gradient's (compute) dtype |
| | ``fp32`` | upcast, reduce in fp32, round once (ZeRO-3 backward reduce-scatter and optimizer syncs) |
| | ``int8`` / ``int4`` | ZeRO-3 backward reduce-scatter and zero2/offload reduce-scatter by all-to-all of quantized rank rows with local dequantize-and-reduce in fp32 (qgZ); HSDP's replicate all-reduce = qgZ + quantized all-gather |

Decisions:

* ``weight_comm`` quantizes weights only: the backward of a quantized gather is
  the full-precision reduce-scatter unless ``grad_comm`` says otherwise.
* The fp32 masters and the local compute shards are never written from
  dequantized values; quantization only changes what the gathered copy holds
  for compute (the update applies gradients taken at the quantized weights to
  the exact masters, as ZeRO++ does).
* Allowed combinations mirror the search space (``search/space.py``):
  ``weight_comm != "bf16"`` needs ``state="zero3"`` (only ZeRO-3 gathers
  weights); ``grad_comm`` ``int8``/``int4`` needs ``zero2``, ``zero3`` or
  ``offload`` (a reduce-scatter). Anything else is a ``PlanError``, raised
  before any collective.
* Block size: ``quantized_collectives.block_for`` (one fp32 scale per up to 512
  elements, smaller for small shards).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from autoshard.errors import PlanError
from autoshard.passes._graph_utils import META_KEY, copy_module
from autoshard.passes._zero3 import Zero3Gather
from autoshard.passes.context import RankContext, pass_state
from autoshard.passes.recompute import CheckpointRegion
from autoshard.plan import LayerStrategy, Plan

NAME = "quantize_comm"

# plan vocabulary → op vocabulary of kernels/quantized_collectives.py ("none" = unquantized, own dtype)
WEIGHT_QDTYPE = {"bf16": "none", "int8": "int8", "fp8": "fp8"}
GRAD_WIRE = {"bf16": "none", "fp32": "fp32", "int8": "int8", "int4": "int4"}
QUANTIZED_GRAD_STATES = ("zero2", "zero3", "offload")


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Rewrite ZeRO-3 gathers and record gradient wire dtypes per the plan (module docstring)."""
    strategies = {s.layer: s for s in plan.layers}
    for s in plan.layers:
        check_strategy(s)
    if all(s.weight_comm == "bf16" and s.grad_comm == "bf16" for s in plan.layers):
        return gm
    out = _rewrite(gm, strategies)
    if out is gm:
        out = copy_module(gm)  # the meta below is this pass's output, not gm's
    state = pass_state(out)
    state.grad_comm = {
        fqn: GRAD_WIRE[strategies[p.layer].grad_comm]
        for fqn, p in state.placements.items()
        if strategies[p.layer].grad_comm != "bf16"
    }
    return out


def check_strategy(s: LayerStrategy) -> None:
    """``PlanError`` unless the layer's ``weight_comm`` / ``grad_comm`` fit its state (module docstring)."""
    if s.weight_comm != "bf16" and s.state != "zero3":
        raise PlanError(
            f"layer {s.layer!r}: weight_comm={s.weight_comm!r} needs state='zero3' (only ZeRO-3 all-gathers "
            f"weights), got state={s.state!r}; set weight_comm='bf16' or state='zero3'"
        )
    if s.grad_comm in ("int8", "int4") and s.state not in QUANTIZED_GRAD_STATES:
        raise PlanError(
            f"layer {s.layer!r}: grad_comm={s.grad_comm!r} needs a reduce-scatter, i.e. state in "
            f"{QUANTIZED_GRAD_STATES}, got state={s.state!r}; set grad_comm to 'bf16' or 'fp32', or change the state"
        )


def _rewrite(gm: fx.GraphModule, strategies: dict[str, LayerStrategy]) -> fx.GraphModule:
    """``gm`` with each quantized layer's ``Zero3Gather`` replaced, recursing into checkpoint regions.

    A ``recompute="full"`` region (``passes/recompute.py``) holds its layers'
    gathers in its own body graph, so the recompute in backward gathers through
    the same (quantized) module. Returns ``gm`` itself when nothing changes.
    """
    replace, records = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, Zero3Gather):
            new = _quantized_gather(module, strategies[module.spec.layer])
            if new is not None:
                replace[node.target], records[node.target] = new, _record(strategies[module.spec.layer])
        elif isinstance(module, CheckpointRegion):
            body = _rewrite(module.body, strategies)
            if body is not module.body:
                replace[node.target] = CheckpointRegion(body, module.kind, module.layers)
    if not replace:
        return gm
    out = copy_module(gm, replace)
    for node in out.graph.nodes:
        if node.op == "call_module" and node.target in records:
            node.meta[META_KEY] = {**records[node.target], "earlier": node.meta.get(META_KEY)}
    return out


def _quantized_gather(module: Zero3Gather, s: LayerStrategy) -> Zero3Gather | None:
    """A copy of ``module`` whose spec carries the layer's wire dtypes, or ``None`` if they are the defaults."""
    spec = dataclasses.replace(module.spec, qdtype=WEIGHT_QDTYPE[s.weight_comm], grad_comm=GRAD_WIRE[s.grad_comm])
    return Zero3Gather(spec, on_gather=module.on_gather) if spec.quantized else None


def _record(s: LayerStrategy) -> dict:
    return {"pass": NAME, "why": _why(s), "layer": s.layer, "weight_comm": s.weight_comm, "grad_comm": s.grad_comm}


def _why(s: LayerStrategy) -> str:
    parts = []
    if s.weight_comm != "bf16":
        parts.append(f"weight_comm={s.weight_comm}: qwZ all-gather (forward and backward re-gather) of "
                     f"{s.weight_comm} payload + fp32 block scales, dequantized into the compute dtype")
    if s.grad_comm != "bf16":
        how = "reduce-scatter in fp32" if s.grad_comm == "fp32" else f"qgZ all-to-all of {s.grad_comm} chunks, local dequantize-and-reduce"
        parts.append(f"grad_comm={s.grad_comm}: backward {how}")
    else:
        parts.append("gradients reduce-scattered in full precision (qwZ quantizes weights only)")
    return "; ".join(parts)
