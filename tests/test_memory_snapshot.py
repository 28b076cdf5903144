"""``benchmarks/run.py --memory-snapshot``: the allocator-trace replay (``peak_summary``) on a synthetic trace."""

from __future__ import annotations

from benchmarks.run import peak_summary


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


TORCH = ("/x/site-packages/torch/nn/functional.py", 10, "linear")
BLOCK = ("/r/autoshard/models/layers.py", 42, "forward")
LOSS = ("/r/benchmarks/baselines/common.py", 7, "policy_loss")
OPT = ("/r/runtime/optimizer.py", 99, "step")


def test_peak_and_what_is_live_at_it():
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(TORCH, BLOCK)},   # activation
        {"action": "alloc", "addr": 2, "size": 100, "frames": _frames(TORCH, BLOCK)},   # activation
        {"action": "free_completed", "addr": 9, "size": 50, "frames": []},              # allocated before the step
        {"action": "alloc", "addr": 3, "size": 300, "frames": _frames(LOSS)},           # loss temporaries: the peak
        {"action": "free_requested", "addr": 3, "size": 300, "frames": []},             # not freed until completed
        {"action": "free_completed", "addr": 3, "size": 300, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 4, "size": 200, "frames": _frames(OPT)},            # below the peak
    ]
    out = peak_summary(trace, before=1000)
    assert out["before_step_bytes"] == 1000
    assert out["peak_bytes"] == 1000 + 200 - 50 + 300
    assert out["allocated_in_step_at_peak_bytes"] == 450
    assert out["top"] == [{"where": "baselines/common.py:7 policy_loss", "bytes": 300, "blocks": 1},
                          {"where": "models/layers.py:42 forward", "bytes": 200, "blocks": 2}]


def test_no_allocation_keeps_the_starting_bytes():
    out = peak_summary([{"action": "free_completed", "addr": 1, "size": 10}], before=64)
    assert out["peak_bytes"] == 64 and out["top"] == []
