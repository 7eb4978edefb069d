"""``check(trace) -> Verdict``: every pair of ops whose accesses to the same bytes race.

The ordering comes from :mod:`kvverify.check.rules` (one vector-clock pass). Finding the pairs:

- Accesses are visited in program order, which is a linear extension of happens-before (nothing
  issued later is ordered before something issued earlier), so a race is found when its *later*
  access is visited: the earlier access ``a`` races with ``b`` when ``b.after[t] < p`` for
  ``a.until == (t, p)``.
- An access that completes before the host's next op (host accesses, DURING_API_CALL and pageable
  source reads) is ordered before everything issued later, so only
  accesses placed on a stream are remembered.
- They are remembered per buffer and per stream, on the buffer's *cells*: the elementary byte
  intervals between the range ends the trace uses on that buffer. A list per (buffer, stream,
  read/write) holds the latest position that touched each cell, so "does anything on stream ``t``
  unordered with ``b`` overlap ``b``" is one slice ``max`` (C speed) against ``b.after[t]``.
  Only when that says yes are the per-cell chains of earlier accesses walked, newest first, and
  only down to ``b.after[t]``: listing races costs per race found, never per overlapping pair
  (ordered overlaps, which fill long-lived buffers, cost nothing).
- The streams worth looking at are found once per run of an op's accesses (same buffer and
  clock: the copies of a batch share them), and most are ruled out for the run's whole hull of
  cells at once, against a per-256-cells maximum.
- Touching ranges of one op that the rules treat alike are merged first (kernels and host ops by
  the rules, copies here).
- Races inside one copy / copy_batch (rule 7) are found by a sweep over that op's ranges.

Each unordered pair of ops is reported once (``first`` < ``second``, or equal inside one op),
with the lowest overlapping range and its kind.
"""

from __future__ import annotations

import bisect
from itertools import groupby

from kvverify.check.model import (
    CopyBatch,
    QueryEvent,
    Range,
    Record,
    SyncEvent,
    Trace,
    WaitEvent,
    WaitStream,
    gc_paused,
    union,
)
from kvverify.check.rules import HOST, Access, Ordering, analyze, covers
from kvverify.check.verdict import Race, Verdict

DEFAULT_MAX_RACES = 10_000


class _Stop(Exception):
    pass


def check(trace: Trace, *, max_races: int | None = DEFAULT_MAX_RACES) -> Verdict:
    """Decide whether ``trace`` races under rules 1–7 of the trace format.

    ``max_races`` bounds the number of races listed (``None``: no bound); when it is reached
    the report has ``truncated=True``. The verdict does not depend on it."""
    with gc_paused():
        order = analyze(trace)
        found, truncated = _find(order, max_races)
        races = []
        for (i, j), (a, b, overlap) in sorted(found.items()):
            rule, reason, fix = _explain(order, a, b, overlap)
            races.append(Race(i, j, _kind(a, b), overlap, rule, reason, fix))
        return Verdict(tuple(races), truncated, trace)


# ------------------------------------------------------------------------------------------
# Finding the racing pairs


_CHUNK_BITS = 8     # 256 cells


class _Shadow:
    """What one stream did to one buffer, for one kind of access (reads or writes).

    Per cell: ``k``, the latest stream position that touched it (one slice ``max`` answers "is
    anything here not ordered before clock entry ``th``"), and ``eid``, the entry that did.
    Each entry is ``(position, access, prev)``, where ``prev`` is the entry that was latest on its
    cell before it (an int, for one-cell entries) or those entries as runs of cells (a tuple of
    ``(start, end, entry)``): a chain per cell, newest first, positions decreasing, so
    :meth:`unordered` walks only entries that race (and the runs that lead to them).
    ``chunk`` holds the same maximum per 256 cells, to rule a whole run of an op out at once."""

    __slots__ = ("chunk", "eid", "entries", "k", "last")

    def __init__(self, ncells: int):
        self.k = [0] * ncells
        self.eid = [-1] * ncells
        self.chunk = [0] * ((ncells >> _CHUNK_BITS) + 1)
        self.entries: list = []
        self.last = 0          # the latest position of all

    def unordered(self, c0: int, c1: int, th: int) -> list[Access]:
        """The accesses on cells [c0, c1) at positions after ``th``."""
        out, seen = [], set()
        stack = list(_runs(self.eid, c0, c1))
        entries = self.entries
        while stack:
            s0, s1, e = stack.pop()
            if e < 0:
                continue
            k, access, prev = entries[e]
            if k <= th:            # and so is everything older on these cells
                continue
            if e not in seen:
                seen.add(e)
                out.append(access)
            if type(prev) is int:
                stack.append((s0, s1, prev))
            else:
                for p0, p1, pe in prev:
                    lo, hi = max(p0, s0), min(p1, s1)
                    if lo < hi and pe >= 0:
                        stack.append((lo, hi, pe))
        return out


def _runs(ids: list[int], c0: int, c1: int) -> tuple:
    """``ids[c0:c1]`` as runs ``(start, end, id)``."""
    seg = ids[c0:c1]
    if seg.count(seg[0]) == len(seg):      # one run, the usual case (C speed)
        return ((c0, c1, seg[0]),)
    out = []
    x = c0
    for e, g in groupby(seg):
        n = len(list(g))
        out.append((x, x + n, e))
        x += n
    return tuple(out)


def _coalesce(raw: list[Access]) -> list[Access]:
    """The accesses of one copy / copy_batch with touching ranges merged where the rules treat
    them alike (sources apart from destinations, and by earliest and latest point): a batch of
    neighbouring blocks is then checked as a few ranges (kernels and host ops come merged from
    the rules). Races are per op pair, so nothing reported changes but the overlap, which may come
    out longer (still one contiguous run of overlapping bytes)."""
    groups: dict = {}
    for a in raw:
        groups.setdefault((a[6], a[8], id(a[7])), []).append(a)
    if len(groups) == len(raw):
        return raw
    out = []
    for items in groups.values():
        first = items[0]
        if len(items) == 1:
            out.append(first)
            continue
        for r in union([Range(a[3], a[4], a[5]) for a in items]):
            out.append(first._replace(buffer=r[0], offset=r[1], length=r[2]))
    return out


def _find(order: Ordering, max_races: int | None):
    trace = order.trace
    accesses = order.accesses
    starts = order.starts
    buf_rank = {name: n for n, name in enumerate(trace.buffers)}
    # (Access fields by position in the hot loops: 0 op, 1 copy, 2 role, 3 buffer, 4 offset,
    # 5 length, 6 write, 7 after, 8 until.)

    # Per op: its accesses (rule 7 needs them one by one) and what is checked (merged), in runs
    # that share buffer, kind, earliest and latest point. Meanwhile, per buffer, the range ends.
    per_op = []
    ends: dict[str, set] = {name: set() for name in trace.buffers}
    for i in range(len(trace.ops)):
        s, e = starts[i], starts[i + 1]
        if s == e:
            continue
        raw = accesses[s:e]
        runs: list = []
        run = buf = after = until = write = None
        for a in (_coalesce(raw) if e - s > 2 and raw[0][1] is not None else raw):
            if a[3] is not buf or a[7] is not after or a[8] is not until or a[6] is not write:
                buf, after, until, write, run = a[3], a[7], a[8], a[6], []
                runs.append((buf, after, until, write, run))
            run.append(a)
        for buf, _, _, _, run in runs:
            pts = ends[buf]
            pts.update([a[4] for a in run])
            pts.update([a[4] + a[5] for a in run])
        per_op.append((raw, runs))

    # Cells: the elementary intervals between those ends, and a map from byte to cell index.
    cell_of: dict[str, dict[int, int]] = {}
    ncells: dict[str, int] = {}
    for name, pts in ends.items():
        pts = sorted(pts)
        cell_of[name] = {p: n for n, p in enumerate(pts)}
        ncells[name] = max(len(pts) - 1, 0)
    # per buffer: (timeline, writes, reads) of each stream that touched it
    lanes: dict[str, list[tuple[int, _Shadow, _Shadow]]] = {name: [] for name in trace.buffers}
    shadow_of: dict[tuple[str, int, bool], _Shadow] = {}

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

    def shadow(buf: str, t: int, write: bool) -> _Shadow:
        sh = shadow_of.get((buf, t, write))
        if sh is None:
            lane = (t, _Shadow(ncells[buf]), _Shadow(ncells[buf]))
            lanes[buf].append(lane)
            shadow_of[buf, t, True] = lane[1]
            shadow_of[buf, t, False] = lane[2]
            sh = lane[1 if write else 2]
        return sh

    try:
        for raw, runs in per_op:
            placed = []
            for buf, after, until, write, run in runs:
                cells = cell_of[buf]
                c0s = [cells[b[4]] for b in run]            # each run's first and end cells
                c1s = [cells[b[4] + b[5]] for b in run]
                if until[0] != HOST:
                    placed.append((buf, until, write, run, c0s, c1s))
                # The streams worth looking at depend only on the buffer and the clock (shadows
                # change only between ops), and usually none is left once the run's hull of
                # cells is compared with each stream's per-chunk maxima.
                if write:
                    todo = [(w, r, after[t]) for t, w, r in lanes[buf] if w.last > after[t] or r.last > after[t]]
                else:
                    todo = [(w, r, after[t]) for t, w, r in lanes[buf] if w.last > after[t]]
                if not todo:
                    continue
                h0 = min(c0s) >> _CHUNK_BITS
                h1 = ((max(c1s) - 1) >> _CHUNK_BITS) + 1
                todo = [(w, r, th) for w, r, th in todo
                        if max(w.chunk[h0:h1]) > th or (write and max(r.chunk[h0:h1]) > th)]
                # against everything remembered from earlier ops, stream by stream: a read
                # against the writes, a write against both
                for b, c0, c1 in zip(run, c0s, c1s) if todo else ():
                    for sw, sr, th in todo:
                        if sw.last > th:
                            m = sw.k[c0] if c1 - c0 == 1 else max(sw.k[c0:c1])
                            if m > th:
                                for a in sw.unordered(c0, c1, th):
                                    record(a, b)
                        if write and sr.last > th:
                            m = sr.k[c0] if c1 - c0 == 1 else max(sr.k[c0:c1])
                            if m > th:
                                for a in sr.unordered(c0, c1, th):
                                    record(a, b)
            if raw[0][1] is not None and len(raw) > 1:
                _intra(raw, buf_rank, record)       # rule 7, on the copies one by one
            # remember what is placed on a stream (the per-access part of _Shadow, inlined)
            for buf, (t, k), write, run, c0s, c1s in placed:
                sh = shadow(buf, t, write)
                sh.last = k
                entries, ks, eids, chunk = sh.entries, sh.k, sh.eid, sh.chunk
                for a, c0, c1 in zip(run, c0s, c1s):
                    e = len(entries)
                    if c1 - c0 == 1:
                        entries.append((k, a, eids[c0]))
                        eids[c0] = e
                        ks[c0] = k
                        chunk[c0 >> _CHUNK_BITS] = k
                    else:
                        n = c1 - c0
                        seg = eids[c0:c1]
                        first = seg[0]
                        # prev: one run where the cells had one latest entry (the usual case)
                        entries.append((k, a, ((c0, c1, first),) if seg.count(first) == n else _runs(eids, c0, c1)))
                        eids[c0:c1] = [e] * n
                        ks[c0:c1] = [k] * n
                        h0, h1 = c0 >> _CHUNK_BITS, (c1 - 1) >> _CHUNK_BITS
                        if h0 == h1:
                            chunk[h0] = k
                        else:
                            chunk[h0:h1 + 1] = [k] * (h1 + 1 - h0)
    except _Stop:
        return found, True
    return found, False


def _intra(group: list[Access], buf_rank: dict, record) -> None:
    """Rule 7: the accesses of one copy / copy_batch are unordered among themselves. Report the
    lowest conflicting overlap: a sweep by offset, per buffer, remembering the read and the write
    that reach furthest; the first access that starts before one of them ends (a write, or a
    read under a write) conflicts, and no conflict starts lower."""
    by_buf: dict[str, list[Access]] = {}
    for a in group:
        by_buf.setdefault(a[3], []).append(a)
    for name in sorted(by_buf, key=buf_rank.__getitem__):
        items = by_buf[name]
        if len(items) < 2 or not any(a[6] for a in items):
            continue
        items.sort(key=lambda a: (a[4], not a[6]))
        far_w = far_r = None          # the write / read with the furthest end so far
        end_w = end_r = -1
        for x in items:
            start = x[4]
            partner = far_w if start < end_w else (far_r if x[6] and start < end_r else None)
            if partner is not None:
                a, b = (partner, x) if _before_in_op(partner, x) else (x, partner)
                record(a, b)
                return
            end = start + x[5]
            if x[6]:
                if end > end_w:
                    far_w, end_w = x, end
            elif end > end_r:
                far_r, end_r = x, end


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
        reason = (f"{what_a}; the host {_does(b)} at op {j} without having observed op {i} "
                  f"complete: no sync_stream, sync_device, sync_event or query_event (true) in between "
                  f"covers it (rule 4){notes}")
        fix = f"add `sync_stream('{sa}')` before op {j}"
        ev = _event_after(trace, order, i, j, ta, ka)
        if ev:
            fix += f" (or `sync_event('{ev[0]}')`: its record at op {ev[1]} covers op {i})"
        if a.floating and b.write:   # an ANY read the host overwrites
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


def _does(a: Access) -> str:
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
