"""The trace format's values and ops (``docs/trace-format.md``, version 1.2): a byte range is a
:class:`Range` named tuple ``(buffer, offset, length)``, a buffer a :class:`Buffer`, each copy of a
batch a :class:`Transfer` named tuple ``(src, dst)``, and every op a small named tuple of its kind
(:class:`Kernel`, :class:`Copy`, ... :class:`Free`; ``Op`` is any of them); ``op_to_json`` and
``describe_op`` write an op as JSON and as reports name it. Made only by the parser
(``kvverify.check.parser``), which validates them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

from kvverify.terms import HOST_SPACE

VERSION = 1  # of the trace format: the ``version`` a trace declares
PAGEABLE = HOST_SPACE["pageable"]


# --------------------------------------------------------------------------------------------
# Values


class Range(NamedTuple):
    """``length`` bytes of ``buffer`` from ``offset``: JSON ``[buffer, offset, length]``."""

    buffer: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlap(self, other: Range) -> Range | None:
        """The bytes both ranges cover, or None."""
        if self.buffer != other.buffer:
            return None
        lo, hi = max(self.offset, other.offset), min(self.end, other.end)
        return Range(self.buffer, lo, hi - lo) if lo < hi else None

    def to_json(self) -> list:
        return [self.buffer, self.offset, self.length]

    def __str__(self) -> str:
        return f"{self.buffer}[{self.offset}:{self.end}]"


_buffer, _offset = itemgetter(0), itemgetter(1)


def union(ranges: Sequence[Range]) -> Sequence[Range]:
    """The same bytes as ``ranges``, with touching or overlapping ranges of one buffer merged,
    sorted by buffer and offset (a kernel listing a request's blocks one by one reads a few runs)."""
    if len(ranges) < 2:
        return ranges
    buffers = set(map(_buffer, ranges))
    if len(buffers) == 1:
        return _merge(sorted(ranges, key=_offset))
    if len(buffers) == len(ranges):    # nothing to merge
        return sorted(ranges)
    return [r for b in sorted(buffers) for r in _merge(sorted((x for x in ranges if x[0] == b), key=_offset))]


def _merge(rs: list[Range]) -> list[Range]:
    """Ranges of one buffer sorted by offset, touching or overlapping ones merged."""
    out = []
    buf, lo, n = first = rs[0]
    hi = lo + n
    for r in rs[1:]:
        o = r[1]
        if o <= hi:
            e = o + r[2]
            hi = max(hi, e)
            first = None
        else:
            out.append(first or tuple.__new__(Range, (buf, lo, hi - lo)))
            first, lo, hi = r, o, o + r[2]
    out.append(first or tuple.__new__(Range, (buf, lo, hi - lo)))
    return out


@dataclass(frozen=True, slots=True)
class Buffer:
    name: str
    space: str    # one of SPACES
    nbytes: int

    def to_json(self) -> dict:
        return {"space": self.space, "bytes": self.nbytes}


class Transfer(NamedTuple):
    """One copy of a ``copy_batch``: ``{"src": range, "dst": range}``."""

    src: Range
    dst: Range

    def to_json(self) -> dict:
        return {"src": self.src.to_json(), "dst": self.dst.to_json()}


# --------------------------------------------------------------------------------------------
# Ops (one class per op of the table in TRACE_FORMAT.md; ``kind`` is its JSON "op"). Named tuples:
# immutable, and made in a fraction of a frozen dataclass's time (a trace has millions); an op
# equals only an op of its own kind (see _same_op below).


class Kernel(NamedTuple):
    kind = "kernel"   # the JSON "op" (a class attribute, no field)
    stream: str
    reads: tuple[Range, ...] = ()
    writes: tuple[Range, ...] = ()
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class Copy(NamedTuple):
    """cudaMemcpyAsync: stream-ordered on both sides, except where pageable memory (rule 6)."""

    kind = "copy"   # the JSON "op" (a class attribute, no field)
    stream: str
    src: Range
    dst: Range
    name: str | None = None
    at: str | None = None
    thread: str | None = None

    @property
    def copies(self) -> tuple[Transfer, ...]:
        return (Transfer(self.src, self.dst),)

    @property
    def order(self) -> str:
        return "STREAM"


class CopyBatch(NamedTuple):
    """cuMemcpyBatchAsync with one CUmemcpyAttributes (one ``order``) for all copies."""

    kind = "copy_batch"   # the JSON "op" (a class attribute, no field)
    stream: str
    order: str
    copies: tuple[Transfer, ...]
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class Record(NamedTuple):
    kind = "record"   # the JSON "op" (a class attribute, no field)
    event: str
    stream: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class WaitEvent(NamedTuple):
    kind = "wait_event"   # the JSON "op" (a class attribute, no field)
    stream: str
    event: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class WaitStream(NamedTuple):
    kind = "wait_stream"   # the JSON "op" (a class attribute, no field)
    stream: str
    on: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class SyncEvent(NamedTuple):
    kind = "sync_event"   # the JSON "op" (a class attribute, no field)
    event: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class QueryEvent(NamedTuple):
    kind = "query_event"   # the JSON "op" (a class attribute, no field)
    event: str
    result: bool
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class SyncStream(NamedTuple):
    kind = "sync_stream"   # the JSON "op" (a class attribute, no field)
    stream: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class SyncDevice(NamedTuple):
    kind = "sync_device"   # the JSON "op" (a class attribute, no field)
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class HostWrite(NamedTuple):
    kind = "host_write"   # the JSON "op" (a class attribute, no field)
    ranges: tuple[Range, ...]
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class HostRead(NamedTuple):
    kind = "host_read"   # the JSON "op" (a class attribute, no field)
    ranges: tuple[Range, ...]
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class Release(NamedTuple):
    """The thread releases host synchronization object ``sync`` (format 1.2, rule 8)."""

    kind = "release"   # the JSON "op" (a class attribute, no field)
    sync: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class Acquire(NamedTuple):
    """The thread acquires ``sync``: it follows every earlier release of it (format 1.2, rule 8)."""

    kind = "acquire"   # the JSON "op" (a class attribute, no field)
    sync: str
    name: str | None = None
    at: str | None = None
    thread: str | None = None


class Free(NamedTuple):
    """The thread releases these bytes, device or host (format 1.2, rule 9)."""

    kind = "free"   # the JSON "op" (a class attribute, no field)
    ranges: tuple[Range, ...]
    name: str | None = None
    at: str | None = None
    thread: str | None = None


Op = (Kernel | Copy | CopyBatch | Record | WaitEvent | WaitStream | SyncEvent | QueryEvent
      | SyncStream | SyncDevice | HostWrite | HostRead | Release | Acquire | Free)


def _same_op(self, other) -> bool:
    return type(self) is type(other) and tuple.__eq__(self, other)


def _other_op(self, other) -> bool:
    return not _same_op(self, other)


for _op in (Kernel, Copy, CopyBatch, Record, WaitEvent, WaitStream, SyncEvent, QueryEvent, SyncStream, SyncDevice,
            HostWrite, HostRead, Release, Acquire, Free):
    _op.__eq__, _op.__ne__, _op.__hash__ = _same_op, _other_op, tuple.__hash__


def op_to_json(op: Op) -> dict:
    """The JSON object of one op, fields in the order of the format's table."""
    out: dict[str, Any] = {"op": op.kind}
    if isinstance(op, Kernel):
        out.update(stream=op.stream, reads=[r.to_json() for r in op.reads],
                   writes=[r.to_json() for r in op.writes])
    elif isinstance(op, Copy):
        out.update(stream=op.stream, src=op.src.to_json(), dst=op.dst.to_json())
    elif isinstance(op, CopyBatch):
        out.update(stream=op.stream, order=op.order, copies=[c.to_json() for c in op.copies])
    elif isinstance(op, Record):
        out.update(event=op.event, stream=op.stream)
    elif isinstance(op, WaitEvent):
        out.update(stream=op.stream, event=op.event)
    elif isinstance(op, WaitStream):
        out.update(stream=op.stream, on=op.on)
    elif isinstance(op, SyncEvent):
        out.update(event=op.event)
    elif isinstance(op, QueryEvent):
        out.update(event=op.event, result=op.result)
    elif isinstance(op, SyncStream):
        out.update(stream=op.stream)
    elif isinstance(op, (HostWrite, HostRead, Free)):
        out.update(ranges=[r.to_json() for r in op.ranges])
    elif isinstance(op, (Release, Acquire)):
        out.update(sync=op.sync)
    if op.name is not None:
        out["name"] = op.name
    if op.at is not None:
        out["at"] = op.at
    if op.thread is not None:
        out["thread"] = op.thread
    return out


def describe_op(op: Op, index: int, thread: str | None = None) -> str:
    """``op 3 (copy_batch 'store' on 'offload', ANY, thread 'loader') at offload.py:88 in store``:
    how reports name an op (``at``, where the program issued it, when the trace has it). The
    thread is the op's own, else ``thread`` (a trace's first thread, for ops that name none)."""
    bits = [op.kind]
    if op.name:
        bits.append(repr(op.name))
    stream = getattr(op, "stream", None)
    if stream is not None:
        bits.append(f"on '{stream}'")
    text = " ".join(bits)
    if isinstance(op, CopyBatch):
        text += f", {op.order}"
    thread = op.thread or thread
    if thread is not None:
        text += f", thread '{thread}'"
    return f"op {index} ({text})" + (f" at {op.at}" if op.at else "")
