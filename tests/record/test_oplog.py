"""The op log (``kvverify.record.capture.oplog``, ``csrc/op_log.cpp``) against the dispatch mode it
stands in for: the same program, recorded both ways on the host, must give the same trace.

No GPU: a CPU arena stands for device memory (as ``benchmarks/bench_record.py --host-only`` does), the
extension's real native log and op observer run on CPU tensors, and the event reports go through
the recorder's guard as the observed methods send them (deferred into the op log as marks).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvverify.record import recording  # noqa: E402
from kvverify.record.capture.dispatch import Platform  # noqa: E402
from kvverify.record.capture.oplog import decode  # noqa: E402
from kvverify.record.trace.recorder import Recorder  # noqa: E402


def _native_log():
    from kvverify.device import extension

    if extension.load_error() is not None:
        pytest.skip(f"kvverify._C is not built here: {extension.load_error()}")
    from kvverify.record.capture.native import NativeLog

    return NativeLog()


STREAM = 0x5000


class ArenaAsDevice(Platform):
    """CPU tensors in ``arena`` are device memory, those whose storage is in ``pinned`` pinned host
    memory; one stream; the extension's native log (and op log) in earnest. Its device work runs at
    its call: no host byte is pending, so no host watch is needed."""

    watch_off = None

    def __init__(self, arena: torch.Tensor, pinned: list[torch.Tensor]) -> None:
        self.lo, self.hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        self.pinned = {t.untyped_storage().data_ptr() for t in pinned}
        self.log = _native_log()
        self.guard = None
        self.recorder = None

    def where(self, t):
        return "device" if self.lo <= t.untyped_storage().data_ptr() < self.hi else "host"

    def stream_key(self, t):
        return STREAM

    def logged_stream_key(self, stream):
        assert stream is None  # CPU tensors: the op log writes no stream down
        return STREAM

    def is_pinned(self, t):
        return t.untyped_storage().data_ptr() in self.pinned

    def read_values(self, t):
        return t.detach().contiguous().view(-1).numpy().copy()

    def allocator_blocks(self):
        return [(self.lo, self.hi - self.lo)]

    def install(self, recorder, guard, native=True):
        self.capture_off = "a stand-in without a GPU"
        self.recorder, self.guard = recorder, guard
        self.log.enable(True)
        recorder.pending, recorder.take = self.log.pending, self.log.take

    def uninstall(self):
        self.log.enable(False)
        self.recorder = self.guard = None

    def native_leftover(self):
        return self.log.leftover()

    def op_log(self):
        return self.log.op_log()

    def report(self, what: str, *args) -> None:
        if self.guard is not None:
            self.guard(getattr(self.recorder, what))(*args)


@pytest.fixture(scope="module")
def swap_op():
    lib = torch.library.Library("kvoplog", "DEF")
    lib.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order=1) -> ()")
    lib.impl("swap_blocks_batch", lambda *args: None, "CompositeExplicitAutograd")
    yield torch.ops.kvoplog.swap_blocks_batch
    del lib


def _program(swap, platform: ArenaAsDevice, arena, host, descriptor) -> None:
    """An engine step three times over: views and in-place ops, an out= reduction, a strided
    view, a host-to-device copy of block ids, a batched swap of raw pointers (CPU tables), a
    composite op (torch decomposes it above a dispatch mode), events, a fresh output."""
    block = 256
    layers = [arena[k * 1024:(k + 1) * 1024].view(64, 16) for k in range(4)]
    scores = arena[-64:].view(torch.int64)
    ids = arena[-128:-64].view(torch.int64)
    offsets = torch.arange(4, dtype=torch.int64) * block
    gpu_ptrs = (torch.tensor([t.data_ptr() for t in layers])[:, None] + offsets).reshape(-1)
    host_ptrs = (torch.tensor([host.data_ptr() + k * 1024 for k in range(4)])[:, None] + offsets).reshape(-1)
    for step in range(3):
        for layer in layers:
            layer[0:8].fill_(step)
        torch.sum(layers[0][0:8], dim=(0, 1), dtype=torch.int64, out=scores[0])
        descriptor.copy_(torch.as_tensor([step, step + 1], dtype=torch.int64))
        ids[0:2].copy_(descriptor, non_blocking=True)
        platform.report("event_created", 0x700 + step)
        platform.report("event_recorded", 0x700 + step, STREAM)
        swap(gpu_ptrs, host_ptrs, torch.full((16,), block, dtype=torch.int64), 1)
        platform.report("event_queried", 0x700 + step, step % 2 == 0)
        layers[1][:, 0:4].zero_()
        layers[2].reshape(-1).add_(1)  # reshape: composite, a view here
        fresh = layers[3].clone()
        fresh.add_(1)


def _record(swap, op_log: bool):
    arena = torch.zeros(8 << 10, dtype=torch.uint8)
    host = torch.zeros(4096, dtype=torch.uint8)
    descriptor = torch.zeros(2, dtype=torch.int64)
    platform = ArenaAsDevice(arena, [host, descriptor])
    with recording(platform=platform, op_log=op_log) as rec:
        _program(swap, platform, arena, host, descriptor)
    return rec, platform


def _comparable(rec) -> str:
    # the arena and the host tensors lie elsewhere in each run: buffers are compared by their number,
    # counted in the order the trace names them (host tensors the program makes land where it freed
    # others in one run and not in the other, as the recorder's own allocations between ops differ:
    # the recording then counts one allocation more or less before a buffer)
    text = re.sub(r"0x[0-9a-f]+", "0x?", json.dumps(rec.trace(), sort_keys=True))
    numbers: dict[str, dict[str, int]] = {}

    def number(m: re.Match) -> str:
        kind = numbers.setdefault(m[1], {})
        return f"{m[1]}#{kind.setdefault(m[2], len(kind))}{m[3]}"

    return re.sub(r"\b([a-z]+)(\d+)( @0x\?| \()", number, text)


def test_the_op_log_gives_the_trace_the_dispatch_mode_gives(swap_op):
    live, _ = _record(swap_op, op_log=False)
    logged, _ = _record(swap_op, op_log=True)
    assert _comparable(logged) == _comparable(live)
    assert logged.summary().notes == live.summary().notes
    ops = Counter(op["op"] for op in live.trace()["ops"])
    # what the comparison covers: kernels, the copy, the swap, the events, the host accesses
    assert ops["copy_batch"] == 3 and ops["copy"] == 3 and ops["record"] == 3 and ops["query_event"] >= 1
    assert all(op.get("at", "").startswith("tests/record/test_oplog.py:") for op in live.trace()["ops"]
               if op["op"] in ("kernel", "copy", "copy_batch"))


def dispatch_calls(monkeypatch) -> list[str]:
    """The names of the ops the recorder's dispatch mode is handed from now on, in order (the spy is
    then the innermost frame outside kvverify where the mode locates an op)."""
    from kvverify.record.capture.dispatch import RecordingMode

    calls = []
    original = RecordingMode.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        calls.append(str(func))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(RecordingMode, "__torch_dispatch__", spy)
    return calls


def test_the_op_log_was_what_recorded_the_ops(swap_op, monkeypatch):
    # the dispatch mode must not have seen the ops of the logged run: its handler is never called live
    live_calls = dispatch_calls(monkeypatch)
    logged, _ = _record(swap_op, op_log=True)
    assert live_calls == []
    assert any(op["op"] == "copy_batch" for op in logged.trace()["ops"])


def test_a_thread_started_while_logging_hands_the_ops_to_the_dispatch_mode(swap_op):
    arena = torch.zeros(8 << 10, dtype=torch.uint8)
    host = torch.zeros(4096, dtype=torch.uint8)
    platform = ArenaAsDevice(arena, [host])
    with recording(platform=platform, keep_all=True) as rec:
        arena[0:64].fill_(1)  # logged
        worker = threading.Thread(target=lambda: arena[64:128].fill_(2), name="worker")
        worker.start()
        worker.join()
        arena[0:64].fill_(3)  # the dispatch mode's from the thread's start on
    kernels = [op for op in rec.trace()["ops"] if op["op"] == "kernel"]
    assert [op.get("thread") for op in kernels] == [None, "worker", None]
    names = [op["op"] for op in rec.trace()["ops"]]
    # the logged fill comes before the thread's start, which orders the worker's fill after it
    assert names.index("kernel") < names.index("release")


def test_an_op_that_raises_is_not_logged_and_what_follows_is(swap_op):
    arena = torch.zeros(8 << 10, dtype=torch.uint8)
    platform = ArenaAsDevice(arena, [])
    with recording(platform=platform, keep_all=True) as rec:
        with pytest.raises(RuntimeError):
            arena[0:64].view(8, 8).copy_(torch.zeros(3, 3, dtype=torch.uint8))  # shapes that do not broadcast
        arena[0:64].fill_(1)
    kernels = [op for op in rec.trace()["ops"] if op["op"] == "kernel"]
    assert len(kernels) == 1 and kernels[0]["name"].startswith("aten.fill_")
    assert rec.complete()


def test_decode_reads_every_tag():
    tensor = [1, 0, -1, 4, 5, 1000, 16, 1000, 16, 2, 3, 0, 2, 7, 9]
    fields = [7, 0, 0xabc,
              7, *tensor, 2, -5, 3, 1, 4, np.float64(0.5).view(np.int64).item(), 5, 2, *tensor, *tensor, 0, 6, 0x99, 1,
              1, 7]
    op, stream, inputs, outputs = decode(fields)
    assert op == 7 and stream == (0xabc, 0)
    t, n, flag, x, (a, b), none, s = inputs
    assert (t.data_ptr(), t.span, t.untyped_storage().data_ptr(), t.numel(), t._version) == (1000, (1000, 16), 1000, 2, 3)
    assert t.is_contiguous() and not t.pinned and t.dtype == torch.int64 and t.is_cpu and t.stream is None
    assert t.values.tolist() == [7, 9]
    assert (n, flag, x) == (-5, True, 0.5) and a.values.tolist() == b.values.tolist() == [7, 9]
    assert none is None and s.key == (0x99, 1)
    from kvverify.record.capture.oplog import NotLogged

    assert len(outputs) == 1 and isinstance(outputs[0], NotLogged)


def test_a_stream_the_op_log_did_not_write_down_is_not_made_up():
    from kvverify.record.capture.oplog import NotLogged

    with pytest.raises(NotLogged):
        Platform().logged_stream_key(None)
    assert Platform().logged_stream_key((0x1234, 0)) == Recorder.stream_key(0x1234, 0)


def test_an_op_without_tensor_arguments_is_logged_not_looked_into(swap_op):
    # kvverify::host_register(int ptr, int nbytes) has one kernel, CompositeImplicitAutograd, and no
    # tensor to dispatch on an Autograd key: torch decomposes nothing, a dispatch mode sees the op itself
    from kvverify.record.capture.dispatch import RecordingMode
    from kvverify.record.capture.oplog import LOG, TRANSPARENT

    lib = torch.library.Library("kvoplog2", "DEF")
    lib.define("remember(int ptr, int nbytes) -> ()")
    lib.impl("remember", lambda ptr, nbytes: None, "CompositeImplicitAutograd")
    mode = RecordingMode(Recorder(lambda depth=1: None), Platform(), (), internal=None)
    assert mode.log_class(torch.ops.kvoplog2.remember.default, -1)[0] == LOG
    # with a tensor argument, a composite-only op is decomposed above the mode: looked into
    assert mode.log_class(torch.ops.aten.reshape.default, 0)[0] == TRANSPARENT
    del lib
