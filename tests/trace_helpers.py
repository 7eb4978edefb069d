"""Small helpers for the checker's tests."""

from __future__ import annotations

import json

from kvverify.check import Trace, TraceBuilder, Verdict, check
from kvverify.check.oracle import build_graph, explore

ORACLE_LIMIT = 9   # access nodes; the oracle's search grows quickly beyond

# The example of TRACE_FORMAT.md, "Examples", verbatim: a store behind a barrier, STREAM order.
STORE_EXAMPLE = json.loads("""
{"version": 1,
 "buffers": {"gpu": {"space": "device", "bytes": 8192}, "cpu": {"space": "host_pinned", "bytes": 8192}},
 "streams": ["compute", "offload"],
 "ops": [
  {"op": "kernel", "stream": "compute", "name": "write_kv", "reads": [], "writes": [["gpu", 0, 4096]]},
  {"op": "wait_stream", "stream": "offload", "on": "compute"},
  {"op": "copy_batch", "stream": "offload", "order": "STREAM", "copies": [{"src": ["gpu", 0, 4096], "dst": ["cpu", 0, 4096]}]},
  {"op": "record", "event": "end", "stream": "offload"},
  {"op": "sync_event", "event": "end"},
  {"op": "host_read", "ranges": [["cpu", 0, 4096]]}]}
""")

GPU = ("gpu", 0, 4096)
GPU2 = ("gpu", 4096, 4096)
CPU = ("cpu", 0, 4096)
CPU2 = ("cpu", 4096, 4096)
PAGE = ("page", 0, 4096)


def assert_agrees_with_the_oracle(trace: Trace) -> None:
    """The checker and the oracle on ``trace``: the same verdict (a race exactly when two allowed
    executions can disagree), the same racing op pairs, and each race's kind one the oracle sees."""
    report = check(trace)
    result = explore(trace)
    assert report.verdict == result.verdict, (trace.dumps(), report.to_json(), result.witness)
    assert report.pairs() == set(result.unordered), (trace.dumps(), report.to_json(), result.unordered)
    for race in report.races:
        assert race.kind in result.unordered[(race.first, race.second)]


def builder(streams=("compute", "offload", "load")) -> TraceBuilder:
    """Buffers of every space (8 KiB each) and the given streams."""
    b = TraceBuilder()
    b.buffer("gpu", "device", 8192)
    b.buffer("gpu_b", "device", 8192)
    b.buffer("cpu", "host_pinned", 8192)
    b.buffer("reg", "host_registered", 8192)
    b.buffer("page", "host_pageable", 8192)
    for s in streams:
        b.stream(s)
    return b


def races(b: TraceBuilder) -> dict[tuple[int, int], str]:
    """{(first, second): kind} of the built trace's races."""
    return {(r.first, r.second): r.kind for r in run(b).races}


def run(b: TraceBuilder) -> Verdict:
    """Check the built trace; where it is small enough, the oracle must agree on the verdict and
    on the racing op pairs (so every hand-written trace is checked twice, independently)."""
    trace = b.build()
    report = check(trace)
    assert report.verdict == ("RACY" if report.races else "SAFE")
    if len(build_graph(trace).accesses) <= ORACLE_LIMIT:
        result = explore(trace, max_accesses=ORACLE_LIMIT)
        assert result.verdict == report.verdict, result.witness
        assert set(result.unordered) == report.pairs()
        for r in report.races:
            assert r.kind in result.unordered[(r.first, r.second)]
    return report


def only(b: TraceBuilder):
    """The one race of the built trace."""
    report = run(b)
    assert len(report.races) == 1, report.races
    return report.races[0]
