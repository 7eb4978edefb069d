"""The default streams as CUDA defines them ("Default stream", "Stream synchronization behavior"),
recorded on the CPU stand-in: ``cudaStreamPerThread`` is one stream per host thread (two threads
on it are two streams); the legacy default stream (handle 0, ``CU_STREAM_LEGACY``) is one stream
per device, and synchronizes implicitly with the blocking streams of its device, in both directions,
never with non-blocking ones (torch's own streams)."""

from __future__ import annotations

import threading

import pytest
from fake_cuda import FakeCuda, FakeStream

import kvverify.record as record
from kvverify.record.trace.recorder import CU_STREAM_LEGACY, IMPLICIT, LEGACY_STREAM, PER_THREAD_STREAM

BLOCK = 4096


class Blocking(FakeCuda):
    """The stand-in, with the driver's answer on whether a stream is blocking (a cupy stream is; a
    torch stream is not): what ``CudaPlatform`` asks cuStreamGetFlags."""

    def __init__(self, blocking: set[int]) -> None:
        super().__init__()
        self.blocking = blocking

    def install(self, recorder, guard, native=True):
        super().install(recorder, guard, native)
        recorder.stream_info = lambda handle: (handle in self.blocking, 0)


def race_lines(rec) -> list[tuple[str, str]]:
    ops = rec.trace()["ops"]
    return [(ops[r.first]["op"], ops[r.second]["op"]) for r in rec.check().races]


def test_two_threads_on_the_per_thread_default_stream_are_two_streams():
    fake = FakeCuda()
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    fake.current = FakeStream(fake, PER_THREAD_STREAM)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        a.fill_(1)  # the main thread's per-thread stream

        def store():  # another thread's per-thread stream: nothing orders it after the fill
            host.copy_(a, non_blocking=True)

        t = threading.Thread(target=store, name="copier")
        t.start()
        t.join()
    assert race_lines(rec) == [("kernel", "copy")]
    streams = rec.trace()["streams"]
    assert streams == ["per-thread default of MainThread", "per-thread default of copier"], streams


def test_one_thread_on_the_per_thread_default_stream_is_in_stream_order():
    fake = FakeCuda()
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    fake.current = FakeStream(fake, PER_THREAD_STREAM)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        a.fill_(1)
        host.copy_(a, non_blocking=True)
        fake.current.synchronize()
        host.sum()
    assert rec.check().safe and rec.complete()


@pytest.mark.parametrize("handle", [LEGACY_STREAM, CU_STREAM_LEGACY])
def test_both_handles_of_the_legacy_stream_are_one_stream(handle):
    fake = FakeCuda()
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        a.fill_(1)  # on handle 0
        with fake.use(FakeStream(fake, handle)):
            host.copy_(a, non_blocking=True)
    assert rec.check().safe
    assert rec.trace()["streams"] == ["default"]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_the_legacy_stream_waits_for_a_blocking_streams_earlier_work(blocking):
    side_handle = 0x9100
    fake = Blocking({side_handle} if blocking else set())
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = FakeStream(fake, side_handle)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with fake.use(side):
            a.fill_(1)  # a blocking stream's kernel
        host.copy_(a, non_blocking=True)  # on the legacy stream: after it, if the side stream blocks
    if blocking:
        assert rec.check().safe
        implied = [op for op in rec.trace()["ops"] if op.get("name") == IMPLICIT]
        assert [op["op"] for op in implied] == ["record", "wait_event"]
    else:
        assert race_lines(rec) == [("kernel", "copy")]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_a_blocking_stream_waits_for_the_legacy_streams_earlier_work(blocking):
    side_handle = 0x9200
    fake = Blocking({side_handle} if blocking else set())
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    side = FakeStream(fake, side_handle)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        a.fill_(1)  # the legacy stream
        with fake.use(side):
            host.copy_(a, non_blocking=True)
    assert rec.check().safe == blocking


def test_the_per_thread_stream_synchronizes_with_the_legacy_stream():
    """"The per-thread default stream is not a non-blocking stream and will synchronize with the
    legacy default stream if both are used in a program" (CUDA Runtime API, stream sync behavior)."""
    fake = FakeCuda()
    a, host = fake.device(BLOCK), fake.pinned(BLOCK)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        a.fill_(1)
        with fake.use(FakeStream(fake, PER_THREAD_STREAM)):
            host.copy_(a, non_blocking=True)
    assert rec.check().safe


def test_implicit_synchronization_is_written_once_per_new_work():
    side_handle = 0x9300
    fake = Blocking({side_handle})
    a, b = fake.device(BLOCK), fake.device(BLOCK)
    side = FakeStream(fake, side_handle)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        with fake.use(side):
            a.fill_(1)
        b.fill_(2)  # legacy: waits for side's fill
        b.fill_(3)  # legacy again: nothing new on side
    assert sum(op.get("name") == IMPLICIT for op in rec.trace()["ops"]) == 2
