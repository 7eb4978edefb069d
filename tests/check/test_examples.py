"""The traces in ``examples/`` (the README points newcomers at them): each gives the verdict its
name says, and each racy one the race its story is about."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvverify

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# file -> (verdict, the races as (kind, first op's `at`, second op's `at`))
EXPECTED = {
    "store-stream-safe.json": ("SAFE", []),
    "store-any-racy.json": ("RACY", [("RAW", "engine.py:40 in forward", "offload.py:13 in store")]),
    "load-any-safe.json": ("SAFE", []),
    "load-any-rewrite-racy.json": ("RACY", [("WAR", "offload.py:52 in load", "offload.py:55 in load")]),
}


def test_every_example_has_an_expectation():
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_example_gives_the_verdict_its_name_says(name):
    verdict = kvverify.check(EXAMPLES / name)
    expected_verdict, races = EXPECTED[name]
    ops = verdict.trace.ops
    assert verdict.verdict == expected_verdict
    assert [(r.kind, ops[r.first].at, ops[r.second].at) for r in verdict.races] == races
