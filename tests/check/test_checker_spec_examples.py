"""Every example of docs/trace-format.md (copied here verbatim), and every example of
docs/checker.md (read from the file, with the expectation in the comment after each)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from trace_helpers import STORE_EXAMPLE, builder, races

from kvverify.check import Trace, check
from kvverify.check.oracle import explore

STORE = STORE_EXAMPLE


def _both(doc) -> dict:
    """{(first, second): kind} from the checker, after checking the oracle agrees."""
    trace = Trace.from_json(doc)
    report = check(trace)
    oracle = explore(trace)
    assert oracle.verdict == report.verdict
    assert set(oracle.unordered) == report.pairs()
    return {(r.first, r.second): r.kind for r in report.races}


def test_store_as_written_is_safe():
    assert _both(STORE) == {}


@pytest.mark.parametrize("order", ["ANY", "DURING_API_CALL"])
def test_store_out_of_stream_order_races_with_the_writer(order):
    doc = copy.deepcopy(STORE)
    doc["ops"][2]["order"] = order
    assert _both(doc) == {(0, 2): "RAW"}       # one race, ops 0 and 2, RAW


def test_store_without_the_barrier_races():
    doc = copy.deepcopy(STORE)
    del doc["ops"][1]
    assert _both(doc) == {(0, 1): "RAW"}       # indices shift


def test_load_with_host_source_written_once_in_any_order_is_safe():
    b = builder(streams=("compute", "offload"))
    b.host_write([("cpu", 0, 4096)])
    b.copy_batch("offload", "ANY", [(("cpu", 0, 4096), ("gpu", 0, 4096))])
    b.record("loaded", "offload")
    b.wait_event("compute", "loaded")
    b.kernel("compute", "use", reads=[("gpu", 0, 4096)])
    assert races(b) == {}


def test_document_header_example_parses():
    doc = json.loads("""
    {"version": 1,
     "buffers": {"gpu_kv": {"space": "device", "bytes": 1048576},
                 "cpu_kv": {"space": "host_pinned", "bytes": 1048576}},
     "streams": ["compute", "offload"],
     "ops": []}""")
    assert check(Trace.from_json(doc)).verdict == "SAFE"


# -- docs/checker.md ------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "checker.md"
_EXAMPLE = re.compile(r"```json\n([^`]*)```\n<!-- expect: (.*?) -->")


def _doc_examples():
    return [pytest.param(text, expect, id=f"example{k}")
            for k, (text, expect) in enumerate(_EXAMPLE.findall(DOC.read_text()))]


def test_docs_have_examples():
    assert len(_doc_examples()) >= 8


@pytest.mark.parametrize("text, expect", _doc_examples())
def test_docs_example(text, expect):
    verdict, _, rest = expect.partition(" ")
    expected = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        pair, kind = item.split()
        first, second = map(int, pair.split("-"))
        expected[(first, second)] = kind
    got = _both(json.loads(text))
    assert ("RACY" if got else "SAFE") == verdict
    assert got == expected
