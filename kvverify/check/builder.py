"""Traces built in code (:class:`TraceBuilder`): declarations and ops added one call at a time,
validated at :meth:`TraceBuilder.build` by the parser every trace goes through.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

from kvverify.check.ops import VERSION, Range, Transfer
from kvverify.check.parser import Trace


RangeLike = Range | Sequence


def _rj(r: RangeLike) -> list:
    # numpy integers and the like become plain ints; anything else is left for validation to name
    out = list(r)
    for k in (1, 2):
        if k < len(out) and not isinstance(out[k], bool):
            try:
                out[k] = operator.index(out[k])
            except TypeError:
                pass
    return out


class TraceBuilder:
    """Build a trace in code; each op method returns the index of the op it added, and takes
    ``thread=``: the host thread that issues it (one declared with :meth:`thread`; None: the
    first thread, format 1.2).

    Example::

        b = TraceBuilder()
        b.buffer("gpu", "device", 8192)
        b.buffer("cpu", "host_pinned", 8192)
        b.stream("compute")
        b.stream("offload")
        b.kernel("compute", "write_kv", writes=[("gpu", 0, 4096)])          # op 0
        b.wait_stream("offload", on="compute")                               # op 1
        b.copy_batch("offload", "STREAM", [(("gpu", 0, 4096), ("cpu", 0, 4096))])  # op 2
        trace = b.build()
    """

    def __init__(self) -> None:
        self._buffers: dict[str, dict] = {}
        self._streams: list[str] = []
        self._threads: list[str] = []
        self._ops: list[dict] = []

    # declarations
    def buffer(self, name: str, space: str, nbytes: int) -> str:
        self._buffers[name] = {"space": space, "bytes": nbytes}
        return name

    def stream(self, name: str) -> str:
        self._streams.append(name)
        return name

    def thread(self, name: str) -> str:
        """Declare a host thread (the first one declared owns the ops that name none)."""
        self._threads.append(name)
        return name

    # ops
    def _add(self, op: dict, name: str | None, thread: str | None) -> int:
        if name is not None:
            op["name"] = name
        if thread is not None:
            op["thread"] = thread
        self._ops.append(op)
        return len(self._ops) - 1

    def kernel(self, stream: str, name: str | None = None, reads: Iterable[RangeLike] = (),
               writes: Iterable[RangeLike] = (), *, thread: str | None = None) -> int:
        return self._add({"op": "kernel", "stream": stream, "reads": [_rj(r) for r in reads],
                          "writes": [_rj(r) for r in writes]}, name, thread)

    def copy(self, stream: str, src: RangeLike, dst: RangeLike, name: str | None = None, *,
             thread: str | None = None) -> int:
        return self._add({"op": "copy", "stream": stream, "src": _rj(src), "dst": _rj(dst)}, name, thread)

    def copy_batch(self, stream: str, order: str, copies: Iterable, name: str | None = None, *,
                   thread: str | None = None) -> int:
        """``copies``: (src, dst) pairs, :class:`Transfer` objects or ``{"src", "dst"}`` dicts."""
        out = []
        for c in copies:
            if isinstance(c, Mapping):
                src, dst = c["src"], c["dst"]
            elif isinstance(c, Transfer):
                src, dst = c.src, c.dst
            else:
                src, dst = c
            out.append({"src": _rj(src), "dst": _rj(dst)})
        return self._add({"op": "copy_batch", "stream": stream, "order": order, "copies": out}, name, thread)

    def record(self, event: str, stream: str, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "record", "event": event, "stream": stream}, name, thread)

    def wait_event(self, stream: str, event: str, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "wait_event", "stream": stream, "event": event}, name, thread)

    def wait_stream(self, stream: str, on: str, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "wait_stream", "stream": stream, "on": on}, name, thread)

    def sync_event(self, event: str, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "sync_event", "event": event}, name, thread)

    def query_event(self, event: str, result: bool, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "query_event", "event": event, "result": result}, name, thread)

    def sync_stream(self, stream: str, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "sync_stream", "stream": stream}, name, thread)

    def sync_device(self, name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "sync_device"}, name, thread)

    def host_write(self, ranges: Iterable[RangeLike], name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "host_write", "ranges": [_rj(r) for r in ranges]}, name, thread)

    def host_read(self, ranges: Iterable[RangeLike], name: str | None = None, *, thread: str | None = None) -> int:
        return self._add({"op": "host_read", "ranges": [_rj(r) for r in ranges]}, name, thread)

    def release(self, sync: str, name: str | None = None, *, thread: str | None = None) -> int:
        """The thread releases ``sync`` (a lock's unlock, a queue put, a thread's start or end)."""
        return self._add({"op": "release", "sync": sync}, name, thread)

    def acquire(self, sync: str, name: str | None = None, *, thread: str | None = None) -> int:
        """The thread acquires ``sync``: ordered after every earlier release of it (rule 8)."""
        return self._add({"op": "acquire", "sync": sync}, name, thread)

    def free(self, ranges: Iterable[RangeLike], name: str | None = None, *, thread: str | None = None) -> int:
        """The thread releases these bytes, device or host (rule 9)."""
        return self._add({"op": "free", "ranges": [_rj(r) for r in ranges]}, name, thread)

    def to_json(self) -> dict:
        out = {"version": VERSION, "buffers": {k: dict(v) for k, v in self._buffers.items()},
               "streams": list(self._streams)}
        if self._threads:
            out["threads"] = list(self._threads)
        out["ops"] = [dict(op) for op in self._ops]
        return out

    def build(self) -> Trace:
        """Validate (raising :class:`TraceError`) and return the trace."""
        return Trace.from_json(self.to_json())

    def __len__(self) -> int:
        return len(self._ops)
