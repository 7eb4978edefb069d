"""The ordering rules of ``docs/trace-format.md``: the one place they are written down.

:func:`analyze` walks a trace once, in program order, with vector clocks over the *timelines*:
timeline 0 is the host thread, timeline ``1 + n`` is ``trace.streams[n]``. A clock entry ``c[t] = p``
says "everything at positions ``1..p`` of timeline ``t`` has completed". Positions:

- host: op ``i`` sits at host position ``i + 1`` (each op is one host API call);
- stream: every kernel / copy / copy_batch gets the next position of its stream.

Every range an op touches becomes an :class:`Access` with the interval its rules allow (a
kernel's or host op's touching ranges of one kind become one access: only their union matters):

- ``after`` (earliest): the access starts only after every position this clock covers;
- ``until`` (latest): ``(timeline, position)``; the access has completed before anything whose
  ``after`` clock covers that position.

So access ``a`` happens before access ``b`` exactly when ``b.after[a.until[0]] >= a.until[1]``
(:func:`happens_before`). Two accesses of one op are never ordered by this test, which is rule 7 for
copies (a kernel's own reads and writes are one piece of work: the checker does not compare them).

Rules and the CUDA behaviour they follow (CUDA Runtime API, "Stream synchronization behavior" and
"API synchronization behavior"; Driver API ``cuMemcpyBatchAsync``; ``cudaEventRecord``,
``cudaStreamWaitEvent``, ``cudaEventSynchronize``, ``cudaEventQuery``, ``cudaStreamSynchronize``,
``cudaDeviceSynchronize``) are cited where each is applied below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvverify.check.model import (
    Copy,
    CopyBatch,
    HostRead,
    HostWrite,
    Kernel,
    QueryEvent,
    Record,
    SyncDevice,
    SyncEvent,
    SyncStream,
    Trace,
    WaitEvent,
    WaitStream,
    union,
)

HOST = 0
"""Timeline index of the host thread; stream ``trace.streams[n]`` is timeline ``n + 1``."""

Clock = tuple  # tuple[int, ...], one entry per timeline


class Access(NamedTuple):
    """One byte range one op touches, with the interval the rules allow for it."""

    op: int                  # index of the op in trace.ops
    copy: int | None         # index of the copy inside a copy / copy_batch, else None
    role: str                # "read" / "write" (kernel, host), "src" / "dst" (copies)
    buffer: str
    offset: int
    length: int
    write: bool
    after: Clock             # earliest: starts after every position this clock covers
    until: tuple[int, int]   # latest: completes before whatever covers (timeline, position)
    rule: str                # what placed it: "1" host, "2" stream order, "5:ANY", "5:DURING_API_CALL", "6:src"

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def floating(self) -> bool:
        """True for a source read placed by its order or by rule 6 rather than by stream order."""
        return self.rule.startswith(("5:ANY", "5:DURING", "6:src"))


class OpOrder(NamedTuple):
    """What the rules computed for one op (used to explain races)."""

    host: Clock                      # the host's clock when the call starts (what it has observed)
    timeline: int | None = None      # stream-ordered work, waits and records: the stream's timeline
    position: int = 0                # stream-ordered work: its position on that timeline
    stream: Clock | None = None      # clock of stream-ordered work (its "after") / the stream after a wait
    capture: int | None = None       # wait_event / sync_event / query_event: op index of the record used


def happens_before(a: Access, b: Access) -> bool:
    """True when the rules order access ``a`` before access ``b``."""
    t, p = a.until
    return b.after[t] >= p


def covers(clock: Clock, timeline: int, position: int) -> bool:
    return clock[timeline] >= position


def _join(a: Clock, b: Clock) -> Clock:
    return tuple(map(max, a, b))


@dataclass
class Ordering:
    """The result of :func:`analyze`: every access of the trace, in program order, and per op
    the clocks that placed them."""

    trace: Trace
    timelines: tuple[str, ...]           # "host", then the stream names
    accesses: list[Access]
    ops: list[OpOrder]
    waits: dict[int, list[int]]          # timeline -> op indices of the waits on it, in order
    syncs: list[int]                     # op indices of host synchronizations (sync_*, query_event)
    starts: list[int]                    # accesses of op i: accesses[starts[i]:starts[i + 1]]

    def accesses_of(self, i: int) -> list[Access]:
        return self.accesses[self.starts[i]:self.starts[i + 1]]

    def timeline_of(self, stream: str) -> int:
        return self.timelines.index(stream)

    def name(self, timeline: int) -> str:
        return "host" if timeline == HOST else self.timelines[timeline]


def analyze(trace: Trace) -> Ordering:
    """Apply rules 1–7 to ``trace``; see the module docstring for what the clocks mean."""
    buffers = trace.buffers
    tl = {s: n + 1 for n, s in enumerate(trace.streams)}
    width = 1 + len(trace.streams)
    zero = (0,) * width
    stream_clock = [zero] * width      # per timeline: what the stream's next work starts after
    position = [0] * width             # per timeline: last position handed out
    events: dict[str, tuple[Clock, int]] = {}   # event -> (captured clock, op index of the record)
    host = zero                        # what the host has observed complete (rules 1, 4, 6)
    accesses: list[Access] = []
    ops: list[OpOrder] = []
    waits: dict[int, list[int]] = {t: [] for t in range(1, width)}
    syncs: list[int] = []
    append = accesses.append
    new = tuple.__new__   # Access(op, copy, role) + Range(buffer, offset, length) + (write, after, until, rule)

    starts: list[int] = []
    for i, op in enumerate(trace.ops):
        starts.append(len(accesses))
        # Rule 1, program order: the call at host position i + 1 starts after the host's
        # previous calls returned (host[0] == i); h is what anything this call starts follows.
        h = host
        done = (0, i + 1)      # "completes before the host's next op": rule 5 DURING_API_CALL, rule 6
        info = OpOrder(h)

        if isinstance(op, Kernel):
            # Rule 2 (CUDA "Stream synchronization behavior"): work on one stream runs in issue
            # order, after what the stream waits on; rule 1: and after its own issue.
            t = tl[op.stream]
            k = position[t] = position[t] + 1
            sa = _join(stream_clock[t], h)
            pos = (t, k)
            # A kernel's reads (and its writes) all happen at its place in the stream: only their
            # union matters, so touching ranges become one access.
            for r in union(op.reads):
                append(new(Access, (i, None, "read") + r + (False, sa, pos, "2")))
            for r in union(op.writes):
                append(new(Access, (i, None, "write") + r + (True, sa, pos, "2")))
            stream_clock[t] = sa[:t] + (k,) + sa[t + 1:]
            info = OpOrder(h, t, k, sa)

        elif isinstance(op, (Copy, CopyBatch)):
            t = tl[op.stream]
            k = position[t] = position[t] + 1
            sa = _join(stream_clock[t], h)
            pos = (t, k)
            order = op.order   # a plain copy (cudaMemcpyAsync) reads its source in stream order
            src_rule = "2" if isinstance(op, Copy) else f"5:{order}"
            for c, tr in enumerate(op.copies):
                src, dst = tr.src, tr.dst
                # Rule 6, dst, as amended here (NOTES.md, docs/checker.md): a copy to pageable
                # memory is NOT taken to have completed when the call returns. The format's rule
                # follows the old text of CUDA's "API synchronization behavior"; the current text
                # says transfers between device and pageable memory "might be synchronous", and on
                # an H200 (driver 580) a D2H cuMemcpyBatchAsync into pageable memory returned before
                # the copy ran. The destination is written in stream order like any other.
                until = pos
                if buffers[src.buffer].space == "host_pageable":
                    # Rule 6, src (same section: pageable memory is staged into pinned memory by
                    # the call, and the driver *may* synchronize with the stream to do so): read
                    # during the call, whatever the order. "May" is no promise, so the read is
                    # not placed after the stream's pending work, like DURING_API_CALL.
                    append(new(Access, (i, c, "src") + src + (False, h, done, "6:src")))
                elif order == "STREAM":
                    # Rule 5 STREAM (Driver API CUmemcpySrcAccessOrder, used by cuMemcpyBatchAsync:
                    # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, access to the source in stream order).
                    append(new(Access, (i, c, "src") + src + (False, sa, until, src_rule)))
                elif order == "DURING_API_CALL":
                    # Rule 5 DURING_API_CALL (CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL: out of
                    # stream order, all accesses complete before the call returns): after what
                    # the host observed complete before the call, before the host's next op, not
                    # after the stream's pending work.
                    append(new(Access, (i, c, "src") + src + (False, h, done, src_rule)))
                else:
                    # Rule 5 ANY (CU_MEMCPY_SRC_ACCESS_ORDER_ANY: out of stream order, and accesses
                    # may happen after the call returns): from the call until the copy completes
                    # in stream order; not after the stream's pending work.
                    append(new(Access, (i, c, "src") + src + (False, h, until, src_rule)))
                # The destination is always accessed in stream order (CUmemcpySrcAccessOrder).
                # Rule 7 (cuMemcpyBatchAsync: the batch as a whole executes in stream order, the
                # copies within it in no specific order): nothing orders it against its own
                # source or the other copies of the batch.
                append(new(Access, (i, c, "dst") + dst + (True, sa, until, "2")))
            stream_clock[t] = sa[:t] + (k,) + sa[t + 1:]
            info = OpOrder(h, t, k, sa)

        elif isinstance(op, (HostWrite, HostRead)):
            w = isinstance(op, HostWrite)
            role = "write" if w else "read"
            for r in union(op.ranges):
                append(new(Access, (i, None, role) + r + (w, h, done, "1")))

        elif isinstance(op, Record):
            # cudaEventRecord: the event captures all work issued to the stream so far (including
            # what the stream waits on); a later record replaces the capture (rule 3).
            t = tl[op.stream]
            events[op.event] = (stream_clock[t], i)
            info = OpOrder(h, t, 0, stream_clock[t])

        elif isinstance(op, WaitEvent):
            # cudaStreamWaitEvent: later work on the stream starts after the event's latest
            # capture (rule 2); an event never recorded orders nothing (rule 3).
            t = tl[op.stream]
            cap = events.get(op.event)
            if cap is not None:
                stream_clock[t] = _join(stream_clock[t], cap[0])
            waits[t].append(i)
            info = OpOrder(h, t, 0, stream_clock[t], cap[1] if cap else None)

        elif isinstance(op, WaitStream):
            # torch's Stream.wait_stream: record a fresh event on `on`, wait on it in `stream`.
            t, on = tl[op.stream], tl[op.on]
            stream_clock[t] = _join(stream_clock[t], stream_clock[on])
            waits[t].append(i)
            info = OpOrder(h, t, 0, stream_clock[t], i)

        elif isinstance(op, (SyncEvent, QueryEvent)):
            # Rule 4 (cudaEventSynchronize; cudaEventQuery returning cudaSuccess): the host
            # continues after the latest capture completed. Rule 3: never recorded → nothing;
            # a query that saw "not ready" tells the host nothing.
            cap = events.get(op.event)
            if cap is not None and (isinstance(op, SyncEvent) or op.result):
                host = _join(host, cap[0])
            syncs.append(i)
            info = OpOrder(h, None, 0, None, cap[1] if cap else None)

        elif isinstance(op, SyncStream):
            # Rule 4 (cudaStreamSynchronize): everything issued to the stream has completed.
            host = _join(host, stream_clock[tl[op.stream]])
            syncs.append(i)

        elif isinstance(op, SyncDevice):
            # Rule 4 (cudaDeviceSynchronize): everything issued to every stream has completed.
            for c in stream_clock[1:]:
                host = _join(host, c)
            syncs.append(i)

        # Program order: the next call starts after this one returned.
        host = (i + 1,) + host[1:]
        ops.append(info)

    starts.append(len(accesses))
    return Ordering(trace, ("host",) + tuple(trace.streams), accesses, ops, waits, syncs, starts)
