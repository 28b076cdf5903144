"""Hugging Face weights in and out (``runtime/hf_export.py``, ``Safetensors`` sources, ``autoshard export``).

One spawned 2-rank gloo job (module fixture ``job``) reads tiny HF models slice-wise into sharded plans:
a Llama saved by ``save_pretrained(max_shard_size="50KB")`` (ten shards and an index) under ZeRO-3 and
DDP, a GPT-2 with tied embeddings under ZeRO-3. Each program takes one SGD step (so the exported weights
are the program's, not the files'), returns every rank's regions of its fp32 masters and its logits, and
saves a checkpoint; the ZeRO-3 Llama is also exported live (``export_program``). The parent assembles
the regions into full tensors and holds ``from_pretrained`` of every export to them: weights bit-equal,
logits equal to the program's. Tiny configs, CPU, fp32.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _harness import run_gloo_cases  # noqa: E402
from _runtime_cases import loss_fn  # noqa: E402
from autoshard.cli import main  # noqa: E402
from autoshard.runtime._checkpoint_files import CheckpointError  # noqa: E402
from autoshard.runtime.hf_export import (  # noqa: E402
    ExportError,
    export_checkpoint,
    hf_name_map,
    parse_size,
    resolve_config,
)

pytestmark = pytest.mark.slow  # spawned gloo ranks

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=64)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
WORLD = 2


def _tokens(batch: int = 2 * WORLD):
    return torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- rank side


def _program(world_size, directory, state):
    """An actor-critic from ``directory``'s config, trunk and LM head read slice-wise from its files (HF names
    through ``hf_name_map``), the value head initialised, under ``state`` on every layer."""
    from autoshard.models.hf import actor_critic, load_hf_config
    from autoshard.passes import capture
    from autoshard.plan import LayerStrategy, Mesh, Plan
    from autoshard.runtime import BuildOptions, build_program
    from autoshard.runtime.hf_export import hf_name_map
    from autoshard.runtime.materialize import Initialize, Layered, Safetensors
    from autoshard.runtime.optimizer import OptimizerConfig
    from autoshard.train import TrainSpec

    config = load_hf_config(directory)
    policy = actor_critic(config, dtype=torch.float32)
    graph = capture(policy, seq_lens=(8, 16))
    plan = Plan(model_name=graph.model_name, mesh=Mesh(dp_shard=world_size),
                layers=tuple(LayerStrategy(layer=layer.name, state=state) for layer in graph.layers))
    program = build_program(policy, graph, plan, TrainSpec(global_batch=2 * world_size, seq_len=16,
                                                                 precision="fp32"),
                            optimizer=OptimizerConfig(name="sgd", lr=0.5, max_grad_norm=None),
                            weights=Layered(Safetensors(directory, name_map=hf_name_map(config)), Initialize(0)),
                            options=BuildOptions(compile=False))
    return program, config


def _regions(program):
    masters = program.local_state_dict()
    return {fqn: (placement.region(program.ctx), placement.global_shape, masters[fqn].clone())
            for fqn, placement in program.param_placements.items()}


def _case(rank, world_size, directory, state, root=None, record_config=True, live=False):
    """Logits as loaded; one SGD step; regions and logits after it; a checkpoint (and a live export)."""
    from pathlib import Path

    from autoshard.runtime.checkpoint import program_state, save
    from autoshard.runtime.hf_export import export_program, hf_config_extras

    del rank
    program, config = _program(world_size, directory, state)
    out = {"loaded": _regions(program)}
    with torch.no_grad():
        out["loaded_logits"] = program(_tokens(2))[0]
    if root is None:
        return out
    program.step(program.local_batch(_tokens()), loss_fn)
    with torch.no_grad():
        out["logits"] = program(_tokens(2))[0]
    out["regions"] = _regions(program)
    extras = hf_config_extras(config) if record_config else {}  # else the CLI is given --config
    save(Path(root) / "ckpt", program_state(program, step=1, extras=extras))
    if live:
        out["live"] = export_program(program, Path(root) / "live", config, step=1)
    return out


# --------------------------------------------------------------------------- parent side


def _assemble(per_rank, key="regions"):
    full = {}
    for result in per_rank:
        for fqn, (region, shape, master) in result[key].items():
            full.setdefault(fqn, torch.full(shape, float("nan")))[region] = master
    assert not any(t.isnan().any() for t in full.values())
    return full


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_export")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    llama.save_pretrained(root / "llama", max_shard_size="50KB")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    gpt2.save_pretrained(root / "gpt2")
    cases = {
        "llama_zero3": functools.partial(_case, directory=str(root / "llama"), state="zero3",
                                         root=str(root / "llama_zero3"), live=True),
        "llama_ddp": functools.partial(_case, directory=str(root / "llama"), state="replicate"),
        "gpt2_zero3": functools.partial(_case, directory=str(root / "gpt2"), state="zero3",
                                        root=str(root / "gpt2_zero3"), record_config=False),
    }
    results = run_gloo_cases(cases, WORLD, timeout_s=300)
    with torch.no_grad():
        hf_logits = {"llama": llama(_tokens(2)).logits, "gpt2": gpt2(_tokens(2)).logits}
    return {"root": root, "results": results, "hf_logits": hf_logits, "hf_models": {"llama": llama, "gpt2": gpt2}}


def _assert_exact(hf_model, program_weights):
    """The HF model's parameters (tied ones once) are the program's trunk and LM head, bit for bit."""
    params, to_hf = dict(hf_model.named_parameters()), hf_name_map(hf_model.config)
    for fqn, tensor in program_weights.items():
        if fqn.startswith("value_head."):
            continue
        assert torch.equal(params[to_hf(fqn)].detach(), tensor), fqn
    assert len(params) == len([f for f in program_weights if not f.startswith("value_head.")])


def test_sharded_hf_directory_loads_into_zero3_and_ddp(job):
    assert len(list((job["root"] / "llama").glob("model-*-of-*.safetensors"))) > 1
    for case, family in (("llama_zero3", "llama"), ("llama_ddp", "llama"), ("gpt2_zero3", "gpt2")):
        _assert_exact(job["hf_models"][family], _assemble(job["results"][case], "loaded"))
        for out in job["results"][case]:  # GPT-2: tied embeddings, trunk under 'transformer.'
            torch.testing.assert_close(out["loaded_logits"], job["hf_logits"][family], atol=1e-5, rtol=0)


def test_zero3_checkpoint_exports_exactly_sharded(job, tmp_path):
    per_rank = job["results"]["llama_zero3"]
    weights = _assemble(per_rank)
    result = export_checkpoint(job["root"] / "llama_zero3" / "ckpt", tmp_path / "out", max_shard_size="100KB",
                               value_head=tmp_path / "value_head.safetensors")
    assert result.config_source == "checkpoint extras" and result.dtype == torch.float32 and result.step == 1
    assert len(result.files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert result.dropped == ("value_head.bias", "value_head.weight")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    _assert_exact(model, weights)
    original = transformers.LlamaForCausalLM.from_pretrained(job["root"] / "llama").model.embed_tokens.weight
    assert not torch.equal(original, weights["model.embed_tokens.weight"])  # the step moved it: the program's weights
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(2)).logits, per_rank[0]["logits"], atol=1e-5, rtol=0)
    from safetensors.torch import load_file

    head = load_file(tmp_path / "value_head.safetensors")
    assert set(head) == {"value_head.weight", "value_head.bias"}
    assert all(torch.equal(head[k], weights[k]) for k in head)


def test_exported_directory_reads_back_slice_wise(job, tmp_path):
    from autoshard.runtime._safetensors_source import SafetensorsSource

    weights = _assemble(job["results"]["llama_zero3"])
    export_checkpoint(job["root"] / "llama_zero3" / "ckpt", tmp_path / "out", max_shard_size="100KB")
    trunk = {fqn: tuple(t.shape) for fqn, t in weights.items() if not fqn.startswith("value_head.")}
    with SafetensorsSource(tmp_path / "out") as source:
        source.check(trunk)
        for fqn, shape in trunk.items():
            region = (slice(1, shape[0]),) + tuple(slice(0, n) for n in shape[1:])
            assert torch.equal(source.read(fqn, shape, region, "cpu"), weights[fqn][region]), fqn


def test_live_program_export_equals_the_checkpoint_export(job):
    per_rank = job["results"]["llama_zero3"]
    assert all(out["live"].directory == job["root"] / "llama_zero3" / "live" for out in per_rank)
    model = transformers.LlamaForCausalLM.from_pretrained(job["root"] / "llama_zero3" / "live")
    _assert_exact(model, _assemble(per_rank))
    assert not list((job["root"] / "llama_zero3").glob(".live.checkpoint-*"))  # the staging checkpoint is gone


def test_bf16_export_is_one_file_in_bf16(job, tmp_path):
    weights = _assemble(job["results"]["llama_zero3"])
    result = export_checkpoint(job["root"] / "llama_zero3" / "ckpt", tmp_path / "out", dtype="bf16")
    assert result.files == ("model.safetensors",) and result.dtype == torch.bfloat16
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    _assert_exact(model.float(), {k: v.to(torch.bfloat16).float() for k, v in weights.items()})


def test_cli_exports_tied_gpt2_with_a_config(job, tmp_path, capsys):
    per_rank = job["results"]["gpt2_zero3"]
    weights = _assemble(per_rank)
    assert "lm_head.weight" not in weights  # the policy holds the tied head once, as HF does
    code = main(["export", str(job["root"] / "gpt2_zero3" / "ckpt"), "-o", str(tmp_path / "out"),
                 "--config", str(job["root"] / "gpt2")])
    assert code == 0, capsys.readouterr().err
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    _assert_exact(model, weights)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(2)).logits, per_rank[0]["logits"], atol=1e-5, rtol=0)


def _cli_error(capsys, *argv) -> str:
    assert main(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoshard: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_refuses_bad_input_in_one_line(job, tmp_path, capsys):
    llama_ckpt, gpt2_ckpt = job["root"] / "llama_zero3" / "ckpt", job["root"] / "gpt2_zero3" / "ckpt"
    assert "no checkpoint at" in _cli_error(capsys, tmp_path / "nothing", "-o", tmp_path / "out")
    (tmp_path / "partial").mkdir()
    assert "not a committed autoshard checkpoint" in _cli_error(capsys, tmp_path / "partial", "-o", tmp_path / "out")
    err = _cli_error(capsys, gpt2_ckpt, "-o", tmp_path / "out")
    assert "records no Hugging Face config" in err and "--config" in err
    err = _cli_error(capsys, llama_ckpt, "-o", tmp_path / "out", "--config", job["root"] / "gpt2")
    assert "does not match a GPT2LMHeadModel" in err and "first:" in err
    assert "'model.embed_tokens.weight' (as 'transformer.embed_tokens.weight') is not in the model" in err
    wider = transformers.LlamaConfig(**{**LLAMA, "vocab_size": 512})
    wider.save_pretrained(tmp_path / "wider")
    err = _cli_error(capsys, llama_ckpt, "-o", tmp_path / "out", "--config", tmp_path / "wider")
    assert "'model.embed_tokens.weight' is [256, 64] in the checkpoint, [512, 64] in the model" in err
    transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    err = _cli_error(capsys, llama_ckpt, "-o", tmp_path / "out", "--config", tmp_path / "tied")
    assert "1 mismatch, first: 'lm_head.weight' (as 'lm_head.weight') is tied to another parameter" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not an empty directory" in _cli_error(capsys, llama_ckpt, "-o", tmp_path / "full")
    assert "max_shard_size" in _cli_error(capsys, llama_ckpt, "-o", tmp_path / "out", "--max-shard-size", "lots")
    assert "dtype" in _cli_error(capsys, llama_ckpt, "-o", tmp_path / "out", "--dtype", "int8")
    assert not (tmp_path / "out").exists()


def test_options_and_the_plan_model_as_config_source(job, tmp_path):
    from autoshard.runtime._checkpoint_files import CheckpointInfo

    assert parse_size("50KB") == 50_000 and parse_size("2GiB") == 2 * 2**30 and parse_size(1000) == 1000
    with pytest.raises(ExportError):
        parse_size("0MB")
    with pytest.raises(CheckpointError):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")
    planned = CheckpointInfo("", 0, 2, {}, plan={"model_name": str(job["root"] / "llama")})  # `autoshard plan DIR`
    config, source = resolve_config(None, planned)
    assert config.model_type == "llama" and source == f"the plan's model {job['root'] / 'llama'}"
