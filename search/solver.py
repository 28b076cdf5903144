r"""Search: meshes enumerated outside CP-SAT, one CP-SAT model per surviving (mesh, schedule).

Outer search (``solve``)
    1. ``space.enumerate_meshes`` lists admissible meshes; ``space.schedule_candidates``
       lists (micro-batch, schedule) per mesh. Each pair is a *candidate*.
    2. Each candidate gets a cheap lower bound from two cost calls per layer
       class (``_probe_bound``): the fastest-looking strategy (first state, no
       recompute, bf16 comm, per ``sp``) gives ``t_c``, and
       ``LB = (m + (p−1)/v) · Σ_l t_l / p``. It is valid when neither sharding
       state nor quantized comm makes forward+backward faster and recompute
       never does (true of every cost model here). With the real cost model,
       ``cost_model.lower_bound_step_time`` (when present) is max-ed in.
    3. Best-first: a heap of (bound, order, level) pops the smallest bound and stops once it is ≥
       the best step time found. A probe-level entry is refined (memory probe, then the full cost
       table, ``evaluate.prune_dominated``, and ``bounds.table_bounds``: joint min of slots·t + tail
       per class plus a Lagrangian relaxation of per-rank memory rows summed over the first j ranks,
       whose in-flight counts are the largest) and pushed back; a
       table-level entry runs the CP-SAT model below with ``Z < best`` as a cutoff.
    4. Heuristic incumbent U (``incumbent.py``): every refined candidate that could still win
       prices a Lagrangian-greedy plan on balanced stages. While U is finite, all probe entries
       with bound ≤ U are refined before any CP-SAT solve, bounds > U are dropped, and CP-SAT
       gets ``Z < U·(1 + UPPER_SLACK)`` until it has its own incumbent. Ties are kept, so the
       plan is the one found without U; if CP-SAT reproduces nothing under U the search reruns
       without it.

CP-SAT model (``cpsat_model.py``), for mesh (p = pp) and schedule (m, v). Classes
c (``space.solver_classes``), options s ∈ S_c, anchor blocks b (``evaluate``),
n_{c,b} layers of class c riding on block b, ranks k:

    x[c,s] ∈ {0,1}                Σ_s x[c,s] = 1                       one_strategy/<c>       add_strategy_choice
    sp ∈ {0,1} (tp > 1)           Σ_{s: s.sp} x[c,s] = sp              sp_consistent/<c>      add_strategy_choice
    y[b,k] ∈ {0,1}, k ∈ W(b)      Σ_k y[b,k] = 1, st_b = Σ_k k·y[b,k]  stage_assign/<b>       add_stage_assignment
                                  st_b ≤ st_{b+1} ≤ st_b + 1           stage_contiguous/<b>   add_stage_assignment
    V_b = Σ_c n_{c,b} Σ_s x[c,s]·V[c,s]  for V ∈ {t, tail, S, A, R, O}                        add_block_terms
    G_k ≥ Σ_s x[c,s]·G[c,s]  (c on rank k)                             buffer_max/<c>/stage<k> add_buffer_max
    H_k ≥ Σ_s x[c,s]·H[c,s]  (c on rank k)                             gathered_max/<c>/stage<k> add_buffer_max
    L_k ≥ G_k,  L_k ≥ (1+prefetch)·H_k                                 live_buffers/stage<k>  add_buffer_max
    X_k ≥ Σ_s x[c,s]·X[c,s]  (c on rank k)                             build_max/<c>/stage<k>  add_buffer_max
    Y_k ≥ Σ_s x[c,s]·Y[c,s]  (c on rank k)                             optstep_max/<c>/stage<k> add_buffer_max
    A_b −= Σ (A−A')[c,s]·z,  z ≤ x[c,s], z ≤ full(c_prev)             chain_region/<c>       add_block_terms
    T_max ≥ Σ_b y[b,k]·t_b + P_k                                       stage_time/stage<k>    add_stage_rows_and_objective
    Σ_b y[b,k]·(S_b + f_k·A_b) + L_k ≤ M    (pp > 1)                  mem/stage<k>           add_stage_rows_and_objective
    pp = 1: per layer j of block b (first and last block of each run of equal blocks):
      Σ S − [m=1]·Σ Gr + (f−1)·Σ A + A_{<b} + a_{b,≤j} + [m=1]·(Gr_{>b} + gr_{b,>j})
          + max(G, (1+prefetch)·H)_{b,j} ≤ M   (Gr = gradients; m = 1: forward and backward rows)         mem/block<b>/layer<j>  add_timeline_rows
    Σ_b y[b,k]·R_b + X_k ≤ M                                          build/stage<k>         add_stage_rows_and_objective
    Σ_b y[b,k]·O_b + Y_k ≤ M                                          optstep/stage<k>       add_stage_rows_and_objective
    Z ≥ (m + (p−1)/v)·T_max + Σ_b y[b,k]·tail_b                        step/stage<k>          add_stage_rows_and_objective
    minimise  W·Z + Σ_{c,s} h(c,s)·x[c,s] + Σ_b g(b)·st_b

Products y·(linear in x) are linearised with one non-negative variable per
(b, k) bounded below under ``only_enforce_if(y[b,k])``; every row using them
is an upper bound, so the optimum sets them to the product. f_k is
``pipeline.in_flight`` (1F1B: min(p−k, m); GPipe: m; interleaved: Megatron's
warm-up count / v; rows are multiplied by v to stay integral). M is the
per-rank limit ``(max_memory_bytes or device memory) · (1 − headroom)``. ``mem`` bounds the step
peak, ``optstep`` the optimizer step's (O = params + grads + optimizer + the fp32 gradients the
update reads, Y = the copies of the gradient bucket being packed), ``build`` the build peak (R =
params + device optimizer states, X = the largest parameter region being built:
``search/memory.py``); the rank's peak is the largest, so all must fit. The
build rows are added lazily (``_solve_lazily``): the model without them is solved first, and solved
again with them only when its answer does not fit them.
W(b) is a window: stage boundary k lies within ``max(2, ⌈B/p⌉)`` blocks of
``round(k·B/p)`` (so one stage may shrink or grow by a whole stage's worth to
offset the embedding or the head); blocks outside every window are fixed.
Interleaved schedules use p·v equal chunks (virtual stage j on rank j mod p)
and no y. Strategies are shared by all layers of a class on every stage
(stages differ only in their boundaries).

Determinism. h and g are small deterministic weights below W: h(c,s) = 16·(rank
of s in canonical order) + crc32(c, s) mod 16, so among plans of equal step
time the simpler strategy wins (less sharding, less recompute, unquantized
comm: DDP before ZeRO when ZeRO buys nothing) and any remaining tie resolves
to one unique optimum; g(b) = 1 + crc32(b) mod 8 does the same for stage
boundaries. Candidate
order is a pure function of the inputs; CP-SAT runs with a fixed seed and
worker count (2 workers running ``cpsat_model.LP_SUBSOLVERS`` by default). Two solves that reach
OPTIMAL return identical plans. Candidates whose optima tie exactly (e.g. two data-parallel
splits the cost model prices alike) resolve to the one CP-SAT solves first, a pure function of
the inputs and of the bounds' values. Only the
wall time differs: ``SolverStats.wall_s`` is kept in memory only (not written, not compared;
``autoshard/plan.py``, "Reproducible files"), so plan files compare byte for byte. A search cut short by
``time_limit_s`` (status FEASIBLE) depends on timing and is not reproducible.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError, InfeasibleError
from autoshard.graph import ModelGraph
from autoshard.plan import Fingerprints, LayerStrategy, Mesh, Plan, Predictions, Schedule, SolverStats
from autoshard.progress import ProgressFn, Update
from autoshard.search import bounds, cost_model, incumbent, layer_terms
from autoshard.search.cpsat_model import ModelInput, ModelResult, block_members, fits_build_rows, solve_model
from autoshard.search.evaluate import (
    CostFn, CostTable, Option, anchor_blocks, chain_flags, evaluate, fallback_predictions, layer_stages,
    num_anchor_blocks, prune_dominated,
)
from autoshard.search.space import (
    RECOMPUTE, Constraints, PruneRecord, SolverClass, admissible_strategies, enumerate_meshes, resolve_pins,
    schedule_candidates, solver_classes, strategy_key, validate_constraints,
)
from autoshard.train import TrainSpec

DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_NUM_WORKERS = 2  # measured on a 2-core host: docs/search.md, speed (cpsat_model.LP_SUBSOLVERS)
GiB = 2**30


@dataclass(frozen=True)
class Candidate:
    """One (mesh, schedule) pair with its probe lower bound."""

    mesh: Mesh
    schedule: Schedule
    lower_bound_s: float
    admissible: tuple[tuple[LayerStrategy, ...], ...]  # per class, pin-filtered

    def order_key(self) -> tuple:
        m, s = self.mesh, self.schedule
        return (self.lower_bound_s, m.tp, m.pp, m.dp_shard, m.dp_replicate, m.ep, s.micro_batch, s.name,
                s.virtual_stages)


@dataclass
class _Search:
    """Mutable state of one ``solve`` call (never escapes it)."""

    graph: ModelGraph
    cluster: Cluster
    train: TrainSpec
    classes: tuple[SolverClass, ...]
    class_of_layer: tuple[int, ...]
    table: CostTable
    cap_bytes: int
    unit_s: float = 1e-9
    best: tuple[float, Candidate, ModelResult, tuple[tuple[Option, ...], ...]] | None = None
    bound_s: float = math.inf
    min_memory_bytes: float = math.inf
    min_memory_where: str = ""
    solved_meshes: set = dataclasses.field(default_factory=set)
    too_big: dict = dataclasses.field(default_factory=dict)  # (mesh, schedule kind) → smallest failing micro-batch
    statuses: list = dataclasses.field(default_factory=list)
    upper_s: float = math.inf  # heuristic incumbent U (incumbent.py): some plan is at least this fast
    mesh_bound_s: float | None = None  # cost_model.lower_bound_step_time (depends on the world size only)
    rows: dict = dataclasses.field(default_factory=dict)  # bounds.MemoryRows per (pp, schedule kind, m)
    offload: bool = True  # whether layers may take the offload state (solve: a first pass without)
    progress: ProgressFn | None = None  # solve's progress argument
    meshes_considered: int = 0


def without_wall_time(plan: Plan) -> Plan:
    """``plan`` with ``solver.wall_s = 0`` (for byte-for-byte comparison of two solves)."""
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, wall_s=0.0))


def solve(graph: ModelGraph, cluster: Cluster, train: TrainSpec, *, constraints: Constraints | None = None,
          time_limit_s: float = DEFAULT_TIME_LIMIT_S, hint: Plan | None = None, cost_fn: CostFn | None = None,
          num_workers: int = DEFAULT_NUM_WORKERS, progress: ProgressFn | None = None) -> Plan:
    """Search the fastest plan for ``graph`` on ``cluster`` that fits per-rank memory.

    constraints: pins, fixed mesh degrees, memory limit, schedule (``space.Constraints``).
    time_limit_s: wall-clock budget for the whole search; when it runs out the
        best plan so far is returned with status ``FEASIBLE``.
    hint: a previous plan (e.g. for another cluster); its mesh and schedule
        are tried first and its per-class choices seed CP-SAT (``AddHint``).
    cost_fn: ``layer_cost``-compatible function; default ``cost_model.layer_cost``.
    progress: receives ``Update("search", decided, candidates, unit="candidates")`` as the main
        loop refines, solves or prunes (mesh, schedule) candidates; its note says how many meshes
        CP-SAT solved of those enumerated and the best step time so far (``autoshard/progress.py``).
        ``None``: silent. It never changes the plan.
    Raises ``AutoshardError`` for malformed or contradictory constraints and
    ``InfeasibleError`` (naming the binding family and what to relax) when no plan fits.
    """
    start = time.monotonic()
    constraints = constraints or Constraints()
    validate_constraints(constraints, graph, cluster)
    cost_fn = cost_fn or cost_model.layer_cost
    # Offload (CPU optimizer) only for a model that fits no other way: a first pass without it, then,
    # if nothing fits, one with it, in the same time budget
    try:
        return _solve_pass(graph, cluster, train, constraints, cost_fn, hint, start, time_limit_s, num_workers,
                           offload=False, progress=progress)
    except _NothingFits:
        pass
    try:
        return _solve_pass(graph, cluster, train, constraints, cost_fn, hint, start, time_limit_s, num_workers,
                           offload=True, progress=progress)
    except _NothingFits as nothing:
        raise nothing.error from None


class _NothingFits(Exception):
    """A pass proved every candidate over the memory (``error``: what ``solve`` raises if offload can't help)."""

    def __init__(self, error: InfeasibleError) -> None:
        super().__init__(str(error))
        self.error = error


def _solve_pass(graph: ModelGraph, cluster: Cluster, train: TrainSpec, constraints: Constraints, cost_fn: CostFn,
                hint: Plan | None, start: float, time_limit_s: float, num_workers: int, *, offload: bool,
                progress: ProgressFn | None = None) -> Plan:
    search = _new_search(graph, cluster, train, constraints, cost_fn, offload=offload)
    search.progress = progress
    if search.cap_bytes <= 0:
        raise _below_reservation_error(cluster, constraints)
    enumeration = enumerate_meshes(graph, cluster, train, constraints.mesh)
    if not enumeration.meshes:
        raise _no_mesh_error(enumeration.pruned, constraints)
    candidates, pin_records = _candidates(search, enumeration.meshes, constraints, cost_fn)
    if not candidates:
        raise _no_mesh_error(enumeration.pruned + tuple(pin_records), constraints)
    search.unit_s = _time_unit(candidates)
    search.meshes_considered = len(enumeration.meshes)
    ordered = _ordered(candidates, hint)
    _run(search, ordered, hint, start + time_limit_s, num_workers)
    if search.best is None and math.isfinite(search.upper_s) and "TIME_LIMIT" not in search.statuses:
        # U came from a plan CP-SAT does not reproduce (it never has so far): search again without it
        search.upper_s, search.statuses = math.inf, []
        _run(search, ordered, hint, start + time_limit_s, num_workers, use_upper=False)
    if search.best is None:
        if "TIME_LIMIT" in search.statuses:
            raise _timeout_error(time_limit_s)
        raise _NothingFits(_infeasible_error(search, constraints))
    return _assemble(search, len(enumeration.meshes), time.monotonic() - start, cost_fn)


# ----------------------------------------------------------------------------- setup
def _new_search(graph: ModelGraph, cluster: Cluster, train: TrainSpec, constraints: Constraints,
                cost_fn: CostFn, offload: bool = True) -> _Search:
    classes = solver_classes(graph, resolve_pins(constraints, graph))
    index = {layer.name: i for i, c in enumerate(classes) for layer in c.layers}
    return _Search(
        graph=graph, cluster=cluster, train=train, classes=classes,
        class_of_layer=tuple(index[layer.name] for layer in graph.layers), table=CostTable(cost_fn, cluster, train),
        cap_bytes=usable_memory(cluster, constraints), offload=offload,
    )


def usable_memory(cluster: Cluster, constraints: Constraints) -> int:
    """M: per-rank bytes a plan may use (``Constraints`` docstring)."""
    limit = constraints.max_memory_bytes or cluster.device.memory_bytes
    if constraints.memory_headroom is not None:
        return int(limit * (1.0 - constraints.memory_headroom))
    device = dataclasses.replace(cluster.device, memory_bytes=limit)
    return int(cost_model.usable_memory_bytes(dataclasses.replace(cluster, device=device)))


def _candidates(search: _Search, meshes: tuple[Mesh, ...], constraints: Constraints,
                cost_fn: CostFn) -> tuple[list[Candidate], list[PruneRecord]]:
    out, records = [], []
    for mesh in meshes:
        admissible = tuple(admissible_strategies(c.representative, mesh, dict(c.pin), search.train.comm_precision,
                                                 offload=search.offload) for c in search.classes)
        empty = [c for c, a in zip(search.classes, admissible) if not a]
        if empty:
            records.append(PruneRecord(f"pin/{empty[0].name}",
                                       f"pin {dict(empty[0].pin)} is not admissible on this mesh", mesh))
            continue
        mesh_bound = _mesh_bound(search, mesh, cost_fn)
        for schedule in schedule_candidates(mesh, search.graph, search.train, constraints.schedule):
            bound = max(mesh_bound, _probe_bound(search, mesh, schedule, admissible))
            out.append(Candidate(mesh, schedule, bound, admissible))
    return out, records


def _mesh_bound(search: _Search, mesh: Mesh, cost_fn: CostFn) -> float:
    bound_fn = getattr(cost_model, "lower_bound_step_time", None)
    if bound_fn is None or cost_fn is not cost_model.layer_cost:
        return 0.0
    if search.mesh_bound_s is None:  # compute spread over the whole world: the same for every mesh
        search.mesh_bound_s = float(bound_fn(search.graph, mesh, search.cluster, search.train))
    return search.mesh_bound_s


def _slots(mesh: Mesh, schedule: Schedule) -> float:
    v = schedule.virtual_stages if schedule.name == "interleaved_1f1b" else 1
    return schedule.num_micro_batches + (mesh.pp - 1) / v


def _probe_bound(search: _Search, mesh: Mesh, schedule: Schedule,
                 admissible: tuple[tuple[LayerStrategy, ...], ...]) -> float:
    """Module docstring, step 2."""
    per_sp: dict[bool, float] = {}
    for sp in (False, True):
        total = 0.0
        for c, strategies in zip(search.classes, admissible):
            probes = [s for s in strategies if s.sp == sp]
            if not probes:
                total = math.inf
                break
            probe = min(probes, key=strategy_key)
            total += len(c.layers) * search.table.option(c.representative, probe, mesh, schedule).time_s
        per_sp[sp] = total
    return _slots(mesh, schedule) * min(per_sp.values()) / mesh.pp


def _time_unit(candidates: list[Candidate]) -> float:
    """Power of ten with the smallest positive bound at ~1e7 units (objective resolution 1e-7)."""
    positive = [c.lower_bound_s for c in candidates if c.lower_bound_s > 0]
    reference = min(positive) if positive else 1.0
    return 10.0 ** (math.floor(math.log10(reference)) - 7)


def _ordered(candidates: list[Candidate], hint: Plan | None) -> list[Candidate]:
    ordered = sorted(candidates, key=Candidate.order_key)
    if hint is None:
        return ordered
    first = [c for c in ordered if c.mesh == hint.mesh and c.schedule == _bare(hint.schedule)]
    return first + [c for c in ordered if c not in first]


def _bare(schedule: Schedule) -> Schedule:
    return Schedule(name=schedule.name, micro_batch=schedule.micro_batch,
                    num_micro_batches=schedule.num_micro_batches, virtual_stages=schedule.virtual_stages)


# ----------------------------------------------------------------------------- main loop
UPPER_SLACK = 1e-4  # a heuristic incumbent U admits CP-SAT solutions with step < U·(1 + slack) (rounding)
MEMORY_MARGIN = 1e-3  # heuristic plans must fit M·(1 − margin), so KiB rounding in CP-SAT keeps them feasible


def _run(search: _Search, candidates: list[Candidate], hint: Plan | None, deadline: float, num_workers: int,
         use_upper: bool = True) -> None:
    """Best-first branch and bound (module docstring, step 3) over two heaps of (bound, order, candidate):
    ``probes`` (probe bound) and ``tables`` (table bound, ready for CP-SAT). While a heuristic
    incumbent U is known, every probe entry with bound ≤ U is refined before any CP-SAT solve, so
    CP-SAT starts with the best cutoff the tables give; without U the smaller bound goes first."""
    probes = [(c.lower_bound_s, i, c) for i, c in enumerate(candidates)]
    if hint is not None and candidates and (candidates[0].mesh, candidates[0].schedule) == (hint.mesh, _bare(hint.schedule)):
        probes[0] = (-math.inf, 0, candidates[0])  # the hint's candidate runs first
    heapq.heapify(probes)
    tables: list = []
    decided = 0  # candidates dropped by their memory or table bound, or solved
    _report(search, decided, len(candidates))
    while True:
        probe_ok, table_ok = (bool(h) and _alive(search, h[0][0], use_upper) for h in (probes, tables))
        if not probe_ok and not table_ok:
            _report(search, len(candidates), len(candidates))
            return  # every remaining entry's bound is ≥ the incumbent
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            search.bound_s = min(search.bound_s, max(min(h[0][0] for h in (probes, tables) if h), 0.0))
            search.statuses.append("TIME_LIMIT")
            return
        if probe_ok and (use_upper and math.isfinite(search.upper_s) or not table_ok
                         or probes[0][:2] <= tables[0][:2]):
            bound, i, cand = heapq.heappop(probes)
            refined = _refine(search, cand, use_upper)
            if refined is not None:
                heapq.heappush(tables, (max(cand.lower_bound_s, refined[0]), i, cand, refined[1]))
            else:
                decided += 1
                _report(search, decided, len(candidates))
            continue
        _, _, cand, options = heapq.heappop(tables)
        _solve_candidate(search, cand, options, hint, remaining, num_workers, use_upper)
        decided += 1
        _report(search, decided, len(candidates))


def _report(search: _Search, decided: int, total: int) -> None:
    """The main loop's progress (``solve``'s ``progress``); no effect on the search."""
    if search.progress is None:
        return
    best = f", best step {search.best[0]:.4g} s" if search.best is not None else ""
    note = f"{len(search.solved_meshes)} of {search.meshes_considered} meshes solved{best}"
    search.progress(Update("search", decided, total, unit="candidates", note=note, eta=False))


def _alive(search: _Search, bound: float, use_upper: bool) -> bool:
    """A bound can still hold the optimum: < the CP-SAT incumbent and ≤ the heuristic one (ties kept)."""
    if search.best is not None and bound >= search.best[0]:
        return False
    return not use_upper or bound <= search.upper_s * (1 + UPPER_SLACK)


def _note_upper(search: _Search, cand: Candidate, options) -> None:
    """Lower U with ``incumbent.upper_bound`` of a refined candidate."""
    anchors = anchor_blocks(search.graph)
    u = incumbent.upper_bound(options, search.class_of_layer, anchors, num_anchor_blocks(search.graph),
                              chain_flags(search.graph), cand.mesh, cand.schedule,
                              search.cap_bytes * (1 - MEMORY_MARGIN))
    search.upper_s = min(search.upper_s, u)


def _refine(search: _Search, cand: Candidate, use_upper: bool = True) -> tuple[float, tuple] | None:
    """(table bound, dominance-pruned options) of a candidate, or None when it cannot fit. A candidate
    whose table bound could still win also lowers the heuristic incumbent U (``incumbent.py``)."""
    if _memory_hopeless(search, cand):
        return None
    options = _class_options(search, cand)
    time_lb, mem_lb = _table_bounds(search, cand, options)
    _note_memory(search, cand, mem_lb)
    if mem_lb > search.cap_bytes:
        return None
    if use_upper and _alive(search, max(time_lb, cand.lower_bound_s), use_upper):
        _note_upper(search, cand, options)
    return time_lb, options


def _class_options(search: _Search, cand: Candidate) -> tuple[tuple[Option, ...], ...]:
    return tuple(
        tuple(prune_dominated(search.table.options(c.representative, strategies, cand.mesh, cand.schedule)))
        for c, strategies in zip(search.classes, cand.admissible)
    )


def _table_bounds(search: _Search, cand: Candidate, options) -> tuple[float, float]:
    """(step-time, per-rank memory) lower bounds from the full cost table (``bounds.py``)."""
    return bounds.table_bounds(options, _layer_counts(search), _memory_rows(search, cand), cand.mesh,
                               cand.schedule, float(search.cap_bytes))


def _layer_counts(search: _Search) -> np.ndarray:
    return np.bincount(np.asarray(search.class_of_layer), minlength=len(search.classes)).astype(float)  # (C,)


def _memory_rows(search: _Search, cand: Candidate) -> bounds.MemoryRows:
    """``bounds.memory_rows`` of the candidate, memoised per (pp, schedule kind, m)."""
    s = cand.schedule
    key = (cand.mesh.pp, s.name, s.virtual_stages, s.num_micro_batches)
    if key not in search.rows:
        search.rows[key] = bounds.memory_rows(search.class_of_layer, anchor_blocks(search.graph),
                                              chain_flags(search.graph), num_anchor_blocks(search.graph),
                                              len(search.classes), cand.mesh, s)
    return search.rows[key]


def _probe_memory(search: _Search, cand: Candidate) -> float:
    """Per-rank memory lower bound from the most frugal strategies (module docstring, step 3), over the
    prefix rows of ``bounds.py`` (the first ranks hold the most micro-batches in flight)."""
    rows = _memory_rows(search, cand)
    per_sp = []
    for sp in (False, True):
        frugal_bytes = []  # per class: (R,) least left side of the row over the probes
        for index, (c, strategies) in enumerate(zip(search.classes, cand.admissible)):
            mine = [s for s in strategies if s.sp == sp]
            if not mine:
                break
            deepest = max(RECOMPUTE.index(s.recompute) for s in mine)
            frugal = [s for s in mine if RECOMPUTE.index(s.recompute) == deepest]
            sharded = [s for s in frugal if s.state in ("zero3", "offload")] or frugal
            probes = {s.state: s for s in sorted(sharded, key=strategy_key, reverse=True)}.values()
            options = [search.table.option(c.representative, s, cand.mesh, cand.schedule) for s in probes]
            apart = cand.mesh.pp == 1 and cand.schedule.num_micro_batches == 1  # Option.static_floor
            static = np.array([[o.static_floor(apart) for o in options]])  # (1, n_probes)
            act = np.array([[o.activation_bytes for o in options]])
            chain = np.minimum(act, [[o.chain_bytes for o in options]])
            frugal_bytes.append(rows.weighted(static, act, chain)[:, index, :].min(axis=1))  # (R,)
        else:
            need = np.stack(frugal_bytes, axis=1).sum(axis=1)  # (R,)
            per_sp.append(float(np.max(need / rows.ranks)))
    return min(per_sp, default=math.inf)


def _note_memory(search: _Search, cand: Candidate, need: float) -> None:
    if need < search.min_memory_bytes:
        search.min_memory_bytes = need
        search.min_memory_where = f"mesh {_mesh_text(cand.mesh)}, {_sched_text(cand.schedule)}"


def _memory_hopeless(search: _Search, cand: Candidate) -> bool:
    """Skip candidates whose memory probe exceeds M; a failing micro-batch fails every larger one too."""
    kind = (cand.mesh, cand.schedule.name, cand.schedule.virtual_stages)
    if cand.schedule.micro_batch >= search.too_big.get(kind, math.inf):
        return True
    need = _probe_memory(search, cand)
    _note_memory(search, cand, need)
    if need <= search.cap_bytes:
        return False
    search.too_big[kind] = min(search.too_big.get(kind, math.inf), cand.schedule.micro_batch)
    return True


def _solve_candidate(search: _Search, cand: Candidate, options, hint: Plan | None, remaining: float,
                     num_workers: int, use_upper: bool = True) -> None:
    best_s = search.best[0] if search.best else math.inf
    cutoff = best_s if search.best is not None else (
        search.upper_s * (1 + UPPER_SLACK) if use_upper and math.isfinite(search.upper_s) else None)
    anchors, num_blocks = anchor_blocks(search.graph), num_anchor_blocks(search.graph)
    inp = ModelInput(
        classes=search.classes, options=options,
        block_classes=block_members(anchors, search.class_of_layer, num_blocks),
        block_chain=block_members(anchors, chain_flags(search.graph), num_blocks),
        mesh=cand.mesh, schedule=cand.schedule, cap_bytes=search.cap_bytes, unit_s=search.unit_s,
        cutoff_s=cutoff, hint=_hint_strategies(search, hint),
        hint_block_stage=_hint_block_stages(search, hint, cand),
    )
    result, options = _solve_lazily(inp, remaining, num_workers)
    search.solved_meshes.add(cand.mesh)
    search.statuses.append(result.status)
    if result.status in ("FEASIBLE", "UNKNOWN"):
        search.bound_s = min(search.bound_s, max(result.bound_s, cand.lower_bound_s))
    if result.status not in ("OPTIMAL", "FEASIBLE"):
        return
    step_s = _evaluate_result(search, cand, options, result)
    if step_s < best_s:
        search.best = (step_s, cand, result, options)


def _solve_lazily(inp: ModelInput, time_limit_s: float, num_workers: int) -> tuple[ModelResult, tuple]:
    """(CP-SAT answer, the options it indexes) with the build rows added lazily (module docstring).

    First the relaxation: no ``build/stage<k>`` rows, options pruned without their numbers
    (``prune_dominated(build=False)``: fewer survive, since ZeRO-3's smaller build transient no
    longer keeps it beside an offload option that beats it in the step). Its optimum is an optimum
    of the step-only problem over every option; when it fits the build rows it is the full model's
    optimum too, and its bound and infeasibility hold for the full model. Otherwise the full model
    is solved in the time left. The build rows rarely bind, and they cost as many linearisation
    variables as the memory rows.
    """
    start = time.monotonic()
    step_options = tuple(tuple(prune_dominated(opts, build=False)) for opts in inp.options)
    relaxed_inp = dataclasses.replace(inp, options=step_options)
    relaxed = solve_model(relaxed_inp, time_limit_s=time_limit_s, num_workers=num_workers, build_rows=False)
    if relaxed.status not in ("OPTIMAL", "FEASIBLE") or fits_build_rows(relaxed_inp, relaxed):
        return relaxed, step_options
    remaining = time_limit_s - (time.monotonic() - start)
    return solve_model(inp, time_limit_s=remaining, num_workers=num_workers), inp.options


def _layer_options(search: _Search, options, result: ModelResult) -> list[Option]:
    return [options[c][result.choice[c]] for c in search.class_of_layer]


def _evaluate_result(search: _Search, cand: Candidate, options, result: ModelResult) -> float:
    stages = layer_stages(search.graph, result.block_stage)
    return evaluate(_layer_options(search, options, result), stages, cand.mesh, cand.schedule,
                    chain_flags(search.graph)).step_s


def _hint_strategies(search: _Search, hint: Plan | None) -> tuple[LayerStrategy | None, ...]:
    if hint is None:
        return ()
    names = {s.layer: s for s in hint.layers}
    return tuple(names.get(c.representative.name) for c in search.classes)


def _hint_block_stages(search: _Search, hint: Plan | None, cand: Candidate) -> tuple[int, ...]:
    if hint is None or hint.mesh.pp != cand.mesh.pp or len(hint.layers) != len(search.graph.layers):
        return ()
    stages: dict[int, int] = {}
    for anchor, strategy in zip(anchor_blocks(search.graph), hint.layers):
        stages.setdefault(anchor, strategy.stage)
    return tuple(stages[b] for b in sorted(stages))


# ----------------------------------------------------------------------------- result
def _assemble(search: _Search, meshes_considered: int, wall_s: float, cost_fn: CostFn) -> Plan:
    step_s, cand, result, options = search.best
    stages = layer_stages(search.graph, result.block_stage)
    layer_opts = _layer_options(search, options, result)
    layers = tuple(dataclasses.replace(o.strategy, layer=layer.name, stage=stage)
                   for layer, o, stage in zip(search.graph.layers, layer_opts, stages))
    proven = all(s in ("OPTIMAL", "INFEASIBLE") for s in search.statuses)
    bound = min(search.bound_s, step_s)
    plan = Plan(
        model_name=search.graph.model_name, mesh=cand.mesh, layers=layers, schedule=cand.schedule,
        solver=SolverStats(status="OPTIMAL" if proven else "FEASIBLE", objective=step_s, bound=bound,
                           gap=(step_s - bound) / step_s if step_s > 0 else 0.0, wall_s=wall_s,
                           meshes_considered=meshes_considered, meshes_solved=len(search.solved_meshes)),
        fingerprints=_fingerprints(search, cost_fn), global_batch=search.train.global_batch,
        seq_len=search.train.seq_len, precision=search.train.precision, optimizer=search.train.optimizer,
    )
    return dataclasses.replace(plan, predictions=_predictions(search, plan, layer_opts, stages, cost_fn))


def _predictions(search: _Search, plan: Plan, layer_opts, stages, cost_fn: CostFn) -> Predictions:
    if cost_fn is cost_model.layer_cost:
        try:
            return cost_model.predict(search.graph, plan, search.cluster, search.train)
        except NotImplementedError:
            pass
    return dataclasses.replace(
        fallback_predictions(search.graph, layer_opts, stages, plan.mesh, plan.schedule, search.cluster, search.train),
        caveats=cost_model.pricing_caveats(search.graph, search.cluster))


def _fingerprints(search: _Search, cost_fn: CostFn) -> Fingerprints:
    version = cost_model.COST_MODEL_VERSION if cost_fn is cost_model.layer_cost else (
        f"custom:{getattr(cost_fn, '__module__', '?')}.{getattr(cost_fn, '__qualname__', '?')}")
    if hasattr(Fingerprints, "of"):
        return Fingerprints.of(search.graph, search.cluster, version)
    cluster_fp = search.cluster.fingerprint() if hasattr(search.cluster, "fingerprint") else ""
    return Fingerprints(model=search.graph.fingerprint(), cluster=cluster_fp, cost_model=version)


# ----------------------------------------------------------------------------- errors
def _mesh_text(mesh: Mesh) -> str:
    return f"dp_replicate={mesh.dp_replicate} dp_shard={mesh.dp_shard} tp={mesh.tp} pp={mesh.pp} ep={mesh.ep}"


def _sched_text(schedule: Schedule) -> str:
    return f"{schedule.name} micro_batch={schedule.micro_batch} m={schedule.num_micro_batches}"


def _no_mesh_error(records: tuple[PruneRecord, ...], constraints: Constraints) -> AutoshardError:
    families = sorted({r.constraint for r in records})
    examples = "; ".join(sorted({r.detail for r in records})[:4])
    fixed = f" with Constraints.mesh={dict(constraints.mesh)}" if constraints.mesh else ""
    return InfeasibleError(
        f"no mesh is admissible{fixed}: binding constraint families {families} ({examples}); relax: "
        "change or drop the fixed mesh degrees or pins, use a global_batch divisible by the data-parallel "
        "degree, or pad heads/vocab to a multiple of the tensor-parallel degree"
    )


def _timeout_error(time_limit_s: float) -> InfeasibleError:
    return InfeasibleError(
        f"time_limit_s={time_limit_s:g} ran out before any plan was found (no candidate was proven "
        "infeasible for all of them); relax: a larger time_limit_s, or fix mesh degrees (Constraints.mesh) "
        "to search fewer candidates")


def _below_reservation_error(cluster: Cluster, constraints: Constraints) -> InfeasibleError:
    limit = constraints.max_memory_bytes or cluster.device.memory_bytes
    if constraints.memory_headroom is not None:
        return InfeasibleError(
            f"Constraints.memory_headroom={constraints.memory_headroom} leaves no usable memory of the "
            f"{limit / GiB:.2f} GiB limit; allowed: headroom in [0, 1); use a headroom below 1, e.g. 0.1")
    reserved = layer_terms.reserved_bytes(cluster)
    return InfeasibleError(
        f"the per-rank memory limit {limit / GiB:.2f} GiB is at or below the cost model's fixed reservation of "
        f"{reserved / GiB:.2f} GiB (CUDA context, NCCL and allocator pools) by {(reserved - limit) / GiB:.2f} GiB, "
        f"so no plan can fit; relax: set Constraints.max_memory_bytes above {reserved / GiB:.2f} GiB plus the "
        "model's needs (or calibrate reserved_bytes for this device)")


def _infeasible_error(search: _Search, constraints: Constraints) -> InfeasibleError:
    need = search.min_memory_bytes
    need_text = f"{need / GiB:.2f} GiB" if math.isfinite(need) else "unknown"
    limit = (constraints.max_memory_bytes or search.cluster.device.memory_bytes) / GiB
    pins = f"; pins in effect: {dict(constraints.pin)}" if constraints.pin else ""
    usable = f"{search.cap_bytes / GiB:.2f} GiB ({limit:.2f} GiB less allocator headroom)"
    if not math.isfinite(need) or need > search.cap_bytes:
        why = (f"the smallest per-rank memory any plan needs is at least {need_text} ({search.min_memory_where}), "
               f"but the usable per-rank memory is {usable}")
    else:  # the per-layer bound fits: never cite it as the need (it is not the binding constraint)
        proven = search.statuses.count("INFEASIBLE")
        why = (f"the solver proved the {proven} candidate(s) left by the per-layer memory bound infeasible: that "
               f"bound ({need_text}, {search.min_memory_where}) is within the usable per-rank memory of {usable}, "
               "but no joint choice of the layers' strategies keeps both the step peak and the build "
               "(materialization) peak under it")
    return InfeasibleError(
        f"no plan fits in memory: binding constraint family mem/stage* (step) or build/stage* (build): {why}{pins}; "
        "relax: more devices, recompute='full', state='offload' or 'zero3', a smaller micro-batch or global batch, "
        "or a larger Constraints.max_memory_bytes"
    )
