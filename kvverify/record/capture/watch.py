"""The host watch: page protection over host memory that device work may still read or write, so
that the host's first touch of it through any path is seen (``csrc/record/host_watch.cpp``).

The dispatcher sees torch's ops; numpy views of pinned memory, ``.numpy()``, ``.tolist()``, the
buffer protocol, ``ctypes.memmove`` and native code touch host bytes without it. From the driver
call that issues device work on pinned or registered host memory (a copy, a batched copy, a
memset, a kernel whose arguments point there) until the host has observed that work complete (a
synchronization, an event or stream query that returned true, followed through the waits between
streams), its pages are protected; the first touch of them by each thread, for each pending
range and kind (read, write), is a fault the watch turns into a ``host_touch`` record of the native
log: the address, read or write, the bytes of the pending ranges it hit on that page, and the
thread's Python frames (read without the GIL: the touch may come from code that released it).
The recorder writes it as a ``host_read`` / ``host_write`` at that point of the thread's program
(``kvverify.record.capture.driver``). A program that synchronizes before it touches the bytes
makes no fault at all.

What it does not watch is said: pageable host memory (the driver copies it with the CPU, often from
threads of its own), host bytes device work reaches through a pointer table in device memory that
no small host copy filled, and work captured into a CUDA graph. The recorder compares the host
bytes every device op touched with what the watch covered (``covered``) and names the rest as not
recorded (``kvverify.record.session``).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

LOSSES = ("touches lost (no free record slot)", "device ranges past the watch's table",
          "pages past the watch's table", "intervals past the watch's coverage table",
          "allocations too large to watch whole for a kernel", "failed mprotect calls",
          "faults opened without a single step")
"""What ``HostWatch.losses`` counts, in its order (``kvverify_watch_losses``)."""


class HostWatch:
    """The host watch of ``kvverify._C`` (``lib``: the extension loaded with ctypes, as
    ``kvverify.record.capture.native.NativeLog`` loads it)."""

    def __init__(self, lib) -> None:
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        lib.kvverify_watch_start.restype = ctypes.c_char_p
        lib.kvverify_watch_internal.restype = ctypes.POINTER(ctypes.c_int)
        lib.kvverify_watch_threads.argtypes = [ctypes.c_int]
        lib.kvverify_watch_declare.argtypes = [u64, u64, ctypes.c_int]
        lib.kvverify_watch_device_op.argtypes = [u64, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                                 ctypes.POINTER(ctypes.c_uint8), i64]
        lib.kvverify_watch_event_recorded.argtypes = [u64, u64]
        lib.kvverify_watch_stream_waited.argtypes = [u64, u64]
        lib.kvverify_watch_event_completed.argtypes = [u64]
        lib.kvverify_watch_stream_completed.argtypes = [u64]
        lib.kvverify_watch_stream_key.argtypes = [u64, ctypes.c_int]
        lib.kvverify_watch_stream_key.restype = u64
        lib.kvverify_watch_open.argtypes = [u64, u64]
        lib.kvverify_watch_open.restype = i64
        lib.kvverify_watch_close.argtypes = [u64, u64]
        lib.kvverify_watch_covered.argtypes = [ctypes.POINTER(u64), i64]
        lib.kvverify_watch_covered.restype = i64
        lib.kvverify_watch_losses.argtypes = [ctypes.POINTER(u64)]
        lib.kvverify_watch_stats.argtypes = [ctypes.POINTER(u64)]
        self._lib = lib
        self._local = threading.local()
        self._undo: list = []
        self.running = False

    def start(self) -> str | None:
        """Start watching; returns None, or why it cannot (not x86-64 Linux, running already).

        Python's ``faulthandler.enable`` (pytest calls it at its start) installs its own handler of
        segmentation faults: while the watch runs, the watch's is put back on top after it, and
        hands it every fault that is not the watch's (a real crash still dumps its traceback)."""
        why = self._lib.kvverify_watch_start()
        self.running = why is None
        if self.running:
            self.threads(threading.active_count())
            self._keep_on_top()
        return None if why is None else why.decode()

    def stop(self) -> None:
        """Stop (idempotent): every page gets its protection back."""
        if self.running:
            self.running = False
            while self._undo:
                self._undo.pop()()
            self._lib.kvverify_watch_stop()

    def _keep_on_top(self) -> None:
        import faulthandler

        enable, disable = faulthandler.enable, faulthandler.disable
        on_top, before_off = self._lib.kvverify_watch_on_top, self._lib.kvverify_watch_before_off

        def enabled(*args, **kwargs):
            result = enable(*args, **kwargs)
            on_top()
            return result

        def disabled(*args, **kwargs):
            before_off()
            return disable(*args, **kwargs)

        enabled.__wrapped__, disabled.__wrapped__ = enable, disable
        faulthandler.enable, faulthandler.disable = enabled, disabled
        self._undo.append(lambda: (setattr(faulthandler, "enable", enable), setattr(faulthandler, "disable", disable)))

    def threads(self, n: int) -> None:
        """``n`` threads may touch host memory now: with one, a page is opened for good once its
        thread's first touch is recorded; with more, each touch of it while device work is pending
        is single-stepped (a second thread's first touch is recorded too)."""
        self._lib.kvverify_watch_threads(int(n))

    @contextlib.contextmanager
    def internal(self):
        """The recorder's own work on this thread: its touches of protected pages are let through,
        not recorded (they are not the program's)."""
        flag = getattr(self._local, "flag", None)
        if flag is None:
            pointer = self._lib.kvverify_watch_internal()
            flag = self._local.flag = pointer.contents if pointer else ctypes.c_int()
        flag.value += 1
        try:
            yield
        finally:
            flag.value -= 1

    @contextlib.contextmanager
    def opened(self, address: int, nbytes: int):
        """``[address, address + nbytes)`` unprotected for a system call of this thread (the kernel
        answers EFAULT on a protected page instead of faulting: a ``preadv`` into pinned memory a
        copy still reads would fail); gives how many pages it opened (0: none was protected). The
        caller records the access itself."""
        opened = self._lib.kvverify_watch_open(address, nbytes)
        try:
            yield opened
        finally:
            self._lib.kvverify_watch_close(address, nbytes)

    def covered(self) -> list[tuple[int, int]]:
        """The host byte intervals ``[lo, hi)`` the watch protected for some device op, merged, in
        whole pages (what it protects)."""
        room = 1024
        while True:
            out = (ctypes.c_uint64 * (2 * room))()
            n = self._lib.kvverify_watch_covered(out, room)
            if n <= room:
                return [(out[2 * k], out[2 * k + 1]) for k in range(n)]
            room = n

    def stats(self) -> dict[str, float]:
        """Where the watch's time went since it started (counts, and milliseconds in total): its
        mprotect calls, faults, device ops, the driver's answers on what memory an address is, the
        completions it followed."""
        out = (ctypes.c_uint64 * 10)()
        self._lib.kvverify_watch_stats(out)
        names = ("mprotect", "faults", "device ops", "driver queries", "completions")
        return {name: (int(out[2 * k]), out[2 * k + 1] / 1e6) for k, name in enumerate(names)}

    def losses(self) -> dict[str, int]:
        """What could not be watched (``LOSSES``), where any."""
        out = (ctypes.c_uint64 * len(LOSSES))()
        self._lib.kvverify_watch_losses(out)
        return {what: int(n) for what, n in zip(LOSSES, out) if n}

    # -- what native capture feeds it on a GPU, for a stand-in of the device ------------------------

    def declare(self, address: int, nbytes: int, host: bool = True) -> None:
        """Memory the driver cannot describe: host (watched) or device."""
        self._lib.kvverify_watch_declare(address, nbytes, 1 if host else 2)

    def device_op(self, stream: int, address: int, nbytes: int, device_writes: bool) -> None:
        """Device work on ``stream`` reads (or writes) ``nbytes`` at ``address``."""
        self.device_ops(stream, [(address, nbytes, device_writes)])

    def device_ops(self, stream: int, accesses: list[tuple[int, int, bool]]) -> None:
        """One device op on ``stream`` (a batched copy) with these ``(address, bytes, device
        writes)`` accesses."""
        n = len(accesses)
        addresses, sizes = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
        writes = (ctypes.c_uint8 * n)()
        for k, (address, nbytes, written) in enumerate(accesses):
            addresses[k], sizes[k], writes[k] = address, nbytes, int(written)
        self._lib.kvverify_watch_device_op(stream, addresses, sizes, writes, n)

    def event_recorded(self, event: int, stream: int) -> None:
        self._lib.kvverify_watch_event_recorded(event, stream)

    def stream_waited(self, stream: int, event: int) -> None:
        self._lib.kvverify_watch_stream_waited(stream, event)

    def event_completed(self, event: int) -> None:
        self._lib.kvverify_watch_event_completed(event)

    def stream_completed(self, stream: int) -> None:
        self._lib.kvverify_watch_stream_completed(stream)

    def device_completed(self) -> None:
        self._lib.kvverify_watch_device_completed()

    def stream_key(self, handle: int, per_thread_api: bool = False) -> int:
        """The key the watch tracks ``handle`` by (the per-thread default stream: one per thread)."""
        return int(self._lib.kvverify_watch_stream_key(handle, int(per_thread_api)))


def unwatched(ops: list[dict], memory, covered: list[tuple[int, int]] | None) -> tuple[int, str | None]:
    """How many host byte ranges device work in ``ops`` (a ``Recorder``'s log) touched without the
    watch's protection while it was pending, and a description of the first (None: none).

    A range counts where it lies outside every interval of ``covered`` (None: the watch did not
    run, so none is covered) in pinned or registered memory, or in pageable memory a batched copy
    writes. Other pageable ranges are never pending: a copy reads a pageable source during its call
    (trace format rule 6), and a ``cudaMemcpyAsync`` into pageable memory "will return only once the
    copy has completed" (CUDA Runtime API, "API synchronization behavior"), but a
    ``cuMemcpyBatchAsync`` into it was measured to return before its copy ran (docs/checker.md), and
    the watch holds those destinations. ``memory``: the recorder's ``MemoryMap``."""
    import numpy as np

    from kvverify.terms import HOST_SPACE

    pageable, allocations = HOST_SPACE["pageable"], memory.allocations
    watched = (HOST_SPACE["pinned"], HOST_SPACE["registered"])
    lo = np.array([c[0] for c in covered or ()], dtype=np.int64)
    hi = np.array([c[1] for c in covered or ()], dtype=np.int64)
    count, first = 0, None

    def check(k: int, index, offset, length, written: bool, pending_pageable: bool = False) -> None:
        nonlocal count, first
        index, offset, length = (np.atleast_1d(np.asarray(v, dtype=np.int64)) for v in (index, offset, length))
        roots = [allocations[i].final()[0] for i in index.tolist()]  # (a placeholder may have merged into memory learnt later)
        spaces = np.array([pageable if a.placeholder else a.space for a in roots])
        start = np.array([allocations[i].base for i in index.tolist()], dtype=np.int64) + offset
        at = np.searchsorted(hi, start, side="right")  # the first interval ending after the range's start
        inside = (at < len(lo)) & (lo[np.minimum(at, len(lo) - 1)] <= start) & \
            (start + length <= hi[np.minimum(at, len(hi) - 1)]) if len(lo) else np.zeros(len(start), dtype=bool)
        exposed = (np.isin(spaces, watched) | ((spaces == pageable) & written & pending_pageable)) & ~inside
        n = int(exposed.sum())
        if n and first is None:
            j = int(np.argmax(exposed))
            op = ops[k]
            first = (f"{int(length[j])} bytes of {allocations[int(index[j])].space} memory at {int(start[j]):#x}, "
                     f"{op.get('name') or op['op']} at {op.get('at') or '?'}")
        count += n

    for k, op in enumerate(ops):
        kind = op["op"]
        if kind == "copy":
            check(k, op["src"][0], op["src"][1], op["src"][2], False)
            check(k, op["dst"][0], op["dst"][1], op["dst"][2], True)
        elif kind == "copy_batch":
            c = op["copies"]
            check(k, c.src_index, c.src_offset, c.size, False)
            check(k, c.dst_index, c.dst_offset, c.size, True, pending_pageable=True)
        elif kind == "kernel":
            for spans, written in ((op["reads"], False), (op["writes"], True)):
                if spans:
                    index, offset, length = zip(*spans)
                    check(k, index, offset, length, written)
    return count, first
