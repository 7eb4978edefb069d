"""Explaining a race: which rule leaves two accesses unordered, in words, and one change that
orders them. Reads what :class:`kvverify.check.rules.Ordering` kept: the control ops (records,
waits, host synchronizations) with their clocks, and the ops the checker kept for their races."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from kvverify.check.model import (
    CopyBatch,
    QueryEvent,
    Range,
    SyncEvent,
    WaitEvent,
    WaitStream,
)
from kvverify.check.rules import Access, Ordering, covers

Explanation = tuple[str, str, str]
"""``(rule, reason, fix)``."""


def explain(order: Ordering, a: Access, b: Access, overlap: Range) -> Explanation:
    """Why no rule orders access ``a`` (earlier) before ``b`` (op ``b.op``, which the checker kept),
    and a fix. ``overlap``: the bytes they share."""
    if a.op == b.op:
        return _intra(order, a, b, overlap)
    ta = a.until[0]
    what_a = f"op {a.op} {_does(a)} on '{order.name(ta)}'"
    if a.floating:   # an ANY source read, on the stream until its copy completes
        what_a = (f"op {a.op} may read its source {_rng(a)} until the copy completes on '{order.name(ta)}' "
                  f"({a.rule[2:]} order, rule 5)")
    if b.rule == "1":
        return _by_the_host(order, a, b, what_a)
    if b.floating:
        return _out_of_stream_order(order, a, b, what_a)
    # b runs in stream order on another stream that never waited for a.
    i, j = a.op, b.op
    tb = order.info[j].timeline
    sa, sb = order.name(ta), order.name(tb)
    reason = (f"{what_a}; op {j} {_does(b)} on '{sb}', which does not wait for '{sa}' after op {i} "
              f"(rule 2: no wait_event / wait_stream orders them) and the host did not synchronize "
              f"with '{sa}' before issuing op {j} (rule 4){_wait_notes(order, tb, i, j, ta)}")
    return "2", reason, f"add `{sb}.wait_stream({sa})` before op {j}"


def _by_the_host(order: Ordering, a: Access, b: Access, what_a: str) -> Explanation:
    """The host touches the bytes: only a host synchronization orders stream work before it."""
    i, j = a.op, b.op
    ta, ka = a.until
    sa = order.name(ta)
    reason = (f"{what_a}; the host {_does(b)} at op {j} without having observed op {i} "
              f"complete: no sync_stream, sync_device, sync_event or query_event (true) in between "
              f"covers it (rule 4){_host_notes(order, i, j, ta, ka)}")
    fix = f"add `sync_stream('{sa}')` before op {j}"
    ev = _event_after(order, i, j, ta, ka)
    if ev:
        fix += f" (or `sync_event('{ev[0]}')`: its record at op {ev[1]} covers op {i})"
    if a.floating and b.write:   # an ANY read the host overwrites
        fix += f", or give op {i} DURING_API_CALL order so it reads during the call"
    return "4", reason, fix


def _out_of_stream_order(order: Ordering, a: Access, b: Access, what_a: str) -> Explanation:
    """``b`` is a source read placed by its order (rule 5) or by pageable memory (rule 6)."""
    i, j = a.op, b.op
    ta, ka = a.until
    info_b = order.info[j]
    tb = info_b.timeline
    sa, sb = order.name(ta), order.name(tb)
    pageable = b.rule == "6:src"
    src_kind = "device" if order.buffers[b.buffer].space == "device" else "host"
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
    if not covers(info_b.stream, ta, ka):
        reason = (f"{how}, which does not include {what_a}; stream '{sb}' does not wait for '{sa}' "
                  f"after op {i} either (rule 2){_wait_notes(order, tb, i, j, ta)}")
        if pageable:
            return rule, reason, f"add `sync_stream('{sa}')` before op {j}"
        return rule, reason, (f"use STREAM order for op {j} and add `{sb}.wait_stream({sa})` before it "
                              f"(or add `sync_stream('{sa}')` before op {j})")
    if tb == ta:
        cause = f"so not after the work already queued on its own stream '{sb}' ({what_a})"
    else:
        w = _first_wait_covering(order, tb, i, j, ta, ka)
        reach = f"op {w}'s wait on {_waited(order, w)}" if w is not None else f"its wait for '{sa}'"
        cause = f"so it may happen before stream '{sb}' reaches {reach} ({what_a})"
    if pageable:
        fix = f"add `sync_stream('{sa}')` before op {j} (or copy from pinned memory in STREAM order)"
    elif src_kind == "device":
        fix = f"use STREAM order for op {j}: a device source must be read in stream order, behind its barrier"
    else:
        fix = f"use STREAM order for op {j} (or add `sync_stream('{sa}')` before it)"
    return rule, f"{how}, {cause}", fix


def _intra(order: Ordering, a: Access, b: Access, overlap: Range) -> Explanation:
    j = a.op
    op = order.ops[j]
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


def _waited(order: Ordering, w: int) -> str:
    op = order.ops[w]
    if isinstance(op, WaitStream):
        return f"'{op.on}'"
    return f"event '{op.event}'"


def _between(indices: list[int], i: int, j: int) -> list[int]:
    return indices[bisect_right(indices, i):bisect_left(indices, j)]


def _first_wait_covering(order: Ordering, tb: int, i: int, j: int, ta: int, ka: int) -> int | None:
    """The wait on stream ``tb`` (between ops i and j) after which the stream follows op i.
    A stream's clock only grows, so "covers" is monotone along its waits: bisect."""
    ws = _between(order.waits.get(tb, []), i, j)
    lo, hi = 0, len(ws)
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(order.info[ws[mid]].stream, ta, ka):
            hi = mid
        else:
            lo = mid + 1
    return ws[lo] if lo < len(ws) else None


def _capture_note(order: Ordering, x: int, event: str, verb: str, i: int, ta: int) -> str | None:
    """Rule 3: a wait / sync on an event that was never recorded, or whose latest record on op
    i's stream came before op i, orders nothing useful; say so. Other events are not mentioned."""
    r = order.info[x].capture
    if r is None:
        return f"op {x} {verb} event '{event}', which was never recorded before it and so orders nothing (rule 3)"
    if r < i and order.info[r].timeline == ta:
        return (f"op {x} {verb} event '{event}' as recorded at op {r}, before op {i} was issued "
                f"(a record captures only earlier work, rule 3)")
    return None


def _wait_notes(order: Ordering, tb: int, i: int, j: int, ta: int) -> str:
    """Rule 3 notes on the waits of stream ``tb`` between ops i and j."""
    notes = []
    for w in _between(order.waits.get(tb, []), i, j)[-64:]:
        op = order.ops[w]
        if isinstance(op, WaitEvent):
            note = _capture_note(order, w, op.event, "waits on", i, ta)
            if note:
                notes.append(note)
    return "".join("; " + n for n in notes[-2:])


def _host_notes(order: Ordering, i: int, j: int, ta: int, ka: int) -> str:
    """Rule 3 / 4 notes on the host synchronizations between ops i and j."""
    notes = []
    for x in _between(order.syncs, i, j)[-64:]:
        op = order.ops[x]
        if isinstance(op, (SyncEvent, QueryEvent)):
            verb = "syncs" if isinstance(op, SyncEvent) else "queries"
            note = _capture_note(order, x, op.event, verb, i, ta)
            r = order.info[x].capture
            if (note is None and isinstance(op, QueryEvent) and not op.result and r is not None
                    and covers(order.info[r].stream, ta, ka)):
                note = f"op {x} queried event '{op.event}', which covers op {i}, and saw it not complete"
            if note:
                notes.append(note)
    return "".join("; " + n for n in notes[-2:])


def _event_after(order: Ordering, i: int, j: int, ta: int, ka: int) -> tuple[str, int] | None:
    """An event whose latest record before op j captures op i (a finer fix than sync_stream)."""
    if j - i > 4096:   # a hint, not worth a long scan
        return None
    latest: dict[str, int] = {}
    for r in _between(order.records, i, j):
        latest[order.ops[r].event] = r
    for ev, r in sorted(latest.items(), key=lambda kv: kv[1]):
        if covers(order.info[r].stream, ta, ka):
            return ev, r
    return None
