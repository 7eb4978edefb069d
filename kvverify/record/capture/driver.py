"""CUDA driver calls, given as integers, as the recorder's ops: one translation for both places that
see them, cuda-python's calls where Python makes them (``kvverify.record.capture.bindings``) and native
capture's records of every thread (``kvverify.record.capture.native``).

- ``cuMemcpyBatchAsync``: a ``copy_batch`` per attribute group, in its ``srcAccessOrder``; a copy
  (``cuMemcpyAsync``, the ``cuMemcpy{HtoD,DtoH,DtoD}Async`` family; ``cuMemcpy``, which the host
  waits for): a ``copy``; a memset: a ``kernel`` writing the range;
- a kernel launch outside the dispatcher (Triton, pybind11, a JIT kernel): a ``kernel`` that reads
  and writes every allocation one of its argument words points into, and every allocation a
  pointer table it is given points into (a device table filled by a host copy the recording saw):
  with no declaration of what it touches, the whole of each (a report too many, never a race
  missed); a launch whose arguments could not be read makes the recording incomplete;
- event and stream operations, synchronization: the recorder's own reports;
- ``cuMemMap``: device memory there from now on; ``cuMemUnmap``: a ``free`` of the range;
  ``cuMemHostRegister`` / ``Unregister``: registered host memory, and its ``free``;
- a stream capture: the ops issued to the stream meanwhile are the graph's, not run; a graph
  launch runs them on its stream, in capture order (``Recorder.graph_launched``); a graph captured
  before the recording, and the calls the trace format cannot say yet, are named as missed.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import numpy as np

from kvverify.record.capture.native import text_frames
from kvverify.record.capture.threads import NOT_RECORDED
from kvverify.record.trace.recorder import CopyArrays, NativeRecord, Recorder
from kvverify.terms import DEVICE_SPACE, HOST_SPACE, SrcAccessOrder

POINTER_RANGE = (1 << 16, 1 << 57)
"""Argument words outside this range are taken for numbers, not addresses (no lookup)."""
UNREADABLE = f"{NOT_RECORDED} (kernels launched outside the dispatcher whose arguments could not be read):"
GRAPHS = f"{NOT_RECORDED} (launches of CUDA graphs captured before the recording: their work is not known):"
UNMODELLED = f"{NOT_RECORDED} (driver calls the trace cannot say yet):"
GRAPH = -1  # the key of a graph launch's site (kernel sites are keyed by their function)
HOST_TOUCH = "host access seen by the host watch"
"""The name of a host access the host watch saw (a numpy view, ``.tolist()``, ctypes, native code)."""


class DriverOps:
    """Writes driver calls into ``recorder``.

    ``mode``: the recording's ``RecordingMode`` (pointer resolution, pointer tables);
    ``stream_key``: ``(handle) -> Recorder stream key``; ``locate_frames``: ``(frames) -> at`` of a
    record's ``(code, line)`` frames; ``function_name``: ``(function) -> kernel name``;
    ``locate_text``: ``(frames) -> at`` of ``(file, line, function)`` frames read as text.
    """

    def __init__(self, recorder: Recorder, mode, stream_key: Callable[[int], object],
                 locate_frames: Callable[[tuple], str | None] = lambda frames: None,
                 function_name: Callable[[int], str] = lambda function: "?",
                 locate_text: Callable[[list], str | None] = lambda frames: None) -> None:
        self.rec = recorder
        self.mode = mode
        self.stream_key = stream_key
        self.locate_frames = locate_frames
        self.function_name = function_name
        self.locate_text = locate_text
        self._sites: dict[tuple[int, int], str | None] = {}  # (thread, function) -> where it is about to launch
        self._declared: dict[int, tuple] = {}  # thread -> (reads, writes, name) of kvverify.record.kernel

    def graph_site(self) -> None:
        """The program is about to launch a CUDA graph on this thread with the GIL released: the
        launch's record has no frames, and takes this line."""
        self._sites[(threading.get_ident(), GRAPH)] = self.rec.locate()

    def declare(self, declared: tuple | None) -> tuple | None:
        """This thread's launches outside the dispatcher read and write these spans from now on
        (``(reads, writes, name)``; None: what their arguments point into again); returns the
        declaration it replaces (a nested ``kernel(...)`` gives it back at its end)."""
        ident = threading.get_ident()
        previous = self._declared.get(ident)
        if declared is None:
            self._declared.pop(ident, None)
        else:
            self._declared[ident] = declared
        return previous

    def launch_site(self, function: int) -> None:
        """A launcher (Triton's launch-enter hook) is about to launch ``function`` on this thread,
        with the GIL released: the launch's record has no frames, and takes this line."""
        self._sites[(threading.get_ident(), function)] = self.rec.locate()

    # -- copies -----------------------------------------------------------------------------------

    def copy(self, stream: int, dst: int, src: int, nbytes: int, name: str, at: str | None,
             blocking: bool = False) -> None:
        """One copy of ``nbytes`` from ``src`` to ``dst`` on stream handle ``stream``; ``blocking``:
        ``cuMemcpy`` (on the legacy default stream), which synchronizes the host as CUDA's "API
        synchronization behavior" says for its direction: to host memory, and from pinned or
        registered memory to the device, the host waits for the copy; from pageable memory to the
        device, for the stream's earlier work only (a sync before the copy); between device
        buffers, not at all. Where either side is not known (an unresolved range), only what every
        kind it can be would give."""
        size = np.array([nbytes], dtype=np.int64)
        s_index, s_offset, d_index, d_offset = self.mode.resolve_both(
            np.array([src], dtype=np.int64), np.array([dst], dtype=np.int64), size, at)
        key = self.stream_key(stream)
        s, d = int(s_index[0]), int(d_index[0])
        sync = self._blocking_sync(s, d) if blocking else None
        if sync == "before":
            self.rec.synchronized_by_op(key, at)
        self.rec.copy(key, name, (s, int(s_offset[0]), nbytes), (d, int(d_offset[0]), nbytes), at)
        if sync == "after":
            self.rec.synchronized_by_op(key, at)

    def _blocking_sync(self, src: int, dst: int) -> str | None:
        """Where a ``cuMemcpy`` from allocation ``src`` to ``dst`` synchronizes the host: "after"
        the copy, "before" it (the stream's earlier work only) or None."""
        allocations = self.rec.memory.allocations
        s, d = allocations[src], allocations[dst]
        if not d.placeholder and d.space != DEVICE_SPACE:
            return "after"  # to host memory (from the device or the host): returns once complete
        if d.placeholder or s.placeholder or s.space == DEVICE_SPACE:
            return None  # device to device (or could be)
        return "before" if s.space == HOST_SPACE["pageable"] else "after"

    def copy_batch(self, stream: int, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray,
                   groups: list[tuple[int, int]], name: str, at: str | None) -> None:
        """``cuMemcpyBatchAsync``: int64 arrays ``dst``, ``src``, ``sizes`` of shape ``(n,)``;
        ``groups``: ``(srcAccessOrder, first index)`` of each attribute group, in order."""
        count = len(sizes)
        s_index, s_offset, d_index, d_offset = self.mode.resolve_both(src, dst, sizes, at)
        starts = [first for _, first in groups] + [count]
        for k, (order, _) in enumerate(groups):
            part = slice(starts[k], starts[k + 1])
            self.rec.copy_batch(self.stream_key(stream), name, SrcAccessOrder(order).name,
                                CopyArrays(s_index[part], s_offset[part], d_index[part], d_offset[part], sizes[part]), at)

    def memset(self, stream: int, dst: int, nbytes: int, name: str, at: str | None) -> None:
        span = self._span(dst, nbytes, at)
        self.rec.kernel(self.stream_key(stream), name, [], [span], at)

    # -- kernels ------------------------------------------------------------------------------------

    def launch(self, stream: int, function: int, words: list[int], at: str | None) -> None:
        """A kernel launched outside the dispatcher, with its argument words (``None``: they could
        not be read)."""
        name = f"kernel {self.function_name(function)}"
        declared = self._declared.get(threading.get_ident())
        if declared is not None:  # kvverify.record.kernel: what the program says the launch touches
            reads, writes, given = declared
            if reads or writes:
                self.rec.kernel(self.stream_key(stream), given or name, reads, writes, at)
            return
        if words is None:
            self.rec.notes[f"{UNREADABLE} {name}"] += 1
            return
        spans = self.touched(words, at)
        if spans:
            self.rec.kernel(self.stream_key(stream), name, spans, spans, at)

    def touched(self, words: list[int], at: str | None) -> list:
        """The whole-allocation spans of what ``words`` point into, and of what the pointer tables
        among them point into (a device table's values known from the host copy that filled it)."""
        lo, hi = POINTER_RANGE
        candidates = np.array(sorted({w for w in words if lo <= w < hi}), dtype=np.int64)
        if not len(candidates):
            return []
        memory = self.rec.memory
        self.mode.learn(candidates)
        seen: dict[int, tuple] = {}
        for address in candidates.tolist():
            holder = memory.find(address)
            if holder is None:  # (a placeholder is bytes a copy reached unknown: the kernel's too)
                continue
            seen[holder.index] = (holder.index, 0, holder.size)
            table = self.mode.pointer_table(address)
            if table is not None:
                values = table[(table >= lo) & (table < hi)]
                self.mode.learn(values)
                for value in values.tolist():
                    inner = memory.find(value)
                    if inner is not None:
                        seen[inner.index] = (inner.index, 0, inner.size)
        return list(seen.values())

    def _span(self, address: int, nbytes: int, at: str | None):
        index, offset = self.mode.resolve_one(address, nbytes, at)
        return index, offset, nbytes

    # -- memory -------------------------------------------------------------------------------------

    def mapped(self, base: int, nbytes: int, name: str, at: str | None) -> None:
        self.rec.allocated(base, nbytes, DEVICE_SPACE, name, at)

    def unmapped(self, base: int, nbytes: int, name: str, at: str | None) -> None:
        """A release of ``[base, base + nbytes)``, which may cover several mappings (and bytes the
        recording never learnt of): a free of each part where it lies, so that device work on any
        of them races with the unmap."""
        end = base + nbytes
        memory = self.rec.memory
        spans, cursor = [], base
        mapped = memory.overlapping(base, end)
        for a in mapped:
            lo, hi = max(a.base, base), min(a.end, end)
            if lo > cursor:
                spans.append(memory.unresolved_span(cursor, lo - cursor, "lies in no allocation the recording knows", at))
            spans.append((a.index, lo - a.base, hi - lo))
            cursor = hi
        if cursor < end:
            spans.append(memory.unresolved_span(cursor, end - cursor, "lies in no allocation the recording knows", at))
        self.rec.released(spans, name, at, after="unmapped")
        for a in mapped:
            if not a.placeholder:
                memory.retire(a.base)

    def registered(self, base: int, nbytes: int, name: str, at: str | None) -> None:
        self.rec.allocated(base, nbytes, HOST_SPACE["registered"], name, at)

    def unregistered(self, base: int, name: str, at: str | None) -> None:
        # the release orders nothing: device work still on the bytes races with it
        released = self.rec.memory.retire(base)
        if released is not None:
            self.rec.released([(released.index, 0, released.size)], name, at)

    def touched_by_host(self, address: int, write: bool, lo: int, hi: int, at: str | None) -> None:
        """The host watch saw this thread's first touch of pending host bytes (a page fault at
        ``address``, a write or a read): a host access of ``[lo, hi)``, the bytes of the device
        work pending there on that page (``kvverify.record.capture.watch``)."""
        span = self.mode.host_span(lo, hi - lo, at)
        self.rec.host_access("host_write" if write else "host_read", [span], HOST_TOUCH, at)

    # -- native capture's records ---------------------------------------------------------------------

    def record(self, record: NativeRecord) -> None:
        """Write one record of native capture (``kvverify.record.capture.native``), located by its frames."""
        kind, f = record.kind, record.fields
        at = self.locate_frames(record.frames)
        rec, key = self.rec, self.stream_key
        if kind == "launch":
            stream, function, n = f[0], f[1], f[2]
            site = self._sites.pop((threading.get_ident(), function), None)
            self.launch(stream, function, None if n < 0 else f[3:3 + n], at or site)
        elif kind == "copy":
            self.copy(f[0], f[1], f[2], f[3], "native copy", at, blocking=bool(f[4]))
        elif kind == "copy_batch":
            stream, count, nattrs = f[0], f[1], f[2]
            triples = np.array(f[3:3 + 3 * count], dtype=np.int64).reshape(count, 3)
            attrs = f[3 + 3 * count:3 + 3 * count + 2 * nattrs]
            groups = [(attrs[2 * k], attrs[2 * k + 1]) for k in range(nattrs)]
            self.copy_batch(stream, triples[:, 0].copy(), triples[:, 1].copy(), triples[:, 2].copy(), groups,
                            "native cuMemcpyBatchAsync", at)
        elif kind == "memset":
            self.memset(f[0], f[1], f[2], "native memset", at)
        elif kind == "event_record":
            rec.event_recorded(f[0], key(f[1]), at=at)
        elif kind == "event_wait":
            rec.event_waited(f[1], key(f[0]), at=at)
        elif kind == "event_sync":
            rec.event_synchronized(f[0], at=at)
        elif kind == "event_query":
            rec.event_queried(f[0], bool(f[1]), at=at)
        elif kind == "stream_sync":
            rec.stream_synchronized(key(f[0]), at=at)
        elif kind == "stream_query":
            rec.stream_queried(key(f[0]), bool(f[1]), at=at)
        elif kind == "device_sync":
            rec.device_synchronized(at=at)
        elif kind == "event_create":
            rec.event_created(f[0])
        elif kind == "event_destroy":
            rec.event_deleted(f[0])
        elif kind == "map":
            self.mapped(f[0], f[1], "native cuMemMap", at)
        elif kind == "unmap":
            self.unmapped(f[0], f[1], "native cuMemUnmap", at)
        elif kind == "host_register":
            self.registered(f[0], f[1], "native cuMemHostRegister", at)
        elif kind == "host_unregister":
            self.unregistered(f[0], "native cuMemHostUnregister", at)
        elif kind == "capture_begin":
            rec.capture_began(key(f[0]), at)
        elif kind == "capture_end":
            rec.capture_ended(key(f[0]), f[1])
        elif kind == "graph_instantiate":
            rec.graph_instantiated(f[0], f[1])
        elif kind == "graph_destroy":
            rec.graph_destroyed(graph=f[0])
        elif kind == "graph_exec_destroy":
            rec.graph_destroyed(graph_exec=f[0])
        elif kind == "host_touch":
            self.touched_by_host(f[0], bool(f[1]), f[2], f[3], self.locate_text(text_frames(f[4:])))
        elif kind == "graph_launch":
            at = at or self._sites.pop((threading.get_ident(), GRAPH), None)
            if not rec.graph_launched(f[0], key(f[1]), at):
                rec.notes[f"{GRAPHS} {at or '?'}"] += 1
        else:  # "unmodelled": the driver function's name, from CUPTI's constant string
            name = ctypes.string_at(f[1]).decode() if len(f) > 1 and f[1] else f"callback {f[0]}"
            rec.notes[f"{UNMODELLED} {name}"] += 1
