"""``autoshard/progress.py``: the plain line format, when ``Lines`` prints, ``--quiet`` silence, the
terminal decision (a parameter, no real terminal), and the library stages reporting through it
(capture, search, calibrate, the PPO step line) without changing their results."""

from __future__ import annotations

import io

import pytest

from autoshard.progress import (
    Lines, Live, Silent, Update, format_duration, format_line, format_rate, reporter,
)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(**options) -> tuple[Lines, io.StringIO, FakeClock]:
    stream, clock = io.StringIO(), FakeClock()
    return Lines(clock=clock, stream=stream, **options), stream, clock


# ------------------------------------------------------------------ format
def test_line_format():
    update = Update("step", 3, 10, rate=1234.0, rate_unit="tok/s")
    assert format_line(update, 12.0, 28.0) == "step 3/10  elapsed 12 s  ETA 28 s  1.2k tok/s"
    search = Update("search", 40, 96, unit="candidates", note="3 of 24 meshes solved", eta=False)
    assert format_line(search, 4.2, None) == "search 40/96 candidates  elapsed 4 s  3 of 24 meshes solved"
    assert format_line(Update("capture gpt:tiny", 1, 1), 3.0, None) == "capture gpt:tiny  elapsed 3 s"  # a stage
    assert format_line(Update("done in 4.0 s", 1, 1), None, None) == "done in 4.0 s"


@pytest.mark.parametrize("seconds, text", [(0.4, "0 s"), (12.4, "12 s"), (200, "3 min 20 s"), (7500, "2 h 05 min")])
def test_durations(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("value, text", [(1234.5, "1.2k"), (223.4, "223"), (0.52, "0.52"), (2.5e6, "2.5M")])
def test_rates(value, text):
    assert format_rate(value) == text


# ------------------------------------------------------------------- lines
def test_lines_eta_from_the_first_update():
    progress, stream, clock = _lines(delay_s=0.0, interval_s=0.0)
    progress(Update("step", 0, 10))
    clock.now += 12.0
    progress(Update("step", 3, 10, rate=1200.0, rate_unit="tok/s"))
    assert stream.getvalue().splitlines()[-1] == "step 3/10  elapsed 12 s  ETA 28 s  1.2k tok/s"


def test_lines_resumed_run_counts_from_its_first_step():
    progress, stream, clock = _lines(delay_s=0.0, interval_s=0.0)
    progress(Update("step", 50, 100))
    clock.now += 10.0
    progress(Update("step", 60, 100))
    assert stream.getvalue().splitlines()[-1] == "step 60/100  elapsed 10 s  ETA 40 s"


def test_lines_wait_for_the_delay_then_throttle_and_print_the_last():
    progress, stream, clock = _lines(delay_s=2.0, interval_s=5.0)
    for completed in range(5):  # within the first 2 s: nothing
        progress(Update("search", completed, 100, eta=False))
        clock.now += 0.3
    assert stream.getvalue() == ""
    clock.now += 1.0
    progress(Update("search", 10, 100, eta=False))  # past the delay: the first line
    clock.now += 1.0
    progress(Update("search", 20, 100, eta=False))  # within the interval: throttled
    clock.now += 1.0
    progress(Update("search", 100, 100, eta=False))  # the last one
    assert [line.split("  ")[0] for line in stream.getvalue().splitlines()] == ["search 10/100", "search 100/100"]


def test_short_work_prints_nothing_but_kept_updates_always_print():
    progress, stream, clock = _lines()
    progress(Update("capture gpt:tiny", 0, 1))
    clock.now += 0.5
    progress(Update("capture gpt:tiny", 1, 1))
    assert stream.getvalue() == ""
    progress(Update("step", 1, 2, note="reward 0.1", keep=True))
    assert stream.getvalue() == "step 1/2  elapsed 0 s  reward 0.1\n"


# ------------------------------------------------------- choice of reporter
def test_quiet_is_silent():
    stream = io.StringIO()
    progress = reporter(stream, quiet=True, terminal=True)
    assert isinstance(progress, Silent)
    progress(Update("step", 1, 2, note="reward 0.1", keep=True))
    progress.log("text")
    progress.close()
    assert stream.getvalue() == ""


@pytest.mark.parametrize("terminal, lines, kind", [
    (True, True, Live), (True, False, Live), (False, True, Lines), (False, False, Silent), (None, True, Lines),
])
def test_terminal_decision(terminal, lines, kind):
    """``terminal`` decides (``None``: ``isatty`` of the stream, False for a StringIO); no real terminal needed."""
    progress = reporter(io.StringIO(), terminal=terminal, lines=lines)
    try:
        assert type(progress) is kind
    finally:
        progress.close()


def test_live_draws_rows_and_keeps_kept_updates():
    stream = io.StringIO()
    with reporter(stream, terminal=True) as progress:
        progress(Update("step", 0, 4))
        progress(Update("step", 1, 4, note="reward 0.125", keep=True))
    text = stream.getvalue()
    assert "step 1/4  elapsed 0 s" in text and "reward 0.125" in text


# ------------------------------------------------------- library reporting
def test_capture_and_search_report_and_stay_the_same():
    from autoshard.cluster import Cluster
    from autoshard.passes.capture import capture_reference
    from autoshard.search import solve
    from autoshard.search.solver import without_wall_time
    from autoshard.train import TrainSpec

    updates: list[Update] = []
    graph = capture_reference("gpt:tiny", seq_lens=(8, 16), progress=updates.append)
    assert [(u.task, u.completed, u.total) for u in updates] == [("capture gpt:tiny", k, 3) for k in range(4)]
    assert updates[-1].note == f"{len(graph.layers)} layers captured"

    cluster, train = Cluster.load("h100-sxm:1x8"), TrainSpec(global_batch=16, seq_len=16)
    updates.clear()
    reported = solve(graph, cluster, train, time_limit_s=30, progress=updates.append)
    silent = solve(graph, cluster, train, time_limit_s=30)
    assert without_wall_time(reported) == without_wall_time(silent)
    assert updates[0].completed == 0 and updates[-1].completed == updates[-1].total > 0
    assert all(u.task == "search" and not u.eta for u in updates)
    meshes = reported.solver
    assert f"{meshes.meshes_solved} of {meshes.meshes_considered} meshes solved, best step" in updates[-1].note


def test_calibrate_reports_each_probe():
    import torch

    from autoshard.calibrate import CalibrationSizes, calibrate
    from autoshard.cluster import Cluster

    updates: list[Update] = []
    calibrate(Cluster.detect(), torch.device("cpu"), CalibrationSizes.quick(), progress=updates.append)
    assert [u.completed for u in updates] == list(range(len(updates)))
    assert {u.total for u in updates} == {len(updates) - 1}
    assert [u.note for u in updates][:2] == ["matmul", "kernel overhead"] and updates[-1].note == "done"


def test_ppo_step_line():
    from autoshard.runtime.metrics import LiveSummary

    updates: list[Update] = []
    summary = LiveSummary(150, progress=updates.append)
    summary.start(0)
    summary({"step": 8.0, "reward/mean": 0.175, "perf/tokens_per_s": 1234.0, "time/step": 0.13})
    summary({"step": 9.0, "reward/mean": 0.2})
    start, step, unkept = updates
    assert (start.completed, start.total, start.keep) == (0, 150, False)
    assert (step.task, step.completed, step.total, step.rate, step.rate_unit, step.keep) == (
        "step", 8, 150, 1234.0, "tok/s", True)  # kept: every 8th of 150 steps (about 20 lines)
    assert step.note == "reward 0.175 | 0.13 s"  # step and tokens/s are in the line's head
    assert (unkept.completed, unkept.keep) == (9, False)
