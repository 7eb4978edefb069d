"""Hypothesis strategies for small random traces (the checker's property tests).

Random ops alone rarely line up into the shapes that matter (work, an event, a wait or a sync,
then conflicting work), so traces are built from *hand-offs*: an access, an optional record of
its stream, an optional wait / sync of some kind (often on that event), and another access.
Each trace uses a few tiny buffers so that accesses overlap often. Format 1.2: a trace has one to
three host threads; each op is issued by one of them (the first thread's ops name it or not), a
hand-off may pass from one thread to another through a release and an acquire of one of a few
sync names, and an access may be a free (of device or host bytes).
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvverify.check.model import ORDERS, Trace

STREAMS = ("s0", "s1", "s2")
EVENTS = ("e0", "e1")
THREADS = ("t0", "t1", "t2")
SYNCS = ("q0", "q1")
BUFFERS = {
    "d0": {"space": "device", "bytes": 8},
    "d1": {"space": "device", "bytes": 8},
    "p": {"space": "host_pinned", "bytes": 8},
    "r": {"space": "host_registered", "bytes": 8},
    "g": {"space": "host_pageable", "bytes": 8},
}
HOST = ("p", "r", "g")


def _overlap(a, b) -> bool:
    return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]


def _conflict(c, k) -> bool:
    return _overlap(c["dst"], k["dst"]) or _overlap(c["dst"], k["src"]) or _overlap(c["src"], k["dst"])


def _threads(draw) -> tuple[tuple[str, ...], object]:
    """The trace's threads (none declared, or one to three) and a function that marks an op as
    issued by one of them (the first thread's ops name it or leave it out)."""
    threads = THREADS[: draw(st.integers(0, len(THREADS)))]

    def by(op: dict, thread: str | None = None) -> dict:
        if threads:
            thread = thread or draw(st.sampled_from(threads))
            if thread != threads[0] or draw(st.booleans()):
                op["thread"] = thread
        return op

    return threads, by


def _doc(buffers: dict, streams, threads, ops: list[dict]) -> dict:
    doc = {"version": 1, "buffers": buffers, "streams": list(streams), "ops": ops}
    if threads:
        doc["threads"] = list(threads)
    return doc


@st.composite
def small_traces(draw, max_nodes: int = 7, max_ops: int = 10):
    """A valid trace whose oracle graph has at most ``max_nodes`` access nodes (a kernel or host
    op is one node, each copy two) and at most about ``max_ops`` ops."""
    streams = STREAMS[: draw(st.integers(1, len(STREAMS)))]
    threads, by = _threads(draw)
    used = draw(st.lists(st.sampled_from(tuple(BUFFERS)), min_size=1, max_size=3, unique=True))
    host_used = [b for b in used if b in HOST] or ["p"]
    clean = draw(st.booleans())     # keep the copies of a batch apart (rule 7 races less often)
    budget = [max_nodes]
    ops: list[dict] = []

    def rng(host=False, length=None):
        buf = draw(st.sampled_from(host_used if host else used))
        n = length or draw(st.sampled_from((4, 8)))
        return [buf, draw(st.sampled_from([o for o in (0, 4) if o + n <= 8])), n]

    def access(stream):
        """One op that touches memory, within the node budget (or None)."""
        kinds = []
        if budget[0] >= 1:
            kinds += ["kernel", "kernel", "host_write", "host_read", "free"]
        if budget[0] >= 2:
            kinds += ["copy", "copy_batch", "copy_batch", "copy_batch"]
        if not kinds:
            return None
        kind = draw(st.sampled_from(kinds))
        if kind == "kernel":
            reads = [rng() for _ in range(draw(st.integers(0, 2)))]
            writes = [rng() for _ in range(draw(st.integers(0 if reads else 1, 2)))]
            budget[0] -= 1
            return {"op": "kernel", "stream": stream, "reads": reads, "writes": writes}
        if kind in ("host_write", "host_read"):
            budget[0] -= 1
            return {"op": kind, "ranges": [rng(host=True) for _ in range(draw(st.integers(1, 2)))]}
        if kind == "free":
            budget[0] -= 1
            return {"op": "free", "ranges": [rng() for _ in range(draw(st.integers(1, 2)))]}
        n = draw(st.sampled_from((4, 8)))
        if kind == "copy":
            budget[0] -= 2
            return {"op": "copy", "stream": stream, "src": rng(length=n), "dst": rng(length=n)}
        copies = []
        for _ in range(draw(st.integers(1, max(1, min(3, budget[0] // 2))))):
            m = draw(st.sampled_from((4, 8)))
            c = {"src": rng(length=m), "dst": rng(length=m)}
            if clean and (_overlap(c["src"], c["dst"]) or any(_conflict(c, k) for k in copies)):
                continue
            copies.append(c)
        if not copies:
            copies = [{"src": rng(length=4), "dst": rng(length=4)}]
        budget[0] -= 2 * len(copies)
        return {"op": "copy_batch", "stream": stream, "order": draw(st.sampled_from(ORDERS)), "copies": copies}

    def handoff(thread):
        """A release by ``thread`` and an acquire by another (or none): rule 8."""
        if len(threads) < 2 or not draw(st.booleans()):
            return []
        sync = draw(st.sampled_from(SYNCS))
        return [by({"op": "release", "sync": sync}, thread),
                by({"op": "acquire", "sync": draw(st.sampled_from(SYNCS)) if draw(st.integers(0, 3)) == 0 else sync})]

    def sync(stream, event):
        """A way (or none) for later work to follow `stream` / `event`."""
        other = draw(st.sampled_from(streams))
        kind = draw(st.sampled_from(("wait_event", "wait_event", "sync_event", "query_event", "wait_stream",
                                     "sync_stream", "sync_device", "none", "none")))
        if kind == "wait_event":
            return {"op": "wait_event", "stream": other, "event": event}
        if kind == "sync_event":
            return {"op": "sync_event", "event": event}
        if kind == "query_event":
            return {"op": "query_event", "event": event, "result": draw(st.booleans())}
        if kind == "wait_stream":
            return {"op": "wait_stream", "stream": other, "on": stream}
        if kind == "sync_stream":
            return {"op": "sync_stream", "stream": draw(st.sampled_from(streams))}
        if kind == "sync_device":
            return {"op": "sync_device"}
        return None

    while len(ops) < max_ops and budget[0] > 0:
        stream = draw(st.sampled_from(streams))
        event = draw(st.sampled_from(EVENTS))
        op = access(stream)
        if op is None:
            break
        ops.append(by(op))
        thread = op.get("thread", threads[0] if threads else None)
        if draw(st.booleans()):
            ops.append(by({"op": "record", "event": event, "stream": stream}, thread))
        s = sync(stream, event if draw(st.integers(0, 3)) else draw(st.sampled_from(EVENTS)))
        if s is not None:
            # the thread that synchronizes is often the one that passes what it saw on
            ops.append(by(s, thread if draw(st.booleans()) else None))
            thread = s.get("thread", threads[0] if threads else None)
        ops += handoff(thread)
    if draw(st.booleans()):   # a final synchronization or a stray op, sometimes
        s = sync(draw(st.sampled_from(streams)), draw(st.sampled_from(EVENTS)))
        if s is not None:
            ops.append(by(s))
    return Trace.from_json(_doc(BUFFERS, streams, threads, ops))


BUSY_BUFFERS = {
    "d0": {"space": "device", "bytes": 256},
    "d1": {"space": "device", "bytes": 256},
    "p": {"space": "host_pinned", "bytes": 256},
    "g": {"space": "host_pageable", "bytes": 256},
}


@st.composite
def busy_traces(draw, max_streams: int = 12, max_ops: int = 60):
    """A valid trace too big for the oracle: up to ``max_streams`` streams and ``max_ops`` ops,
    ops with up to 8 ranges at several granularities, every kind of synchronization, so that lanes
    fill, get pruned by host synchronizations and need their segment maps."""
    streams = [f"s{k}" for k in range(draw(st.integers(1, max_streams)))]
    events = [f"e{k}" for k in range(4)]
    threads, by = _threads(draw)

    def rng(host=False):
        buf = draw(st.sampled_from(("p", "g") if host else tuple(BUSY_BUFFERS)))
        size = draw(st.sampled_from((8, 16, 64, 256)))
        return [buf, draw(st.integers(0, 256 // size - 1)) * size, size]

    def ranges(host=False, low=0):
        return [rng(host) for _ in range(draw(st.integers(low, 8)))]

    ops: list[dict] = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(("kernel", "kernel", "kernel", "copy", "copy_batch", "copy_batch",
                                     "host_write", "host_read", "record", "record", "wait_event",
                                     "wait_stream", "sync_event", "query_event", "sync_stream", "sync_device",
                                     "free", "release", "acquire")))
        stream = draw(st.sampled_from(streams))
        if kind == "free":
            ops.append({"op": kind, "ranges": ranges(low=1)})
        elif kind in ("release", "acquire"):
            ops.append({"op": kind, "sync": draw(st.sampled_from(SYNCS))})
        elif kind == "kernel":
            ops.append({"op": kind, "stream": stream, "reads": ranges(), "writes": ranges(low=1)})
        elif kind in ("host_write", "host_read"):
            ops.append({"op": kind, "ranges": ranges(host=True, low=1)})
        elif kind in ("copy", "copy_batch"):
            copies = []
            for _ in range(1 if kind == "copy" else draw(st.integers(1, 6))):
                src, dst = rng(), rng()
                n = min(src[2], dst[2])
                copies.append({"src": [src[0], src[1], n], "dst": [dst[0], dst[1], n]})
            if kind == "copy":
                ops.append({"op": kind, "stream": stream, **copies[0]})
            else:
                ops.append({"op": kind, "stream": stream, "order": draw(st.sampled_from(ORDERS)), "copies": copies})
        elif kind == "record":
            ops.append({"op": kind, "event": draw(st.sampled_from(events)), "stream": stream})
        elif kind == "wait_event":
            ops.append({"op": kind, "stream": stream, "event": draw(st.sampled_from(events))})
        elif kind == "wait_stream":
            ops.append({"op": kind, "stream": stream, "on": draw(st.sampled_from(streams))})
        elif kind == "sync_event":
            ops.append({"op": kind, "event": draw(st.sampled_from(events))})
        elif kind == "query_event":
            ops.append({"op": kind, "event": draw(st.sampled_from(events)), "result": draw(st.booleans())})
        elif kind == "sync_stream":
            ops.append({"op": kind, "stream": stream})
        else:
            ops.append({"op": kind})
        by(ops[-1])
    return Trace.from_json(_doc(BUSY_BUFFERS, streams, threads, ops))
