"""The recorder's state: what the program asked the device to do, in host program order.

``Recorder`` turns what the hooks report (``kvverify.record.capture.hooks``: the observed event and
stream methods, the caching allocator's log; ``kvverify.record.capture.dispatch``: every aten op, copy
and batched swap) into ops of the trace format
(``docs/trace-format.md``), each with ``at``, where the user's code issued it. It knows nothing
of torch: everything reaches it as integers (stream and event handles, byte addresses), which is
what lets the CPU tests drive it with synthetic events.

Streams and events get readable, unique names: ``default`` (the legacy default stream),
``stream1 (offload.py:41)`` (where the program first used it), ``event3 (offload.py:57)`` (where
it was first recorded). An event handle that CUDA creates again after a destroy is a new event
(a wait on it orders nothing until it is recorded again), as is the case in CUDA.

Work reported while an op runs (a Python custom op that records an event) is held back until the
op itself is in the log: the event then captures the op's work.

Lifetimes (trace format 1.2): the allocators' own ordering is written as ops, so that bytes a new
owner receives can be one buffer with their old owner's (``kvverify.record.trace.writer``):

- torch's caching allocator hands a freed block out again on the stream it was freed on (stream
  order covers that), and after ``Tensor.record_stream(s)`` only once an event it recorded on ``s``
  at the free has completed: a ``record`` on each such stream at the free, a ``query_event`` that
  returned true at the reuse;
- torch's pinned host allocator records an event on the stream of each non-blocking copy from or
  to one of its blocks and hands the block out again once those events have completed: a
  ``record`` after the copy, the same ``query_event`` at the reuse; copies it does not see (a raw
  pointer in a batched swap) get no event, and their bytes are reused under them;
- memory released with no ordering of its own (``cudaFreeHost`` of kvverify's host memory, a pool
  of the program's own: ``kvverify.record.free`` / ``reuse``) is a ``free`` op.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvverify.record.trace.memory import MemoryMap, Span


class Depth(threading.local):
    """Per thread: how deep it is in some code (the recorder's own; a queue's put or get)."""

    depth = 0


INSIDE = Depth()
"""How deep this thread is in the recorder's own code, whose locks and calls are not the program's."""


def busy() -> bool:
    """True while this thread runs the recorder's own code."""
    return INSIDE.depth > 0


LEGACY_STREAM, CU_STREAM_LEGACY, PER_THREAD_STREAM = 0, 1, 2
"""The legacy default stream (torch's default stream: handle 0, and ``CU_STREAM_LEGACY``), one per
device, and ``cudaStreamPerThread`` (``CU_STREAM_PER_THREAD``), one per device and host thread."""
DEFAULT_STREAMS = frozenset((LEGACY_STREAM, CU_STREAM_LEGACY, PER_THREAD_STREAM))
"""The special handles (``Recorder.stream_key``)."""
STREAM_ITEMS = frozenset(("kernel", "copy", "copy_batch", "record", "wait_event"))
"""The ops the recorder logs that are items of their stream."""
IMPLICIT = "implicit synchronization with the legacy default stream"
HERE = object()
"""``at`` of a report made where it happens: the recorder locates the user's frame itself."""


class NativeRecord(NamedTuple):
    """One record of the native log (``kvverify.record.capture.native``): ``kind`` (``"alloc"`` and
    ``"free"``: torch's caching allocator handed out a block, a free was asked for, fields
    ``address, size, stream, device``; the driver calls of native capture), its ``fields``, the
    ``(code, line)`` frames of the call, innermost first (``(file, line, function)`` where they
    were read as text, the thread having released the GIL; empty: not known), and ``when`` the
    call ran (``Recorder.when``; None: not known)."""

    kind: str
    fields: list
    frames: tuple = ()
    when: tuple[int, int] | None = None


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


class _Exclusive:
    """``Recorder.exclusive()``: a reentrant lock whose methods are bound before a recording
    observes the lock types' (``kvverify.record.capture.threads``), and the thread's depth in the
    recorder's own code."""

    def __init__(self) -> None:
        lock = threading.RLock()
        self._acquire, self._release = lock.acquire, lock.release

    def __enter__(self) -> None:
        self._acquire()
        INSIDE.depth += 1

    def __exit__(self, *exc) -> None:
        INSIDE.depth -= 1
        self._release()


class _PerThread(threading.local):
    """Per thread: whether an op of it runs, what it reported meanwhile (held back), and whether
    it is taking the allocator's reports."""

    in_op = False
    held = None
    collecting = False
    when = None  # the span of the call whose ops it logs now (Recorder.when)


def short_at(at: str | None) -> str:
    """``offload.py:41`` from ``engine/offload.py:41 in store``: how names point at code."""
    if not at:
        return "?"
    return os.path.basename(at.split(" in ", 1)[0])


class Recorder:
    """The op log of one recording, fed by the hooks.

    ``locate``: returns the ``at`` string of the user's frame (``kvverify.record.capture.frames.Locator``);
    ``locate(depth)`` starts looking ``depth`` frames above its caller (default 1: the caller).
    Stream keys are hashable values chosen by the caller: a handle (``int``), or ``(handle,
    device)`` for the per-device special handles (see ``stream_key``).

    Host threads (trace format 1.2): the thread that makes the recorder is the first; others are
    added with ``thread_started``, and each op they log carries their name (``"thread"``). Ops are
    logged in the order they were observed; what several threads report goes through
    ``exclusive()``, which the hooks and the dispatcher take around their work.

    The caching allocator and native capture report from C++ into a log of their own, whatever
    thread makes the call (the platform sets ``pending``, a cheap check that any thread has
    records, and ``take(thread)``, which removes and returns that thread's ``NativeRecord``s);
    ``collect`` logs this thread's before anything else it logs: allocations and frees here, the
    driver calls through ``native`` (set by the session; None: none are captured).
    """

    def __init__(self, locate: Callable[..., str | None]) -> None:
        self.locate = locate
        self.memory = MemoryMap()
        self.ops: list[dict] = []
        self.notes: Counter = Counter()  # what the summary should mention, and how often
        self._streams: dict[object, str] = {}
        self._events: dict[int, str] = {}  # handle -> name of its current incarnation
        self._event_serial = 0
        self._stream_serial = 0
        self._local = _PerThread()
        self.first = threading.get_ident()
        self.threads: dict[int, str] = {self.first: threading.current_thread().name}  # ident -> name, now
        # every thread's name, in the order they came: an ident names another thread once its
        # thread ended and the system reuses it, the name stays its thread's
        self.names: list[str] = [self.threads[self.first]]
        self.followed: set[int] = {self.first}  # every ident a followed thread had, ended ones too
        self._exclusive = _Exclusive()
        self._short: dict[str, str] = {}  # at -> short_at(at), for the names of new events
        self._stream_uses: dict[int, dict] = {}  # allocation index -> streams of record_stream (keys, in order)
        # freed blocks the caching allocator holds back: (base, end, events recorded at the free)
        self._fences: list[tuple[int, int, tuple[str, ...]]] = []
        self._host_fences: dict[int, list[str]] = {}  # pinned allocation index -> events torch's pinned allocator waits for
        # CUDA graphs: stream name -> ops captured on it so far; graph -> its ops; graph exec -> graph
        self._capturing: dict[str, list[dict]] = {}
        # events recorded in a capture (name -> its template): a stream that waits on one joins the
        # capture (CUDA's fork into another stream), and what it is issued is the graph's too
        self._captured_events: dict[str, list[dict]] = {}
        self._graphs: dict[int, list[dict]] = {}
        self._execs: dict[int, list[dict]] = {}  # graph exec -> the captured ops it was made from
        self.pending: Callable[[], bool] = lambda: False
        self.take: Callable[[int], list[NativeRecord]] = lambda thread: []
        self.native: Callable[[NativeRecord], None] | None = None
        # (blocking, device) of a stream handle, where the platform can tell (None: it cannot; the
        # stream is then taken for a non-blocking one: no implicit synchronization, a report too many)
        self.stream_info: Callable[[int], tuple[bool, int] | None] = lambda handle: None
        self._kinds: dict[str, tuple[bool, int]] = {}  # stream name -> (blocking, device; -1: unknown)
        self._legacy: dict[int | None, str] = {}  # device -> the name of its legacy default stream
        self._items: dict[str, int] = {}  # stream name -> the program's items logged on it
        self._synced: dict[tuple[str, str], int] = {}  # (stream, other) -> other's items it waited for

    # -- names -------------------------------------------------------------------------------

    @staticmethod
    def stream_key(handle: int, device: int | None) -> object:
        """The key of stream ``handle`` on ``device``, as issued from the calling thread: the legacy
        default stream (0, ``CU_STREAM_LEGACY``) exists once per device, ``cudaStreamPerThread``
        once per device and host thread (CUDA "Default stream": each host thread has its own), the
        others once per process (``device`` may be None for them)."""
        if handle == PER_THREAD_STREAM:
            return (handle, device, threading.get_ident())
        return (LEGACY_STREAM, device) if handle in DEFAULT_STREAMS else handle

    def stream(self, key: object, at: str | None) -> str:
        """The trace name of a stream, given at its first use."""
        name = self._streams.get(key)
        if name is None:
            if isinstance(key, tuple):
                device = key[1]
                if key[0] == PER_THREAD_STREAM:
                    base = f"per-thread default of {self.threads.get(key[2]) or f'thread {key[2]:#x}'}"
                    self._kinds[base if device == 0 else f"{base} (cuda:{device})"] = (True, device)
                else:
                    base = "default"
                name = base if device == 0 else f"{base} (cuda:{device})"
            else:
                self._stream_serial += 1
                name = f"stream{self._stream_serial} ({self._short_at(at)})"
                info = self.stream_info(key)
                if info is not None:
                    self._kinds[name] = info
            if isinstance(key, tuple) and key[0] == LEGACY_STREAM:
                self._legacy[key[1]] = name
            self._streams[key] = name
        return name

    def _implicit(self, op: dict) -> None:
        """Before ``op`` (an item of its stream) is logged: the synchronization CUDA adds between the
        legacy default stream and the blocking streams of its device ("Stream synchronization
        behavior": work on the legacy stream waits for the earlier work of every blocking stream,
        and work on a blocking stream for the earlier work of the legacy stream), written as a
        record and a wait where the other side has new work since the last one."""
        name = op["stream"]
        legacy_of = {device: legacy for device, legacy in self._legacy.items()}
        device = next((d for d, legacy in legacy_of.items() if legacy == name), None)
        if device is not None:
            others = [b for b, (blocking, d) in self._kinds.items() if blocking and d in (device, -1)]
        else:
            kind = self._kinds.get(name)
            if kind is None or not kind[0]:
                return
            others = [legacy for d, legacy in legacy_of.items() if d == kind[1] or kind[1] == -1]
        for other in others:
            issued = self._items.get(other, 0)
            if issued > self._synced.get((name, other), 0):
                self._synced[(name, other)] = issued
                self._event_serial += 1
                event = f"implicit{self._event_serial} ({self._short_at(op.get('at'))})"
                for implied in ({"op": "record", "event": event, "stream": other},
                                {"op": "wait_event", "stream": name, "event": event}):
                    implied.update(name=IMPLICIT, at=op.get("at"))
                    for key in ("thread", "when"):  # (the same call's)
                        if key in op:
                            implied[key] = op[key]
                    self.ops.append(implied)

    def _event(self, handle: int, at: str | None) -> str:
        name = self._events.get(handle)
        if name is None:
            self._event_serial += 1
            name = self._events[handle] = f"event{self._event_serial} ({self._short_at(at)})"
        return name

    def _short_at(self, at: str | None) -> str:
        # a transfer makes new events at the same lines at every step
        short = self._short.get(at)
        if short is None:
            short = self._short[at] = short_at(at)
        return short

    # -- threads -----------------------------------------------------------------------------

    def thread_started(self, ident: int, name: str) -> str:
        """Record the thread ``ident`` from now on, under ``name`` (made unique); returns it."""
        taken = set(self.names)
        unique, k = name, 1
        while unique in taken:
            k += 1
            unique = f"{name} #{k}"
        self.threads[ident] = unique
        self.names.append(unique)
        self.followed.add(ident)
        return unique

    def thread_ended(self, ident: int) -> None:
        """The thread ``ident`` ended: the system may give its ident to a thread the recording does
        not follow, whose work must not pass for this one's (its name stays in ``names``)."""
        self.threads.pop(ident, None)

    def exclusive(self) -> _Exclusive:
        """A context manager: this thread holds the recorder while it logs (reentrant), and is
        inside the recorder's own code meanwhile (``busy()``)."""
        return self._exclusive

    # -- the log -----------------------------------------------------------------------------

    def collect(self) -> None:
        """Log what the caching allocator reported on this thread since the last ``collect``, in
        the order it happened: called before anything else this thread logs, and by the dispatcher
        hook between an op's return and its own entry (the op's fresh blocks, what it freed)."""
        if not self.pending():
            return
        local = self._local
        if local.collecting:  # a free's record_stream events are logged while collecting
            return
        with self._exclusive:
            local.collecting = True
            try:
                for record in self.take(threading.get_ident()):
                    if record.kind == "alloc":
                        self.memory_allocated(record.fields[0])
                    elif record.kind == "free":
                        self.memory_freed(record.fields[0])
                    elif self.native is not None:
                        local.when = record.when
                        self.native(record)
            finally:
                local.collecting = False
                local.when = None

    def when(self, span: tuple[int, int] | None) -> None:
        """The ops this thread logs from now on (until ``when(None)``) are of one call that ran in
        ``span``: ``(t0, t1)``, ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, as the native log's
        records) taken before the call began and after it returned. Two threads' calls whose spans
        do not overlap reached the driver in span order (``threads.unordered_sharing``)."""
        self._local.when = span

    def _log(self, op: dict) -> None:
        self.collect()
        if "when" not in op and self._local.when is not None:
            op["when"] = self._local.when
        if self._capturing:
            template = self._capturing.get(op.get("stream"))
            if template is None and op["op"] == "wait_event" and op["event"] in self._captured_events:
                # the stream waits on an event recorded in a capture: it is captured from now on
                template = self._capturing[op["stream"]] = self._captured_events[op["event"]]
            if template is not None:
                if op["op"] == "record":
                    self._captured_events[op["event"]] = template
                template.append(op)  # runs at each launch of the graph, not now
                return
        if self._captured_events and op["op"] == "record":
            self._captured_events.pop(op["event"], None)
        ident = threading.get_ident()
        if ident != self.first:
            op["thread"] = self.threads[ident]
        if op["op"] in STREAM_ITEMS and self._legacy and self._kinds:
            self._implicit(op)
        if op["op"] in STREAM_ITEMS:
            self._items[op["stream"]] = self._items.get(op["stream"], 0) + 1
        self.ops.append(op)

    def _held(self) -> list[dict]:
        """What this thread reported while its current op runs."""
        return self._local.held or []

    def _emit(self, op: dict) -> None:
        local = self._local
        if local.in_op:
            if local.held is None:
                local.held = []
            if local.when is not None:
                op["when"] = local.when
            local.held.append(op)
        else:
            self._log(op)

    def begin_op(self) -> None:
        """An op starts running on this thread: hold back what it reports until ``end_op``."""
        self.collect()
        self._local.in_op = True

    def in_op(self) -> bool:
        """Whether an op of this thread runs (``begin_op``) and is not in the log yet."""
        return self._local.in_op

    def end_op(self) -> None:
        """The op is in the log (or failed): release what was reported while it ran."""
        local = self._local
        local.in_op = False
        if local.held is not None:
            held, local.held = local.held, None
            for op in held:
                self._log(op)

    def issued(self, op: dict) -> None:
        """Log device work or a host access built by the dispatcher hook (``op`` in the format of
        this module: spans instead of ranges). Goes before anything held back."""
        self._log(op)

    def unseen(self, sync: str, at: str | None) -> None:
        """A stretch of the program this recording did not see ends here (a recording nested in
        it ran): the device is synchronized, then every thread it ever followed releases ``sync``
        and every one still followed acquires it (trace format 1.2, rules 4 and 8; a thread that
        ended logs nothing more), so that what any of them did before is ordered before what any
        does after, and no pair across the stretch is decided."""
        self.device_synchronized(at=at)
        first = self.names[0]
        for kind, names in (("release", self.names), ("acquire", list(self.threads.values()))):
            for name in names:
                op = {"op": kind, "sync": sync}
                if name != first:
                    op["thread"] = name
                self.ops.append(op)

    def host_synchronized(self, kind: str, sync: str) -> None:
        """This thread released (``kind="release"``) or acquired (``"acquire"``) the host
        synchronization object named ``sync`` (trace format 1.2, rule 8)."""
        self._log({"op": kind, "sync": sync})

    # -- streams, events, synchronization (the observed methods) ----------------------------------

    def event_created(self, handle: int) -> None:
        """CUDA made an event at ``handle``: a new event, whatever the handle named before."""
        self._events.pop(handle, None)

    def event_deleted(self, handle: int) -> None:
        """``cudaEventDestroy``: the handle names nothing until CUDA makes an event there again."""
        self._events.pop(handle, None)

    def event_recorded(self, handle: int, stream: object, at: str | None | object = HERE) -> None:
        """``cudaEventRecord``: the event captures the work issued to ``stream`` so far."""
        at = self.locate() if at is HERE else at
        self._emit({"op": "record", "event": self._event(handle, at), "stream": self.stream(stream, at), "at": at})

    def event_waited(self, handle: int, stream: object, at: str | None | object = HERE) -> None:
        """``cudaStreamWaitEvent``: later work on ``stream`` waits for the event's capture."""
        at = self.locate() if at is HERE else at
        self._emit({"op": "wait_event", "stream": self.stream(stream, at), "event": self._event(handle, at), "at": at})

    def event_synchronized(self, handle: int, at: str | None | object = HERE) -> None:
        """``cudaEventSynchronize``: the host continues once the capture completed."""
        at = self.locate() if at is HERE else at
        self._emit({"op": "sync_event", "event": self._event(handle, at), "at": at})

    def event_queried(self, handle: int, result: bool, at: str | None | object = HERE) -> None:
        """``Event.query()`` returned ``result`` (true orders the captured work, false nothing)."""
        at = self.locate() if at is HERE else at
        self._emit({"op": "query_event", "event": self._event(handle, at), "result": bool(result), "at": at})

    def stream_synchronized(self, stream: object, at: str | None | object = HERE) -> None:
        """``cudaStreamSynchronize`` (also inside a blocking copy)."""
        at = self.locate() if at is HERE else at
        self._emit({"op": "sync_stream", "stream": self.stream(stream, at), "at": at})

    def synchronized_by_op(self, stream: object, at: str | None) -> None:
        """The op being logged synchronizes ``stream`` (a blocking copy does, through
        ``at::cuda::memcpy_and_sync``): logged once, whether or not torch reported it meanwhile."""
        name = self.stream(stream, at)
        if any(op["op"] == "sync_stream" and op["stream"] == name for op in self._held()):
            return
        self._emit({"op": "sync_stream", "stream": name, "at": at})

    def stream_queried(self, stream: object, result: bool, at: str | None | object = HERE) -> None:
        """``Stream.query()``: true says all work issued to it so far has completed, which the
        format says as a fresh event recorded there and queried with result true."""
        if not result:
            return
        at = self.locate() if at is HERE else at
        self._event_serial += 1
        event = f"query{self._event_serial} ({self._short_at(at)})"
        self._emit({"op": "record", "event": event, "stream": self.stream(stream, at), "at": at})
        self._emit({"op": "query_event", "event": event, "result": True, "at": at})

    def stream_waited(self, stream: object, other: object, at: str | None | object = HERE) -> None:
        """``torch.Stream.wait_stream(other)``: an event torch records on ``other`` and ``stream``
        waits for (written with a name of its own)."""
        at = self.locate() if at is HERE else at
        self._event_serial += 1
        event = f"wait{self._event_serial} ({self._short_at(at)})"
        self._emit({"op": "record", "event": event, "stream": self.stream(other, at), "at": at})
        self._emit({"op": "wait_event", "stream": self.stream(stream, at), "event": event, "at": at})

    def capture_began(self, stream: object, at: str | None) -> None:
        """``cudaStreamBeginCapture``: what is issued to ``stream`` from now on is captured into a
        graph (it runs when the graph is launched, not now)."""
        self._capturing[self.stream(stream, at)] = []

    def capture_ended(self, stream: object, graph: int) -> None:
        """``cudaStreamEndCapture``: the ops captured on ``stream`` (and on the streams that joined
        its capture through its events) are graph ``graph``'s. A capture whose begin the recording
        did not see (it began before) makes a graph whose work is not known: its launches are
        missed work (``graph_launched`` returns False), not an empty graph."""
        template = self._capturing.pop(self.stream(stream, None), None)
        if template is None:
            self._graphs.pop(graph, None)  # (a handle CUDA may have given an older graph)
            return
        for name in [name for name, ops in self._capturing.items() if ops is template]:
            del self._capturing[name]
        for event in [event for event, ops in self._captured_events.items() if ops is template]:
            del self._captured_events[event]
        self._graphs[graph] = template

    def graph_instantiated(self, graph_exec: int, graph: int) -> None:
        """``cudaGraphInstantiate``: the executable graph holds a copy of ``graph``'s work, which
        outlives ``graph`` (torch destroys the graph right after instantiating it)."""
        ops = self._graphs.get(graph)
        if ops is None:
            self._execs.pop(graph_exec, None)  # a graph the recording did not capture: its work is unknown
        else:
            self._execs[graph_exec] = ops

    def graph_destroyed(self, graph: int | None = None, graph_exec: int | None = None) -> None:
        """``cuGraphDestroy`` / ``cuGraphExecDestroy``: a graph the program makes at the handle
        later (the explicit graph API, which the recording does not follow) is not this one; the
        executable graphs made from a destroyed graph keep its work."""
        self._graphs.pop(graph, None)
        self._execs.pop(graph_exec, None)

    def graph_launched(self, graph_exec: int, stream: object, at: str | None) -> bool:
        """``cudaGraphLaunch``: the graph's ops run on ``stream`` now, in the order they were captured
        (the graph starts after ``stream``'s earlier work, and its later work waits for all of it),
        each event recorded in it a new one at each launch. False where the graph was not
        captured while recording (nothing is logged)."""
        ops = self._execs.get(graph_exec)
        if ops is None:
            return False
        launch = self.stream(stream, at)
        renamed: dict[str, str] = {}
        for op in ops:
            replay = dict(op, stream=launch, at=op.get("at") or at)
            replay["name"] = f"graph replay ({short_at(at)}): {op.get('name') or op['op']}"
            if "event" in op:
                if op["op"] == "record":
                    self._event_serial += 1
                    renamed[op["event"]] = f"{op['event']} #{self._event_serial}"
                replay["event"] = renamed.get(op["event"], op["event"])
            self._log(replay)
        return True

    def device_synchronized(self, at: str | None | object = HERE) -> None:
        """``cudaDeviceSynchronize``."""
        self._emit({"op": "sync_device", "at": self.locate() if at is HERE else at})

    # -- memory (the allocator's reports, allocations the dispatcher sees) ------------------

    def memory_allocated(self, address: int) -> None:
        """The caching allocator handed out a block at ``address``: whatever the map held
        there is gone (the block's size comes with the tensor that receives it: ``allocated``)."""
        self.memory.retire(address)

    def memory_freed(self, address: int) -> None:
        """The caching allocator took the block at ``address`` back. Where the program called
        ``record_stream`` on it, the allocator records an event on each of those streams now and
        hands the block out again only once they completed (PyTorch, ``CUDACachingAllocator``:
        ``insert_events`` / ``process_events``): written as a ``record`` per stream here and a
        true ``query_event`` at the reuse (``allocated``)."""
        freed = self.memory.retire(address)
        if freed is None:
            return
        uses = self._stream_uses.pop(freed.index, None)
        if not uses:
            return
        at = self.locate()
        events = []
        for stream in uses:
            self._event_serial += 1
            event = f"free{self._event_serial} ({self._short_at(at)})"
            # logged now, not held back until an op that runs meanwhile is: the allocator records
            # the event at the free, before the rest of that op's work (which it must not capture)
            self._log({"op": "record", "event": event, "stream": self.stream(stream, at), "at": at,
                       "name": "caching allocator: record_stream event at the free"})
            events.append(event)
        self._fences.append((freed.base, freed.end, tuple(events)))

    def stream_used(self, address: int, stream: object) -> None:
        """``Tensor.record_stream(stream)`` on the tensor whose storage starts at ``address``."""
        a = self.memory.find(address)
        if a is not None:
            self._stream_uses.setdefault(a.index, {})[stream] = None

    def host_copy_fenced(self, allocation: int, stream: object, at: str | None) -> None:
        """The copy just logged is a non-blocking copy from or to pinned ``allocation`` on
        ``stream``: torch's pinned allocator records an event on the stream after it
        (``CachingHostAllocator_recordEvent``) and waits for it before handing the block out
        again. The event gets a name of its own: the allocator takes its events from a pool, and
        the same CUDA event recorded again for another block must not stand for this record."""
        self._event_serial += 1
        event = f"pinned{self._event_serial} ({self._short_at(at)})"
        self._log({"op": "record", "event": event, "stream": self.stream(stream, at), "at": at,
                   "name": "pinned allocator: its event after a copy from or to the block"})
        self._host_fences.setdefault(allocation, []).append(event)

    def allocated(self, base: int, size: int, space: str, origin: str, at: str | None):
        """Memory just handed to a new owner (an op's fresh output, new host memory); returns its
        ``Allocation``. Where an allocator reuses bytes only after events completed, the host has
        learnt so: a true ``query_event`` of each, logged before the new owner's first access."""
        self.collect()
        end = base + size
        if self._fences:
            keep = []
            for fence in self._fences:
                if fence[0] < end and base < fence[1]:
                    self._queried_true(fence[2], at)
                else:
                    keep.append(fence)
            self._fences = keep
        for old in self.memory.overlapping(base, end):
            events = self._host_fences.pop(old.index, None)
            if events:
                self._queried_true(events, at)
            if old.space != space and not old.placeholder:
                # bytes that change kind here (pageable memory registered, host memory freed unseen
                # and made device memory) stay two buffers in the trace: the old kind ends with a free
                self.released([(old.index, 0, old.size)], f"{old.space} memory becomes {space}", at)
        return self.memory.fresh(base, size, space, origin, at)

    def _queried_true(self, events, at: str | None) -> None:
        for event in events:
            self.issued({"op": "query_event", "event": event, "result": True, "at": at,
                         "name": "allocator: the block's events completed before it was handed out again"})

    def released(self, spans: Sequence[Span], name: str | None, at: str | None, after: str | None = None) -> None:
        """The host thread releases ``spans`` now (trace format 1.2 ``free``): device work on them
        that is not ordered before this point races with it (use after free). ``after``: what the
        bytes are once released, where known: ``"reused"`` (the program's own pool hands them to a
        new owner: still its memory) or ``"unmapped"`` (``cuMemUnmap``: the virtual range stays
        reserved with no memory behind it); a device witness stands in for the next owner there
        (``kvverify.record.confirm.witness``)."""
        if spans:
            op = {"op": "free", "ranges": tuple(spans), "name": name, "at": at}
            if after is not None:
                op["after"] = after
            self.issued(op)

    # -- device work and host accesses ----------------------------------------------------------

    def kernel(self, stream: object, name: str, reads: Sequence[Span], writes: Sequence[Span],
               at: str | None) -> None:
        """A kernel on ``stream``: its accesses happen in stream order (spans: allocation index,
        offset and length in bytes)."""
        self._log({"op": "kernel", "stream": self._streams.get(stream) or self.stream(stream, at), "name": name,
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
