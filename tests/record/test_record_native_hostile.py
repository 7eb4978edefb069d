"""Hostile cases for native capture (``kvverify.record.capture.driver`` / ``recorder``) on the CPU
stand-in: each is a false SAFE (or a recording called complete that is not) found by review."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda
from fake_cuda import race_kinds as kinds

import kvverify.record as record

BLOCK = 4096
KERNEL = 0xF00


def launcher():
    return None


FRAME = ((launcher.__code__, 17),)


@pytest.fixture
def fake():
    fake = FakeCuda()
    fake.function_name = lambda function: "k" if function == KERNEL else "?"
    return fake


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
