"""The predicted step of a plan, laid out in time: per-rank spans and memory samples for ``autoshard report``.

``lay_out_step(graph, plan, cluster, train)`` prices every layer as ``cost_model.predict`` does
(``cost_model.plan_layer_costs``) and places the terms on one step of each pipeline rank. A pipeline rank
stands for every rank of its stage: their dp and tp peers run the same timeline (``Predictions`` is per
pipeline rank too). Units: seconds and bytes.

Streams (the ``tid`` of the Chrome trace)::

    compute         each layer's forward / backward (+ recompute) kernels; the optimizer step; bubbles
    tp/sp/ep comm   the layer's critical-path collectives (TP/SP all-reduce, gather, scatter; EP all-to-all;
                    CP), after the layer's kernels: nothing overlaps them (``LayerCost.critical_comm_s``)
    dp comm         data-parallel gathers and gradient reductions (``dp_*`` terms of ``LayerCost.detail``)
    pp send/recv    the send of a stage's output across a boundary (``cost_model.boundary_send_s``)

Order. The forwards and backwards of whole micro-batches follow the plan's schedule (``search/pipeline.py``):
GPipe runs every forward, then every backward; 1F1B runs ``min(p − k − 1, m)`` warm-up forwards on pipeline
rank ``k``, then alternates one forward and one backward, then the remaining backwards; interleaved 1F1B
does the same over model chunks in Megatron-Core's order (groups of ``p`` micro-batches per chunk, the
warm-up ``2·(p − k − 1) + (v − 1)·p``). A forward of stage ``s`` waits for that micro-batch's forward on
stage ``s − 1`` (its send included), a backward for its own forward and the backward of stage ``s + 1``.
Idle time between a rank's first op and its last is a bubble.

Where the cost model has only per-step totals, they are laid out as the runtime orders them, with
durations that sum to the cost model's terms:

* data-parallel comm: per layer, the hidden part (``comm_total_s − comm_exposed_s``) runs on the dp stream
  beside the compute that hides it: the forward-gather share (``dp_gather_fwd_s``) in each micro-batch's
  forward of the layer, the per-micro-batch backward share (``dp_gather_bwd_s + dp_grad_per_mb_s``) in each
  backward, the rest (``dp_grad_once_s``, ``dp_post_step_s``…) in the layer's last backward. The exposed
  part (``comm_exposed_s``, quantization and copy kernels included) follows the rank's last backward, layer
  by layer in backward order, and the optimizer step (``Σ optimizer_s``) starts ``Σ comm_exposed_s`` after
  that backward. Hidden comm that overran its window is drawn where it queued (the cost model counts the
  overrun in the exposed part, so it may overlap the optimizer step in the picture).
* the rank ends at ``pipelined part + Σ exposed + Σ optimizer``. ``predict`` prices the pipelined part as
  ``(m + (p − 1)/v) · max_k T_k``; this layout runs each rank at its own ``T_k``, so with unbalanced stages
  the laid-out step ends at or before the prediction (equal for balanced stages or one stage).

Memory over the step (``MemorySample``: what the rank holds from that instant on), by kind: parameters,
gradients (the fp32 step gradients in the optimizer step included), optimizer states, activations, buffers
(gathers, backward buffers, pipeline receive buffers, the optimizer step's bucket copies). It follows
``memory.step_peak_bytes``' timeline: a forward reaching layer ``i`` holds the activations of its layers
``≤ i`` for every micro-batch in flight and ``(2 + prefetch)·H_i``; a backward reaching ``i`` frees layer
``i``'s activations after it, holds ``G_i`` (or its own new gradient when larger, in the first backward),
and gradients exist from a layer's first backward to the optimizer step's end. On one stage its peak (with
the optimizer step's and the build's, ``build_bytes``) is ``Predictions.memory_by_stage``; with pipelines
the prediction is the order-free bound, which this never exceeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

STREAMS = ("compute", "tp/sp/ep comm", "dp comm", "pp send/recv")
MEMORY_KINDS = ("parameters", "gradients", "optimizer states", "activations", "buffers")


@dataclass(frozen=True)
class Span:
    """One interval on one stream of one pipeline rank (seconds from the step's start)."""

    rank: int
    stream: str
    name: str
    category: str  # forward, backward, tp comm, dp comm, dp comm (exposed), pp send, optimizer, bubble
    start_s: float
    dur_s: float
    micro_batch: int | None = None
    layer: str | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclass(frozen=True)
class MemorySample:
    """Bytes one rank holds from ``t_s`` until the next sample, by ``MEMORY_KINDS``."""

    t_s: float
    phase: str
    bytes_by_kind: tuple[float, ...]

    @property
    def total(self) -> float:
        return sum(self.bytes_by_kind)


@dataclass(frozen=True)
class RankStep:
    """One pipeline rank's laid-out step."""

    rank: int
    stages: tuple[int, ...]
    spans: tuple[Span, ...]
    memory: tuple[MemorySample, ...]
    build_bytes: tuple[float, ...]  # by MEMORY_KINDS: the build (materialization) peak, before the step
    end_s: float

    @property
    def peak_bytes(self) -> float:
        return max([s.total for s in self.memory] + [sum(self.build_bytes)])


@dataclass(frozen=True)
class StepLayout:
    """Every pipeline rank's step; ``step_s`` is the last rank's end."""

    ranks: tuple[RankStep, ...]
    step_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)


# ------------------------------------------------------------------------------------------ schedule
def virtual_stage_count(plan: Any) -> int:
    """Stages of the schedule: ``pp · v``."""
    from autoshard.search.pipeline import virtual_stages

    return plan.mesh.pp * virtual_stages(plan.schedule)


def rank_op_order(schedule_name: str, pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The ops ``("F"|"B", stage, micro_batch)`` pipeline rank ``rank`` runs, in order (module docstring)."""
    chunks = [c * pp + rank for c in range(v)]  # virtual stages of this rank, Megatron-Core's layout
    forwards = [(chunks[c], j) for g in range(0, m, pp) for c in range(v) for j in range(g, min(g + pp, m))]
    backwards = [(chunks[v - 1 - c], j) for g in range(0, m, pp) for c in range(v)
                 for j in range(g, min(g + pp, m))]
    if schedule_name == "gpipe" or pp == 1:
        warmup = len(forwards) if schedule_name == "gpipe" else (1 if pp == 1 else 0)
    elif v == 1:
        warmup = min(pp - rank - 1, m)
    else:
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)
    if pp == 1 and schedule_name != "gpipe":  # one stage: forward then backward of each micro-batch
        return [op for (s, j) in forwards for op in (("F", s, j), ("B", s, j))]
    order = [("F", s, j) for s, j in forwards[:warmup]]
    rest_f, rest_b = forwards[warmup:], list(backwards)
    while rest_f:
        order.append(("F", *rest_f.pop(0)))
        order.append(("B", *rest_b.pop(0)))
    order += [("B", s, j) for s, j in rest_b]
    return order


def simulate(durations: dict[tuple[str, int], float], orders: Sequence[list[tuple[str, int, int]]],
             num_stages: int) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(start, end) of every op: each rank runs its ``orders`` in turn, each op after its dependencies
    (module docstring); ``durations[(kind, stage)]`` is one micro-batch's op on that stage."""
    done: dict[tuple[str, int, int], tuple[float, float]] = {}
    cursor, free = [0] * len(orders), [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while cursor[rank] < len(order):
                kind, stage, mb = order[cursor[rank]]
                deps = _dependencies(kind, stage, mb, num_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [done[d][1] for d in deps])
                end = start + durations[(kind, stage)]
                done[(kind, stage, mb)], free[rank] = (start, end), end
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, "pipeline schedule deadlocked: rank_op_order and _dependencies disagree"
    return done


def _dependencies(kind: str, stage: int, mb: int, num_stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    deps = [("F", stage, mb)]
    if stage + 1 < num_stages:
        deps.append(("B", stage + 1, mb))
    return deps


# -------------------------------------------------------------------------------------- per layer
@dataclass(frozen=True)
class _LayerTerms:
    """What one layer contributes to its rank's timeline and memory."""

    name: str
    stage: int
    fwd_compute: float
    fwd_comm: float
    bwd_compute: float
    bwd_comm: float
    dp_fwd_hidden: float  # per micro-batch
    dp_bwd_hidden: float  # per micro-batch
    dp_once_hidden: float  # in the last backward
    dp_exposed: float
    optimizer: float
    params: float
    grads: float
    optimizer_bytes: float
    activations: float
    buffers: float  # G
    gathered: float  # H
    step_grads: float
    step_transient: float
    build_transient: float


def _layer_terms(layer: Any, strategy: Any, cost: Any, m: int) -> _LayerTerms:
    d, mem = cost.detail, cost.memory
    fwd_compute = d.get("fwd_compute_s", cost.fwd_s)
    bwd_compute = d.get("bwd_compute_s", cost.bwd_s) + d.get("recompute_s", 0.0)
    hidden = max(cost.comm_total_s - cost.comm_exposed_s, 0.0)
    total = cost.comm_total_s
    share = (lambda *keys: hidden * sum(d.get(k, 0.0) for k in keys) / total) if total > 0 else (lambda *keys: 0.0)
    fwd_hidden, bwd_hidden = share("dp_gather_fwd_s"), share("dp_gather_bwd_s", "dp_grad_per_mb_s")
    return _LayerTerms(
        name=layer.name, stage=strategy.stage, fwd_compute=fwd_compute, fwd_comm=max(cost.fwd_s - fwd_compute, 0.0),
        bwd_compute=bwd_compute, bwd_comm=max(cost.bwd_s - bwd_compute, 0.0),
        dp_fwd_hidden=fwd_hidden / m, dp_bwd_hidden=bwd_hidden / m,
        dp_once_hidden=max(hidden - fwd_hidden - bwd_hidden, 0.0), dp_exposed=cost.comm_exposed_s,
        optimizer=cost.optimizer_s, params=mem.params, grads=mem.grads, optimizer_bytes=mem.optimizer,
        activations=mem.activations, buffers=mem.buffers, gathered=mem.gathered, step_grads=mem.step_grads,
        step_transient=mem.step_transient, build_transient=mem.build_transient,
    )


# ------------------------------------------------------------------------------------------ layout
def lay_out_step(graph: Any, plan: Any, cluster: Any, train: Any) -> StepLayout:
    """Every pipeline rank's predicted step (module docstring)."""
    from autoshard.search import cost_model
    from autoshard.search.pipeline import stage_rank, virtual_stages

    mesh, schedule = plan.mesh, plan.schedule
    m, pp, v = schedule.num_micro_batches, mesh.pp, virtual_stages(schedule)
    by_name = {s.layer: s for s in plan.layers}
    costs = cost_model.plan_layer_costs(graph, plan, cluster, train)
    _, receive = cost_model.boundary_terms(graph, plan, cluster, train)
    terms = [_layer_terms(layer, by_name[layer.name], cost, m) for layer, cost in zip(graph.layers, costs)]
    num_stages = max(virtual_stage_count(plan), max(t.stage for t in terms) + 1)
    sends = _stage_sends(graph, plan, cluster, train, num_stages)
    by_stage: list[list[_LayerTerms]] = [[] for _ in range(num_stages)]
    for t in terms:
        by_stage[t.stage].append(t)
    durations = {}
    for s, layers in enumerate(by_stage):
        durations[("F", s)] = sum(t.fwd_compute + t.fwd_comm for t in layers) + sends[s]
        durations[("B", s)] = sum(t.bwd_compute + t.bwd_comm for t in layers)
    orders = [rank_op_order(schedule.name, pp, v, m, k) for k in range(pp)]
    times = simulate(durations, orders, num_stages)
    ranks = []
    for k in range(pp):
        stages = tuple(s for s in range(num_stages) if stage_rank(s, pp, schedule) == k)
        ranks.append(_RankBuilder(k, stages, by_stage, sends, receive[k], schedule.prefetch).build(orders[k], times))
    notes = (
        "one pipeline rank stands for every dp/tp rank of its stage (they run the same step)",
        "data-parallel comm and the optimizer are per-step totals in the cost model: laid out as the runtime "
        "orders them (hidden comm beside the compute that hides it, the exposed rest after the last backward)",
    )
    return StepLayout(ranks=tuple(ranks), step_s=max(r.end_s for r in ranks), notes=notes)


def _stage_sends(graph: Any, plan: Any, cluster: Any, train: Any, num_stages: int) -> list[float]:
    """Per stage, the send/recv seconds per micro-batch of the boundary after it (0 for the last stage)."""
    from autoshard.search.cost_model import boundary_send_s

    by_name = {s.layer: s for s in plan.layers}
    out = [0.0] * num_stages
    layers = graph.layers
    for i in range(len(layers) - 1):
        here, after = by_name[layers[i].name], by_name[layers[i + 1].name]
        if here.stage != after.stage:
            out[here.stage] += boundary_send_s(layers[i], here.sp, plan.mesh, cluster, plan.schedule, train)
    return out


class _RankBuilder:
    """Spans and memory samples of one pipeline rank, op by op (module docstring)."""

    def __init__(self, rank: int, stages: tuple[int, ...], by_stage: list[list[_LayerTerms]], sends: list[float],
                 receive_bytes: float, prefetch: int) -> None:
        self.rank, self.stages, self.by_stage, self.sends = rank, stages, by_stage, sends
        self.layers = [t for s in stages for t in by_stage[s]]
        self.receive, self.prefetch = receive_bytes, prefetch
        self.spans: list[Span] = []
        self.memory: list[MemorySample] = []
        self.dp_free = 0.0
        self.acts: dict[tuple[int, int], float] = {}  # (stage, micro-batch) → activations held
        self.has_grads: set[str] = set()

    def build(self, order: list[tuple[str, int, int]], times: dict) -> RankStep:
        params = sum(t.params for t in self.layers)
        opt = sum(t.optimizer_bytes for t in self.layers)
        build = (params, 0.0, opt, 0.0, max((t.build_transient for t in self.layers), default=0.0))
        last_mb = {s: max((j for kind, st, j in order if kind == "B" and st == s), default=-1) for s in self.stages}
        self._sample(0.0, "step start", buffers=0.0)
        busy = []
        for kind, stage, mb in order:
            start, end = times[(kind, stage, mb)]
            busy.append((start, end))
            if kind == "F":
                self._forward(stage, mb, start)
            else:
                self._backward(stage, mb, start, mb == last_mb[stage])
        pipeline_end = busy[-1][1] if busy else 0.0
        self._bubbles(busy)
        self._sample(pipeline_end, "exposed dp comm", buffers=0.0, pipelined=False)
        for layer in reversed(self.layers):
            self._dp(layer.dp_exposed, pipeline_end, f"{layer.name} (exposed)", layer.name, None, "dp comm (exposed)")
        # the optimizer waits for the exposed comm as priced; hidden comm that overran its window is drawn
        # as it queued, but the cost model already counts that overrun in the exposed part
        t = pipeline_end + sum(layer.dp_exposed for layer in self.layers)
        optimizer = sum(layer.optimizer for layer in self.layers)
        self._sample(t, "optimizer step", buffers=max((x.step_transient for x in self.layers), default=0.0),
                     extra_grads=sum(x.step_grads for x in self.layers), pipelined=False)
        self.spans.append(Span(self.rank, "compute", "optimizer step", "optimizer", t, optimizer))
        end = t + optimizer
        self.has_grads.clear()
        self._sample(end, "step end", buffers=0.0, pipelined=False)
        return RankStep(rank=self.rank, stages=self.stages, spans=tuple(sorted(self.spans, key=lambda s: s.start_s)),
                        memory=tuple(self.memory), build_bytes=build, end_s=end)

    # ---- ops
    def _forward(self, stage: int, mb: int, t: float) -> None:
        self.acts[(stage, mb)] = 0.0
        for layer in self.by_stage[stage]:
            self.acts[(stage, mb)] += layer.activations
            self._sample(t, f"forward {layer.name}", buffers=(1 + self.prefetch) * layer.gathered)
            self._dp(layer.dp_fwd_hidden, t, f"{layer.name} gather", layer.name, mb)
            t = self._layer_spans(layer, "forward", mb, t, layer.fwd_compute, layer.fwd_comm)
        if self.sends[stage] > 0:
            self.spans.append(Span(self.rank, "pp send/recv", f"send mb {mb}", "pp send", t, self.sends[stage],
                                   micro_batch=mb))

    def _backward(self, stage: int, mb: int, t: float, last: bool) -> None:
        for layer in reversed(self.by_stage[stage]):
            first = layer.name not in self.has_grads
            own = layer.grads if first and layer.grads > layer.buffers else 0.0
            self._sample(t, f"backward {layer.name}", buffers=layer.buffers if not own else 0.0, extra_grads=own)
            once = layer.dp_once_hidden if last else 0.0
            self._dp(layer.dp_bwd_hidden + once, t, f"{layer.name} reduce", layer.name, mb)
            t = self._layer_spans(layer, "backward", mb, t, layer.bwd_compute, layer.bwd_comm)
            self.has_grads.add(layer.name)
            self.acts[(stage, mb)] -= layer.activations
        self.acts.pop((stage, mb), None)
        self._sample(t, "between ops", buffers=0.0)

    def _layer_spans(self, layer: _LayerTerms, phase: str, mb: int, t: float, compute: float, comm: float) -> float:
        self.spans.append(Span(self.rank, "compute", f"{layer.name} {phase[0]}{mb}", phase, t, compute,
                               micro_batch=mb, layer=layer.name))
        if comm > 0:
            self.spans.append(Span(self.rank, "tp/sp/ep comm", f"{layer.name} {phase[0]}{mb} comm", "tp comm",
                                   t + compute, comm, micro_batch=mb, layer=layer.name))
        return t + compute + comm

    def _dp(self, seconds: float, anchor: float, name: str, layer: str, mb: int | None,
            category: str = "dp comm") -> None:
        if seconds <= 0:
            return
        start = max(anchor, self.dp_free)
        self.spans.append(Span(self.rank, "dp comm", name, category, start, seconds, micro_batch=mb, layer=layer))
        self.dp_free = start + seconds

    def _bubbles(self, busy: list[tuple[float, float]]) -> None:
        if not busy:
            return
        edges = [(0.0, 0.0)] + sorted(busy)
        for (_, prev_end), (start, _) in zip(edges, edges[1:]):
            if start - prev_end > 1e-12:
                self.spans.append(Span(self.rank, "compute", "bubble", "bubble", prev_end, start - prev_end))

    # ---- memory
    def _sample(self, t: float, phase: str, *, buffers: float, extra_grads: float = 0.0,
                pipelined: bool = True) -> None:
        """``pipelined``: inside the forwards and backwards, where the pipeline's receive buffers live."""
        grads = sum(x.grads for x in self.layers if x.name in self.has_grads) + extra_grads
        values = (sum(x.params for x in self.layers), grads, sum(x.optimizer_bytes for x in self.layers),
                  sum(self.acts.values()), buffers + (self.receive if pipelined else 0.0))
        self.memory.append(MemorySample(t, phase, values))


__all__ = ["MEMORY_KINDS", "STREAMS", "MemorySample", "RankStep", "Span", "StepLayout", "lay_out_step",
           "rank_op_order", "simulate"]
