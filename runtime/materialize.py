"""Materialisation: every rank creates or reads only the shards its plan gives it.

``build_program`` exports a *meta twin* of the model (``meta_twin``: the same
module tree with every parameter and buffer on the meta device; no data is
copied), runs the passes (``shard_parameters`` allocates this rank's empty
shards on its device), builds the optimizer with empty masters, and then
``fill`` walks this rank's parameters once: for each it asks the weights
source for the rank's *region* of the global tensor (``ParamPlacement.region``:
one ``slice`` per tensor dim; a fused tensor-parallel projection's shard is one
such block per part, read one after the other and joined, ``fill``) as
float32, and hands it to the optimizer slot,
which keeps its part as the fp32 master and writes the compute copy
(``_Slot.load_master``). One region lives at a time, so the build's memory is
this rank's resident state (compute shards, masters, moments) plus about two
regions of the largest parameter it holds (the region read in the file's
dtype, and its fp32 copy); the cost model prices it the same way
(``search/memory.py``, build peak).

Weights sources (``weights=`` of ``build_program`` and ``autoshard.compile``):

| source | when | what a rank reads |
| --- | --- | --- |
| ``FromModule(model)`` | default when the model's parameters hold data (CPU, GPU) | a slice of each parameter, copied to its device as fp32 |
| ``Initialize(seed)`` | default when the model is on meta | ``init_rule`` models (the reference models, or ``rules=``): counter-based values of its region only (``autoshard.init``); others: ``module_init`` or each module's ``reset_parameters`` (below) |
| ``Safetensors(path, name_map=)`` | a ``.safetensors`` file or a Hugging Face sharded directory | ``get_slice`` of its region (``runtime/_safetensors_source.py``) |
| ``Checkpoint(path)`` | an autoshard DCP checkpoint (any plan, any world size) | the saved chunks that overlap its region (DCP, no collective) |
| ``Layered(a, b, ...)`` | a checkpoint that lacks some parameters (an HF model's files under an actor-critic: no value head) | each parameter from the first source holding it, the last for the rest |

A path given as ``weights`` is a DCP checkpoint when it holds autoshard's
sidecar, else safetensors.

Module-init fallback (models with no ``init_rule``, e.g. Hugging Face models
with ``module_init=model._init_weights``, or plain ``nn.Linear`` stacks with
``reset_parameters``): the modules are visited in ``Module.apply`` order
(children first) on a private meta twin; each module's *own* parameters and
meta buffers are materialised whole, in fp32 on the rank's device, the
function runs on the module, every rank takes its region and the whole tensor
is freed. With ``torch.manual_seed(seed)`` first, this is exactly what
``torch.manual_seed(seed); model.to_empty(device=d); model.apply(fn)`` gives on
one device, for every plan; the price is one module's parameters held whole
for a moment (the largest module's, e.g. an embedding). A function that
touches a tensor other than its module's own parameters and buffers raises
``WeightsError`` naming the module (it would silently read meta tensors).

Buffers are replicated: each comes whole from the model where it holds data
(meta parameters with real buffers is what ``accelerate.init_empty_weights()``
gives), else from the module-init fallback; a buffer no one provides is an
error naming it.

The user's module (decision): ``build_program`` never changes it.
``autoshard.compile`` builds with ``FromModule(model, release=True)``: each
parameter's storage is swapped for a meta tensor as soon as this rank has
read its region, and the model's buffers follow at the end, so a model handed
over on the GPU is never held twice; the module stays usable on the meta
device (capture, planning; ``program.full_state_dict()``-style exports come
from the program or a checkpoint). Why: keeping it would cost a whole model
per rank, the failure this module exists to remove.

Every source checks every parameter's name and global shape (all of the
model's, on every rank, before any tensor is read), so a bad file is refused
with one line naming the tensor and the file and nothing is half-loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard.errors import AutoshardError
from autoshard.init import InitRule, init_region
from autoshard.passes._graph_utils import meta_twin  # re-exported: build_program's and tests' entry point
from autoshard.runtime._checkpoint_files import Blocks, CheckpointError, SIDECAR, SafeFileSystemReader, WeightsOnlyLoadPlanner, read_info, read_metadata_safely, resolve_checkpoint
from autoshard.runtime._safetensors_source import SafetensorsSource
from autoshard.runtime.checkpoint import LocalShard, MODEL_PREFIX, _check_fingerprint, to_dtensor

Region = tuple[slice, ...]


class WeightsError(AutoshardError):
    """Weights could not be created or loaded: a bad source, initialiser or buffer."""


@dataclass(frozen=True)
class Wanted:
    """One tensor this rank needs: its name, global shape, region, and its placement (``ParamPlacement``)."""

    fqn: str
    global_shape: tuple[int, ...]
    region: Region
    placement: Any = None


def has_data(model: nn.Module) -> bool:
    """Whether every parameter of ``model`` holds data (no meta tensor)."""
    return not any(p.is_meta for p in model.parameters())


# --------------------------------------------------------------------------- sources


class _Reader:
    """What the readers share: a buffer comes from the model where it holds data; nothing to close."""

    model: nn.Module

    def buffer(self, fqn: str, device: torch.device) -> torch.Tensor | None:
        return _copy(dict(self.model.named_buffers()).get(fqn), device)

    def close(self) -> None:
        pass


def _copy(value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if value is None or value.is_meta else value.detach().to(device, copy=True)


class FromModule(_Reader):
    """Regions sliced from the model's own parameters (module docstring); ``release``: free each after reading."""

    def __init__(self, model: nn.Module, *, release: bool = False) -> None:
        self.model, self.release = model, release
        self.params = dict(model.named_parameters())

    def describe(self) -> str:
        return f"the parameters of {type(self.model).__name__}"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        for fqn, shape in expected.items():
            param = self.params.get(fqn)
            if param is None or tuple(param.shape) != tuple(shape):
                raise WeightsError(f"parameter {fqn!r} {list(shape)}: the model given has "
                                   f"{'none' if param is None else list(param.shape)}; pass the model that was captured")
            if param.is_meta:
                raise WeightsError(f"parameter {fqn!r} is on the meta device: pass weights=Initialize(...) or a "
                                   "checkpoint / safetensors path to create it")

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for item in wanted:
            param = self.params[item.fqn]
            yield item.fqn, param.detach()[item.region].to(device, torch.float32, copy=True)
            if self.release:
                self._release(param)
                self.params[item.fqn] = torch.empty_like(param, device="meta")
            del param

    def _release(self, param: nn.Parameter) -> None:
        """Put a meta stand-in wherever the model holds ``param`` (every owner of a tied one)."""
        stand_in = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        for module in self.model.modules():
            for name, value in module._parameters.items():
                if value is param:
                    module._parameters[name] = stand_in

    def close(self) -> None:
        if self.release:
            self.model.to("meta")


@dataclass(frozen=True)
class Initialize:
    """Initialise on shards (module docstring).

    seed: fixes every value, for every plan.
    rules: ``fqn -> autoshard.init.InitRule`` (default: the model's ``init_rule`` when it has one).
    module_init: ``fn(module)`` run per module in ``Module.apply`` order, each module's own tensors
        materialised whole (default without rules: each module's ``reset_parameters``).
    """

    seed: int = 0
    rules: Callable[[str], InitRule] | None = None
    module_init: Callable[[nn.Module], None] | None = None

    def bind(self, model: nn.Module) -> Any:
        """The reader for ``model``: by rules when there are any and no ``module_init``, else by modules."""
        rules = self.rules or getattr(model, "init_rule", None)
        if rules is not None and self.module_init is None:
            return _RuleReader(model, rules, self.seed)
        return _ModuleInitReader(model, self.module_init, self.seed)


class _RuleReader(_Reader):
    def __init__(self, model: nn.Module, rules: Callable[[str], InitRule], seed: int) -> None:
        self.model, self.rules, self.seed = model, rules, seed

    def describe(self) -> str:
        return f"init rules of {type(self.model).__name__} (seed {self.seed})"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        for fqn in expected:
            try:
                rule = self.rules(fqn)
            except Exception as err:  # a user rule: report which parameter it failed on
                raise WeightsError(f"init rule for parameter {fqn!r} failed: {type(err).__name__}: {err}") from None
            if not isinstance(rule, InitRule):
                raise WeightsError(f"init rule for parameter {fqn!r} returned {rule!r}; expected autoshard.init."
                                   "Normal, Uniform or Constant")

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for item in wanted:
            yield item.fqn, init_region(self.rules(item.fqn), self.seed, item.fqn, item.global_shape, item.region,
                                        device)



class _OnlyOwnTensors(TorchDispatchMode):
    """Refuses any op on a meta tensor while a module's init function runs (module docstring)."""

    def __init__(self, module_name: str, module: nn.Module) -> None:
        super().__init__()
        self.module_name, self.module = module_name, module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise WeightsError(
                    f"the init function of module {self.module_name or '<root>'!r} ({type(self.module).__name__}) "
                    f"touches a tensor {list(value.shape)} that is not its own parameter or buffer ({func}); a "
                    "sharded build initialises one module's own tensors at a time: give that module an init_rule or "
                    "initialise each tensor from its own module")
        return func(*args, **(kwargs or {}))


class _ModuleInitReader(_Reader):
    def __init__(self, model: nn.Module, fn: Callable[[nn.Module], None] | None, seed: int) -> None:
        self.model, self.fn, self.seed = model, fn, seed
        self.buffers_: dict[str, torch.Tensor] = {}

    def describe(self) -> str:
        how = getattr(self.fn, "__name__", "init function") if self.fn else "reset_parameters"
        return f"{how} of each module of {type(self.model).__name__} (seed {self.seed})"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        if self.fn is not None:
            return
        for name, module in self.model.named_modules():
            own = [n for n, p in module.named_parameters(recurse=False)]
            if own and not callable(getattr(module, "reset_parameters", None)):
                raise WeightsError(
                    f"parameter {(name + '.' if name else '') + own[0]!r} of module {name or '<root>'!r} "
                    f"({type(module).__name__}) has no initialiser: the model has no init_rule and the module no "
                    "reset_parameters; pass weights=Initialize(module_init=fn) or rules=, or a checkpoint")

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Module by module in ``apply`` order (children first); see the module docstring."""
        by_name: dict[str, list[Wanted]] = {}
        for w in wanted:
            by_name.setdefault(w.fqn, []).append(w)  # a fused parameter: one item per block
        twin = meta_twin(self.model)
        canonical = {id(p): fqn for fqn, p in twin.named_parameters()}
        owners: dict[int, int] = {}
        for module in twin.modules():
            for p in module.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        whole: dict[int, nn.Parameter] = {}  # id(meta param) → its whole materialised tensor while owners remain
        torch.manual_seed(self.seed)
        for name, module in _post_order(twin):
            made = self._materialise(module, whole, device)
            if self.fn is not None or callable(getattr(module, "reset_parameters", None)):
                with torch.no_grad(), _OnlyOwnTensors(name, module):
                    (self.fn or type(module).reset_parameters)(module)
            for pname, meta_param in made:
                owners[id(meta_param)] -= 1
                if owners[id(meta_param)] == 0:
                    full = whole.pop(id(meta_param))
                    for item in by_name.get(canonical[id(meta_param)], ()):
                        yield item.fqn, full.detach()[item.region].to(torch.float32, copy=True)
                module._parameters[pname] = meta_param
            for bname, value in module.named_buffers(recurse=False):
                if not value.is_meta:
                    self.buffers_[(name + "." if name else "") + bname] = value

    @staticmethod
    def _materialise(module: nn.Module, whole: dict, device: torch.device) -> list[tuple[str, nn.Parameter]]:
        """Swap ``module``'s own meta parameters (and meta buffers) for whole fp32 tensors on ``device``.

        A tied parameter keeps one whole tensor (``whole``, by the meta parameter's id) until its last owner ran.
        """
        made = []
        for pname, meta_param in list(module._parameters.items()):
            if meta_param is None:
                continue
            if id(meta_param) not in whole:
                whole[id(meta_param)] = nn.Parameter(torch.empty(meta_param.shape, device=device, dtype=torch.float32),
                                                     requires_grad=meta_param.requires_grad)
            module._parameters[pname] = whole[id(meta_param)]
            made.append((pname, meta_param))
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[bname] = torch.empty(buf.shape, device=device, dtype=buf.dtype)
        return made

    def buffer(self, fqn: str, device: torch.device) -> torch.Tensor | None:
        return _copy(self.buffers_.get(fqn), device) or super().buffer(fqn, device)

    def close(self) -> None:
        self.buffers_.clear()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` in ``Module.apply`` order: children first, then the module."""
    for child_name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{child_name}" if prefix else child_name)
    yield prefix, module


@dataclass(frozen=True)
class Safetensors:
    """A ``.safetensors`` file or a Hugging Face sharded directory; ``name_map``: model FQN → key in the files."""

    path: str | os.PathLike
    name_map: Mapping[str, str] | Callable[[str], str | None] | None = None
    strict: bool = True

    def bind(self, model: nn.Module) -> Any:
        return _SafetensorsReader(SafetensorsSource(self.path, name_map=self.name_map, strict=self.strict), model)


class _SafetensorsReader(_Reader):
    def __init__(self, source: Any, model: nn.Module) -> None:
        self.source, self.model = source, model

    def describe(self) -> str:
        return self.source.describe()

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        self.source.check(expected)

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for item in wanted:
            yield item.fqn, self.source.read(item.fqn, item.global_shape, item.region, device)

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class Layered:
    """Each parameter from the first of ``sources`` that holds it, the last taking every one left: e.g. a
    Hugging Face checkpoint, which has no value head, under an actor-critic
    (``Layered(Safetensors(dir), Initialize(0))``). Every source but the last must say what it holds
    (``Safetensors``); each checks only the parameters it gives, with its own errors. Buffers come
    from the first source that provides them."""

    sources: tuple

    def __init__(self, *sources: Any) -> None:
        if len(sources) < 2:
            raise WeightsError("Layered(...) takes two or more weights sources, the last one for every parameter left")
        object.__setattr__(self, "sources", tuple(sources))

    def bind(self, model: nn.Module) -> Any:
        return _LayeredReader([bind_source(s, model) for s in self.sources], model)


class _LayeredReader(_Reader):
    def __init__(self, readers: list[Any], model: nn.Module) -> None:
        self.readers, self.model = readers, model
        for reader in readers[:-1]:
            if not callable(getattr(getattr(reader, "source", None), "holds", None)):
                raise WeightsError(f"Layered: {reader.describe()} cannot say which parameters it holds; only the last "
                                   "source may be one that gives every parameter")
        self.owner: dict[str, int] = {}

    def describe(self) -> str:
        return " then ".join(r.describe() for r in self.readers)

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        last = len(self.readers) - 1
        for fqn in expected:
            self.owner[fqn] = next((i for i, r in enumerate(self.readers[:-1]) if r.source.holds(fqn)), last)
        for i, reader in enumerate(self.readers):
            reader.check({fqn: shape for fqn, shape in expected.items() if self.owner[fqn] == i})

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        for i, reader in enumerate(self.readers):
            yield from reader.regions([w for w in wanted if self.owner[w.fqn] == i], device)

    def buffer(self, fqn: str, device: torch.device) -> torch.Tensor | None:
        for reader in self.readers:
            value = reader.buffer(fqn, device)
            if value is not None:
                return value
        return None

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


@dataclass(frozen=True)
class Checkpoint:
    """An autoshard DCP checkpoint directory (``runtime/checkpoint.py``), saved under any plan and world size."""

    path: str | os.PathLike
    model_fingerprint: str = ""

    def bind(self, model: nn.Module) -> Any:
        return _CheckpointReader(self, model)


class _CheckpointReader(_Reader):
    def __init__(self, spec: Checkpoint, model: nn.Module) -> None:
        self.directory = resolve_checkpoint(spec.path)
        self.info = read_info(self.directory)
        self.spec, self.model = spec, model
        self.mesh = None  # the DeviceMesh the placements refer to (set by fill)

    def describe(self) -> str:
        return f"checkpoint {self.directory}"

    def check(self, expected: Mapping[str, tuple[int, ...]]) -> None:
        _check_fingerprint(self.info, self.spec.model_fingerprint, self.directory)
        saved = {k.removeprefix(MODEL_PREFIX): r for k, r in self.info.tensors.items() if k.startswith(MODEL_PREFIX)}
        for fqn, shape in expected.items():
            record = saved.get(fqn)
            if record is None:
                raise CheckpointError(f"checkpoint {self.directory} has no tensor for parameter {fqn!r}; it was "
                                      "saved for another model (pass the checkpoint of this model)")
            if tuple(record.shape) != tuple(shape):
                raise CheckpointError(f"checkpoint {self.directory}: {fqn!r} is saved as {list(record.shape)}, the "
                                      f"model has {list(shape)}; it was saved for another model configuration")
        extra = sorted(set(saved) - set(expected))
        if extra:
            raise CheckpointError(f"checkpoint {self.directory} holds {len(extra)} tensor(s) the model does not have, "
                                  f"e.g. {extra[:3]}; it was saved for another model")

    def regions(self, wanted: list[Wanted], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """One ``dcp.load`` per parameter (no collective): only one region, and the saved chunks it overlaps, live."""
        import torch.distributed.checkpoint as dcp

        metadata = read_metadata_safely(self.directory)
        for item in wanted:
            key = f"{MODEL_PREFIX}{item.fqn}"
            local = torch.empty(tuple(s.stop - s.start for s in item.region), device=device)
            storage = SafeFileSystemReader(self.directory, metadata)
            if _parts_of(item) > 1:  # one part's block of a fused projection (``_blocks``): read at its offsets
                block = Blocks(item.global_shape, {tuple(s.start for s in item.region): local})
                dcp.load({}, storage_reader=storage, planner=WeightsOnlyLoadPlanner({key: block}), no_dist=True)
                yield item.fqn, local
                continue
            target = to_dtensor(LocalShard.of(local, item.placement), self.mesh)
            dcp.load({key: target}, storage_reader=storage, planner=WeightsOnlyLoadPlanner(), no_dist=True)
            loaded = target.to_local()
            if loaded.data_ptr() != local.data_ptr():
                local.copy_(loaded)
            yield item.fqn, local


# --------------------------------------------------------------------------- resolve and fill


def bind_source(weights: Any, model: nn.Module, *, release: bool = False) -> Any:
    """The reader for ``weights`` (``None``, a path, or a source object) over ``model`` (module docstring)."""
    if weights is None:
        return FromModule(model, release=release) if has_data(model) else Initialize().bind(model)
    if isinstance(weights, (str, os.PathLike)):
        path = Path(weights)
        weights = Checkpoint(path) if (path / SIDECAR).is_file() else Safetensors(path)
    if isinstance(weights, FromModule):
        return weights
    if hasattr(weights, "bind"):
        return weights.bind(model)
    raise WeightsError(f"weights={weights!r}: expected None, a path (autoshard checkpoint directory, .safetensors file "
                       "or Hugging Face safetensors directory) or autoshard.runtime.materialize.Initialize / "
                       "Safetensors / Checkpoint / FromModule")


def fill(reader: Any, wanted: list[Wanted], expected: Mapping[str, tuple[int, ...]],
         buffers: Mapping[str, torch.Tensor], device: torch.device, write: Callable[[str, torch.Tensor], None]) -> None:
    """Fill a program from ``reader``: check every parameter's global shape (``expected``, all of the model's),
    copy ``buffers`` (``fqn → empty tensor``), then ``write(fqn, fp32 region)`` for each wanted, one at a time."""
    try:
        reader.check(expected)
        missing = _copy_buffers(reader, buffers, device)  # the module-init fallback computes meta buffers on the way
        for fqn, values in _joined(reader.regions(_blocks(wanted), device), wanted):
            write(fqn, values)
            del values
        for fqn in _copy_buffers(reader, {fqn: buffers[fqn] for fqn in missing}, device):
            raise WeightsError(
                f"buffer {fqn!r} {list(buffers[fqn].shape)} is on the meta device and {reader.describe()} does not "
                "provide it; build the model with its buffers materialised (e.g. accelerate's "
                "init_empty_weights(include_buffers=False)) or compute it in Initialize(module_init=...)")
    finally:
        reader.close()


def _parts_of(item: Wanted) -> int:
    return getattr(item.placement, "tp_parts", 1)


def _blocks(wanted: list[Wanted]) -> list[Wanted]:
    """``wanted`` with each fused parameter (``ParamPlacement.tp_parts > 1``) as one item per block."""
    out = []
    for item in wanted:
        if _parts_of(item) == 1:
            out.append(item)
        else:
            out.extend(replace(item, region=region) for region in item.placement.part_regions(item.region))
    return out


def _joined(values: Iterator[tuple[str, torch.Tensor]], wanted: list[Wanted]) -> Iterator[tuple[str, torch.Tensor]]:
    """The readers' values of ``_blocks(wanted)`` (in any order of parameters, a parameter's blocks in
    order), each fused parameter's blocks concatenated along its tp dim."""
    items = {w.fqn: w for w in wanted}
    pending: dict[str, list[torch.Tensor]] = {}
    for fqn, tensor in values:
        item = items[fqn]
        if _parts_of(item) == 1:
            yield fqn, tensor
            continue
        pending.setdefault(fqn, []).append(tensor)
        if len(pending[fqn]) == _parts_of(item):
            yield fqn, torch.cat(pending.pop(fqn), item.placement.tp_dim)


def _copy_buffers(reader: Any, buffers: Mapping[str, torch.Tensor], device: torch.device) -> list[str]:
    """Copy each buffer ``reader`` provides into its target; the FQNs it does not provide. A build on the
    meta device (``autoshard check``) carries no values: nothing to copy."""
    if device.type == "meta":
        return []
    missing = []
    for fqn, target in buffers.items():
        assert not target.is_meta, f"program buffer {fqn!r} was not allocated (shard_parameters)"
        value = reader.buffer(fqn, device)
        if value is None:
            missing.append(fqn)
            continue
        with torch.no_grad():
            target.copy_(value)
    return missing


__all__ = ["Checkpoint", "FromModule", "Initialize", "Layered", "Safetensors", "Wanted", "WeightsError", "bind_source", "fill",
           "has_data", "meta_twin"]
