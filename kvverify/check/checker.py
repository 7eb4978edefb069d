"""``check(trace) -> Verdict``: every pair of ops whose accesses to the same bytes race.

The ordering comes from :class:`kvverify.check.rules.Ordering`, stepped op by op; the accesses of
each op are checked against what earlier ops left behind and then forgotten, so a trace can be
checked while it is read (:func:`check_ops`). Finding the pairs:

- Accesses are visited in program order, which is a linear extension of happens-before (nothing
  issued later is ordered before something issued earlier), so a race is found when its *later*
  access ``b`` is visited: an earlier access ``a`` placed at ``a.until == (t, p)`` races with
  ``b`` when ``b.after`` does not cover it, i.e. ``p > b.after[t]`` (nor ``a.also``, a second
  latest moment some reads during the call have with several threads: see :class:`Side`).
- With one host thread, an access that completes before the host's next op (host accesses, frees,
  DURING_API_CALL and pageable source reads) is ordered before everything issued later, so only
  accesses placed on a stream are remembered (with several threads, those placed on a thread's
  timeline are remembered too: another thread's later ops need not follow them): per buffer, per
  timeline and per kind (read / write), in a :class:`_Lane`; one
  *entry* per op, holding that op's ranges there, at the op's position ``k``.
- An entry whose position the host has observed complete (every thread's host clock covers it) is
  ordered before everything issued later too, and is dropped: a lane holds only what is still in flight
  as far as the host knows, which bounds memory on traces of millions of ops.
- A lane whose latest position ``b.after`` covers, or whose bytes miss ``b``'s, is skipped at
  once. Otherwise the entries not covered (a suffix: positions grow) are compared with ``b``'s
  ranges one by one while there are few of both (``SCAN_LIMIT``), else looked up in the lane's
  *segment map*, built on first need: the lane's byte ranges cut into segments, each with the
  latest entry over it and its position, so one slice ``max`` (C speed) says whether anything there
  is unordered with a range of ``b``; only then are the distinct entries on the slice (a ``set``,
  C speed) and the entries they overwrote (a chain per entry, restricted to the range) walked, down
  to ``b.after[t]``. Listing races costs per racing entry found, never per byte range of a racing
  op, and ordered overlaps cost nothing.
- An entry's ranges are merged (touching ones joined) and sorted only when something asks: most
  entries are dropped first.
- Races inside one copy / copy_batch (rule 7) are found by a sweep over that op's ranges.

Each unordered pair of ops is reported once (``first`` < ``second``, or equal inside one op),
with the lowest overlapping range and its kind (FREE where one is a free; two frees never race).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter

from kvverify.check import rules
from kvverify.check.explain import explain
from kvverify.check.model import (
    Buffer,
    Copy,
    CopyBatch,
    Op,
    Range,
    Trace,
    gc_paused,
    union,
)
from kvverify.check.rules import HOST, Access, Ordering, Side
from kvverify.check.verdict import Race, Verdict

DEFAULT_MAX_RACES = 10_000
SCAN_LIMIT = 64
"""A side's ranges are compared one by one with a lane's entries that its clock does not cover
while (entries x ranges) stays within this; beyond, they are looked up in the lane's segment map."""


class _Stop(Exception):
    pass


def check(trace: Trace, *, max_races: int | None = DEFAULT_MAX_RACES) -> Verdict:
    """Decide whether ``trace`` races under rules 1–9 of the trace format.

    ``max_races`` bounds the number of races listed (``None``: no bound); when it is reached
    the report has ``truncated=True``. The verdict does not depend on it."""
    return check_ops(trace.buffers, trace.streams, trace.ops, lambda: trace, max_races=max_races,
                     threads=trace.threads)


def check_ops(buffers: Mapping[str, Buffer], streams: tuple[str, ...], ops: Iterable[Op],
              decided: Callable[[], Trace], *, max_races: int | None = DEFAULT_MAX_RACES,
              threads: Sequence[str] = ()) -> Verdict:
    """:func:`check` on ops as they come (an iterator that parses them, for instance): each op is
    checked and forgotten. ``threads``: the trace's host threads (format 1.2). ``decided()`` is
    called once ``ops`` is exhausted and gives the :class:`Trace` the verdict keeps (to name the
    racing ops); ``ops`` is read to its end even when ``max_races`` races were found first, so that
    an invalid op further on is still reported.

    Raises what iterating ``ops`` raises (:class:`TraceError` for an invalid op)."""
    with gc_paused():
        order = Ordering(buffers, streams, threads)
        finder = _Finder(order, buffers, max_races)
        truncated = False
        it = iter(enumerate(ops))
        step, find = order.step, finder.op
        try:
            for i, op in it:
                sides = step(i, op)
                if sides:
                    find(op, sides)
        except _Stop:
            truncated = True
            for _ in it:   # validate the rest
                pass
        trace = decided()
        races = []
        for (i, j), (a, b, overlap) in sorted(finder.found.items()):
            rule, reason, fix = explain(order, a, b, overlap)
            races.append(Race(i, j, _kind(a, b), overlap, rule, reason, fix,
                              first_at=trace.ops[i].at, second_at=trace.ops[j].at))
        # freed here by their reference counts (they hold no cycles), before the collector is back
        # and would traverse their millions of objects once more
        del order, finder, it, step, find
        return Verdict(tuple(races), truncated, trace)


# ------------------------------------------------------------------------------------------
# What is remembered


_key = itemgetter(0)


class _Lane:
    """What one stream did to one buffer for one kind of access (reads or writes), as far as the
    host has not observed it complete. ``entries``: ``[k, side, merged]`` per op, ``k`` its stream
    position (increasing), ``side`` its :class:`Side` here, ``merged`` its ranges merged and
    sorted with their ends (see :func:`_merged`), made when first needed: most entries are dropped
    before anything asks. Entry ``e`` is ``entries[e - base]``; ``last`` is the latest ``k``;
    ``lo``, ``hi``: bytes that hold every entry's ranges (so that the lanes of many streams, each
    working on its own part of a buffer, are passed over at once)."""

    __slots__ = ("base", "entries", "hi", "last", "lo", "segments", "t")

    def __init__(self, t: int):
        self.t = t
        self.entries: list = []
        self.base = 0
        self.last = 0
        self.lo = self.hi = 0
        self.segments: _Segments | None = None

    def add(self, k: int, side: Side, lo: int, hi: int, observed: int) -> None:
        """Remember an op's side at position ``k`` (its ranges within bytes ``[lo, hi)``), first
        dropping the entries at positions the host has observed complete (``observed``), which
        nothing issued later can race with."""
        entries = self.entries
        if entries and entries[0][0] <= observed:
            if entries[-1][0] <= observed:
                dead = len(entries)
            else:
                dead = bisect_right(entries, observed, key=_key)
            if dead == len(entries) or 2 * dead >= len(entries) >= 64:
                del entries[:dead]
                self.base += dead
                self.segments = None    # rebuilt from the live entries when next needed
        if not entries:
            self.lo, self.hi = lo, hi
        else:
            if lo < self.lo:
                self.lo = lo
            if hi > self.hi:
                self.hi = hi
        entries.append([k, side, None])
        self.last = k

    def unordered(self, ranges: Sequence[Range], th: int, nbytes: int) -> Iterator[tuple[Side, Range, Range]]:
        """For each range ``r`` of ``ranges`` and each entry at a position after ``th`` that overlaps
        it: ``(the entry's side, its lowest range overlapping r, r)``. ``nbytes``: the buffer's size."""
        entries = self.entries
        first = bisect_right(entries, th, key=_key)
        if (len(entries) - first) * len(ranges) <= SCAN_LIMIT:
            for entry in entries[first:]:
                merged, ends = _merged(entry)
                if ends is None:
                    a = merged[0]
                    lo, hi = a[1], a[1] + a[2]
                    for r in ranges:
                        if r[1] < hi and lo < r[1] + r[2]:
                            yield entry[1], a, r
                else:
                    n_merged = len(merged)
                    for r in ranges:
                        n = bisect_right(ends, r[1])
                        if n < n_merged and merged[n][1] < r[1] + r[2]:
                            yield entry[1], merged[n], r
            return
        segments = self.segments
        if segments is None:
            segments = self.segments = _Segments(nbytes, self.base)
        segments.catch_up(self)
        for r in ranges:
            for entry in segments.unordered(self, r[1], r[1] + r[2], th):
                yield (*_lowest(entry, r[1], r[1] + r[2]), r)


def _merged(entry) -> tuple[Sequence[Range], list[int] | None]:
    """An entry's ranges merged and sorted, and their ends (None for one range)."""
    m = entry[2]
    if m is None:
        ranges = entry[1].ranges
        if len(ranges) == 1:
            m = entry[2] = (ranges, None)
        else:
            ranges = union(ranges)
            m = entry[2] = (ranges, [r[1] + r[2] for r in ranges])
    return m


def _lowest(entry, lo: int, hi: int) -> tuple[Side, Range] | None:
    """The entry's side and its lowest (merged) range overlapping bytes ``[lo, hi)``, or None."""
    ranges, ends = _merged(entry)
    if ends is None:
        r = ranges[0]
        return (entry[1], r) if r[1] < hi and lo < r[1] + r[2] else None
    n = bisect_right(ends, lo)
    if n < len(ranges) and ranges[n][1] < hi:
        return entry[1], ranges[n]
    return None


class _Segments:
    """A lane's entries laid over the buffer: segment ``s`` is bytes ``[bounds[s], bounds[s + 1])``,
    last written by entry ``owner[s]`` (-1: none) at position ``ks[s]``. ``prev[e]``: the runs of
    segments entry ``e`` overwrote, as ``(starts, ends, owners)``, sorted: a chain per byte, newest
    first, positions decreasing. ``upto``: entries up to this id are laid."""

    __slots__ = ("bounds", "ks", "owner", "prev", "upto")

    def __init__(self, nbytes: int, base: int):
        self.bounds = [0, nbytes]
        self.owner = [-1]
        self.ks = [0]
        self.prev: dict[int, tuple[list, list, list]] = {}
        self.upto = base

    def _split(self, x: int) -> int:
        """Make ``x`` a segment boundary; return its segment index."""
        bounds = self.bounds
        s = bisect_right(bounds, x) - 1
        if bounds[s] == x:
            return s
        bounds.insert(s + 1, x)
        self.owner.insert(s + 1, self.owner[s])
        self.ks.insert(s + 1, self.ks[s])
        return s + 1

    def catch_up(self, lane: _Lane) -> None:
        base, entries = lane.base, lane.entries
        bounds, owner, ks = self.bounds, self.owner, self.ks
        for e in range(max(self.upto, base), base + len(entries)):
            entry = entries[e - base]
            k = entry[0]
            starts, ends, ids = [], [], []
            for r in _merged(entry)[0]:
                s0, s1 = self._split(r[1]), self._split(r[1] + r[2])
                for s in range(s0, s1):
                    if owner[s] >= base:
                        starts.append(bounds[s])
                        ends.append(bounds[s + 1])
                        ids.append(owner[s])
                del bounds[s0 + 1:s1]
                owner[s0:s1] = [e]
                ks[s0:s1] = [k]
            if ids:
                self.prev[e] = (starts, ends, ids)
        self.upto = base + len(entries)

    def unordered(self, lane: _Lane, lo: int, hi: int, th: int) -> list:
        bounds, owner, ks = self.bounds, self.owner, self.ks
        s0 = bisect_right(bounds, lo) - 1
        s1 = bisect_left(bounds, hi)
        if s1 - s0 == 1:
            if ks[s0] <= th:
                return []
            ids = (owner[s0],)
        else:
            if max(ks[s0:s1]) <= th:
                return []
            ids = set(owner[s0:s1])
        base, entries, prev = lane.base, lane.entries, self.prev
        stack = [e for e in ids if e >= base and entries[e - base][0] > th]
        seen = set(stack)
        out = []
        while stack:
            e = stack.pop()
            out.append(entries[e - base])
            p = prev.get(e)
            if p is None:
                continue
            starts, ends, older = p
            p0, p1 = bisect_right(ends, lo), bisect_left(starts, hi)
            for x in set(older[p0:p1]) if p0 < p1 else ():
                if x >= base and x not in seen and entries[x - base][0] > th:
                    seen.add(x)
                    stack.append(x)
        return out


# ------------------------------------------------------------------------------------------
# Finding the racing pairs


class _Finder:
    """Checks each op's sides against the lanes, then adds them to the lanes."""

    def __init__(self, order: Ordering, buffers: Mapping[str, Buffer], max_races: int | None):
        self.order = order
        self.nbytes = {name: b.nbytes for name, b in buffers.items()}
        # by name, not by declaration: a trace's members are unordered (RFC 8259), and so is `buffers`
        self.rank = {name: n for n, name in enumerate(sorted(buffers))}
        self.cap = max_races if max_races is not None else float("inf")
        self.found: dict[tuple[int, int], tuple[Access, Access, Range]] = {}
        # per buffer: the lanes a read is checked against (the streams' writes there), and those a
        # write is (their writes, then their reads)
        self.writers: dict[str, list[_Lane]] = {name: [] for name in buffers}
        self.accessors: dict[str, list[_Lane]] = {name: [] for name in buffers}
        # per buffer, per timeline t: its read lane at 2 * t, its write lane at 2 * t + 1
        self.lane_at: dict[str, list[_Lane | None]] = {name: [None] * (2 * len(order.timelines))
                                                       for name in buffers}

    def record(self, a: Access, b: Access) -> None:
        """Note the race of ``a`` (earlier) with ``b`` (the op just stepped), keeping per op pair
        the lowest overlap (in buffer name order)."""
        lo = max(a.offset, b.offset)
        hi = min(a.offset + a.length, b.offset + b.length)
        if a.role == b.role == "free":   # two frees of the same bytes are no race (rule 9)
            return
        if a.also is not None and rules.covers(b.after, *a.also):   # ordered after all (see Side)
            return
        key = (a.op, b.op)
        old = self.found.get(key)
        if old is None:
            if len(self.found) >= self.cap:
                raise _Stop
            self.order.keep(b.op)
            self.found[key] = (a, b, Range(a.buffer, lo, hi - lo))
        elif (self.rank[a.buffer], lo) < (self.rank[old[2].buffer], old[2].offset):
            self.found[key] = (a, b, Range(a.buffer, lo, hi - lo))

    def op(self, op: Op, sides: list[Side]) -> None:
        """Check the sides of one op (all of them, as the rules gave them), then remember them."""
        writers, accessors, nbytes = self.writers, self.accessors, self.nbytes
        bits, mask = rules.CHUNK_BITS, rules.MASK
        hulls = []
        for side in sides:
            _, _, write, after, _, _, buffer, ranges, _ = side
            if len(ranges) == 1:       # the bytes the side touches, or (many ranges) all the buffer's
                lo = ranges[0][1]
                hi = lo + ranges[0][2]
            else:
                lo, hi = 0, nbytes[buffer]
            hulls.append((lo, hi))
            # against everything remembered from earlier ops, stream by stream: a read against
            # the writes, a write against both
            after = after.chunks
            for lane in (accessors if write else writers)[buffer]:
                t = lane.t
                th = after[t >> bits][t & mask]
                if lane.last > th and lane.lo < hi and lo < lane.hi:
                    self._against(lane, side, th)
        if isinstance(op, (Copy, CopyBatch)):
            _intra(op, sides, self.rank, self.record)       # rule 7, on the copies one by one
        host = self.order.observed
        lane_at = self.lane_at
        for side, (lo, hi) in zip(sides, hulls):
            t, k = side.until
            if t != HOST:
                lane = lane_at[side.buffer][2 * t + side.write] or self._lane(t, side.buffer, side.write)
                lane.add(k, side, lo, hi, host[t >> bits][t & mask])

    def _lane(self, t: int, buffer: str, write: bool) -> _Lane:
        lane = self.lane_at[buffer][2 * t + write] = _Lane(t)
        if write:    # after the other write lanes: a write is checked against writes, then reads
            self.writers[buffer].append(lane)
            self.accessors[buffer].insert(len(self.writers[buffer]) - 1, lane)
        else:
            self.accessors[buffer].append(lane)
        return lane

    def _against(self, lane: _Lane, side: Side, th: int) -> None:
        for earlier, a, b in lane.unordered(side.ranges, th, self.nbytes[side.buffer]):
            self.record(earlier.access(a), side.access(b))


def _intra(op: Copy | CopyBatch, sides: list[Side], buf_rank: dict, record) -> None:
    """Rule 7: the copies of one copy / copy_batch, and each copy's source and destination, are
    unordered among themselves. Report the lowest conflicting overlap: a sweep by offset, per
    buffer, remembering the read and the write that reach furthest; the first range that starts
    before one of them ends (a write, or a read under a write) conflicts, and no conflict starts
    lower. ``sides``: the op's, which place each copy's source and destination (one side per role
    and buffer: a buffer's space, and so rule 6, is the same for all its ranges)."""
    by_buf: dict[str, list] = {}
    for c, (src, dst) in enumerate(op.copies):
        # (offset, writes first, issue order inside the op: copy, source before destination, range)
        by_buf.setdefault(src[0], []).append((src[1], True, (c, False), src))
        by_buf.setdefault(dst[0], []).append((dst[1], False, (c, True), dst))
    for name in sorted(by_buf, key=buf_rank.__getitem__):
        items = by_buf[name]
        if len(items) < 2 or all(x[1] for x in items):
            continue
        items.sort(key=lambda x: x[:2])
        far_w = far_r = None          # the write / read with the furthest end so far
        end_w = end_r = -1
        for x in items:
            start, write = x[0], not x[1]
            partner = far_w if start < end_w else (far_r if write and start < end_r else None)
            if partner is not None:
                place = {(s.role, s.buffer): s for s in sides}
                a, b = sorted((partner, x), key=lambda y: y[2])    # by issue order inside the op
                record(*(place["dst" if y[2][1] else "src", name].access(y[3], y[2][0]) for y in (a, b)))
                return
            end = start + x[3][2]
            if write:
                if end > end_w:
                    far_w, end_w = x, end
            elif end > end_r:
                far_r, end_r = x, end


def _kind(a: Access, b: Access) -> str:
    if a.role == "free" or b.role == "free":
        return "FREE"
    if a.write and b.write:
        return "WAW"
    return "RAW" if a.write else "WAR"


__all__ = ["DEFAULT_MAX_RACES", "SCAN_LIMIT", "check", "check_ops"]
