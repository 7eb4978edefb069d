"""Explaining a race: which rule leaves two accesses unordered, in words, and one change that
orders them (rules 2, 4–9; with several host threads, whose program orders and releases the
explanations name). Reads what :class:`kvverify.check.rules.Ordering` kept: the control ops (records,
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
from kvverify.check.rules import HOST, Access, Ordering, covers

Explanation = tuple[str, str, str]
"""``(rule, reason, fix)``."""


def explain(order: Ordering, a: Access, b: Access, overlap: Range) -> Explanation:
    """Why no rule orders access ``a`` (earlier) before ``b`` (op ``b.op``, which the checker kept),
    and a fix. ``overlap``: the bytes they share."""
    if a.op == b.op:
        return _intra(order, a, b, overlap)
    ta = a.until[0]
    if order.is_thread(ta):    # only with several threads: one thread's program order orders the rest
        return _across_threads(order, a, b)
    if b.role == "free":
        return _freed_in_use(order, a, b)
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
    reason = (f"{what_a}; {_who(order, b)} {_does(b)} at op {j} without having observed op {i} "
              f"complete: no sync_stream, sync_device, sync_event or query_event (true) "
              f"{_through(order)}covers it (rule 4){_host_notes(order, i, j, ta, ka)}")
    fix = f"add `sync_stream('{sa}')` before op {j}"
    ev = _event_after(order, i, j, ta, ka)
    if ev:
        fix += f" (or `sync_event('{ev[0]}')`: its record at op {ev[1]} covers op {i})"
    if a.floating and b.write:   # an ANY read the host overwrites
        fix += f", or give op {i} DURING_API_CALL order so it reads during the call"
    return "4", reason, fix


def _freed_in_use(order: Ordering, a: Access, b: Access) -> Explanation:
    """Op ``b.op`` frees bytes that stream work may still touch (rule 9, use after free)."""
    i, j = a.op, b.op
    ta, ka = a.until
    sa = order.name(ta)
    reason = (f"op {i} {_does(a)} on '{sa}', and {_who(order, b)} frees {_rng(b)} at op {j} without "
              f"having observed op {i} complete (use after free, rule 9): no sync_stream, sync_device, "
              f"sync_event or query_event (true) {_through(order)}covers it (rule 4)"
              f"{_host_notes(order, i, j, ta, ka)}")
    fix = (f"record an event on '{sa}' after the last use (op {i}) and synchronize it (`sync_event`, or "
           f"`query_event` until true) before freeing at op {j}")
    ev = _event_after(order, i, j, ta, ka)
    if ev:
        fix += f"; `sync_event('{ev[0]}')` would do: its record at op {ev[1]} covers op {i}"
    return "9", reason, fix


def _across_threads(order: Ordering, a: Access, b: Access) -> Explanation:
    """``a`` happened in one host thread's program (a host access, a read during the call, a
    free); nothing carries that thread's order to ``b`` (rule 8)."""
    i, j = a.op, b.op
    thread_a = order.name(a.until[0])
    thread_b = order.thread_name(j)
    b_does = _does(b) if order.is_thread(b.until[0]) else f"{_does(b)} on '{order.name(b.until[0])}'"
    if a.role == "free":
        what = f"op {j} {b_does} in thread '{thread_b}' in bytes that op {i} freed in thread '{thread_a}'"
    elif b.role == "free":
        what = f"op {i} {_does(a)} in thread '{thread_a}' and op {j} frees {_rng(b)} in thread '{thread_b}'"
    else:
        what = f"op {i} {_does(a)} in thread '{thread_a}' and op {j} {b_does} in thread '{thread_b}'"
    reason = (f"{what}, and no release / acquire orders op {i} before op {j} (rule 8: a thread's program "
              f"order reaches another thread only through an acquire of a name it released after "
              f"op {i}, or through work it issued after op {i} that the other thread synchronized with)")
    fix = (f"add a release / acquire (a lock, a queue item, a join) ordering thread '{thread_a}'s "
           f"op {i} before thread '{thread_b}'s op {j}: a `release` after op {i} in '{thread_a}' and an "
           f"`acquire` of the same name before op {j} in '{thread_b}'")
    return ("9" if "free" in (a.role, b.role) else "8"), reason, fix


def _who(order: Ordering, b: Access) -> str:
    """Who touches the bytes in a host op: the host, or with several threads the op's thread."""
    return "the host" if b.until[0] == HOST else f"thread '{order.name(b.until[0])}'"


def _through(order: Ordering) -> str:
    """With several threads a synchronization counts also through another thread's release (rule 8)."""
    return "in between " if not order.threads else "in that thread, or in another before a release it acquired, "


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
    if a.role == "free":
        return f"frees {_rng(a)}"
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
