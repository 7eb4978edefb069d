"""The op log (``kvverify.record.capture.oplog``, ``csrc/record/op_log.cpp``) against the dispatch mode it
stands in for: the same program, recorded both ways on the host, must give the same trace, or the op
log must name what it did not see (a NOT RECORDED note); never silently less device work, never a
crash. Programs that test it: several copies from one handler, a sparse tensor, a finalizer running
an op inside the observer, a backward pass, a dispatch mode of the program's own, another thread's
records left in the native log.

No GPU: a CPU arena stands for device memory (as ``benchmarks/bench_record.py --host-only`` does), the
extension's real native log and op observer run on CPU tensors, and the event reports go through
the recorder's guard as the observed methods send them (deferred into the op log as marks).
"""

from __future__ import annotations

import ctypes
import difflib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvverify.record import recording  # noqa: E402
from kvverify.record.capture.dispatch import RecordingPlatform  # noqa: E402
from kvverify.record.capture.oplog import decode  # noqa: E402
from kvverify.record.trace.recorder import Recorder  # noqa: E402


def _native_log():
    from kvverify.device import extension

    if extension.load_error() is not None:
        pytest.skip(f"kvverify._C is not built here: {extension.load_error()}")
    from kvverify.record.capture.native import NativeLog

    return NativeLog()


STREAM = 0x5000


class ArenaAsDevice(RecordingPlatform):
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


def test_ops_that_raised_in_one_recording_leave_the_next_recording_whole(swap_op):
    # an op that raises unwinds through the observer's end callback: the op log's depth and open
    # calls on this thread must be as before it, or every later op of the recording is taken for
    # one inside it and not logged; the next recording starts from a clean thread state
    lib = torch.library.Library("kvoplograise", "DEF")
    lib.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int src_access_order=1) -> ()")

    def refuse(*args):
        raise ValueError("a host page the swap cannot reach")

    lib.impl("swap_blocks_batch", refuse, "CompositeExplicitAutograd")
    arena = torch.zeros(8 << 10, dtype=torch.uint8)
    with recording(platform=ArenaAsDevice(arena, []), op_log=True, keep_all=True) as failing:
        for fails in (lambda: arena.view(64, 128).index_select(0, torch.tensor([1000])),  # a C++ kernel's
                      lambda: arena[0:64].view(8, 8).add_(arena[0:9]),
                      lambda: torch.ops.kvoplograise.swap_blocks_batch(*(torch.zeros(1, dtype=torch.int64),) * 3)):
            with pytest.raises((IndexError, RuntimeError, ValueError)):
                fails()
            arena[0:64].fill_(1)
    del lib
    fills = [op for op in failing.trace()["ops"] if op["op"] == "kernel" and op["name"].startswith("aten.fill_")]
    assert len(fills) == 3
    clean, _ = _record(swap_op, op_log=True)
    ops = Counter(op["op"] for op in clean.trace()["ops"])
    assert ops["copy_batch"] == 3 and ops["copy"] == 3 and ops["kernel"] >= 3
    assert clean.complete()


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
        RecordingPlatform().logged_stream_key(None)
    assert RecordingPlatform().logged_stream_key((0x1234, 0)) == Recorder.stream_key(0x1234, 0)


def test_an_op_without_tensor_arguments_is_logged_not_looked_into(swap_op):
    # kvverify::host_register(int ptr, int nbytes) has one kernel, CompositeImplicitAutograd, and no
    # tensor to dispatch on an Autograd key: torch decomposes nothing, a dispatch mode sees the op itself
    from kvverify.record.capture.dispatch import RecordingMode
    from kvverify.record.capture.oplog import LOG, TRANSPARENT

    lib = torch.library.Library("kvoplog2", "DEF")
    lib.define("remember(int ptr, int nbytes) -> ()")
    lib.impl("remember", lambda ptr, nbytes: None, "CompositeImplicitAutograd")
    mode = RecordingMode(Recorder(lambda depth=1: None), RecordingPlatform(), (), internal=None)
    assert mode.log_class(torch.ops.kvoplog2.remember.default, -1)[0] == LOG
    # with a tensor argument, a composite-only op is decomposed above the mode: looked into
    assert mode.log_class(torch.ops.aten.reshape.default, 0)[0] == TRANSPARENT
    del lib


# -- programs the op log must see as the dispatch mode does, or say it did not -----------------


def _dev(arena: torch.Tensor, offset: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """``n`` elements of ``dtype`` at byte ``offset`` of the arena (device memory)."""
    return arena[offset:offset + n * dtype.itemsize].view(dtype)


def _run(program, op_log: bool, pinned=()):
    arena = torch.zeros(64 << 10, dtype=torch.uint8)
    host = torch.zeros(4096, dtype=torch.uint8)
    platform = ArenaAsDevice(arena, [host, *pinned])
    with recording(platform=platform, op_log=op_log, keep_all=True) as rec:
        program(arena, host, platform)
    return rec


def _both(program):
    return _run(program, op_log=False), _run(program, op_log=True)


def _kernels(rec) -> Counter:
    return Counter(op.get("name") for op in rec.trace()["ops"] if op["op"] in ("kernel", "copy", "copy_batch"))


def _assert_same(live, logged) -> None:
    a, b = _comparable(live), _comparable(logged)
    if a != b:
        lines = [json.dumps(json.loads(t), indent=0, sort_keys=True).splitlines() for t in (a, b)]
        raise AssertionError("the op log's trace is not the dispatch mode's:\n" + "\n".join(
            difflib.unified_diff(*lines, "live", "logged", n=6, lineterm="")))
    assert logged.summary().notes == live.summary().notes


def _redirect(z: torch.Tensor):
    """A dispatch mode of the program's own that runs ``z.mul_(2)`` in place of every ``add_``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Redirect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add_.Tensor:
                return torch.ops.aten.mul_.Tensor(z, 2)
            return func(*args, **(kwargs or {}))

    return Redirect()


def _host_blind(rec) -> list:
    """The trace's ops with every host buffer named "host": for programs that make host tensors as they
    go, which land where freed ones were in one run and not in the other."""
    text = re.sub(r'"(pageable|pinned|registered)#?\d+[^"]*"', '"host"', _comparable(rec))
    return json.loads(text)["ops"]


def _same_or_named(live, logged) -> None:
    """The invariant: the same trace and notes, or the op log says what it did not record."""
    if _comparable(logged) == _comparable(live) and logged.summary().notes == live.summary().notes:
        return
    assert not logged.complete(), ("the op log's trace differs from the dispatch mode's and no NOT RECORDED note "
                                   f"says so: live {_kernels(live)}, logged {_kernels(logged)}")


def test_a_handler_that_reports_several_copies_logs_them_as_live():
    # _foreach_copy_ of host -> device pairs, blocking: the dispatch mode writes its copies and one
    # stream synchronization after them (held back until the op is in the log); the replay must too
    def program(arena, host, platform):
        dsts = [_dev(arena, k * 512, 16) for k in range(4)]
        srcs = [host[k * 64:(k + 1) * 64].view(torch.float32) for k in range(4)]
        torch._foreach_copy_(dsts, srcs)

    live, logged = _both(program)
    assert [op["op"] for op in live.trace()["ops"]] == ["copy"] * 4 + ["sync_stream"]
    _assert_same(live, logged)


def test_a_sparse_device_tensor_is_not_silently_dropped():
    # a sparse tensor whose indices and values lie in device memory: the dispatch mode records the
    # reads of both; the op log writes it down as not strided memory and must say it did not see it
    def program(arena, host, platform):
        indices = _dev(arena, 0, 4, torch.int64).view(2, 2)
        indices.zero_()
        values = _dev(arena, 4096, 2)
        values.fill_(1.0)
        s = torch.sparse_coo_tensor(indices, values, (2, 2), check_invariants=False)
        s * 2

    live, logged = _both(program)
    assert _kernels(live)["aten.mul.Tensor"] == 1
    _same_or_named(live, logged)


GC_PROGRAM = '''
import gc, sys
sys.path.insert(0, {here!r})
import torch
from test_oplog import _dev, _kernels, _run

def program(arena, host, platform):
    x, y = _dev(arena, 0, 16), _dev(arena, 4096, 16)

    class Cycle:  # garbage the collector finds while the op log's Python runs: a finalizer runs an op
        def __init__(self):
            self.me = self

        def __del__(self):
            y.add_(1)

    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(20):
            Cycle()
            x.add_(1); x.mul_(2); x.sub_(1); x.div_(1); x.clamp_(0, 1e9); x.neg_(); x.abs_(); x.sqrt_(); x.exp_()
    finally:
        gc.set_threshold(*old)

live, logged = _run(program, op_log=False), _run(program, op_log=True)
print(sorted(_kernels(live).items()))
print(sorted(_kernels(logged).items()))
print(logged.complete())
'''


def test_an_op_run_by_a_finalizer_inside_the_observer_neither_corrupts_nor_hides_the_log():
    # the observer calls Python (the classifier, the frame predicate) at an op's start; the collector
    # may run a finalizer there that runs an op of its own: a call inside the call being written down
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", GC_PROGRAM.format(here=here)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.path.dirname(os.path.dirname(here)), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    live, logged, complete = done.stdout.splitlines()[-3:]
    assert logged == live or complete == "False", (live, logged)


def test_a_backward_pass_on_the_recording_thread_is_recorded():
    # CPU autograd runs backward on the calling thread; torch wraps each node in a RecordFunction
    # named "autograd::engine::evaluate_function: MulBackward0", which is no dispatcher op: the ops
    # inside it are the program's, as the dispatch mode sees them
    def program(arena, host, platform):
        x = _dev(arena, 0, 16)
        w = x.clone().requires_grad_()
        (w * 2).sum().backward()
        x.add_(1)

    live, logged = _both(program)
    assert [op["op"] for op in live.trace()["ops"] if op.get("name") == "aten.mul.Tensor"].count("host_write") == 2
    assert _host_blind(logged) == _host_blind(live)
    assert logged.summary().notes == live.summary().notes


def test_a_dispatch_mode_of_the_program_sees_the_op_before_the_recording():
    # a mode the program enters inside the recording is above the recording's dispatch mode: what it
    # runs in place of the op is what the device does (here: a write to another buffer)
    def program(arena, host, platform):
        x, z = _dev(arena, 0, 16), _dev(arena, 4096, 16)

        with _redirect(z):
            x.add_(x)

    live, logged = _both(program)
    assert [op.get("name") for op in live.trace()["ops"]] == ["aten.mul_.Tensor"]
    _same_or_named(live, logged)
    _assert_same(live, logged)


def test_records_another_thread_left_in_the_native_log_do_not_make_every_op_flush(monkeypatch):
    # the observer flushes where the native log holds 2**18 records not taken, counting every
    # thread's; the recording thread's flush takes only its own: a thread the recording does not
    # follow (its driver calls, under native capture) then makes every later op a Python call
    import threading

    from kvverify.record.capture.oplog import Replayer

    flushes = []
    original = Replayer._flush
    monkeypatch.setattr(Replayer, "_flush", lambda self: (flushes.append(1), original(self)))
    go, done = threading.Event(), threading.Event()

    def background():  # an unfollowed thread whose records pile up in the native log
        go.wait()
        from kvverify import _C

        mark = ctypes.CDLL(_C.__file__).kvverify_ops_mark  # (a record, as a driver call's would be)
        mark.argtypes = [ctypes.c_int64]
        for _ in range((1 << 18) + 10):
            mark(0)
        done.set()

    worker = threading.Thread(target=background, name="background")
    worker.start()

    def program(arena, host, platform):
        x = _dev(arena, 0, 16)
        go.set()
        done.wait()
        for _ in range(200):
            x.add_(1)

    started = time.monotonic()
    try:
        logged = _run(program, op_log=True)
    finally:
        go.set()
        worker.join()
    assert _kernels(logged)["aten.add_.Tensor"] == 200
    assert len(flushes) <= 1
    # and the stop takes that thread's records (counted as its missed work) in linear time: a minute
    # here before (each record erased from the front of the rest)
    assert time.monotonic() - started < 15
    assert any(note.endswith(": 262154") for note in logged.summary().notes)


def test_a_recording_resumed_inside_a_dispatch_mode_of_the_program_still_sits_below_it():
    # the program enters its mode during the recording, and a recording nested in it starts and stops
    # inside that mode: the outer one goes on where it was, below the program's mode (as the dispatch
    # mode is entered again at its old depth), so the mode's replacement op is what it records
    def program(arena, host, platform):
        x, z = _dev(arena, 0, 16), _dev(arena, 4096, 16)

        with _redirect(z):
            with recording(platform=ArenaAsDevice(arena, []), op_log=True):
                pass
            x.add_(x)

    live, logged = _both(program)
    assert [op.get("name") for op in live.trace()["ops"] if op["op"] == "kernel"] == ["aten.mul_.Tensor"]
    # (both name the pause as work not recorded: what they recorded around it must still agree)
    _assert_same(live, logged)
