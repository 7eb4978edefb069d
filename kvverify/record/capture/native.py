"""The native log: what torch's caching allocator and the CUDA driver report from every thread,
kept in C++ (``csrc/record/native_log.cpp``, ``csrc/record/cupti_capture.cpp``) until the recorder takes it.

Two sources fill it while a recording runs:

- torch's caching allocator, through a trace tracker (every block handed out, every free asked for);
- native capture: the driver calls of every thread through CUPTI's callback API (kernel launches
  with their arguments, copies, batched copies, event and stream operations, synchronization,
  maps and unmaps, host registrations, graph launches), except those inside an op of torch's
  dispatcher or a method the recorder observes in Python (``suppressed``), which the recorder
  sees there.

Each record is a ``NativeRecord``: its kind (a name the C++ lists once, read here at load), its
fields (ints), and the Python frames of the call as ``(code, line)`` where the thread held the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading
import time
from collections import Counter

from kvverify.errors import RecordingError
from kvverify.record.trace.recorder import NativeRecord


def cupti_library() -> str | None:
    """The path of a CUPTI library to load: ``KVVERIFY_CUPTI`` if set; else the one of torch's
    ``nvidia`` CUDA wheels, else the toolkit's (``CUDA_HOME``, ``/usr/local/cuda*``); None where
    none is found."""
    given = os.environ.get("KVVERIFY_CUPTI")
    if given:
        return given
    places = []
    with contextlib.suppress(ImportError):
        import nvidia

        places += [os.path.join(root, "*", "lib", "libcupti.so*") for root in nvidia.__path__]
    for home in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if home:
            places += [os.path.join(home, sub, "libcupti.so*") for sub in ("lib64", "lib", "extras/CUPTI/lib64",
                                                                           "targets/x86_64-linux/lib")]
    for pattern in places:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


class NativeLog:
    """The native log of ``kvverify._C`` through ctypes. Raises RecordingError where the extension
    does not load or the allocator refuses the tracker (call after CUDA is initialised)."""

    WORDS = 1 << 20  # words taken per call (a record longer than half of it would stay in the log)

    def __init__(self) -> None:
        from kvverify.device.extension import ops

        ops()  # raises with the build hint where the extension is missing
        from kvverify import _C

        # PyDLL: the GIL stays held during each call, since take() and enable() hand over or drop
        # references to code objects
        lib = ctypes.PyDLL(_C.__file__)
        lib.kvverify_native_kinds.restype = ctypes.c_char_p
        lib.kvverify_native_count.restype = ctypes.c_void_p
        lib.kvverify_native_take.restype = ctypes.c_int64
        lib.kvverify_native_take.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        lib.kvverify_native_enable.argtypes = [ctypes.c_int]
        lib.kvverify_native_start.restype = ctypes.c_char_p
        lib.kvverify_native_start.argtypes = [ctypes.c_char_p]
        lib.kvverify_native_function_name.restype = ctypes.c_char_p
        lib.kvverify_native_function_name.argtypes = [ctypes.c_int64]
        lib.kvverify_native_suppress.argtypes = [ctypes.c_int]
        lib.kvverify_native_stream_info.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int),
                                                    ctypes.POINTER(ctypes.c_int)]
        if lib.kvverify_native_attach_allocator() != 0:
            raise RecordingError("torch's CUDA allocator refused kvverify's trace tracker (a pluggable allocator?): "
                                 "record with torch's own caching allocator")
        self._lib = lib
        self.kinds = {int(number): name for name, number in
                      (pair.split("=") for pair in lib.kvverify_native_kinds().decode().split())}
        self._count = ctypes.c_int64.from_address(lib.kvverify_native_count())
        # a ctypes array: slicing it gives a list of ints in one C loop (most takes are a few words)
        self._words = (ctypes.c_int64 * self.WORDS)()
        self._quiet = _Quiet(lib.kvverify_native_suppress)
        self.capturing = False
        from kvverify.record.capture.watch import HostWatch

        self.watch = HostWatch(lib)

    def enable(self, on: bool) -> None:
        """Log from now on (dropping any record left), or stop logging."""
        self._lib.kvverify_native_enable(int(on))

    def start_capture(self, library: str | None) -> str | None:
        """Start native capture through the CUPTI library at ``library``; returns None, or why it
        could not start (no CUPTI found, another subscriber holds it)."""
        if library is None:
            return "no CUPTI library was found (set KVVERIFY_CUPTI to libcupti.so's path)"
        why = self._lib.kvverify_native_start(library.encode())
        self.capturing = why is None
        return None if why is None else why.decode()

    def stop_capture(self) -> None:
        if self.capturing:
            self._lib.kvverify_native_stop()
            self.capturing = False

    def stream_info(self, handle: int) -> tuple[bool, int] | None:
        """``(blocking, device)`` of stream ``handle`` (blocking: created without
        ``CU_STREAM_NON_BLOCKING``; device -1 where the driver does not say), or None where the
        driver does not know it."""
        blocking, device = ctypes.c_int(), ctypes.c_int()
        if self._lib.kvverify_native_stream_info(handle, ctypes.byref(blocking), ctypes.byref(device)) != 0:
            return None
        return bool(blocking.value), device.value

    def function_name(self, function: int) -> str:
        """The name of a launch record's kernel."""
        return self._lib.kvverify_native_function_name(function).decode(errors="replace")

    def suppressed(self) -> _Quiet:
        """A context manager: the driver calls of this thread inside it are not logged (the
        recorder sees them another way)."""
        return self._quiet

    def op_log(self):
        """The op log of the same extension (``kvverify.record.capture.oplog.OpLog``), or None where
        the extension was built without it."""
        from kvverify.record.capture.oplog import OpLog

        try:
            return OpLog(self._lib)
        except AttributeError:
            return None

    def pending(self) -> bool:
        """Whether any thread has records not taken yet (one memory read, no call)."""
        return self._count.value != 0

    def _take(self, thread: int) -> list[int]:
        words: list[int] = []
        while True:
            n = self._lib.kvverify_native_take(thread, self._words, self.WORDS)
            words += self._words[:n]
            if n < self.WORDS // 2:  # a record longer than what is left stays for the next call
                return words

    def take(self, thread: int) -> list[NativeRecord]:
        """Thread ``thread``'s records (``threading.get_ident()``), oldest first, removed from the log."""
        return parse(self._take(thread), self.kinds)

    def leftover(self) -> Counter:
        """The count of records not taken, by ``(thread, kind)``, removed from the log."""
        words = self._take(0)
        left: Counter = Counter()
        k = 0
        while k < len(words):
            n = 3 + words[k + 2]
            for record in parse(words[k + 1:k + n], self.kinds):  # (which releases its frames)
                left[words[k], record.kind] += 1
            k += n
        return left


class _Quiet(threading.local):
    """``NativeLog.suppressed()``: one object for every use (a method the recorder observes pays
    two C calls, not a generator). It also times the call it wraps: ``last_call()``."""

    depth = 0
    t0 = 0
    span: tuple[int, int] | None = None  # the last call's, once it returned

    def __init__(self, suppress) -> None:
        self._suppress = suppress

    def __enter__(self) -> None:
        if not self.depth:  # (a method observed inside another: the outer call's span is the one)
            self.span, self.t0 = None, time.perf_counter_ns()
        self.depth += 1
        self._suppress(1)

    def __exit__(self, *exc) -> None:
        self._suppress(-1)
        self.depth -= 1
        if not self.depth:
            self.span = (self.t0, time.perf_counter_ns())

    def last_call(self) -> int | None:
        """When this thread's last call made inside ``suppressed()`` began
        (``time.perf_counter_ns()``), now forgotten; None where there is none (or it was taken)."""
        span, self.span = self.span, None
        return None if span is None else span[0]


def text_frames(words: list[int]) -> list[tuple[str, int, str]]:
    """The ``(file, line, function)`` frames a record holds as text, innermost first
    (``csrc/record/frames.h``: ``[n, then per frame: line, file bytes, name bytes, the bytes packed 8 to a
    word]``): frames read where the recorder could not hold the GIL (a host watch fault)."""
    out = []
    n, k = (words[0], 1) if words else (0, 0)
    for _ in range(n):
        line, nfile, nname = words[k], words[k + 1], words[k + 2]
        k += 3
        wf, wn = (nfile + 7) // 8, (nname + 7) // 8
        packed = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[k:k + wf + wn])
        out.append((packed[:nfile].decode(errors="replace"), line, packed[8 * wf:8 * wf + nname].decode(errors="replace")))
        k += wf + wn
    return out


def parse(words: list[int], kinds: dict[int, str]) -> list[NativeRecord]:
    """The records in ``words`` (``[kind, n, nframes, (code, line) x nframes, fields..., t0, t1]``
    each, ``n`` counting what follows it; nframes -1: ``[m, m words of frames as text]`` instead,
    frames ``(file, line, function)``; ``t0`` 0: when the call began is not known); takes over the
    references to their code objects."""
    out = []
    k = 0
    while k < len(words):
        kind, n, nframes = words[k], words[k + 1], words[k + 2]
        end = k + 2 + n  # past the record; its span is the last two words
        t0 = words[end - 2]
        when = (t0, words[end - 1]) if t0 > 0 else None
        if not nframes:  # the allocator's records, most of them
            out.append(NativeRecord(kinds.get(kind, str(kind)), words[k + 3:end - 2], (), when))
        elif nframes == -1:  # read as text, where the thread had released the GIL
            m = words[k + 3]
            out.append(NativeRecord(kinds.get(kind, str(kind)), words[k + 4 + m:end - 2],
                                    tuple(text_frames(words[k + 4:k + 4 + m])), when))
        else:
            frames = []
            for f in range(nframes):
                address, line = words[k + 3 + 2 * f], words[k + 4 + 2 * f]
                code = ctypes.cast(address, ctypes.py_object).value
                ctypes.pythonapi.Py_DecRef(ctypes.py_object(code))  # the record's reference, now ours
                frames.append((code, line))
            out.append(NativeRecord(kinds.get(kind, str(kind)), words[k + 3 + 2 * nframes:end - 2], tuple(frames), when))
        k = end
    return out
