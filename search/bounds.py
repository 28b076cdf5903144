r"""Lower bounds of one candidate (mesh, schedule) from its cost table: step time and per-rank memory.

Notation as in ``solver.py``: p pipeline ranks, ``slots = m + (p−1)/v``,
classes c with ``n_c`` layers, options s with time t, tail, static bytes S,
activations A (A' when the layer continues a checkpoint region), backward buffers G and forward
gathers H (``memory.live_buffers``); ``f_k`` is
``pipeline.in_flight(k)`` and ``M`` the per-rank limit.

Time. The step is ``slots·T_max + max_k tail_k ≥ Σ_l (slots·t_l + tail_l)/p``;
minimised per class jointly over (t, tail).

Memory rows (prefix rows). For ``j = 1…p`` let ``L_j`` be the layers that sit
on a rank ``< j`` in *every* placement CP-SAT may choose (``cpsat_model.stage_windows``;
interleaved schedules have fixed chunks) and ``φ_j = min_{k<j} f_k``. Summing
the memory rows of ranks ``0…j−1``:

    Σ_{l∈L_j} (S_l + φ_j·Â_l) + max(max_{c∈L_j} min_s G_c, (2 + prefetch)·max_{c∈L_j} min_s H_c)  ≤  j·M
                                                                                        (row j)

Row ``p`` is the summed row of every rank with the least in-flight count;
rows ``j < p`` see the first stages, which hold up to ``min(p, m)``
micro-batches of activations (1F1B), so deep pipelines do not look roomier
than they are. ``Â_l = min(A_l, A'_l)`` for a layer that continues its block
and ``A_l`` for the first layer of a block (which keeps its input even under
full recompute, so fully recomputed blocks still cost activations). With one
micro-batch on one stage ``S_l`` leaves out the gradients (``Option.static_floor``), and with
one stage the buffers term is dropped: the CP-SAT timeline rows there (``memory.step_peak_bytes``)
are each ≥ ``Σ S_floor + Σ A`` only at the last layer, not that plus buffers. Every row is implied by
the CP-SAT memory rows (strategies are shared by all stages; every term is
non-negative).

Lagrangian. For a row and any λ ≥ 0,

    Σ_c min_s [n_c·(slots·t_s + tail_s)/p + λ·Σ_{l∈L_j, l∈c}(S_s + φ_j·Â_s)] − λ·(j·M − buffers_j)

is ≤ the constrained minimum (weak duality); the time bound is the largest
value over the rows and ``LAMBDA_GRID``. Both bounds are taken per global
``sp`` value, then the smaller (the plan picks one ``sp``). The memory bound
is ``max_j need_j / j`` with ``need_j`` the smallest left side of row j: some
rank among the first j needs at least that much. The build rows (``build/stage<k>``: resident
params and optimizer states R plus the largest build transient X of the rank) give a second
memory bound the same way, ``Σ_{l∈L_j} min_s R_l + max_{c∈L_j} min_s X_c ≤ j·M``, and the optimizer-step
rows (``optstep/stage<k>``: O and Y in place of R and X) a third; the memory bound is the largest
(the time bound uses the step rows only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoshard.plan import Mesh, Schedule
from autoshard.search.cpsat_model import stage_windows
from autoshard.search.evaluate import Option, interleaved_block_stages
from autoshard.search.memory import gather_copies
from autoshard.search.pipeline import in_flight, virtual_stages

LAMBDA_GRID = np.concatenate([[0.0], np.logspace(-4, 4, 49)])  # × (time scale / memory scale)
MAX_PREFIX_ROWS = 12  # rows j < p evaluated (spread geometrically over 1…p−1), besides row p


@dataclass(frozen=True)
class MemoryRows:
    """Prefix rows of the module docstring, one per entry: ranks j, φ_j and per-class counts n_{c,j}."""

    ranks: np.ndarray  # (R,) j
    flight: np.ndarray  # (R,) φ_j
    counts: np.ndarray  # (R, C) layers of class c surely on a rank < j
    chained: np.ndarray  # (R, C) those of them that continue their block (may hold A' instead of A)

    def weighted(self, static: np.ndarray, act: np.ndarray, chain_act: np.ndarray) -> np.ndarray:
        """(R, C, ...) left sides of the rows per class: n_{c,j}·S + φ_j·(first layers' A + chained min(A, A'))."""
        flight = self.flight.reshape((-1,) + (1,) * static.ndim)  # (R, 1, ...)
        first = (self.counts - self.chained).reshape(self.counts.shape + (1,) * (static.ndim - 1))
        chained = self.chained.reshape(first.shape)
        return first * (static[None] + flight * act[None]) + chained * (static[None] + flight * chain_act[None])


def _sure_rank(num_blocks: int, mesh: Mesh, schedule: Schedule) -> list[int]:
    """Per anchor block, the highest pipeline rank CP-SAT may put it on."""
    p, v = mesh.pp, virtual_stages(schedule)
    if p == 1:
        return [0] * num_blocks
    if v > 1:
        return [stage % p for stage in interleaved_block_stages(num_blocks, p, v)]
    return [hi for _, hi in stage_windows(num_blocks, p)]


def _row_ranks(p: int) -> list[int]:
    """j values: p, plus up to ``MAX_PREFIX_ROWS`` of 1…p−1 spread geometrically."""
    if p <= MAX_PREFIX_ROWS + 1:
        return list(range(1, p + 1))
    picks = {int(round(x)) for x in np.geomspace(1, p - 1, MAX_PREFIX_ROWS)}
    return sorted(picks | {p})


def memory_rows(class_of_layer: Sequence[int], anchors: Sequence[int], continues: Sequence[bool], num_blocks: int,
                num_classes: int, mesh: Mesh, schedule: Schedule, prefix: bool = True) -> MemoryRows:
    """Rows of the module docstring (only row p when ``prefix`` is False or p = 1); ``continues`` is
    ``evaluate.chain_flags``: only a layer that continues its block can hold A' < A."""
    p = mesh.pp
    flights = [in_flight(schedule, p, k) for k in range(p)]
    sure = _sure_rank(num_blocks, mesh, schedule)
    ranks = _row_ranks(p) if prefix else [p]
    layer_rank = np.array([sure[a] for a in anchors])  # (L,)
    classes = np.asarray(class_of_layer)  # (L,)
    chain = np.asarray(continues, dtype=bool)  # (L,)
    counts, chained = np.zeros((len(ranks), num_classes)), np.zeros((len(ranks), num_classes))
    for r, j in enumerate(ranks):
        np.add.at(counts[r], classes[layer_rank < j], 1.0)
        np.add.at(chained[r], classes[(layer_rank < j) & chain], 1.0)
    flight = np.array([min(flights[:j]) for j in ranks], dtype=float)
    return MemoryRows(np.array(ranks, dtype=float), flight, counts, chained)


def _padded(options: Sequence[Sequence[Option]], sp: bool, slots: float, p: int, grads_apart: bool = False):
    """(cost, static, activation) arrays (C, S) of the options with ``sp``; cost +inf where padded.

    ``grads_apart`` (pp = m = 1): static without gradients (``Option.static_floor``)."""
    mine = [[o for o in opts if o.strategy.sp == sp] for opts in options]
    if any(not m for m in mine):
        return None
    width = max(len(m) for m in mine)
    cost = np.full((len(mine), width), np.inf)
    static, act, chain = (np.zeros((len(mine), width)) for _ in range(3))
    for c, opts in enumerate(mine):
        cost[c, :len(opts)] = [(slots * o.time_s + o.tail_s) / p for o in opts]
        static[c, :len(opts)] = [o.static_floor(grads_apart) for o in opts]
        act[c, :len(opts)] = [o.activation_bytes for o in opts]
        chain[c, :len(opts)] = [min(o.activation_bytes, o.chain_bytes) for o in opts]
    return cost, static, act, chain


def _build_need(options: Sequence[Sequence[Option]], rows: MemoryRows, resident_attr: str = "build_resident_bytes",
                transient_attr: str = "build_transient_bytes") -> np.ndarray:
    """(R,) smallest left side of the summed build rows of ranks ``0…j−1`` (module docstring); with the
    optimizer step's attributes, of its rows (``Σ O + max Y``, the same shape)."""
    resident = np.array([min(getattr(o, resident_attr) for o in opts) for opts in options])  # (C,)
    transient = np.array([min(getattr(o, transient_attr) for o in opts) for opts in options])  # (C,)
    return rows.counts @ resident + np.where(rows.counts > 0, transient[None, :], 0.0).max(axis=1)


def table_bounds(options: Sequence[Sequence[Option]], layer_counts: np.ndarray, rows: MemoryRows,
                 mesh: Mesh, schedule: Schedule, cap_bytes: float) -> tuple[float, float]:
    """(step-time lower bound, per-rank memory lower bound) of the module docstring.

    options: per class, the dominance-pruned options; layer_counts: (C,) n_c.
    """
    p = mesh.pp
    slots = schedule.num_micro_batches + (p - 1) / virtual_stages(schedule)
    min_buffer = np.array([min(o.buffer_bytes for o in opts) for opts in options])  # (C,)
    min_gathered = np.array([min(o.gathered_bytes for o in opts) for opts in options])  # (C,)
    buffers = np.maximum(np.where(rows.counts > 0, min_buffer[None, :], 0.0).max(axis=1),  # (R,)
                         gather_copies(schedule.prefetch) * np.where(rows.counts > 0, min_gathered[None, :], 0.0).max(axis=1))
    if p == 1:  # one stage: the timeline rows (memory.step_peak_bytes) are ≥ Σ S_floor + ΣA, not ≥ that + buffers
        buffers = np.zeros_like(buffers)
    time_lb, mem_lb = math.inf, math.inf
    for sp in (False, True):
        padded = _padded(options, sp, slots, p, p == 1 and schedule.num_micro_batches == 1)
        if padded is None:
            continue
        cost, static, act, chain = padded
        weighted = rows.weighted(static, act, chain)  # (R, C, S)
        need = np.where(np.isfinite(cost)[None], weighted, np.inf).min(axis=2).sum(axis=1) + buffers  # (R,)
        mem_lb = min(mem_lb, float(np.max(need / rows.ranks)))
        base = float(layer_counts @ cost.min(axis=1))
        lam = LAMBDA_GRID[None, :] * (max(base, 1e-30) / np.maximum(need, 1.0))[:, None]  # (R, Λ)
        value = (layer_counts[None, None, :, None] * cost[None, None]
                 + lam[:, :, None, None] * weighted[:, None])  # (R, Λ, C, S)
        dual = value.min(axis=3).sum(axis=2) + lam * (buffers - rows.ranks * cap_bytes)[:, None]  # (R, Λ)
        time_lb = min(time_lb, float(dual.max()))
    if math.isfinite(mem_lb):
        optimizer_step = _build_need(options, rows, "optimizer_step_bytes", "step_transient_bytes")
        mem_lb = max(mem_lb, float(np.max(_build_need(options, rows) / rows.ranks)),
                     float(np.max(optimizer_step / rows.ranks)))
    return time_lb, mem_lb
