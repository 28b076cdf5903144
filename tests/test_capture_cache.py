"""``passes/_capture_cache.py``: capture's results on disk, keyed by structure, code, inputs and options."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.models import build
from autoshard.passes import _capture_cache

capture_module = importlib.import_module("autoshard.passes.capture")  # the module (the package exports the function)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(_capture_cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOSHARD_EXPORT_CACHE", raising=False)
    return tmp_path / "cache" / "capture"


def _counting(monkeypatch):
    calls = []
    real = capture_module._capture

    def counted(*args, **kwargs):
        calls.append(args[2])  # model_name
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_module, "_capture", counted)
    return calls


def test_a_second_capture_reads_the_first_and_equals_it(cache, monkeypatch):
    calls = _counting(monkeypatch)
    first = capture_module.capture(build("gpt:tiny", device="meta"), name="gpt:tiny", seq_lens=(8, 16))
    again = capture_module.capture(build("gpt:tiny", device="meta"), name="gpt:tiny", seq_lens=(8, 16))
    assert calls == ["gpt:tiny"] and again == first and len(list(cache.glob("*.pkl"))) == 1


def test_options_inputs_and_structure_are_in_the_key(cache, monkeypatch):
    calls = _counting(monkeypatch)
    capture_module.capture(build("gpt:tiny", device="meta"), name="gpt:tiny", seq_lens=(8, 16))
    capture_module.capture(build("gpt:tiny", device="meta"), name="gpt:tiny", seq_lens=(8, 32))  # option
    capture_module.capture(build("gpt:tiny", device="meta"), name="other", seq_lens=(8, 16))  # name
    capture_module.capture(build("gpt:tiny", device="meta", num_layers=3), name="gpt:tiny", seq_lens=(8, 16))
    capture_module.capture(build("gpt:tiny", device="meta", dtype=torch.bfloat16), name="gpt:tiny", seq_lens=(8, 16))
    tokens = torch.zeros(2, 16, dtype=torch.long)
    capture_module.capture(build("gpt:tiny", device="meta"), (tokens,), name="gpt:tiny")
    capture_module.capture(build("gpt:tiny", device="meta"), (tokens[:, :12],), name="gpt:tiny")  # input shape
    assert len(calls) == 7


def _module_from(path: Path, source: str, name: str):
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


MODEL = """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.{act}(self.fc(x))

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(8, 32)
            self.value = nn.Linear(8, 1)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x), self.value(x).squeeze(-1)
"""


def test_an_edit_of_the_model_file_is_a_new_key_and_sourceless_classes_get_none(cache, tmp_path):
    tanh = _module_from(tmp_path / "m1.py", MODEL.format(act="tanh"), "cache_test_model")
    key = _capture_cache.capture_key(tanh.Policy(), None, ("p",))
    relu = _module_from(tmp_path / "m1.py", MODEL.format(act="relu"), "cache_test_model")
    assert key is not None and _capture_cache.capture_key(relu.Policy(), None, ("p",)) not in (None, key)
    namespace: dict = {"nn": nn}
    exec("class Bare(nn.Module):\n    def forward(self, x):\n        return x\n", namespace)  # no source file
    assert _capture_cache.capture_key(namespace["Bare"](), None, ("p",)) is None


def test_off_switch_and_a_damaged_entry(cache, monkeypatch):
    calls = _counting(monkeypatch)
    model = build("gpt:tiny", device="meta")
    key = _capture_cache.capture_key(model, None, ("gpt:tiny", (8, 16), 2, True, False))
    capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))
    (cache / f"{key}.pkl").write_bytes(b"not a pickle")
    capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))  # unreadable: captured again, rewritten
    capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))  # read
    monkeypatch.setenv("AUTOSHARD_EXPORT_CACHE", "0")
    assert _capture_cache.capture_key(model, None, ("x",)) is None
    capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))
    assert len(calls) == 3


@pytest.mark.slow
def test_another_process_reads_the_entry(cache):
    """A fresh interpreter (another hash seed, other object ids) forms the same key and reads the graph."""
    program = textwrap.dedent("""
        import importlib
        from autoshard.models import build
        c = importlib.import_module("autoshard.passes.capture")
        calls = []
        real = c._capture
        c._capture = lambda *a, **k: calls.append(1) or real(*a, **k)
        graph = c.capture(build("llama:tiny", device="meta"), name="llama:tiny", seq_lens=(8, 16))
        print(len(calls), graph.fingerprint())
    """)
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    runs = [subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    (first_calls, first), (second_calls, second) = (run.stdout.split()[-2:] for run in runs)
    assert (first_calls, second_calls) == ("1", "0") and first == second
