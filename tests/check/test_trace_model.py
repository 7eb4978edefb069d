"""The trace model: parsing, validation (TraceError names op index and field), TraceBuilder."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvverify.check import (
    Copy,
    CopyBatch,
    HostRead,
    HostWrite,
    Kernel,
    QueryEvent,
    Range,
    Record,
    SyncDevice,
    SyncEvent,
    SyncStream,
    Trace,
    TraceBuilder,
    TraceError,
    Transfer,
    WaitEvent,
    WaitStream,
    check,
    model,
    parser,
)

DOC = {
    "version": 1,
    "buffers": {"gpu": {"space": "device", "bytes": 8192}, "cpu": {"space": "host_pinned", "bytes": 8192},
                "reg": {"space": "host_registered", "bytes": 64}, "page": {"space": "host_pageable", "bytes": 64}},
    "streams": ["compute", "offload"],
    "ops": [
        {"op": "kernel", "stream": "compute", "name": "write_kv", "reads": [], "writes": [["gpu", 0, 4096]]},
        {"op": "wait_stream", "stream": "offload", "on": "compute"},
        {"op": "copy_batch", "stream": "offload", "order": "STREAM",
         "copies": [{"src": ["gpu", 0, 4096], "dst": ["cpu", 0, 4096]}]},
        {"op": "record", "event": "end", "stream": "offload"},
        {"op": "sync_event", "event": "end"},
        {"op": "host_read", "ranges": [["cpu", 0, 4096]]},
        {"op": "copy", "stream": "compute", "src": ["page", 0, 8], "dst": ["gpu", 8, 8], "name": "up"},
        {"op": "wait_event", "stream": "compute", "event": "end"},
        {"op": "query_event", "event": "end", "result": False},
        {"op": "sync_stream", "stream": "offload"},
        {"op": "sync_device"},
        {"op": "host_write", "ranges": [["reg", 0, 64], ["page", 0, 1]]},
    ],
}


def test_parse_every_op_kind():
    t = Trace.from_json(DOC)
    kinds = [type(op) for op in t.ops]
    assert kinds == [Kernel, WaitStream, CopyBatch, Record, SyncEvent, HostRead, Copy, WaitEvent, QueryEvent,
                     SyncStream, SyncDevice, HostWrite]
    assert t.ops[0] == Kernel("compute", (), (Range("gpu", 0, 4096),), "write_kv")
    assert t.ops[2].copies == (Transfer(Range("gpu", 0, 4096), Range("cpu", 0, 4096)),)
    assert t.ops[8].result is False
    assert [b.space for b in t.buffers.values()] == ["device", "host_pinned", "host_registered", "host_pageable"]
    assert t.buffers["gpu"].nbytes == 8192
    assert t.streams == ("compute", "offload")


def test_round_trip_object_text_and_bytes():
    t = Trace.from_json(DOC)
    assert Trace.from_json(t.to_json()) == t
    assert Trace.from_json(json.dumps(DOC)) == t
    assert Trace.from_json(json.dumps(DOC).encode()) == t
    assert Trace.from_json(t.dumps(indent=1)) == t
    # to_json writes the fields of the format, names only where given
    assert t.to_json()["ops"][1] == {"op": "wait_stream", "stream": "offload", "on": "compute"}
    assert t.to_json()["ops"][6]["name"] == "up"


def test_ops_are_frozen():
    t = Trace.from_json(DOC)
    with pytest.raises(AttributeError):
        t.ops[0].stream = "offload"


def test_kernel_reads_and_writes_are_optional_names_too():
    doc = copy.deepcopy(DOC)
    doc["ops"] = [{"op": "kernel", "stream": "compute"}]
    assert Trace.from_json(doc).ops[0] == Kernel("compute")


def test_events_need_no_declaration():
    doc = copy.deepcopy(DOC)
    doc["ops"] = [{"op": "sync_event", "event": "never_recorded"}]
    assert Trace.from_json(doc).ops[0] == SyncEvent("never_recorded")


def test_range_helpers():
    a, b = Range("gpu", 0, 100), Range("gpu", 50, 100)
    assert a.end == 100 and str(a) == "gpu[0:100]"
    assert a.overlap(b) == Range("gpu", 50, 50)
    assert a.overlap(Range("gpu", 100, 5)) is None
    assert a.overlap(Range("cpu", 0, 100)) is None


def _bad(mutate):
    doc = copy.deepcopy(DOC)
    mutate(doc)
    with pytest.raises(TraceError) as e:
        Trace.from_json(doc)
    return e.value


def _set(op_index, **fields):
    def mutate(doc):
        doc["ops"][op_index].update(fields)
    return mutate


@pytest.mark.parametrize("mutate, op_index, field, words", [
    (lambda d: d.update(version=2), None, "version", "unknown version"),
    (lambda d: d.update(comment="recorded by hand"), None, "comment", "unknown field"),   # format 1.1
    (lambda d: d.update(opps=d.pop("ops")), None, "opps", "unknown field"),
    (lambda d: d.update(version=True), None, "version", "unknown version"),
    (lambda d: d.pop("ops"), None, "ops", "missing"),
    (lambda d: d.update(streams=["a", "a"]), None, "streams[1]", "twice"),
    (lambda d: d["buffers"].update(x={"space": "gpu", "bytes": 1}), None, "buffers.x.space", "unknown space"),
    (lambda d: d["buffers"].update(x={"space": "device", "bytes": 0}), None, "buffers.x.bytes", "positive"),
    (lambda d: d["buffers"].update(x={"space": "device"}), None, "buffers.x.bytes", "missing"),
    (_set(3, op="record_event"), 3, "op", "unknown op"),
    (lambda d: d["ops"][3].pop("op"), 3, "op", "missing"),
    (_set(0, stream="copmute"), 0, "stream", "unknown stream"),
    (_set(1, on=7), 1, "on", "expected a stream name"),
    (_set(2, order="FAST"), 2, "order", "unknown order"),
    (_set(0, writes=[["gpu", 8000, 4096]]), 0, "writes[0]", "past the end"),
    (_set(0, writes=[["gpu", 0, 0]]), 0, "writes[0]", "length must be"),
    (_set(0, writes=[["gpu", -1, 4]]), 0, "writes[0]", "offset must be"),
    (_set(0, writes=[["gpu", "0", 4]]), 0, "writes[0]", "offset must be"),
    (_set(0, writes=[["gpu", 0, True]]), 0, "writes[0]", "length must be"),
    (_set(0, writes=[["gpu", 0]]), 0, "writes[0]", "expected a range"),
    (_set(0, reads=[["hbm", 0, 4]]), 0, "reads[0]", "unknown buffer"),
    (_set(0, writes="gpu"), 0, "writes", "expected an array"),
    (_set(0, wrtes=[]), 0, "wrtes", "unknown field"),
    (_set(5, ranges=[["cpu", 0, 4], ["gpu", 0, 4]]), 5, "ranges[1]", "host access to device memory"),
    (_set(11, ranges=[["gpu", 0, 4]]), 11, "ranges[0]", "host access to device memory"),
    (lambda d: d["ops"][6].pop("dst"), 6, "dst", "missing"),
    (_set(6, dst=["gpu", 0, 4]), 6, "dst", "one size"),
    (_set(2, copies=[]), 2, "copies", "at least one"),
    (_set(2, copies=[{"src": ["gpu", 0, 4]}]), 2, "copies[0].dst", "missing"),
    (_set(2, copies=[{"src": ["gpu", 0, 4], "dst": ["cpu", 8190, 4]}]), 2, "copies[0].dst", "past the end"),
    (_set(2, copies=[["gpu", 0, 4]]), 2, "copies[0]", "expected"),
    (_set(8, result="yes"), 8, "result", "true or false"),
    (lambda d: d["ops"][8].pop("result"), 8, "result", "missing"),
    (_set(4, event=3), 4, "event", "event name"),
    (_set(4, name=3), 4, "name", "expected a string"),
    (lambda d: d["ops"].append(["kernel"]), 12, None, "JSON object"),
])
def test_invalid_input_names_op_index_and_field(mutate, op_index, field, words):
    err = _bad(mutate)
    assert isinstance(err, ValueError)
    assert err.op_index == op_index
    assert err.field == field
    assert words in str(err)
    assert "\n" not in str(err)
    if op_index is not None:
        assert str(err).startswith(f"op {op_index}")
    if field is not None:
        assert f"field '{field}'" in str(err)


_DROP = object()
_VALUES = [_DROP, None, 7, True, "", "compute", "copmute", "end", "STREAM", "FAST", "kernel", "host_read", [], {},
           ["gpu", 0, 4096], ["cpu", 0, 4096], ["gpu", 0, 0], [["gpu", 0, 4]], [["cpu", 8190, 4]], [["page", 0, 1]],
           [["gpu", 0, 4], 3], [{"src": ["gpu", 0, 4], "dst": ["cpu", 0, 4]}], [{"src": ["gpu", 0, 4]}]]
_KEYS = ["op", "stream", "on", "event", "result", "order", "copies", "src", "dst", "reads", "writes", "ranges",
         "name", "at", "wrtes"]


def _outcome(doc):
    try:
        return Trace.from_json(doc)
    except TraceError as e:
        return str(e), e.op_index, e.field


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(index=st.integers(0, len(DOC["ops"])), changes=st.lists(st.tuples(st.sampled_from(_KEYS),
                                                                         st.sampled_from(_VALUES)), max_size=3))
def test_the_fast_way_of_parsing_an_op_agrees_with_the_careful_one(index, changes):
    """Every op is parsed by a short way first and, when anything there is amiss, by the careful
    way, which names the first problem in the order the messages promise: both give the same op
    or the same error, whatever (and however many things) is wrong."""
    doc = copy.deepcopy(DOC)
    if index == len(DOC["ops"]):
        doc["ops"].append(changes[0][1] if changes else [])     # not an object at all
    else:
        for key, value in changes:
            if value is _DROP:
                doc["ops"][index].pop(key, None)
            else:
                doc["ops"][index][key] = copy.deepcopy(value)
    fast = _outcome(doc)
    shipped = parser._Parser.op
    parser._Parser.op = parser._Parser._op
    try:
        assert fast == _outcome(doc)
    finally:
        parser._Parser.op = shipped


@pytest.mark.parametrize("text", ["", "{", "[1, 2", "{'version': 1}", b"\xff\xfe", "[" * 100_000 + "]" * 100_000])
def test_bad_json_is_a_trace_error(text):
    with pytest.raises(TraceError) as e:
        Trace.from_json(text)
    assert e.value.op_index is None
    assert "\n" not in str(e.value)


def test_top_level_must_be_an_object():
    with pytest.raises(TraceError, match="JSON object"):
        Trace.from_json("[]")


# -- TraceBuilder -----------------------------------------------------------------------------


def test_builder_builds_the_same_trace_as_json():
    b = TraceBuilder()
    assert b.buffer("gpu", "device", 8192) == "gpu"
    b.buffer("cpu", "host_pinned", 8192)
    b.buffer("reg", "host_registered", 64)
    b.buffer("page", "host_pageable", 64)
    assert b.stream("compute") == "compute"
    b.stream("offload")
    assert b.kernel("compute", "write_kv", writes=[("gpu", 0, 4096)]) == 0
    assert b.wait_stream("offload", on="compute") == 1
    b.copy_batch("offload", "STREAM", [(("gpu", 0, 4096), ("cpu", 0, 4096))])
    b.record("end", "offload")
    b.sync_event("end")
    b.host_read([("cpu", 0, 4096)])
    b.copy("compute", ("page", 0, 8), ("gpu", 8, 8), name="up")
    b.wait_event("compute", "end")
    b.query_event("end", False)
    b.sync_stream("offload")
    b.sync_device()
    assert b.host_write([("reg", 0, 64), ("page", 0, 1)]) == 11
    assert len(b) == 12
    assert b.build() == Trace.from_json(DOC)


def test_builder_accepts_copy_specs_in_three_shapes_and_integer_likes():
    import numpy as np

    b = TraceBuilder()
    b.buffer("gpu", "device", 64)
    b.buffer("cpu", "host_pinned", 64)
    b.stream("s")
    b.copy_batch("s", "ANY", [
        (("gpu", 0, 8), ("cpu", 0, 8)),
        {"src": ("gpu", 8, 8), "dst": ("cpu", 8, 8)},
        Transfer(Range("gpu", 16, 8), Range("cpu", 16, 8)),
    ], name="store")
    b.host_read([("cpu", np.int64(0), np.int32(8))])
    t = b.build()
    assert [c.src.offset for c in t.ops[0].copies] == [0, 8, 16]
    assert t.ops[0].name == "store"
    assert t.ops[1].ranges == (Range("cpu", 0, 8),)


def test_builder_validates_on_build():
    b = TraceBuilder()
    b.buffer("gpu", "device", 64)
    b.stream("s")
    b.kernel("s", "k", reads=[("gpu", 0, 8)])
    b.host_write([("gpu", 0, 8)])
    with pytest.raises(TraceError) as e:
        b.build()
    assert (e.value.op_index, e.value.field) == (1, "ranges[0]")
    b2 = TraceBuilder()
    b2.kernel("undeclared")
    with pytest.raises(TraceError) as e:
        b2.build()
    assert (e.value.op_index, e.value.field) == (0, "stream")


def test_describe_names_op_kind_name_stream_and_order():
    t = Trace.from_json(DOC)
    assert t.describe(0) == "op 0 (kernel 'write_kv' on 'compute')"
    assert t.describe(2) == "op 2 (copy_batch on 'offload', STREAM)"
    assert t.describe(10) == "op 10 (sync_device)"


@pytest.mark.parametrize("key", ["name", "at"])
def test_name_and_at_are_strings_when_given_and_null_is_not_one(key):
    doc = {"version": 1, "buffers": {"g": {"space": "device", "bytes": 8}}, "streams": ["s"],
           "ops": [{"op": "kernel", "stream": "s", "writes": [["g", 0, 8]], key: None}]}
    with pytest.raises(TraceError, match=rf"^op 0 \(kernel\), field '{key}': expected a string.*got null$"):
        Trace.from_json(doc)
    with pytest.raises(TraceError, match=rf"field '{key}': expected a string"):
        Trace.from_json(json.dumps(doc))  # the text reader too
    del doc["ops"][0][key]
    assert Trace.from_json(doc).ops[0].name is None  # left out, it is fine


# -- format 1.2: threads, release / acquire, free ----------------------------------------------------


def _threaded(**top) -> dict:
    doc = copy.deepcopy(DOC)
    ops = doc.pop("ops")
    doc.update({"threads": ["main", "loader"], **top})
    doc["ops"] = ops          # after threads, as writers put them (text streams the ops)
    doc["ops"] += [{"op": "release", "sync": "q", "thread": "main"},
                   {"op": "acquire", "sync": "q", "thread": "loader"},
                   {"op": "free", "ranges": [["gpu", 0, 8], ["cpu", 0, 8]], "thread": "loader"}]
    return doc


def test_threads_release_acquire_and_free_parse_and_round_trip():
    t = Trace.from_json(_threaded())
    assert t.threads == ("main", "loader")
    assert t.ops[12:] == (model.Release("q", thread="main"), model.Acquire("q", thread="loader"),
                          model.Free((Range("gpu", 0, 8), Range("cpu", 0, 8)), thread="loader"))
    assert t.ops[0].thread is None              # the first thread's
    assert Trace.from_json(t.to_json()) == t and Trace.from_json(t.dumps()) == t
    assert t.to_json()["threads"] == ["main", "loader"]
    assert t.describe(0) == "op 0 (kernel 'write_kv' on 'compute', thread 'main')"
    assert t.describe(14) == "op 14 (free, thread 'loader')"


def test_the_builder_writes_threads_and_the_new_ops():
    b = TraceBuilder()
    b.buffer("gpu", "device", 64)
    b.stream("s")
    b.thread("main")
    b.thread("loader")
    b.kernel("s", "k", writes=[("gpu", 0, 8)], thread="loader")
    b.release("q", thread="loader")
    b.acquire("q", name="get")
    b.free([("gpu", 0, 8)])
    doc = b.to_json()
    assert doc["threads"] == ["main", "loader"] and list(doc) == ["version", "buffers", "streams", "threads", "ops"]
    assert doc["ops"][1:] == [{"op": "release", "sync": "q", "thread": "loader"},
                              {"op": "acquire", "sync": "q", "name": "get"},
                              {"op": "free", "ranges": [["gpu", 0, 8]]}]
    assert b.build().ops[0].thread == "loader"


@pytest.mark.parametrize("doc, op_index, field, words", [
    (_threaded(threads="main"), None, "threads", "non-empty array of thread names"),
    (_threaded(threads=[]), None, "threads", "non-empty array"),
    (_threaded(threads=["main", ""]), None, "threads[1]", "non-empty string"),
    (_threaded(threads=["main", 3]), None, "threads[1]", "non-empty string"),
    (_threaded(threads=["main", "main"]), None, "threads[1]", "declared twice"),
    (_threaded(threads=["main"]), 13, "thread", "unknown thread 'loader' (declared: 'main')"),
    ({**DOC, "ops": [{"op": "sync_device", "thread": "main"}]}, 0, "thread",
     "the trace declares no threads"),
    ({**_threaded(), "ops": [{"op": "sync_device", "thread": 1}]}, 0, "thread", "expected a thread name"),
    ({**_threaded(), "ops": [{"op": "release"}]}, 0, "sync", "missing"),
    ({**_threaded(), "ops": [{"op": "acquire", "sync": ""}]}, 0, "sync", "non-empty string"),
    ({**_threaded(), "ops": [{"op": "acquire", "sync": ["q"]}]}, 0, "sync", "non-empty string"),
    ({**_threaded(), "ops": [{"op": "release", "sync": "q", "ranges": []}]}, 0, "ranges",
     "unknown field for a release op"),
    ({**_threaded(), "ops": [{"op": "free"}]}, 0, "ranges", "missing"),
    ({**_threaded(), "ops": [{"op": "free", "ranges": [["gpu", 0, 9000]]}]}, 0, "ranges[0]", "past the end"),
    ({**_threaded(), "ops": [{"op": "free", "ranges": "gpu"}]}, 0, "ranges", "expected an array"),
    ({"thread": ["main"], **_threaded()}, None, "thread", "did you mean 'threads'?"),
])
def test_invalid_1_2_forms_name_op_index_and_field(doc, op_index, field, words):
    for given in (doc, json.dumps(doc)):      # decoded, and read from text
        with pytest.raises(TraceError) as e:
            Trace.from_json(given)
        err = e.value
        assert (err.op_index, err.field) == (op_index, field), str(err)
        assert words in str(err)


def test_a_repeated_thread_key_is_invalid():
    text = '{"version": 1, "buffers": {}, "streams": [], "threads": ["a"], "ops": [{"op": "sync_device", ' \
           '"thread": "a", "thread": "a"}]}'
    with pytest.raises(TraceError, match="repeat"):
        Trace.from_json(text)


@pytest.mark.parametrize("op, field, line", [
    ({"op": "record", "evnt": "e", "stream": "compute"}, "evnt",
     "op 3 (record), field 'evnt': unknown field for a record op (did you mean 'event'?)"),
    ({"op": "kernel", "stream": "compute", "wrtes": []}, "wrtes",
     "op 3 (kernel), field 'wrtes': unknown field for a kernel op (did you mean 'writes'?)"),
    ({"op": "acquire", "snyc": "q"}, "snyc",
     "op 3 (acquire), field 'snyc': unknown field for an acquire op (did you mean 'sync'?)"),
    ({"op": "sync_device", "zzz": 1}, "zzz", "op 3 (sync_device), field 'zzz': unknown field for a sync_device op"),
    ({"op": "copy_batch", "stream": "compute", "order": "ANY", "copies": [{"src": ["gpu", 0, 4], "dts": ["cpu", 0, 4]}]},
     "copies[0].dts", "op 3 (copy_batch), field 'copies[0].dts': unknown field (did you mean 'dst'?)"),
])
def test_a_misspelt_key_is_named_with_the_closest_known_one(op, field, line):
    doc = copy.deepcopy(DOC)
    doc["ops"][3] = op
    for given in (doc, json.dumps(doc)):
        with pytest.raises(TraceError) as e:
            Trace.from_json(given)
        assert (e.value.op_index, e.value.field, str(e.value)) == (3, field, line)


def test_a_misspelt_buffer_key_is_named_too():
    doc = copy.deepcopy(DOC)
    doc["buffers"]["x"] = {"space": "device", "byts": 8}
    with pytest.raises(TraceError, match=r"field 'buffers.x.byts': unknown field \(did you mean 'bytes'\?\)"):
        Trace.from_json(doc)


def test_threads_after_the_ops_are_read_before_the_ops_that_name_them():
    """Object members are unordered (RFC 8259): a ``threads`` member after ``ops`` declares the
    threads the ops name, as it does before them."""
    head = '{"version": 1, "buffers": {"cpu": {"space": "host_pinned", "bytes": 8}}, "streams": [], "ops": '
    ops = '[{"op": "host_write", "ranges": [["cpu", 0, 8]]}, {"op": "host_read", "ranges": [["cpu", 0, 8]]}]'
    trace = Trace.from_json(head + ops + ', "threads": ["main", "other"]}')
    assert trace.threads == ("main", "other")
    with pytest.raises(TraceError, match="declared twice") as e:
        Trace.from_json(head + ops + ', "threads": ["main", "main"]}')
    assert e.value.field == "threads[1]"
    named = ops.replace('"op": "host_read"', '"op": "host_read", "thread": "other"')
    trace = Trace.from_json(head + named + ', "threads": ["main", "other"]}')
    assert trace.ops[1].thread == "other"
    assert check(head + named + ', "threads": ["main", "other"]}').verdict == "RACY"  # two threads, no hand-off
    assert check(head + ops + ', "threads": ["main", "other"]}').verdict == "SAFE"
    with pytest.raises(TraceError, match="unknown thread 'third'") as e:
        Trace.from_json(head + named.replace('"other"', '"third"') + ', "threads": ["main", "other"]}')
    assert (e.value.op_index, e.value.field) == (1, "thread")
