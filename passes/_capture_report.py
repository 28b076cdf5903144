"""Human views of a captured ``ModelGraph``: the layer table and the op-coverage table (rich).

Per-token figures are evaluated at one sequence length (default: the longer
one capture measured at), so the attention terms that grow with ``s`` show:

    GFLOP/token = forward_flops(1, s) / s / 1e9
    saved/token = saved_bytes(1, s) / s        (boundary + interior + interior_seq · s)
"""

from __future__ import annotations

from rich.table import Table

from autoshard.graph import ModelGraph


def _human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _seq_of(graph: ModelGraph, seq_len: int | None) -> int:
    if seq_len is not None:
        return seq_len
    return graph.capture_seq_lens[-1] if graph.capture_seq_lens else 1


def format_layer_table(graph: ModelGraph, seq_len: int | None = None) -> Table:
    """One row per layer: name, kind, block, class, params, forward GFLOP/token and saved bytes/token at ``seq_len``."""
    seq = _seq_of(graph, seq_len)
    table = Table(title=f"{graph.model_name}: {len(graph)} layers, {_human_count(graph.param_count)} params, s={seq}")
    for column in ("#", "layer", "kind", "block", "class"):
        table.add_column(column)
    for column in ("params", "fwd GFLOP/token", "saved/token"):
        table.add_column(column, justify="right")
    for layer in graph:
        table.add_row(
            str(layer.index),
            layer.name,
            layer.kind,
            "" if layer.block is None else str(layer.block),
            layer.class_id,
            _human_count(layer.param_count) + (" (+tied)" if layer.tied_params else ""),
            f"{layer.forward_flops(1, seq) / seq / 1e9:.4f}",
            _human_bytes(layer.saved_bytes(1, seq) / seq),
        )
    return table


def format_coverage(graph: ModelGraph) -> Table:
    """Ops capture priced and ops it saw but could not price (unaccounted first)."""
    coverage = graph.coverage
    total = sum(coverage.counted.values()) + sum(coverage.unaccounted.values())
    unknown = len(coverage.unaccounted)
    table = Table(title=f"{graph.model_name}: op coverage ({unknown} unaccounted op kinds, {total} nodes)")
    table.add_column("op")
    table.add_column("nodes", justify="right")
    table.add_column("status")
    for op, count in sorted(coverage.unaccounted.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(op, str(count), "[bold red]unaccounted[/]")
    for op, count in sorted(coverage.counted.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(op, str(count), "counted")
    return table
