"""Where each PPO phase's time goes, from the Chrome traces of ``autoshard ppo --profile``.

    python benchmarks/trace_phases.py RUN.rank0.trace.json [...] [--json OUT]

``PhaseTimer`` marks every phase of the recorded step as a ``ppo::<phase>`` annotation
(``runtime/metrics.py``). Per trace and phase: the wall time of the annotation; on a GPU rank the
device kernels that ran inside it (by their start time), split into collectives (NCCL kernels) and
compute, with the part of the wall no kernel covers ("idle": launch-bound or waiting on the host);
and the CPU operators with the most self time (``--top``). A phase whose device time is mostly
idle is host-bound (eager launches, Python); one whose collectives dominate is communication-bound.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

PREFIX = "ppo::"


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (plain or gzipped JSON)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict[str, Any]], top: int = 5) -> dict[str, dict[str, Any]]:
    """Per phase (in trace order): wall, kernel, collective, compute and idle microseconds, kernel count,
    and the ``top`` CPU operators by self time inside it (module docstring)."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    phases = [e for e in complete if str(e.get("name", "")).startswith(PREFIX)]
    kernels = [e for e in complete if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu_ops = [e for e in complete if e.get("cat") == "cpu_op"]
    out: dict[str, dict[str, Any]] = {}
    for ph in sorted(phases, key=lambda e: e["ts"]):
        name, start, end = ph["name"][len(PREFIX):], ph["ts"], ph["ts"] + ph["dur"]
        inside = [k for k in kernels if start <= k["ts"] < end]
        spans = [(k["ts"], min(k["ts"] + k["dur"], end)) for k in inside]
        comm = [k for k in inside if "nccl" in str(k.get("name", "")).lower()]
        busy = _union(spans)
        ops: dict[str, float] = {}
        for op in cpu_ops:
            if start <= op["ts"] < end and op.get("tid") == ph.get("tid"):
                ops[op["name"]] = ops.get(op["name"], 0.0) + op["dur"]
        row = out.setdefault(name, {"wall_us": 0.0, "kernels": 0, "kernel_us": 0.0, "collective_us": 0.0,
                                    "compute_us": 0.0, "idle_us": 0.0, "cpu_ops": {}})
        row["wall_us"] += ph["dur"]
        row["kernels"] += len(inside)
        row["kernel_us"] += sum(k["dur"] for k in inside)
        row["collective_us"] += sum(k["dur"] for k in comm)
        row["compute_us"] += sum(k["dur"] for k in inside) - sum(k["dur"] for k in comm)
        row["idle_us"] += ph["dur"] - busy if inside else 0.0
        for op, us in ops.items():
            row["cpu_ops"][op] = row["cpu_ops"].get(op, 0.0) + us
    for row in out.values():
        row["cpu_ops"] = dict(sorted(row["cpu_ops"].items(), key=lambda kv: -kv[1])[:top])
    return out


def format_table(name: str, phases: dict[str, dict[str, Any]]) -> str:
    lines = [f"### {name}", "", "| phase | wall ms | kernels | compute ms | collectives ms | device idle ms | top CPU ops (ms, incl. children) |",
             "|---|---|---|---|---|---|---|"]
    for phase, r in phases.items():
        ops = ", ".join(f"{op} {us / 1e3:.1f}" for op, us in r["cpu_ops"].items())
        lines.append(f"| {phase} | {r['wall_us'] / 1e3:.1f} | {r['kernels']} | {r['compute_us'] / 1e3:.1f} | "
                     f"{r['collective_us'] / 1e3:.1f} | {r['idle_us'] / 1e3:.1f} | {ops} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", default=None, help="write {trace: {phase: row}} here")
    args = parser.parse_args(argv)
    result = {}
    for path in args.traces:
        result[path] = summarize(load_trace(path), args.top)
        print(format_table(Path(path).name, result[path]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
