"""``tests/_tiers.py``: ``make test`` runs the named sample of a matrix, ``make test-full`` all of it."""

from __future__ import annotations

import importlib

import pytest

import _tiers


def test_sample_keeps_the_named_cases_in_matrix_order(monkeypatch):
    monkeypatch.setattr(_tiers, "FULL", False)
    assert list(_tiers.sample({"a": 1, "b": 2, "c": 3}, ("c", "a"))) == ["a", "c"]
    assert _tiers.sample_list([("x", 1), ("y", 2)], [("y", 2)]) == [("y", 2)]


def test_full_tier_keeps_every_case(monkeypatch):
    monkeypatch.setattr(_tiers, "FULL", True)
    assert _tiers.sample({"a": 1, "b": 2}, ("a",)) == {"a": 1, "b": 2}


def test_a_sampled_name_missing_from_the_matrix_is_an_error():
    with pytest.raises(KeyError, match="renamed"):
        _tiers.sample({"a": 1}, ("renamed",))


def test_the_environment_chooses_the_tier(monkeypatch):
    try:
        monkeypatch.setenv("AUTOSHARD_TESTS", "full")
        assert importlib.reload(_tiers).FULL
        monkeypatch.delenv("AUTOSHARD_TESTS")
        assert not importlib.reload(_tiers).FULL
    finally:
        monkeypatch.undo()
        importlib.reload(_tiers)
