"""The recorder's op log, fed synthetic reports (as the observed methods and the native log deliver them), and the
trace writer: names, held-back reports, what is summarized, and that every trace it writes is valid."""

from __future__ import annotations

import numpy as np
import pytest
from fake_cuda import Lines

from kvverify.check import Trace, check
from kvverify.record.trace.recorder import LEGACY_STREAM, CopyArrays, Recorder
from kvverify.record.trace.writer import build

COMPUTE, OFFLOAD = 0x7F00, 0x7F10  # stream handles
EVENT, EVENT2 = 0xE000, 0xE100



def recorder() -> Recorder:
    return Recorder(Lines())


def batch(*copies) -> CopyArrays:
    cols = list(zip(*copies))
    return CopyArrays(*(np.array(c, dtype=np.int64) for c in cols))


def store(rec: Recorder, order: str, *, wait: bool = True):
    """compute writes a GPU block; offload (optionally behind compute) stores it; the host polls the
    end event and reads the host block."""
    gpu = rec.memory.fresh(0x10000, 8192, "device", "kv cache", "prog.py:0 in setup")
    cpu = rec.memory.fresh(0x90000, 8192, "host_pinned", "cpu cache", "prog.py:0 in setup")
    rec.kernel(COMPUTE, "write_kv", [], [(gpu.index, 0, 4096)], rec.locate())
    if wait:
        rec.event_created(EVENT)
        rec.event_recorded(EVENT, COMPUTE)
        rec.event_waited(EVENT, OFFLOAD)
    rec.copy_batch(OFFLOAD, "swap", order, batch((gpu.index, 0, cpu.index, 0, 4096)), rec.locate())
    rec.event_created(EVENT2)
    rec.event_recorded(EVENT2, OFFLOAD)
    rec.event_queried(EVENT2, False)
    rec.event_queried(EVENT2, False)
    rec.event_queried(EVENT2, True)
    rec.host_access("host_read", [(cpu.index, 0, 4096)], "consume", rec.locate())
    return gpu, cpu


def test_a_store_behind_a_barrier_in_stream_order_is_safe_and_any_races_at_the_lines_that_issued_it():
    rec = recorder()
    store(rec, "STREAM")
    doc, _ = build(rec)
    assert check(doc).safe
    rec = recorder()
    store(rec, "ANY")
    doc, _ = build(rec)
    verdict = check(doc)
    assert not verdict.safe
    (race,) = verdict.races
    first, second = doc["ops"][race.first], doc["ops"][race.second]
    assert (first["op"], second["op"], race.kind) == ("kernel", "copy_batch", "RAW")
    assert first["at"] == "prog.py:1 in step" and second["at"] == "prog.py:4 in step"
    assert "prog.py:4 in step" in verdict.render()


def test_a_false_query_orders_nothing_and_only_a_true_one_does():
    rec = recorder()
    gpu = rec.memory.fresh(0x10000, 4096, "device", "kv")
    cpu = rec.memory.fresh(0x90000, 4096, "host_pinned", "cpu")
    rec.copy(OFFLOAD, "d2h", (gpu.index, 0, 4096), (cpu.index, 0, 4096), None)
    rec.event_recorded(EVENT, OFFLOAD)
    rec.event_queried(EVENT, False)
    rec.host_access("host_read", [(cpu.index, 0, 4096)], None, None)
    assert not check(build(rec)[0]).safe  # H4: consumed before completion was observed
    rec.event_queried(EVENT, True)
    rec.host_access("host_read", [(cpu.index, 0, 4096)], None, None)
    races = check(build(rec)[0]).races
    assert [(r.first, r.second) for r in races] == [(0, 3)]  # only the read before the true answer


def test_streams_and_events_get_readable_names_and_a_recreated_event_is_a_new_one():
    rec = recorder()
    assert rec.stream(Recorder.stream_key(LEGACY_STREAM, 0), None) == "default"
    assert rec.stream(Recorder.stream_key(LEGACY_STREAM, 1), None) == "default (cuda:1)"
    assert rec.stream(COMPUTE, "tests/offload.py:41 in store") == "stream1 (offload.py:41)"
    assert rec.stream(COMPUTE, "elsewhere.py:9 in f") == "stream1 (offload.py:41)"  # named once
    rec.event_created(EVENT)
    rec.event_recorded(EVENT, COMPUTE)
    first = rec.ops[-1]["event"]
    rec.event_deleted(EVENT)
    rec.event_created(EVENT)  # CUDA hands the handle out again
    rec.event_waited(EVENT, OFFLOAD)  # a wait on the new, never recorded event: orders nothing
    assert rec.ops[-1]["event"] != first


def test_a_wait_on_a_recreated_event_does_not_order_the_old_capture():
    rec = recorder()
    gpu = rec.memory.fresh(0x10000, 4096, "device", "kv")
    cpu = rec.memory.fresh(0x90000, 4096, "host_pinned", "cpu")
    rec.kernel(COMPUTE, "write", [], [(gpu.index, 0, 4096)], None)
    rec.event_created(EVENT)
    rec.event_recorded(EVENT, COMPUTE)
    rec.event_deleted(EVENT)
    rec.event_created(EVENT)
    rec.event_waited(EVENT, OFFLOAD)
    rec.copy(OFFLOAD, "store", (gpu.index, 0, 4096), (cpu.index, 0, 4096), None)
    assert not check(build(rec)[0]).safe


def test_reports_during_an_op_come_after_it_and_a_blocking_copys_sync_is_written_once():
    rec = recorder()
    gpu = rec.memory.fresh(0x10000, 4096, "device", "kv")
    cpu = rec.memory.fresh(0x90000, 4096, "host_pageable", "cpu")
    rec.begin_op()
    rec.stream_synchronized(COMPUTE)  # torch's memcpy_and_sync reports it while the copy runs
    rec.event_recorded(EVENT, COMPUTE)  # a Python custom op's event, while it runs
    rec.copy(COMPUTE, "d2h", (gpu.index, 0, 4096), (cpu.index, 0, 4096), "prog.py:7 in f")
    rec.synchronized_by_op(COMPUTE, "prog.py:7 in f")  # the dispatcher hook's own, for the blocking copy
    rec.end_op()
    assert [op["op"] for op in rec.ops] == ["copy", "sync_stream", "record"]
    rec.begin_op()  # a blocking copy torch did not report a synchronization for
    rec.copy(COMPUTE, "d2h", (gpu.index, 0, 4096), (cpu.index, 0, 4096), "prog.py:8 in f")
    rec.synchronized_by_op(COMPUTE, "prog.py:8 in f")
    rec.end_op()
    assert [op["op"] for op in rec.ops[3:]] == ["copy", "sync_stream"]


def test_stream_query_true_orders_the_streams_work_and_false_records_nothing():
    rec = recorder()
    gpu = rec.memory.fresh(0x10000, 4096, "device", "kv")
    cpu = rec.memory.fresh(0x90000, 4096, "host_pinned", "cpu")
    rec.copy(OFFLOAD, "d2h", (gpu.index, 0, 4096), (cpu.index, 0, 4096), None)
    rec.stream_queried(OFFLOAD, False)
    assert len(rec.ops) == 1
    rec.stream_queried(OFFLOAD, True)
    rec.host_access("host_read", [(cpu.index, 0, 4096)], None, None)
    assert check(build(rec)[0]).safe


def test_only_buffers_that_kernels_of_one_stream_alone_touch_are_summarized():
    """What a trace may leave out: bytes every access reaches through one stream with no host
    access. Kernels on two streams race like copies (a Triton copy kernel beside compute's
    zero-fill), so a buffer two streams' kernels touch is written."""
    rec = recorder()
    kv = rec.memory.fresh(0x10000, 4096, "device", "kv")
    act = rec.memory.fresh(0x20000, 4096, "device", "activations")
    work = rec.memory.fresh(0x30000, 4096, "device", "workspace")
    cpu = rec.memory.fresh(0x90000, 4096, "host_pinned", "cpu")
    staging = rec.memory.fresh(0xA0000, 64, "host_pageable", "host only")
    rec.kernel(COMPUTE, "mlp", [(act.index, 0, 4096)], [(act.index, 0, 4096), (work.index, 0, 64)], None)
    rec.kernel(OFFLOAD, "race on activations", [], [(act.index, 0, 64)], None)
    rec.kernel(COMPUTE, "attn", [(act.index, 0, 4096), (kv.index, 0, 4096), (work.index, 0, 64)], [], None)
    rec.copy(OFFLOAD, "store", (kv.index, 0, 4096), (cpu.index, 0, 4096), None)
    rec.host_access("host_write", [(staging.index, 0, 64)], None, None)
    doc, summary = build(rec)
    assert set(doc["buffers"]) == {"gpu0 @0x10000", "gpu1 @0x20000", "pinned3 @0x90000"}
    assert [op["op"] for op in doc["ops"]] == ["kernel", "kernel", "kernel", "copy"]
    assert summary.kernels_summarized == 0 and summary.accesses_summarized == 3  # workspace twice, staging once
    races = check(doc).races
    assert [(r.first, r.second, r.kind) for r in races] == [(0, 1, "WAW"), (1, 2, "RAW")]
    full, _ = build(rec, keep_all=True)
    assert len(full["ops"]) == 5 and len(check(full).races) == 2  # what was left out cannot race


def test_a_buffer_kernels_of_one_stream_and_the_host_touch_is_written():
    rec = recorder()
    act = rec.memory.fresh(0x20000, 4096, "device", "activations")
    work = rec.memory.fresh(0x30000, 4096, "device", "workspace")
    rec.kernel(COMPUTE, "mlp", [], [(act.index, 0, 4096), (work.index, 0, 64)], None)
    rec.released([(act.index, 0, 4096)], "free", None)
    doc, summary = build(rec)
    assert set(doc["buffers"]) == {"gpu0 @0x20000"}
    assert summary.accesses_summarized == 1
    assert [r.kind for r in check(doc).races] == ["FREE"]


def test_unused_event_records_are_dropped_and_polling_is_written_once_per_event():
    rec = recorder()
    rec.stream(COMPUTE, None)
    rec.event_recorded(EVENT, COMPUTE)  # never waited on, synchronized or queried
    rec.event_recorded(EVENT2, COMPUTE)
    for _ in range(5):
        rec.event_queried(EVENT2, False)
    rec.event_queried(EVENT2, True)
    doc, summary = build(rec)
    assert [op["op"] for op in doc["ops"]] == ["record", "query_event", "query_event"]
    assert [op["result"] for op in doc["ops"][1:]] == [False, True]
    assert summary.records_dropped == 1 and summary.queries_collapsed == 4


def test_buffers_are_named_by_kind_and_where_the_program_made_them_and_labels_stay_unique():
    rec = recorder()
    a = rec.memory.fresh(0x10000, 64, "device", "t", "tests/offload.py:30 in __init__")
    b = rec.memory.fresh(0x20000, 64, "host_pinned", "t", None)
    c = rec.memory.fresh(0x30000, 64, "host_pinned", "t", None, label="staging")
    d = rec.memory.fresh(0x40000, 64, "host_pinned", "t", None, label="staging")
    rec.copy_batch(OFFLOAD, "swap", "STREAM", batch((a.index, 0, b.index, 0, 8), (a.index, 8, c.index, 0, 8),
                                                     (a.index, 16, d.index, 0, 8)), None)
    doc, _ = build(rec)
    assert set(doc["buffers"]) == {"gpu0 (offload.py:30)", "pinned1 @0x20000", "staging", "staging #3"}
    Trace.from_json(doc)


def test_unresolved_pointers_are_written_as_pageable_memory_and_listed():
    rec = recorder()
    gpu = rec.memory.fresh(0x10000, 8192, "device", "kv")
    lost = rec.memory.unresolved_span(0xDEAD000, 4096, "dst_ptrs[0] lies in no allocation", "prog.py:3 in f")
    rec.copy_batch(OFFLOAD, "swap", "ANY", batch((gpu.index, 0, lost[0], lost[1], 4096)), "prog.py:3 in f")
    doc, summary = build(rec)
    assert doc["buffers"]["unresolved 0xdead000"] == {"space": "host_pageable", "bytes": 4096}
    text = "\n".join(summary.lines())
    assert "4096 bytes at 0xdead000 at prog.py:3 in f: dst_ptrs[0] lies in no allocation" in text


def test_every_written_trace_is_valid():
    rec = recorder()
    store(rec, "DURING_API_CALL")
    rec.device_synchronized()
    rec.stream_synchronized(OFFLOAD)
    rec.event_synchronized(EVENT2)
    Trace.from_json(build(rec)[0])
    Trace.from_json(build(rec, keep_all=True)[0])


def test_a_copy_moves_one_size():
    rec = recorder()
    with pytest.raises(ValueError, match="a copy moves one size"):
        rec.copy(OFFLOAD, "x", (0, 0, 8), (0, 0, 16), None)
