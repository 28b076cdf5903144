"""The zoo campaign's summary and re-prediction tools (benchmarks/zoo_summary.py, benchmarks/zoo_repredict.py)."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import zoo_summary  # noqa: E402
from benchmarks.zoo_repredict import rebuilt_plan  # noqa: E402


def _row(config, plan, measured_s, predicted_s, measured_gib, predicted_gib, **extra):
    return {"config": config, "status": "ok", "plan": plan, "median_step_s": measured_s,
            "peak_memory_bytes": measured_gib * 2**30,
            "predicted_calibrated": {"step_time_s": predicted_s, "peak_memory_bytes": predicted_gib * 2**30}, **extra}


def _results(rows):
    return {"meta": {"model": "m:1", "world_size": 2, "device_name": "card"}, "rows": rows}


def _tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_summary_reads_nested_archives_and_scores_plans_and_ratios(tmp_path, capsys):
    """Rows inside a session's sharded.tgz packed again into zoo.tgz are found; per-plan errors and the
    predicted/measured ratio against the best baseline come out as defined."""
    searched = _row("autoshard", "dp_shard=2; zero3×4; m=1 mb=2", 0.100, 0.110, 10.0, 10.5)
    forced = _row("autoshard-replicate", "dp_shard=2; replicate×4; m=1 mb=2", 0.120, 0.120, 12.0, 12.0)
    baseline = _row("fsdp2-noreshard-compiled", "dp_shard=2; zero2×4; m=1 mb=2", 0.105, 0.121, 11.0, 11.0)
    slow = _row("deepspeed-z3", "dp_shard=2; zero3×4; m=1 mb=2", 0.300, 0.110, 11.0, 11.0)
    session = _tgz({"./m1_x2/autoshard_r1/results.json": json.dumps(_results([searched, forced])).encode(),
                    "./m1_x2/fsdp2_r1/results.json": json.dumps(_results([baseline, slow])).encode()})
    (tmp_path / "zoo.tgz").write_bytes(_tgz({"./pairA/sharded.tgz": session}))
    rows = zoo_summary._pooled(zoo_summary.rows_of([tmp_path]))
    assert sorted(r["config"] for r in rows) == ["autoshard", "autoshard-replicate", "deepspeed-z3",
                                                  "fsdp2-noreshard-compiled"]
    assert zoo_summary.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Per plan: 2 autoshard plans measured" in text
    assert "median |step error| **5.0%**" in text  # +10% and 0%
    # best baseline: predicted 0.121/0.110 = 1.100, measured 0.105/0.100 = 1.050 → +4.8%
    assert "fsdp2-noreshard-compiled (best baseline) | 1.100 | 1.050 | +4.8%" in text
    assert "deepspeed-z3 (not counted)" in text


def test_repredict_rebuilds_uniform_plans_only():
    from autoshard.models import build
    from autoshard.passes import capture

    graph = capture(build("gpt:tiny", device="meta"), seq_lens=(8, 16))
    plan = rebuilt_plan({"plan": "dp_shard=2; replicate×1 zero3×11; m=1 mb=4"}, graph)
    assert plan.mesh.dp_shard == 2 and plan.schedule.micro_batch == 4
    assert {s.state for s, l in zip(plan.layers, graph.layers) if l.param_count} == {"zero3"}
    assert rebuilt_plan({"plan": "dp_shard=2; replicate×5 zero1×7; m=1 mb=4"}, graph) is None
    recorded = rebuilt_plan({"plan": "anything", "plan_dict": plan.to_dict()}, graph)
    assert recorded == plan


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__]))
