"""The HTML page of ``autoshard report``: inline SVG and CSS, no script, nothing fetched.

``render_html(report)`` draws four figures from a ``report.Report``:

* ``#strategy-map``: layers left to right, one row per decision (state, TP, SP, EP, recompute, stage); each
  cell a ``<rect>`` with a ``<title>`` tooltip; the state row's cells carry ``class="layer"`` and
  ``data-layer`` (one per layer). A legend per row.
* ``#memory``: per pipeline rank, the bytes held over the step, stacked by kind (``report_model.MEMORY_KINDS``;
  one ``<path class="mem-area">`` per kind with ``data-samples``), the build peak as a bar on the left, the
  predicted peak as a line.
* ``#timeline``: per pipeline rank, one lane per stream (``report_model.STREAMS``), one
  ``<rect class="span">`` per span, coloured by category.
* ``#measured`` (with ``--measured``): the measured trace's busiest lanes on the same kind of axis.

Every value is escaped (``html.escape``); layer names come from the plan file.
"""

from __future__ import annotations

import html
from typing import Any, Iterable, Sequence

from autoshard.report_model import MEMORY_KINDS, STREAMS

WIDTH = 1100
LEFT = 150  # room for the row labels
PLOT_W = WIDTH - LEFT - 20
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
STRATEGY_ROWS: tuple[tuple[str, dict[str, str]], ...] = (
    ("state", {"replicate": "#4e79a7", "zero1": "#76b7b2", "zero2": "#59a14f", "zero3": "#f28e2b",
               "offload": "#e15759"}),
    ("tp", {"none": "#d9d9d9", "megatron": "#b07aa1"}),
    ("sp", {"False": "#d9d9d9", "True": "#edc948"}),
    ("ep", {"False": "#d9d9d9", "True": "#9c755f"}),
    ("recompute", {"none": "#d9d9d9", "selective": "#ff9da7", "full": "#e15759"}),
)
ON_OFF = {"False": "off", "True": "on"}  # legend words for the boolean rows (sp, ep)
MEMORY_COLORS = dict(zip(MEMORY_KINDS, ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1")))
CATEGORY_COLORS = {"forward": "#4e79a7", "backward": "#59a14f", "tp comm": "#b07aa1", "dp comm": "#f28e2b",
                   "dp comm (exposed)": "#e15759", "pp send": "#76b7b2", "optimizer": "#9c755f",
                   "bubble": "#e8e8e8"}
CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1160px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 6px; }
.summary { color: #444; margin: 2px 0; } .note { color: #666; font-size: 12px; margin: 2px 0; }
svg { display: block; margin: 6px 0; } svg text { font: 11px system-ui, sans-serif; fill: #333; }
.legend span { display: inline-block; margin-right: 14px; font-size: 12px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 2px 10px 2px 0; text-align: left; }
"""


def esc(value: Any) -> str:
    """``value`` as HTML text (quotes escaped too: safe inside attributes)."""
    return html.escape(str(value), quote=True)


def fmt_seconds(seconds: float) -> str:
    """``0.0123`` → ``12.3 ms``."""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_bytes(nbytes: float) -> str:
    """``3_221_225_472`` → ``3.00 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def legend(items: Iterable[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{esc(n)}</span>'
                                           for n, c in items) + "</div>"


def render_html(report: Any) -> str:
    """The whole page (module docstring)."""
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(report.title)}</title>",
             f"<style>{CSS}</style></head><body>", f"<h1>{esc(report.title)}</h1>"]
    parts += [f'<p class="summary">{esc(line)}</p>' for line in report.summary]
    parts += [f'<p class="note">caveat: {esc(c)}</p>' for c in report.plan.predictions.caveats]
    parts.append("<h2>Strategy per layer</h2>")
    parts.append(strategy_map(report.plan, report.layer_names))
    parts.append("<h2>Predicted memory per rank over the step</h2>")
    parts.append(memory_chart(report.layout, report.plan))
    parts.append("<h2>Predicted step timeline per rank</h2>")
    parts.append(timeline_chart(report.layout))
    parts += [f'<p class="note">{esc(n)}</p>' for n in report.layout.notes]
    if report.measured is not None:
        parts.append("<h2>Measured step</h2>")
        parts.append(measured_chart(report.measured, report.layout.step_s))
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --------------------------------------------------------------------------------- strategy map
def strategy_map(plan: Any, layer_names: Sequence[str]) -> str:
    """Layers × decisions, coloured, with a legend per row (module docstring)."""
    by_name = {s.layer: s for s in plan.layers}
    strategies = [by_name[n] for n in layer_names]
    n = len(strategies)
    cell, row_h = PLOT_W / max(n, 1), 20
    stage_colors = {s: PALETTE[s % len(PALETTE)] for s in sorted({x.stage for x in strategies})}
    rows = [*STRATEGY_ROWS, ("stage", {str(s): c for s, c in stage_colors.items()})]
    height = row_h * len(rows) + 50
    out = [f'<svg id="strategy-map" width="{WIDTH}" height="{height}" data-layers="{n}">']
    for r, (field, colors) in enumerate(rows):
        y = 4 + r * row_h
        out.append(f'<text x="{LEFT - 8}" y="{y + 14}" text-anchor="end">{esc(field)}</text>')
        for i, s in enumerate(strategies):
            value = str(getattr(s, field))
            klass = "layer" if field == "state" else "layer-cell"
            out.append(f'<rect class="{klass}" data-layer="{esc(s.layer)}" data-{field}="{esc(value)}" '
                       f'x="{LEFT + i * cell:.2f}" y="{y}" width="{max(cell - 1, 0.5):.2f}" height="{row_h - 3}" '
                       f'fill="{colors.get(value, "#999")}"><title>{esc(s.layer)}: {esc(s.notation or "DDP")}, '
                       f'stage {s.stage}</title></rect>')
    y = 4 + len(rows) * row_h + 14
    for position, i in enumerate(_tick_indices(n, 7)):
        dy = 13 * (position % 2)  # alternate rows: neighbouring names do not overlap
        out.append(f'<text x="{LEFT + (i + 0.5) * cell:.1f}" y="{y + dy}" text-anchor="middle">'
                   f'{esc(layer_names[i])}</text>')
    out.append("</svg>")
    for field, colors in rows:
        used = {str(getattr(s, field)) for s in strategies}
        out.append(legend((f"{field} {ON_OFF.get(v, v)}", c) for v, c in colors.items() if v in used))
    return "\n".join(out)


def _tick_indices(n: int, count: int) -> list[int]:
    if n <= count:
        return list(range(n))
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


# --------------------------------------------------------------------------------------- memory
def memory_chart(layout: Any, plan: Any) -> str:
    """Per rank: the build peak as a bar, the step as stacked step-areas by kind (module docstring)."""
    predicted_peaks = list(plan.predictions.memory_by_stage)
    top = max([r.peak_bytes for r in layout.ranks] + predicted_peaks) or 1.0
    panel_h, gap = 120, 34
    height = len(layout.ranks) * (panel_h + gap) + 24
    bar_w, x0, width = 30, LEFT, PLOT_W  # the step shares the timeline's x axis; the build bar sits left of it
    scale_x = width / (layout.step_s or 1.0)
    out = [f'<svg id="memory" width="{WIDTH}" height="{height}">']
    for n, rank in enumerate(layout.ranks):
        y0 = 8 + n * (panel_h + gap) + panel_h  # baseline
        predicted = plan.predictions.memory_by_stage[rank.rank] if rank.rank < len(
            plan.predictions.memory_by_stage) else rank.peak_bytes
        out.append(f'<g class="memory-rank" data-rank="{rank.rank}" data-peak="{rank.peak_bytes:.0f}" '
                   f'data-predicted-peak="{predicted}">')
        out.append(f'<text x="{LEFT - bar_w - 14}" y="{y0 - panel_h / 2}" text-anchor="end">pp rank {rank.rank}</text>')
        out.append(f'<text x="{LEFT - bar_w - 14}" y="{y0 - panel_h / 2 + 14}" text-anchor="end">peak '
                   f'{esc(fmt_bytes(rank.peak_bytes))}</text>')
        below = 0.0
        for k, kind in enumerate(MEMORY_KINDS):  # build bar
            h = rank.build_bytes[k] / top * panel_h
            out.append(f'<rect class="mem-build" data-kind="{kind}" x="{LEFT - bar_w - 6}" y="{y0 - below - h:.2f}" '
                       f'width="{bar_w}" height="{h:.2f}" fill="{MEMORY_COLORS[kind]}"><title>build: {kind} '
                       f'{esc(fmt_bytes(rank.build_bytes[k]))}</title></rect>')
            below += h
        out.append(f'<text x="{LEFT - bar_w / 2 - 6}" y="{y0 + 12}" text-anchor="middle">build</text>')
        out += _stacked_areas(rank.memory, layout.step_s, x0, y0, scale_x, panel_h / top)
        y_peak = y0 - predicted / top * panel_h
        out.append(f'<line x1="{LEFT - bar_w - 6}" x2="{x0 + width}" y1="{y_peak:.2f}" y2="{y_peak:.2f}" stroke="#222" '
                   f'stroke-dasharray="4 3"><title>predicted peak {esc(fmt_bytes(predicted))}</title></line>')
        out.append(_time_axis(x0, y0, width, layout.step_s))
        out.append("</g>")
    out.append("</svg>")
    out.append(legend([(k, MEMORY_COLORS[k]) for k in MEMORY_KINDS] + [("predicted peak (dashed)", "#222")]))
    return "\n".join(out)


def _stacked_areas(samples: Sequence[Any], end_s: float, x0: float, y0: float, sx: float, sy: float) -> list[str]:
    """One closed step-path per kind between the running sums below and above it."""
    out = []
    times = [s.t_s for s in samples] + [end_s]
    below = [0.0] * len(samples)
    for k, kind in enumerate(MEMORY_KINDS):
        above = [b + s.bytes_by_kind[k] for b, s in zip(below, samples)]
        upper = [(x0 + times[i] * sx, y0 - above[i] * sy, x0 + times[i + 1] * sx) for i in range(len(samples))]
        lower = [(x0 + times[i] * sx, y0 - below[i] * sy, x0 + times[i + 1] * sx) for i in range(len(samples))]
        d = "M" + " L".join(f"{a:.1f},{y:.1f} {b:.1f},{y:.1f}" for a, y, b in upper)
        d += " L" + " L".join(f"{b:.1f},{y:.1f} {a:.1f},{y:.1f}" for a, y, b in reversed(lower)) + " Z"
        peak = max((s.bytes_by_kind[k] for s in samples), default=0.0)
        out.append(f'<path class="mem-area" data-kind="{kind}" data-samples="{len(samples)}" '
                   f'data-max="{peak:.0f}" d="{d}" fill="{MEMORY_COLORS[kind]}" stroke="none">'
                   f'<title>{kind}: up to {esc(fmt_bytes(peak))}</title></path>')
        below = above
    return out


def _time_axis(x0: float, y: float, width: float, end_s: float, ticks: int = 6) -> str:
    parts = [f'<line x1="{x0}" x2="{x0 + width}" y1="{y}" y2="{y}" stroke="#888"/>']
    for i in range(ticks + 1):
        t = end_s * i / ticks
        x = x0 + width * i / ticks
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="#888"/>'
                     f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle">{esc(fmt_seconds(t))}</text>')
    return "".join(parts)


# ------------------------------------------------------------------------------------- timeline
def timeline_chart(layout: Any) -> str:
    """One lane per (rank, stream), one rect per span (module docstring)."""
    lane_h, gap = 16, 26
    per_rank = len(STREAMS) * lane_h + gap
    height = len(layout.ranks) * per_rank + 10
    scale = PLOT_W / (layout.step_s or 1.0)
    out = [f'<svg id="timeline" width="{WIDTH}" height="{height}">']
    for n, rank in enumerate(layout.ranks):
        y0 = 4 + n * per_rank
        out.append(f'<g class="timeline-rank" data-rank="{rank.rank}" data-end="{rank.end_s:.9f}">')
        lanes = {stream: y0 + i * lane_h for i, stream in enumerate(STREAMS)}
        for stream, y in lanes.items():
            out.append(f'<text x="{LEFT - 8}" y="{y + 12}" text-anchor="end">rank {rank.rank} {esc(stream)}</text>')
            out.append(f'<rect x="{LEFT}" y="{y}" width="{PLOT_W}" height="{lane_h - 2}" fill="#fafafa"/>')
        for span in rank.spans:
            out.append(f'<rect class="span" data-stream="{esc(span.stream)}" data-category="{esc(span.category)}" '
                       f'x="{LEFT + span.start_s * scale:.2f}" y="{lanes[span.stream]}" '
                       f'width="{max(span.dur_s * scale, 0.3):.2f}" height="{lane_h - 2}" '
                       f'fill="{CATEGORY_COLORS.get(span.category, "#999")}"><title>{esc(span.name)}: '
                       f'{esc(fmt_seconds(span.dur_s))} at {esc(fmt_seconds(span.start_s))}</title></rect>')
        out.append("</g>")
    out.append(_time_axis(LEFT, height - 24, PLOT_W, layout.step_s).replace("<line", "<line", 1))
    out.append("</svg>")
    out.append(legend(CATEGORY_COLORS.items()))
    return "\n".join(out)


# ------------------------------------------------------------------------------------- measured
def measured_chart(measured: Any, predicted_s: float) -> str:
    """The measured trace's lanes beside the prediction: its step length, time per category, the lanes."""
    lane_h = 14
    height = len(measured.lanes) * lane_h + 34
    span_s = measured.end_s - measured.start_s or 1e-9
    scale = PLOT_W / span_s
    rows = "".join(f"<tr><td>{esc(cat)}</td><td>{esc(fmt_seconds(sec))}</td></tr>"
                   for cat, sec in measured.seconds_by_category())
    out = [f'<p class="summary">{esc(measured.source)}: measured {esc(fmt_seconds(span_s))} '
           f'(predicted step {esc(fmt_seconds(predicted_s))}, {span_s / predicted_s if predicted_s else 0:.2f}×)</p>',
           f"<table><tr><th>busy time by category</th><th></th></tr>{rows}</table>",
           f'<svg id="measured" width="{WIDTH}" height="{height}" data-events="{measured.event_count}">']
    for i, lane in enumerate(measured.lanes):
        y = 4 + i * lane_h
        out.append(f'<text x="{LEFT - 8}" y="{y + 11}" text-anchor="end">{esc(lane.label[:24])}</text>')
        for event in lane.events:
            color = CATEGORY_COLORS["dp comm"] if event.category == "communication" else (
                CATEGORY_COLORS["forward"] if event.category == "compute" else "#bab0ac")
            out.append(f'<rect class="measured-span" x="{LEFT + (event.start_s - measured.start_s) * scale:.2f}" '
                       f'y="{y}" width="{max(event.dur_s * scale, 0.3):.2f}" height="{lane_h - 2}" fill="{color}">'
                       f'<title>{esc(event.name[:120])}: {esc(fmt_seconds(event.dur_s))}</title></rect>')
    out.append(_time_axis(LEFT, height - 24, PLOT_W, span_s))
    out.append("</svg>")
    out.append(legend([("compute (kernels, aten ops)", CATEGORY_COLORS["forward"]),
                       ("communication (nccl, gloo, c10d)", CATEGORY_COLORS["dp comm"]), ("other", "#bab0ac")]))
    return "\n".join(out)


__all__ = ["render_html"]
