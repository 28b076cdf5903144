"""The sharded-session benchmark's CPU parts, without torchrun.

``benchmarks/sharded_summary.py`` on a synthetic session tree (medians over processes, the best
baseline, GPU idle from profiled rows, a process killed at its limit, a config skipped before
launch, an 80 GB overflow mark, two session folders pooled); ``benchmarks/run.py``'s Hugging Face
model spec (argument checks, capture dispatch, the graph cache, the skipped rows without
``transformers``), the ``fsdp2*`` options and ``common``'s HF helpers.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import run  # noqa: E402
from benchmarks import sharded_summary as summary  # noqa: E402
from benchmarks.baselines import common  # noqa: E402

GIB = 2**30
META = {"model": "llama:7b", "world_size": 2, "device_name": "NVIDIA H100 80GB HBM3", "global_batch": 4,
        "seq_len": 2048, "precision": "bf16", "steps": 10, "warmup": 3, "cluster": "h100-sxm:1x2", "torch": "2.11",
        "date": "2026-11-27T00:00:00+00:00"}


def _process(root: Path, group: str, config: str, round_: int, *, tokens: float | None = None, peak: float = 40,
             idle: tuple[float, float] | None = None, status: str = "ok", started: int = 100, **proc) -> Path:
    """One process folder: run.py's results.json when ``tokens`` is given, and the shell's proc.json."""
    folder = root / group / f"{config}_r{round_}"
    folder.mkdir(parents=True)
    if tokens is not None or status != "ok":
        row = {"config": config, "status": status, "plan": "dp_shard=2" if config == "autoshard" else "≈ zero3"}
        if tokens is not None:
            row.update(tokens_per_s=tokens, mfu=tokens / 1e5, peak_memory_bytes=int(peak * GIB))
        if idle is not None:
            row["profile"] = {"span_ms": idle[0], "gpu_idle_ms": idle[1], "kernels": 10}
        (folder / "results.json").write_text(json.dumps({"meta": META, "rows": [row]}))
    (folder / "proc.json").write_text(json.dumps({"config": config, "round": round_, "started": started, **proc}))
    return folder


def test_summary_medians_ratio_idle_and_lost_processes(tmp_path):
    group = "llama7b_x2"
    for r, (a, b, c) in enumerate([(9000, 7000, 5000), (10000, 7600, 5200), (9600, 7200, 4000)], start=1):
        _process(tmp_path, group, "autoshard", r, tokens=a, peak=82 if r == 2 else 70,
                 idle=(100.0, 5.0) if r == 1 else None, rc=0)
        _process(tmp_path, group, "fsdp2-compiled", r, tokens=b, idle=(100.0, 20.0) if r == 1 else None, rc=0)
        _process(tmp_path, group, "fsdp2", r, tokens=c, rc=0)
    _process(tmp_path, group, "deepspeed-z3", 1, status="skipped: deepspeed not installed")
    killed = _process(tmp_path, group, "fsdp2-noreshard-compiled", 1, rc=124, wall_s=300, limit_s=300)
    (killed.parent / f"{killed.name}.log").write_text("step 1\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n")
    _process(tmp_path, group, "fsdp2-noreshard-compiled", 2, tokens=7400, rc=0)

    data = summary.collect([tmp_path])
    assert list(data[group]) == ["autoshard", "fsdp2-compiled", "fsdp2-noreshard-compiled", "fsdp2", "deepspeed-z3"]
    text = "\n".join(summary.table(group, data[group]))
    # medians 9600 vs the best baseline's 7400 (fsdp2-noreshard-compiled: one process, one killed)
    assert "| autoshard | dp_shard=2 | 9,600 | 9,000–10,000 | 9.6% | 82.00 † | 5.0% | 1.30× | 3/3 | ok |" in text
    assert ("| fsdp2-noreshard-compiled | ≈ zero3 | 7,400 | 7,400–7,400 | 7.4% | 40.00 | – | best baseline | "
            "1/2 | ok; 1 lost: failed: killed at its 300 s limit: torch.OutOfMemoryError: CUDA out of memory. |") \
        in text
    assert "| fsdp2-compiled | ≈ zero3 | 7,200 | 7,000–7,600 | 7.2% | 40.00 | 20.0% | 0.97× |" in text
    assert "| deepspeed-z3 | | – | – | – | – | – | – | 0/1 | skipped: deepspeed not installed |" in text
    assert "† above 79.65 GiB" in text
    assert text.startswith("## llama:7b on 2 × NVIDIA H100 80GB HBM3")
    lost = summary.load_process(killed)
    assert lost["status"] == "failed: killed at its 300 s limit: torch.OutOfMemoryError: CUDA out of memory."


def test_summary_pools_sessions_and_orders_groups_by_world_then_start(tmp_path):
    first, second = tmp_path / "call1", tmp_path / "call2"
    _process(first, "hf-llama7b_x2", "autoshard", 1, tokens=100, started=200, rc=0)
    _process(first, "llama7b_x2", "autoshard", 1, tokens=100, started=100, rc=0)
    _process(second, "llama7b_x2", "autoshard", 1, tokens=300, started=900, rc=0)
    _process(second, "llama7b_x4", "autoshard", 1, tokens=500, started=50, rc=0)
    data = summary.collect([first, second])
    assert list(data) == ["llama7b_x2", "hf-llama7b_x2", "llama7b_x4"]
    assert summary.config_stats(data["llama7b_x2"]["autoshard"])["tokens_per_s"] == 200
    lost = _process(first, "llama7b_x2", "fsdp2", 1, rc=1, wall_s=12)
    assert summary.load_process(lost)["status"] == "failed: exit 1 after 12 s, no row"
    assert summary.markdown([tmp_path / "none"]).startswith("no <tag>_x<N>")


def test_first_error_and_idle_fraction():
    assert summary.first_error("x\n[rank1]: RuntimeError: boom\nValueError: later") == "RuntimeError: boom"
    assert summary.first_error("all good") is None
    assert summary.idle_fraction({"profile": {"span_ms": 200.0, "gpu_idle_ms": 50.0}}) == 0.25
    assert summary.idle_fraction({"profile": {"host_ms": 3.0, "kernels": 0}}) is None  # CPU: no kernels


# --------------------------------------------------------------------------- run.py: the HF spec and configs


def test_run_accepts_hf_specs_and_the_compiled_fsdp2_configs(tmp_path):
    args = run.parse_args(["--model", "hf-llama:7b", "--configs", "autoshard,fsdp2-compiled,deepspeed-z3",
                           "--cluster", "h100-sxm:1x2", "--graph-cache", str(tmp_path), "--out", str(tmp_path)])
    assert args.model == "hf-llama:7b" and args.configs == ["autoshard", "fsdp2-compiled", "deepspeed-z3"]
    with pytest.raises(SystemExit):
        run.parse_args(["--model", "hf-llama:tiny", "--attn", "math", "--out", str(tmp_path)])
    options = {name: run.fsdp2_options(name) for name in ("fsdp2", "fsdp2-noreshard", "fsdp2-compiled",
                                                          "fsdp2-noreshard-compiled")}
    assert [(o.reshard_after_forward, o.compile) for o in options.values()] == [
        (True, False), (False, False), (True, True), (False, True)]
    assert run.EQUIVALENT["fsdp2-compiled"] == ("zero3", False)


def test_hf_helpers_of_common():
    assert common.is_hf_spec("hf-llama:7b") and common.is_hf_spec("hf-qwen2:1.5b") and not common.is_hf_spec("llama:7b")
    assert common.hf_overrides({"num_layers": 2, "attn_impl": "sdpa"}) == {"num_hidden_layers": 2}
    with pytest.raises(common.BaselineError):
        common.hf_overrides({"attn_impl": "math"})


def test_hf_capture_dispatch_and_graph_cache(tmp_path, monkeypatch):
    import importlib

    from benchmarks import hf_zoo

    capture_module = importlib.import_module("autoshard.passes.capture")  # the package exports a function so named

    calls = []
    monkeypatch.setattr(hf_zoo, "build_hf_policy", lambda spec, **kw: calls.append((spec, kw)) or "model")
    monkeypatch.setattr(capture_module, "capture", lambda model, **kw: {"captured": model, **kw})
    run._capture_cached.cache_clear()
    spec = common.RunSpec(model="hf-llama:tiny", global_batch=2, seq_len=16, num_layers=1, device="cpu")
    graph = run._capture(spec, tmp_path)
    assert graph == {"captured": "model", "name": "hf-llama:tiny", "seq_lens": (8, 16)}
    assert calls == [("hf-llama:tiny", {"device": "meta", "dtype": torch.bfloat16, "num_hidden_layers": 1})]
    [cached] = tmp_path.glob("*.pkl")
    assert cached.name == "hf-llama_tiny_s16_bfloat16_num_layers-1.pkl"
    run._capture_cached.cache_clear()
    assert run._capture(spec, tmp_path) == graph and len(calls) == 1  # read from the file, not captured again
    run._capture_cached.cache_clear()


def test_hf_reference_model_is_the_seeded_policy():
    pytest.importorskip("transformers")
    from benchmarks.hf_policy import build_hf_policy

    spec = common.RunSpec(model="hf-llama:tiny", global_batch=2, seq_len=8, device="cpu")
    model = common.reference_model(spec, "cpu")
    expected = build_hf_policy("hf-llama:tiny", device="cpu", seed=common.SEED)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    common.prepare_reference(spec)  # nothing to cache for an HF spec


def test_hf_rows_skipped_without_transformers(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port).items():
        monkeypatch.setenv(name, str(value))  # a world of one, restored afterwards
    monkeypatch.setattr(run, "hf_available", lambda: False)
    out = tmp_path / "out"
    assert run.main(["--model", "hf-llama:7b", "--device", "cpu", "--precision", "fp32", "--cluster", "cpu:1x1",
                     "--configs", "autoshard,fsdp2", "--batch", "2", "--seq", "16", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["config"], r["status"]) for r in rows] == [("autoshard", "skipped: transformers not installed"),
                                                          ("fsdp2", "skipped: transformers not installed")]
