"""Training curves from a PPO metrics file (JSON lines written by ``runtime/metrics.py``).

``plot_metrics(jsonl_path, out_png, smooth=0.6)`` draws one panel per curve — reward, KL (k1), entropy,
value loss, response length, tokens/s — against ``step`` with matplotlib's Agg backend (no display
needed). Keys missing from the file leave their panel empty with a note, so partial logs still plot.
``plot_main(args)`` is the body of ``autoshard plot METRICS.jsonl [-o OUT.png] [--smooth S]``.

Each panel draws the raw values faintly, their exponential moving average (``ema``: ``y_t = s·y_{t−1} +
(1 − s)·x_t``, debiased as TensorBoard does, so the first points are not pulled towards 0) as the line, and
the min/max of the raw values over a window of ``1/(1 − s)`` steps around each step as a shaded band.
``--smooth 0`` draws the raw curve alone.

Title: what the run trained, from the run description beside the metrics file (``<stem>.run.json``,
written by rank 0 of ``autoshard ppo``: model, task, world size, mesh, precision;
``runtime.metrics.read_run_info``), else the plan written beside it (``<stem>.plan.json``: model and
world size), else the file name.

Files: the output path is checked (``file_io.check_output_path``: a regular
file or nothing, in a writable directory; missing parents are created) before
the metrics are read, the metrics file is read strictly
(``runtime.metrics.read_metrics``: ``file_io``'s rules, 256 MiB), and the PNG
is written atomically (``file_io.atomic_write``).
"""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path
from typing import Sequence

from autoshard import file_io
from autoshard.errors import AutoshardError
from autoshard.plan import Plan
from autoshard.runtime.metrics import read_metrics, read_run_info

PANELS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("kl/k1", "KL to reference (k1)"),
    ("policy/entropy", "entropy"),
    ("value/loss", "value loss"),
    ("response/length", "response length"),
    ("perf/tokens_per_s", "tokens/s"),
)
DEFAULT_SMOOTH = 0.6


def ema(values: Sequence[float], smooth: float) -> list[float]:
    """Debiased exponential moving average of ``values`` with weight ``smooth`` in [0, 1) (module docstring);
    non-finite values are skipped (the average carries over them)."""
    out, avg, weight = [], 0.0, 0.0
    for x in values:
        if math.isfinite(x):
            avg = smooth * avg + (1.0 - smooth) * x
            weight = smooth * weight + (1.0 - smooth)
        out.append(avg / weight if weight > 0 else float("nan"))
    return out


def min_max_band(values: Sequence[float], smooth: float) -> tuple[list[float], list[float]]:
    """(low, high) per point: min and max of the finite values in a centred window of ``1/(1 − smooth)`` steps."""
    half = max(int(round(1.0 / (1.0 - smooth))) // 2, 0)
    low, high = [], []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - half):i + half + 1] if math.isfinite(v)]
        low.append(min(window) if window else float("nan"))
        high.append(max(window) if window else float("nan"))
    return low, high


def run_title(jsonl_path: str | Path) -> str:
    """The figure's title (module docstring): model · task · ranks (mesh) · precision, or the file name."""
    path = Path(jsonl_path)
    info = read_run_info(path)
    if info:
        ranks = info.get("world_size")
        parts = [str(info[k]) for k in ("model", "task") if k in info]
        if ranks is not None:
            parts.append(f"{ranks} rank{'s' if ranks != 1 else ''}" + (f" ({info['mesh']})" if "mesh" in info else ""))
        parts += [str(info[k]) for k in ("schedule", "precision") if k in info]
        return " · ".join(parts)
    plan_path = path.with_name(f"{path.stem}.plan.json")
    if plan_path.is_file():
        try:
            plan = Plan.load(plan_path)
        except AutoshardError:
            return path.name
        return f"{plan.model_name} · {plan.mesh.world_size} ranks · {plan.precision}"
    return path.name


def check_smooth(value: float) -> float:
    """``value`` when it is a smoothing weight in [0, 1), else ``AutoshardError`` naming the allowed range."""
    if not 0.0 <= value < 1.0:
        raise AutoshardError(f"--smooth {value}: the EMA weight must be in [0, 1): 0 draws the raw curve, "
                             f"0.9 averages over about 10 steps (default {DEFAULT_SMOOTH})")
    return value


def plot_metrics(jsonl_path: str | Path, out_png: str | Path, smooth: float = DEFAULT_SMOOTH) -> Path:
    """Write a 2×3 grid of the ``PANELS`` curves of ``jsonl_path`` to ``out_png``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_smooth(smooth)
    path = Path(jsonl_path)
    file_io.check_output_path(out_png, noun="plot", parents=True)
    rows = read_metrics(path)
    if not rows:
        raise AutoshardError(f"metrics file {str(path)!r} has no rows; run at least one PPO step first")
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(row.get("step", i + 1), row[key]) for i, row in enumerate(rows) if key in row]
        ax.set_title(title)
        ax.set_xlabel("step")
        if points:
            _draw_curve(ax, [p[0] for p in points], [float(p[1]) for p in points], smooth)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, f"no {key!r} in log", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(run_title(path) + (f"   (EMA {smooth:g}, band: min/max)" if smooth > 0 else ""))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return file_io.atomic_write(out_png, png.getvalue(), noun="plot", parents=True)


def _draw_curve(ax: object, steps: list[float], values: list[float], smooth: float) -> None:
    if smooth <= 0:
        ax.plot(steps, values, lw=1.4)
        return
    low, high = min_max_band(values, smooth)
    ax.fill_between(steps, low, high, alpha=0.18, lw=0, label="min/max")
    ax.plot(steps, values, lw=0.8, alpha=0.35, label="raw")
    ax.plot(steps, ema(values, smooth), lw=1.6, label=f"EMA {smooth:g}")


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``autoshard plot`` arguments: METRICS (a .jsonl file), ``-o/--out`` (default: METRICS with .png) and
    ``--smooth``."""
    parser.add_argument("metrics", help="JSON-lines metrics file written by a PPO run")
    parser.add_argument("-o", "--out", default=None, help="output PNG (default: next to the metrics file)")
    parser.add_argument("--smooth", type=float, default=DEFAULT_SMOOTH, metavar="S",
                        help=f"EMA weight in [0, 1) of the drawn line, with a min/max band of the raw values "
                             f"(default {DEFAULT_SMOOTH}; 0: the raw curve alone)")


def plot_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """CLI body: plot ``args.metrics`` to ``args.out``; accepts a parsed namespace or an argv list."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="autoshard plot", description="plot PPO training curves")
        add_plot_arguments(parser)
        args = parser.parse_args(args)
    if not Path(args.metrics).name:  # "", "/", ".": with_suffix below would raise
        raise AutoshardError(f"cannot read metrics file {args.metrics!r}: not a file path; "
                             f"{file_io.METRICS_FILE.hint}")
    smooth = check_smooth(getattr(args, "smooth", DEFAULT_SMOOTH))
    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    print(f"wrote {plot_metrics(args.metrics, out, smooth)}")
    return 0


__all__ = ["DEFAULT_SMOOTH", "PANELS", "add_plot_arguments", "ema", "min_max_band", "plot_main", "plot_metrics",
           "run_title"]
