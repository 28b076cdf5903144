"""Keep the source tree's ``kernels/`` folder from shadowing the installed ``kernels`` distribution.

``autoshard.kernels`` is built from a top-level ``kernels/`` folder of the source tree (``pyproject.toml``'s
``package-dir``). Hugging Face ``transformers`` (5.25 and later) depends on the PyPI package ``kernels`` and
imports it as a top-level module when it is installed. Wherever the source tree's root is on ``sys.path``
(``python -m ...`` or ``pytest`` run from it) the folder is found first: ``import transformers`` then fails
(``cannot import name 'CUDAProperties' from 'kernels'``). ``install`` puts a finder ahead of the path finder
that resolves the top-level name ``kernels`` on ``sys.path`` without the source tree's root, and only when
a ``kernels`` distribution is installed and the folder would shadow it; otherwise it does nothing. The
folder keeps its place in the layout (it is the contract's), and nothing is imported early.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import sys

_NAME = "kernels"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the source tree (autoshard/ is its core)


class _InstalledKernels:
    """A meta path finder for the top-level ``kernels`` that skips the source tree's root."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != _NAME or path is not None:
            return None
        entries = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _ROOT]
        return importlib.machinery.PathFinder.find_spec(name, entries)


def install() -> None:
    """Add the finder once, when the installed distribution would be shadowed (module docstring)."""
    if not os.path.isfile(os.path.join(_ROOT, _NAME, "__init__.py")):
        return  # an installed autoshard: no source tree to shadow anything
    if any(isinstance(finder, _InstalledKernels) for finder in sys.meta_path):
        return
    try:
        importlib.metadata.distribution(_NAME)
    except importlib.metadata.PackageNotFoundError:
        return
    sys.meta_path.insert(0, _InstalledKernels())
