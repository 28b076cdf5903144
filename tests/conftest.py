"""Suite-wide pytest hooks.

Order of files: every file with a ``slow`` test (spawned gloo jobs, subprocess runs) runs before the
files without one, each group in its usual order. Under ``make test`` (pytest-xdist, ``--dist loadfile``:
whole files handed to the two workers in collection order) the long files then start first and the
many short ones fill the end, so one worker does not run a long file alone while the other idles
(longest-first scheduling, with the ``slow`` marker as the length estimate).

Capture cache: a run of the suite starts with an empty one of its own (``AUTOSHARD_CACHE_DIR``, a new
temporary folder unless set), shared by the xdist workers, their spawned ranks and CLI subprocesses,
which inherit the environment. A developer's ``~/.cache/autoshard`` is never read, and CI's cold start
is what every run sees. The runtime's exports are kept there too (``AUTOSHARD_EXPORT_CACHE=disk``,
``runtime/export_cache.py`` note "on disk"): the ranks of a job, and later jobs, load the program one
of them exported.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_ENV = "AUTOSHARD_CACHE_DIR"
_EXPORT_ENV = "AUTOSHARD_EXPORT_CACHE"
_OWN_CACHE = "_autoshard_test_cache"


def pytest_configure(config: pytest.Config) -> None:
    if _CACHE_ENV not in os.environ:  # the controller sets it before it starts the xdist workers
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="autoshard-test-cache-")
        setattr(config, _OWN_CACHE, os.environ[_CACHE_ENV])
    os.environ.setdefault(_EXPORT_ENV, "disk")


def pytest_unconfigure(config: pytest.Config) -> None:
    own = getattr(config, _OWN_CACHE, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    first_seen: dict[object, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (item.path not in slow_files, first_seen[item.path]))
