"""Format 1.2: host threads (rules 1 and 4 amended, rule 8) and freed memory (rule 9).

Each rule has a trace that races without it and is safe with it (the pair differs only in the
ordering the rule reads); every trace here is also run through the oracle (trace_helpers.run).
"""

from __future__ import annotations

import json

import pytest
from trace_helpers import CPU, GPU, GPU2, STORE_EXAMPLE, builder, only, races, run

from kvverify.check import Trace, analyze, check, happens_before
from kvverify.cli import main


def threaded(streams=("compute", "offload", "load"), threads=("main", "loader")):
    b = builder(streams)
    for t in threads:
        b.thread(t)
    return b


# -- Rule 1 (amended): program order per thread ----------------------------------------------------


def test_rule1_one_threads_ops_follow_each_other_whatever_comes_between():
    b = threaded()
    b.host_write([CPU], thread="loader")     # 0
    b.host_read([("cpu", 4096, 4096)])       # 1: main, other bytes
    b.host_read([CPU], thread="loader")      # 2
    assert races(b) == {}


def test_rule1_trace_order_between_threads_orders_nothing():
    b = threaded()
    b.host_write([CPU])                       # 0: main
    b.host_read([CPU], thread="loader")       # 1
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "RAW", "8")
    assert "thread 'main'" in r.reason and "thread 'loader'" in r.reason
    assert "release" in r.fix and "acquire" in r.fix


def test_rule1_work_a_thread_issues_follows_that_threads_earlier_ops_only():
    b = threaded()
    b.host_write([CPU], thread="loader")      # 0
    b.copy("load", CPU, GPU, thread="loader")  # 1: after op 0
    b.copy("offload", CPU, GPU2)              # 2: main: not after op 0
    assert races(b) == {(0, 2): "RAW"}


# -- Rule 8: release / acquire ---------------------------------------------------------------------


@pytest.mark.parametrize("handoff", [False, True])
def test_rule8_an_acquire_follows_the_release_before_it(handoff):
    b = threaded()
    b.host_write([CPU])                       # 0: main fills a pinned slot
    if handoff:
        b.release("slot0")                    # main puts the slot in a queue
        b.acquire("slot0", thread="loader")   # the loader gets it
    b.copy("load", CPU, GPU, thread="loader")
    assert races(b) == ({} if handoff else {(0, 1): "RAW"})


def test_rule8_an_acquire_before_the_release_in_ops_orders_nothing():
    b = threaded()
    b.acquire("q", thread="loader")           # 0
    b.host_write([CPU])                       # 1
    b.release("q")                            # 2
    b.host_read([CPU], thread="loader")       # 3
    assert races(b) == {(1, 3): "RAW"}


def test_rule8_an_acquire_of_another_name_orders_nothing():
    b = threaded()
    b.host_write([CPU])
    b.release("a")
    b.acquire("b", thread="loader")
    b.host_read([CPU], thread="loader")
    assert races(b) == {(0, 3): "RAW"}


def test_rule8_is_transitive_over_threads():
    b = threaded(threads=("a", "b", "c"))
    b.host_write([CPU], thread="a")           # 0
    b.release("ab", thread="a")
    b.acquire("ab", thread="b")
    b.release("bc", thread="b")
    b.acquire("bc", thread="c")
    b.host_read([CPU], thread="c")            # 5
    assert races(b) == {}
    d = threaded(threads=("a", "b", "c"))
    d.host_write([CPU], thread="a")
    d.release("ab", thread="a")
    d.release("bc", thread="b")               # before b acquired: passes nothing of a's on
    d.acquire("ab", thread="b")
    d.acquire("bc", thread="c")
    d.host_read([CPU], thread="c")
    assert races(d) == {(0, 5): "RAW"}


def test_rule8_an_acquire_follows_every_earlier_release_of_the_name():
    b = threaded(threads=("a", "b", "c"))
    b.host_write([CPU], thread="a")           # 0
    b.release("lock", thread="a")
    b.host_write([("cpu", 4096, 4096)], thread="b")   # 2
    b.release("lock", thread="b")
    b.acquire("lock", thread="c")
    b.host_read([("cpu", 0, 8192)], thread="c")       # 5: after both writes
    assert races(b) == {}


# -- Rule 4 (amended): a thread's synchronization, passed on by rule 8 -----------------------------


@pytest.mark.parametrize("handoff", [False, True])
def test_rule4_a_sync_orders_work_before_the_threads_it_is_passed_to(handoff):
    b = threaded()
    b.copy_batch("offload", "STREAM", [(GPU, CPU)], thread="loader")   # 0: a store
    b.sync_stream("offload", thread="loader")                          # 1
    if handoff:
        b.release("stored", thread="loader")
        b.acquire("stored")
    b.host_read([CPU])                                                 # main reads the slot
    assert races(b) == ({} if handoff else {(0, 2): "RAW"})


def test_rule4_one_threads_sync_does_not_order_another_threads_ops():
    b = threaded()
    b.kernel("compute", "w", writes=[CPU])    # 0
    b.sync_device(thread="loader")            # 1
    b.host_read([CPU])                        # 2: main did not synchronize
    r = only(b)
    assert (r.first, r.second, r.kind, r.rule) == (0, 2, "RAW", "4")
    assert "thread 'main' reads cpu[0:4096]" in r.reason
    assert r.fix == "add `sync_stream('compute')` before op 2"


@pytest.mark.parametrize("handoff", [False, True])
def test_rule5_any_reads_after_what_the_issuing_thread_observed(handoff):
    b = threaded()
    b.kernel("compute", "w", writes=[GPU])    # 0
    b.sync_stream("compute")                  # 1: main observed it
    if handoff:
        b.release("go")
        b.acquire("go", thread="loader")
    b.copy_batch("offload", "ANY", [(GPU, CPU)], thread="loader")
    assert races(b) == ({} if handoff else {(0, 2): "RAW"})


def test_rule2_stream_order_is_global_across_threads():
    b = threaded()
    b.kernel("compute", "w", writes=[GPU])                   # 0: main
    b.kernel("compute", "r", reads=[GPU], thread="loader")   # 1: same stream, later in ops
    assert races(b) == {}


def test_a_record_or_wait_is_a_stream_item_of_the_thread_that_issued_it():
    # main's host write comes before its wait on 'load': the loader's copy queued behind the wait
    # on 'load' runs after it (the oracle holds the rules to this too)
    b = threaded()
    b.record("e", "compute")                                 # 0
    b.host_write([CPU])                                      # 1
    b.wait_event("load", "e")                                # 2: main, an item of 'load'
    b.copy("load", CPU, GPU, thread="loader")                # 3
    assert races(b) == {}
    c = threaded()
    c.host_write([CPU])
    c.copy("load", CPU, GPU, thread="loader")
    assert races(c) == {(0, 1): "RAW"}


def test_events_use_the_latest_record_in_trace_order():
    b = threaded()
    b.kernel("compute", "w", writes=[CPU])                   # 0
    b.record("done", "compute", thread="loader")             # 1
    b.sync_event("done")                                     # 2: main syncs the loader's record
    b.host_read([CPU])
    assert races(b) == {}


def test_a_source_read_during_the_call_is_over_for_work_queued_behind_its_copy():
    b = threaded()
    b.copy_batch("load", "DURING_API_CALL", [(CPU, GPU)])            # 0: main
    b.kernel("load", "reuse", writes=[CPU], thread="loader")         # 1: behind op 0 on 'load'
    assert races(b) == {}
    c = threaded()
    c.copy_batch("load", "DURING_API_CALL", [(CPU, GPU)])
    c.kernel("offload", "reuse", writes=[CPU], thread="loader")      # another stream
    assert races(c) == {(0, 1): "WAR"}


# -- Rule 9: free ----------------------------------------------------------------------------------


@pytest.mark.parametrize("synced", [False, True])
def test_rule9_freeing_what_a_stream_still_uses(synced):
    b = builder()
    b.kernel("compute", "attn", reads=[GPU])  # 0
    if synced:
        b.record("used", "compute")
        b.sync_event("used")
    b.free([("gpu", 0, 8192)])
    report = run(b)
    if synced:
        assert report.safe
        return
    (r,) = report.races
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "FREE", "9")
    assert "use after free" in r.reason
    assert r.fix.startswith("record an event on 'compute' after the last use (op 0) and synchronize it")


def test_rule9_the_freeing_threads_later_work_is_the_next_owner():
    b = builder()
    b.free([GPU])                             # 0
    b.kernel("compute", "new_owner", writes=[GPU])   # 1: issued after the free
    b.host_write([CPU])
    assert races(b) == {}


@pytest.mark.parametrize("handoff", [False, True])
def test_rule9_another_threads_work_follows_a_free_only_through_rule8(handoff):
    b = threaded()
    b.free([GPU])                             # 0: main
    if handoff:
        b.release("block")
        b.acquire("block", thread="loader")
    b.copy("load", CPU, GPU, thread="loader")
    report = run(b)
    if handoff:
        assert report.safe
        return
    (r,) = report.races
    assert (r.first, r.second, r.kind, r.rule) == (0, 1, "FREE", "9")
    assert "freed in thread 'main'" in r.reason


def test_rule9_a_free_may_name_device_memory_and_host_memory():
    b = threaded()
    b.host_read([CPU], thread="loader")       # 0
    b.free([CPU, GPU])                        # 1: main frees both
    assert races(b) == {(0, 1): "FREE"}


def test_rule9_two_frees_of_the_same_bytes_do_not_race():
    b = threaded()
    b.free([GPU])
    b.free([("gpu", 0, 8192)], thread="loader")
    assert races(b) == {}


def test_rule9_a_use_between_two_frees_races_with_the_unordered_one():
    b = threaded()
    b.free([GPU])                             # 0
    b.kernel("compute", "use", reads=[GPU])   # 1: main, after its own free
    b.free([GPU], thread="loader")            # 2: not after the kernel
    assert races(b) == {(1, 2): "FREE"}


# -- reports, helpers ----------------------------------------------------------------------------------


def test_reports_name_the_threads_of_the_ops():
    b = threaded()
    b.host_write([CPU])
    b.host_read([CPU], thread="loader", name="peek")
    trace = b.build()
    text = check(trace).render()
    assert "first:  op 0 (host_write, thread 'main')" in text
    assert "second: op 1 (host_read 'peek', thread 'loader')" in text
    assert check(trace).to_json()["races"][0]["kind"] == "RAW"


def test_free_kind_in_json_and_text(tmp_path, capsys):
    b = builder()
    b.kernel("compute", "attn", reads=[GPU])
    b.free([GPU])
    path = tmp_path / "t.json"
    path.write_text(b.build().dumps())
    assert main(["check", "--json", str(path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [(r["first"], r["second"], r["kind"], r["rule"]) for r in out["races"]] == [(0, 1, "FREE", "9")]
    assert main(["check", str(path)]) == 1
    assert "race 1: FREE on gpu[0:4096] (4096 bytes), rule 9" in capsys.readouterr().out


def test_happens_before_reads_thread_timelines():
    b = threaded()
    b.host_write([CPU])                       # 0
    b.release("x")
    b.acquire("x", thread="loader")
    b.host_read([CPU], thread="loader")       # 3
    b.host_read([CPU])                        # 4
    _, (w, r_loader, r_main) = analyze(b.build())
    assert happens_before(w, r_loader) and happens_before(w, r_main)
    assert not happens_before(r_loader, r_main) and not happens_before(r_main, r_loader)


# -- 1.1 traces keep their verdicts ---------------------------------------------------------------


def _one_thread_variants(doc: dict) -> list[dict]:
    """The same trace as 1.2 sees it with one thread: threads absent, one thread declared, the ops
    naming it or not; and with two threads declared but every op in the first."""
    one = json.loads(json.dumps(doc))
    one["threads"] = ["main"]
    named = json.loads(json.dumps(one))
    for op in named["ops"]:
        op["thread"] = "main"
    two = json.loads(json.dumps(doc))
    two["threads"] = ["main", "idle"]
    return [one, named, two]


def test_one_thread_traces_keep_their_verdicts_and_reports():
    for order in ("STREAM", "ANY"):
        doc = json.loads(json.dumps(STORE_EXAMPLE))
        doc["ops"][2]["order"] = order
        base = check(doc)
        assert base.verdict == ("SAFE" if order == "STREAM" else "RACY")
        for variant in _one_thread_variants(doc):
            got = check(variant)
            assert [(r.first, r.second, r.kind, r.overlap, r.rule) for r in got.races] == \
                [(r.first, r.second, r.kind, r.overlap, r.rule) for r in base.races]
    # a 1.1 trace reads, writes and reports exactly as before: no threads key, no thread field
    trace = Trace.from_json(STORE_EXAMPLE)
    assert trace.threads == () and trace.to_json() == STORE_EXAMPLE


def test_scenario_traces_keep_their_verdicts_with_one_declared_thread():
    from kvverify.scenarios import SCENARIOS, Params, to_trace

    racy = 0
    for scenario in SCENARIOS.values():
        for direction in scenario.directions:
            program = scenario.program(direction, Params(blocks_per_transfer=2, transfers=2))
            for order in ("STREAM", "DURING_API_CALL", "ANY"):
                doc = to_trace(program, order, "pinned", 64, 1)
                base = check(doc)
                racy += not base.safe
                for variant in _one_thread_variants(doc):
                    assert check(variant).pairs() == base.pairs(), (scenario.name, direction, order)
    assert racy    # the catalogue's broken schedules are among them


def test_an_invalid_1_2_trace_is_exit_2_naming_op_and_field(tmp_path, capsys):
    doc = json.loads(json.dumps(STORE_EXAMPLE))
    doc["ops"][3] = {"op": "record", "evnt": "end", "stream": "offload"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert main(["check", "--json", str(path)]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert (out["verdict"], out["op"], out["field"]) == ("INVALID", 3, "evnt")
    assert "op 3 (record), field 'evnt': unknown field for a record op (did you mean 'event'?)" in captured.err


def test_rule3_a_wait_on_an_event_never_recorded_is_no_item_of_its_stream():
    """cudaStreamWaitEvent on an event never recorded "is a functional no-op" (CUDA Runtime API):
    it does not order its thread's earlier ops before another thread's later work on the stream,
    as a record there would."""
    doc = {"version": 1, "buffers": {"d": {"space": "device", "bytes": 8}, "p": {"space": "host_pinned", "bytes": 8}},
           "streams": ["s1"], "threads": ["a", "b"],
           "ops": [{"op": "host_read", "ranges": [["p", 0, 8]]},
                   {"op": "wait_event", "stream": "s1", "event": "never"},
                   {"op": "copy", "stream": "s1", "src": ["d", 0, 8], "dst": ["p", 0, 8], "thread": "b"}]}
    assert [(r.first, r.second, r.kind) for r in check(doc).races] == [(0, 2, "WAR")]
    doc["ops"][1] = {"op": "record", "event": "e", "stream": "s1"}
    assert check(doc).safe
