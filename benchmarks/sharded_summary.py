"""Summary of ``benchmarks/sharded_session.sh``: one table per (model, world), one row per config.

Layout of a session folder (one or more given; a second call's folder adds its processes)::

    ROOT/<tag>_x<N>/<config>_r<k>/results.json   benchmarks/run.py's file (one config per process)
    ROOT/<tag>_x<N>/<config>_r<k>/proc.json      the shell's record: started (epoch s), rc, wall_s,
                                                 limit_s, profiled, or a status when none was started
    ROOT/<tag>_x<N>/<config>_r<k>.log            the process's output

Per config, over its processes (each process's figure is its median step, slowest rank):

- ``tokens/s``: median over the measured processes (min–max beside it);
- ``MFU``: median (``report.finish_row``: model FLOPs over step time × world × the planning
  cluster's peak);
- ``peak GiB``: the largest ``max_memory_allocated`` (max over ranks, the build included), marked
  ``†`` above ``CARD_GIB`` (an 80 GB H100's 81559 MiB: it would not fit there, e.g. measured on H200s);
- ``GPU idle``: median over the profiled processes of rank 0's ``gpu_idle_ms / span_ms`` in one
  step under ``torch.profiler`` (``run.py --profile``; the span is first to last kernel);
- ``vs best baseline``: tokens/s over the best baseline's (the config not starting with
  ``autoshard`` with the highest median tokens/s); > 1 is faster;
- ``processes``: measured / attempted.

A process without a row (killed at its limit, crashed before writing) is counted as attempted,
with its exit code and the first error its log shows.

    python benchmarks/sharded_summary.py ROOT [ROOT ...] > summary.md
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

GIB = 2**30
CARD_GIB = 81559 * 2**20 / GIB  # an H100 80GB HBM3 as nvidia-smi reports it
# Configs in the order of the session's table; others follow alphabetically.
ORDER = ("autoshard", "fsdp2-compiled", "fsdp2-noreshard-compiled", "fsdp2", "fsdp2-noreshard", "deepspeed-z3",
         "deepspeed-z2", "megatron-tp", "megatron-tp-sp")
ERROR = re.compile(r"^(?:\[rank\d+\]:?\s*)?((?:torch\.)?[\w.]*(?:Error|Exception)\b.*)$", re.M)


def first_error(text: str) -> str | None:
    """The first ``...Error: ...`` / ``...Exception...`` line of a log (a failing rank ends the job first)."""
    found = ERROR.search(text)
    return found.group(1).strip()[:200] if found else None


def load_process(folder: Path) -> dict[str, Any]:
    """The row of ``folder``'s config: run.py's when it wrote one, else what the shell and the log say."""
    config = folder.name.rsplit("_r", 1)[0]
    proc = _json(folder / "proc.json") or {}
    results = _json(folder / "results.json") or {}
    rows = [r for r in results.get("rows", []) if r.get("config") == config]
    row = dict(rows[0]) if rows else {"config": config, "status": proc.get("status") or _lost(folder, proc)}
    row["meta"] = results.get("meta") or {}
    row["proc"] = proc
    return row


def _lost(folder: Path, proc: dict[str, Any]) -> str:
    """Status of a process that wrote no row: exit code, killed at its limit or not, first error."""
    rc, wall = proc.get("rc"), proc.get("wall_s")
    log = folder.parent / f"{folder.name}.log"
    error = first_error(log.read_text(errors="replace")) if log.exists() else None
    if rc is None:
        what = "no row and no exit record"
    elif rc in (124, 137):
        what = f"killed at its {proc.get('limit_s', '?')} s limit"
    else:
        what = f"exit {rc} after {wall} s, no row"
    return f"failed: {what}" + (f": {error}" if error else "")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(roots: list[Path]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``{group: {config: [row per process]}}`` over every root: groups by world size, then in the order
    the session ran them (first start; the model priority order), configs in ``ORDER``."""
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for root in roots:
        for folder in sorted(p for p in root.glob("*/*_r*") if p.is_dir()):
            row = load_process(folder)
            found.setdefault(folder.parent.name, {}).setdefault(row["config"], []).append(row)
    groups = sorted(found, key=lambda g: _group_key(g, found[g]))
    return {g: {c: found[g][c] for c in sorted(found[g], key=_config_key)} for g in groups}


def _group_key(group: str, configs: dict[str, list[dict[str, Any]]]) -> tuple:
    tag, _, world = group.rpartition("_x")
    starts = [r["proc"]["started"] for rows in configs.values() for r in rows if "started" in r["proc"]]
    return (int(world) if world.isdigit() else 0, min(starts, default=float("inf")), tag)


def _config_key(config: str) -> tuple:
    return (ORDER.index(config) if config in ORDER else len(ORDER), config)


def idle_fraction(row: dict[str, Any]) -> float | None:
    """Rank 0's GPU idle time over the profiled step's kernel span (``run.profile_step``), or None."""
    profile = row.get("profile") or {}
    span, idle = profile.get("span_ms"), profile.get("gpu_idle_ms")
    return idle / span if span and idle is not None else None


def config_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and counts of one config's processes (module docstring)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s")]
    tokens = [r["tokens_per_s"] for r in ok]
    mfu = [r["mfu"] for r in ok if r.get("mfu") is not None]
    peaks = [r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes")]
    idle = [f for f in (idle_fraction(r) for r in ok) if f is not None]
    return {"measured": len(ok), "attempted": len(rows),
            "tokens_per_s": statistics.median(tokens) if tokens else None,
            "tokens_min": min(tokens) if tokens else None, "tokens_max": max(tokens) if tokens else None,
            "mfu": statistics.median(mfu) if mfu else None,
            "peak_gib": max(peaks) / GIB if peaks else None,
            "idle": statistics.median(idle) if idle else None, "idle_n": len(idle),
            "plan": next((r.get("plan") for r in ok if r.get("plan")), ""),
            "status": _status(ok, rows)}


def _status(ok: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """``ok``, ``ok; 1 lost: <why>`` when some processes gave no row, or the distinct failures."""
    lost = sorted({r.get("status", "?") for r in rows if r not in ok})
    if not ok:
        return "; ".join(lost)
    return "ok" if not lost else f"ok; {len(rows) - len(ok)} lost: " + "; ".join(lost)


def best_baseline(stats: dict[str, dict[str, Any]]) -> str | None:
    """The baseline (not ``autoshard*``) with the highest median tokens/s, or None."""
    measured = [c for c, s in stats.items() if not c.startswith("autoshard") and s["tokens_per_s"]]
    return max(measured, key=lambda c: stats[c]["tokens_per_s"]) if measured else None


def header(group: str, configs: dict[str, list[dict[str, Any]]]) -> str:
    """What the group's processes ran: model, shape, world and card, planning cluster, torch, dates."""
    metas = [r["meta"] for rows in configs.values() for r in rows if r.get("meta")]
    if not metas:
        return f"## {group}"
    m = metas[0]
    dates = sorted(x.get("date", "") for x in metas)
    cards = sorted({x.get("device_name", "?") for x in metas})
    return (f"## {m.get('model')} on {m.get('world_size')} × {' / '.join(cards)}\n\n"
            f"batch {m.get('global_batch')} × seq {m.get('seq_len')}, {m.get('precision')}, {m.get('steps')} steps "
            f"({m.get('warmup')} warm-up) per process, plans for {m.get('cluster')}, torch {m.get('torch')}, "
            f"{dates[0]} – {dates[-1]}")


def table(group: str, configs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The markdown table of one (model, world) group."""
    stats = {c: config_stats(rows) for c, rows in configs.items()}
    best = best_baseline(stats)
    lines = [header(group, configs), "",
             "| config | plan | tokens/s (median) | min–max | MFU | peak GiB | GPU idle | vs best baseline | "
             "processes | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for config, s in stats.items():
        if s["tokens_per_s"] is None:
            lines.append(f"| {config} | | – | – | – | – | – | – | 0/{s['attempted']} | "
                         f"{_cell(s['status'])} |")
            continue
        ratio = "best baseline" if config == best else (
            f"{s['tokens_per_s'] / stats[best]['tokens_per_s']:.2f}×" if best else "–")
        peak = "–" if s["peak_gib"] is None else f"{s['peak_gib']:.2f}" + (" †" if s["peak_gib"] > CARD_GIB else "")
        idle = "–" if s["idle"] is None else f"{s['idle'] * 100:.1f}%"
        lines.append(f"| {config} | {s['plan']} | {s['tokens_per_s']:,.0f} | {s['tokens_min']:,.0f}–"
                     f"{s['tokens_max']:,.0f} | {_pct(s['mfu'])} | {peak} | {idle} | {ratio} | "
                     f"{s['measured']}/{s['attempted']} | {_cell(s['status'])} |")
    if any(s["peak_gib"] and s["peak_gib"] > CARD_GIB for s in stats.values()):
        lines += ["", f"† above {CARD_GIB:.2f} GiB: would not fit an 80 GB H100."]
    return lines + [""]


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def _cell(text: str) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= 120 else text[:117] + "..."


def markdown(roots: list[Path]) -> str:
    """Every group's table; a line when nothing was found."""
    data = collect(roots)
    if not data:
        return f"no <tag>_x<N>/<config>_r<k>/ folders under {', '.join(map(str, roots))}\n"
    return "\n".join(line for group, configs in data.items() for line in table(group, configs))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(markdown([Path(a) for a in argv]), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
