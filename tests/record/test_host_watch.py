"""The host watch (``csrc/record/host_watch.cpp``, ``kvverify.record.capture.watch``) on the CPU: host bytes
that device work may still read or write are protected, and the host's first touch of them through
any path (numpy, ``.tolist()``, ``ctypes.memmove``, the buffer protocol) is a ``host_touch`` record
with its thread and Python line; a program that waits for the work first makes none. What native
capture feeds the watch on a GPU (the driver calls that issue work on host memory, and the ones that
order and complete it) is fed here by the test, over anonymous memory declared as host memory."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

PAGE = 4096
HERE = os.path.relpath(os.path.realpath(__file__))  # as a recording shows this file (relative to the working directory)
S1, S2 = 0x7000, 0x7100  # stream handles
E1 = 0xE100  # an event handle


def _lib():
    from kvverify.device import extension

    if extension.load_error() is not None:
        pytest.skip(f"kvverify._C is not built here: {extension.load_error()}")
    if not sys.platform.startswith("linux") or __import__("platform").machine() != "x86_64":
        pytest.skip("the host watch needs x86-64 Linux")
    from kvverify import _C

    return ctypes.PyDLL(_C.__file__)


class Log:
    """The extension's native log and host watch, driven by hand (what a recording's platform
    does on a GPU): ``take()`` gives this thread's records."""

    def __init__(self) -> None:
        from kvverify.record.capture.watch import HostWatch

        self.lib = lib = _lib()
        lib.kvverify_native_kinds.restype = ctypes.c_char_p
        lib.kvverify_native_enable.argtypes = [ctypes.c_int]
        lib.kvverify_native_take.restype = ctypes.c_int64
        lib.kvverify_native_take.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        self.kinds = {int(n): k for k, n in (p.split("=") for p in lib.kvverify_native_kinds().decode().split())}
        self.watch = HostWatch(lib)
        self._out = (ctypes.c_int64 * (1 << 16))()

    def take(self, thread: int | None = None):
        from kvverify.record.capture.native import parse

        n = self.lib.kvverify_native_take(threading.get_ident() if thread is None else thread, self._out, 1 << 16)
        return parse(list(self._out[:n]), self.kinds)

    def touches(self, thread: int | None = None):
        """``(write, first byte, end, where)`` of each touch: ``where`` as a recording locates it, the
        innermost frame that is not library code (numpy's own Python, torch's)."""
        from kvverify.record.capture.frames import Locator
        from kvverify.record.capture.native import text_frames

        out = []
        for r in self.take(thread):
            assert r.kind == "host_touch", r
            where = Locator().locate_text(text_frames(r.fields[4:]))
            out.append((bool(r.fields[1]), r.fields[2], r.fields[3], where))
        return out


@pytest.fixture
def log():
    log = Log()
    log.lib.kvverify_native_enable(1)
    assert log.watch.start() is None
    yield log
    log.watch.stop()
    log.lib.kvverify_native_enable(0)


@pytest.fixture
def host(log):
    """Four pages of anonymous memory, declared as pinned host memory, as a numpy array."""
    buffer = mmap.mmap(-1, 4 * PAGE)
    array = np.frombuffer(buffer, dtype=np.uint8)
    log.watch.declare(array.ctypes.data, array.nbytes)
    yield array
    del array


def line_of(marker: str) -> int:
    """The line of this file that holds ``marker``."""
    source = open(__file__, encoding="utf-8").read().splitlines()
    return next(k + 1 for k, text in enumerate(source) if marker in text and "line_of(" not in text)


def test_a_read_of_bytes_a_pending_device_write_holds_is_recorded_once_with_its_line(log, host):
    base = host.ctypes.data
    log.watch.device_op(S1, base, 2 * PAGE, True)  # a D2H into the first two pages, pending
    first = int(host[100])  # watch: read
    again = int(host[200])  # (same page, same thread: recorded already)
    third = int(host[3 * PAGE])  # (nothing pending on the fourth page)
    assert (first, again, third) == (0, 0, 0)
    touches = log.touches()
    assert [(w, lo - base, hi - base) for w, lo, hi, _ in touches] == [(False, 0, PAGE)]
    assert touches[0][3] == f"{HERE}:{line_of('# watch: read')} in test_a_read_of_bytes_a_pending_device_write_holds_is_" \
                            "recorded_once_with_its_line"


def test_a_write_is_recorded_where_a_read_was_and_once_per_pending_range(log, host):
    """A later access of the thread to the same pending work races only if its first one of that
    kind does (rules 1 and 4): one record per thread, range and kind, on the page first touched."""
    base = host.ctypes.data
    log.watch.device_op(S1, base, 2 * PAGE, True)
    log.watch.device_op(S1, base + 2 * PAGE, PAGE, True)  # other work, on the third page
    host[10]  # noqa: B018 (a read: recorded)
    host[20] = 1  # a write of the same bytes: recorded too (a write races where a read need not)
    host[PAGE + 5] = 2  # the same pending work, on its second page: recorded already
    host[2 * PAGE] = 3  # other pending work: its own record
    assert [(w, lo - base, hi - base) for w, lo, hi, _ in log.touches()] == [
        (False, 0, PAGE), (True, 0, PAGE), (True, 2 * PAGE, 3 * PAGE)]


def test_a_device_read_makes_host_writes_faults_and_leaves_reads_alone(log, host):
    base = host.ctypes.data
    log.watch.device_op(S1, base, PAGE, False)  # an H2D reading the first page, pending
    host[0] + host[4000]  # noqa: B018 (reads race with no read)
    assert log.touches() == []
    host[1] = 9  # watch: write under a read
    ((write, lo, hi, where),) = log.touches()
    assert write and (lo, hi) == (base, base + PAGE)
    assert where.startswith(f"{HERE}:{line_of('# watch: write under a read')} in ")


def test_a_touch_beside_the_pending_bytes_on_a_shared_page_is_let_through_unrecorded(log, host):
    """The fault's address is the byte touched: another tensor on the same page is no conflict."""
    base = host.ctypes.data
    log.watch.device_op(S1, base + 512, 512, True)  # the pending bytes: [512, 1024)
    host[0] = 1
    host[2048] = 2
    assert host[0] == 1 and host[2048] == 2 and log.touches() == []
    host[600] = 3
    assert [(w, lo - base, hi - base) for w, lo, hi, _ in log.touches()] == [(True, 512, 1024)]


def test_completion_the_host_observed_ends_the_watch_on_the_bytes(log, host):
    base = host.ctypes.data
    log.watch.device_op(S1, base, PAGE, True)
    log.watch.event_recorded(E1, S1)
    log.watch.event_completed(E1)  # an event recorded after the copy, synchronized (or queried true)
    host[0] = 1
    log.watch.device_op(S1, base + PAGE, PAGE, True)
    log.watch.stream_completed(S1)
    host[PAGE] = 1
    log.watch.device_op(S2, base + 2 * PAGE, PAGE, True)
    log.watch.device_completed()
    host[2 * PAGE] = 1
    assert log.touches() == []


def test_an_event_recorded_before_the_work_does_not_complete_it(log, host):
    base = host.ctypes.data
    log.watch.event_recorded(E1, S1)
    log.watch.device_op(S1, base, PAGE, True)
    log.watch.event_completed(E1)
    host[0] = 1
    assert len(log.touches()) == 1


def test_completion_follows_the_waits_between_streams(log, host):
    """S2 waits for an event S1 recorded after the copy; an event of S2 after the wait completes:
    so has the copy (CUDA: work after a wait starts after the event's capture)."""
    base = host.ctypes.data
    log.watch.device_op(S1, base, PAGE, True)
    log.watch.event_recorded(E1, S1)
    log.watch.stream_waited(S2, E1)
    log.watch.event_recorded(E1 + 1, S2)
    log.watch.event_completed(E1 + 1)
    host[0] = 1
    assert log.touches() == []


def test_a_wait_after_the_event_completed_orders_nothing_before_it(log, host):
    base = host.ctypes.data
    log.watch.event_recorded(E1 + 1, S2)  # recorded before S2 waits
    log.watch.device_op(S1, base, PAGE, True)
    log.watch.event_recorded(E1, S1)
    log.watch.stream_waited(S2, E1)
    log.watch.event_completed(E1 + 1)
    host[0] = 1
    assert len(log.touches()) == 1


@pytest.mark.parametrize("how", ["numpy", "tolist", "memmove", "buffer", "torch view"])
def test_every_way_the_host_reads_memory_is_seen(log, host, how):
    base = host.ctypes.data
    log.watch.device_op(S1, base, PAGE, True)
    if how == "numpy":
        host[:64].sum()  # watch: how
    elif how == "tolist":
        torch.from_numpy(host[:64]).tolist()  # watch: how
    elif how == "memmove":
        ctypes.memmove(ctypes.create_string_buffer(64), base, 64)  # watch: how (the GIL released)
    elif how == "buffer":
        bytes(memoryview(host)[:64])  # watch: how
    else:
        torch.frombuffer(memoryview(host), dtype=torch.uint8)[:64].clone()  # watch: how
    ((write, lo, _, where),) = log.touches()
    assert not write and lo == base
    file, line = where.split(" in ")[0].rsplit(":", 1)
    assert file == HERE and "# watch: how" in open(__file__).read().splitlines()[int(line) - 1], where


def test_with_two_threads_each_threads_first_touch_is_recorded(log, host):
    """With another thread alive, a page is not opened for good at a first touch: each touch while
    the work is pending is single-stepped, and another thread's first touch is its own record."""
    base = host.ctypes.data
    log.watch.threads(2)
    log.watch.device_op(S1, base, PAGE, True)
    host[0] = 1
    host[1] = 1  # (stepped over, recorded already)
    other: list = []

    def touch():
        host[2] = 1
        other.extend(log.touches(threading.get_ident()))

    t = threading.Thread(target=touch)
    t.start()
    t.join()
    assert [w for w, *_ in log.touches()] == [True] and [w for w, *_ in other] == [True]
    assert host[0] == host[1] == host[2] == 1


def test_stop_gives_every_page_its_protection_back(log, host):
    log.watch.device_op(S1, host.ctypes.data, 4 * PAGE, True)
    log.watch.stop()
    host[:] = 7  # no fault, nothing recorded
    assert (host == 7).all() and log.take() == []


def test_the_recorders_own_reads_are_not_the_programs(log, host):
    log.watch.device_op(S1, host.ctypes.data, PAGE, True)
    with log.watch.internal():
        host[0] = 5
    host[0] = 6
    assert len(log.touches()) == 1


def test_a_system_call_into_protected_pages_goes_through_an_opened_window(log, host, tmp_path):
    """The kernel answers EFAULT on a protected page: a read(2) into pending bytes would fail."""
    path = tmp_path / "kv"
    path.write_bytes(b"\x05" * PAGE)
    log.watch.device_op(S1, host.ctypes.data, PAGE, False)  # an H2D reads the page: writes fault
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as failed:
            os.preadv(fd, [memoryview(host)[:PAGE]], 0)
        assert failed.value.errno == 14  # EFAULT: what the window prevents
        with log.watch.opened(host.ctypes.data, PAGE):
            assert os.preadv(fd, [memoryview(host)[:PAGE]], 0) == PAGE
    finally:
        os.close(fd)
    assert (host[:PAGE] == 5).all()


def test_the_coverage_is_the_pages_the_watch_protected_merged(log, host):
    base = host.ctypes.data
    log.watch.device_op(S1, base, 100, True)
    log.watch.device_op(S1, base + PAGE - 10, 100, False)
    log.watch.device_op(S2, base + 3 * PAGE, 10, True)
    assert log.watch.covered() == [(base, base + 2 * PAGE), (base + 3 * PAGE, base + 4 * PAGE)]
    assert log.watch.losses() == {}


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).parent))


PRELUDE = """
    import ctypes, faulthandler, mmap, numpy as np
    from test_host_watch import Log
    log = Log()
    log.lib.kvverify_native_enable(1)
"""


def test_a_crash_elsewhere_still_crashes_and_is_reported_by_the_handler_before_the_watch():
    """A fault on a page the watch does not hold goes to whoever handled faults before it (here
    Python's faulthandler, as pytest enables it): the process dies as it would have."""
    result = _child(PRELUDE + """
    faulthandler.enable()
    assert log.watch.start() is None
    buffer = mmap.mmap(-1, 4096)
    array = np.frombuffer(buffer, dtype=np.uint8)
    log.watch.declare(array.ctypes.data, 4096)
    log.watch.device_op(0x7000, array.ctypes.data, 4096, True)
    array[0] = 1
    ctypes.string_at(8)  # a real crash: nothing mapped at address 8
    """)
    assert result.returncode == -11, result
    assert "Fatal Python error: Segmentation fault" in result.stderr


def test_a_protected_page_of_the_programs_own_is_not_the_watchs():
    result = _child(PRELUDE + """
    assert log.watch.start() is None
    buffer = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    array = np.frombuffer(buffer, dtype=np.uint8)
    print("read", array[0], flush=True)
    ctypes.memset(array.ctypes.data, 1, 1)  # a write to a read-only mapping: the program's own fault
    """)
    assert result.returncode == -11 and "read 0" in result.stdout, result


def test_a_fault_handler_enabled_while_watching_stays_beneath_the_watch():
    """pytest enables faulthandler at its start, which under ``kvverify record -- pytest`` is after
    the watch started: the watch stays on top (its faults stay its own, no traceback is dumped for
    them), and a real crash still reaches faulthandler, also after a disable and enable again."""
    result = _child(PRELUDE + """
    assert log.watch.start() is None
    faulthandler.enable()
    buffer = mmap.mmap(-1, 4096)
    array = np.frombuffer(buffer, dtype=np.uint8)
    log.watch.declare(array.ctypes.data, 4096)
    log.watch.device_op(0x7000, array.ctypes.data, 4096, True)
    array[0] = 1
    faulthandler.disable()
    log.watch.device_op(0x7000, array.ctypes.data, 4096, True)
    array[1] = 1
    faulthandler.enable()
    log.watch.device_op(0x7000, array.ctypes.data, 4096, True)
    array[2] = 1
    print("touches", len(log.touches()), flush=True)
    ctypes.string_at(8)
    """)
    assert result.returncode == -11 and "touches 3" in result.stdout, result
    assert result.stderr.count("Fatal Python error: Segmentation fault") == 1, result.stderr


# -- what the watch did not hold -------------------------------------------------------------------


def _recorder_with(spaces: dict[str, str]):
    from fake_cuda import Lines

    from kvverify.record.trace.recorder import Recorder

    rec = Recorder(Lines())
    made = {name: rec.memory.fresh(0x10_0000 * (k + 1), PAGE, space, name) for k, (name, space) in
            enumerate(spaces.items())}
    return rec, made


def test_unwatched_names_host_bytes_device_work_touched_outside_the_coverage():
    from kvverify.record.capture.watch import unwatched
    from kvverify.record.trace.recorder import CopyArrays

    rec, m = _recorder_with({"gpu": "device", "pin": "host_pinned", "reg": "host_registered", "page": "host_pageable"})
    gpu, pin, reg, page = (m[k] for k in ("gpu", "pin", "reg", "page"))
    rec.copy(0x5000, "store", (gpu.index, 0, 64), (pin.index, 0, 64), "prog.py:7 in step")
    rec.copy(0x5000, "load", (page.index, 0, 64), (gpu.index, 0, 64), None)  # a pageable source: read at the call
    rec.copy(0x5000, "store", (gpu.index, 0, 64), (page.index, 0, 64), None)  # cudaMemcpyAsync: done at return
    rec.kernel(0x5000, "uva", [(reg.index, 0, 64)], [], None)
    covered = [(pin.base, pin.base + 64), (reg.base, reg.base + 64)]
    assert unwatched(rec.ops, rec.memory, covered) == (0, None)
    count, first = unwatched(rec.ops, rec.memory, [(pin.base, pin.base + 32)])
    assert count == 2 and first == f"64 bytes of host_pinned memory at {pin.base:#x}, store at prog.py:7 in step"
    assert unwatched(rec.ops, rec.memory, None)[0] == 2  # no watch: every pinned or registered range
    import numpy as np

    swap = CopyArrays(np.array([gpu.index]), np.array([0]), np.array([page.index]), np.array([128]), np.array([64]))
    rec.copy_batch(0x5000, "swap", "STREAM", swap, None)  # a batched copy into pageable memory may be pending
    count, first = unwatched(rec.ops, rec.memory, covered)
    assert count == 1 and "host_pageable" in first and "swap" in first
    assert unwatched(rec.ops, rec.memory, [*covered, (page.base + 128, page.base + 192)]) == (0, None)


def test_a_recording_without_a_host_watch_says_so_where_device_work_touched_host_memory():
    """A platform whose device work can be pending and that has no host watch (native capture off,
    a recording without native capture): a NOT RECORDED line, never a SAFE that covers it all."""
    from fake_cuda import FakeCuda

    import kvverify.record as record

    class Unwatched(FakeCuda):
        watch_off = "native capture is off"

    fake = Unwatched()
    a, host = fake.device(PAGE), fake.pinned(PAGE)
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        host.copy_(a, non_blocking=True)
        fake.synchronize()
    assert rec.check().safe and not rec.complete()
    (note,) = [n for n in rec.summary().notes if "host watch" in n]
    assert "host watch off: native capture is off" in note and note.endswith(": 1")


def test_the_host_watch_benchmark_runs_and_prints_its_figures(capsys):
    """benchmarks/bench_host_watch.py (the watch's cost per step on the host) stays runnable."""
    _lib()
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_watch.py"
    spec = importlib.util.spec_from_file_location("bench_host_watch", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--steps", "3", "--layers", "2", "--blocks", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("host watch: ") and "device ops 3.0 / " in out and "[2 layers, 8 blocks" in out
