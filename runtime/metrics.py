"""Per-step PPO metrics: phase timers, throughput, MFU, peak memory, JSON lines, a per-step progress line.

Keys written per step (all floats; ``/`` groups them):

| key | meaning |
| --- | --- |
| ``step`` | 1-based step index |
| ``reward/mean``, ``reward/std`` | total reward per sequence (seq_reward + Σ token rewards), over all dp ranks |
| ``response/length``, ``response/empty_frac`` | mean response tokens (``<eos>`` included); fraction whose first token was ``<eos>`` |
| ``kl/k1``, ``kl/k3`` | mean per-token KL estimates of the rollout policy to the reference |
| ``policy/loss``, ``policy/clip_frac``, ``policy/entropy``, ``policy/approx_kl`` | per-token means over the last PPO epoch |
| ``value/loss``, ``value/clip_frac``, ``value/explained_var`` | critic metrics |
| ``grad/norm`` | mean pre-clip global gradient norm over optimizer steps |
| ``mismatch/logp_abs``, ``mismatch/logp_max`` | mean and max abs(rollout log-prob − recomputed log-prob) |
| ``time/<phase>`` | seconds per phase: weight_sync (engines with a rollout replica), generate, logprobs, reference, values, advantages, train; ``time/step`` total |
| ``perf/tokens_per_s`` | rollout tokens (prompt + response, all dp ranks) per step second, divided by dp ranks (per device) |
| ``perf/mfu`` | training FLOPs / train seconds / peak FLOPs (only when both FLOPs inputs are given) |
| ``memory/peak_gb`` | ``torch.cuda.max_memory_allocated`` on GPU; the process's max RSS on CPU |
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterator

import torch

from autoshard.errors import AutoshardError
from autoshard.file_io import METRICS_FILE, atomic_write, parse_json_strict, read_bounded_text
from autoshard.progress import Update, reporter

PHASES = ("weight_sync", "generate", "logprobs", "reference", "values", "advantages", "train")


class PhaseTimer:
    """Accumulates wall seconds per named phase (``with timer.phase("generate"): ...``)."""

    def __init__(self, synchronize: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = synchronize and torch.cuda.is_available()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body; on GPU, synchronise first and last so kernels are counted in their phase. A
        profiler trace marks it ``ppo::<name>`` (``benchmarks/trace_phases.py`` sums each phase's kernels)."""
        if self._sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"ppo::{name}"):  # the phase in a --profile trace
                yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        """``time/<phase>`` for every phase seen."""
        return {f"time/{name}": secs for name, secs in self.seconds.items()}


def peak_memory_gb(device: torch.device | str = "cpu") -> float:
    """Peak memory in GB: CUDA max allocated on a GPU device, the process's max RSS otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


def mfu(flops_per_token: float | None, tokens: float, seconds: float, peak_flops: float | None) -> float:
    """Model FLOPs utilisation: flops_per_token · tokens / seconds / peak_flops (nan when unknown)."""
    if not flops_per_token or not peak_flops or seconds <= 0:
        return float("nan")
    return flops_per_token * tokens / seconds / peak_flops


class MetricsWriter:
    """Appends one JSON object per step to ``path`` (created with its parents, opened at the first row);
    non-finite floats become null."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = None

    def write(self, metrics: dict[str, float]) -> None:
        row = {k: (v if isinstance(v, (int, str)) or math.isfinite(v) else None) for k, v in metrics.items()}
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def truncate_metrics(path: str | Path, step: int) -> int:
    """Keep the rows of ``path`` up to ``step`` (a resumed run's checkpoint) and drop the later ones, which the
    resumed run writes again: no duplicate rows. The file is rewritten atomically; returns the rows dropped
    (0 when it does not exist). Each line is read strictly, as ``read_metrics`` does."""
    if not Path(path).exists():
        return 0
    kept, dropped = [], 0
    for number, line in enumerate(read_bounded_text(path, METRICS_FILE).splitlines(), start=1):
        if not line.strip():
            continue
        row = parse_json_strict(line, source=f"metrics file {str(path)!r} line {number}", kind=METRICS_FILE)
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        atomic_write(path, "".join(f"{line}\n" for line in kept), noun="metrics file")
    return dropped


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a JSON-lines metrics file (null → nan).

    Read by ``autoshard/file_io.py``'s strict rules (a regular UTF-8 file of at most 256 MiB; each
    line standard JSON without duplicate keys); a line that is not an object of numbers, strings
    and nulls is refused (``AutoshardError`` naming the file and line)."""
    name = str(path)
    rows = []
    for number, line in enumerate(read_bounded_text(path, METRICS_FILE).splitlines(), start=1):
        if not line.strip():
            continue
        source = f"metrics file {name!r} line {number}"
        row = parse_json_strict(line, source=source, kind=METRICS_FILE)
        if not isinstance(row, dict) or any(isinstance(v, (dict, list)) for v in row.values()):
            raise AutoshardError(f"{source}: expected one JSON object of numbers per line, got "
                                 f"{line.strip()[:40]!r}; {METRICS_FILE.hint}")
        rows.append({k: float("nan") if v is None else v for k, v in row.items()})
    return rows


def run_info_path(metrics: str | Path) -> Path:
    """The run's description beside its metrics file: ``run.jsonl`` → ``run.run.json``."""
    metrics = Path(metrics)
    return metrics.with_name(f"{metrics.stem}.run.json")


def write_run_info(metrics: str | Path, info: dict[str, str | int | float]) -> Path:
    """Write what a run trains (model, task, plan mesh, world size…; ``autoshard plot`` titles its figure with
    it) beside ``metrics``, atomically."""
    return atomic_write(run_info_path(metrics), json.dumps(info, sort_keys=True, indent=2) + "\n",
                        noun="run info file", parents=True)


def read_run_info(metrics: str | Path) -> dict[str, str | int | float] | None:
    """The run description beside ``metrics``, or None when there is none (an older run) or it is not a JSON
    object of scalars."""
    path = run_info_path(metrics)
    if not path.is_file():
        return None
    try:
        info = parse_json_strict(read_bounded_text(path, METRICS_FILE), source=str(path), kind=METRICS_FILE)
    except AutoshardError:
        return None
    if not isinstance(info, dict) or any(isinstance(v, (dict, list)) for v in info.values()):
        return None
    return info


_SUMMARY = (
    ("step", "step {:.0f}"),
    ("reward/mean", "reward {:.3f}"),
    ("response/length", "len {:.1f}"),
    ("kl/k1", "kl {:+.4f}"),
    ("policy/entropy", "ent {:.2f}"),
    ("policy/clip_frac", "clip {:.2f}"),
    ("value/loss", "vloss {:.4f}"),
    ("value/explained_var", "ev {:+.2f}"),
    ("grad/norm", "gnorm {:.2f}"),
    ("perf/tokens_per_s", "{:.0f} tok/s"),
    ("time/step", "{:.2f} s"),
)


def format_summary(metrics: dict[str, float]) -> str:
    """One line of the headline metrics present in ``metrics``."""
    return " | ".join(fmt.format(metrics[key]) for key, fmt in _SUMMARY if key in metrics)


KEPT_STEP_LINES = 20  # step lines a run keeps (prints in a log): the first, every k-th and the last
HEARTBEAT_S = 60.0  # a log also gets the latest step after this long without a line (slow steps)


class LiveSummary:
    """Reports each step's metrics as progress (``autoshard/progress.py``): ``step i/N``, elapsed, ETA and
    tokens/s, with ``format_summary`` of the other headline metrics as the note. About
    ``KEPT_STEP_LINES`` steps are kept (``kept``): a log gets their lines, plus the latest step after
    ``HEARTBEAT_S`` without one; a terminal gets them above a live row that every step updates. The
    metrics file has every step. Rank 0 only, by the caller.

    ``progress``: where to report (default: plain lines or a live display on stdout).
    """

    def __init__(self, total_steps: int | None = None, progress: Callable[[Update], None] | None = None) -> None:
        self.total_steps = total_steps
        self.progress = progress if progress is not None else reporter(interval_s=HEARTBEAT_S)
        self.first_step = 0

    def start(self, step: int = 0) -> None:
        """Training starts after ``step`` (0, or a resumed checkpoint's): elapsed time and ETA count from now."""
        self.first_step = step
        self.progress(Update("step", step, self.total_steps))

    def kept(self, step: int) -> bool:
        """Whether ``step``'s line is kept: the run's first step, every k-th and the last, with
        k = ceil(steps to run / ``KEPT_STEP_LINES``) (every step when the total is unknown)."""
        if self.total_steps is None:
            return True
        every = max(1, math.ceil((self.total_steps - self.first_step) / KEPT_STEP_LINES))
        return step == self.first_step + 1 or step % every == 0 or step >= self.total_steps

    def __call__(self, metrics: dict[str, float]) -> None:
        step = int(metrics["step"])
        rest = {key: value for key, value in metrics.items() if key not in ("step", "perf/tokens_per_s")}
        self.progress(Update("step", step, self.total_steps, note=format_summary(rest),
                             rate=metrics.get("perf/tokens_per_s"), rate_unit="tok/s", keep=self.kept(step)))

    def close(self) -> None:
        """Stop a live display (``Reporter.close``)."""
        close = getattr(self.progress, "close", None)
        if close is not None:
            close()
