"""The CLI takes the user's own model (``autoshard/models/source.py``): ``package.module:factory`` or
``path/to/file.py:factory`` for ``capture``, ``plan`` (and ``plan --plan``) and ``explain``, built on meta
(a factory that takes ``device`` is built there; one that does not is moved there); bad inputs name
the part that is wrong. Models: ``tests/_user_models.py`` (written outside the project's conventions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autoshard.cli import main
from autoshard.errors import ModelError
from autoshard.models.source import build_from_factory, is_factory_spec, load_model

HERE = Path(__file__).resolve().parent
FILE_SPEC = f"{HERE / '_user_models.py'}:nano_policy"
ARGS = ("--batch", "4", "--seq", "64")


def test_specs_are_told_apart():
    assert not is_factory_spec("llama:7b") and not is_factory_spec("GPT") and not is_factory_spec("moe:tiny")
    assert is_factory_spec("_user_models:nano_policy")  # a top-level module on sys.path
    assert is_factory_spec("pkg.models:make") and is_factory_spec("models.py:make") and is_factory_spec(FILE_SPEC)


def test_factories_build_on_meta_in_the_compute_dtype():
    model, name = load_model("_user_models:nano_policy")
    assert name == "_user_models:nano_policy"
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    moved = build_from_factory("_user_models:cpu_only_policy")  # no device argument: built, then moved
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in moved.parameters())
    assert len(moved.blocks) == 3


@pytest.mark.slow
def test_capture_plan_reuse_and_explain_a_user_model(capsys, tmp_path):
    assert main(["capture", FILE_SPEC, "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "blocks.1.qkv" in out and "lm_head" in out

    path = tmp_path / "plan.json"
    assert main(["plan", "_user_models:nano_policy", "--cluster", "cpu:1x2", *ARGS, "-o", str(path)]) == 0
    plan = json.loads(path.read_text())
    assert plan["model_name"] == "_user_models:nano_policy"
    capsys.readouterr()
    assert main(["plan", "--plan", str(path), "--cluster", "cpu:1x2"]) == 0  # rebuilds the model by its name
    assert "search skipped" in capsys.readouterr().out
    assert main(["explain", str(path), "--layer", "blocks.0.fc"]) == 0
    assert "blocks.0.fc" in capsys.readouterr().out


@pytest.mark.parametrize("spec,message", [
    ("nosuch_pkg.models:make", "cannot import module 'nosuch_pkg.models'"),
    ("_user_models:missing", "has no attribute 'missing'; callables there: "),
    ("_user_models:NOT_CALLABLE", "is a int, not a callable"),
    ("_user_models:not_a_module", "returned a dict, not a torch.nn.Module"),
    ("_user_models:raises", "raised RuntimeError: checkpoint missing"),
    ("does/not/exist.py:make", "no Python file"),
])
def test_bad_models_name_what_is_wrong(spec, message, capsys):
    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(spec)
    assert main(["plan", spec, "--cluster", "cpu:1x2", *ARGS]) != 0
    assert message.split(";")[0] in capsys.readouterr().err


transformers = pytest.importorskip("transformers")


def _saved(tmp_path, name, config) -> Path:
    config.save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.slow
def test_hugging_face_config_directories_and_files(capsys, tmp_path):
    """A Hugging Face model directory (``save_pretrained``'s config.json) or the JSON file itself plans
    and explains through ``autoshard.models.hf.actor_critic``; an unsupported model type is refused with
    the supported ones, a directory without config.json with the reason."""
    llama = _saved(tmp_path, "llama", transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128))
    gpt2 = _saved(tmp_path, "gpt2", transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                                           n_positions=128))
    model, name = load_model(str(llama))
    assert name == str(llama) and all(p.is_meta for p in model.parameters())
    logits_shape = model.lm_head.weight.shape
    assert tuple(logits_shape) == (256, 64) and model.config.use_cache is False

    path = tmp_path / "plan.json"
    assert main(["plan", str(llama), "--cluster", "cpu:1x2", *ARGS, "-o", str(path)]) == 0
    assert main(["explain", str(path), "--layer", "model.layers.0.mlp"]) == 0
    assert main(["capture", str(gpt2 / "config.json"), "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp" in out and "model.h.1.attn" in out

    bert = _saved(tmp_path, "bert", transformers.BertConfig(hidden_size=64, num_hidden_layers=1,
                                                           num_attention_heads=4, intermediate_size=128))
    with pytest.raises(ModelError, match="model_type 'bert' has no actor-critic policy here; supported: gemma, gpt2"):
        load_model(str(bert))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="a directory without config.json"):
        load_model(str(tmp_path / "empty"))
