"""Training curves from a PPO metrics file (JSON lines written by ``runtime/metrics.py``).

``plot_metrics(jsonl_path, out_png)`` draws one panel per curve — reward,
KL (k1), entropy, value loss, response length, tokens/s — against ``step``
with matplotlib's Agg backend (no display needed). Keys missing from the file
leave their panel empty with a note, so partial logs still plot.
``plot_main(args)`` is the body of ``autoshard plot METRICS.jsonl [-o OUT.png]``.

Files: the output path is checked (``file_io.check_output_path``: a regular
file or nothing, in a writable directory; missing parents are created) before
the metrics are read, the metrics file is read strictly
(``runtime.metrics.read_metrics``: ``file_io``'s rules, 256 MiB), and the PNG
is written atomically (``file_io.atomic_write``).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Sequence

from autoshard import file_io
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
            ax.plot(*zip(*points), lw=1.4)
            ax.grid(alpha=0.3)
        else:
            ax.text(0.5, 0.5, f"no {key!r} in log", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(path.name)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return file_io.atomic_write(out_png, png.getvalue(), noun="plot", parents=True)


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
    if not Path(args.metrics).name:  # "", "/", ".": with_suffix below would raise
        raise AutoshardError(f"cannot read metrics file {args.metrics!r}: not a file path; "
                             f"{file_io.METRICS_FILE.hint}")
    out = args.out or str(Path(args.metrics).with_suffix(".png"))
    print(f"wrote {plot_metrics(args.metrics, out)}")
    return 0


__all__ = ["PANELS", "add_plot_arguments", "plot_main", "plot_metrics"]
