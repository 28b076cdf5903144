"""Read a rank's regions of parameters straight from safetensors files.

``SafetensorsSource`` fills the rectangular region of each global parameter
that a rank owns (a tuple of ``slice(start, stop)``, one per tensor dim) from a
safetensors checkpoint, such as one downloaded from the Hugging Face Hub.

What is read
    ``path`` is one ``.safetensors`` file, or a directory holding either
    exactly one ``*.safetensors`` file or a sharded checkpoint::

        DIR/model.safetensors.index.json      {"metadata": {"total_size": N},
                                               "weight_map": {key: "model-00001-of-00003.safetensors", ...}}
        DIR/model-00001-of-00003.safetensors  the tensors the index assigns to it
        ...

    Files are opened lazily and their handles kept for reuse until ``close``.

Name map
    A parameter FQN (``blocks.0.attn.q.weight``) is looked up under a key of
    the file. ``name_map`` is a dict (FQNs absent from it map to themselves) or
    a callable returning the key (``None``: the FQN itself).

Checks (``check``, headers only)
    Every rank calls ``check`` with every parameter's global shape before it
    reads anything, so a bad checkpoint is refused on every rank before any
    tensor is loaded: nothing is half-loaded. ``CheckpointError`` (one line,
    naming the tensor and the file) when the path does not exist or holds no
    safetensors file, the index is malformed or names a missing file, a file is
    not readable as safetensors, a parameter's key is missing (with the closest
    key as a hint), a shape differs, a dtype is not a float format that upcasts
    to float32, or (``strict=True``) the files hold tensors no parameter maps to.

Why slices
    A rank never holds a whole tensor it shards. ``handle.get_slice(key)``
    reads the header only, and indexing it with a region returns a view of the
    memory-mapped file, so only the pages holding the region are read; ``read``
    copies that view into a new float32 tensor of the region's shape. A region
    of whole rows is one contiguous byte range; a region of columns touches
    every row, yet still allocates only the region.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from autoshard.runtime._checkpoint_files import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
# Float formats that upcast to float32 element by element. Packed F4 (two values
# per byte) and scale-only F8_E8M0 hold quantized weights that need their scales.
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")
MAX_NAMED = 5

NameMap = Mapping[str, str] | Callable[[str], str | None]


def _safetensors() -> Any:
    """The ``safetensors`` package, an optional dependency that only this module needs."""
    try:
        import safetensors
    except ImportError:
        raise ImportError(
            "reading safetensors checkpoints needs the 'safetensors' package, which is not installed: "
            "pip install safetensors"
        ) from None
    return safetensors


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


@dataclass(frozen=True)
class _Layout:
    """Where the tensors are: every file, and (sharded) the index's key → file map."""

    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: dict[str, Path] | None = None  # None: the keys are the one file's header keys


# --------------------------------------------------------------------------- layout


def _resolve_layout(path: Path) -> _Layout:
    """The files of ``path``: one file, a directory's only file, or a sharded directory's index."""
    if path.is_file():
        return _Layout(files=(path,))
    if not path.is_dir():
        raise CheckpointError(
            f"no safetensors checkpoint at {str(path)!r}: the path does not exist; "
            f"pass a {SUFFIX} file or a directory holding {INDEX_NAME} and its shards"
        )
    if (path / INDEX_NAME).is_file():
        return _read_index(path / INDEX_NAME)
    found = sorted(p for p in path.glob(f"*{SUFFIX}") if p.is_file())
    if len(found) == 1:
        return _Layout(files=(found[0],))
    what = "no *.safetensors file" if not found else f"{len(found)} *.safetensors files but no {INDEX_NAME}"
    raise CheckpointError(
        f"directory {str(path)!r} holds {what}; pass a {SUFFIX} file or a directory holding "
        f"{INDEX_NAME} and its shards (or exactly one {SUFFIX} file)"
    )


def _read_index(index: Path) -> _Layout:
    """Parse a Hugging Face index: ``weight_map`` maps each key to a file name beside the index."""
    try:
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        weight_map = {str(key): index.parent / str(name) for key, name in names.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{index}: not a valid safetensors index ({type(err).__name__}: {_one_line(err)}); "
            'expected JSON {"weight_map": {tensor_key: file_name}}'
        ) from None
    files = tuple(dict.fromkeys(weight_map.values()))  # first-seen order
    return _Layout(files=files, index=index, weight_map=weight_map)


def _closest_key(key: str, keys: Iterable[str]) -> str:
    """A hint naming the file key closest to ``key`` ("" when none is close)."""
    keys = list(keys)
    # A key that only adds a prefix (``model.``) is the likeliest match, however short ``key`` is.
    close = [k for k in keys if k.endswith("." + key)][:1] or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:
        return ""
    hint = f"; the closest key is {close[0]!r}"
    if close[0].endswith(key):
        prefix = close[0][: -len(key)]
        hint += f" (the file's keys carry the prefix {prefix!r}: name_map=lambda fqn: {prefix!r} + fqn)"
    return hint


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


# --------------------------------------------------------------------------- source


class SafetensorsSource:
    """Fills a rank's parameter regions from a safetensors file or sharded directory.

    ``path``: a ``.safetensors`` file or a directory (module docstring).
    ``name_map``: parameter FQN → key in the files (dict or callable).
    ``strict``: ``check`` refuses files holding tensors no parameter maps to.
    Call ``check`` once with every parameter's global shape, then ``read``
    each region; ``close`` (or ``with``) releases the file handles.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        name_map: NameMap | None = None,
        strict: bool = True,
    ) -> None:
        self.path = Path(path)
        self.name_map = name_map
        self.strict = strict
        self._layout: _Layout | None = None
        self._handles: dict[Path, Any] = {}  # file → open safe_open handle
        self._file_keys: dict[Path, frozenset[str]] = {}  # file → the keys its header lists
        self._key_files: Mapping[str, Path] | None = None  # every key → its file

    # ----------------------------------------------------------------- public

    def describe(self) -> str:
        """``"safetensors directory /x (3 files)"`` or ``"safetensors file /x/model.safetensors"``."""
        if self.path.is_file():
            return f"safetensors file {self.path}"
        try:
            count = len(self._get_layout().files)
        except CheckpointError:
            return f"safetensors path {self.path}"
        return f"safetensors directory {self.path} ({count} file{'s' if count != 1 else ''})"

    def key_of(self, fqn: str) -> str:
        """The key in the files that holds parameter ``fqn``."""
        if self.name_map is None:
            return fqn
        if isinstance(self.name_map, Mapping):
            return self.name_map.get(fqn, fqn)
        key = self.name_map(fqn)
        return fqn if key is None else key

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        """Refuse the checkpoint unless it fits ``expected`` (every parameter FQN → global shape).

        Reads headers only. Raises ``CheckpointError`` (module docstring "Checks").
        """
        layout = self._get_layout()
        for file in layout.files:
            self._handle(file)  # a missing or unreadable file is refused before any tensor check
        keys = self._keys()
        self._check_present(expected, keys)
        for fqn, shape in expected.items():
            self._check_header(fqn, self.key_of(fqn), tuple(shape))
        if self.strict:
            self._check_no_extras(keys, {self.key_of(fqn) for fqn in expected})

    def holds(self, fqn: str) -> bool:
        """Whether the files hold a tensor for parameter ``fqn`` (its key, ``key_of``); reads headers only."""
        return self.key_of(fqn) in self._keys()

    def read(
        self,
        fqn: str,
        global_shape: tuple[int, ...],
        region: tuple[slice, ...],
        device: torch.device | str,
    ) -> torch.Tensor:
        """A new contiguous float32 tensor on ``device`` equal to ``full[region]`` of ``fqn``'s tensor.

        Only the region's bytes are read (module docstring "Why slices").
        ``region`` has one ``slice(start, stop)`` per dim of ``global_shape``.
        """
        assert len(region) == len(global_shape), (fqn, region, global_shape)
        assert all(s.step in (None, 1) for s in region), region
        key = self.key_of(fqn)
        self._check_present({fqn: global_shape}, self._keys())
        tensor_slice = self._check_header(fqn, key, tuple(global_shape))
        local_shape = tuple(len(range(*s.indices(n))) for s, n in zip(region, global_shape))
        out = torch.empty(local_shape, dtype=torch.float32, device=device)
        if out.numel() == 0:
            return out
        view = tensor_slice[region]  # (*local_shape), file dtype, a view of the mapped file
        return out.copy_(view)

    def close(self) -> None:
        """Close every open file handle (a later ``read`` reopens lazily)."""
        handles, self._handles = self._handles, {}
        self._file_keys.clear()
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, strict={self.strict})"

    # ----------------------------------------------------------------- files

    def _get_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _resolve_layout(self.path)
        return self._layout

    def _handle(self, file: Path) -> Any:
        """The open handle of ``file`` (reads its header on first use)."""
        if file in self._handles:
            return self._handles[file]
        layout = self._get_layout()
        if layout.index is not None and not file.is_file():
            users = [key for key, f in layout.weight_map.items() if f == file]
            raise CheckpointError(
                f"{layout.index} names file {file.name!r} (for {len(users)} tensors, e.g. {users[0]!r}), "
                f"which does not exist in {file.parent}; the checkpoint is incomplete: download the missing shard"
            )
        st = _safetensors()
        try:
            handle = st.safe_open(str(file), framework="pt", device="cpu")
        except (st.SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{file}: not a readable safetensors file ({_one_line(err)}); re-download or re-save it"
            ) from None
        self._handles[file] = handle
        self._file_keys[file] = frozenset(handle.keys())
        return handle

    def _keys(self) -> Mapping[str, Path]:
        """Every key of the checkpoint → the file that holds it (the index's map, or the one file's header)."""
        if self._key_files is None:
            layout = self._get_layout()
            if layout.weight_map is not None:
                self._key_files = layout.weight_map
            else:
                (file,) = layout.files
                self._handle(file)
                self._key_files = dict.fromkeys(sorted(self._file_keys[file]), file)
        return self._key_files

    # ----------------------------------------------------------------- checks

    def _check_present(self, expected: Mapping[str, Any], keys: Mapping[str, Path]) -> None:
        missing = [fqn for fqn in expected if self.key_of(fqn) not in keys]
        if not missing:
            return
        fqn, key = missing[0], self.key_of(missing[0])
        more = f" (and {len(missing) - 1} more parameters)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"parameter {fqn!r} (looked up as key {key!r}) is not in {self.describe()}{more}"
            f"{_closest_key(key, keys)}; pass name_map to map parameter names to the file's keys"
        )

    def _check_header(self, fqn: str, key: str, global_shape: tuple[int, ...]) -> Any:
        """The header-only slice object of ``key``, after checking its shape and dtype."""
        file = self._keys()[key]
        handle = self._handle(file)
        if key not in self._file_keys[file]:
            raise CheckpointError(
                f"tensor {key!r} (parameter {fqn!r}) is not in {file}, where {self._get_layout().index} "
                "puts it; the index does not belong to these files: re-download the checkpoint"
            )
        tensor_slice = handle.get_slice(key)
        shape, code = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
        if shape != global_shape:
            raise CheckpointError(
                f"tensor {key!r} in {file} has shape {_shape_str(shape)} but parameter {fqn!r} has global shape "
                f"{_shape_str(global_shape)}; the checkpoint belongs to another model configuration "
                "or name_map pairs the wrong tensors"
            )
        if code not in FLOAT_CODES:
            raise CheckpointError(
                f"tensor {key!r} in {file} has dtype {code}, which cannot fill parameter {fqn!r}; "
                f"parameters are read from one of {', '.join(FLOAT_CODES)} (upcast to float32): "
                "fix name_map or re-save the checkpoint"
            )
        return tensor_slice

    def _check_no_extras(self, keys: Mapping[str, Path], used: set[str]) -> None:
        extra = [key for key in keys if key not in used]
        if not extra:
            return
        named = ", ".join(repr(key) for key in extra[:MAX_NAMED])
        more = f" and {len(extra) - MAX_NAMED} more" if len(extra) > MAX_NAMED else ""
        raise CheckpointError(
            f"{self.describe()} holds {len(extra)} tensors no parameter maps to: {named}{more}; "
            "pass strict=False to ignore them, or name_map if they are parameters under other names"
        )


# --------------------------------------------------------------------------- writing


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Indices grouped into files in order; a new file starts when the next tensor would pass the cap."""
    shards: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not shards or total + size > max_shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return shards


def _distinct_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies-or-views, each tied tensor kept once under its first name."""
    seen_views: set[tuple[Any, ...]] = set()
    seen_storages: set[tuple[torch.device, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.numel() > 0 and view in seen_views:  # tied weights: the same tensor under a second name
            continue
        # Another view of a storage already written is copied: safetensors refuses shared storage.
        shared = tensor.numel() > 0 and storage in seen_storages
        seen_views.add(view)
        seen_storages.add(storage)
        tensor = tensor.to("cpu")
        out[name] = tensor.clone(memory_format=torch.contiguous_format) if shared else tensor.contiguous()
    return out


def write_sharded(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int,
) -> Path:
    """Write ``state_dict`` as a Hugging Face-style sharded safetensors directory; returns it.

    Files ``model-0000k-of-0000n.safetensors`` hold the tensors in their order,
    a new file begun when the next tensor would pass ``max_shard_bytes`` (a
    larger tensor gets a file of its own); ``model.safetensors.index.json``
    records ``total_size`` and the ``weight_map``. Tied tensors (same storage
    and view) are written once, under their first name.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _distinct_tensors(state_dict)
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for k, members in enumerate(shards, start=1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}{SUFFIX}"
        save_file({names[i]: tensors[names[i]] for i in members}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({names[i]: file_name for i in members})
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return directory


__all__ = ["INDEX_NAME", "SafetensorsSource", "write_sharded"]
