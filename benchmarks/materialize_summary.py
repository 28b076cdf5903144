"""Markdown table of ``benchmarks/materialize_bench.py`` rows (one JSON object per line).

    python benchmarks/materialize_summary.py OUT/materialize.jsonl [MORE.jsonl ...]

One table per (card, world size): a row per run in file order with the plan, predicted and
measured peaks (GiB; measured = max over ranks of ``max_memory_allocated``, build and steps
counted apart; on the CPU the build peak is the runtime's live-bytes count, ``report``), the step time (median and min–max over the steps after warm-up), the build's wall
time, the first and last loss and the status. A line that is not JSON is reported and skipped;
a run that did not finish (the driver's ``killed`` rows) shows its status with empty cells.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COLUMNS = ("model", "config", "weights", "plan", "pred peak", "pred build", "build peak", "step peak",
           "step ms (min–max)", "build s", "loss first → last", "status")


def read_rows(paths: Iterable[str | Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every JSON object of ``paths`` and a note for each line that is not one."""
    rows, notes = [], []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                notes.append(f"{path}:{number}: not JSON ({err.msg}), skipped")
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                notes.append(f"{path}:{number}: not a JSON object, skipped")
    return rows, notes


def _num(value: Any, spec: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "–"
    return format(value, spec)


def _step(row: dict[str, Any]) -> str:
    median = _num(row.get("step_ms_median"), ".1f")
    if median == "–":
        return median
    return f"{median} ({_num(row.get('step_ms_min'), '.1f')}–{_num(row.get('step_ms_max'), '.1f')})"


def _loss(row: dict[str, Any]) -> str:
    first, last = _num(row.get("loss_first"), ".3f"), _num(row.get("loss_last"), ".3f")
    return "–" if first == "–" else f"{first} → {last}"


def _status(row: dict[str, Any]) -> str:
    status = str(row.get("status", "?"))
    return (status if len(status) <= 60 else status[:57] + "...").replace("|", "/")


def _build_peak(row: dict[str, Any]) -> Any:
    measured = row.get("build_peak_gib")
    return measured if measured is not None else (row.get("report") or {}).get("build_peak_gib")


def cells(row: dict[str, Any]) -> list[str]:
    """One table row's cells (``COLUMNS``)."""
    weights = str(row.get("weights", "–")) + (" (reused)" if row.get("weights_reused") else "")
    return [str(row.get("model", "?")), str(row.get("config", "?")), weights, str(row.get("plan") or "–"),
            _num(row.get("predicted_peak_gib"), ".2f"), _num(row.get("predicted_build_peak_gib"), ".2f"),
            _num(_build_peak(row), ".2f"), _num(row.get("step_peak_gib"), ".2f"), _step(row),
            _num(row.get("build_s"), ".1f"), _loss(row), _status(row)]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The tables (module docstring), one per (card, world size), in order of first appearance."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    card = "?"
    for row in rows:  # a row without a card (the driver's killed rows) ran on the previous row's
        card = str(row.get("card") or card)
        groups.setdefault((card, row.get("world_size", "?")), []).append(row)
    out: list[str] = []
    for (card, world), members in groups.items():
        first = members[0]
        out += [f"{world} × {card}, torch {first.get('torch', '?')}, transformers {first.get('transformers') or '–'}, "
                f"seq {first.get('seq', '?')}, global batch {first.get('batch', '?')}, {first.get('steps', '?')} steps "
                f"({first.get('warmup', '?')} warm-up), {first.get('date', '?')}; memory in GiB", "",
                "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(cells(row)) + " |" for row in members]
        out.append("")
    return "\n".join(out) if out else "no rows\n"


def main(argv: list[str] | None = None) -> int:
    """Print the tables of the files named in ``argv``; 2 when none is given or one is missing."""
    paths = sys.argv[1:] if argv is None else argv
    missing = [p for p in paths if not Path(p).is_file()]
    if not paths or missing:
        print(f"usage: materialize_summary.py FILE.jsonl [...]; missing: {missing}" if missing else
              "usage: materialize_summary.py FILE.jsonl [...]", file=sys.stderr)
        return 2
    rows, notes = read_rows(paths)
    print(markdown(rows), end="")
    for note in notes:
        print(f"- {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
