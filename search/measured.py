"""Measured per-layer times (``autoshard cluster calibrate --model``): lookup and interpolation.

Profile-guided planners (Alpa, Galvatron) time the model's own layers on the
target device rather than trusting FLOP counts; at the sizes where eager
PyTorch runs at 10 % MFU the time of norms, RoPE, casts, attention and the loss
is set by kernel efficiency and dispatch, not by peak FLOP/s. The calibration
probe times each distinct layer of the model (forward, and forward + backward)
at a few micro-batch sizes and tp shards; ``Cluster.with_calibration`` keeps the
samples in ``cluster.calibration`` under flat keys (``sample_key``, defined with ``Cluster``)::

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
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from autoshard.cluster import LAYER_TIME_KEY_PREFIX as KEY_PREFIX
from autoshard.cluster import Cluster
from autoshard.cluster import layer_time_key as sample_key  # the key format is the cluster file's
from autoshard.graph import LayerInfo

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


__all__ = ["KEY_PREFIX", "LayerTime", "interpolate", "layer_signature", "measured_layer_time", "sample_key"]
