"""Summary of ``benchmarks/isolated.sh``: one table per model, one row per config.

Each process (one config, one round) gives its median step (slowest rank); a config's
figure is the median over its rounds, with the rounds' min–max next to it. "vs best baseline"
divides the best baseline's figure by the config's (> 1: faster). Baselines are every
config not starting with ``autoshard``.

    python benchmarks/isolated_summary.py OUT/iso > summary.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def collect(root: Path) -> dict[str, dict[str, list[dict]]]:
    """``{model_tag: {config: [row per round]}}`` from ``<tag>/<config>_r<k>/results.json``."""
    out: dict[str, dict[str, list[dict]]] = {}
    for path in sorted(root.glob("*/*_r*/results.json")):
        tag, config = path.parent.parent.name, path.parent.name.rsplit("_r", 1)[0]
        rows = [r for r in json.loads(path.read_text())["rows"] if r["config"] == config]
        out.setdefault(tag, {}).setdefault(config, []).extend(rows)
    return out


def table(tag: str, configs: dict[str, list[dict]]) -> list[str]:
    ok = {c: [r for r in rows if r["status"] == "ok"] for c, rows in configs.items()}
    med = {c: statistics.median(r["median_step_s"] for r in rows) for c, rows in ok.items() if rows}
    baselines = [c for c in med if not c.startswith("autoshard")]
    best = min(baselines, key=med.get) if baselines else None
    lines = [f"## {tag}", "", "| config | plan | rounds | step ms (median) | min–max ms | peak GiB | vs best baseline |",
             "|---|---|---|---|---|---|---|"]
    for config, rows in configs.items():
        if config not in med:
            status = ", ".join(sorted({r["status"] for r in rows})) or "no result"
            lines.append(f"| {config} | | {len(rows)} | – | – | – | {status} |")
            continue
        steps = [r["median_step_s"] * 1e3 for r in ok[config]]
        peaks = [r["peak_memory_bytes"] for r in ok[config] if r.get("peak_memory_bytes")]
        peak = f"{max(peaks) / 2**30:.2f}" if peaks else "–"  # none on the CPU
        ratio = "best baseline" if config == best else (f"{med[best] / med[config]:.2f}×" if best else "–")
        lines.append(f"| {config} | {ok[config][0].get('plan') or ''} | {len(steps)} | {med[config] * 1e3:.1f} | "
                     f"{min(steps):.1f}–{max(steps):.1f} | {peak} | {ratio} |")
    return lines + [""]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    data = collect(Path(argv[0]))
    if not data:
        print(f"no */*_r*/results.json under {argv[0]}", file=sys.stderr)
        return 1
    for tag, configs in data.items():
        print("\n".join(table(tag, configs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
