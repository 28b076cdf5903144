"""SafetensorsSource (runtime/_safetensors_source.py): regions read from safetensors files.

Pure unit tests, no process group: regions of a single file and of a sharded
directory written by ``write_sharded`` equal slices of the original tensors;
name maps; every refused checkpoint raises a one-line ``CheckpointError``
naming the tensor and the file; and ``read`` of a one-row region reads that
row only (``safe_open`` wrapped so a full-tensor read fails the test).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard.errors import AutoshardError
from autoshard.runtime._checkpoint_files import CheckpointError
from autoshard.runtime._safetensors_source import INDEX_NAME, SafetensorsSource, write_sharded

# name -> global shape, in model order; fp32 at 4 bytes per element.
SHAPES = {"emb.weight": (10, 6), "blocks.0.attn.q.weight": (6, 6), "blocks.0.mlp.b": (7,), "norm.g": (6,)}
REGIONS = [
    (slice(0, 10), slice(0, 6)),  # whole tensor
    (slice(3, 7), slice(0, 6)),  # rows (dim 0)
    (slice(0, 10), slice(2, 5)),  # columns (dim 1)
    (slice(8, 10), slice(1, 4)),  # both dims
    (slice(4, 4), slice(0, 6)),  # empty along dim 0
    (slice(0, 10), slice(6, 6)),  # empty along dim 1
]


def _weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in SHAPES.items()}


def _save(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def _sharded(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    # Tensor bytes 240, 144, 28, 24 under a 160-byte cap: files emb | q | b + g.
    return write_sharded(tensors or _weights(), tmp_path / "ckpt", max_shard_bytes=160)


def _refusal(source: SafetensorsSource, expected=SHAPES) -> str:
    with pytest.raises(CheckpointError) as info:
        source.check(expected)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, AutoshardError) and isinstance(info.value, ValueError)
    return message


# --------------------------------------------------------------------------- round trips


def test_single_file_regions_round_trip(tmp_path):
    weights = _weights()
    with SafetensorsSource(_save(tmp_path, weights)) as source:
        source.check(SHAPES)
        for region in REGIONS:
            out = source.read("emb.weight", SHAPES["emb.weight"], region, "cpu")
            assert out.dtype == torch.float32 and out.is_contiguous()
            assert torch.equal(out, weights["emb.weight"][region])
        out = source.read("blocks.0.mlp.b", (7,), (slice(2, 5),), torch.device("cpu"))
        assert torch.equal(out, weights["blocks.0.mlp.b"][2:5])


def test_sharded_directory_regions_round_trip(tmp_path):
    weights = _weights()
    directory = _sharded(tmp_path, weights)
    index = json.loads((directory / INDEX_NAME).read_text())
    assert list(index["weight_map"]) == list(SHAPES)  # order kept
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in weights.values())
    source = SafetensorsSource(directory)
    assert source.describe() == f"safetensors directory {directory} (3 files)"
    source.check(SHAPES)
    for name, shape in SHAPES.items():
        for region in REGIONS:
            region = region[: len(shape)]
            region = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(region, shape))
            assert torch.equal(source.read(name, shape, region, "cpu"), weights[name][region])
    source.close()
    # A closed source reopens its files on the next read.
    assert torch.equal(source.read("norm.g", (6,), (slice(1, 3),), "cpu"), weights["norm.g"][1:3])
    source.close()


def test_directory_with_one_unindexed_file(tmp_path):
    weights = _weights()
    _save(tmp_path, weights)
    with SafetensorsSource(tmp_path) as source:
        source.check(SHAPES)
        assert torch.equal(source.read("norm.g", (6,), (slice(0, 6),), "cpu"), weights["norm.g"])


def test_bf16_file_reads_as_upcast_fp32(tmp_path):
    weights = _weights(torch.bfloat16)
    with SafetensorsSource(_save(tmp_path, weights)) as source:
        source.check(SHAPES)
        region = (slice(2, 9), slice(1, 5))
        out = source.read("emb.weight", (10, 6), region, "cpu")
        assert out.dtype == torch.float32
        assert torch.equal(out, weights["emb.weight"].float()[region])


def test_name_map_dict_and_callable(tmp_path):
    weights = _weights()
    path = _save(tmp_path, {"model." + k: v for k, v in weights.items()})
    as_dict = {k: "model." + k for k in SHAPES}
    for name_map in (as_dict, lambda fqn: "model." + fqn):
        with SafetensorsSource(path, name_map=name_map) as source:
            source.check(SHAPES)
            out = source.read("emb.weight", (10, 6), (slice(1, 2), slice(0, 6)), "cpu")
            assert torch.equal(out, weights["emb.weight"][1:2])
    # Absent from the dict / None from the callable: the FQN itself.
    path = _save(tmp_path, {"tok.w": weights["emb.weight"], "norm.g": weights["norm.g"]}, "renamed.safetensors")
    expected = {"emb.weight": (10, 6), "norm.g": (6,)}
    for name_map in ({"emb.weight": "tok.w"}, lambda fqn: "tok.w" if fqn == "emb.weight" else None):
        with SafetensorsSource(path, name_map=name_map) as source:
            source.check(expected)
            assert torch.equal(source.read("norm.g", (6,), (slice(0, 6),), "cpu"), weights["norm.g"])


def test_write_sharded_writes_tied_weights_once_and_copies_views(tmp_path):
    fused = torch.randn(6, 4)
    emb = torch.randn(5, 3)
    state = {"emb": emb, "head": emb, "qkv": fused, "q": fused[:2], "kT": fused[2:4].t()}
    directory = write_sharded(state, tmp_path / "tied", max_shard_bytes=1 << 20)
    weight_map = json.loads((directory / INDEX_NAME).read_text())["weight_map"]
    assert list(weight_map) == ["emb", "qkv", "q", "kT"]
    with SafetensorsSource(directory) as source:
        source.check({"emb": (5, 3), "qkv": (6, 4), "q": (2, 4), "kT": (4, 2)})
        assert torch.equal(source.read("kT", (4, 2), (slice(0, 4), slice(0, 2)), "cpu"), fused[2:4].t())


# --------------------------------------------------------------------------- refusals


def test_missing_tensor_named_with_closest_key(tmp_path):
    path = _save(tmp_path, {"model." + k: v for k, v in _weights().items()})
    message = _refusal(SafetensorsSource(path))
    assert "'emb.weight'" in message and str(path) in message and "and 3 more" in message
    assert "'model.emb.weight'" in message and "name_map" in message


def test_extra_tensors_refused_when_strict_and_ignored_otherwise(tmp_path):
    extras = {f"unused.{i}": torch.zeros(2) for i in range(7)}
    path = _save(tmp_path, {**_weights(), **extras})
    message = _refusal(SafetensorsSource(path))
    assert "7 tensors" in message and "'unused.0'" in message and "'unused.4'" in message
    assert "'unused.5'" not in message and "and 2 more" in message
    assert str(path) in message and "strict=False" in message
    SafetensorsSource(path, strict=False).check(SHAPES)


def test_wrong_shape_names_both_shapes_and_file(tmp_path):
    path = _save(tmp_path, {**_weights(), "norm.g": torch.zeros(8)})
    message = _refusal(SafetensorsSource(path))
    assert "'norm.g'" in message and "[8]" in message and "[6]" in message and str(path) in message


def test_integer_dtype_refused(tmp_path):
    path = _save(tmp_path, {**_weights(), "blocks.0.mlp.b": torch.arange(7)})
    message = _refusal(SafetensorsSource(path))
    assert "'blocks.0.mlp.b'" in message and "I64" in message and str(path) in message


def test_index_naming_missing_shard(tmp_path):
    directory = _sharded(tmp_path)
    (directory / "model-00002-of-00003.safetensors").unlink()
    message = _refusal(SafetensorsSource(directory))
    assert "'model-00002-of-00003.safetensors'" in message and INDEX_NAME in message
    assert "'blocks.0.attn.q.weight'" in message


def test_garbage_files_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    message = _refusal(SafetensorsSource(path))
    assert str(path) in message and "not a readable safetensors file" in message
    directory = _sharded(tmp_path)
    shard = directory / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    assert str(shard) in _refusal(SafetensorsSource(directory))


def test_bad_paths_and_index_refused(tmp_path):
    missing = tmp_path / "nowhere"
    assert str(missing) in _refusal(SafetensorsSource(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no *.safetensors file" in _refusal(SafetensorsSource(empty))
    for name in ("a.safetensors", "b.safetensors"):
        _save(empty, _weights(), name)
    assert "2 *.safetensors files but no" in _refusal(SafetensorsSource(empty))
    directory = _sharded(tmp_path)
    index = json.loads((directory / INDEX_NAME).read_text())
    index["weight_map"]["norm.g"] = "model-00001-of-00003.safetensors"  # not where the tensor is
    (directory / INDEX_NAME).write_text(json.dumps(index))
    message = _refusal(SafetensorsSource(directory))
    assert "'norm.g'" in message and "model-00001-of-00003.safetensors" in message
    (directory / INDEX_NAME).write_text('{"weight_map": [1, 2]}')
    assert INDEX_NAME in _refusal(SafetensorsSource(directory))


# --------------------------------------------------------------------------- reading only the region


class _RecordingSlice:
    """Wraps a safetensors slice object: records each region asked for and the bytes it returned."""

    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, region):
        out = self._inner[region]
        self._log.append((region, out.numel() * out.element_size()))
        return out


class _NoFullReads:
    """Wraps ``safe_open``: ``get_tensor`` (a whole-tensor read) fails the test; slices are recorded."""

    def __init__(self, log, *args, **kwargs):
        self._inner = _REAL_SAFE_OPEN(*args, **kwargs)
        self._log = log

    def keys(self):
        return self._inner.keys()

    def get_slice(self, key):
        return _RecordingSlice(self._inner.get_slice(key), self._log)

    def get_tensor(self, key):
        raise AssertionError(f"read the whole tensor {key!r}")

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


_REAL_SAFE_OPEN = safetensors.safe_open


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages that torch ops under this mode allocate.

    An output storage that is also an argument's (views, in-place ops, and
    ``set_``, by which safetensors wraps its memory map of the file) was not
    allocated by the op and is not counted.
    """

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage_of(a)._cdata for a in tree_flatten((args, kwargs))[0] if _storage_of(a) is not None}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage):
        if storage._cdata in self._seen:
            return
        self._seen.add(storage._cdata)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, storage._cdata, storage.nbytes())

    def _free(self, cdata, nbytes):
        self._seen.discard(cdata)
        self.live -= nbytes


def _storage_of(value):
    if isinstance(value, torch.Tensor):
        return value.untyped_storage()
    return value if isinstance(value, torch.UntypedStorage) else None


def _fail(*args, **kwargs):
    raise AssertionError("loaded a whole file")


def test_read_of_one_row_reads_only_that_row(tmp_path, monkeypatch):
    full = torch.randn(4096, 1024)
    path = _save(tmp_path, {"pad": torch.zeros(3), "w": full})
    log: list = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _NoFullReads(log, *a, **k))
    monkeypatch.setattr(safetensors.torch, "load_file", _fail)
    monkeypatch.setattr(safetensors.torch, "load", _fail)
    row_bytes = 1024 * 4
    with SafetensorsSource(path, strict=False) as source:
        source.check({"w": (4096, 1024)})
        assert log == []  # check reads headers only
        region = (slice(1234, 1235), slice(0, 1024))
        with _LiveBytes() as mode:
            out = source.read("w", (4096, 1024), region, "cpu")
    assert torch.equal(out, full[1234:1235])
    assert out.untyped_storage().nbytes() == row_bytes  # not a view into a larger buffer
    assert log == [(region, row_bytes)]  # the one slice read asked for the row only
    assert mode.peak <= row_bytes  # torch allocated nothing beyond the result
