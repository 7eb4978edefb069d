"""A recorder must never change what the program does: a battery of torch's stream, event, allocator
and copy APIs runs plainly and recorded, and every result, type and exception must be the same.

A serving engine's offload handler crashed under an earlier recorder, which replaced ``torch.Event``
with a subclass: torch's C++ checks the exact type in ``elapsed_time``. Values that depend on
timing (an elapsed time, a query before synchronizing) are compared by type and sign only."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from kvverify.record import recording

pytestmark = pytest.mark.gpu


def outcome(fn):
    """What calling ``fn`` gave: ``("ok", value)`` or ``("raise", type name, message)``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # the battery compares exceptions, whatever they are
        return ("raise", type(exc).__name__, str(exc))


def timed(value: float) -> tuple:
    return ("float", value > 0) if isinstance(value, float) else ("not a float", type(value).__name__)


def battery() -> list[tuple[str, object]]:
    results = []

    def check(label, fn):
        results.append((label, outcome(fn)))

    torch.cuda.synchronize()
    # torch.Event, as an engine's handler pools them
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    check("torch.Event type", lambda: (type(start) is torch.Event, isinstance(start, torch.Event), type(start).__name__))
    check("torch.Event query before sync is a bool", lambda: type(end.query()).__name__)
    end.synchronize()
    check("torch.Event query after sync", end.query)
    check("torch.Event elapsed_time", lambda: timed(start.elapsed_time(end)))
    check("torch.Event elapsed_time of a torch.cuda.Event", lambda: start.elapsed_time(torch.cuda.Event()))
    check("torch.Event elapsed_time of an object", lambda: start.elapsed_time(object()))
    check("torch.Event unrecorded query", lambda: torch.Event(device="cuda").query())
    check("torch.Event pickle", lambda: type(pickle.loads(pickle.dumps(torch.Event(device="cuda")))).__name__)
    check("torch.Event method names", lambda: (torch.Event.query.__name__, torch.Event.__name__, torch.Event.__module__))
    check("torch.Event repr", lambda: repr(torch.Event(device="cuda")).split(",")[0])
    # torch.cuda.Event
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(1_000_000)
    b.record()
    b.synchronize()
    check("cuda.Event type", lambda: (type(a) is torch.cuda.Event, isinstance(a, torch.Event)))
    check("cuda.Event elapsed_time", lambda: timed(a.elapsed_time(b)))
    check("cuda.Event query", b.query)
    check("cuda.Event ipc_handle", lambda: type(torch.cuda.Event(interprocess=True).ipc_handle()).__name__)
    check("cuda.Event ipc_handle without interprocess", lambda: torch.cuda.Event().ipc_handle())
    check("cuda.Event pickle", lambda: pickle.dumps(torch.cuda.Event()))
    # streams
    side = torch.cuda.Stream(priority=-1)
    check("stream priority", lambda: side.priority)
    check("stream type", lambda: (type(side) is torch.cuda.Stream, type(torch.cuda.current_stream()).__name__))
    with torch.cuda.stream(side):
        check("current stream inside", lambda: torch.cuda.current_stream() == side)
        side.wait_stream(torch.cuda.default_stream())
        torch.cuda._sleep(100_000)
    side.synchronize()
    check("stream query after sync", side.query)
    check("stream wait_event of None", lambda: side.wait_event(None))
    check("generic stream", lambda: type(torch.Stream(device="cuda")).__name__)
    # allocator: the recording must keep no tensor alive, or blocks would not be reused as they are
    before = torch.cuda.memory_allocated()
    x = torch.empty(1 << 20, device="cuda")
    check("memory_allocated grows by the block", lambda: torch.cuda.memory_allocated() - before)
    address = x.data_ptr()
    with torch.cuda.stream(side):
        y = x * 2
    x.record_stream(side)
    del x, y
    side.synchronize()
    z = torch.empty(1 << 20, device="cuda")
    check("the freed block is handed out again", lambda: z.data_ptr() == address)
    check("memory_allocated after", lambda: torch.cuda.memory_allocated() - before)
    check("record_stream of a CPU tensor", lambda: torch.empty(1).record_stream(side))
    # copies
    kept = torch.empty(1, device="cuda")
    pinned = torch.arange(4096, dtype=torch.float32).pin_memory()
    on_gpu = pinned.to("cuda", non_blocking=True)
    back = on_gpu.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    check("round trip", lambda: (torch.equal(back, pinned), back.is_pinned(), back.dtype, on_gpu.device.type))
    check("copy_ of a wrong size into a kept tensor", lambda: kept.copy_(torch.empty(2)))
    check("copy_ from a thread", lambda: _from_thread(lambda: torch.ones(8, device="cuda").sum().item()))
    check("synchronize returns", torch.cuda.synchronize)
    return results


def _from_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(outcome(fn)))
    worker.start()
    worker.join()
    return out[0]


def test_the_battery_gives_the_same_results_and_exceptions_recorded_as_plainly():
    plain = battery()
    with recording() as rec:
        recorded = battery()
    again = battery()  # after the recording too
    assert [label for label, _ in plain] == [label for label, _ in recorded]
    for (label, want), (_, got), (_, after) in zip(plain, recorded, again):
        assert got == want, label
        assert after == want, label
    assert ("ok", (True, True, "Event")) == dict(recorded)["torch.Event type"]
    assert rec.trace()["ops"], "the recording saw the battery's work"
    assert rec.complete(), rec.summary().lines()  # the battery's worker thread is followed
    assert any(op.get("thread") for op in rec.recorder.ops if op["op"] == "kernel")


def test_an_op_that_raises_while_its_cuda_temporary_is_freed_keeps_its_exception():
    """torch's GPU-trace hooks (which PyTorch's CUDA Stream Sanitizer and an earlier recorder
    activate, for good) call Python from C++ at each deallocation; a CUDA temporary freed while an
    op's exception unwinds made the program see SystemError instead of its RuntimeError."""

    def raising():
        return outcome(lambda: torch.empty(1, device="cuda").copy_(torch.empty(2)))

    plain = raising()
    with recording():
        recorded = raising()
    after = raising()
    assert plain[:2] == ("raise", "RuntimeError")
    assert recorded == plain == after
