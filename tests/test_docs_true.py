"""Docs that name code facts hold them: checked here where it is cheap."""

from __future__ import annotations

import re
from pathlib import Path

from autoshard.passes import PASSES

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_doc_lists_the_passes_in_their_order():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Passes and runtime"):]
    paragraph = section[section.index("(`PASSES`"):section.index("Collectives are")]
    listed = re.findall(r"`([a-z_]+)`", paragraph.split(":", 1)[1])
    assert listed == [p.NAME if hasattr(p, "NAME") else p.__name__.rsplit(".", 1)[-1] for p in PASSES]


def test_passes_package_docstring_names_the_last_pass():
    import autoshard.passes as passes

    last = PASSES[-1].__name__.rsplit(".", 1)[-1]
    assert f"``{last}`` runs last" in passes.__doc__
