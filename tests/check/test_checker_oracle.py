"""The checker against its oracle (an independent enumerator of executions), and the oracle itself."""

from __future__ import annotations

import ast
import inspect

import pytest
from hypothesis import HealthCheck, given, settings
from trace_helpers import CPU, GPU, GPU2, assert_agrees_with_the_oracle, builder
from trace_strategies import small_traces

import kvverify.check.oracle as oracle_module
from kvverify.check import check
from kvverify.check.oracle import build_graph, explore, unordered_conflicts

# Deterministic in CI (derandomize: the same examples every run, no example database), and quick.
PROPERTY = settings(max_examples=1000, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
BIGGER = settings(PROPERTY, max_examples=250)


@PROPERTY
@given(small_traces())
def test_checker_flags_a_race_exactly_when_the_oracle_finds_a_disagreement(trace):
    assert_agrees_with_the_oracle(trace)


@BIGGER
@given(small_traces(max_nodes=9, max_ops=14))
def test_checker_agrees_with_the_oracle_on_longer_traces(trace):
    assert_agrees_with_the_oracle(trace)


# -- the oracle itself ---------------------------------------------------------------------------


def _store(order: str):
    b = builder(streams=("compute", "offload"))
    b.kernel("compute", "write_kv", writes=[GPU])      # 0
    b.wait_stream("offload", on="compute")             # 1
    b.copy_batch("offload", order, [(GPU, CPU)])       # 2
    return b.build()


def test_oracle_finds_the_any_store_race_with_a_witness():
    result = explore(_store("ANY"))
    assert result.disagree and result.verdict == "RACY"
    w = result.witness
    assert w["observed_at"] == "op 2 copy 0 src"
    # the first execution read after the kernel, the second before it
    assert w["execution_1"].index("op 0 kernel") < w["execution_1"].index("op 2 copy 0 src")
    assert w["execution_2"] == ["op 2 copy 0 src"]
    assert result.unordered == {(0, 2): {"RAW"}}


def test_oracle_stream_order_store_is_safe():
    result = explore(_store("STREAM"))
    assert not result.disagree and result.witness is None and result.unordered == {}


def test_oracle_sees_unordered_writes_that_a_later_write_hides():
    # nothing reads between the two writes and a third write covers both: only what each write
    # overwrites tells the executions apart, and the spec calls the pair a race
    b = builder()
    b.kernel("compute", "w1", writes=[GPU])            # 0
    b.kernel("offload", "w2", writes=[GPU])            # 1
    b.wait_stream("load", on="compute")
    b.wait_stream("load", on="offload")
    b.kernel("load", "w3", writes=[GPU])               # 4
    trace = b.build()
    result = explore(trace)
    assert result.disagree and result.witness["observed_at"] in ("op 0 kernel", "op 1 kernel")
    assert {(r.first, r.second, r.kind) for r in check(trace).races} == {(0, 1, "WAW")}


def test_oracle_explores_every_order_of_independent_accesses():
    b = builder()
    b.kernel("compute", "a", writes=[GPU])
    b.kernel("offload", "b", writes=[GPU2])
    b.kernel("load", "c", reads=[CPU])
    result = explore(b.build())
    assert not result.disagree
    assert result.states >= 7      # every subset of three unordered accesses was reached


def test_oracle_refuses_big_traces():
    b = builder()
    for _ in range(11):
        b.kernel("compute", "k", writes=[GPU])
    with pytest.raises(ValueError, match="at most 10"):
        explore(b.build())


def _reaches(graph, a: str, b: str) -> bool:
    ids = {name: n for n, name in enumerate(graph.names)}
    return bool(graph.reach()[ids[a]] >> ids[b] & 1)


def test_graph_places_source_reads_by_order():
    b = builder()
    b.copy_batch("offload", "DURING_API_CALL", [(GPU, CPU)])   # 0
    b.copy_batch("offload", "ANY", [(GPU, CPU)])               # 1
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])            # 2
    g = build_graph(b.build())
    assert _reaches(g, "op 0 copy 0 src", "ret 0")             # during the call
    assert not _reaches(g, "begin 0", "op 0 copy 0 src")       # not in stream order
    assert not _reaches(g, "op 1 copy 0 src", "ret 1")         # ANY: until the copy completes ...
    assert _reaches(g, "op 1 copy 0 src", "end 1")
    assert _reaches(g, "call 1", "op 1 copy 0 src") and not _reaches(g, "end 0", "op 1 copy 0 src")
    assert _reaches(g, "end 1", "op 2 copy 0 src")             # STREAM: after the stream's work
    assert not _reaches(g, "op 2 copy 0 src", "op 2 copy 0 dst")   # rule 7


def test_graph_pageable_and_events():
    b = builder()
    b.copy("offload", GPU, ("page", 0, 4096))                  # 0: stream-ordered (rule 6 as amended)
    b.wait_event("compute", "never")                           # 1
    b.record("e", "offload")                                   # 2
    b.query_event("e", False)                                  # 3
    b.sync_event("e")                                          # 4
    g = build_graph(b.build())
    assert not _reaches(g, "op 0 copy 0 dst", "ret 0") and not _reaches(g, "op 0 copy 0 src", "ret 0")
    assert _reaches(g, "op 0 copy 0 dst", "ret 4")               # ...observed by the sync on op 2's event
    assert not _reaches(g, "record 2", "ret 3")                # a query that saw false
    assert _reaches(g, "record 2", "ret 4")
    assert "wait 1" not in g.names  # a wait on an event never recorded is a no-op: no item of its stream


def test_unordered_conflicts_lists_kinds_by_issue_order():
    b = builder()
    b.kernel("compute", "rw", reads=[GPU], writes=[GPU2])      # 0
    b.kernel("offload", "wr", reads=[GPU2], writes=[GPU])      # 1
    assert unordered_conflicts(b.build()) == {(0, 1): {"RAW", "WAR"}}


def test_oracle_does_not_reuse_the_checker():
    tree = ast.parse(inspect.getsource(oracle_module))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert {m for m in imported if m.startswith("kvverify")} == {"kvverify.check.model"}
