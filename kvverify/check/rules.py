"""The ordering rules of ``docs/trace-format.md`` (1–9, format 1.2): the one place they are written down.

:class:`Ordering` walks a trace op by op, in trace order, with vector clocks over the
*timelines*: timeline 0 is the host thread, timeline ``1 + n`` is ``trace.streams[n]``; with
several host threads (format 1.2), thread ``k`` is timeline ``1 + len(streams) + k`` instead of 0
(see :class:`Ordering`). A clock entry ``c[t] = p`` says "everything at positions ``1..p`` of
timeline ``t`` has completed". Positions:

- host: op ``i`` sits at position ``i + 1`` of its thread (each op is one host API call);
- stream: every kernel / copy / copy_batch gets the next position of its stream.

What an op does to one buffer in one role, placed by one rule, is a :class:`Side` (a kernel's
reads, a batch's sources...: only the union of its ranges matters to other ops); each of its
ranges, as an :class:`Access`, has the interval its rules allow:

- ``after`` (earliest): the access starts only after every position this clock covers, and
  after the host calls before its own op: with one thread its host entry is always the op's
  index, so clocks leave the host entry out (it is 0 in them) and :func:`happens_before` reads it
  from ``op``; with several, the thread's entry is the op's index;
- ``until`` (latest): ``(timeline, position)``; the access has completed before anything whose
  ``after`` clock covers that position.

So access ``a`` happens before access ``b`` exactly when ``b.after`` covers ``a.until``
(:func:`happens_before`). Two accesses of one op are never ordered by this test, which is rule 7 for
copies (a kernel's own reads and writes are one piece of work: the checker does not compare them).

Clocks are persistent (:class:`Clock`): a tuple of chunks of ``CHUNK`` entries, sharing every chunk
it can with the clock it came from, and knowing the host clock it was based on and which of its
chunks may exceed that base. The host's clock only grows, so a host synchronization or a wait
compares (and keeps) only the chunks that moved, not one entry per stream, and ``sync_device`` takes
the streams' latest positions instead of joining every stream's clock.

Rules 8 and 9 follow the host's own synchronization (a release / acquire: a lock, a queue item,
a thread's start or join) and the release of memory (a free is a write by its thread).
Rules and the CUDA behaviour they follow (CUDA Runtime API, "Stream synchronization behavior" and
"API synchronization behavior"; Driver API ``cuMemcpyBatchAsync``; ``cudaEventRecord``,
``cudaStreamWaitEvent``, ``cudaEventSynchronize``, ``cudaEventQuery``, ``cudaStreamSynchronize``,
``cudaDeviceSynchronize``) are cited where each is applied below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import NamedTuple

from kvverify.check.model import (
    PAGEABLE,
    Acquire,
    Buffer,
    Copy,
    CopyBatch,
    Free,
    HostRead,
    HostWrite,
    Kernel,
    Op,
    QueryEvent,
    Range,
    Record,
    Release,
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

_new = tuple.__new__   # a named tuple from a tuple of all its fields, without the argument machinery

CHUNK_BITS = 3
CHUNK = 1 << CHUNK_BITS          # entries per chunk of a clock
MASK = CHUNK - 1


class Clock(NamedTuple):
    """A vector clock. Entry ``t`` is ``chunks[t >> CHUNK_BITS][t & MASK]`` (:func:`entry`).

    ``base`` is the clock of host thread ``lineage`` as it was at ``version`` (a thread's host
    clock only grows, so of two versions of one lineage the later covers the earlier; versions are
    unique across threads) and every chunk not listed in ``dirty`` is that chunk of ``base`` (the
    same object): joining a clock with a later host clock of its lineage, or with a clock of another
    base of that lineage, compares only the dirty chunks (bases of two threads' lineages are
    unrelated: every chunk is compared). Chunks are shared between clocks wherever they are equal."""

    chunks: tuple[tuple[int, ...], ...]
    base: tuple[tuple[int, ...], ...]
    version: int
    dirty: tuple[int, ...]
    lineage: int = 0


def entry(clock: Clock, timeline: int) -> int:
    """The position of ``timeline`` that ``clock`` covers (0 for the host: see the module docstring)."""
    return clock.chunks[timeline >> CHUNK_BITS][timeline & MASK]


def covers(clock: Clock, timeline: int, position: int) -> bool:
    """True when ``clock`` says position ``position`` of stream timeline ``timeline`` has completed."""
    return clock.chunks[timeline >> CHUNK_BITS][timeline & MASK] >= position


def join(a: Clock, b: Clock) -> Clock:
    """The entrywise maximum of two clocks, on the later of their bases."""
    if a is b:
        return a
    if a.version < b.version:
        a, b = b, a
    # b's clean chunks are its base's, which the later base (a's) of the same lineage covers: only
    # b's dirty chunks can raise a
    chunks = None
    dirty = a.dirty
    for n in b.dirty if a.lineage == b.lineage else range(len(b.chunks)):
        x, y = a.chunks[n], b.chunks[n]
        if x is y:
            continue
        z = tuple(map(max, x, y))
        if z == x:
            continue
        if chunks is None:
            chunks = list(a.chunks)
        chunks[n] = y if z == y else z
        if n not in dirty:
            dirty += (n,)
    return a if chunks is None else _new(Clock, (tuple(chunks), a.base, a.version, dirty, a.lineage))


def _rebase(clock: Clock, host: Clock) -> Clock:
    """``clock`` joined with a host thread's clock ``host`` (of a later version where the lineage
    is the same), on ``host``'s base."""
    chunks = None
    dirty = ()
    for n in clock.dirty if clock.lineage == host.lineage else range(len(clock.chunks)):
        x, y = clock.chunks[n], host.chunks[n]
        if x is y:
            continue
        z = tuple(map(max, x, y))
        if z == y:
            continue
        if chunks is None:
            chunks = list(host.chunks)
        chunks[n] = x if z == x else z
        dirty += (n,)
    if chunks is None:
        return host
    return _new(Clock, (tuple(chunks), host.chunks, host.version, dirty, host.lineage))


def _with(clock: Clock, timeline: int, position: int) -> Clock:
    """``clock`` with one entry raised (a new chunk, the others shared)."""
    n, k = timeline >> CHUNK_BITS, timeline & MASK
    chunks = [*clock.chunks]
    chunk = [*chunks[n]]
    chunk[k] = position
    chunks[n] = tuple(chunk)
    dirty = clock.dirty
    return _new(Clock, (tuple(chunks), clock.base, clock.version, dirty if n in dirty else dirty + (n,),
                        clock.lineage))


class Access(NamedTuple):
    """One byte range one op touches, with the interval the rules allow for it."""

    op: int                  # index of the op in trace.ops
    copy: int | None         # index of the copy inside a copy / copy_batch (rule 7), else None
    role: str                # "read" / "write" (kernel, host), "src" / "dst" (copies), "free"
    buffer: str
    offset: int
    length: int
    write: bool
    after: Clock             # earliest: starts after every position this clock covers (and op's issue)
    until: tuple[int, int]   # latest: completes before whatever covers (timeline, position)
    rule: str                # what placed it: "1" host, "2" stream order, "5:ANY", "5:DURING_API_CALL",
                             # "6:src", "9" free
    also: tuple[int, int] | None = None   # latest too: before whatever covers this (see Side)

    @property
    def floating(self) -> bool:
        """True for a source read placed by its order or by rule 6 rather than by stream order."""
        return self.rule.startswith(("5:ANY", "5:DURING", "6:src"))


class Side(NamedTuple):
    """What one op does to one buffer in one role, placed by one rule: the accesses of a kernel's
    reads (or writes), a host op, a copy_batch's sources (or destinations) there. ``ranges`` are
    as the op lists them (in any order, overlapping or not): only their union matters to races
    with other ops (a batch's copies among themselves are rule 7's business, see the checker).

    ``also``: a second latest moment, for a source read during the call with several threads: it
    completes before the thread's next op (``until``) and before its copy completes in stream
    order, so work another thread queued behind the copy follows it too (None otherwise: with one
    thread, the next op's position is before everything later)."""

    op: int
    role: str
    write: bool
    after: Clock
    until: tuple[int, int]
    rule: str
    buffer: str
    ranges: Sequence[Range]
    also: tuple[int, int] | None = None

    def access(self, r: Range, copy: int | None = None) -> Access:
        """Range ``r`` of this side as an :class:`Access`."""
        return Access(self.op, copy, self.role, r[0], r[1], r[2], self.write, self.after, self.until, self.rule,
                      self.also)


_buffer = itemgetter(0)


def _sides(i: int, role: str, write: bool, after: Clock, until: tuple[int, int], rule: str,
           ranges: Sequence[Range], also: tuple[int, int] | None = None) -> list[Side]:
    """``ranges`` as sides, one per buffer."""
    new = tuple.__new__
    if len(ranges) == 1 or (buffers := len(set(map(_buffer, ranges)))) == 1:
        return [new(Side, (i, role, write, after, until, rule, ranges[0][0], ranges, also))]
    if buffers == len(ranges):    # a range per buffer (a kernel reading a few tensors)
        return [new(Side, (i, role, write, after, until, rule, r[0], [r], also)) for r in sorted(ranges)]
    by_buffer: dict[str, list[Range]] = {}
    for r in ranges:
        by_buffer.setdefault(r[0], []).append(r)
    return [new(Side, (i, role, write, after, until, rule, buf, rs, also)) for buf, rs in sorted(by_buffer.items())]


class OpOrder(NamedTuple):
    """What the rules computed for one op (used to explain races)."""

    timeline: int | None = None      # stream-ordered work, waits and records: the stream's timeline
    stream: Clock | None = None      # clock of stream-ordered work (its "after") / the stream after a wait
                                     # / a record's capture
    capture: int | None = None       # wait_event / sync_event / query_event: op index of the record used


def happens_before(a: Access, b: Access) -> bool:
    """True when the rules order access ``a`` before access ``b``."""
    t, p = a.until
    if t == HOST:
        return b.op >= p
    return covers(b.after, t, p) or a.also is not None and covers(b.after, *a.also)


class Ordering:
    """Rules 1–9 applied op by op: :meth:`step` takes the ops in trace order and returns each
    one's accesses. What explains races later is kept: the control ops (records, waits, host
    synchronizations) with their clocks, and the ops the checker asks for (:meth:`keep`).

    ``buffers``, ``streams`` and ``threads`` are the trace's declarations (``Trace.buffers``,
    ``Trace.streams``, ``Trace.threads``). Memory grows with the control ops and the streams, not
    with ops x streams: clocks share chunks.

    With one host thread (``threads`` empty or one name) program order is op order, timeline 0
    (``HOST``), read from op indices and never stored in clocks. With several, each thread has a
    timeline of its own after the streams (timeline 0 is then unused) and a clock of what it has
    observed (its *host clock*); clocks then hold thread entries, because rule 8 and rule 4 through
    rule 8 order one thread's ops after another's: a thread's entry moves into a clock where its
    program order leaves it (a ``release``, work it issues), never at each op. A thread's own entry
    in its host clock is left stale (its program order needs none).
    """

    def __init__(self, buffers: Mapping[str, Buffer], streams: Sequence[str], threads: Sequence[str] = ()):
        self.buffers = buffers
        self.threads: tuple[str, ...] = tuple(threads) if len(threads) > 1 else ()
        self.timelines: tuple[str, ...] = ("host", *streams, *self.threads)
        self.timeline_of: dict[str, int] = {s: n + 1 for n, s in enumerate(streams)}
        self._thread_index = {t: k for k, t in enumerate(self.threads)}
        self._first_thread_timeline = 1 + len(streams)
        width = len(self.timelines)
        nchunks = (width + MASK) >> CHUNK_BITS
        zero = ((0,) * CHUNK,) * nchunks
        # per thread, what it has observed complete (rules 4, 6, 8); versions unique across threads
        self._hosts = [Clock(zero, zero, k, (), k) for k in range(max(1, len(self.threads)))]
        self._versions = len(self._hosts) - 1
        self._me = 0                   # the thread of the op being stepped
        self.host = self._hosts[0]     # its host clock
        self.here = HOST if not self.threads else self._first_thread_timeline   # its timeline
        self.observed = self.host.chunks   # what every thread has observed (see _floor)
        self._stream: list[Clock] = [self.host] * width   # per timeline: what its next work starts after
        self._position = [0] * (nchunks * CHUNK)     # per timeline: last position handed out
        self._events: dict[str, tuple[Clock, int]] = {}   # event -> (captured clock, op index of the record)
        self._released: dict[str, Clock] = {}   # sync name -> the join of its releases so far (rule 8)
        self.ops: dict[int, Op] = {}          # control ops and kept ops, by index
        self.info: dict[int, OpOrder] = {}    # what the rules computed for them
        self.waits: dict[int, list[int]] = {t: [] for t in range(1, 1 + len(streams))}  # waits per stream timeline
        self.syncs: list[int] = []            # op indices of sync_event and query_event
        self.records: list[int] = []          # op indices of records
        self._current: tuple[Op, int | None, Clock | None] | None = None

    def is_thread(self, timeline: int) -> bool:
        """True for the timeline of a host thread (``HOST``, or one of several threads')."""
        return timeline == HOST or timeline >= self._first_thread_timeline

    def name(self, timeline: int) -> str:
        return self.timelines[timeline]

    def thread_name(self, i: int) -> str:
        """The thread of kept op ``i`` (with several threads): its own, or the first one."""
        return self.ops[i].thread or self.threads[0]

    def keep(self, i: int) -> None:
        """Keep the op just stepped (index ``i``) and its clocks, to explain a race it is in."""
        op, timeline, stream = self._current
        self.ops[i], self.info[i] = op, OpOrder(timeline, stream)

    def _item(self, t: int, i: int) -> Clock:
        """What an item op ``i`` puts on stream timeline ``t`` starts after. Rule 2 (CUDA "Stream
        synchronization behavior"): items on one stream (work, records, waits) run in issue order,
        from whichever thread, after what the stream waits on; rule 1: and after their issue (what
        the issuing thread observed, and its earlier ops)."""
        sa = self._stream[t]
        if sa.version != self.host.version:
            sa = _rebase(sa, self.host)
        if self.here != HOST:
            sa = _with(sa, self.here, i)
        return sa

    def _issue(self, t: int, i: int) -> tuple[Clock, tuple[int, int]]:
        sa = self._item(t, i)
        k = self._position[t] = self._position[t] + 1
        self._stream[t] = _with(sa, t, k)
        return sa, (t, k)

    def step(self, i: int, op: Op) -> list[Side]:
        """Apply the rules to op ``i`` (ops must come in trace order, each once); return its
        sides (see :class:`Side`; none for records, waits, host synchronizations, releases and
        acquires). Raises KeyError for an op naming a thread the ordering was not given."""
        if self.threads:
            k = self._thread_index[op.thread] if op.thread is not None else 0
            if k != self._me:
                self._me, self.host, self.here = k, self._hosts[k], self._first_thread_timeline + k
        return _RULES[type(op)](self, i, op)

    def _after(self, i: int) -> Clock:
        """The earliest start of what op ``i`` does during its call: after what its thread has
        observed and (with several threads, where clocks hold them) the thread's earlier ops."""
        return self.host if self.here == HOST else _with(self.host, self.here, i)

    def _kernel(self, i: int, op: Kernel) -> list[Side]:
        sa, pos = self._issue(self.timeline_of[op.stream], i)
        self._current = (op, pos[0], sa)
        # A kernel's reads (and its writes) all happen at its place in the stream: only their
        # union matters.
        out = _sides(i, "read", False, sa, pos, "2", op.reads) if op.reads else []
        if op.writes:
            out += _sides(i, "write", True, sa, pos, "2", op.writes)
        return out

    def _host(self, i: int, op: HostWrite | HostRead) -> list[Side]:
        # Rule 1: the thread touches the bytes during its call, which completes before its next op.
        self._current = (op, None, None)
        w = isinstance(op, HostWrite)
        return _sides(i, "write" if w else "read", w, self._after(i), (self.here, i + 1), "1", op.ranges)

    def _free(self, i: int, op: Free) -> list[Side]:
        # Rule 9: a write of the bytes by the thread at this point of its program; what it issues
        # later, or what rule 8 orders after it, is the bytes' next owner.
        self._current = (op, None, None)
        return _sides(i, "free", True, self._after(i), (self.here, i + 1), "9", op.ranges)

    def _copy(self, i: int, op: Copy | CopyBatch) -> list[Side]:
        sa, until = self._issue(self.timeline_of[op.stream], i)
        self._current = (op, until[0], sa)
        h = self._after(i)   # what the thread has observed complete before the call (rules 5, 6, 8)
        done = (self.here, i + 1)   # "completes before the thread's next op": rule 5 DURING_API_CALL, rule 6
        also = None if self.here == HOST else until   # ...and before the copy completes (see Side)
        order = op.order   # a plain copy (cudaMemcpyAsync) reads its source in stream order
        src_rule = "2" if isinstance(op, Copy) else f"5:{order}"
        if order == "STREAM":
            # Rule 5 STREAM (Driver API CUmemcpySrcAccessOrder, used by cuMemcpyBatchAsync:
            # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, access to the source in stream order).
            src_after, src_until, src_also = sa, until, None
        elif order == "DURING_API_CALL":
            # Rule 5 DURING_API_CALL (CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL: out of stream
            # order, all accesses complete before the call returns): after what the host observed
            # complete before the call, before the host's next op, not after the stream's pending
            # work.
            src_after, src_until, src_also = h, done, also
        else:
            # Rule 5 ANY (CU_MEMCPY_SRC_ACCESS_ORDER_ANY: out of stream order, and accesses may
            # happen after the call returns): from the call until the copy completes in stream
            # order; not after the stream's pending work.
            src_after, src_until, src_also = h, until, None
        buffers = self.buffers
        srcs, pageable_srcs = [], []
        for src, _ in op.copies:
            # Rule 6, src (CUDA "API synchronization behavior": pageable memory is staged into
            # pinned memory by the call, and the driver *may* synchronize with the stream to do
            # so): read during the call, whatever the order. "May" is no promise, so the read is
            # not placed after the stream's pending work, like DURING_API_CALL.
            (pageable_srcs if buffers[src[0]].space == PAGEABLE else srcs).append(src)
        out = _sides(i, "src", False, src_after, src_until, src_rule, srcs, src_also) if srcs else []
        if pageable_srcs:
            out += _sides(i, "src", False, h, done, "6:src", pageable_srcs, also)
        # The destination is always accessed in stream order (CUmemcpySrcAccessOrder); rule 6,
        # dst, as amended here (NOTES.md, docs/checker.md): a copy to pageable memory is NOT taken
        # to have completed when the call returns. The format's rule follows the old text of
        # CUDA's "API synchronization behavior"; the current text says transfers between device
        # and pageable memory "might be synchronous", and on an H200 (driver 580) a D2H
        # cuMemcpyBatchAsync into pageable memory returned before the copy ran. Rule 7
        # (cuMemcpyBatchAsync: the batch as a whole executes in stream order, the copies within
        # it in no specific order): nothing orders a destination against its own source or the
        # other copies of the batch.
        out += _sides(i, "dst", True, sa, until, "2", [dst for _, dst in op.copies])
        return out

    # Records, waits and host synchronizations move clocks and touch no memory; what explaining a
    # race may need of them is kept.

    def _keep(self, i: int, op: Op, info: OpOrder) -> list[Side]:
        self.ops[i], self.info[i] = op, info
        return []

    def _record(self, i: int, op: Record) -> list[Side]:
        # cudaEventRecord: the event captures all work issued to the stream so far (including
        # what it waits on); a later record replaces the capture (rule 3).
        t = self.timeline_of[op.stream]
        if self.here != HOST:   # one thread: its later work follows the record's issue anyway
            self._stream[t] = self._item(t, i)
        self._events[op.event] = (self._stream[t], i)
        self.records.append(i)
        return self._keep(i, op, _new(OpOrder, (t, self._stream[t], None)))

    def _wait_event(self, i: int, op: WaitEvent) -> list[Side]:
        # cudaStreamWaitEvent: later work on the stream starts after the event's latest capture
        # (rule 2); on an event never recorded it "acts as if the record has already completed, and
        # so is a functional no-op" (CUDA Runtime API, cudaStreamWaitEvent): no item of the stream,
        # ordering nothing (rule 3), not even its thread's earlier ops before later work there.
        t = self.timeline_of[op.stream]
        cap = self._events.get(op.event)
        if cap is not None:
            if self.here != HOST:   # a wait is an item of the stream too (rule 2)
                self._stream[t] = self._item(t, i)
            self._stream[t] = join(self._stream[t], cap[0])
        self.waits[t].append(i)
        return self._keep(i, op, _new(OpOrder, (t, self._stream[t], cap[1] if cap else None)))

    def _wait_stream(self, i: int, op: WaitStream) -> list[Side]:
        # torch's Stream.wait_stream: record a fresh event on `on`, wait on it in `stream`.
        t, on = self.timeline_of[op.stream], self.timeline_of[op.on]
        if self.here != HOST:   # the fresh record on `on` and the wait are items of their streams
            self._stream[on] = self._item(on, i)
            self._stream[t] = self._item(t, i)
        self._stream[t] = join(self._stream[t], self._stream[on])
        self.waits[t].append(i)
        return self._keep(i, op, _new(OpOrder, (t, self._stream[t], i)))

    def _sync_event(self, i: int, op: SyncEvent | QueryEvent) -> list[Side]:
        # Rule 4 (cudaEventSynchronize; cudaEventQuery returning cudaSuccess): the host continues
        # after the latest capture completed. Rule 3: never recorded → nothing; a query that saw
        # "not ready" tells the host nothing.
        cap = self._events.get(op.event)
        if cap is not None and (isinstance(op, SyncEvent) or op.result):
            self._observe(cap[0])
        self.syncs.append(i)
        return self._keep(i, op, _new(OpOrder, (None, None, cap[1] if cap else None)))

    def _sync_stream(self, i: int, op: SyncStream) -> list[Side]:
        # Rule 4 (cudaStreamSynchronize): everything issued to the stream has completed.
        self._observe(self._stream[self.timeline_of[op.stream]])
        return []

    def _sync_device(self, i: int, op: SyncDevice) -> list[Side]:
        # Rule 4 (cudaDeviceSynchronize): everything issued to every stream has completed.
        old = self.host.chunks
        if self.threads:
            # the streams' clocks hold the issuing threads' entries too: join them all
            clock = self.host
            for c in self._stream[1:self._first_thread_timeline]:
                clock = join(clock, c)
            chunks = clock.chunks
        else:
            # Each stream's clock covers no more than the positions handed out so far, and its own
            # last one: their join is those positions.
            pos = self._position
            chunks = tuple(y if (x := tuple(pos[n * CHUNK:(n + 1) * CHUNK])) == y else x
                           for n, y in enumerate(old))
        if chunks != old:
            self._become(chunks)
        return []

    def _release(self, i: int, op: Release) -> list[Side]:
        # Rule 8: what the thread did up to here, and what it observed, is ordered before every
        # later acquire of the name. One thread: program order already orders everything.
        if self.threads:
            mine = _with(self.host, self.here, i + 1)
            old = self._released.get(op.sync)
            self._released[op.sync] = mine if old is None else join(old, mine)
        return []

    def _acquire(self, i: int, op: Acquire) -> list[Side]:
        # Rule 8: after every earlier release of the name (none: nothing), transitively.
        released = self._released.get(op.sync)
        if released is not None:
            self._observe(released)
        return []

    def _observe(self, clock: Clock) -> None:
        """The thread has observed ``clock``'s work complete (rule 4; rule 8 for an acquire)."""
        host = join(self.host, clock)
        if host is not self.host:
            self._become(host.chunks)

    def _become(self, chunks: tuple[tuple[int, ...], ...]) -> None:
        """The thread's host clock is now ``chunks``: a new version, its own base."""
        self._versions += 1
        self.host = self._hosts[self._me] = Clock(chunks, chunks, self._versions, (), self._me)
        self.observed = self._floor() if self.threads else chunks

    def _floor(self) -> tuple[tuple[int, ...], ...]:
        """What every thread has observed: the least of their host clocks, entry by entry. A
        thread's own entry counts for nothing there (its later ops follow its earlier ones)."""
        hosts = [h.chunks for h in self._hosts]
        chunks = [tuple(map(min, *same)) for same in zip(*hosts)]
        for k in range(len(hosts)):
            t = self._first_thread_timeline + k
            n, e = t >> CHUNK_BITS, t & MASK
            chunk = [*chunks[n]]
            chunk[e] = min(h[n][e] for u, h in enumerate(hosts) if u != k)
            chunks[n] = tuple(chunk)
        return tuple(chunks)


# Functions, not bound methods kept on the instance: an Ordering then holds no reference to itself,
# so the millions of objects it keeps are freed when the checker drops it, not left to the cyclic
# collector to traverse.
_RULES = {Kernel: Ordering._kernel, Copy: Ordering._copy, CopyBatch: Ordering._copy, HostWrite: Ordering._host,
          HostRead: Ordering._host, Record: Ordering._record, WaitEvent: Ordering._wait_event,
          WaitStream: Ordering._wait_stream, SyncEvent: Ordering._sync_event, QueryEvent: Ordering._sync_event,
          SyncStream: Ordering._sync_stream, SyncDevice: Ordering._sync_device, Release: Ordering._release,
          Acquire: Ordering._acquire, Free: Ordering._free}


def analyze(trace: Trace) -> tuple[Ordering, list[Access]]:
    """Apply rules 1–9 to every op of ``trace``; return the :class:`Ordering` (its clocks after the
    last op, the control ops) and every access, in trace order, as the checker sees them: per
    op, side by side (:class:`Side`), a side's touching ranges merged. The checker steps the
    ordering itself and keeps no list of accesses; this is for looking at the rules' intervals."""
    order = Ordering(trace.buffers, trace.streams, trace.threads)
    accesses = [side.access(r) for i, op in enumerate(trace.ops) for side in order.step(i, op)
                for r in union(side.ranges)]
    return order, accesses
