"""Measured per-layer times (``autoshard cluster calibrate --model``): lookup and interpolation.

Profile-guided planners (Alpa, Galvatron) time the model's own layers on the
target device rather than trusting FLOP counts; at the sizes where eager
PyTorch runs at 10 % MFU the time of norms, RoPE, casts, attention and the loss
is set by kernel efficiency and dispatch, not by peak FLOP/s. The calibration
probe times each distinct layer of the model (forward, and forward + backward)
at a few micro-batch sizes and tp shards; ``Cluster.with_calibration`` keeps the
samples in ``cluster.calibration`` under flat keys::

    layer_time|<signature>|<dtype>|tp=<t>|seq=<s>|tokens=<T>|fwd_s     seconds
    layer_time|<signature>|<dtype>|tp=<t>|seq=<s>|tokens=<T>|bwd_s     seconds

``signature`` (``layer_signature``) names a layer's structure: kind, parameter
shapes and tp roles (names relative to the layer), tied parameters, the
shape metadata (heads, hidden, ffn, vocab, experts) and, for an attention that
saves its score tensors (the explicit "math" path), that fact, so SDPA and math
attention of the same shapes are probed and looked up apart. Equal signatures mean the
same computation, so a probe of a one-block model serves every block of the
full one. ``tp`` is the Megatron TP degree the layer was sharded by (q/k/v/up/
gate/head split by output, o/down by input), ``T`` the tokens of one
micro-batch on the rank.

Interpolation: piecewise linear in ``T`` between probed token counts of the
same (signature, dtype, tp, seq); beyond the range the end segment's line is
extended; below ``T_min`` never under ``t(T_min)·T/T_min`` (time does not drop
faster than the work). One probed size: proportional, ``t(T₀)·T/T₀``. No sample for the key:
``None`` and the cost model keeps its analytic terms.

Plan residuals (``benchmarks/plan_probe.py``, calibration key ``plan_residuals``): the layer
probe times layers alone, so whatever the runtime adds around them under a strategy (host
dispatch of collectives and their copy kernels, blocking waits, NCCL kernels spinning for a
late peer) is missing from a prediction; it is large for ZeRO-3, SP and quantized
communication (docs/cost-model.md, "Plan residuals"). The plan probe runs forced plans on
truncated copies of the model (the same blocks, fewer of them: 1 and 3 by default) on the
target machine, and fits ``measured − predicted`` of every run as::

    residual(plan) = c_plan + Σ_key n_key(plan) · r_key        r_key ≥ 0

``n_key`` = the plan's block layers (transformer-block layers: embedding, head and final norm
are the same in every depth and go to the plan's intercept ``c_plan``) whose strategy has
``key``: the strategy's notation (``Z3``, ``DDP·TP·SP``, ``Z3·qW8``) on one mesh and
micro-batch count (``mesh_key``: ``r2s2t1p1c1e1m1``). ``c₀`` = the median ``c_plan`` (free sign),
per step, is what a plan gets. Keys::

    plan_residual|<mesh_key>|<notation>|<dtype>      seconds per block layer per step
    plan_residual_step_s|<dtype>                     c₀, seconds per step

Lookup (``runtime_residual_s``): the exact key; else the larger of the same notation's mean
over the other probed meshes and the largest residual probed on this mesh (on any mesh when
this one was not probed): what was not measured here is priced no cheaper than the worst
measured here, so the search does not prefer a strategy only because nothing measured it
(it did: the first version fell back to the other meshes' mean or to 0, and the search put
``offload``, probed only under TP 4 where its fit was 0, on every norm layer of an HSDP
plan). ``None`` without plan residuals in the calibration.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.cluster import Cluster
from autoshard.graph import LayerInfo
from autoshard.plan import LayerStrategy, Mesh, Schedule

KEY_PREFIX = "layer_time"
_META = ("num_heads", "num_kv_heads", "num_experts", "top_k", "hidden", "ffn_hidden", "vocab")


def layer_signature(layer: LayerInfo) -> str:
    """``"<kind>:<sha256[:10]>"`` of the layer's structure (module docstring); no cost numbers, no dtype."""
    prefix = len(layer.name) + 1
    blob = {
        "kind": layer.kind,
        "params": [(p.name[prefix:], list(p.global_shape), p.tp_role) for p in layer.params],
        "tied": [name.rsplit(".", 1)[-1] for name in layer.tied_params],
        "meta": [getattr(layer, f) for f in _META],
    }
    if layer.saved_interior_per_token_seq > 0:  # an explicit (math) attention keeps its scores: not SDPA's kernel
        blob["scores_saved"] = True
    return f"{layer.kind}:{hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:10]}"


def sample_key(signature: str, dtype: str, tp: int, seq_len: int, tokens: int, field: str) -> str:
    """The flat ``cluster.calibration`` key of one probed number (module docstring)."""
    return f"{KEY_PREFIX}|{signature}|{dtype}|tp={tp}|seq={seq_len}|tokens={tokens}|{field}"


@dataclass(frozen=True)
class LayerTime:
    """Measured forward and backward seconds of one micro-batch of one layer."""

    fwd_s: float
    bwd_s: float


def _parse(key: str) -> tuple[tuple[str, str, int, int], int, str] | None:
    parts = key.split("|")
    if len(parts) != 7 or parts[0] != KEY_PREFIX:
        return None
    _, signature, dtype, tp, seq, tokens, field = parts
    return (signature, dtype, int(tp[3:]), int(seq[4:])), int(tokens[7:]), field


@functools.lru_cache(maxsize=64)
def _tables(cluster: Cluster) -> dict[tuple[str, str, int, int], tuple[tuple[int, float, float], ...]]:
    """(signature, dtype, tp, seq) → sorted ((tokens, fwd_s, bwd_s), …) from ``cluster.calibration``."""
    raw: dict[tuple, dict[int, dict[str, float]]] = {}
    for key, value in cluster.calibration.items():
        parsed = _parse(key) if key.startswith(KEY_PREFIX) else None
        if parsed is not None:
            group, tokens, field = parsed
            raw.setdefault(group, {}).setdefault(tokens, {})[field] = float(value)
    return {group: tuple(sorted((t, v["fwd_s"], v["bwd_s"]) for t, v in by_tokens.items()
                                if "fwd_s" in v and "bwd_s" in v))
            for group, by_tokens in raw.items()}


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear ``y(x)`` through sorted ``points`` (module docstring: extension and floor)."""
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * x / x0
    i = next((k for k in range(1, len(points) - 1) if x <= points[k][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    first_x, first_y = points[0]
    return max(y, first_y * x / first_x) if x < first_x else y


def measured_layer_time(layer: LayerInfo, cluster: Cluster, dtype: str, tp: int, seq_len: int,
                        tokens: float) -> LayerTime | None:
    """Interpolated ``LayerTime`` of ``layer`` at ``tokens`` tokens, or ``None`` when not probed."""
    if not any(k.startswith(KEY_PREFIX) for k in cluster.calibration):
        return None
    samples = _tables(cluster).get((layer_signature(layer), dtype, tp, seq_len))
    if not samples:
        return None
    fwd = interpolate(tuple((t, f) for t, f, _ in samples), tokens)
    bwd = interpolate(tuple((t, b) for t, _, b in samples), tokens)
    return LayerTime(max(fwd, 0.0), max(bwd, 0.0))


# ---- plan residuals -------------------------------------------------------------------------

RESIDUAL_PREFIX = "plan_residual"
RESIDUAL_STEP_PREFIX = "plan_residual_step_s"


def mesh_key(mesh: Mesh, schedule: Schedule) -> str:
    """``r<dp_replicate>s<dp_shard>t<tp>p<pp>c<cp>e<ep>m<micro-batches>``: the mesh part of a residual key."""
    return (f"r{mesh.dp_replicate}s{mesh.dp_shard}t{mesh.tp}p{mesh.pp}c{mesh.cp}e{mesh.ep}"
            f"m{schedule.num_micro_batches}")


def residual_key(mesh: str, notation: str, dtype: str) -> str:
    """The flat ``cluster.calibration`` key of one fitted residual (module docstring)."""
    return f"{RESIDUAL_PREFIX}|{mesh}|{notation}|{dtype}"


def residual_step_key(dtype: str) -> str:
    return f"{RESIDUAL_STEP_PREFIX}|{dtype}"


@functools.lru_cache(maxsize=64)
def _residual_tables(cluster: Cluster) -> dict[tuple[str, str], dict[str, float]]:
    """(notation, dtype) → {mesh_key: seconds per block layer per step}."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in cluster.calibration.items():
        parts = key.split("|")
        if len(parts) == 4 and parts[0] == RESIDUAL_PREFIX:
            out.setdefault((parts[2], parts[3]), {})[parts[1]] = float(value)
    return out


def runtime_residual_s(strategy: LayerStrategy, mesh: Mesh, schedule: Schedule, cluster: Cluster,
                       dtype: str) -> float | None:
    """Fitted runtime seconds per step of one block layer under ``strategy`` (lookup: module docstring)."""
    tables = _residual_tables(cluster)
    here = mesh_key(mesh, schedule)
    by_mesh = tables.get((strategy.notation, dtype), {})
    if here in by_mesh:
        return by_mesh[here]
    # not probed here: no cheaper than the worst strategy probed on this mesh (else anywhere), so that
    # the search does not prefer a strategy only because nothing measured it on this mesh
    same_dtype = [m for (_, d), m in tables.items() if d == dtype]
    on_mesh = [m[here] for m in same_dtype if here in m]
    everywhere = [v for m in same_dtype for v in m.values()]
    if not everywhere:
        return None
    worst = max(on_mesh or everywhere)
    return max(sum(by_mesh.values()) / len(by_mesh), worst) if by_mesh else worst


def residual_step_s(cluster: Cluster, dtype: str) -> float:
    """The fitted per-step constant ``c₀`` (0 when the calibration has no plan residuals)."""
    return float(cluster.calibration.get(residual_step_key(dtype), 0.0))


def fit_residuals(rows: Sequence[tuple[str, Mapping[str, int], float]]) -> tuple[float, dict[str, float], dict[str, float]]:
    """``(c₀, {key: r_key}, {plan: c_plan})`` fitting ``residual = c_plan + Σ n_key·r_key``, ``r_key`` ≥ 0.

    ``rows``: per probed run, the plan's name, its block-layer count of each key and
    ``measured − predicted`` seconds. Each plan gets its own intercept ``c_plan`` (its embedding,
    head and per-step costs, which depend on its strategies), so the per-layer ``r_key`` come from
    how a plan's residual grows with depth; ``c₀`` for plans not probed is the median of the
    ``c_plan`` of plans probed at two depths or more. Least squares with non-negativity by
    elimination: solve, pin the most negative ``r_key`` to 0, repeat (exact when at most one
    constraint binds, close otherwise; a probe fits a handful of keys). Keys no row separates get
    the minimum-norm split (``numpy.linalg.lstsq``).
    """
    if not rows:
        raise ValueError("fit_residuals: no probe rows")
    keys = sorted({k for _, counts, _ in rows for k, n in counts.items() if n})
    plans = sorted({plan for plan, _, _ in rows})
    a = np.array([[1.0 if plan == p else 0.0 for p in plans] + [float(counts.get(k, 0)) for k in keys]
                  for plan, counts, _ in rows])
    y = np.array([float(r) for _, _, r in rows])
    free = list(range(len(plans) + len(keys)))
    while True:
        x = np.zeros(len(plans) + len(keys))
        x[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
        negative = [j for j in free if j >= len(plans) and x[j] < 0.0]
        if not negative:
            break
        free.remove(min(negative, key=lambda j: x[j]))
    intercepts = {p: float(x[i]) for i, p in enumerate(plans)}
    depths = {p: sum(1 for plan, _, _ in rows if plan == p) for p in plans}
    steady = [intercepts[p] for p in plans if depths[p] >= 2] or list(intercepts.values())
    return float(np.median(steady)), {k: float(x[len(plans) + i]) for i, k in enumerate(keys)}, intercepts


__all__ = ["KEY_PREFIX", "RESIDUAL_PREFIX", "LayerTime", "fit_residuals", "interpolate", "layer_signature",
           "measured_layer_time", "mesh_key", "residual_key", "residual_step_key", "residual_step_s",
           "runtime_residual_s", "sample_key"]
