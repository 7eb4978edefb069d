"""Lifetimes (trace format 1.2): bytes an allocator hands to a new owner are one buffer with their old
owner's, ordered only by what the program and the allocators did: stream order on the block's
stream, ``record_stream`` events, the pinned allocator's copy events; an allocator's event fences
only the work issued before it (a pool's event reused for another block, a block freed while an op
runs, one copy of many); memory released with no ordering of its own is a ``free`` (an unregister
through torch's cudart too). The recorder is fed as torch's callbacks and the dispatcher feed it on
a GPU (``kvverify.record.capture.hooks``, ``dispatch``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import Lines

import kvverify.record as record
from kvverify.check import check
from kvverify.record.trace.recorder import CopyArrays, Recorder
from kvverify.record.trace.writer import build

COMPUTE, SIDE = 0x7F00, 0x7F10  # stream handles
BLOCK = 1 << 20
EVENT = 0xE000



def races(rec: Recorder):
    doc, _ = build(rec)
    return doc, check(doc).races


def freed_under_a_side_copy(*, record_stream: bool, sync: bool = False):
    """A block made on compute and read by a D2H on a side stream is freed; its bytes go to a new
    tensor the compute stream writes (meta-pytorch/torchrec#4231's shape)."""
    rec = Recorder(Lines())
    old = rec.allocated(0x10000, BLOCK, "device", "output of aten.empty", rec.locate())
    host = rec.allocated(0x900000, BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    rec.kernel(COMPUTE, "fill", [], [(old.index, 0, BLOCK)], rec.locate())
    rec.event_created(EVENT)
    rec.event_recorded(EVENT, COMPUTE)
    rec.event_waited(EVENT, SIDE)
    rec.copy(SIDE, "copy_", (old.index, 0, BLOCK), (host.index, 0, BLOCK), rec.locate())
    if record_stream:
        rec.stream_used(0x10000, SIDE)
    rec.memory_freed(0x10000)
    if sync:
        rec.device_synchronized()
    rec.memory_allocated(0x10000)
    new = rec.allocated(0x10000, BLOCK, "device", "output of aten.empty", rec.locate())
    rec.kernel(COMPUTE, "fill", [], [(new.index, 0, BLOCK)], rec.locate())
    return rec


def test_a_block_freed_under_a_side_streams_copy_and_reused_races_with_the_new_owners_write():
    doc, found = races(freed_under_a_side_copy(record_stream=False))
    assert len(doc["buffers"]) == 2  # the old and the new owner's bytes are one buffer
    pair = {(r.first, r.second, r.kind) for r in found}
    copy = next(i for i, op in enumerate(doc["ops"]) if op["op"] == "copy")
    write = max(i for i, op in enumerate(doc["ops"]) if op["op"] == "kernel")
    assert (copy, write, "WAR") in pair


def test_record_stream_is_the_allocators_event_at_the_free_and_its_completion_at_the_reuse():
    doc, found = races(freed_under_a_side_copy(record_stream=True))
    assert not found
    record_op, query = (op for op in doc["ops"] if op.get("name", "").startswith(("caching", "allocator")))
    assert record_op["op"] == "record" and record_op["stream"].startswith("stream") and query["op"] == "query_event"
    assert query["result"] is True and query["event"] == record_op["event"]


def test_a_synchronization_before_the_reuse_orders_it_too():
    _, found = races(freed_under_a_side_copy(record_stream=False, sync=True))
    assert not found


def test_reuse_on_the_blocks_own_stream_is_stream_ordered():
    rec = Recorder(Lines())
    old = rec.allocated(0x10000, BLOCK, "device", "t", rec.locate())
    host = rec.allocated(0x900000, BLOCK, "host_pinned", "t", rec.locate())
    rec.copy(COMPUTE, "copy_", (old.index, 0, BLOCK), (host.index, 0, BLOCK), rec.locate())
    rec.memory_freed(0x10000)
    new = rec.allocated(0x10000 + 4096, 4096, "device", "t", rec.locate())  # a part of the block
    rec.kernel(COMPUTE, "fill", [], [(new.index, 0, 4096)], rec.locate())
    rec.host_access("host_read", [(host.index, 0, BLOCK)], "read", rec.locate())
    doc, found = races(rec)
    buffer = doc["ops"][-2]["writes"][0]
    assert buffer[1] == 4096 and doc["buffers"][buffer[0]]["bytes"] == BLOCK
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == \
        [("RAW", "copy", "host_read")]  # the unsynchronized read, not the reuse


def pinned_temporary(*, copied_by_torch: bool):
    """A pinned temporary from torch's host allocator is the source of an H2D on a side stream and
    dropped; the allocator hands its block to a new tensor the host writes (pytorch/pytorch#130785,
    LMCache's raw-pointer form)."""
    rec = Recorder(Lines())
    temp = rec.allocated(0x900000, 4096, "host_pinned", "output of aten._pin_memory", rec.locate())
    gpu = rec.allocated(0x10000, 4096, "device", "t", rec.locate())
    rec.begin_op()
    if copied_by_torch:  # copy_(non_blocking=True): torch records the allocator's event on the stream
        rec.copy(SIDE, "copy_", (temp.index, 0, 4096), (gpu.index, 0, 4096), rec.locate())
        rec.host_copy_fenced(temp.index, SIDE, rec.locate())
    else:  # a batched swap of raw pointers: the allocator knows nothing of it
        copies = CopyArrays(*(np.array([v], dtype=np.int64) for v in (temp.index, 0, gpu.index, 0, 4096)))
        rec.copy_batch(SIDE, "swap_blocks_batch", "STREAM", copies, rec.locate())
    rec.end_op()
    new = rec.allocated(0x900000, 4096, "host_pinned", "output of aten._pin_memory", rec.locate())
    rec.host_access("host_write", [(new.index, 0, 4096)], "fill", rec.locate())
    return races(rec)


def test_a_pinned_block_reused_under_a_raw_pointer_copy_races_with_the_new_owners_host_write():
    doc, found = pinned_temporary(copied_by_torch=False)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == \
        [("WAR", "copy_batch", "host_write")]


def test_the_pinned_allocator_waits_for_the_event_torchs_own_copy_recorded():
    doc, found = pinned_temporary(copied_by_torch=True)
    assert not found
    assert [op["op"] for op in doc["ops"]] == ["copy", "record", "query_event", "host_write"]


def test_allocations_at_one_address_in_different_spaces_stay_apart():
    rec = Recorder(Lines())
    a = rec.allocated(0x10000, 4096, "host_pageable", "t", rec.locate())
    rec.memory.retire(0x10000)
    b = rec.allocated(0x10000, 4096, "host_pinned", "t", rec.locate())
    gpu = rec.allocated(0x90000, 4096, "device", "t", rec.locate())
    rec.copy(SIDE, "copy_", (a.index, 0, 4096), (gpu.index, 0, 4096), rec.locate())
    rec.copy(SIDE, "copy_", (b.index, 0, 4096), (gpu.index, 0, 4096), rec.locate())
    doc, _ = races(rec)
    assert sorted(v["space"] for v in doc["buffers"].values()) == ["device", "host_pageable", "host_pinned"]


# -- through the dispatcher, on the CPU stand-in ---------------------------------------------------


def test_free_and_reuse_annotations_are_free_ops_at_the_line_that_made_them(fake):
    gpu = fake.device(4, 4096)
    cpu = fake.pinned(4, 4096)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        side = fake.stream()
        with fake.use(side):
            cpu[1].copy_(gpu[1], non_blocking=True)
        record.reuse(cpu[1])  # a pool hands the slot on while the copy may still write it
        record.free(gpu[2], name="unmap")
    doc = rec.trace()
    frees = [op for op in doc["ops"] if op["op"] == "free"]
    assert [op["name"] for op in frees] == ["reuse", "unmap"]
    assert frees[0]["ranges"][0][1:] == [4096, 4096] and "test_record_lifetimes.py" in frees[0]["at"]
    found = rec.check().races
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second].get("name")) for r in found] == \
        [("FREE", "copy", "reuse")]


def test_a_thread_started_while_recording_records_its_device_work_and_annotations_under_its_name(fake):
    import threading

    gpu = fake.device(4096)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        worker = threading.Thread(target=lambda: (gpu.add_(1), record.host_write((0x1000, 8))), name="offloader")
        worker.start()
        worker.join()
    mine = [op for op in rec.recorder.ops if op.get("thread") == "offloader" and op["op"] not in ("release", "acquire")]
    assert [op["op"] for op in mine] == ["kernel", "host_write"] and rec.complete()
    assert "test_record_lifetimes.py" in mine[0]["at"]
    # after the recording, the thread's mode records nothing
    ops = len(rec.recorder.ops)
    after = threading.Thread(target=lambda: gpu.add_(1))
    after.start()
    after.join()
    assert len(rec.recorder.ops) == ops


def test_threads_running_when_the_recording_starts_are_named_in_the_summary(fake):
    import threading

    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, name="engine-loop")
    idle.start()
    try:
        with record.recording(platform=fake, skip=fake.skip()) as rec:
            torch.zeros(1)
    finally:
        stop.set()
        idle.join()
    assert any("engine-loop" in line for line in rec.summary().lines())
    assert rec.complete()  # named, not missed: nothing says it did device work


@pytest.mark.parametrize("stale", [(0, BLOCK), (-64, 128), (BLOCK // 2, BLOCK)], ids=["same", "across-its-start", "inside"])
def test_host_memory_freed_unseen_does_not_pass_for_the_device_tensor_made_there(fake, stale):
    """CPU frees reach no callback: the map may still hold a freed pageable tensor where new memory
    now lies. A device tensor there must not be taken for that host memory (a copy into it would be
    host to host, read at the call, and its race hidden)."""
    gpu, staging = fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        # what the map would hold had a CPU tensor lived at (some of) these addresses and been freed
        offset, size = stale
        rec.recorder.allocated(gpu.data_ptr() + offset, size, "host_pageable", "output of aten.empty", None)
        with fake.use(fake.stream()):
            gpu.copy_(staging, non_blocking=True)
        staging.fill_(2)  # the host rewrites the source the H2D may still read
    doc = rec.trace()
    copy = next(op for op in doc["ops"] if op["op"] == "copy")
    assert doc["buffers"][copy["dst"][0]]["space"] == "device" and copy["dst"][1:] == [0, BLOCK]
    assert [r.kind for r in rec.check().races] == ["WAR"] and rec.complete()


def test_pageable_memory_registered_under_a_pending_d2h_ends_as_pageable_with_a_free(fake):
    """A D2H into pageable memory is written in stream order (rule 6); registering the memory
    (cudaHostRegister) while it is pending makes the bytes another buffer in the trace: the old kind
    ends with a free, which the pending copy races with."""
    gpu, cpu = fake.device(BLOCK), fake.pageable(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with fake.use(fake.stream()):
            cpu.copy_(gpu, non_blocking=True)
        rec.recorder.allocated(cpu.data_ptr(), BLOCK, "host_registered", "cudaHostRegister", None)
        cpu.sum()
    doc = rec.trace()
    kinds = {(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races}
    assert ("FREE", "copy", "free") in kinds


def test_a_thread_the_recording_does_not_follow_is_not_taken_for_an_ended_one_with_its_ident(fake):
    import _thread
    import threading

    gpu = fake.device(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        followed = threading.Thread(target=lambda: gpu.add_(1), name="followed")
        followed.start()
        followed.join()
        done = threading.Event()
        # a thread started outside threading.Thread: not followed, whatever ident the system gives it
        _thread.start_new_thread(lambda: (fake.event().record(), done.set()), ())
        done.wait()
    notes = rec.summary().notes
    assert not rec.complete()
    assert any(n.startswith("NOT RECORDED") and "stream, event and allocator reports" in n for n in notes), notes
    assert [op["thread"] for op in rec.recorder.ops if op["op"] == "record"] == []


# -- the allocators' events fence only the work issued before them -----------------------------------

SMALL_BLOCK = 4096  # the blocks of the tests below
H = 0xE100  # one CUDA event handle

def d2h(rec: Recorder, gpu, host, *, event: int | None, created: bool = True):
    """``host.copy_(gpu, non_blocking=True)`` on SIDE as the dispatcher logs it: the copy, then
    torch's pinned allocator's event after it (``host_copy_fenced``). ``event``: a CUDA event the
    program records meanwhile (a Python custom op's, held back until the op is logged)."""
    rec.begin_op()
    if event is not None:
        if created:
            rec.event_created(event)
        rec.event_recorded(event, SIDE)
    rec.copy(SIDE, "copy_", (gpu.index, 0, SMALL_BLOCK), (host.index, 0, SMALL_BLOCK), rec.locate())
    rec.host_copy_fenced(host.index, SIDE, rec.locate())
    rec.end_op()


def test_a_pinned_allocator_event_reused_for_another_block_fences_only_its_own_copy():
    """torch's pinned allocator takes its events from a pool: once block X's event completed, X is
    free and the same CUDA event is recorded again for a copy into block Y. X's reuse was written
    as a true query of the event's *name*, which (rule 3) reads its latest record: Y's copy, which
    the allocator never waited for. The host's read of Y, unsynchronized, was called SAFE."""
    rec = Recorder(Lines())
    x = rec.allocated(0x900000, SMALL_BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    y = rec.allocated(0xA00000, SMALL_BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    g1 = rec.allocated(0x10000, SMALL_BLOCK, "device", "t", rec.locate())
    g2 = rec.allocated(0x20000, SMALL_BLOCK, "device", "t", rec.locate())
    d2h(rec, g1, x, event=H)
    d2h(rec, g2, y, event=H, created=False)  # the pool's event again: no creation callback
    # X handed out again
    new = rec.allocated(0x900000, SMALL_BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    rec.host_access("host_write", [(new.index, 0, SMALL_BLOCK)], "fill", rec.locate())
    rec.host_access("host_read", [(y.index, 0, SMALL_BLOCK)], "consume", rec.locate())
    doc, found = races(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second].get("name")) for r in found] == \
        [("RAW", "copy", "consume")]


def test_a_record_stream_block_freed_while_an_op_runs_fences_only_work_issued_before_the_free():
    """The caching allocator records its ``record_stream`` event when the block is freed; a block
    freed while an op runs (its last reference dropped inside it, an ``out=`` resized) had that
    record held back until the op was logged, so the event captured the op's own copy too. The
    block's reuse then ordered the copy before the host: its unsynchronized read was called SAFE."""
    rec = Recorder(Lines())
    rec.allocated(0x10000, SMALL_BLOCK, "device", "t", rec.locate())  # `old`
    gpu = rec.allocated(0x20000, SMALL_BLOCK, "device", "t", rec.locate())
    host = rec.allocated(0x900000, SMALL_BLOCK, "host_pageable", "t", rec.locate())
    rec.stream_used(0x10000, SIDE)
    rec.begin_op()  # host.copy_(gpu, non_blocking=True) on SIDE, during which `old` is freed
    rec.memory_freed(0x10000)
    rec.copy(SIDE, "copy_", (gpu.index, 0, SMALL_BLOCK), (host.index, 0, SMALL_BLOCK), rec.locate())
    rec.end_op()
    rec.memory_allocated(0x10000)
    rec.allocated(0x10000, SMALL_BLOCK, "device", "t", rec.locate())  # the block's next owner
    rec.host_access("host_read", [(host.index, 0, SMALL_BLOCK)], "consume", rec.locate())
    doc, found = races(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second].get("name")) for r in found] == \
        [("RAW", "copy", "consume")]


def test_foreach_copy_fences_each_pinned_block_only_with_its_own_copy(fake):
    """``torch._foreach_copy_`` runs one non-blocking copy per pair, and the pinned allocator records
    one event after each; the dispatcher sees them all held back at the end of the op, and fenced
    every pair's block with every event, the later pairs' included. The reuse of the first block
    then ordered the second pair's D2H before the host's read of its destination: called SAFE."""
    gpu1, gpu2 = fake.device(SMALL_BLOCK), fake.device(SMALL_BLOCK)
    first, second = fake.pinned(SMALL_BLOCK), fake.pinned(SMALL_BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        recorder = rec.recorder
        with fake.use(side):
            # the pinned allocator's two events, as torch records them while the op runs
            recorder.begin_op()
            for _ in range(2):
                fake.event().record(side)
            torch._foreach_copy_([first, second], [gpu1, gpu2], non_blocking=True)
        # the first block is handed out again (an allocation of the pinned allocator at its address)
        with recorder.exclusive():
            recorder.allocated(first.data_ptr(), SMALL_BLOCK, "host_pinned", "output of aten.empty", None)
        record.host_read(second)
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert ("RAW", "copy", "host_read") in kinds



def test_cuda_host_unregister_through_torchs_cudart_is_a_free(monkeypatch):
    """``cudaHostUnregister`` of kvverify's host memory is a ``free`` (device work still on the bytes
    races with it); the same call through ``torch.cuda.cudart()`` only forgot the memory, so a D2H
    still writing it was called SAFE against the release."""
    from kvverify.record.capture.hooks import CudaPlatform, thread_guard

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    rec = Recorder(Lines())
    platform = CudaPlatform()
    platform._wrap_host_register(rec, thread_guard(rec, lambda: False))
    try:
        buf = np.zeros(SMALL_BLOCK, dtype=np.uint8)
        cudart.cudaHostRegister(buf.ctypes.data, SMALL_BLOCK, 0)
        registered = rec.memory.find(buf.ctypes.data)
        gpu = rec.allocated(0x10000, SMALL_BLOCK, "device", "t", rec.locate())
        # in flight
        rec.copy(SIDE, "copy_", (gpu.index, 0, SMALL_BLOCK), (registered.index, 0, SMALL_BLOCK), rec.locate())
        cudart.cudaHostUnregister(buf.ctypes.data)
    finally:
        platform.uninstall()
    doc, found = races(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == \
        [("FREE", "copy", "free")]

