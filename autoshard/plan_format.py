"""Human forms of a ``Plan``: the ``str`` table and the ``rich`` renderable.

Layout::

    plan for gpt:tiny | global_batch=64 seq_len=2048 bf16 adamw
    mesh dp_replicate=1 dp_shard=8 tp=1 pp=1 ep=1 cp=1 (world 8) | no pipeline: 4 micro-batches of 2 accumulated
    predicted step 1.23 s (compute 0.9 s, exposed comm 210 ms, bubble 0 s, optimizer 30 ms) | ...
    predicted memory/rank peak 61.20 GiB | by stage: ... | params ..., grads ...
    solver OPTIMAL objective 1.23 bound 1.2 gap 2.5% (meshes 12 solved / 40 considered)

    layer              strategy   state  tp        sp   ep  recompute  weight  grad  stage
    embed              Z3         zero3  none      -    -   none       bf16    bf16  0
    blocks.0-31.attn   Z3·TP·SP   ...

Folding (a decision): a layer name's first all-digit component is its block
index (``blocks.7.attn`` → prefix ``blocks``, index 7, suffix ``attn``). The
consecutive layers sharing a prefix and index form one block. A run of
blocks with consecutive indices whose layers have the same suffixes and the
same decisions (every ``LayerStrategy`` field but the name, the stage
included) prints once, as ``blocks.0-31.attn``. So a stage boundary or one
block that differs breaks the run and stays visible. ``repr`` and the JSON
form are never folded; ``fold=False`` prints every layer.

The schedule is said in words (``describe_schedule``): with pp = 1 there is no
pipeline, only gradient accumulation over m micro-batches, so ``1f1b m=4``
would mislead. The rich form wraps the memory line only between its items
(``_Items``), never inside ``params 22.1 KiB``. ``NOTATION_LEGEND`` explains
the strategy notation (``Z2·qG4``); the CLI's ``--help`` of ``plan``,
``explain`` and ``inspect`` shows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: plan.py imports this module for ``str(plan)``
    from autoshard.plan import LayerStrategy, Plan

HEADERS = ("layer", "strategy", "state", "tp", "sp", "ep", "recompute", "weight", "grad", "stage")

NOTATION_LEGEND = """\
strategy notation (parts joined by '·', a part at its default is left out):
  DDP      replicated parameters, gradients all-reduced (data parallel)
  Z1 Z2 Z3 ZeRO-1/2/3: optimizer states / + gradients / + parameters sharded over dp_shard
  Off      ZeRO-Offload: optimizer states and update on the host CPU
  TP  SP   Megatron tensor parallelism; sequence parallelism of its activations
  EP       expert parallelism (MoE experts spread over the dp ranks)
  R(sel)   selective recompute (attention internals); R(full): the whole layer recomputed in backward
  qW8 qWf8 parameter all-gathers sent in int8 / fp8
  qG8 qG4  gradient reductions sent in int8 / int4;  G32: in fp32
  e.g. Z2·qG4: ZeRO-2 with int4 gradient reduce-scatters"""


@dataclass(frozen=True)
class _Block:
    """Consecutive layers sharing one (prefix, block index); ``index`` None = not in a block."""

    prefix: str
    index: int | None
    members: tuple[tuple[str, LayerStrategy], ...]  # (suffix or full name, strategy)

    def signature(self) -> tuple:
        return tuple((suffix, s.decision()) for suffix, s in self.members)


def _split_name(name: str) -> tuple[str, int, str] | None:
    """``"blocks.7.attn"`` → ``("blocks", 7, "attn")``; ``None`` without a numeric part."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def _blocks(layers: tuple[LayerStrategy, ...]) -> list[_Block]:
    out: list[_Block] = []
    for s in layers:
        split = _split_name(s.layer)
        if split is None:
            out.append(_Block(s.layer, None, ((s.layer, s),)))
            continue
        prefix, index, suffix = split
        last = out[-1] if out else None
        if last is not None and (last.prefix, last.index) == (prefix, index):
            out[-1] = _Block(prefix, index, last.members + ((suffix, s),))
        else:
            out.append(_Block(prefix, index, ((suffix, s),)))
    return out


def _folded_name(prefix: str, first: int, last: int, suffix: str) -> str:
    index = str(first) if first == last else f"{first}-{last}"
    return ".".join(part for part in (prefix, index, suffix) if part)


def fold_layers(layers: tuple[LayerStrategy, ...]) -> list[tuple[str, LayerStrategy]]:
    """Rows ``(display name, strategy)`` with runs of identical blocks folded (module docstring)."""
    rows: list[tuple[str, LayerStrategy]] = []
    blocks = _blocks(layers)
    i = 0
    while i < len(blocks):
        head = blocks[i]
        j = i
        while (
            head.index is not None
            and j + 1 < len(blocks)
            and blocks[j + 1].prefix == head.prefix
            and blocks[j + 1].index == blocks[j].index + 1
            and blocks[j + 1].signature() == head.signature()
        ):
            j += 1
        if j == i:
            rows.extend((s.layer, s) for _, s in head.members)
        else:
            last = blocks[j].index
            rows.extend((_folded_name(head.prefix, head.index, last, suffix), s) for suffix, s in head.members)
        i = j + 1
    return rows


def layer_row(name: str, s: LayerStrategy) -> tuple[str, ...]:
    """One table row (columns as ``HEADERS``)."""
    return (
        name,
        s.notation,
        s.state,
        s.tp,
        "yes" if s.sp else "-",
        "yes" if s.ep else "-",
        s.recompute,
        s.weight_comm,
        s.grad_comm,
        str(s.stage),
    )


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``61.20 GiB``, ``512.0 MiB``, ``12 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_seconds(t: float) -> str:
    """Seconds in a readable unit: ``1.23 s``, ``45.6 ms``, ``12.0 µs``, ``0 s``."""
    if t == 0:
        return "0 s"
    if abs(t) >= 1:
        return f"{t:.3g} s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def describe_schedule(plan: Plan) -> str:
    """The schedule in words: ``no pipeline: 4 micro-batches of 2 accumulated`` (pp = 1), or
    ``1f1b pipeline over 4 stages, 8 micro-batches of 2`` (``, 2 virtual stages per rank`` when interleaved)."""
    s = plan.schedule
    batches = (f"{s.num_micro_batches} micro-batch{'es' if s.num_micro_batches > 1 else ''} of {s.micro_batch} "
               f"sequence{'s' if s.micro_batch > 1 else ''}")
    if plan.mesh.pp == 1:
        return "no pipeline: " + (f"{batches} accumulated per step" if s.num_micro_batches > 1
                                  else f"one batch of {s.micro_batch} sequence{'s' if s.micro_batch > 1 else ''} per step")
    virtual = f", {s.virtual_stages} virtual stages per rank" if s.virtual_stages > 1 else ""
    return f"{s.name} pipeline over {plan.mesh.pp} stages, {batches}{virtual}"


def header_lines(plan: Plan) -> list[str]:
    """The lines above the layer table: model, mesh + schedule, predictions, solver."""
    lines = [
        f"plan for {plan.model_name} | global_batch={plan.global_batch} seq_len={plan.seq_len} "
        f"{plan.precision} {plan.optimizer}",
        f"mesh {plan.mesh} | {describe_schedule(plan)}",
    ]
    lines.extend(_prediction_lines(plan))
    lines.extend(rollout_lines(plan))
    stats = plan.solver
    if stats.status != "NONE":
        lines.append(
            f"solver {stats.status} objective {stats.objective:.4g} bound {stats.bound:.4g} gap {stats.gap:.1%} "
            f"(meshes {stats.meshes_solved} solved / {stats.meshes_considered} considered)"
        )
    return lines


def _prediction_lines(plan: Plan) -> list[str]:
    p = plan.predictions
    if p.step_time_s == 0 and p.peak_memory_bytes == 0:
        return ["predicted (none recorded)"]
    step = (
        f"predicted step {format_seconds(p.step_time_s)} (compute {format_seconds(p.compute_s)}, "
        f"exposed comm {format_seconds(p.exposed_comm_s)}, bubble {format_seconds(p.bubble_s)}, "
        f"optimizer {format_seconds(p.optimizer_s)}) | {p.tokens_per_s:,.0f} tokens/s | MFU {p.mfu:.1%}"
    )
    memory = f"predicted memory/rank peak {format_bytes(p.peak_memory_bytes)}"
    if p.build_peak_bytes:
        memory += f" (build {format_bytes(p.build_peak_bytes)})"
    if p.memory_by_stage:
        memory += " | by stage: " + ", ".join(
            f"{i}: {format_bytes(b)}" for i, b in enumerate(p.memory_by_stage)
        )
    if p.memory_breakdown:
        parts = sorted(p.memory_breakdown.items(), key=lambda kv: (-kv[1], kv[0]))
        memory += " | " + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts)
    return [step, memory, *(f"caveat: {text}" for text in p.caveats)]


def rollout_lines(plan: Plan) -> list[str]:
    """The RL plan's rollout layout, its reshard and the layouts considered (``search/rollout.py``); none
    without a rollout section."""
    if not plan.rollout:
        return []
    r, c = plan.rollout[0], plan.rollout[0].chosen
    sharded = "a whole copy per rank" if r.tp == 1 else f"a Megatron shard of 1/{r.tp} per rank"
    lines = [
        f"rollout tp={r.tp} × {r.dp} groups ({sharded}) | {r.sequences} sequences of {r.prompt_len}+{r.response_len} "
        f"tokens per RL step | weights {format_bytes(c.weights_bytes)}, KV cache {format_bytes(c.kv_cache_bytes)} per rank",
        f"reshard training → rollout: {format_bytes(c.reshard_bytes)} received per rank, {format_seconds(c.reshard_s)}"
        + (f" | per parameter: {c.reshard_plan}" if c.reshard_plan else ""),
        f"predicted RL step {format_seconds(c.rl_step_s)} = generate {format_seconds(c.generate_s)} + reshard "
        f"{format_seconds(c.reshard_s)} + score {format_seconds(c.score_s)} + advantages "
        f"{format_seconds(c.advantages_s)} + train {format_seconds(c.train_s)} "
        f"| peak/rank {format_bytes(c.peak_bytes)}",
    ]
    others = [o for o in r.options if o.tp != r.tp]
    if others:
        lines.append("rollout layouts considered: " + ", ".join(
            f"tp={o.tp} " + (f"not chosen: {o.refusal}" if o.refusal else
                             f"RL step {format_seconds(o.rl_step_s)} (training {o.training_mesh})") for o in others))
    return lines


def _rows(plan: Plan, fold: bool) -> list[tuple[str, ...]]:
    pairs = fold_layers(plan.layers) if fold else [(s.layer, s) for s in plan.layers]
    return [layer_row(name, s) for name, s in pairs]


def format_plan(plan: Plan, *, fold: bool = True) -> str:
    """``str(plan)``: header lines, a blank line, then the per-layer table."""
    rows = [HEADERS, *_rows(plan, fold)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(HEADERS))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([*header_lines(plan), "", *table])


class _Items:
    """A rich renderable of one text line that wraps only between its items: after ``, `` or `` | ``
    (a value and its unit, ``params 22.1 KiB``, stay on one line); wrapped lines are indented."""

    SEPARATORS = re.compile(r"(?<=, )|(?<= \| )")

    def __init__(self, line: str) -> None:
        self.items = [item for item in self.SEPARATORS.split(line) if item]

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        width, line = options.max_width, ""
        for item in self.items:
            if line.strip() and len(line) + len(item.rstrip()) > width:
                yield Text(line.rstrip(), overflow="fold")
                line = "    "
            line += item
        yield Text(line.rstrip(), overflow="fold")


def plan_to_rich(plan: Plan, *, fold: bool = True) -> Any:
    """The plan as a ``rich`` renderable: header lines (wrapped between items) above a per-layer table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for name in HEADERS:
        table.add_column(name, no_wrap=name in ("layer", "strategy"))
    for row in _rows(plan, fold):
        table.add_row(*(Text(cell) for cell in row))
    return Group(*(_Items(line) for line in header_lines(plan)), Text(""), table)
