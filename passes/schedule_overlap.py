"""Pass ``schedule_overlap``: ZeRO-3 forward all-gathers split into start + wait, started ahead (prefetch).

Pre-conditions: ``insert_collectives`` and ``recompute`` ran (``Zero3Gather``
call nodes exist for ZeRO-3 layers; a ``Regather`` may be installed);
``quantize_comm`` and ``split_pipeline`` have not. Post-conditions, with
``p = plan.schedule.prefetch > 0``:

* each top-level ``Zero3Gather`` call of a layer whose communication is not
  quantized becomes two call nodes: ``GatherStart`` (copy-in + async
  ``autoshard::all_gather_start``, ``kernels/async_collectives.py``) and
  ``GatherWait`` (``autoshard::all_gather_wait`` + copy-out, at the old node's
  place: the first use). The parameters' ``getitem`` nodes read the wait;
* the start of the k-th such gather of a pipeline stage (graph order) is placed
  right after the wait of the j-th, j the largest index such that layers
  j … k−1 hold at least p *heavy* gathers (``prefetch_anchors``), so layer k's
  gather is in flight while p heavy layers (and the light ones between)
  compute; starts without such a j go right before the stage's first wait. With
  only heavy layers, j = k − p. At most ``p + 1`` heavy layers' gathered buffers
  (plus the light ones between) are alive;
* every start has exactly one wait, after it (``check_waits``); both nodes record
  why in ``node.meta["autoshard"]`` (``pass``, ``why``, ``layer``, and for the
  start ``issued_after``: the node it follows).

``prefetch = 0`` returns the graph unchanged (blocking gathers at first use):
the A/B switch of ``benchmarks/overlap_bench.py``.

[Note: overlap order]
Heavy vs light: a layer's norm is its own "layer" with its own gather (GPT:
embed, pos_embed, then per block attn_norm, attn, mlp_norm, mlp). Counting
every gather, p = 1 put the attention block's gather behind the attn_norm
compute only (one norm kernel) and the MLP's behind mlp_norm's: the big
gathers had nothing to hide behind. A gather smaller than ``LIGHT_FRACTION``
of the stage's largest is light and does not count towards p.

Why start k right after wait k−p (FSDP2's forward prefetch order), and not
earlier: the process group runs collectives in issue order on one stream
(NCCL) or queue (gloo), so issuing start k before wait k−p cannot make k−p
arrive sooner, and it would keep one more buffer alive. On NCCL the compute
stream only waits at ``GatherWait``; the host runs ahead, so the gather of
layer k+1 runs during layer k's kernels (p = 1).

Decisions and limits (partial, stated):

* Backward (pp = 1): the ``Regather`` re-gathers are prefetched one layer ahead
  (``Regather.prefetch``; ``passes/recompute.py`` note "backward prefetch"), and
  the unquantized gathers' reduce-scatters leave the compute stream
  (``Zero3Gather.grad_sink``; ``passes/_zero3.py`` note "async reduce-scatter in
  backward"; eager execution only, a traced graph keeps the blocking op).
* Layers with ``weight_comm``/``grad_comm`` other than ``bf16`` keep their
  blocking ``Zero3Gather`` at first use: ``quantize_comm`` (a later pass)
  rewrites those modules, and the quantized gather has no async form yet.
* Gathers inside an activation-checkpoint region (``recompute="full"``) are in
  the region's body, not the top-level graph, and stay blocking there.
* No bucketing: one all-gather per layer already (the ZeRO-3 copy-in flattens a
  layer's parameters into one buffer); gradient bucketing
  (``schedule.bucket_bytes``) belongs to the optimizer (``runtime/_buckets.py``), which
  reduces DDP/ZeRO-1/2 gradients one bucket at a time: after backward by default, or under the last
  micro-batch's backward with ``BuildOptions(overlap_grad_sync=True)`` (``runtime/optimizer.py``,
  "Overlapped gradient sync"); a compiled one-step program reduces them as graph nodes inductor overlaps.
* The copy-in/copy-out layout is that of ``[Note: ZeRO-3 gather layout]``
  (``passes/_zero3.py``), restated in ``GatherStart``/``GatherWait`` (the
  numerics test compares the two paths bit for bit).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from autoshard.passes._graph_utils import META_KEY, copy_module, tag
from autoshard.passes._zero3 import Zero3Gather
from autoshard.passes.context import RankContext, pass_state
from autoshard.plan import Plan

NAME = "schedule_overlap"


class GatherStart(nn.Module):
    """Graph module: local shards of one layer → copy-in (L,) → async all-gather; returns the (n·L,) buffer."""

    def __init__(self, gather: Zero3Gather) -> None:
        super().__init__()
        self.gather = gather  # holds the GatherSpec; the Regather re-gathers through it in backward

    def forward(self, *shards: torch.Tensor) -> torch.Tensor:
        return self.gather.start(shards)  # (n·L,), in flight


class GatherWait(nn.Module):
    """Graph module: wait for a ``GatherStart`` buffer → full parameters (as ``Zero3Gather.forward`` returns)."""

    def __init__(self, gather: Zero3Gather) -> None:
        super().__init__()
        self.gather = gather

    def forward(self, pending: torch.Tensor, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.gather.spec
        roots = self.gather.finish(pending)
        if self.gather.on_gather is not None:  # Regather: backward re-gathers through the blocking module
            self.gather.on_gather(self.gather, shards, roots)
        # no narrow without padding: its backward (slice_backward) would allocate and copy a zero-padded grad
        return tuple(root if root.shape[0] == d else root.narrow(0, 0, d) for root, d in zip(roots, spec.global_dim0))


# [Note: compiled programs]
# A program run through ``torch.compile`` (``ctx.compiled``) keeps its gathers blocking at first use
# in the FX graph: the compiled gather is the functional all-gather of
# ``kernels/traced_collectives.py``, whose start inductor issues asynchronously and whose wait it
# places itself. Moving it here would be undone by AOT autograd's re-tracing. Instead this pass
# records, in ``PassState.compile_options``, the inductor passes that overlap them,
# chosen from the plan (``compile_options``); ``Program`` compiles with them. Modes:
#   "scheduler": inductor's overlap scheduler (``aten_distributed_optimizations``): it estimates
#       each collective's and each kernel's time, moves gathers (forward and the backward
#       re-gathers) and reduce-scatters to hide under compute within a memory bound, and buckets
#       collectives that stay exposed;
#   "reorder": the scheduler-IR passes (``reorder_for_compute_comm_overlap``: raise
#       communication, sink waits, preserving peak memory);
#   "none": inductor's default order (a gather's wait still waits only where it is used).
# ``prefetch = 0`` selects "none" (the A/B switch, as for eager programs), as does a CPU device. Options a torch
# version does not know are dropped (``Program``); the GPU comparison that picked the default
# is linked from docs/runtime.md.
COMPILE_OVERLAP = ("scheduler", "reorder", "none")
DEFAULT_COMPILE_OVERLAP = "scheduler"
_OVERLAP_OPTIONS = {
    "scheduler": {"aten_distributed_optimizations.enable_overlap_scheduling": True,
                  "aten_distributed_optimizations.collective_bucketing": True},
    "reorder": {"reorder_for_compute_comm_overlap": True,
                "reorder_for_compute_comm_overlap_passes": [
                    "reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                    "reorder_communication_preserving_peak_memory"]},
    "none": {},
}


def compile_options(plan: Plan, device: str, mode: str | None = None) -> dict:
    """Inductor options for a compiled program of ``plan`` on ``device`` (note "compiled programs")."""
    mode = mode or DEFAULT_COMPILE_OVERLAP
    if mode not in COMPILE_OVERLAP:
        raise ValueError(f"compile overlap mode {mode!r}: allowed {list(COMPILE_OVERLAP)}")
    if plan.schedule.prefetch <= 0 or torch.device(device).type != "cuda":
        mode = "none"  # on a CPU gloo runs each collective to completion: nothing to overlap
    return {"overlap": mode, "inductor": dict(_OVERLAP_OPTIONS[mode])}


def run(gm: fx.GraphModule, plan: Plan, ctx: RankContext) -> fx.GraphModule:
    """Split ZeRO-3 gathers into start + wait and start them ``plan.schedule.prefetch`` layers ahead.

    Compiled programs: record the inductor overlap options instead (note "compiled programs").
    """
    if ctx.compiled:
        out = copy_module(gm)
        pass_state(out).compile_options = compile_options(plan, ctx.device)
        return out
    prefetch = plan.schedule.prefetch
    if prefetch <= 0:
        return gm
    gathers = _async_gathers(gm, plan)
    if not gathers:
        return gm
    out = copy_module(gm)
    nodes = {n.name: n for n in out.graph.nodes}
    stage_of = {s.layer: s.stage for s in plan.layers}
    by_stage: dict[int, list[fx.Node]] = {}
    for name in gathers:
        node = nodes[name]
        by_stage.setdefault(stage_of[out.get_submodule(node.target).spec.layer], []).append(node)
    for stage_nodes in by_stage.values():
        _split_stage(out, stage_nodes, prefetch)
    regather = pass_state(out).regather
    if regather is not None and plan.mesh.pp == 1:
        regather_module = out.get_submodule(regather)
        regather_module.prefetch = True  # backward prefetch of re-gathers (passes/recompute.py note)
        for module in out.modules():  # backward reduce-scatters off the compute stream (passes/_zero3.py note)
            if isinstance(module, Zero3Gather) and not module.spec.quantized:
                module.grad_sink = regather_module.grad_sink
    out.graph.eliminate_dead_code()
    out.graph.lint()
    check_waits(out.graph, out)
    out.recompile()
    return out


def _async_gathers(gm: fx.GraphModule, plan: Plan) -> list[str]:
    """Names of the top-level ``Zero3Gather`` call nodes to make asynchronous (unquantized layers only)."""
    strategies = {s.layer: s for s in plan.layers}
    names = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, Zero3Gather) and not module.spec.quantized:
            s = strategies[module.spec.layer]
            if s.weight_comm == "bf16" and s.grad_comm == "bf16":
                names.append(node.name)
    return names


LIGHT_FRACTION = 1 / 16  # a gather under this fraction of the stage's largest is "light" (note "overlap order")


def prefetch_anchors(sizes: list[int], prefetch: int) -> list[int | None]:
    """For gather k of a stage (flat sizes in graph order): the index j whose wait its start follows, or None.

    j is the largest index with at least ``prefetch`` heavy gathers among j … k−1
    (their layers compute while gather k is in flight); None: no such j, the
    start goes before the stage's first wait. Non-decreasing in k.
    """
    largest = max(sizes, default=0)
    heavy = [size >= LIGHT_FRACTION * largest for size in sizes]
    anchors: list[int | None] = []
    for k in range(len(sizes)):
        j, count = k, 0
        while j > 0 and count < prefetch:
            j -= 1
            count += heavy[j]
        anchors.append(j if count >= prefetch else None)
    return anchors


def _split_stage(gm: fx.GraphModule, gathers: list[fx.Node], prefetch: int) -> None:
    """Replace each gather of one stage by start + wait (module docstring placement rule), in place."""
    waits = [_replace_with_wait(gm, g) for g in gathers]
    sizes = [sum(gm.get_submodule(w.target).gather.spec.flat_sizes()) for w in waits]
    anchors = prefetch_anchors(sizes, prefetch)
    prev_start = None
    for k, (wait, j) in enumerate(zip(waits, anchors)):
        anchor = waits[j] if j is not None else None
        # starts sharing an anchor keep graph order: NCCL runs them in issue order
        after = prev_start if j is not None and k > 0 and anchors[k - 1] == j else anchor
        start = _insert_start(gm, wait, after, waits[0])
        layer = gm.get_submodule(wait.target).gather.spec.layer
        if j is not None:
            why = (f"prefetch: layer {layer}'s all-gather issued after layer {_layer(gm, anchor)}'s wait, in flight "
                   f"during the compute of {k - j} layer(s), {prefetch} of them heavy")
        else:
            why = f"prefetch: fewer than {prefetch} heavy layer(s) before it in the stage, issued before the stage's first wait"
        tag(start, NAME, why, layer=layer, issued_after=anchor.name if anchor is not None else None, prefetch=prefetch)
        prev_start = start


def _layer(gm: fx.GraphModule, wait: fx.Node) -> str:
    return gm.get_submodule(wait.target).gather.spec.layer


def _replace_with_wait(gm: fx.GraphModule, gather: fx.Node) -> fx.Node:
    """A ``GatherWait`` call at ``gather``'s place (its first use) taking over its users; ``gather`` erased."""
    module = gm.get_submodule(gather.target)
    target = gather.target + "_wait"
    gm.add_submodule(target, GatherWait(module))
    with gm.graph.inserting_before(gather):
        # args[0] (the pending buffer) is set once the start node exists
        wait = gm.graph.call_module(target, (None, *gather.args))
    gather.replace_all_uses_with(wait)
    tag(wait, NAME, "wait for the layer's prefetched all-gather at its first use, then copy-out",
        layer=module.spec.layer, earlier=gather.meta.get(META_KEY))
    wait.meta["nn_module_stack"] = gather.meta.get("nn_module_stack", {})
    gm.graph.erase_node(gather)
    gm.delete_submodule(gather.target)  # now reached only through the start/wait modules
    return wait


def _insert_start(gm: fx.GraphModule, wait: fx.Node, anchor: fx.Node | None, first_wait: fx.Node) -> fx.Node:
    """A ``GatherStart`` call after ``anchor`` (or before ``first_wait``); wires it into ``wait``."""
    target = wait.target.removesuffix("_wait") + "_start"
    gm.add_submodule(target, GatherStart(gm.get_submodule(wait.target).gather))
    shards = wait.args[1:]
    where = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(first_wait)
    with where:
        start = gm.graph.call_module(target, shards)
    _hoist_inputs(gm.graph, start)
    wait.update_arg(0, start)
    start.meta["nn_module_stack"] = wait.meta.get("nn_module_stack", {})
    return start


def _hoist_inputs(graph: fx.Graph, node: fx.Node) -> None:
    """Move ``get_attr`` inputs defined after ``node`` to just before it (they have no inputs themselves)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    for arg in node.all_input_nodes:
        if index[arg] > index[node]:
            assert arg.op == "get_attr", f"start input {arg.name} ({arg.op}) is defined after the start"
            node.prepend(arg)


def check_waits(graph: fx.Graph, gm: fx.GraphModule) -> None:
    """Every ``GatherStart`` node has exactly one user, a ``GatherWait`` after it (internal invariant)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), GatherStart):
            users = list(node.users)
            assert len(users) == 1 and isinstance(gm.get_submodule(users[0].target), GatherWait), \
                f"{node.name}: a started all-gather must be waited exactly once, users={users}"
            assert index[users[0]] > index[node], f"{node.name}: its wait comes before it"


__all__ = ["LIGHT_FRACTION", "GatherStart", "GatherWait", "NAME", "check_waits", "prefetch_anchors", "run"]
