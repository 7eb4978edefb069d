"""The default streams on a CUDA device: ``cudaStreamPerThread`` (``torch.cuda.ExternalStream(2)``)
is one stream per host thread, so two threads working on it race where one thread is in stream
order; the legacy default stream (torch's default stream) synchronizes with a blocking stream
(cupy's default kind) and not with a non-blocking one (torch's own)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvverify.record import recording

pytestmark = pytest.mark.gpu

N = 1 << 20
HOLD_NS = 50_000_000


def race_pairs(rec) -> list[tuple[str, str, str]]:
    ops = rec.trace()["ops"]
    return [(r.kind, ops[r.first]["op"], ops[r.second]["op"]) for r in rec.check().races]


@pytest.mark.parametrize("threads", [2, 1])
def test_the_per_thread_default_stream_is_one_stream_per_thread(threads):
    a = torch.zeros(N, dtype=torch.uint8, device="cuda")
    host = torch.zeros(N, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()

    def store():
        with torch.cuda.stream(torch.cuda.ExternalStream(2)):
            host.copy_(a, non_blocking=True)

    with recording() as rec:
        with torch.cuda.stream(torch.cuda.ExternalStream(2)):
            torch.cuda._sleep(HOLD_NS)
            a.fill_(1)
        if threads == 2:
            t = threading.Thread(target=store, name="copier")
            t.start()
            t.join()
        else:
            store()
        torch.cuda.synchronize()
    if threads == 2:
        assert race_pairs(rec) == [("RAW", "kernel", "copy")], rec.report()
        assert {"per-thread default of copier"} <= set(rec.trace()["streams"]), rec.trace()["streams"]
    else:
        assert rec.check().safe and rec.complete(), rec.report()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_the_legacy_default_stream_waits_for_a_blocking_streams_work(blocking):
    cupy = pytest.importorskip("cupy")
    a = torch.zeros(N, dtype=torch.uint8, device="cuda")
    host = torch.zeros(N, dtype=torch.uint8, pin_memory=True)
    x = cupy.asarray(a)  # the same bytes (no copy)
    stream = cupy.cuda.Stream(non_blocking=not blocking)
    x += 1  # compiled and run once before the recording
    torch.cuda.synchronize()
    with recording() as rec:
        with stream:
            x += 1  # a cupy kernel on its stream, outside torch's dispatcher
        host.copy_(a, non_blocking=True)  # torch's default stream: the legacy default stream
        torch.cuda.synchronize()
    if blocking:
        assert rec.check().safe, rec.report()
    else:
        assert race_pairs(rec) == [("RAW", "kernel", "copy")], rec.report()
    # cupy launches with the GIL released: the kernel's line is read from the thread's frames all the same
    (kernel,) = [op for op in rec.trace()["ops"] if op["op"] == "kernel"]
    assert "test_default_streams_gpu.py:" in kernel.get("at", ""), kernel
