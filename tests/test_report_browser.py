"""The report page in a real headless browser (Debian's ``chromium``; ``make test`` installs it when missing):
it renders (a non-trivial screenshot) and its DOM, after layout, holds the charts with their data.

Skipped with the reason when no ``chromium`` is on PATH. ``AUTOSHARD_REPORT_SCREENSHOT=PATH`` also saves the
screenshot there (how ``docs/img/report.png`` is made)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from autoshard.cli import main

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = [
    pytest.mark.slow,  # subprocess runs (headless chromium)
    pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH: `make test` installs Debian's "
                       "chromium (apt-get install chromium) when apt is available"),
]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-dev-shm-usage"]


def _browser(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, *FLAGS, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    work = tmp_path_factory.mktemp("report")
    plan, html = work / "plan.json", work / "plan.html"
    assert main(["plan", "llama:tiny", "--cluster", "h100-sxm:1x8", "--batch", "32", "--seq", "128",
                 "--micro-batch", "2", "--mesh", "pp=2,tp=2", "--time-limit", "5", "-o", str(plan)]) == 0
    assert main(["report", str(plan), "-o", str(html)]) == 0
    return html


def test_page_renders_to_a_screenshot(page, tmp_path):
    shot = tmp_path / "report.png"
    result = _browser("--window-size=1200,1500", f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    assert shot.stat().st_size > 30_000  # a blank 1200x1500 PNG is a few KB
    target = os.environ.get("AUTOSHARD_REPORT_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)


def test_dom_holds_the_charts_with_data(page):
    dom = _browser("--dump-dom", page.as_uri()).stdout
    assert 'id="strategy-map"' in dom and 'id="memory"' in dom and 'id="timeline"' in dom
    layers = int(re.search(r'id="strategy-map"[^>]*data-layers="(\d+)"', dom).group(1))
    assert layers == 12 and len(re.findall(r'<rect class="layer"', dom)) == layers  # llama:tiny's layers
    assert len(re.findall(r'class="memory-rank"', dom)) == 2
    samples = [int(n) for n in re.findall(r'class="mem-area" data-kind="[^"]+" data-samples="(\d+)"', dom)]
    assert len(samples) == 10 and min(samples) > 10
    assert max(float(x) for x in re.findall(r'data-kind="activations" data-samples="\d+" data-max="([\d.]+)"',
                                            dom)) > 0
    assert len(re.findall(r'<rect class="span"', dom)) > 50
