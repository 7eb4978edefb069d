"""One test (at least) per ordering rule 1–7 of TRACE_FORMAT.md, plus the race report's shape."""

from __future__ import annotations

import pytest
from trace_helpers import CPU, CPU2, GPU, GPU2, PAGE, builder, only, races, run

from kvverify.check import Range, analyze, check, happens_before
from kvverify.check.rules import entry

ORDERS = ("STREAM", "DURING_API_CALL", "ANY")


# -- Rule 1: program order ---------------------------------------------------------------------


def test_rule1_host_ops_follow_each_other():
    b = builder()
    b.host_write([CPU])
    b.host_read([CPU])
    b.host_write([CPU])
    assert races(b) == {}


def test_rule1_work_starts_after_it_is_issued():
    b = builder()
    b.host_write([CPU])                         # 0
    b.kernel("compute", "k", reads=[CPU])       # 1: reads pinned memory after the write
    b.copy("offload", CPU, GPU)                 # 2: reads it too
    assert races(b) == {}


def test_rule1_issued_is_not_completed():
    b = builder()
    b.kernel("compute", "k", reads=[CPU])       # 0
    b.host_write([CPU])                         # 1: the kernel may still be reading
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "WAR", "4")


# -- Rule 2: stream order, wait_event / wait_stream ---------------------------------------------


def test_rule2_one_stream_runs_in_issue_order():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.kernel("compute", "r", reads=[GPU])
    b.copy_batch("compute", "STREAM", [(GPU, CPU)])
    b.kernel("compute", "w2", writes=[GPU])
    assert races(b) == {}


def test_rule2_two_streams_are_unordered():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.kernel("offload", "r", reads=[GPU])
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "RAW", "2")
    assert r.fix == "add `offload.wait_stream(compute)` before op 1"


def test_rule2_wait_event_orders_the_capture():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.record("e", "compute")
    b.wait_event("offload", "e")
    b.kernel("offload", "r", reads=[GPU])
    assert races(b) == {}


def test_rule2_wait_stream_orders_what_was_issued_before_it_only():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])      # 0
    b.wait_stream("offload", on="compute")      # 1
    b.kernel("compute", "w2", writes=[GPU2])    # 2: after the wait_stream
    b.kernel("offload", "r", reads=[GPU, GPU2])  # 3
    assert races(b) == {(2, 3): "RAW"}


def test_rule2_is_transitive_across_streams():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.record("a", "compute")
    b.wait_event("offload", "a")
    b.kernel("offload", "x", reads=[GPU2])
    b.record("b", "offload")
    b.wait_event("load", "b")
    b.kernel("load", "r", reads=[GPU])
    assert races(b) == {}


def test_rule2_a_wait_does_not_reach_back():
    # the waiting stream's earlier work is not ordered after the event
    b = builder()
    b.kernel("offload", "r", reads=[GPU])       # 0
    b.kernel("compute", "w", writes=[GPU])      # 1
    b.record("e", "compute")
    b.wait_event("offload", "e")
    assert races(b) == {(0, 1): "WAR"}


# -- Rule 3: events never recorded; a later record replaces the capture -------------------------


def test_rule3_waiting_on_a_never_recorded_event_orders_nothing():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])      # 0
    b.wait_event("offload", "e")                # 1: e not recorded yet
    b.record("e", "compute")                    # 2: too late for op 1
    b.kernel("offload", "r", reads=[GPU])       # 3
    r = only(b)
    assert (r.first, r.second, r.rule) == (0, 3, "2")
    assert "never recorded" in r.reason and "rule 3" in r.reason


@pytest.mark.parametrize("sync", ["sync_event", "query_event"])
def test_rule3_syncing_on_a_never_recorded_event_orders_nothing(sync):
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])   # 0
    if sync == "sync_event":
        b.sync_event("e")                             # 1
    else:
        b.query_event("e", True)                      # 1: CUDA says "complete" at once
    b.record("e", "offload")                          # 2
    b.host_read([CPU])                                # 3
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 3, "RAW", "4")
    assert "never recorded" in r.reason


def test_rule3_a_later_record_replaces_the_capture():
    b = builder()
    b.kernel("compute", "w1", writes=[GPU])     # 0
    b.record("e", "compute")                    # 1: captures op 0
    b.kernel("compute", "w2", writes=[GPU2])    # 2
    b.wait_event("offload", "e")                # 3: waits for op 0 only
    b.kernel("offload", "r1", reads=[GPU])      # 4: ordered
    b.kernel("offload", "r2", reads=[GPU2])     # 5: not ordered after op 2
    b.record("e", "compute")                    # 6: now captures op 2
    b.wait_event("load", "e")                   # 7
    b.kernel("load", "r3", reads=[GPU, GPU2])   # 8: ordered after both writes
    assert races(b) == {(2, 5): "RAW"}


def test_rule3_a_capture_from_before_the_write_is_named():
    b = builder()
    b.record("e", "compute")                    # 0: captures nothing
    b.kernel("compute", "w", writes=[GPU])      # 1
    b.wait_event("offload", "e")                # 2
    b.kernel("offload", "r", reads=[GPU])       # 3
    r = only(b)
    assert (r.first, r.second) == (1, 3)
    assert "recorded at op 0, before op 1" in r.reason


def test_rule3_record_on_an_idle_stream_captures_nothing():
    b = builder()
    b.record("e", "offload")                    # nothing issued to offload yet
    b.kernel("compute", "w", writes=[GPU])
    b.sync_event("e")
    b.kernel("load", "r", reads=[GPU])
    assert races(b) == {(1, 3): "RAW"}


# -- Rule 4: host synchronization ---------------------------------------------------------------


@pytest.mark.parametrize("sync", ["sync_stream", "sync_device", "sync_event", "query_true"])
def test_rule4_host_sync_orders_captured_work_before_later_host_ops(sync):
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])
    b.record("done", "offload")
    {"sync_stream": lambda: b.sync_stream("offload"), "sync_device": b.sync_device,
     "sync_event": lambda: b.sync_event("done"), "query_true": lambda: b.query_event("done", True)}[sync]()
    b.host_read([CPU])
    assert races(b) == {}


def test_rule4_a_query_that_saw_not_ready_orders_nothing():
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])   # 0
    b.record("done", "offload")                       # 1
    b.query_event("done", False)                      # 2
    b.host_read([CPU])                                # 3
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 3, "RAW", "4")
    assert "saw it not complete" in r.reason
    assert r.fix.startswith("add `sync_stream('offload')` before op 3")
    assert "sync_event('done')" in r.fix


def test_rule4_syncing_another_stream_does_not_help():
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])
    b.sync_stream("compute")
    b.host_read([CPU])
    assert races(b) == {(0, 2): "RAW"}


def test_rule4_host_sync_orders_before_everything_issued_later():
    # no wait between the streams: the host saw op 0 complete before issuing op 2
    b = builder()
    b.kernel("compute", "w", writes=[GPU])      # 0
    b.sync_stream("compute")                    # 1
    b.kernel("offload", "r", reads=[GPU])       # 2
    b.copy_batch("load", "ANY", [(GPU, CPU)])   # 3: even a source read in ANY order
    assert races(b) == {}


def test_rule4_sync_event_orders_only_the_capture():
    b = builder()
    b.kernel("compute", "w1", writes=[GPU])     # 0
    b.record("e", "compute")                    # 1
    b.kernel("compute", "w2", writes=[GPU2])    # 2
    b.sync_event("e")                           # 3
    b.kernel("offload", "r", reads=[GPU, GPU2])  # 4
    assert races(b) == {(2, 4): "RAW"}


# -- Rule 5: source access order of copy_batch --------------------------------------------------


@pytest.mark.parametrize("order, expected", [
    ("STREAM", {}),
    ("DURING_API_CALL", {(0, 1): "RAW"}),
    ("ANY", {(0, 1): "RAW"}),
])
def test_rule5_only_stream_order_reads_after_the_streams_pending_work(order, expected):
    b = builder()
    b.kernel("offload", "w", writes=[GPU])               # 0: pending on the copy's own stream
    b.copy_batch("offload", order, [(GPU, CPU)])         # 1
    assert races(b) == expected
    if expected:
        r = only(b)
        assert r.rule == "5"
        assert "its own stream 'offload'" in r.reason
        assert r.fix.startswith("use STREAM order for op 1")


@pytest.mark.parametrize("order, expected", [
    ("STREAM", {(1, 2): "WAR"}),
    ("DURING_API_CALL", {}),          # read during the call: before the host's next op
    ("ANY", {(1, 2): "WAR"}),         # read any time until the copy completes
])
def test_rule5_when_the_host_may_rewrite_the_source(order, expected):
    b = builder()
    b.host_write([CPU])                                  # 0
    b.copy_batch("load", order, [(CPU, GPU)])            # 1
    b.host_write([CPU])                                  # 2
    assert races(b) == expected


@pytest.mark.parametrize("order", ORDERS)
def test_rule5_every_order_reads_after_what_the_host_observed(order):
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.sync_stream("compute")
    b.copy_batch("offload", order, [(GPU, CPU)])
    assert races(b) == {}


@pytest.mark.parametrize("order", ORDERS)
def test_rule5_the_source_read_completes_with_the_copy(order):
    # whatever the order, the read is over when the copy completes in stream order
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU)])            # 0
    b.kernel("load", "overwrite_src", writes=[CPU])      # 1: after the copy, same stream
    b.record("e", "load")
    b.wait_event("compute", "e")
    b.kernel("compute", "k", writes=[CPU2], reads=[GPU])
    b.sync_event("e")
    b.host_write([CPU])
    assert races(b) == {}


@pytest.mark.parametrize("order", ORDERS)
def test_rule5_the_destination_is_always_written_in_stream_order(order):
    b = builder()
    b.kernel("load", "reader", reads=[GPU])              # 0
    b.copy_batch("load", order, [(CPU, GPU)])            # 1: overwrites after op 0, any order
    b.record("e", "load")
    b.wait_event("compute", "e")
    b.kernel("compute", "use", reads=[GPU])
    assert races(b) == {}


def test_rule5_any_behind_a_barrier_is_not_behind_it():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])               # 0
    b.wait_stream("offload", on="compute")               # 1
    b.copy_batch("offload", "ANY", [(GPU, CPU)])         # 2
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 2, "RAW", "5")
    assert "ANY order" in r.reason and "op 1's wait on 'compute'" in r.reason
    assert r.fix.startswith("use STREAM order for op 2")


def test_rule5_any_without_barrier_names_both_fixes():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.copy_batch("offload", "DURING_API_CALL", [(GPU, CPU)])
    r = only(b)
    assert r.rule == "5"
    assert "offload.wait_stream(compute)" in r.fix and "STREAM order" in r.fix


# -- Rule 6: pageable host memory ---------------------------------------------------------------


@pytest.mark.parametrize("op", ["copy", "STREAM", "DURING_API_CALL", "ANY"])
def test_rule6_a_pageable_source_is_read_during_the_call(op):
    b = builder()
    b.host_write([PAGE])
    if op == "copy":
        b.copy("load", PAGE, GPU)
    else:
        b.copy_batch("load", op, [(PAGE, GPU)])
    b.host_write([PAGE])        # safe at once: the call staged the bytes before returning
    assert races(b) == {}


@pytest.mark.parametrize("op", ["copy", "STREAM", "ANY"])
def test_rule6_a_pageable_source_is_not_read_in_stream_order(op):
    # a device write to pageable memory (HMM / ATS) pending on the copy's own stream: the call
    # stages the source immediately, "no device synchronization is performed"
    b = builder()
    b.kernel("load", "w", writes=[PAGE])                 # 0
    if op == "copy":
        b.copy("load", PAGE, GPU)                        # 1
    else:
        b.copy_batch("load", op, [(PAGE, GPU)])          # 1
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "RAW", "6")
    assert "pageable" in r.reason and "sync_stream('load')" in r.fix


@pytest.mark.parametrize("op", ["copy", "STREAM", "DURING_API_CALL", "ANY"])
def test_rule6_a_pageable_destination_has_not_completed_when_the_call_returns(op):
    # Rule 6 as amended (docs/checker.md): current CUDA docs say device <-> pageable transfers
    # "might be synchronous", and an H200 returned from a D2H batch into pageable memory before
    # the copy ran. The destination is written in stream order; the host must synchronize.
    b = builder()
    if op == "copy":
        b.copy("offload", GPU, PAGE)
    else:
        b.copy_batch("offload", op, [(GPU, PAGE)])
    b.host_read([PAGE])
    b.host_write([PAGE])
    assert races(b) == {(0, 1): "RAW", (0, 2): "WAW"}


@pytest.mark.parametrize("op", ["copy", "STREAM", "DURING_API_CALL", "ANY"])
def test_rule6_a_pageable_destination_is_safe_after_a_sync(op):
    b = builder()
    if op == "copy":
        b.copy("offload", GPU, PAGE)
    else:
        b.copy_batch("offload", op, [(GPU, PAGE)])
    b.sync_stream("offload")
    b.host_read([PAGE])
    b.host_write([PAGE])
    assert races(b) == {}


def test_rule6_a_pageable_destination_does_not_order_the_streams_earlier_work():
    b = builder()
    b.kernel("offload", "w", writes=[CPU])               # 0: writes pinned memory (UVA)
    b.copy("offload", GPU, PAGE)                         # 1: no promise that op 0 completed
    b.host_read([CPU])                                   # 2
    assert races(b) == {(0, 2): "RAW"}


def test_rule6_no_copy_of_a_batch_with_a_pageable_destination_has_completed():
    b = builder()
    b.copy_batch("offload", "STREAM", [(GPU, PAGE), (GPU2, CPU)])   # 0
    b.host_read([PAGE])                                             # 1
    b.host_read([CPU])                                              # 2
    assert races(b) == {(0, 1): "RAW", (0, 2): "RAW"}


def test_rule6_pinned_and_registered_memory_are_not_pageable():
    for buf in ("cpu", "reg"):
        b = builder()
        b.copy("offload", GPU, (buf, 0, 4096))
        b.host_read([(buf, 0, 4096)])
        assert races(b) == {(0, 1): "RAW"}


# -- Rule 7: inside one copy_batch ---------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_rule7_two_copies_of_one_batch_writing_the_same_bytes(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU), (CPU2, ("gpu", 2048, 4096))])
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 0, "WAW", "7")
    assert r.overlap == Range("gpu", 2048, 2048)
    assert "copies 0 and 1 of op 0" in r.reason
    assert "later copy_batch" in r.fix


@pytest.mark.parametrize("order", ORDERS)
def test_rule7_one_copy_reads_what_another_writes(order):
    b = builder()
    b.copy_batch("load", order, [(CPU, GPU), (GPU, ("gpu_b", 0, 4096))])
    assert races(b) == {(0, 0): "RAW"}     # copy 0 writes gpu, copy 1 reads it
    b = builder()
    b.copy_batch("load", order, [(GPU, ("gpu_b", 0, 4096)), (CPU, GPU)])
    assert races(b) == {(0, 0): "WAR"}


@pytest.mark.parametrize("op", ["copy", "STREAM", "ANY"])
def test_rule7_a_copys_own_source_and_destination(op):
    b = builder()
    src, dst = ("gpu", 0, 4096), ("gpu", 1024, 4096)
    if op == "copy":
        b.copy("compute", src, dst)
    else:
        b.copy_batch("compute", op, [(src, dst)])
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 0, "WAR", "7")
    assert r.overlap == Range("gpu", 1024, 3072)
    assert "source" in r.reason and "destination" in r.reason


def test_rule7_copies_reading_the_same_source_do_not_race():
    b = builder()
    b.copy_batch("offload", "ANY", [(GPU, CPU), (GPU, CPU2)])
    assert races(b) == {}


def test_rule7_separate_batches_on_one_stream_are_ordered():
    b = builder()
    b.copy_batch("load", "ANY", [(CPU, GPU)])
    b.copy_batch("load", "ANY", [(CPU2, GPU)])
    assert races(b) == {}


def test_a_kernel_overlapping_itself_is_not_a_race():
    b = builder()
    b.kernel("compute", "inplace", reads=[GPU], writes=[GPU, ("gpu", 100, 10)])
    assert races(b) == {}


# -- the report ---------------------------------------------------------------------------------


def test_kinds_are_by_issue_order():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])       # 0
    b.kernel("offload", "r", reads=[GPU])        # 1  RAW with 0
    b.kernel("load", "w2", writes=[GPU])         # 2  WAW with 0, WAR with 1
    assert races(b) == {(0, 1): "RAW", (0, 2): "WAW", (1, 2): "WAR"}


def test_each_pair_appears_once_with_its_lowest_overlap():
    b = builder()
    b.kernel("compute", "w", writes=[("gpu", 100, 10), ("gpu_b", 0, 8), ("gpu", 0, 50), ("gpu", 40, 20)])
    b.kernel("offload", "r", reads=[("gpu_b", 0, 8), ("gpu", 0, 200)], writes=[("gpu", 300, 4)])
    report = run(b)
    assert len(report.races) == 1
    r = report.races[0]
    assert (r.first, r.second, r.kind) == (0, 1, "RAW")
    # the lowest overlap in buffer name order; ranges one op lists back to back or
    # overlapping count as one run of bytes
    assert r.overlap == Range("gpu", 0, 60)


def test_the_overlap_is_the_lowest_even_across_buffers_and_kinds():
    b = builder()
    b.kernel("compute", "w", writes=[("gpu_b", 0, 8), ("gpu", 64, 8)])
    b.kernel("offload", "rw", reads=[("gpu", 0, 128)], writes=[("gpu_b", 0, 8)])
    (r,) = run(b).races
    assert (r.kind, r.overlap) == ("RAW", Range("gpu", 64, 8))    # 'gpu' sorts before 'gpu_b'


def test_every_unordered_pair_is_listed_not_just_the_latest():
    b = builder()
    b.kernel("compute", "w1", writes=[GPU])      # 0
    b.kernel("compute", "w2", writes=[GPU])      # 1
    b.copy_batch("offload", "STREAM", [(GPU, CPU)])   # 2
    b.host_read([CPU])                           # 3
    assert races(b) == {(0, 2): "RAW", (1, 2): "RAW", (2, 3): "RAW"}


def test_races_are_sorted_and_max_races_truncates():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    for _ in range(5):
        b.kernel("offload", "r", reads=[GPU])
    full = check(b.build())
    assert [(r.first, r.second) for r in full.races] == [(0, k) for k in range(1, 6)]
    assert not full.truncated
    cut = check(b.build(), max_races=2)
    assert cut.verdict == "RACY" and cut.truncated and len(cut.races) == 2
    assert cut.to_json()["truncated"] is True
    assert "truncated" not in full.to_json()


def test_report_json_shape():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])
    b.kernel("offload", "r", reads=[GPU])
    doc = run(b).to_json()
    assert set(doc) == {"verdict", "races"}
    assert doc["verdict"] == "RACY"
    (race,) = doc["races"]
    assert set(race) == {"first", "second", "kind", "overlap", "rule", "reason", "fix"}
    assert race["overlap"] == ["gpu", 0, 4096]
    assert check(builder().build()).to_json() == {"verdict": "SAFE", "races": []}


def test_render_names_ops_bytes_kind_why_and_fix():
    b = builder()
    b.kernel("compute", "write_kv", writes=[GPU])
    b.kernel("offload", "read_kv", reads=[GPU])
    text = run(b).render(b.build(), "t.json")
    assert text.startswith("RACY in t.json (2 ops, 3 streams): 1 race")
    assert "RAW on gpu[0:4096] (4096 bytes), rule 2" in text
    assert "op 0 (kernel 'write_kv' on 'compute')" in text
    assert "op 1 (kernel 'read_kv' on 'offload')" in text
    assert "why:" in text and "fix:    add `offload.wait_stream(compute)` before op 1" in text
    assert check(builder().build()).render().startswith("SAFE")


def test_rules_api_intervals():
    b = builder()
    b.kernel("compute", "w", writes=[GPU])               # 0
    b.wait_stream("offload", on="compute")               # 1
    b.copy_batch("offload", "ANY", [(GPU, CPU)])         # 2
    b.copy_batch("offload", "DURING_API_CALL", [(GPU2, CPU2)])   # 3
    order, accesses = analyze(b.build())
    w, any_src, any_dst, during_src, _during_dst = accesses
    compute, offload = order.timeline_of["compute"], order.timeline_of["offload"]
    assert any_src.rule == "5:ANY" and any_src.floating
    assert any_src.until == any_dst.until == (offload, 1)          # latest: the copy's completion
    assert entry(any_src.after, compute) == 0                      # earliest: not behind the barrier
    assert entry(any_dst.after, compute) == 1                      # the destination is
    assert during_src.until == (0, 4)                              # before the host's next op
    assert happens_before(w, any_dst) and not happens_before(w, any_src)
    assert not happens_before(any_src, any_dst) and not happens_before(any_dst, any_src)   # rule 7
