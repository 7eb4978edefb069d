"""The checker's fast paths held to references.

- The oracle (an independent enumerator of executions) on small traces, with the fast paths
  forced: every lane looked up through its segment map (``SCAN_LIMIT = 0``), and clocks cut into
  chunks of two entries so that joins, host snapshots and dirty chunks span several chunks (the
  oracle tests in test_checker_oracle.py run the checker as shipped).
- A pairwise reference on busier traces (every pair of accesses of ``analyze``, ordered or not by
  ``happens_before``, and every pair of copies of one batch): the same racing pairs, the same
  lowest overlap, a kind the reference also sees, whatever the fast paths.
- Traces of the shapes that once cost minutes, small enough to check here, for their verdicts.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from trace_helpers import assert_agrees_with_the_oracle
from trace_strategies import busy_traces, small_traces

from kvverify.check import (
    Copy,
    CopyBatch,
    Trace,
    analyze,
    check,
    checker,
    happens_before,
    rules,
)

SETTINGS = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
BUSY = settings(SETTINGS, max_examples=100)

# (lanes checked one by one up to, chunk bits): as shipped; segment maps always and clocks of many
# small chunks
AS_SHIPPED, FORCED = (checker.SCAN_LIMIT, rules.CHUNK_BITS), (0, 1)


@contextlib.contextmanager
def fast_paths(scan_limit: int, chunk_bits: int):
    saved = checker.SCAN_LIMIT, rules.CHUNK_BITS, rules.CHUNK, rules.MASK
    checker.SCAN_LIMIT = scan_limit
    rules.CHUNK_BITS, rules.CHUNK, rules.MASK = chunk_bits, 1 << chunk_bits, (1 << chunk_bits) - 1
    try:
        yield
    finally:
        checker.SCAN_LIMIT, rules.CHUNK_BITS, rules.CHUNK, rules.MASK = saved


@SETTINGS
@given(trace=small_traces(max_nodes=8, max_ops=12))
def test_forced_fast_paths_agree_with_the_oracle(trace):
    with fast_paths(*FORCED):
        assert_agrees_with_the_oracle(trace)


def _kind(a_write: bool, b_write: bool) -> str:
    return "WAW" if a_write and b_write else ("RAW" if a_write else "WAR")


def _frees(a, b) -> str | None:
    """Rule 9: a pair with a free is of kind FREE; "no race" (None) for two frees."""
    frees = (a.role == "free") + (b.role == "free")
    return None if frees == 2 else ("FREE" if frees else _kind(a.write, b.write))


def reference(trace: Trace) -> dict[tuple[int, int], tuple[tuple[int, int], set[str]]]:
    """Per racing op pair: the lowest overlap as (buffer rank, first byte) and the kinds seen there."""
    rank = {name: n for n, name in enumerate(sorted(trace.buffers))}  # buffers in name order
    best: dict[tuple[int, int], tuple[tuple[int, int], set[str]]] = {}

    def note(pair, buf, lo, kind):
        where = (rank[buf], lo)
        old = best.get(pair)
        if old is None or where < old[0]:
            best[pair] = (where, {kind})
        elif where == old[0]:
            old[1].add(kind)

    _, accesses = analyze(trace)
    for a, b in itertools.combinations(accesses, 2):     # a issued before b
        lo, hi = max(a.offset, b.offset), min(a.offset + a.length, b.offset + b.length)
        if (a.op != b.op and a.buffer == b.buffer and lo < hi and (a.write or b.write)
                and not happens_before(a, b) and (kind := _frees(a, b))):
            note((a.op, b.op), a.buffer, lo, kind)
    for j, op in enumerate(trace.ops):      # rule 7: copies of one op, a copy's own two sides
        if isinstance(op, (Copy, CopyBatch)):
            sides = [(c, 0, src, False) for c, (src, _) in enumerate(op.copies)]
            sides += [(c, 1, dst, True) for c, (_, dst) in enumerate(op.copies)]
            for x, y in itertools.combinations(sorted(sides), 2):     # x issued before y
                lo, hi = max(x[2].offset, y[2].offset), min(x[2].end, y[2].end)
                if x[2].buffer == y[2].buffer and lo < hi and (x[3] or y[3]):
                    note((j, j), x[2].buffer, lo, _kind(x[3], y[3]))
    return best


@pytest.mark.parametrize("scan_limit, chunk_bits", [AS_SHIPPED, FORCED], ids=["as-shipped", "forced"])
@BUSY
@given(trace=busy_traces())
def test_fast_paths_agree_with_every_pair_of_accesses(scan_limit, chunk_bits, trace):
    with fast_paths(scan_limit, chunk_bits):
        report = check(trace, max_races=None)
    expected = reference(trace)
    rank = {name: n for n, name in enumerate(sorted(trace.buffers))}  # buffers in name order
    assert report.pairs() == set(expected), trace.dumps()
    for race in report.races:
        where, kinds = expected[(race.first, race.second)]
        assert (rank[race.overlap.buffer], race.overlap.offset) == where, (race, trace.dumps())
        assert race.kind in kinds, (race, kinds)


# -- the shapes that once cost minutes (issue #11), at sizes a test can afford ---------------------


def _doc(buffers: dict, streams: list[str], ops: list[dict]) -> dict:
    return {"version": 1, "buffers": buffers, "streams": streams, "ops": ops}


def test_sync_device_with_many_streams_observes_every_stream():
    streams = [f"s{k}" for k in range(300)]
    ops = [{"op": "kernel", "stream": s, "writes": [["out", k * 8, 8]]} for k, s in enumerate(streams)]
    racy = _doc({"out": {"space": "host_pinned", "bytes": 2400}}, streams,
                ops + [{"op": "host_read", "ranges": [["out", 0, 2400]]}])
    assert check(racy).pairs() == {(k, 300) for k in range(300)}
    safe = _doc(racy["buffers"], streams, ops + [{"op": "sync_device"}, {"op": "host_read", "ranges": [["out", 0, 2400]]}])
    assert check(safe).safe
    # a stream that waited on another before the sync is observed through its own entry too
    late = _doc(racy["buffers"], streams, [*ops, {"op": "sync_device"},
                                           {"op": "kernel", "stream": "s299", "writes": [["out", 0, 8]]},
                                           {"op": "wait_stream", "stream": "s7", "on": "s299"},
                                           {"op": "record", "event": "e", "stream": "s7"},
                                           {"op": "sync_event", "event": "e"},
                                           {"op": "host_read", "ranges": [["out", 0, 8]]}])
    assert check(late).safe


def test_host_syncs_round_robin_over_many_streams():
    streams = [f"s{k}" for k in range(200)]
    ops = []
    for k, s in enumerate(streams):
        ops.append({"op": "kernel", "stream": s, "writes": [["out", k * 8, 8]]})
        ops.append({"op": "record", "event": f"e{k}", "stream": s})
    for n in range(2000):
        k = n % 200
        ops.append({"op": "sync_stream", "stream": streams[k]} if n % 2 else
                   {"op": "query_event", "event": f"e{k}", "result": True})
    ops.append({"op": "host_read", "ranges": [["out", 0, 1600]]})
    assert check(_doc({"out": {"space": "host_pinned", "bytes": 1600}}, streams, ops)).safe
    ops[-1:-1] = [{"op": "kernel", "stream": "s3", "writes": [["out", 24, 8]]}]    # after the last sync of s3
    assert check(_doc({"out": {"space": "host_pinned", "bytes": 1600}}, streams, ops)).pairs() == {(len(ops) - 2, len(ops) - 1)}


def test_one_writer_of_many_ranges_against_unsynchronized_whole_buffer_readers():
    n = 5000
    streams = [f"s{k}" for k in range(41)]
    ops = [{"op": "kernel", "stream": "s0", "writes": [["buf", k * 128, 64] for k in range(n)]}]
    ops += [{"op": "kernel", "stream": s, "reads": [["buf", 0, n * 128]]} for s in streams[1:]]
    report = check(_doc({"buf": {"space": "device", "bytes": n * 128}}, streams, ops))
    assert report.pairs() == {(0, k) for k in range(1, 41)}
    assert {(r.kind, tuple(r.overlap)) for r in report.races} == {("RAW", ("buf", 0, 64))}


def test_the_race_cap_stops_listing_not_deciding():
    n = 2000
    streams = [f"s{k}" for k in range(301)]
    ops = [{"op": "kernel", "stream": "s0", "writes": [["buf", k * 128, 64] for k in range(n)]}]
    ops += [{"op": "kernel", "stream": s, "reads": [["buf", 0, n * 128]]} for s in streams[1:]]
    report = check(_doc({"buf": {"space": "device", "bytes": n * 128}}, streams, ops), max_races=100)
    assert report.verdict == "RACY" and report.truncated and report.pairs() == {(0, k) for k in range(1, 101)}


def test_a_host_write_of_many_ranges_then_many_streams():
    n = 5000
    streams = [f"s{k}" for k in range(100)]
    ops = [{"op": "host_write", "ranges": [["pinned", k * 128, 64] for k in range(n)]}]
    ops += [{"op": "kernel", "stream": s, "reads": [["pinned", 0, n * 128]], "writes": [["out", k * 8, 8]]}
            for k, s in enumerate(streams)]
    buffers = {"pinned": {"space": "host_pinned", "bytes": n * 128}, "out": {"space": "device", "bytes": 800}}
    assert check(_doc(buffers, streams, ops)).safe
    ops.append({"op": "host_write", "ranges": [["pinned", 128 * k, 8] for k in range(0, n, 7)]})
    assert check(_doc(buffers, streams, ops)).pairs() == {(k, 101) for k in range(1, 101)}


@pytest.mark.parametrize("scan_limit, chunk_bits", [AS_SHIPPED, FORCED], ids=["as-shipped", "forced"])
@pytest.mark.parametrize("host_syncs", [False, True], ids=["one-base", "later-bases"])
def test_waits_chain_across_chunks(scan_limit, chunk_bits, host_syncs):
    """s0 writes; s9 waits on s0, s18 on s9, ... s45 on s36: what s45 does next is ordered after
    the write, through clock entries that sit in different chunks (and, with host synchronizations
    of other streams in between, on different host snapshots); s47, which waits for nothing, is not."""
    streams = [f"s{k}" for k in range(48)]
    chain = streams[0:48:9]

    def trace(space: str, tail: list[dict]) -> Trace:
        ops = [{"op": "kernel", "stream": "s0", "writes": [["buf", 0, 8]]}]
        for k, (prev, nxt) in enumerate(itertools.pairwise(chain)):
            if host_syncs:
                ops.append({"op": "kernel", "stream": streams[k + 1], "writes": [["other", k * 8, 8]]})
                ops.append({"op": "sync_stream", "stream": streams[k + 1]})
            ops.append({"op": "kernel", "stream": nxt, "writes": [["other", 100 + k * 8, 8]]})
            ops.append({"op": "wait_stream", "stream": nxt, "on": prev})
        if host_syncs:    # the chain's last stream then works on a later host snapshot
            ops.append({"op": "kernel", "stream": "s46", "writes": [["other", 200, 8]]})
            ops.append({"op": "sync_stream", "stream": "s46"})
        buffers = {"buf": {"space": space, "bytes": 8}, "other": {"space": "device", "bytes": 256}}
        return Trace.from_json(_doc(buffers, streams, ops + tail))

    with fast_paths(scan_limit, chunk_bits):
        device = trace("device", [{"op": "kernel", "stream": chain[-1], "reads": [["buf", 0, 8]]},
                                  {"op": "kernel", "stream": "s47", "reads": [["buf", 0, 8]]}])
        assert check(device).pairs() == {(0, len(device.ops) - 1)}
        synced = trace("host_pinned", [{"op": "record", "event": "end", "stream": chain[-1]},
                                       {"op": "sync_event", "event": "end"},
                                       {"op": "host_write", "ranges": [["buf", 0, 8]]}])
        assert check(synced).safe
        second_last = trace("host_pinned", [{"op": "record", "event": "end", "stream": chain[-2]},
                                            {"op": "sync_event", "event": "end"},
                                            {"op": "host_write", "ranges": [["buf", 0, 8]]}])
        assert check(second_last).safe      # the chain's second-last stream follows s0 too
        alone = trace("host_pinned", [{"op": "record", "event": "end", "stream": "s47"},
                                      {"op": "sync_event", "event": "end"},
                                      {"op": "host_write", "ranges": [["buf", 0, 8]]}])
        assert check(alone).pairs() == {(0, len(alone.ops) - 1)}
