"""Progress of long work: a live display on a terminal, plain lines in logs, nothing when quiet.

Library code describes its progress and never prints it: ``capture``,
``search.solve``, ``calibrate`` and the PPO loop take an optional
``progress`` argument, a ``ProgressFn`` (any callable taking an
``Update``), ``None`` by default, so library use stays silent. The CLI
passes a ``Reporter`` made by ``reporter``, which chooses by where the
output goes:

| ``reporter(...)`` | class | what it prints |
| --- | --- | --- |
| ``quiet=True`` | ``Silent`` | nothing |
| a terminal | ``Live`` | one ``rich.progress`` row per task: spinner, bar, then the line below with its elapsed time ticking; updates with ``keep`` are also printed above the rows |
| anything else, ``lines=True`` | ``Lines`` | plain lines, no timestamps or colour (``format_line``) |
| anything else, ``lines=False`` | ``Silent`` | nothing: commands whose output is a result (``plan``, ``explain``) keep a pipe to that result or to one error line |

A line (``format_line``)::

    step 3/10  elapsed 12 s  ETA 28 s  1.2k tok/s  reward 0.175 | len 4.5

``Lines`` prints a task's lines only once the task has run ``delay_s`` (2 s:
work that ends sooner prints nothing), then at most one per ``interval_s``
plus its last one (``completed == total``); an update with ``keep`` (a
training step's metrics) is always printed. A task of ``total=1`` is a stage:
no count. A task reported done in its first update has no elapsed time. Elapsed time counts
from the task's first update, so callers send ``completed=0`` (or the
resumed step) when the work starts; ETA = elapsed / (units done since that
first update) · (units left), shown when the update's ``eta`` is true and
its total known (a branch-and-bound search sets ``eta=False``: the meshes
left do not predict its time).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

DEFAULT_DELAY_S = 2.0
DEFAULT_INTERVAL_S = 2.0


@dataclass(frozen=True)
class Update:
    """What one task has done so far; a ``ProgressFn`` receives these."""

    task: str
    """Row name, e.g. ``"step"``, ``"search"``, ``"capture llama:7b"``; updates of one task share it."""
    completed: int
    """Units done (steps, meshes solved, probes run)."""
    total: int | None = None
    """Units in all, when known."""
    unit: str = ""
    """Shown after the count: ``search 40/96 candidates``."""
    note: str = ""
    """What is running now or the latest result, e.g. ``best step 0.532 s``."""
    rate: float | None = None
    """Throughput in ``rate_unit`` per second, e.g. tokens/s."""
    rate_unit: str = "/s"
    """Shown after the rate: ``1.2k tok/s``."""
    eta: bool = True
    """Whether completed/total predicts the time left (module docstring)."""
    keep: bool = False
    """A record worth keeping (a training step's metrics): always printed, and kept above a live display."""


ProgressFn = Callable[[Update], None]


def format_duration(seconds: float) -> str:
    """``12 s``, ``3 min 20 s``, ``2 h 05 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def format_rate(value: float) -> str:
    """``1234.5`` → ``1.2k``; ``223.4`` → ``223``; ``0.52`` → ``0.52``."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def format_count(update: Update) -> str:
    """``3/10``, ``3/12 meshes``, ``3`` (no total); empty for a stage (``total=1``)."""
    if update.total == 1:
        return ""
    count = f"{update.completed}/{update.total}" if update.total is not None else str(update.completed)
    return f"{count} {update.unit}" if update.unit else count


def format_details(update: Update, eta_s: float | None) -> str:
    """The part of a line after the elapsed time: ETA, rate and note, two spaces apart."""
    parts = []
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    if update.rate is not None:
        parts.append(f"{format_rate(update.rate)} {update.rate_unit}")
    if update.note:
        parts.append(update.note)
    return "  ".join(parts)


def format_line(update: Update, elapsed_s: float | None, eta_s: float | None) -> str:
    """``step 3/10  elapsed 12 s  ETA 28 s  1.2k tok/s  NOTE`` (module docstring); no elapsed part when
    ``elapsed_s`` is None (a task reported done in its first update)."""
    count = format_count(update)
    parts = [f"{update.task} {count}" if count else update.task]
    if elapsed_s is not None:
        parts.append(f"elapsed {format_duration(elapsed_s)}")
    details = format_details(update, eta_s)
    if details:
        parts.append(details)
    return "  ".join(parts)


@dataclass
class _Clock:
    """When a task started and from which count, for elapsed time and ETA."""

    start_s: float
    first_completed: int
    first_total: int | None
    last_print_s: float | None = None

    @property
    def instant(self) -> bool:
        """Reported done in its first update: no elapsed time to show."""
        return self.first_total is not None and self.first_completed >= self.first_total


@dataclass
class Reporter:
    """Base of the reporters: keeps each task's clock; prints nothing (``Silent``)."""

    clock: Callable[[], float] = time.monotonic
    _tasks: dict[str, _Clock] = field(default_factory=dict, init=False, repr=False)

    def __call__(self, update: Update) -> None:
        """Report ``update`` (a ``ProgressFn``)."""
        now = self.clock()
        task = self._tasks.setdefault(update.task, _Clock(now, update.completed, update.total))
        self._show(update, task, now)

    def timing(self, update: Update, now: float) -> tuple[float | None, float | None]:
        """(elapsed s, ETA s) of ``update``'s task at ``now``; each None when not meaningful."""
        task = self._tasks[update.task]
        elapsed = None if task.instant else now - task.start_s
        done = update.completed - task.first_completed
        if elapsed is None or not update.eta or update.total is None or done <= 0 or update.completed >= update.total:
            return elapsed, None
        return elapsed, elapsed / done * (update.total - update.completed)

    def log(self, text: str) -> None:
        """Print one line of text (above a live display); nothing when silent."""

    def close(self) -> None:
        """Stop a live display (its rows stay on the screen)."""

    def _show(self, update: Update, task: _Clock, now: float) -> None:
        pass

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Silent(Reporter):
    """Prints nothing (``--quiet``, or a pipe under a result command)."""


@dataclass
class Lines(Reporter):
    """Plain lines on ``stream`` (module docstring: which updates print)."""

    stream: TextIO | None = None
    delay_s: float = DEFAULT_DELAY_S
    interval_s: float = DEFAULT_INTERVAL_S

    def _show(self, update: Update, task: _Clock, now: float) -> None:
        elapsed, eta = self.timing(update, now)
        final = update.total is not None and update.completed >= update.total
        due = (elapsed or 0.0) >= self.delay_s and (
            task.last_print_s is None or final or now - task.last_print_s >= self.interval_s)
        if update.keep or due:
            task.last_print_s = now
            self.log(format_line(update, elapsed, eta))

    def log(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(text + "\n")
        stream.flush()


class Live(Reporter):
    """``rich.progress`` rows on a terminal ``console``, one per task, drawn from the first update until
    ``close``: spinner (✓ when done), bar, then ``format_line`` with the elapsed time and ETA ticking
    between updates, cut with "…" at the terminal's width. A task of ``total=1`` is a stage: no bar."""

    def __init__(self, console: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn
        from rich.table import Column
        from rich.text import Text

        reporter = self

        class StageFreeBar(BarColumn):
            def render(self, task: Any) -> Any:
                return Text("") if task.total is None or task.total <= 1 else super().render(task)

        class LineColumn(ProgressColumn):
            def render(self, task: Any) -> Any:
                return Text(reporter._line(task.fields), no_wrap=True, overflow="ellipsis")

        super().__init__(clock=clock)
        self.console = console
        self._ids: dict[str, Any] = {}
        self._started = False
        self._rows = Progress(  # the line column alone shrinks on a narrow terminal (it may wrap; its text does not)
            SpinnerColumn(finished_text="✓", table_column=Column(no_wrap=True)),
            StageFreeBar(bar_width=16, table_column=Column(no_wrap=True)), LineColumn(),
            console=console, redirect_stdout=False, redirect_stderr=False,
        )

    def _line(self, fields: dict[str, Any]) -> str:
        """The row's text now: elapsed and ETA move on from the last update unless the task is done."""
        update, at, eta = fields["update"], fields["at"], fields["eta"]
        done = update.total is not None and update.completed >= update.total
        now = at if done else self.clock()
        eta = None if eta is None else max(eta - (now - at), 0.0)
        task = self._tasks[update.task]
        return format_line(update, None if task.instant else now - task.start_s, eta)

    def _show(self, update: Update, task: _Clock, now: float) -> None:
        if not self._started:
            self._rows.start()
            self._started = True
        elapsed, eta = self.timing(update, now)
        fields = {"update": update, "at": now, "eta": eta}
        if update.task not in self._ids:
            self._ids[update.task] = self._rows.add_task(update.task, total=update.total, **fields)
        self._rows.update(self._ids[update.task], total=update.total, completed=update.completed, **fields)
        if update.keep:
            self.log(format_line(update, elapsed, eta))

    def log(self, text: str) -> None:
        self._rows.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._started:
            self._rows.stop()
            self._started = False


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (``isatty``), where a live display can redraw."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def reporter(stream: TextIO | None = None, *, quiet: bool = False, terminal: bool | None = None,
             lines: bool = True, console: Any = None, delay_s: float = DEFAULT_DELAY_S,
             interval_s: float = DEFAULT_INTERVAL_S) -> Reporter:
    """The reporter for output to ``stream`` (default stdout) or to a rich ``console`` (module docstring table).

    ``terminal``: whether the output is a terminal (default: ``console.is_terminal``, else
    ``is_terminal(stream)``); tests pass it instead of a real terminal. ``lines``: whether a
    non-terminal gets plain lines (``False``: nothing).
    """
    if quiet:
        return Silent()
    if console is not None:
        stream = console.file
        terminal = console.is_terminal if terminal is None else terminal
    stream = stream or sys.stdout
    terminal = is_terminal(stream) if terminal is None else terminal
    if terminal:
        if console is None:
            from rich.console import Console

            console = Console(file=stream, force_terminal=True, highlight=False)
        return Live(console)
    if lines:
        return Lines(stream=stream, delay_s=delay_s, interval_s=interval_s)
    return Silent()


__all__ = [
    "Lines", "Live", "ProgressFn", "Reporter", "Silent", "Update", "format_duration", "format_line", "format_rate",
    "is_terminal", "reporter",
]
