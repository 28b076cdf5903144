"""Hide other libraries' warnings from CLI users; ``--debug`` shows them all.

Installed by the CLI entry (``autoshard/cli.py``'s ``main``) and by every
process ``autoshard run`` / ``ppo`` starts (``runtime/launch_child.py``: the
torchrun agent and each rank), so a torch deprecation is not printed once per
rank. Nothing here imports torch.

What is hidden, and why:

- ``FutureWarning``, ``DeprecationWarning``, ``PendingDeprecationWarning``
  from anywhere: they ask a library's caller to change code (e.g. torch's
  pytree ``LeafSpec`` deprecation, attributed to ``copyreg`` by its stack
  level), which a CLI user cannot do;
- ``UserWarning`` raised in the modules of ``THIRD_PARTY`` (torch internals
  and the libraries autoshard loads).

Warnings of autoshard's own modules stay visible. Nothing is filtered when
the user set warning options (``-W`` / ``PYTHONWARNINGS``) or when
``debug`` is true.
"""

from __future__ import annotations

import sys
import warnings

THIRD_PARTY = ("torch", "triton", "transformers", "safetensors", "ortools", "google", "networkx", "numpy", "sympy",
               "matplotlib", "yaml", "rich")
_DEVELOPER_WARNINGS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def filter_third_party_warnings(debug: bool = False) -> bool:
    """Install the filters of the module docstring; returns whether it did (not with ``debug`` or ``-W``)."""
    if debug or sys.warnoptions:
        return False
    for category in _DEVELOPER_WARNINGS:
        warnings.filterwarnings("ignore", category=category)
    modules = "|".join(THIRD_PARTY)
    warnings.filterwarnings("ignore", category=UserWarning, module=rf"({modules})(\.|$)")
    return True


__all__ = ["THIRD_PARTY", "filter_third_party_warnings"]
