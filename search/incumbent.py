r"""A cheap feasible plan per candidate: an upper bound on the optimum before any CP-SAT solve.

Branch and bound prunes a candidate when its lower bound is ≥ the best step
time known, and CP-SAT proves "no plan better than the cutoff" far faster
than it finds and proves an optimum. Both need a good incumbent early; this
module finds one in floating point, without CP-SAT.

For one (mesh, schedule) with dominance-pruned options per class:

    for each global sp and each λ in LAMBDA_GRID:
        choose per class  s_c(λ) = argmin_s  (slots·t_s + tail_s)/p + λ·(S_s + f_max·A_s)
    place blocks on balanced stages (boundary k at round(k·B/p); interleaved: equal chunks)
    evaluate every distinct assignment (``evaluate.evaluate``, exactly the solver objective)
    U = the step of the first assignment (sp = False first, then the smallest λ) whose every rank fits M

λ trades time for memory (the Lagrangian of the table bound in ``solver.py``,
with the most-loaded rank's in-flight count ``f_max`` so the choice is safe
on every stage). U is an upper bound of the candidate's optimum (the
assignment is feasible for the CP-SAT model: same strategies on every stage,
boundaries inside every window), hence of the global optimum; it is only a
bound, never the answer: the plan returned is always a CP-SAT optimum.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autoshard.plan import Mesh, Schedule
from autoshard.search.evaluate import Option, evaluate, interleaved_block_stages, rank_of
from autoshard.search.memory import gather_copies
from autoshard.search.pipeline import in_flight, virtual_stages

LAMBDA_GRID = np.concatenate([[0.0], np.logspace(-3, 3, 25)])  # × (time scale / memory scale)


def balanced_block_stages(num_blocks: int, pp: int, schedule: Schedule) -> list[int]:
    """(Virtual) stage per anchor block: boundary k at round(k·B/p), the centre of the CP-SAT window."""
    v = virtual_stages(schedule)
    if v > 1:
        return interleaved_block_stages(num_blocks, pp, v)
    centres = [round(k * num_blocks / pp) for k in range(1, pp)]
    return [sum(1 for c in centres if b >= c) for b in range(num_blocks)]


def _assignments(options: Sequence[Sequence[Option]], slots: float, pp: int, f_max: float) -> list[tuple[int, ...]]:
    """Distinct per-class option indices over (sp, λ) (module docstring): sp = False first, then
    increasing λ (faster, hungrier assignments first)."""
    out: dict[tuple[int, ...], None] = {}
    for sp in (False, True):
        rows = []
        for opts in options:
            idx = [i for i, o in enumerate(opts) if o.strategy.sp == sp]
            if not idx:
                break
            cost = np.array([(slots * opts[i].time_s + opts[i].tail_s) / pp for i in idx])  # (n_s,)
            mem = np.array([opts[i].static_bytes + f_max * opts[i].activation_bytes for i in idx])  # (n_s,)
            rows.append((np.array(idx), cost, mem))
        else:
            scale = max(sum(c.min() for _, c, _ in rows), 1e-30) / max(sum(m.min() for _, _, m in rows), 1.0)
            lam = LAMBDA_GRID * scale  # (L,)
            picks = np.stack([idx[(cost[None, :] + lam[:, None] * mem[None, :]).argmin(axis=1)]
                              for idx, cost, mem in rows], axis=1)  # (L, C)
            for row in picks:
                out.setdefault(tuple(int(i) for i in row), None)
    return list(out)


def _rank_tables(class_of_layer: Sequence[int], stages: Sequence[int], continues: Sequence[bool], pp: int,
                 schedule: Schedule, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts (P, C): layers of class c on rank k, chained (P, C, C): layers of class c continuing a
    layer of class c' on rank k, indexed [k, c', c])."""
    counts, chained = np.zeros((pp, num_classes)), np.zeros((pp, num_classes, num_classes))
    for i, (c, stage) in enumerate(zip(class_of_layer, stages)):
        k = rank_of(stage, pp, schedule)
        counts[k, c] += 1
        if continues[i]:
            chained[k, class_of_layer[i - 1], c] += 1
    return counts, chained


def _rank_memory(options: Sequence[Sequence[Option]], picks: np.ndarray, counts: np.ndarray, chained: np.ndarray,
                 flight: np.ndarray, prefetch: int) -> np.ndarray:
    """(A, P) per-rank memory screen for each assignment row of ``picks`` (A, C): the largest of the
    order-free step bound (gradients summed with activations; ``memory.step_peak_bytes``' bound, without
    pipeline receive buffers), the optimizer step's and the build peak. A screen, not ``evaluate``: an
    assignment it passes is priced by ``evaluate``, which decides; one it rejects may have fit (one stage's
    timeline is below the bound), which costs the heuristic incumbent only a better candidate."""
    def per_class(attr):  # (A, C)
        return np.array([[getattr(options[c][i], attr) for c, i in enumerate(row)] for row in picks])

    static, act, chain, buf, resident, transient, opt, opt_transient, gathered = (per_class(a) for a in (
        "static_bytes", "activation_bytes", "chain_bytes", "buffer_bytes", "build_resident_bytes",
        "build_transient_bytes", "optimizer_step_bytes", "step_transient_bytes", "gathered_bytes"))
    full = per_class("full_recompute").astype(float)  # (A, C)
    saving = full[:, None, :] * full[:, :, None] * (act - chain)[:, None, :]  # (A, C', C)
    activations = act @ counts.T - np.einsum("kpc,apc->ak", chained, saving)  # (A, P)
    present = counts > 0  # (P, C)
    buffers = np.maximum(np.where(present[None], buf[:, None, :], 0.0).max(axis=2),  # (A, P): memory.live_buffers
                         gather_copies(prefetch) * np.where(present[None], gathered[:, None, :], 0.0).max(axis=2))
    step = static @ counts.T + buffers + flight[None, :] * activations
    build = resident @ counts.T + np.where(present[None], transient[:, None, :], 0.0).max(axis=2)  # (A, P)
    optimizer_step = opt @ counts.T + np.where(present[None], opt_transient[:, None, :], 0.0).max(axis=2)  # (A, P)
    return np.maximum(np.maximum(step, build), optimizer_step)


def upper_bound(options: Sequence[Sequence[Option]], class_of_layer: Sequence[int], anchors: Sequence[int],
                num_blocks: int, continues: Sequence[bool], mesh: Mesh, schedule: Schedule,
                cap_bytes: float) -> float:
    """U of the module docstring (``math.inf`` when no tried assignment fits).

    Memory is screened for all assignments at once from per-rank class counts (``_rank_memory``); only
    assignments that pass are priced by ``evaluate``, which decides (screening tolerance 1e-9 relative).
    """
    pp = mesh.pp
    slots = schedule.num_micro_batches + (pp - 1) / virtual_stages(schedule)
    flight = np.array([in_flight(schedule, pp, k) for k in range(pp)])
    choices = _assignments(options, slots, pp, float(flight.max()))  # per sp, fastest λ first
    if not choices:
        return math.inf
    block_stage = balanced_block_stages(num_blocks, pp, schedule)
    stages = [block_stage[a] for a in anchors]
    counts, chained = _rank_tables(class_of_layer, stages, continues, pp, schedule, len(options))
    memory = _rank_memory(options, np.array(choices), counts, chained, flight, schedule.prefetch)  # (A, P)
    for choice, peak in zip(choices, memory.max(axis=1)):
        if peak > cap_bytes * (1 + 1e-9):
            continue
        layer_options = [options[c][choice[c]] for c in class_of_layer]
        ev = evaluate(layer_options, stages, mesh, schedule, continues)
        if ev.peak_memory_bytes <= cap_bytes:
            return ev.step_s
    return math.inf
