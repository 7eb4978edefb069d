"""The recorder's state: what the program asked the device to do, in host program order.

``Recorder`` turns what the hooks report (``kvverify.record.hooks``: torch's GPU-trace callbacks
for streams, events and synchronization, the patched ``query()`` methods; ``kvverify.record.
dispatch``: every aten op, copy and batched swap) into ops of the trace format
(``docs/trace-format.md``), each with ``at``, where the user's code issued it. It knows nothing
of torch: everything reaches it as integers (stream and event handles, byte addresses), which is
what lets the CPU tests drive it with synthetic events.

Streams and events get readable, unique names: ``default`` (the legacy default stream),
``stream1 (offload.py:41)`` (where the program first used it), ``event3 (offload.py:57)`` (where
it was first recorded). An event handle that CUDA creates again after a destroy is a new event
(a wait on it orders nothing until it is recorded again), as is the case in CUDA.

Work reported while an op runs (torch records an event after a non-blocking copy, a blocking
copy synchronizes its stream) is held back until the op itself is in the log: the event then
captures the copy, as it does on the device.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvverify.record.memory import MemoryMap, Span

LEGACY_STREAM, PER_THREAD_STREAM = 0, 2
"""``cudaStreamLegacy`` (torch's default stream, handle 0) and ``cudaStreamPerThread``: one per device."""


@dataclass(frozen=True)
class CopyArrays:
    """The copies of one batched swap, resolved: int64 numpy arrays of shape ``(n,)``.

    ``src_index`` / ``dst_index`` are allocation indices (``MemoryMap.allocations``); offsets and
    ``size`` are in bytes."""

    src_index: object
    src_offset: object
    dst_index: object
    dst_offset: object
    size: object


def short_at(at: str | None) -> str:
    """``offload.py:41`` from ``tests/offload.py:41 in store``: how names point at code."""
    if not at:
        return "?"
    return os.path.basename(at.split(" in ", 1)[0])


class Recorder:
    """The op log of one recording, fed by the hooks.

    ``locate``: returns the ``at`` string of the user's frame (``kvverify.record.frames.Locator``).
    Stream keys are hashable values chosen by the caller: a handle (``int``), or ``(handle,
    device)`` for the per-device special handles (see ``stream_key``).
    """

    def __init__(self, locate: Callable[[], str | None]) -> None:
        self.locate = locate
        self.memory = MemoryMap()
        self.ops: list[dict] = []
        self.notes: Counter = Counter()  # what the summary should mention, and how often
        self._streams: dict[object, str] = {}
        self._events: dict[int, str] = {}  # handle -> name of its current incarnation
        self._event_serial = 0
        self._stream_serial = 0
        self._in_op = False
        self._held: list[dict] | None = None  # ops reported while an op runs

    # -- names -------------------------------------------------------------------------------

    @staticmethod
    def stream_key(handle: int, device: int) -> object:
        """The key of stream ``handle`` on ``device``: the special handles (legacy and
        per-thread default streams) exist once per device, the others once per process."""
        return (handle, device) if handle in (LEGACY_STREAM, 1, PER_THREAD_STREAM) else handle

    def stream(self, key: object, at: str | None) -> str:
        """The trace name of a stream, given at its first use."""
        name = self._streams.get(key)
        if name is None:
            if isinstance(key, tuple):
                handle, device = key
                base = "default" if handle != PER_THREAD_STREAM else "per-thread default"
                name = base if device == 0 else f"{base} (cuda:{device})"
            else:
                self._stream_serial += 1
                name = f"stream{self._stream_serial} ({short_at(at)})"
            self._streams[key] = name
        return name

    def _event(self, handle: int, at: str | None) -> str:
        name = self._events.get(handle)
        if name is None:
            self._event_serial += 1
            name = self._events[handle] = f"event{self._event_serial} ({short_at(at)})"
        return name

    # -- the log -----------------------------------------------------------------------------

    def _emit(self, op: dict) -> None:
        if self._in_op:
            if self._held is None:
                self._held = []
            self._held.append(op)
        else:
            self.ops.append(op)

    def begin_op(self) -> None:
        """An op starts running: hold back what is reported until ``end_op``."""
        self._in_op = True

    def end_op(self) -> None:
        """The op is in the log (or failed): release what was reported while it ran."""
        self._in_op = False
        if self._held is not None:
            held, self._held = self._held, None
            for op in held:
                self.ops.append(op)

    def issued(self, op: dict) -> None:
        """Log device work or a host access built by the dispatcher hook (``op`` in the format of
        this module: spans instead of ranges). Goes before anything held back."""
        self.ops.append(op)

    # -- streams, events, synchronization (GPU-trace callbacks and patched methods) ------------

    def event_created(self, handle: int) -> None:
        """CUDA made an event at ``handle``: a new event, whatever the handle named before."""
        self._events.pop(handle, None)

    def event_deleted(self, handle: int) -> None:
        """``cudaEventDestroy``: the handle names nothing until CUDA makes an event there again."""
        self._events.pop(handle, None)

    def event_recorded(self, handle: int, stream: object) -> None:
        """``cudaEventRecord``: the event captures the work issued to ``stream`` so far."""
        at = self.locate()
        self._emit({"op": "record", "event": self._event(handle, at), "stream": self.stream(stream, at), "at": at})

    def event_waited(self, handle: int, stream: object) -> None:
        """``cudaStreamWaitEvent``: later work on ``stream`` waits for the event's capture."""
        at = self.locate()
        self._emit({"op": "wait_event", "stream": self.stream(stream, at), "event": self._event(handle, at), "at": at})

    def event_synchronized(self, handle: int) -> None:
        """``cudaEventSynchronize``: the host continues once the capture completed."""
        at = self.locate()
        self._emit({"op": "sync_event", "event": self._event(handle, at), "at": at})

    def event_queried(self, handle: int, result: bool) -> None:
        """``Event.query()`` returned ``result`` (true orders the captured work, false nothing)."""
        at = self.locate()
        self._emit({"op": "query_event", "event": self._event(handle, at), "result": bool(result), "at": at})

    def stream_synchronized(self, stream: object) -> None:
        """``cudaStreamSynchronize`` (also inside a blocking copy)."""
        at = self.locate()
        self._emit({"op": "sync_stream", "stream": self.stream(stream, at), "at": at})

    def synchronized_by_op(self, stream: object, at: str | None) -> None:
        """The op being logged synchronizes ``stream`` (a blocking copy does, through
        ``at::cuda::memcpy_and_sync``): logged once, whether or not torch reported it meanwhile."""
        name = self.stream(stream, at)
        if any(op["op"] == "sync_stream" and op["stream"] == name for op in self._held or ()):
            return
        self._emit({"op": "sync_stream", "stream": name, "at": at})

    def stream_queried(self, stream: object, result: bool) -> None:
        """``Stream.query()``: true says all work issued to it so far has completed, which the
        format says as a fresh event recorded there and queried with result true."""
        if not result:
            return
        at = self.locate()
        self._event_serial += 1
        event = f"query{self._event_serial} ({short_at(at)})"
        self._emit({"op": "record", "event": event, "stream": self.stream(stream, at), "at": at})
        self._emit({"op": "query_event", "event": event, "result": True, "at": at})

    def device_synchronized(self) -> None:
        """``cudaDeviceSynchronize``."""
        self._emit({"op": "sync_device", "at": self.locate()})

    # -- memory (allocator callbacks) ------------------------------------------------------

    def memory_allocated(self, address: int) -> None:
        """The caching allocator handed out a block at ``address``: whatever the map held
        there is gone (the block's size comes with the tensor that receives it)."""
        self.memory.retire(address)

    def memory_freed(self, address: int) -> None:
        """The caching allocator took the block at ``address`` back."""
        self.memory.retire(address)

    # -- device work and host accesses ----------------------------------------------------------

    def kernel(self, stream: object, name: str, reads: Sequence[Span], writes: Sequence[Span],
               at: str | None) -> None:
        """A kernel on ``stream``: its accesses happen in stream order (spans: allocation index,
        offset and length in bytes)."""
        self.issued({"op": "kernel", "stream": self.stream(stream, at), "name": name,
                     "reads": tuple(reads), "writes": tuple(writes), "at": at})

    def copy(self, stream: object, name: str, src: Span, dst: Span, at: str | None) -> None:
        """One stream-ordered copy (cudaMemcpyAsync); ``src`` and ``dst`` have one length."""
        if src[2] != dst[2]:
            raise ValueError(f"a copy moves one size: src {src[2]} bytes, dst {dst[2]} bytes ({name} at {at})")
        self.issued({"op": "copy", "stream": self.stream(stream, at), "name": name, "src": src, "dst": dst, "at": at})

    def copy_batch(self, stream: object, name: str, order: str, copies: CopyArrays, at: str | None) -> None:
        """One ``cuMemcpyBatchAsync`` with one source access ``order`` (``kvverify.terms.ORDERS``)."""
        self.issued({"op": "copy_batch", "stream": self.stream(stream, at), "name": name, "order": order,
                     "copies": copies, "at": at})

    def host_access(self, kind: str, spans: Sequence[Span], name: str | None, at: str | None) -> None:
        """The host thread reads (``kind="host_read"``) or writes (``"host_write"``) ``spans`` now."""
        if kind not in ("host_read", "host_write"):
            raise ValueError(f"a host access is host_read or host_write, got {kind!r}")
        if spans:
            self.issued({"op": kind, "ranges": tuple(spans), "name": name, "at": at})
