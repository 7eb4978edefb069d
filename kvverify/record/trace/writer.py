"""From a recorder's op log to a trace document (``docs/trace-format.md``, version 1.2).

Bytes are one buffer for as long as the recording knows them: allocations of one memory space that
share an address (the caching allocator's block handed to a new tensor, a pinned block torch's
host allocator reuses, host memory freed and allocated again) are written as one buffer that
covers them all, each op's ranges at their offset in it. What orders a new owner after an old one
is then what the program and the allocators did, written as ops (``kvverify.record.trace.recorder``):
stream order on the block's stream, the allocators' events, synchronization; where nothing does, the
checker reports the race, as it should (a freed block reused under a copy still reading it).

Only what can matter is written, and nothing that can (the design's "what a trace may leave
out"): two accesses to a buffer that every access reaches through one stream and no host access
touches are in stream order, so such a buffer (an intermediate activation, a compute-only
workspace) is summarized: its kernels' accesses counted, not written. A buffer is kept when a copy
or a batched swap touches it, when both the host and the device do, or when kernels on two streams
or more do: a kernel is a writer like any other (a Triton copy kernel on a side stream beside
compute's zero-fill; two streams that share a weight). The happens-before order between the ops
written does not change: kernels add no ordering edges, only accesses.
Records of events nothing waits on, synchronizes with or queries order nothing and are left out,
unless another thread's later work on the same stream follows them (a stream's order holds whichever
thread issues to it: then the record orders its thread's earlier ops before that work, and so does a
kernel whose every access was summarized, which is then written with none); repeated "not yet"
answers of a polling loop are written once.

``keep_all=True`` writes every access, the summarized ones too (they cannot race).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvverify.record.trace.memory import Allocation, Unresolved
from kvverify.record.trace.recorder import Recorder, short_at
from kvverify.terms import DEVICE_SPACE

PREFIX = {DEVICE_SPACE: "gpu", "host_pinned": "pinned", "host_registered": "registered", "host_pageable": "pageable"}


@dataclass
class Summary:
    """What a recording holds and what the trace writer left out."""

    ops_recorded: int = 0
    ops_written: int = 0
    kernels_summarized: int = 0  # kernels whose every access was to a summarized buffer
    accesses_summarized: int = 0  # byte ranges left out (of kernels and host accesses)
    buffers_written: int = 0
    allocations_seen: int = 0
    records_dropped: int = 0  # records of events nothing uses
    queries_collapsed: int = 0  # repeated false queries of one event
    unresolved: list[Unresolved] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # the log index of each op written, in trace order

    def lines(self) -> list[str]:
        out = [f"recorded {self.ops_recorded} ops, wrote {self.ops_written} "
               f"({self.buffers_written} buffers of {self.allocations_seen} allocations seen)"]
        if self.kernels_summarized or self.accesses_summarized:
            out.append(f"summarized {self.kernels_summarized} kernels and {self.accesses_summarized} accesses to "
                       "buffers only kernels on one stream touch (--keep-all writes them)")
        if self.records_dropped or self.queries_collapsed:
            out.append(f"left out {self.records_dropped} records of events nothing waits on, synchronizes with or "
                       f"queries, and {self.queries_collapsed} repeated 'not yet' answers of polls")
        if self.unresolved:
            out.append(f"{len(self.unresolved)} byte ranges lie in no allocation the recording knows; "
                       "written as pageable host memory ('unresolved 0x...'), as the CUDA driver treats them:")
            for u in self.unresolved[:10]:
                where = f" at {u.at}" if u.at else ""
                out.append(f"  {u.length} bytes at {u.address:#x}{where}: {u.reason}")
            if len(self.unresolved) > 10:
                out.append(f"  ... and {len(self.unresolved) - 10} more")
            out.append("  declare such memory with kvverify.record.host_buffer(...) (docs/record.md)")
        out += self.notes
        return out


def buffer_name(a: Allocation) -> str:
    """``gpu12 (offload.py:30)``: kind, allocation number, where the program made it (or its
    address); a name the user gave (``host_buffer(..., name=)``) wins; memory the recording never
    learnt of is ``unresolved 0x7f0000`` (its address)."""
    if a.label:
        return a.label
    if a.placeholder:
        return f"unresolved {a.base:#x}"
    where = f"({short_at(a.at)})" if a.at else f"@{a.base:#x}"
    return f"{PREFIX[a.space]}{a.index} {where}"


def _spans(op: dict) -> Iterable[tuple]:
    kind = op["op"]
    if kind == "kernel":
        yield from op["reads"]
        yield from op["writes"]
    elif kind == "copy":
        yield op["src"]
        yield op["dst"]
    elif kind in ("host_read", "host_write", "free"):
        yield from op["ranges"]


def _shared_bytes(allocations: list[Allocation], final: list[tuple[Allocation, int]]) -> list[tuple[Allocation, int]]:
    """Per allocation index: the allocation whose buffer holds its bytes, and its offset there.

    Allocations that end up in themselves (not placeholders merged into later memory) and overlap
    in address within one memory space (placeholders only with placeholders) share a buffer, named after the first of them made, whose
    ``size`` grows to cover all (the returned allocations are copies: the recorder's stay as they
    were)."""
    from dataclasses import replace

    roots = [a for a in allocations if final[a.index][0] is a]
    holder: dict[int, tuple[Allocation, int]] = {}
    by_space: dict[tuple, list[Allocation]] = {}
    for a in roots:
        # a placeholder beside a live allocation marks a range that ran past its end: kept apart
        by_space.setdefault((a.space, a.placeholder), []).append(a)
    for group in by_space.values():
        group.sort(key=lambda a: (a.base, a.index))
        start = 0
        while start < len(group):
            end, hi = start + 1, group[start].end
            while end < len(group) and group[end].base < hi:
                hi = max(hi, group[end].end)
                end += 1
            members = group[start:end]
            first = min(members, key=lambda a: a.index)
            lo = members[0].base
            shared = first if len(members) == 1 else replace(first, base=lo, size=hi - lo)
            for a in members:
                holder[a.index] = (shared, a.base - lo)
            start = end
    out = []
    for a in allocations:
        root, delta = final[a.index]
        shared, shift = holder[root.index]
        out.append((shared, delta + shift))
    return out


def build(recorder: Recorder, *, keep_all: bool = False) -> tuple[dict, Summary]:
    """The trace (a JSON-ready dict) of what ``recorder`` logged, and a summary of it.

    Raises nothing for a well-formed log; the result passes ``kvverify.check.Trace.from_json``.
    """
    import numpy as np

    allocations = recorder.memory.allocations
    summary = Summary(ops_recorded=len(recorder.ops), allocations_seen=len(allocations),
                      unresolved=recorder.memory.still_unresolved())
    # Where each allocation's bytes are written, by index: placeholders merge into memory learnt
    # later, and allocations that share addresses into one buffer.
    final = _shared_bytes(allocations, [a.final() for a in allocations])
    finals = np.array([f[0].index for f in final], dtype=np.int64)
    shifts = np.array([f[1] for f in final], dtype=np.int64)
    copied: set[int] = set()
    on_host: set[int] = set()
    kernel_streams: dict[int, str | None] = {}  # buffer -> the one stream its kernels use (None: several)
    used_events: set[str] = set()
    for op in recorder.ops:
        kind = op["op"]
        if kind == "copy_batch":
            c = op["copies"]
            copied.update(np.unique(finals[np.concatenate([c.src_index, c.dst_index])]).tolist())
            continue
        if kind in ("wait_event", "sync_event", "query_event"):
            used_events.add(op["event"])
        if kind == "kernel":
            stream = op["stream"]
            for span in _spans(op):
                buffer = final[span[0]][0].index
                if kernel_streams.setdefault(buffer, stream) != stream:
                    kernel_streams[buffer] = None
            continue
        target = {"copy": copied, "host_read": on_host, "host_write": on_host, "free": on_host}.get(kind)
        if target is not None:
            target.update(final[span[0]][0].index for span in _spans(op))
    keep = copied | (on_host & kernel_streams.keys()) | {b for b, s in kernel_streams.items() if s is None}
    names: dict[int, str] = {}
    taken: set[str] = set()

    def name(index: int) -> str:
        out = names.get(index)
        if out is None:
            out = buffer_name(allocations[index])
            if out in taken:  # labels the user gave may repeat
                out = f"{out} #{index}"
            taken.add(out)
            names[index] = out
        return out

    def rng(span: tuple) -> list:
        a, shift = final[span[0]]
        return [name(a.index), span[1] + shift, span[2]]

    def kept(spans: tuple) -> list:
        out = [rng(s) for s in spans if keep_all or final[s[0]][0].index in keep]
        summary.accesses_summarized += len(spans) - len(out)
        return out

    ops: list[dict] = []
    polled: set[str] = set()  # events answered "not yet" since the last op other than a query
    crossing = _crossing(recorder.ops)
    handed_on = _handed_on(recorder.ops)
    for k, op in enumerate(recorder.ops):
        kind = op["op"]
        if kind in ("release", "acquire") and k not in crossing:
            continue
        if kind == "kernel":
            reads, writes = kept(op["reads"]), kept(op["writes"])
            if not reads and not writes and k not in handed_on:
                summary.kernels_summarized += 1
                continue
            out = {"op": kind, "stream": op["stream"], "reads": reads, "writes": writes}
        elif kind in ("host_read", "host_write", "free"):
            ranges = kept(op["ranges"])
            if not ranges:
                continue
            out = {"op": kind, "ranges": ranges}
        elif kind == "copy":
            out = {"op": kind, "stream": op["stream"], "src": rng(op["src"]), "dst": rng(op["dst"])}
        elif kind == "copy_batch":
            c = op["copies"]
            sizes = c.size.tolist()
            src = zip(finals[c.src_index].tolist(), (c.src_offset + shifts[c.src_index]).tolist(), sizes)
            dst = zip(finals[c.dst_index].tolist(), (c.dst_offset + shifts[c.dst_index]).tolist(), sizes)
            out = {"op": kind, "stream": op["stream"], "order": op["order"],
                   "copies": [{"src": [name(i), o, n], "dst": [name(j), p, n]}
                              for (i, o, n), (j, p, _) in zip(src, dst)]}
        elif kind == "record" and op["event"] not in used_events and k not in handed_on:
            summary.records_dropped += 1
            continue
        else:
            out = {k: v for k, v in op.items() if k not in ("at", "when")}
        if kind != "query_event":
            polled.clear()
        elif not op["result"]:
            if op["event"] in polled:
                summary.queries_collapsed += 1
                continue
            polled.add(op["event"])
        if op.get("name"):
            out["name"] = op["name"]
        else:
            out.pop("name", None)
        if op.get("at"):
            out["at"] = op["at"]
        if op.get("thread"):
            out["thread"] = op["thread"]
        ops.append(out)
        summary.sources.append(k)

    used_buffers: set[str] = set()
    streams: dict[str, None] = {}
    for out in ops:
        for key in ("stream", "on"):
            if key in out:
                streams.setdefault(out[key])
        for key in ("reads", "writes", "ranges"):
            used_buffers.update(r[0] for r in out.get(key, ()))
        for key in ("src", "dst"):
            if key in out:
                used_buffers.add(out[key][0])
        for c in out.get("copies", ()):
            used_buffers.add(c["src"][0])
            used_buffers.add(c["dst"][0])
    sizes = {a.index: a.size for a, _ in final}
    buffers = {names[i]: {"space": allocations[i].space, "bytes": sizes[i]}
               for i in sorted(names) if names[i] in used_buffers}
    summary.ops_written = len(ops)
    summary.buffers_written = len(buffers)
    doc = {"version": 1, "buffers": buffers, "streams": list(streams)}
    others = {out["thread"] for out in ops if "thread" in out}
    if others:  # trace format 1.2: the recording thread first, then the others in the order they came
        doc["threads"] = [t for k, t in enumerate(recorder.names) if t in others or k == 0]
    doc["ops"] = ops
    return doc, summary


STREAM_ITEMS = frozenset(("kernel", "copy", "copy_batch", "record", "wait_event", "wait_stream"))
"""The ops that are items of their stream: each runs after the earlier items of its stream."""


def _handed_on(log: list[dict]) -> set[int]:
    """Positions of the stream items that a later item of the same stream issued by another thread
    follows. Such an item orders the earlier ops of its thread before that later work (trace
    format rule 2: one stream's order holds whichever thread issued its items), whatever it does
    itself: the writer keeps it (a record nothing uses, a kernel of summarized accesses only,
    then with none)."""
    later: dict[str, set] = {}  # stream -> the threads of its items after the one at hand
    out: set[int] = set()
    for k in range(len(log) - 1, -1, -1):
        op = log[k]
        if op["op"] not in STREAM_ITEMS:
            continue
        stream, thread = op["stream"], op.get("thread")
        threads = later.setdefault(stream, set())
        if threads - {thread}:
            out.add(k)
        threads.add(thread)
    return out


def _crossing(log: list[dict]) -> set[int]:
    """Positions of the ``release`` / ``acquire`` ops that order two threads: a release that an
    acquire of another thread comes after, an acquire that comes after a release of another thread.
    The others order nothing program order does not (rule 8 within one thread), and a recording
    logs every lock of the process: they are left out."""
    releasers: dict[str, set] = {}  # sync name -> threads that released it so far
    keep: set[int] = set()
    pending: dict[str, list[tuple[int, object]]] = {}  # sync name -> releases not yet known to cross
    for k, op in enumerate(log):
        kind = op["op"]
        if kind not in ("release", "acquire"):
            continue
        sync, thread = op["sync"], op.get("thread")
        if kind == "release":
            releasers.setdefault(sync, set()).add(thread)
            pending.setdefault(sync, []).append((k, thread))
            continue
        if releasers.get(sync, set()) - {thread}:
            keep.add(k)
            rest = []
            for position, by in pending.get(sync, ()):
                (keep.add(position) if by != thread else rest.append((position, by)))
            pending[sync] = rest
    return keep
