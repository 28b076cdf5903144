"""CPU tests of the sharded-materialisation benchmark (``benchmarks/materialize_bench.py``).

The Hugging Face Llama of the zoo (``benchmarks/hf_zoo.py``; its other families: tests/test_hf_zoo.py):
builds on meta (buffers on the CPU) and on the CPU, computes what ``LlamaModel.forward`` computes, exports with a causal SDPA and no mask, and
captures on meta. The bench: argument validation, the plan fields, the safetensors writer and
its reuse, a world-1 run of each model family in this process. The summary printer on synthetic rows. Tests that
need ``transformers`` or ``safetensors`` skip without them.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import materialize_bench as bench  # noqa: E402
from benchmarks import materialize_summary as summary  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    from benchmarks import hf_zoo

    return hf_zoo


@pytest.fixture(scope="module")
def tiny_graph(hf):
    from autoshard.passes.capture import capture

    return capture(hf.build_hf_policy("hf-llama:tiny", dtype=torch.bfloat16), name="hf-llama:tiny", seq_lens=(8, 16))


# --------------------------------------------------------------------------- the Hugging Face policy


def test_hf_policy_builds_on_meta_with_cpu_buffers(hf):
    model = hf.build_hf_policy("hf-llama:tiny", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.device.type == "cpu" and inv_freq.dtype == torch.float32  # what a sharded build copies
    config = hf.hf_llama_7b()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
            config.vocab_size, config.max_position_embeddings) == (4096, 32, 32, 11008, 32000, 4096)
    assert config._attn_implementation == "sdpa" and not config.use_cache and not config.tie_word_embeddings


def test_hf_policy_computes_llama_model_forward(hf):
    model = hf.build_hf_policy("hf-llama:tiny", device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, values = model(tokens)
    assert logits.shape == (2, 12, model.config.vocab_size) and values.shape == (2, 12)
    hidden = model.model(input_ids=tokens).last_hidden_state  # HF's own forward, mask and all
    torch.testing.assert_close(logits, model.lm_head(hidden), rtol=0, atol=1e-6)


def test_hf_policy_init_follows_its_rules_and_restores_buffers(hf):
    model = hf.build_hf_policy("hf-llama:tiny", device="cpu", seed=3)
    params = dict(model.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1) and torch.all(params["value_head.bias"] == 0)
    assert abs(params["model.embed_tokens.weight"].std().item() - 0.02) < 2e-3
    again = hf.build_hf_policy("hf-llama:tiny", device="cpu", seed=3)
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
    expected, _ = model.model.rotary_emb.compute_default_rope_parameters(model.config)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)


def test_hf_policy_exports_causal_sdpa_without_a_mask(hf):
    from torch.export import Dim

    model = hf.build_hf_policy("hf-llama:tiny", device="cpu")
    tokens = torch.zeros(2, 8, dtype=torch.long)
    exported = torch.export.export(model, (tokens,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},), strict=False)
    sdpa = [n for n in exported.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == model.config.num_hidden_layers
    for node in sdpa:  # no mask and is_causal: the flash kernel on a GPU
        attn_mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        assert attn_mask is None and is_causal is True, (node.args, node.kwargs)


@pytest.mark.slow
def test_hf_policy_captures_on_meta(hf, tiny_graph):
    names = [layer.name for layer in tiny_graph.layers]
    assert names[0] == "model.embed_tokens" and names[-2:] == ["lm_head", "value_head"]
    assert tiny_graph.num_blocks == 2 and tiny_graph.vocab == 256 and tiny_graph.hidden == 64
    kinds = {layer.name: layer.kind for layer in tiny_graph.layers}
    assert kinds["model.layers.1.self_attn"] == "attention" and kinds["model.layers.1.mlp"] == "mlp"
    roles = {p.name: p.tp_role for layer in tiny_graph.layers for p in layer.params}
    assert roles["model.layers.0.self_attn.o_proj.weight"] == "row"
    assert roles["model.layers.0.mlp.gate_proj.weight"] == "column"
    model = hf.build_hf_policy("hf-llama:tiny")
    captured = sum(math.prod(p.global_shape) for layer in tiny_graph.layers for p in layer.params)
    assert captured == sum(p.numel() for p in model.parameters())


def test_build_hf_policy_refuses_an_unknown_spec(hf):
    with pytest.raises(ValueError, match="allowed"):
        hf.build_hf_policy("hf-llama:13b")
    with pytest.raises(ValueError, match="not an hf-\\* spec"):
        hf.build_hf_policy("llama:tiny")


# --------------------------------------------------------------------------- the bench


BASE = ["--model", "llama:tiny", "--cluster", "cpu:1x2", "--out", "/tmp/x"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--warmup", "5", "--steps", "5"], "--warmup 5"),
    (["--seq", "2"], "--seq 2"),
    (["--batch", "0"], "--batch 0"),
    (["--baseline", "fsdp2", "--weights", "safetensors"], "meta"),
    (["--cluster", "nonsense:9"], "--cluster"),
])
def test_bench_refuses_bad_arguments(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(BASE + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_an_unknown_model(capsys):
    for model in ("llama:huge", "hf-llama:huge", "hf-qwen2:7b"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--model", model] + BASE[2:])
        assert f"--model {model!r}" in capsys.readouterr().err


def test_bench_defaults():
    args = bench.parse_args(["--model", "hf-llama:7b", "--cluster", "h100-sxm:1x2", "--out", "/tmp/x"])
    assert (args.weights, args.baseline, args.steps, args.warmup, args.precision) == ("meta", None, 20, 3, "bf16")
    assert args.weights_dir == Path("/tmp/autoshard_materialize/hf-llama_7b")


@pytest.mark.slow  # over ~3 s: not in make test-fast
def test_plan_fields_runs_and_counts(tiny_graph):
    from autoshard.plan import Mesh
    from benchmarks.baselines.autoshard_trainer import uniform_plan

    plan = uniform_plan(tiny_graph, Mesh(dp_shard=2), state="zero3", global_batch=4, seq_len=16)
    fields = bench.plan_fields(plan)
    assert fields["mesh"]["dp_shard"] == 2 and fields["states"] == {"zero3": len(tiny_graph.layers)}
    assert fields["state_runs"] == [{"state": "zero3", "first": "model.embed_tokens", "last": "value_head",
                                     "count": len(tiny_graph.layers)}]


def test_write_weights_writes_a_sharded_directory_once(hf, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from autoshard.runtime._safetensors_source import INDEX_NAME

    monkeypatch.setattr(bench, "MAX_SHARD_BYTES", 20_000)  # several files for a tiny model
    model = hf.build_hf_policy("hf-llama:tiny")
    assert bench.write_weights(model, "hf-llama:tiny", tmp_path, 0, torch.device("cpu"))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {name for name, _ in model.named_parameters()}
    assert len(set(index["weight_map"].values())) > 1
    from safetensors import safe_open

    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(tmp_path / index["weight_map"][name], "pt") as f:
        value = f.get_tensor(name)
    assert value.dtype == torch.bfloat16 and value.shape == (64, 128) and 0.01 < value.float().std() < 0.03
    assert not bench.write_weights(model, "hf-llama:tiny", tmp_path, 0, torch.device("cpu"))  # reused
    assert bench.write_weights(model, "hf-llama:tiny", tmp_path, 1, torch.device("cpu"))  # another seed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world_of_one(tmp_path, monkeypatch, *extra: str) -> dict:
    """``main`` in this process, a gloo world of one; the row it appended."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(key, value)
    code = bench.main(["--device", "cpu", "--cluster", "cpu:1x1", "--precision", "fp32", "--seq", "8", "--batch", "2",
                       "--steps", "3", "--warmup", "1", "--out", str(tmp_path), *extra])
    rows = [json.loads(line) for line in (tmp_path / bench.RESULTS_FILE).read_text().splitlines()]
    assert len(rows) == 1
    assert code == (0 if rows[0]["status"] == "ok" else 1)
    return rows[0]


@pytest.mark.slow
def test_bench_runs_a_reference_model_in_a_world_of_one(tmp_path, monkeypatch):
    row = _run_world_of_one(tmp_path, monkeypatch, "--model", "llama:tiny")
    assert row["status"] == "ok", row["status"]
    assert row["config"] == "autoshard" and row["world_size"] == 1 and len(row["losses"]) == 3
    assert row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
    assert row["build_peak_gib"] == row["report"]["build_peak_gib"] > 0  # the runtime's CPU live-bytes count
    assert row["predicted_build_peak_gib"] > 0 and row["step_peak_gib"] is None  # no CUDA counter


@pytest.mark.slow
def test_bench_runs_the_hf_policy_in_a_world_of_one(hf, tmp_path, monkeypatch):
    row = _run_world_of_one(tmp_path, monkeypatch, "--model", "hf-llama:tiny")
    assert row["status"] == "ok", row["status"]


# --------------------------------------------------------------------------- the summary


def _row(**fields) -> dict:
    base = {"model": "llama:7b", "config": "autoshard", "weights": "meta", "card": "NVIDIA H100 80GB HBM3",
            "world_size": 2, "torch": "2.11.0", "transformers": "5.17.0", "seq": 1024, "batch": 8, "steps": 20,
            "warmup": 3, "date": "2026-11-26T22:00:00+00:00", "plan": "dp_shard=2; zero2×66; m=2 mb=2",
            "predicted_peak_gib": 73.25, "predicted_build_peak_gib": 51.18, "build_peak_gib": 50.5,
            "step_peak_gib": 72.0, "step_ms_median": 412.34, "step_ms_min": 400.0, "step_ms_max": 430.9,
            "build_s": 14.2, "loss_first": 10.61, "loss_last": 9.87, "status": "ok"}
    return {**base, **fields}


def test_summary_tables(tmp_path, capsys):
    rows = [_row(), _row(weights="safetensors", weights_reused=True),
            _row(config="fsdp2", plan="≈ dp_shard=2; zero3×132", predicted_build_peak_gib=None),
            {"model": "hf-llama:7b", "config": "autoshard", "weights": "meta", "world_size": 2,
             "status": "killed: exit 124 after 240s, no row written"},
            _row(card="cpu", world_size=2, build_peak_gib=None, step_peak_gib=None, report={"build_peak_gib": 0.25})]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    assert summary.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert text.count("| model |") == 2  # one table per (card, world)
    assert "| llama:7b | autoshard | meta | dp_shard=2; zero2×66; m=2 mb=2 | 73.25 | 51.18 | 50.50 | 72.00 | " \
           "412.3 (400.0–430.9) | 14.2 | 10.610 → 9.870 | ok |" in text
    assert "| safetensors (reused) |" in text and "| fsdp2 | meta | ≈ dp_shard=2; zero3×132 | 73.25 | – |" in text
    assert "| hf-llama:7b | autoshard | meta | – | – | – | – | – | – | – | – | killed: exit 124" in text
    assert "| 0.25 | – |" in text  # the CPU row's build peak from the runtime's report
    assert "m.jsonl:6: not JSON" in text


def test_summary_needs_existing_files(tmp_path, capsys):
    assert summary.main([]) == 2
    assert summary.main([str(tmp_path / "absent.jsonl")]) == 2
    assert "missing" in capsys.readouterr().err
