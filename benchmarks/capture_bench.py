"""Time ``capture_reference`` on five reference models and record what it found.

Each model is built on meta in bf16 and captured whole (every block exported
and measured; nothing replicated). Target: ``llama:70b`` under 60 s on a 2-core
CPU. The first row also pays torch's one-time warm-up (export machinery,
sympy caches), so it is captured once untimed before the timed run.

Per model: wall seconds, layers, layer classes, parameters, export-graph nodes,
unaccounted op kinds, forward GFLOP/token and saved MiB/token (whole model,
micro-batch 1, at the capture's longer sequence), and the per-block saved
bytes against Korthikanti's ``sbh(34 + 5as/h)`` (a ratio; ≠ 1 where the model
differs from the paper's block: RMSNorm in fp32, RoPE, SwiGLU, flash attention).

Writes ``benchmarks/results/capture_<date>.json`` and prints a table.
Run from the repository root: ``.venv/bin/python benchmarks/capture_bench.py [--only SPEC]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the editable install maps autoshard.passes only with the root on sys.path

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoshard.passes.capture import capture_reference  # noqa: E402

SPECS = ("gpt:tiny", "gpt:1.3b", "llama:7b", "llama:70b", "moe:8x7b")
TARGET_S = {"llama:70b": 60.0}


def _korthikanti_ratio(graph, spec: str) -> float | None:
    """Measured saved bytes of block 0 over sbh(34 + 5as/h), at micro-batch 1 and the capture's s2."""
    attn = next((layer for layer in graph if layer.kind == "attention"), None)
    if attn is None or not attn.num_heads:
        return None
    seq, h, a = graph.capture_seq_lens[-1], graph.hidden, attn.num_heads
    block = [layer for layer in graph if layer.block == attn.block]
    measured = sum(layer.saved_bytes(1, seq) for layer in block)
    return measured / (seq * h * (34 + 5 * a * seq / h))


def measure(spec: str) -> dict:
    """Capture ``spec`` once and summarise the graph."""
    start = time.perf_counter()
    graph = capture_reference(spec)
    wall = time.perf_counter() - start
    seq = graph.capture_seq_lens[-1]
    coverage = graph.coverage
    return {
        "spec": spec,
        "wall_s": round(wall, 2),
        "target_s": TARGET_S.get(spec),
        "layers": len(graph),
        "classes": len(graph.classes()),
        "params": graph.param_count,
        "graph_nodes": sum(coverage.counted.values()) + sum(coverage.unaccounted.values()),
        "unaccounted": dict(coverage.unaccounted),
        "seq_lens": list(graph.capture_seq_lens),
        "fwd_gflop_per_token": sum(layer.forward_flops(1, seq) for layer in graph) / seq / 1e9,
        "saved_mib_per_token": sum(layer.saved_bytes(1, seq) for layer in graph) / seq / 2**20,
        "block_saved_over_korthikanti": _korthikanti_ratio(graph, spec),
        "fingerprint": graph.fingerprint(),
    }


def run(specs: tuple[str, ...]) -> list[dict]:
    """Warm up once, then capture every spec in order."""
    capture_reference("gpt:tiny")  # one-time torch warm-up, untimed
    return [measure(spec) for spec in specs]


def _table(rows: list[dict]) -> Table:
    table = Table(title="capture_reference (meta, bf16)")
    for column in ("model", "wall s", "target s", "layers", "classes", "params", "nodes", "unaccounted",
                   "GFLOP/token", "saved MiB/token", "block/Korthikanti"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        ratio = r["block_saved_over_korthikanti"]
        table.add_row(
            r["spec"], f"{r['wall_s']:.2f}", "" if r["target_s"] is None else f"{r['target_s']:.0f}",
            str(r["layers"]), str(r["classes"]), f"{r['params'] / 1e9:.3f}B", str(r["graph_nodes"]),
            str(sum(r["unaccounted"].values())), f"{r['fwd_gflop_per_token']:.3f}",
            f"{r['saved_mib_per_token']:.3f}", "" if ratio is None else f"{ratio:.3f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SPECS, help="capture one model")
    args = parser.parse_args()
    rows = run((args.only,) if args.only else SPECS)
    Console(width=160).print(_table(rows))
    out = ROOT / "benchmarks" / "results" / f"capture_{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "results": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    slow = [r["spec"] for r in rows if r["target_s"] is not None and r["wall_s"] > r["target_s"]]
    if slow:
        sys.exit(f"over target: {', '.join(slow)}")


if __name__ == "__main__":
    main()
