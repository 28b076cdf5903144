"""Training curves from a PPO metrics file (JSON lines written by ``runtime/metrics.py``).

``plot_metrics(jsonl_path, out_png)`` draws one panel per curve — reward,
KL (k1), entropy, value loss, response length, tokens/s — against ``step``
with matplotlib's Agg backend (no display needed). Keys missing from the file
leave their panel empty with a note, so partial logs still plot.
``plot_main(args)`` is the body of ``autoshard plot METRICS.jsonl [-o OUT.png]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from autoshard.errors import AutoshardError

PANELS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("kl/k1", "KL to reference (k1)"),
    ("policy/entropy", "entropy"),
    ("value/loss", "value loss"),
    ("response/length", "response length"),
    ("perf/tokens_per_s", "tokens/s"),
)


def plot_metrics(jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Write a 2×3 grid of the ``PANELS`` curves of ``jsonl_path`` to ``out_png``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autoshard.runtime.metrics import read_metrics

    path = Path(jsonl_path)
    if not path.is_file():
        raise AutoshardError(f"metrics file {str(path)!r} does not exist; pass the JSON-lines file a PPO run wrote")
    rows = read_metrics(path)
    if not rows:
        raise AutoshardError(f"metrics file {str(path)!r} has no rows; run at least one PPO step first")
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(row.get("step", i + 1), row[key]) for i, row in enumerate(rows) if key in row]
        ax.set_title(title)
        ax.set_xlabel("step")
        if points:
            ax.plot(*zip(*points), lw=1.4)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, f"no {key!r} in log", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(path.name)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``autoshard plot`` arguments: METRICS (a .jsonl file) and ``-o/--out`` (default: METRICS with .png)."""
    parser.add_argument("metrics", help="JSON-lines metrics file written by a PPO run")
    parser.add_argument("-o", "--out", default=None, help="output PNG (default: next to the metrics file)")


def plot_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """CLI body: plot ``args.metrics`` to ``args.out``; accepts a parsed namespace or an argv list."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="autoshard plot", description="plot PPO training curves")
        add_plot_arguments(parser)
        args = parser.parse_args(args)
    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    print(f"wrote {plot_metrics(args.metrics, out)}")
    return 0


__all__ = ["PANELS", "add_plot_arguments", "plot_main", "plot_metrics"]
