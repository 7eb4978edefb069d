"""Native capture's records as the recording writes them (``kvverify.record.capture.driver``), on the CPU
stand-in: the records a GPU's CUPTI callbacks put in the native log (``csrc/record/cupti_capture.cpp``)
are put in by the test, between the program's ops, as the C++ puts them on the calling thread.
Among them what orders what: a blocking ``cuMemcpy`` synchronizes the host only where CUDA says it
does; a stream forked into a graph capture runs at the graph's launch; a graph whose capture began
before the recording is work not known; a nested kernel declaration gives the outer one back; memory
the recording resolved as unknown is touched by the kernels given its address.
What the driver reports, and when, is under test on a GPU (``test_record_native_gpu.py``)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
from fake_cuda import race_kinds as kinds

import kvverify.record as record

BLOCK = 4096
KERNEL = 0xF00  # a CUfunction


def launcher():  # the user's line that launched a native kernel: its code object is the record's frame
    return None


FRAME = ((launcher.__code__, 17),)


@pytest.fixture(autouse=True)
def kernel_named(fake):
    """The stand-in (``fake``, tests/record/conftest.py) names the CUfunction ``KERNEL``
    ``copy_blocks_kernel``, as the driver names a kernel the native log reports."""
    fake.function_name = lambda function: "copy_blocks_kernel" if function == KERNEL else "?"


def test_a_native_kernel_that_writes_a_block_races_with_a_copy_on_another_stream(fake):
    """A Triton kernel writes block ``a`` on a side stream (its argument words hold a's address and
    a number); the default stream copies ``a`` to the host with no wait: RAW, the kernel's line
    taken from the record's frames."""
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("launch", side.handle, KERNEL, 2, a.data_ptr(), 12345, frames=FRAME)
        host.copy_(a, non_blocking=True)
    assert kinds(rec) == [("RAW", "kernel", "copy")]
    kernel = next(op for op in rec.trace()["ops"] if op["op"] == "kernel")
    assert kernel["name"] == "kernel copy_blocks_kernel"
    assert kernel["at"].endswith("test_record_native.py:17 in launcher")
    assert rec.complete()


def test_the_same_kernel_waited_for_is_safe(fake):
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("launch", side.handle, KERNEL, 1, a.data_ptr(), frames=FRAME)
        fake.default.wait_stream(side)
        host.copy_(a, non_blocking=True)
        fake.synchronize()
    assert rec.check().verdict == "SAFE" and rec.complete()


def test_a_kernel_given_a_pointer_table_touches_the_blocks_the_table_points_into(fake):
    """A load kernel gets a device table of block addresses, filled by a host copy the recording
    saw: the blocks it points into are the kernel's too (the engine's Triton load's shape)."""
    table, block, host = fake.device(2, dtype=torch.int64), fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        table.copy_(torch.tensor([block.data_ptr(), block.data_ptr() + 64], dtype=torch.int64))
        fake.native("launch", side.handle, KERNEL, 1, table.data_ptr(), frames=FRAME)
        host.copy_(block, non_blocking=True)
    assert ("RAW", "kernel", "copy") in kinds(rec)


def test_a_native_copy_into_pinned_memory_read_by_the_host_unsynchronized_races(fake):
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy", side.handle, host.data_ptr(), a.data_ptr(), BLOCK, 0, frames=FRAME)
        record.host_read(host)
    assert kinds(rec) == [("RAW", "copy", "host_read")]


def test_a_blocking_native_copy_is_waited_for_by_the_host(fake):
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy", 0, host.data_ptr(), a.data_ptr(), BLOCK, 1, frames=FRAME)
        record.host_read(host)
    assert rec.check().verdict == "SAFE"


def test_a_native_batched_copy_keeps_each_attribute_groups_order(fake):
    """cuMemcpyBatchAsync from a C++ extension: a ``copy_batch`` per attribute group, in the
    group's source access order."""
    src, dst = fake.device(2 * BLOCK), fake.pinned(2 * BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy_batch", side.handle, 2, 2,
                    dst.data_ptr(), src.data_ptr(), BLOCK, dst.data_ptr() + BLOCK, src.data_ptr() + BLOCK, BLOCK,
                    0x1, 0, 0x3, 1, frames=FRAME)
    batches = [op for op in rec.trace()["ops"] if op["op"] == "copy_batch"]
    assert [(b["order"], len(b["copies"])) for b in batches] == [("STREAM", 1), ("ANY", 1)]


def test_an_unmap_under_a_native_kernel_is_a_use_after_free(fake):
    """Sleep mode's shape (vllm-project/vllm#45268): memory mapped, a kernel on it in flight,
    unmapped with no wait."""
    side = fake.stream()
    base = 0x7F00_0000_0000
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("map", base, 1 << 20, frames=FRAME)
        fake.native("launch", side.handle, KERNEL, 1, base + 4096, frames=FRAME)
        fake.native("unmap", base, 1 << 20, frames=FRAME)
        record.host_read(fake.pinned(16))  # the next thing the thread logs takes the records
    assert ("FREE", "kernel", "free") in kinds(rec)


def test_what_the_trace_cannot_say_makes_the_recording_incomplete_by_name(fake):
    name = ctypes.create_string_buffer(b"cuMemcpy2DAsync_v2")
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("launch", side.handle, KERNEL, -1, frames=FRAME)
        fake.native("graph_launch", 0xABC, side.handle, frames=FRAME)
        fake.native("unmodelled", 289, ctypes.addressof(name), frames=FRAME)
        fake.synchronize()
    notes = "\n".join(rec.summary().notes)
    assert not rec.complete()
    assert "arguments could not be read" in notes and "copy_blocks_kernel" in notes
    assert "CUDA graphs captured before the recording" in notes and "test_record_native.py:17" in notes
    assert "cuMemcpy2DAsync_v2" in notes


def test_native_records_of_a_thread_the_recording_does_not_follow_are_missed_work(fake):
    a = fake.device(BLOCK)
    side = fake.stream()
    started = threading.Event()
    finish = threading.Event()

    def worker():  # running before the recording: not followed
        started.set()
        finish.wait()
        fake.native("launch", side.handle, KERNEL, 1, a.data_ptr())

    t = threading.Thread(target=worker, name="old-worker")
    t.start()
    started.wait()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        finish.set()
        t.join()
    assert not rec.complete()
    assert any("old-worker" in note or "ended" in note for note in rec.summary().notes)


def test_a_destroy_the_native_log_holds_comes_before_the_next_observed_record(fake):
    """The program drops an event (``cuEventDestroy``: native capture logs it) and records a new one
    that CUDA makes at the same handle (a method the recorder observes in Python). The destroy was
    taken from the log only after the record had its name, so it took the new event's name away:
    the synchronization that follows named an event never recorded, and a safe read was RACY."""
    gpu, host = fake.device(BLOCK), fake.pinned(BLOCK)
    compute = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        first = fake.event()
        first.record(compute)
        handle = first.handle
        with fake.use(compute):
            host.copy_(gpu, non_blocking=True)
        fake.native("event_destroy", handle)  # the old event dropped
        again = fake.event()
        again.handle = handle  # CUDA makes the new event at the freed handle
        fake.report("event_created", handle)
        again.record(compute)
        again.synchronize()
        record.host_read(host)
    assert rec.check().verdict == "SAFE", rec.check().render()


def test_the_log_parser_takes_over_each_frames_code_reference():
    """A record's frames hold references to code objects (taken by the C++ under the GIL); the
    parser hands them to Python and drops the record's own, or every recorded call would leak."""
    import sys

    from kvverify.record.capture.native import parse

    code = launcher.__code__
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(code))  # the record's reference, as the C++ takes it
    before = sys.getrefcount(code)
    kinds = {1: "alloc", 23: "event_query", 26: "device_sync"}
    # each record ends with its call's span (t0 0: not known)
    records = parse([1, 7, 0, 10, 20, 0, 0, 0, 99, 23, 5, 0, 7, 1, 50, 60, 26, 5, 1, id(code), 42, 70, 80], kinds)
    assert [(r.kind, r.fields, r.when) for r in records] == [("alloc", [10, 20, 0, 0], None),
                                                             ("event_query", [7, 1], (50, 60)),
                                                             ("device_sync", [], (70, 80))]
    assert records[2].frames == ((code, 42),)
    del records
    assert sys.getrefcount(code) == before - 1


def test_a_followed_threads_driver_calls_after_its_last_op_at_the_stop_are_missed_work(fake):
    """A worker started while recording launches a kernel and is still running (it logs nothing
    more) when the recording stops: its launch was never taken, and the recording says so; its
    frees after its last op change nothing and are not counted."""
    import time

    side = fake.stream()
    block = fake.device(BLOCK)
    launched, finish = [], []  # flags, not locks: a lock op would be logged, and take the records with it

    def worker():
        fake.native("launch", side.handle, KERNEL, 1, block.data_ptr())
        fake.native("free", 0x1234, 0, 0, 0)
        launched.append(True)
        while not finish:
            time.sleep(0.001)

    with record.recording(platform=fake, skip=fake.skip()) as rec:
        t = threading.Thread(target=worker, name="late")
        t.start()
        while not launched:
            time.sleep(0.001)
    finish.append(True)
    t.join()
    notes = [n for n in rec.summary().notes if "after the last op" in n]
    assert notes == ["NOT RECORDED (driver calls made after the last op the thread logged, as the recording "
                     "stopped), thread 'late': 1"]
    assert not rec.complete()


@pytest.mark.parametrize("keep_graph", [False, True], ids=["graph-destroyed", "graph-kept"])
def test_a_kernel_captured_in_a_graph_runs_at_each_launch_on_the_launch_stream(fake, keep_graph):
    """Stream capture: the fill issued to the capturing stream runs when the graph is launched,
    on the launch stream, not at capture: a read of the block before the launch is no race, a read
    after it with no wait is one (each launch's own). torch destroys the captured graph once it is
    instantiated: the executable graph keeps its work."""
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    capture, replay = fake.stream(), fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("capture_begin", capture.handle, frames=FRAME)
        with fake.use(capture):
            a.fill_(1)  # captured
        fake.native("capture_end", capture.handle, 0x6A, frames=FRAME)
        fake.native("graph_instantiate", 0xE7, 0x6A)
        if not keep_graph:
            fake.native("graph_destroy", 0x6A)  # torch.cuda.CUDAGraph.capture_end's own
        host.copy_(a, non_blocking=True)  # before any launch: the fill has not run
        fake.synchronize()
        for _ in range(2):
            fake.native("graph_launch", 0xE7, replay.handle, frames=FRAME)
            host.copy_(a, non_blocking=True)  # no wait for the replay
            fake.synchronize()
    doc = rec.trace()
    found = rec.check().races
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == [("RAW", "kernel", "copy")] * 2
    replays = [op for op in doc["ops"] if op["op"] == "kernel"]
    assert len(replays) == 2 and all(op["name"].startswith("graph replay (test_record_native.py:17)") for op in replays)
    assert all(op["stream"] == replays[0]["stream"] != "default" for op in replays)
    assert rec.complete(), rec.summary().notes


def test_a_declared_kernel_touches_what_it_declares_and_no_more(fake):
    """``kvverify.record.kernel`` declares a launcher's reads and writes: the copy kernel reads
    ``src`` and writes ``dst`` (its arguments point into both); an unsynchronized read of ``src``
    on another stream is then no race, a read of ``dst`` is one."""
    src, dst = fake.device(BLOCK), fake.device(BLOCK)
    out1, out2 = fake.pinned(BLOCK), fake.pinned(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with record.kernel(reads=[src], writes=[dst], name="copy src to dst"):
            fake.native("launch", side.handle, KERNEL, 2, src.data_ptr(), dst.data_ptr(), frames=FRAME)
        out1.copy_(src, non_blocking=True)
        out2.copy_(dst, non_blocking=True)
        fake.synchronize()
    doc = rec.trace()
    found = rec.check().races
    assert [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in found] == [("RAW", "kernel", "copy")]
    kernel = next(op for op in doc["ops"] if op["op"] == "kernel")
    assert kernel["name"] == "copy src to dst"


def test_a_declared_kernel_reaches_blocks_through_its_pointer_tables(fake):
    """A Triton load's tables of source and destination block addresses, declared in one line."""
    host_blocks, gpu_blocks = fake.pinned(4, BLOCK), fake.device(4, BLOCK)
    out = fake.pinned(BLOCK)
    src_table = torch.tensor([host_blocks[k].data_ptr() for k in (0, 2)], dtype=torch.int64)
    dst_table = torch.tensor([gpu_blocks[k].data_ptr() for k in (1, 3)], dtype=torch.int64)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with record.kernel(reads_through=(src_table, BLOCK), writes_through=(dst_table, BLOCK)):
            fake.native("launch", side.handle, KERNEL, 0, frames=FRAME)
        out.copy_(gpu_blocks[3], non_blocking=True)  # a block the load writes: a race
        out.copy_(gpu_blocks[0], non_blocking=True)  # a block it does not touch
        fake.synchronize()
    doc = rec.trace()
    kinds = [(r.kind, doc["ops"][r.first]["op"], doc["ops"][r.second]["op"]) for r in rec.check().races]
    assert kinds == [("RAW", "kernel", "copy")]
    logged = next(op for op in rec.recorder.ops if op["op"] == "kernel")  # (the trace drops untouched buffers)
    assert len(logged["reads"]) == 2 and len(logged["writes"]) == 2


def test_kernel_outside_a_recording_does_nothing():
    with record.kernel(reads=[(0x1000, 16)]):
        pass


def test_a_graph_made_at_the_handle_of_a_destroyed_captured_graph_is_not_replayed_as_it(fake):
    """A captured graph destroyed, and a graph built with the explicit graph API (not followed)
    given the same handle: its launch is missed work, not a replay of the old capture."""
    a = fake.device(BLOCK)
    capture, replay = fake.stream(), fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("capture_begin", capture.handle, frames=FRAME)
        with fake.use(capture):
            a.fill_(1)
        fake.native("capture_end", capture.handle, 0x6A, frames=FRAME)
        fake.native("graph_exec_destroy", 0xE7)
        fake.native("graph_destroy", 0x6A)
        fake.native("graph_instantiate", 0xE7, 0x6A)  # the explicit graph at the same handles
        fake.native("graph_launch", 0xE7, replay.handle, frames=FRAME)
        fake.synchronize()
    assert not rec.complete()
    assert not any((op.get("name") or "").startswith("graph replay") for op in rec.recorder.ops)


# -- what a blocking copy, a capture and a declaration order -----------------------------------


def test_a_kernel_on_a_stream_forked_into_a_capture_runs_at_the_graph_launch(fake):
    """Multi-stream capture (fork / join through events, as torch's graph-safe side streams do):
    ``side`` waits on an event recorded on the capturing stream, so it is captured too, and its
    kernel runs at each launch of the graph, not at capture. It was logged as run at capture
    (before a device synchronize), and the graph's replay missed it: an unsynchronized read after
    the launch was SAFE."""
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    capture, side, replay = fake.stream(), fake.stream(), fake.stream()
    fork, join = 0xE100, 0xE200
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("capture_begin", capture.handle, frames=FRAME)
        fake.native("event_create", fork)
        fake.native("event_create", join)
        fake.native("event_record", fork, capture.handle, frames=FRAME)
        fake.native("event_wait", side.handle, fork, frames=FRAME)
        fake.native("launch", side.handle, KERNEL, 1, a.data_ptr(), frames=FRAME)
        fake.native("event_record", join, side.handle, frames=FRAME)
        fake.native("event_wait", capture.handle, join, frames=FRAME)
        fake.native("capture_end", capture.handle, 0x6A, frames=FRAME)
        fake.native("graph_instantiate", 0xE7, 0x6A)
        fake.synchronize()
        fake.native("graph_launch", 0xE7, replay.handle, frames=FRAME)
        host.copy_(a, non_blocking=True)  # on the default stream, no wait for the replay
        fake.synchronize()
    assert kinds(rec) == [("RAW", "kernel", "copy")], rec.check().render()
    assert rec.complete(), rec.summary().notes


def test_a_capture_begun_before_the_recording_is_a_graph_whose_work_is_not_known(fake):
    """The capture began before the recording started (its begin was never seen) and ends while it
    runs: the recorder made the graph an empty one, and its launch replayed nothing with the
    recording called complete (the kernel captured before the start never ran in the trace)."""
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    capture, replay = fake.stream(), fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("capture_end", capture.handle, 0x6B, frames=FRAME)
        fake.native("graph_instantiate", 0xE8, 0x6B)
        fake.native("graph_launch", 0xE8, replay.handle, frames=FRAME)
        host.copy_(a, non_blocking=True)
        fake.synchronize()
    assert not rec.complete(), rec.summary().notes


def test_a_blocking_device_to_device_cumemcpy_does_not_synchronize_the_host(fake):
    """``cuMemcpy`` between two device buffers: CUDA's API synchronization behaviour says "for
    transfers from device memory to device memory, no host-side synchronization is performed".
    The recorder wrote every cuMemcpy as a sync of the legacy stream, so an earlier async copy
    into pinned memory read by the host after the cuMemcpy was SAFE."""
    a, b, c, host = fake.device(BLOCK), fake.device(BLOCK), fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy", 0, host.data_ptr(), a.data_ptr(), BLOCK, 0, frames=FRAME)  # cuMemcpyDtoHAsync
        fake.native("copy", 0, c.data_ptr(), b.data_ptr(), BLOCK, 1, frames=FRAME)  # cuMemcpy D2D
        record.host_read(host)
    assert kinds(rec) == [("RAW", "copy", "host_read")], rec.check().render()


def test_a_blocking_device_to_host_cumemcpy_still_synchronizes(fake):
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy", 0, host.data_ptr(), a.data_ptr(), BLOCK, 1, frames=FRAME)
        record.host_read(host)
    assert rec.check().verdict == "SAFE"


def test_a_nested_kernel_declaration_gives_the_outer_one_back_at_its_end(fake):
    """``kernel(...)`` inside ``kernel(...)``: the inner block's end dropped the thread's
    declaration altogether, so a launch after it in the outer block (a table-driven kernel whose
    arguments point at nothing the recording knows) touched nothing: its race was SAFE."""
    gpu_blocks, out = fake.device(2, BLOCK), fake.pinned(BLOCK)
    dst_table = torch.tensor([gpu_blocks[1].data_ptr()], dtype=torch.int64)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with record.kernel(writes_through=(dst_table, BLOCK)):
            with record.kernel(reads=[gpu_blocks[0]]):
                pass
            fake.native("launch", side.handle, KERNEL, 0, frames=FRAME)
        out.copy_(gpu_blocks[1], non_blocking=True)
        fake.synchronize()
    assert ("RAW", "kernel", "copy") in kinds(rec), rec.check().render()


def test_a_kernel_given_an_address_the_recording_resolved_as_unknown_touches_it(fake):
    """Memory the recording does not know (``cudaMalloc`` of an extension's own) is a placeholder
    buffer (``unresolved 0x...``) where a copy writes it; a kernel on another stream whose argument
    points into it with no wait touched nothing (placeholders were skipped): SAFE, complete."""
    a = fake.device(BLOCK)
    unknown = 0x7E00_0000_0000
    copier, reader = fake.stream(), fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        fake.native("copy", copier.handle, unknown, a.data_ptr(), BLOCK, 0, frames=FRAME)
        fake.native("launch", reader.handle, KERNEL, 1, unknown + 64, frames=FRAME)
        fake.synchronize()
    assert ("RAW", "copy", "kernel") in kinds(rec) or not rec.complete(), rec.check().render()


def test_a_blocking_pageable_to_device_cumemcpy_waits_for_the_earlier_work_not_the_copy(fake):
    """``cuMemcpy`` from pageable memory to the device: a stream sync before the copy, which returns
    once the source is staged, with the DMA maybe still in flight. A kernel on a non-blocking stream
    reading the destination after it, with no wait, races with the copy."""
    a, host = fake.device(BLOCK), fake.pageable(BLOCK)
    side = fake.stream()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        record.host_write(host)
        fake.native("copy", 0, a.data_ptr(), host.data_ptr(), BLOCK, 1, frames=FRAME)
        fake.native("launch", side.handle, KERNEL, 1, a.data_ptr(), frames=FRAME)
        fake.synchronize()
    assert ("RAW", "copy", "kernel") in kinds(rec), rec.check().render()
