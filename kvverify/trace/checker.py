"""``check(trace) -> Report``: every pair of ops whose accesses to the same bytes race.

The ordering comes from :mod:`kvverify.trace.rules` (one vector-clock pass). Finding the pairs:

- Accesses are visited in program order, which is a linear extension of happens-before (nothing
  issued later is ordered before something issued earlier), so a race is found when its *later*
  access is visited: the earlier access ``a`` races with ``b`` when ``b.after[t] < p`` for
  ``a.until == (t, p)``.
- An access that completes before the host's next op (host accesses, DURING_API_CALL and pageable
  source reads, copies to pageable memory) is ordered before everything issued later, so only
  accesses placed on a stream are remembered.
- They are remembered per buffer and per stream, on the buffer's *cells*: the elementary byte
  intervals between the range ends the trace uses on that buffer. A list per (buffer, stream,
  read/write) holds the latest position that touched each cell, so "does anything on stream ``t``
  unordered with ``b`` overlap ``b``" is one slice ``max`` (C speed) against ``b.after[t]``;
  the position history is walked only when that says yes, so the cost of listing races is paid
  per race found, not per overlapping pair.
- Races inside one copy / copy_batch (rule 7) are found by a sweep over that op's ranges.

Each unordered pair of ops is reported once (``first`` < ``second``, or equal inside one op),
with the lowest overlapping range and its kind.
"""

from __future__ import annotations

import bisect
import heapq

from kvverify.trace.model import (
    CopyBatch,
    QueryEvent,
    Range,
    Record,
    SyncEvent,
    Trace,
    WaitEvent,
    WaitStream,
)
from kvverify.trace.report import Race, Report
from kvverify.trace.rules import HOST, Access, Ordering, analyze, covers

DEFAULT_MAX_RACES = 10_000


class _Stop(Exception):
    pass


def check(trace: Trace, *, max_races: int | None = DEFAULT_MAX_RACES) -> Report:
    """Decide whether ``trace`` races under rules 1–7 of the trace format.

    ``max_races`` bounds the number of races listed (``None``: no bound); when it is reached
    the report has ``truncated=True``. The verdict does not depend on it."""
    order = analyze(trace)
    found, truncated = _find(order, max_races)
    races = []
    for (i, j), (a, b, overlap) in sorted(found.items()):
        rule, reason, fix = _explain(order, a, b, overlap)
        races.append(Race(i, j, _kind(a, b), overlap, rule, reason, fix))
    return Report(tuple(races), truncated)


# ------------------------------------------------------------------------------------------
# Finding the racing pairs


class _Lane:
    """What one stream did to one buffer: per cell, the latest position that read / wrote it,
    and the history of (position, first cell, end cell, access) in position order."""

    __slots__ = ("last_r", "last_w", "rhist", "rk", "whist", "wk")

    def __init__(self, ncells: int):
        self.wk = [0] * ncells
        self.rk = [0] * ncells
        self.whist: list = []
        self.rhist: list = []
        self.last_w = 0
        self.last_r = 0


def _find(order: Ordering, max_races: int | None):
    trace = order.trace
    accesses = order.accesses
    buf_rank = {name: n for n, name in enumerate(trace.buffers)}

    # Cells: per buffer, the sorted range ends used on it, and a map from byte to cell index.
    ends: dict[str, set] = {name: set() for name in trace.buffers}
    for a in accesses:
        e = ends[a.buffer]
        e.add(a.offset)
        e.add(a.offset + a.length)
    cell_of: dict[str, dict[int, int]] = {}
    ncells: dict[str, int] = {}
    for name, e in ends.items():
        pts = sorted(e)
        cell_of[name] = {p: n for n, p in enumerate(pts)}
        ncells[name] = max(len(pts) - 1, 0)
    lanes: dict[str, dict[int, _Lane]] = {name: {} for name in trace.buffers}

    found: dict[tuple[int, int], tuple[Access, Access, Range]] = {}
    cap = max_races if max_races is not None else float("inf")

    def record(a: Access, b: Access) -> None:
        lo = max(a.offset, b.offset)
        hi = min(a.offset + a.length, b.offset + b.length)
        overlap = Range(a.buffer, lo, hi - lo)
        key = (a.op, b.op)
        old = found.get(key)
        if old is None:
            if len(found) >= cap:
                raise _Stop
            found[key] = (a, b, overlap)
        elif (buf_rank[overlap.buffer], lo) < (buf_rank[old[2].buffer], old[2].offset):
            found[key] = (a, b, overlap)

    n = len(accesses)
    start = 0
    try:
        while start < n:
            j = accesses[start].op
            stop = start + 1
            while stop < n and accesses[stop].op == j:
                stop += 1
            group = accesses[start:stop]

            # 1. against everything remembered from earlier ops
            for b in group:
                cells = cell_of[b.buffer]
                c0, c1 = cells[b.offset], cells[b.offset + b.length]
                after = b.after
                for t, lane in lanes[b.buffer].items():
                    th = after[t]
                    if lane.last_w > th:
                        m = lane.wk[c0] if c1 - c0 == 1 else max(lane.wk[c0:c1])
                        if m > th:
                            for k, e0, e1, a in reversed(lane.whist):
                                if k <= th:
                                    break
                                if e0 < c1 and e1 > c0:
                                    record(a, b)
                    if b.write and lane.last_r > th:
                        m = lane.rk[c0] if c1 - c0 == 1 else max(lane.rk[c0:c1])
                        if m > th:
                            for k, e0, e1, a in reversed(lane.rhist):
                                if k <= th:
                                    break
                                if e0 < c1 and e1 > c0:
                                    record(a, b)

            # 2. inside the op (rule 7)
            if group[0].copy is not None:
                _intra(group, buf_rank, record)

            # 3. remember what is placed on a stream
            for a in group:
                t, k = a.until
                if t == HOST:
                    continue
                lane = lanes[a.buffer].get(t)
                if lane is None:
                    lane = lanes[a.buffer][t] = _Lane(ncells[a.buffer])
                cells = cell_of[a.buffer]
                c0, c1 = cells[a.offset], cells[a.offset + a.length]
                if a.write:
                    if c1 - c0 == 1:
                        lane.wk[c0] = k
                    else:
                        lane.wk[c0:c1] = [k] * (c1 - c0)
                    lane.whist.append((k, c0, c1, a))
                    lane.last_w = k
                else:
                    if c1 - c0 == 1:
                        lane.rk[c0] = k
                    else:
                        lane.rk[c0:c1] = [k] * (c1 - c0)
                    lane.rhist.append((k, c0, c1, a))
                    lane.last_r = k
            start = stop
    except _Stop:
        return found, True
    return found, False


def _intra(group: list[Access], buf_rank: dict, record) -> None:
    """Rule 7: the accesses of one copy / copy_batch are unordered among themselves. Report the
    lowest conflicting overlap (a sweep over the op's ranges, per buffer)."""
    by_buf: dict[str, list[Access]] = {}
    for a in group:
        by_buf.setdefault(a.buffer, []).append(a)
    for name in sorted(by_buf, key=buf_rank.__getitem__):
        items = by_buf[name]
        if len(items) < 2 or not any(a.write for a in items):
            continue
        items.sort(key=lambda a: (a.offset, not a.write))
        active_w: list = []   # heaps of (end, seq, access)
        active_r: list = []
        for seq, x in enumerate(items):
            for heap in (active_w, active_r):
                while heap and heap[0][0] <= x.offset:
                    heapq.heappop(heap)
            partner = None
            if active_w:
                partner = active_w[0][2]
            elif x.write and active_r:
                partner = active_r[0][2]
            if partner is not None:
                a, b = (partner, x) if _before_in_op(partner, x) else (x, partner)
                record(a, b)
                return
            heapq.heappush(active_w if x.write else active_r, (x.offset + x.length, seq, x))


def _before_in_op(a: Access, b: Access) -> bool:
    """Issue order inside one op: by copy index, the source before the destination."""
    return (a.copy, a.role != "src") < (b.copy, b.role != "src")


def _kind(a: Access, b: Access) -> str:
    if a.write and b.write:
        return "WAW"
    return "RAW" if a.write else "WAR"


# ------------------------------------------------------------------------------------------
# Explaining a race: which rule leaves it unordered, and a change that orders it


def _explain(order: Ordering, a: Access, b: Access, overlap: Range) -> tuple[str, str, str]:
    trace = order.trace
    i, j = a.op, b.op
    if i == j:
        return _explain_intra(trace, a, b, overlap)

    ta, ka = a.until
    sa = order.name(ta)
    what_a = f"op {i} {_does(a)} on '{sa}'"
    if a.floating:   # an ANY source read, on the stream until its copy completes
        what_a = (f"op {i} may read its source {_rng(a)} until the copy completes on '{sa}' "
                  f"({a.rule[2:]} order, rule 5)")
    info_b = order.ops[j]

    if b.rule == "1":
        # The host touches the bytes: only a host synchronization orders stream work before it.
        notes = _host_notes(order, i, j, ta, ka)
        reason = (f"{what_a}; the host {_does(b, host=True)} at op {j} without having observed op {i} "
                  f"complete: no sync_stream, sync_device, sync_event or query_event (true) in between "
                  f"covers it (rule 4){notes}")
        fix = f"add `sync_stream('{sa}')` before op {j}"
        ev = _event_after(trace, order, i, j, ta, ka)
        if ev:
            fix += f" (or `sync_event('{ev[0]}')`: its record at op {ev[1]} covers op {i})"
        if a.floating and b.write and a.rule == "5:ANY":
            fix += f", or give op {i} DURING_API_CALL order so it reads during the call"
        return "4", reason, fix

    tb = info_b.timeline
    sb = order.name(tb)
    if b.floating:
        stream_clock = info_b.stream
        pageable = b.rule == "6:src"
        src_space = trace.buffers[b.buffer].space
        src_kind = "device" if src_space == "device" else "host"
        if pageable:
            how = (f"op {j}'s source {_rng(b)} is pageable host memory, which the call reads during the "
                   f"call whatever its order (rule 6, CUDA \"API synchronization behavior\")")
            rule = "6"
        else:
            when = ("during the call" if b.rule == "5:DURING_API_CALL"
                    else "at any time from the call until the copy completes")
            how = (f"op {j} reads its {src_kind} source {_rng(b)} with {b.rule[2:]} order (rule 5): {when}, "
                   f"after only what the host has observed complete")
            rule = "5"
        if covers(stream_clock, ta, ka):
            if tb == ta:
                cause = f"so not after the work already queued on its own stream '{sb}' ({what_a})"
            else:
                w = _first_wait_covering(order, tb, i, j, ta, ka)
                reach = f"op {w}'s wait on {_waited(trace, w)}" if w is not None else f"its wait for '{sa}'"
                cause = f"so it may happen before stream '{sb}' reaches {reach} ({what_a})"
            reason = f"{how}, {cause}"
            if pageable:
                fix = f"add `sync_stream('{sa}')` before op {j} (or copy from pinned memory in STREAM order)"
            elif src_kind == "device":
                fix = f"use STREAM order for op {j}: a device source must be read in stream order, behind its barrier"
            else:
                fix = f"use STREAM order for op {j} (or add `sync_stream('{sa}')` before it)"
        else:
            reason = (f"{how}, which does not include {what_a}; stream '{sb}' does not wait for '{sa}' "
                      f"after op {i} either (rule 2){_wait_notes(order, tb, i, j, ta, ka)}")
            if pageable:
                fix = f"add `sync_stream('{sa}')` before op {j}"
            else:
                fix = (f"use STREAM order for op {j} and add `{sb}.wait_stream({sa})` before it "
                       f"(or add `sync_stream('{sa}')` before op {j})")
        return rule, reason, fix

    # b runs in stream order on another stream that never waited for a.
    reason = (f"{what_a}; op {j} {_does(b)} on '{sb}', which does not wait for '{sa}' after op {i} "
              f"(rule 2: no wait_event / wait_stream orders them) and the host did not synchronize "
              f"with '{sa}' before issuing op {j} (rule 4){_wait_notes(order, tb, i, j, ta, ka)}")
    fix = f"add `{sb}.wait_stream({sa})` before op {j}"
    return "2", reason, fix


def _explain_intra(trace: Trace, a: Access, b: Access, overlap: Range) -> tuple[str, str, str]:
    j = a.op
    op = trace.ops[j]
    if a.copy == b.copy:
        which = f"copy {a.copy} of op {j}" if isinstance(op, CopyBatch) else f"op {j}"
        reason = (f"the source {_rng(a if a.role == 'src' else b)} and destination "
                  f"{_rng(b if a.role == 'src' else a)} of {which} overlap: a copy's own source read "
                  f"and destination write are unordered (rule 7)")
        fix = "copy through a separate staging range so that source and destination do not overlap"
    else:
        reason = (f"copies {a.copy} and {b.copy} of op {j} overlap on {overlap}: copy {a.copy} "
                  f"{_does(a)}, copy {b.copy} {_does(b)}; the copies of one copy_batch are unordered "
                  f"among themselves (rule 7, cuMemcpyBatchAsync)")
        fix = (f"make the copies of op {j} disjoint, or move copy {b.copy} into a later copy_batch "
               f"on '{op.stream}'")
    return "7", reason, fix


def _rng(a: Access) -> str:
    return str(Range(a.buffer, a.offset, a.length))


def _does(a: Access, host: bool = False) -> str:
    if a.role == "src":
        return f"reads its source {_rng(a)}"
    if a.role == "dst":
        return f"writes its destination {_rng(a)}"
    return f"{'writes' if a.write else 'reads'} {_rng(a)}"


def _waited(trace: Trace, w: int) -> str:
    op = trace.ops[w]
    if isinstance(op, WaitStream):
        return f"'{op.on}'"
    return f"event '{op.event}'"


def _between(indices: list[int], i: int, j: int) -> list[int]:
    lo, hi = bisect.bisect_right(indices, i), bisect.bisect_left(indices, j)
    return indices[lo:hi]


def _first_wait_covering(order: Ordering, tb: int, i: int, j: int, ta: int, ka: int) -> int | None:
    """The wait on stream ``tb`` (between ops i and j) after which the stream follows op i.
    A stream's clock only grows, so "covers" is monotone along its waits: bisect."""
    ws = _between(order.waits.get(tb, []), i, j)
    lo, hi = 0, len(ws)
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(order.ops[ws[mid]].stream, ta, ka):
            hi = mid
        else:
            lo = mid + 1
    return ws[lo] if lo < len(ws) else None


def _capture_note(order: Ordering, x: int, event: str, verb: str, i: int, ta: int) -> str | None:
    """Rule 3: a wait / sync on an event that was never recorded, or whose latest record on op
    i's stream came before op i, orders nothing useful; say so. Other events are not mentioned."""
    r = order.ops[x].capture
    if r is None:
        return f"op {x} {verb} event '{event}', which was never recorded before it and so orders nothing (rule 3)"
    if r < i and order.ops[r].timeline == ta:
        return (f"op {x} {verb} event '{event}' as recorded at op {r}, before op {i} was issued "
                f"(a record captures only earlier work, rule 3)")
    return None


def _wait_notes(order: Ordering, tb: int, i: int, j: int, ta: int, ka: int) -> str:
    """Rule 3 notes on the waits of stream ``tb`` between ops i and j."""
    trace = order.trace
    notes = []
    for w in _between(order.waits.get(tb, []), i, j)[-64:]:
        op = trace.ops[w]
        if isinstance(op, WaitEvent):
            note = _capture_note(order, w, op.event, "waits on", i, ta)
            if note:
                notes.append(note)
    return "".join("; " + n for n in notes[-2:])


def _host_notes(order: Ordering, i: int, j: int, ta: int, ka: int) -> str:
    """Rule 3 / 4 notes on the host synchronizations between ops i and j."""
    trace = order.trace
    notes = []
    for x in _between(order.syncs, i, j)[-64:]:
        op = trace.ops[x]
        if isinstance(op, (SyncEvent, QueryEvent)):
            verb = "syncs" if isinstance(op, SyncEvent) else "queries"
            note = _capture_note(order, x, op.event, verb, i, ta)
            r = order.ops[x].capture
            if (note is None and isinstance(op, QueryEvent) and not op.result and r is not None
                    and covers(order.ops[r].stream, ta, ka)):
                note = f"op {x} queried event '{op.event}', which covers op {i}, and saw it not complete"
            if note:
                notes.append(note)
    return "".join("; " + n for n in notes[-2:])


def _event_after(trace: Trace, order: Ordering, i: int, j: int, ta: int, ka: int):
    """An event whose latest record before op j captures op i (a finer fix than sync_stream)."""
    if j - i > 4096:   # a hint, not worth a long scan
        return None
    latest: dict[str, int] = {}
    for r in range(i + 1, j):
        op = trace.ops[r]
        if isinstance(op, Record):
            latest[op.event] = r
    for ev, r in sorted(latest.items(), key=lambda kv: kv[1]):
        if covers(order.ops[r].stream, ta, ka):
            return ev, r
    return None


__all__ = ["DEFAULT_MAX_RACES", "check"]
