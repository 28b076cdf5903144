"""``passes/_capture_cache.py``: capture's results on disk, keyed by structure, code, inputs and options."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
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


def _key(model, example_inputs=None, name="gpt:tiny", seq_lens=(8, 16)):
    return _capture_cache.capture_key(model, example_inputs, (name, seq_lens, 2, True, False))  # capture's options


def test_options_inputs_and_structure_are_in_the_key(cache):
    tokens = torch.zeros(2, 16, dtype=torch.long)
    keys = [
        _key(build("gpt:tiny", device="meta")),
        _key(build("gpt:tiny", device="meta"), seq_lens=(8, 32)),  # an option
        _key(build("gpt:tiny", device="meta"), name="other"),  # the name
        _key(build("gpt:tiny", device="meta", num_layers=3)),  # structure
        _key(build("gpt:tiny", device="meta", dtype=torch.bfloat16)),  # dtype
        _key(build("gpt:tiny", device="cpu")),  # the parameters' device
        _key(build("gpt:tiny", device="meta"), (tokens,)),
        _key(build("gpt:tiny", device="meta"), (tokens[:, :12],)),  # an input's shape
        _key(build("llama:tiny", device="meta")),  # another class
    ]
    assert None not in keys and len(set(keys)) == len(keys)
    assert _key(build("gpt:tiny", device="meta")) == keys[0]  # a second build of the same model: the same key


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
    key = _key(model)
    (cache).mkdir(parents=True)
    (cache / f"{key}.pkl").write_bytes(b"not a pickle")
    graph = capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))  # unreadable: captured, rewritten
    assert calls == ["gpt:tiny"] and _capture_cache.load(key) == graph
    monkeypatch.setenv("AUTOSHARD_EXPORT_CACHE", "0")
    assert _key(model) is None and _capture_cache.cache_dir() is None


@pytest.mark.slow
def test_another_process_reads_the_entry(cache):
    """A fresh interpreter (another hash seed, other object ids) forms this process's key and reads its graph."""
    program = textwrap.dedent("""
        import hashlib, importlib, json
        from autoshard.models import build
        c = importlib.import_module("autoshard.passes.capture")
        calls = []
        real = c._capture
        c._capture = lambda *a, **k: calls.append(1) or real(*a, **k)
        graph = c.capture(build("llama:tiny", device="meta"), name="llama:tiny", seq_lens=(8, 16))
        print(len(calls), hashlib.sha256(json.dumps(graph.to_dict(), sort_keys=True).encode()).hexdigest())
    """)
    graph = capture_module.capture(build("llama:tiny", device="meta"), name="llama:tiny", seq_lens=(8, 16))
    env = {**os.environ, "PYTHONHASHSEED": "random"}  # the fixture's AUTOSHARD_CACHE_DIR among it
    run = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    whole = hashlib.sha256(json.dumps(graph.to_dict(), sort_keys=True).encode()).hexdigest()  # every field
    assert run.stdout.split()[-2:] == ["0", whole]


def test_a_process_waiting_on_the_lock_reads_the_entry_instead_of_capturing(cache, monkeypatch):
    """Note "one process traces": while one holds a key's lock, another capture of that model waits, then
    reads what the first wrote (here a stand-in graph: had the waiter captured, it would return its own)."""
    import dataclasses
    import threading

    calls = _counting(monkeypatch)
    model = build("gpt:tiny", device="meta")
    key = _key(model)
    stand_in = dataclasses.replace(capture_module.capture(model, name="other", seq_lens=(8, 16)), model_name="written")
    calls.clear()
    got = []
    with _capture_cache.locked(key):
        waiter = threading.Thread(target=lambda: got.append(capture_module.capture(model, name="gpt:tiny", seq_lens=(8, 16))))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not got  # blocked on the lock, not capturing
        _capture_cache.store(key, stand_in)
    waiter.join(timeout=60)
    assert got == [stand_in] and calls == []
