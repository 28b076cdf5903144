"""``benchmarks/isolated_summary.py``: medians over rounds, the best baseline, failed configs."""

from __future__ import annotations

import json

from benchmarks.isolated_summary import collect, table


def _write(root, tag, config, round_, step_s, status="ok", peak=2**30):
    d = root / tag / f"{config}_r{round_}"
    d.mkdir(parents=True)
    row = {"config": config, "status": status, "median_step_s": step_s if status == "ok" else None,
           "peak_memory_bytes": peak, "plan": "dp_shard=2" if config == "autoshard" else ""}
    (d / "results.json").write_text(json.dumps({"meta": {}, "rows": [row], "loss_agreement": []}))


def test_medians_and_ratio_against_the_best_baseline(tmp_path):
    for r, (a, b, c) in enumerate([(0.10, 0.20, 0.30), (0.30, 0.22, 0.28), (0.12, 0.18, 0.40)], start=1):
        _write(tmp_path, "llama350m", "autoshard", r, a)
        _write(tmp_path, "llama350m", "fsdp2-noreshard", r, b)
        _write(tmp_path, "llama350m", "megatron-tp", r, c)
    _write(tmp_path, "llama350m", "deepspeed-z2", 1, None, status="failed")
    data = collect(tmp_path)
    assert set(data["llama350m"]) == {"autoshard", "fsdp2-noreshard", "megatron-tp", "deepspeed-z2"}
    lines = "\n".join(table("llama350m", data["llama350m"]))
    # autoshard median 0.12 s over rounds, the best baseline fsdp2-noreshard median 0.20 s
    assert "| autoshard | dp_shard=2 | 3 | 120.0 | 100.0–300.0 | 1.00 | 1.67× |" in lines
    assert "| fsdp2-noreshard |  | 3 | 200.0 | 180.0–220.0 | 1.00 | best baseline |" in lines
    assert "| megatron-tp |  | 3 | 300.0 | 280.0–400.0 | 1.00 | 0.67× |" in lines
    assert "| deepspeed-z2 | | 1 | – | – | – | failed |" in lines
