"""Suite-wide pytest hooks.

Order of files: every file with a ``slow`` test (spawned gloo jobs, subprocess runs) runs before the
files without one, each group in its usual order. Under ``make test`` (pytest-xdist, ``--dist loadfile``:
whole files handed to the two workers in collection order) the long files then start first and the
many short ones fill the end, so one worker does not run a long file alone while the other idles
(longest-first scheduling, with the ``slow`` marker as the length estimate).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    first_seen: dict[object, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)
    items.sort(key=lambda item: (item.path not in slow_files, first_seen[item.path]))
