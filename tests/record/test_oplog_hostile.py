"""Hostile programs for the op log (``kvverify.record.capture.oplog``, ``csrc/op_log.cpp``): each is
recorded with the op log and with the dispatch mode it stands in for, on the CPU arena of
``test_oplog.py``; the two must give the same trace, or the op log must name what it did not see
(a NOT RECORDED note). Never silently less device work, never a crash."""

from __future__ import annotations

import ctypes
import difflib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from test_oplog import ArenaAsDevice, _comparable  # noqa: E402

from kvverify.record import recording  # noqa: E402


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
from test_oplog_hostile import _dev, _kernels, _run

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
