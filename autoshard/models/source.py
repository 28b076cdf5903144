"""Where the CLI gets a model: a reference spec or the user's own factory.

    MODEL := family:size              a reference policy (``autoshard models``), e.g. llama:7b
           | package.module:factory   a callable importable from sys.path (the current directory first)
           | path/to/file.py:factory  a callable defined in a Python file
           | path/to/hf_model_dir     a Hugging Face model directory (its config.json), or
           | path/to/config.json      the config file itself: ``autoshard.models.hf.actor_critic``

``load_model(spec)`` returns the module on the meta device (planning reads no weights) and the name
plans record, so ``autoshard explain`` / ``plan --plan`` rebuild the same model later. A factory is
called with ``device="meta"`` (and ``dtype=``) when its signature takes them, so a 70B model costs
nothing to build; otherwise it is called with no arguments and its parameters are moved to meta
afterwards (the factory then pays for its own weights once). It must return an ``nn.Module`` whose
``forward(tokens)`` returns ``(logits, values)`` or logits alone, as ``autoshard.compile`` expects.

Errors name the part that is wrong: the module that does not import (and why), the attribute it
lacks, a factory that raises or returns something else.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autoshard.errors import ModelError
from autoshard.models import FAMILIES, build, parse_spec
from autoshard.models.hf import actor_critic, load_hf_config


def is_factory_spec(spec: str) -> bool:
    """Whether ``spec`` names a factory (``module.path:callable`` or ``file.py:callable``), not a reference model."""
    target, sep, attr = spec.strip().rpartition(":")
    return bool(sep and attr and target) and ("." in target or "/" in target or target.endswith(".py")
                                              or _importable(target))


def _importable(name: str) -> bool:
    if name.lower() in FAMILIES:
        return False
    _cwd_on_path()
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cwd_on_path() -> None:
    """The current directory's modules import, as under ``python -m`` (a console script's path lacks it)."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names (module docstring); ``ModelError`` naming what failed."""
    target, _, attr = spec.strip().rpartition(":")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ModelError(f"model {spec!r}: no Python file {str(path)!r}")
        module_name = f"_autoshard_user_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's file: say what it raised
            raise ModelError(f"model {spec!r}: running {path} raised {type(err).__name__}: {err}") from err
    else:
        _cwd_on_path()
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ModelError(f"model {spec!r}: cannot import module {target!r} ({err}); give package.module:factory "
                             "importable from the current directory, a path/to/file.py:factory, or a reference "
                             "model (see `autoshard models`)") from err
        except Exception as err:  # noqa: BLE001 - importing the user's module ran its code
            raise ModelError(f"model {spec!r}: importing {target!r} raised {type(err).__name__}: {err}") from err
    factory = getattr(module, attr, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise ModelError(f"model {spec!r}: {target!r} has no attribute {attr!r}"
                         + (f"; callables there: {', '.join(public)}" if public else ""))
    if not callable(factory):
        raise ModelError(f"model {spec!r}: {target}.{attr} is a {type(factory).__name__}, not a callable that "
                         "returns an nn.Module")
    return factory


def build_from_factory(spec: str, *, device: str | torch.device = "meta",
                       dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Call the factory ``spec`` names and return its module on ``device`` in ``dtype`` (module docstring)."""
    factory = resolve_factory(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes = lambda name: name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())  # noqa: E731
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if takes(k)}
    try:
        model = factory(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's factory: say what it raised
        raise ModelError(f"model {spec!r}: calling {getattr(factory, '__name__', spec)}({', '.join(kwargs)}) raised "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {spec!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    if torch.device(device).type == "meta" and any(not p.is_meta for p in model.parameters()):
        model = model.to("meta")  # in place: ties stay ties; nothing of the factory's weights is kept
    return model


def is_hf_config_spec(spec: str) -> bool:
    """Whether ``spec`` is a Hugging Face model directory (with ``config.json``) or a ``.json`` config file."""
    path = Path(spec.strip()).expanduser()
    return (path.is_dir() and (path / "config.json").is_file()) or (path.suffix == ".json" and path.is_file())


def load_model(spec: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16,
               **overrides: object) -> tuple[nn.Module, str]:
    """(module, name to record in plans) for a CLI ``MODEL`` (module docstring). ``overrides`` go to a
    reference model's config only."""
    if is_hf_config_spec(spec):
        if overrides:
            raise ModelError(f"model {spec!r}: config overrides ({', '.join(overrides)}) apply to reference models only")

        return actor_critic(load_hf_config(spec), device=device, dtype=dtype), str(Path(spec.strip()).expanduser())
    if Path(spec.strip()).expanduser().is_dir():
        raise ModelError(f"model {spec!r}: a directory without config.json; a Hugging Face model directory holds one "
                         "(save_pretrained writes it)")
    if is_factory_spec(spec):
        if overrides:
            raise ModelError(f"model {spec!r}: config overrides ({', '.join(overrides)}) apply to reference models only")
        return build_from_factory(spec, device=device, dtype=dtype), spec.strip()

    family, size = parse_spec(spec)
    name = f"{family}:{size}"
    return build(name, device=device, dtype=dtype, **overrides), name


__all__ = ["build_from_factory", "is_factory_spec", "is_hf_config_spec", "load_model", "resolve_factory"]
