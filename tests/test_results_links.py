"""Every relative link of the project's pages into benchmarks/results/ or docs/ names a path that exists.

Results move between campaign folders; a page that cites a figure must follow it. Checked: README.md,
docs/*.md and the READMEs of benchmarks/results/. Links inside code blocks and code spans are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKED_ROOTS = (REPO / "benchmarks" / "results", REPO / "docs")
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
                *(REPO / "benchmarks" / "results").rglob("README.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_targets(page: Path) -> list[str]:
    """The link targets of a markdown page that are paths (no scheme, not a bare #anchor)."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        targets.append(target)
    return targets


def resolve(page: Path, target: str) -> Path:
    """Where a relative link of `page` points, anchor and query dropped."""
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    return (page.parent / path).resolve()


def test_pages_found():
    assert REPO / "README.md" in PAGES and REPO / "docs" / "benchmarks.md" in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_into_results_and_docs_resolve(page: Path):
    broken = []
    for target in relative_targets(page):
        path = resolve(page, target)
        if any(path == root or root in path.parents for root in CHECKED_ROOTS) and not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to missing paths: {broken}"


def test_link_parser_sees_links_and_skips_code(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("[a](x/y.md#s) ![i](img.png \"t\") `[c](not/a/link)` [w](https://e.org) [h](#top)\n"
                    "```\n[d](fenced/link)\n```\n", encoding="utf-8")
    assert relative_targets(page) == ["x/y.md#s", "img.png"]
    assert resolve(page, "x/y.md#s") == (tmp_path / "x" / "y.md").resolve()
