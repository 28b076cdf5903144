"""Test tiers of the matrices: which cases ``make test`` runs and which only ``make test-full`` adds.

``make test`` is CI's tier and must stay within its time budget on two cores; ``make test-full``
(``AUTOSHARD_TESTS=full``) runs every case of every matrix, and every test marked ``full``.

The rule for a matrix (strategies × worlds × models, a gloo job per world): ``make test`` keeps one case
per code path, the case that exercises the most of it; a case whose every path another kept case
also runs (the same strategy on a smaller mesh, a sibling model family with the same layer forms, a
second schedule of the same stage code) moves to ``full``. Each file's sample names what its dropped
cases are covered by. Compiled cases cost ~9 s of a core per rank each (dynamo + AOT autograd), so
the compiled matrices are where most of the difference lies.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TypeVar

import pytest

T = TypeVar("T")

FULL = os.environ.get("AUTOSHARD_TESTS", "") == "full"

# a whole test that only ``make test-full`` runs (``make test`` deselects the marker)
full = pytest.mark.full


def sample(cases: Mapping[str, T], keep: Iterable[str]) -> dict[str, T]:
    """The cases of ``cases`` this tier runs: those named in ``keep`` (in ``cases``' order), or all of them
    under ``make test-full``. A name in ``keep`` that ``cases`` lacks is an error, so a renamed case
    cannot silently leave CI."""
    keep = set(keep)
    missing = keep - set(cases)
    if missing:
        raise KeyError(f"sampled cases not in the matrix: {sorted(missing)}")
    return dict(cases) if FULL else {name: case for name, case in cases.items() if name in keep}


def sample_list(cases: Iterable[T], keep: Iterable[T]) -> list[T]:
    """``sample`` for a matrix given as a list of parameter tuples."""
    cases = list(cases)
    return list(sample({repr(c): c for c in cases}, [repr(k) for k in keep]).values())
