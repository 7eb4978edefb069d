"""A hostile review of the recorder: programs that race which a recording must not call SAFE,
behaviour a recording must not change, state it must not leave behind. Each test is one finding;
a strict xfail names a defect left for the lead to fix."""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, Lines

import kvverify.record as record
from kvverify.check import check
from kvverify.record.trace.recorder import Recorder
from kvverify.record.trace.writer import build

SIDE, COMPUTE = 0x7F10, 0x7F00
BLOCK = 4096



def verdict(rec: Recorder):
    doc, _ = build(rec)
    return doc, check(doc).races


# -- host threads --------------------------------------------------------------------------------


def test_a_lock_release_that_raises_orders_nothing(fake):
    """``lock.release()`` of a lock that is not held raises RuntimeError and releases nothing; the
    recorder logged the release before calling it, so another thread's later acquire of the lock was
    ordered after everything the releasing thread did: a race of its host write hidden."""
    cpu, gpu = fake.pinned(BLOCK), fake.device(BLOCK)
    side = fake.stream()
    lock = threading.Lock()
    wrote = []  # a flag no lock guards: orders nothing (docs/record.md), only makes the order below happen
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        def writer():
            record.host_write(cpu)
            try:
                lock.release()  # a bug of the program: the lock is not held
            except RuntimeError:
                pass
            wrote.append(True)

        def reader():
            while not wrote:
                time.sleep(0.001)
            with lock, fake.use(side):
                gpu.copy_(cpu, non_blocking=True)  # the H2D reads what the writer wrote

        # the reader runs before the writer ends: threading's own bookkeeping lock, taken at each
        # thread's start and end, orders nothing here (test_threadings_own_bookkeeping_lock...)
        threads = [threading.Thread(target=reader, name="reader"), threading.Thread(target=writer, name="writer")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_threadings_own_bookkeeping_lock_orders_no_thread_after_another():
    """Every thread takes ``threading._active_limbo_lock`` as it begins and ends, and ``Thread.start``
    takes it too: observed as a program lock, it ordered a thread started after another one ended
    after everything that one did. The program never synchronized them: its writer's host write and
    the copy that reads the bytes race (a slower writer would still be writing)."""
    fake = FakeCuda()
    cpu, gpu = fake.pinned(BLOCK), fake.device(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        writer = threading.Thread(target=lambda: record.host_write(cpu), name="writer")
        writer.start()
        while writer.is_alive():  # (not a join: the program does not wait for it; this run happens to)
            time.sleep(0.001)

        def reader():
            with fake.use(side):
                gpu.copy_(cpu, non_blocking=True)

        copier = threading.Thread(target=reader, name="reader")
        copier.start()
        copier.join()
        writer.join()
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_a_thread_that_gets_the_ident_of_one_that_ended_keeps_both_names_apart(fake):
    """Thread idents are reused once a thread ended (glibc hands the next thread the same pthread):
    the new thread's name replaced the old one's in the recorder, so the old thread's ops named a
    thread the trace did not declare (an invalid trace: ``check`` raised), and a third thread of
    the old one's name got that name again, merging two program orders into one."""
    gpu = fake.device(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        idents = []
        for _ in range(3):
            t = threading.Thread(target=lambda: (idents.append(threading.get_ident()), gpu.add_(1)), name="worker")
            t.start()
            t.join()
    if len(set(idents)) == 3:
        pytest.skip("this system gave each thread a new ident")
    doc = rec.trace()
    assert doc["threads"] == ["MainThread", "worker", "worker #2", "worker #3"]
    assert {op["thread"] for op in doc["ops"] if "thread" in op} == {"worker", "worker #2", "worker #3"}
    rec.check()  # a valid trace


def _two_threads_on_one_stream(fake, *, locked: bool):
    """A worker thread records an event on the side stream while the main thread copies on it; the
    main thread then waits for the event on its default stream. ``locked``: both hold one lock."""
    gpu, cpu = fake.device(BLOCK), fake.pinned(BLOCK)
    side, lock = fake.stream(), threading.Lock()
    held = lock if locked else contextlib.nullcontext()
    event = fake.event()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        def worker():
            with held:
                event.record(side)

        t = threading.Thread(target=worker, name="worker")
        t.start()
        with held, fake.use(side):
            gpu.copy_(cpu, non_blocking=True)
        t.join()
        event.wait(fake.default)
    return rec


def test_two_threads_issuing_to_one_stream_with_no_host_ordering_make_the_recording_incomplete(fake):
    """Each op is logged after its CUDA call returned: a record of one thread and a copy of another on
    the same stream, unordered on the host, may have reached the driver in the other order than the
    log's, and that order decides whether the event captures the copy. The recording must not call
    what follows SAFE: it says so as missed (``NOT_RECORDED``)."""
    rec = _two_threads_on_one_stream(fake, locked=False)
    assert not rec.complete()
    note = next(n for n in rec.summary().notes if "no host ordering" in n)
    assert "stream 'stream" in note and "record at" in note and "(worker)" in note
    assert int(note.rsplit(": ", 1)[1]) >= 1


def test_two_threads_on_one_stream_ordered_by_a_lock_leave_the_recording_complete(fake):
    rec = _two_threads_on_one_stream(fake, locked=True)
    assert rec.complete(), rec.summary().notes


# -- lifetimes -------------------------------------------------------------------------------------

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
    rec.copy(SIDE, "copy_", (gpu.index, 0, BLOCK), (host.index, 0, BLOCK), rec.locate())
    rec.host_copy_fenced(host.index, SIDE, rec.locate())
    rec.end_op()


def test_a_pinned_allocator_event_reused_for_another_block_fences_only_its_own_copy():
    """torch's pinned allocator takes its events from a pool: once block X's event completed, X is
    free and the same CUDA event is recorded again for a copy into block Y. X's reuse was written
    as a true query of the event's *name*, which (rule 3) reads its latest record: Y's copy, which
    the allocator never waited for. The host's read of Y, unsynchronized, was called SAFE."""
    rec = Recorder(Lines())
    x = rec.allocated(0x900000, BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    y = rec.allocated(0xA00000, BLOCK, "host_pinned", "output of aten.empty", rec.locate())
    g1 = rec.allocated(0x10000, BLOCK, "device", "t", rec.locate())
    g2 = rec.allocated(0x20000, BLOCK, "device", "t", rec.locate())
    d2h(rec, g1, x, event=H)
    d2h(rec, g2, y, event=H, created=False)  # the pool's event again: no creation callback
    new = rec.allocated(0x900000, BLOCK, "host_pinned", "output of aten.empty", rec.locate())  # X handed out again
    rec.host_access("host_write", [(new.index, 0, BLOCK)], "fill", rec.locate())
    rec.host_access("host_read", [(y.index, 0, BLOCK)], "consume", rec.locate())
    doc, found = verdict(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second].get("name")) for r in found] == \
        [("RAW", "copy", "consume")]


def test_a_record_stream_block_freed_while_an_op_runs_fences_only_work_issued_before_the_free():
    """The caching allocator records its ``record_stream`` event when the block is freed; a block
    freed while an op runs (its last reference dropped inside it, an ``out=`` resized) had that
    record held back until the op was logged, so the event captured the op's own copy too. The
    block's reuse then ordered the copy before the host: its unsynchronized read was called SAFE."""
    rec = Recorder(Lines())
    rec.allocated(0x10000, BLOCK, "device", "t", rec.locate())  # `old`
    gpu = rec.allocated(0x20000, BLOCK, "device", "t", rec.locate())
    host = rec.allocated(0x900000, BLOCK, "host_pageable", "t", rec.locate())
    rec.stream_used(0x10000, SIDE)
    rec.begin_op()  # host.copy_(gpu, non_blocking=True) on SIDE, during which `old` is freed
    rec.memory_freed(0x10000)
    rec.copy(SIDE, "copy_", (gpu.index, 0, BLOCK), (host.index, 0, BLOCK), rec.locate())
    rec.end_op()
    rec.memory_allocated(0x10000)
    rec.allocated(0x10000, BLOCK, "device", "t", rec.locate())  # the block's next owner
    rec.host_access("host_read", [(host.index, 0, BLOCK)], "consume", rec.locate())
    doc, found = verdict(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second].get("name")) for r in found] == \
        [("RAW", "copy", "consume")]


def test_foreach_copy_fences_each_pinned_block_only_with_its_own_copy(fake):
    """``torch._foreach_copy_`` runs one non-blocking copy per pair, and the pinned allocator records
    one event after each; the dispatcher sees them all held back at the end of the op, and fenced
    every pair's block with every event, the later pairs' included. The reuse of the first block
    then ordered the second pair's D2H before the host's read of its destination: called SAFE."""
    gpu1, gpu2 = fake.device(BLOCK), fake.device(BLOCK)
    first, second = fake.pinned(BLOCK), fake.pinned(BLOCK)
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
            recorder.allocated(first.data_ptr(), BLOCK, "host_pinned", "output of aten.empty", None)
        record.host_read(second)
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert ("RAW", "copy", "host_read") in kinds


# -- cuda-python and os bindings ---------------------------------------------------------------------


@pytest.fixture
def driver_calls(monkeypatch):
    driver = pytest.importorskip("cuda.bindings.driver")

    def ok(*args):
        return (driver.CUresult.CUDA_SUCCESS,)

    for name in ("cuMemMap", "cuMemUnmap", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuEventRecord",
                 "cuEventSynchronize"):
        monkeypatch.setattr(driver, name, ok)
    return driver


def test_an_unmap_of_several_mappings_at_once_frees_each_of_them(fake, driver_calls):
    """``cuMemUnmap`` of a range two ``cuMemMap`` calls mapped: the range lies in no one allocation,
    so its ``free`` went to a placeholder buffer of its own, which no device work touches: the copy
    still reading the first mapping was called SAFE against the unmap."""
    driver = driver_calls
    base = 0x7_0000_0000
    cpu = fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        driver.cuMemMap(base, BLOCK, 0, 1, 0)
        driver.cuMemMap(base + BLOCK, BLOCK, 0, 2, 0)
        with fake.use(fake.stream()):
            driver.cuMemcpyDtoHAsync(cpu.data_ptr(), base, BLOCK, fake.current.handle)  # in flight
        driver.cuMemUnmap(base, 2 * BLOCK)
    doc = rec.trace()
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races] == \
        [("FREE", "copy", "free")]


def test_a_host_pointer_given_as_a_one_element_array_is_its_address_not_its_value(fake, driver_calls):
    """cuda-python takes a host pointer (``srcHost``, ``dstHost``) from any buffer: a numpy array
    is its data's address. The recorder took ``int(array)``, the value of a one-element array, as
    the address: the copy read some unresolved bytes, and the host's write of the array raced with
    nothing."""
    driver = driver_calls
    gpu = fake.device(8)
    host = np.zeros(1, dtype=np.int64)  # one 8-byte slot
    host[0] = 0x1234
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        record.host_buffer(host, "pinned", name="slot")
        with fake.use(fake.stream()):
            driver.cuMemcpyHtoDAsync(gpu.data_ptr(), host, 8, fake.current.handle)
        host[0] = 7
        record.host_write(host)  # rewritten under the copy
    doc = rec.trace()
    copy = next(op for op in doc["ops"] if op["op"] == "copy")
    assert copy["src"][0] == "slot"
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races] == \
        [("WAR", "copy", "host_write")]


# -- state left behind -------------------------------------------------------------------------------


def test_a_programs_own_gc_freeze_survives_a_recording(fake):
    """Servers call ``gc.freeze()`` after start-up (objects kept out of every collection for good);
    the recording's ``gc.unfreeze()`` at its end put all of them back into the collector's passes."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with record.recording(platform=fake, skip=fake.skip()):
            torch.zeros(1)
        assert gc.get_freeze_count() > frozen // 2  # (frozen objects may still be deallocated meanwhile)
    finally:
        gc.unfreeze()


@pytest.mark.xfail(strict=True, reason="a thread started while recording keeps its recording dispatch mode "
                   "after the recording stopped, until the thread ends: every op of a long-lived worker still "
                   "goes through a Python __torch_dispatch__ and torch sees a dispatch mode on its stack "
                   "(torch.compile, FakeTensor and _get_current_dispatch_mode() behave differently); modes are "
                   "thread-local, so only the thread itself can pop it (e.g. at its next op once inactive)")
def test_a_thread_started_while_recording_has_no_dispatch_mode_after_the_recording_stopped(fake):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    stopped, seen = threading.Event(), []

    def worker():
        stopped.wait()
        torch.zeros(1).add_(1)
        seen.append(_get_current_dispatch_mode())

    with record.recording(platform=fake, skip=fake.skip()):
        t = threading.Thread(target=worker)
        t.start()
    stopped.set()
    t.join()
    assert seen == [None]


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
        buf = np.zeros(BLOCK, dtype=np.uint8)
        cudart.cudaHostRegister(buf.ctypes.data, BLOCK, 0)
        registered = rec.memory.find(buf.ctypes.data)
        gpu = rec.allocated(0x10000, BLOCK, "device", "t", rec.locate())
        rec.copy(SIDE, "copy_", (gpu.index, 0, BLOCK), (registered.index, 0, BLOCK), rec.locate())  # in flight
        cudart.cudaHostUnregister(buf.ctypes.data)
    finally:
        platform.uninstall()
    doc, found = verdict(rec)
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == [("FREE", "copy", "free")]


# -- queues ------------------------------------------------------------------------------------------


def _hand_off(fake, *, first_item_to_consumer: bool):
    """Two producers each write a pinned slot on the host and put its index in one queue; the
    consumer gets one item and copies that slot to the device. Through the queue's mutex the get
    came after both puts in this run, but only the put of the item it got orders the consumer."""
    import queue

    slots = [fake.pinned(BLOCK), fake.pinned(BLOCK)]
    gpu = fake.device(BLOCK)
    side = fake.stream()
    q = queue.Queue()
    put = []  # a flag no lock guards: it orders nothing, it only makes the puts happen in this order
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        def producer(k):
            record.host_write(slots[k])
            q.put(k)
            put.append(k)

        threads = [threading.Thread(target=producer, args=(k,), name=f"producer{k}") for k in (0, 1)]
        for k, t in enumerate(threads):
            t.start()
            while len(put) <= k:
                time.sleep(0.001)
        got = []

        def consumer():
            k = q.get()
            got.append(k)
            with fake.use(side):
                gpu.copy_(slots[1 - k if not first_item_to_consumer else k], non_blocking=True)

        c = threading.Thread(target=consumer, name="consumer")
        c.start()
        c.join()
        for t in threads:
            t.join()
    return rec, got


def test_a_queue_orders_a_get_only_after_the_put_of_its_item(fake):
    """The consumer copies the slot of the item it did *not* get: that producer's host write is
    ordered before the copy only by the queue's mutex (this run's timing), so it races."""
    rec, got = _hand_off(fake, first_item_to_consumer=False)
    assert got == [0]
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "host_write", "copy")]


def test_the_item_a_get_returns_orders_its_producer_before_the_consumer(fake):
    rec, got = _hand_off(fake, first_item_to_consumer=True)
    assert got == [0] and rec.check().verdict == "SAFE", rec.check().render()
