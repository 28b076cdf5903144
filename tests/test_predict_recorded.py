"""``benchmarks/predict_recorded.py``: recorded plan summaries parse back into the plans they name."""

from __future__ import annotations

import pytest

from autoshard.errors import AutoshardError
from benchmarks.predict_recorded import parse_summary, recorded_cluster


def test_parse_data_parallel_and_tp_summaries():
    ddp = parse_summary("dp_shard=2; zero1×100; m=1 mb=8")
    assert (ddp.mesh, ddp.state, ddp.tp, ddp.num_micro_batches) == ({"dp_shard": 2}, "zero1", False, 1)
    tp = parse_summary("tp=2; replicate×50 replicate·TP×50; m=4 mb=4")
    assert (tp.mesh, tp.state, tp.tp, tp.num_micro_batches) == ({"tp": 2}, "replicate", True, 4)


def test_unparsable_summary_is_refused():
    with pytest.raises(AutoshardError, match="plan summary"):
        parse_summary("searched plan")


def test_recorded_cluster_drops_the_detected_prefix():
    cluster = recorded_cluster({"cluster": "detected:h100-sxm:1x2"})
    assert cluster.world_size == 2
