"""Two threads issuing to one stream (or one event) with nothing ordering them on the host: which
call reached the driver first decides what an event captures and which record a wait reads. The
recorder times each call (``Recorder.when``: before it began, after it returned, one clock for
every CPU); where the earlier call in the log had returned before the later one began, the driver
saw them in the log's order and the pair is decided. Calls that overlapped, or a call not timed,
leave the recording incomplete (``NOT_RECORDED``), never SAFE by luck. On the CUDA stand-in."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

import kvverify.record as record
from kvverify.record.capture.threads import unordered_sharing, waits_first

BLOCK = 4096


def _spin(flag: list) -> None:
    """Wait for a plain flag: host bookkeeping no lock guards, which orders nothing in a trace."""
    while not flag:
        time.sleep(0.001)


@contextlib.contextmanager
def _slow_op(during):
    """A custom op ``kvtest_driver_order::fill_`` whose call runs ``during()`` before it returns:
    another thread's call made inside it overlaps it."""
    lib = torch.library.Library("kvtest_driver_order", "DEF")
    lib.define("fill_(Tensor(a!) t) -> ()")

    def fill(t):
        during()
        t.fill_(1)

    lib.impl("fill_", fill, "CompositeExplicitAutograd")
    try:
        yield torch.ops.kvtest_driver_order.fill_
    finally:
        lib._destroy()


def _worker_records_while_main_fills(fake, *, overlap: bool, locked: bool = False):
    """A worker thread records an event on the side stream; the main thread fills a device page on
    it, then its default stream waits for the event. ``overlap``: the worker's record runs while
    the fill's call has not returned; else the fill begins once the record returned (a flag orders
    them, not the trace). ``locked``: both hold one lock around their call."""
    gpu = fake.device(BLOCK)
    side, lock, event = fake.stream(), threading.Lock(), fake.event()
    held = lock if locked else contextlib.nullcontext()
    go, recorded = [], []

    def during():
        if overlap:
            go.append(1)
            _spin(recorded)

    with _slow_op(during) as fill, record.recording(platform=fake, skip=fake.skip(), keep_all=True) as rec:
        def worker():
            _spin(go)
            with held:
                event.record(side)
            recorded.append(1)

        t = threading.Thread(target=worker, name="worker")
        t.start()
        if not overlap:
            go.append(1)
            _spin(recorded)
        with held, fake.use(side):
            fill(gpu)
        t.join()
        event.wait(fake.default)
    return rec


def test_calls_of_two_threads_that_overlapped_on_one_stream_make_the_recording_incomplete(fake):
    rec = _worker_records_while_main_fills(fake, overlap=True)
    assert not rec.complete()
    note = next(n for n in rec.summary().notes if "no host ordering" in n)
    assert "stream 'stream" in note and "record at" in note and "(worker)" in note
    assert int(note.rsplit(": ", 1)[1]) == 1


def test_calls_of_two_threads_one_after_the_other_are_ordered_by_the_driver(fake):
    """The record returned before the fill began: the driver saw the record first, the event does
    not capture the fill, and the recording is complete."""
    rec = _worker_records_while_main_fills(fake, overlap=False)
    assert rec.complete(), rec.summary().notes
    ops = rec.trace()["ops"]
    order = [op["op"] for op in ops if op["op"] in ("record", "kernel", "wait_event")]
    assert order == ["record", "kernel", "wait_event"]
    assert not any("when" in op for op in ops)  # the spans stay out of the trace


def test_calls_that_overlapped_but_hold_one_lock_are_ordered_on_the_host(fake):
    rec = _worker_records_while_main_fills(fake, overlap=False, locked=True)
    assert rec.complete(), rec.summary().notes


# -- the rule, on op logs written by hand -----------------------------------------------------------


def _pair(first_when, second_when, kinds=("record", "kernel")):
    first = {"op": kinds[0], "stream": "s", "thread": "worker", "at": "a.py:1"}
    second = {"op": kinds[1], "stream": "s", "at": "b.py:2"}
    if kinds[0] == "record":
        first["event"] = "e"
    for op, when in ((first, first_when), (second, second_when)):
        if when is not None:
            op["when"] = when
    return [first, second]


def test_a_pair_is_decided_only_where_the_earlier_call_returned_before_the_later_began():
    assert unordered_sharing(_pair((10, 20), (21, 30)))[0] == 0
    assert unordered_sharing(_pair((10, 20), (20, 30)))[0] == 1  # returned as the other began: not known
    assert unordered_sharing(_pair((10, 25), (20, 30)))[0] == 1  # overlapped
    assert unordered_sharing(_pair((21, 30), (10, 20)))[0] == 1  # the clock contradicts the log's order
    assert unordered_sharing(_pair(None, (21, 30)))[0] == 1  # a call not timed
    assert unordered_sharing(_pair((10, 20), None))[0] == 1


def test_a_record_and_a_wait_of_one_event_on_two_threads_follow_the_same_rule():
    wait = [{"op": "record", "stream": "s", "event": "e", "thread": "worker", "when": (10, 20)},
            {"op": "wait_event", "stream": "t", "event": "e", "when": (30, 40)}]
    assert unordered_sharing(wait)[0] == 0
    wait[1]["when"] = (15, 40)
    count, first = unordered_sharing(wait)
    assert count == 1 and first.startswith("event 'e'")


# -- host waits: a wait that overlapped another thread's call covers none of it ---------------------


def _op(kind, thread=None, when=None, **fields):
    op = {"op": kind, **fields}
    if thread:
        op["thread"] = thread
    if when:
        op["when"] = when
    return op


def test_a_host_wait_that_overlapped_another_threads_copy_is_moved_before_it():
    """A thread waits on a stream with the GIL released; another thread's copy on that stream is
    issued and logged meanwhile, before the wait returns and is logged. Which of them the driver
    saw first is not known: the wait is taken as the earlier one (it covers less)."""
    log = [_op("copy", None, (1, 2), stream="s"), _op("copy", "loader", (5, 6), stream="s"),
           _op("sync_stream", None, (3, 9), stream="s")]
    assert unordered_sharing(log)[0] == 1
    waits_first(log)
    assert [(op["op"], op.get("thread")) for op in log] == [("copy", None), ("sync_stream", None),
                                                             ("copy", "loader")]
    assert unordered_sharing(log) == (0, None)


def test_a_host_wait_stays_after_what_returned_before_it_began_and_after_its_own_thread():
    log = [_op("copy", "loader", (1, 2), stream="s"), _op("kernel", None, (4, 5), stream="t"),
           _op("copy", "loader", (6, 7), stream="s"), _op("sync_stream", None, (3, 9), stream="s")]
    waits_first(log)
    # not past its own kernel; past the loader's overlapping copy only
    assert [op["op"] for op in log] == ["copy", "kernel", "sync_stream", "copy"]
    confirmed = [_op("copy", "loader", (1, 2), stream="s"), _op("sync_stream", None, (3, 9), stream="s")]
    waits_first(confirmed)
    assert [op["op"] for op in confirmed] == ["copy", "sync_stream"]
    assert unordered_sharing(confirmed)[0] == 0


def test_an_untimed_host_wait_after_another_threads_op_is_not_decided():
    log = [_op("copy", "loader", (5, 6), stream="s"), _op("sync_stream", None, None, stream="s")]
    waits_first(log)
    assert [op["op"] for op in log] == ["copy", "sync_stream"]
    assert unordered_sharing(log)[0] == 1


def test_a_device_synchronize_is_a_wait_for_every_stream():
    """torch.cuda.synchronize() on one thread while another launches: which launches it covered
    is not known unless one returned before the other began."""
    overlapped = [_op("kernel", "worker", (5, 6), stream="s"), _op("sync_device", None, None)]
    count, first = unordered_sharing(overlapped)
    assert count == 1 and first.startswith("stream 's': kernel")
    overlapped[1]["when"] = (3, 9)
    waits_first(overlapped)
    assert [op["op"] for op in overlapped] == ["sync_device", "kernel"]
    assert unordered_sharing(overlapped)[0] == 0
    after = [_op("kernel", "worker", (1, 2), stream="s"), _op("sync_device", None, (3, 9))]
    assert unordered_sharing(after)[0] == 0


def test_a_wait_moved_first_leaves_the_copy_it_did_not_cover_racing_with_a_later_host_read():
    """What the move means for the verdict: the host read after the wait is not ordered after the
    other thread's copy into the same bytes, so the pair races (trace format 1.2, rule 8)."""
    from kvverify.check import check

    doc = {"version": 1, "threads": ["main", "loader"],
           "buffers": {"pin": {"space": "host_pinned", "bytes": 16}, "gpu": {"space": "device", "bytes": 16}},
           "streams": ["s"]}
    log = [_op("copy", "loader", (5, 6), stream="s", src=["gpu", 0, 16], dst=["pin", 0, 16]),
           _op("sync_stream", None, (3, 9), stream="s"),
           _op("host_read", None, None, ranges=[["pin", 0, 16]])]
    waits_first(log)
    doc["ops"] = [{k: v for k, v in op.items() if k != "when"} for op in log]
    result = check(doc)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in result.races] == \
        [("RAW", "copy", "host_read")]
