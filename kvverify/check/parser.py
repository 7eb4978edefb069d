"""The trace (:class:`Trace`) and its one parser: all validation of ``docs/trace-format.md`` lives
here, behind :meth:`Trace.from_json` (a decoded document or JSON text) and :class:`TraceText` (JSON
text, its ops validated one at a time as a checker consumes them); ``TraceBuilder.build`` goes
through it too, so a trace built in code and one read from a file are checked by the same lines.
Invalid input raises :class:`TraceError`, which names the op index and the field in one printable
line of bounded length, whatever the input holds.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvverify.check.jsontext import JSONTextError, ObjectReader, decode
from kvverify.check.ops import (
    VERSION,
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
    Transfer,
    WaitEvent,
    WaitStream,
    describe_op,
    op_to_json,
)
from kvverify.check.text import cut, printable, quote, show
from kvverify.errors import TraceError
from kvverify.terms import DEVICE_SPACE, ORDERS, SPACES


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while millions of small acyclic objects (ranges, ops,
    accesses) are built: its repeated full passes over them cost more than the work itself
    (a 100k-op trace parses and checks about 3x faster)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# The trace


@dataclass(frozen=True)
class Trace:
    """A validated trace. ``ops`` is the order the ops were issued in (with several ``threads``,
    one interleaving of their program orders): a tuple, or (for a trace read by
    :class:`TraceText`) a sequence that parses an op again from the text when asked. ``threads``:
    the host threads' names (format 1.2), empty when the trace declares none."""

    buffers: Mapping[str, Buffer]
    streams: tuple[str, ...]
    ops: Sequence[Op]
    version: int = VERSION
    threads: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: Any) -> Trace:
        """Parse and validate a trace from JSON text (str / bytes) or an already-decoded object
        (where a repeated key can no longer be seen).

        Raises :class:`TraceError` (a ValueError) naming the op index and field of the first
        problem found."""
        with gc_paused():
            if isinstance(doc, (str, bytes, bytearray)):
                text = TraceText(doc)
                ops = tuple(text.ops())
                return cls(text.buffers, text.streams, ops, threads=text.threads)
            parser = _Parser(doc)
            ops = doc["ops"]
            if not isinstance(ops, list):
                parser.fail("ops", f"expected an array of ops, got {_type_name(ops)}")
            return cls(parser.buffers, parser.streams, tuple(parser.op(raw, i) for i, raw in enumerate(ops)),
                       threads=parser.threads)

    def to_json(self) -> dict:
        """The trace as a JSON-ready object (``json.dumps(trace.to_json())`` round-trips)."""
        out = {
            "version": self.version,
            "buffers": {name: b.to_json() for name, b in self.buffers.items()},
            "streams": list(self.streams),
        }
        if self.threads:
            out["threads"] = list(self.threads)
        out["ops"] = [op_to_json(op) for op in self.ops]
        return out

    def dumps(self, indent: int | None = None) -> str:
        return json.dumps(self.to_json(), indent=indent)

    def describe(self, index: int) -> str:
        """How reports name op ``index`` (:func:`describe_op`; with its thread where the trace has threads)."""
        return describe_op(self.ops[index], index, self.threads[0] if self.threads else None)

    def __len__(self) -> int:
        return len(self.ops)


# --------------------------------------------------------------------------------------------
# Reading JSON text


_TOP_LEVEL = ("version", "buffers", "streams", "ops")   # required
_KEYS = ("version", "buffers", "streams", "threads", "ops")   # allowed (threads: format 1.2)


class TraceText:
    """A trace's JSON text, read as it is checked: the header (version, buffers, streams) at
    once, then the ops one at a time, each validated as :meth:`ops` yields it and forgotten.
    :meth:`trace` then gives the :class:`Trace`, whose ops are parsed again from the text when
    asked (a report asks for a few), so a trace of millions of ops is held once, as its text.

    The members may come in any order (RFC 8259: an object's members are unordered). Ops stream
    when ``"ops"`` follows version, buffers and streams (as the format's example and every writer
    put them) and no ``"threads"`` member may still follow (its key nowhere in the rest of the
    text: ops name threads, so they are read once the threads are known); otherwise the ops
    array is decoded whole first.

    ``text``: str, or UTF-8 bytes (a byte order mark is allowed). Raises :class:`TraceError`,
    from the constructor for the header and from :meth:`ops` for an op or what follows the ops."""

    def __init__(self, text: str | bytes | bytearray):
        if not isinstance(text, str):
            try:
                text = str(text, "utf-8-sig")     # no copy of a bytearray first
            except UnicodeDecodeError as e:
                raise TraceError(f"not UTF-8 text: byte {e.start} ({bytes(e.object[e.start:e.start + 1])!r}) "
                                 f"{e.reason}") from None
        self.text = text
        header: dict[str, Any] = {}
        self._streaming = False
        try:
            self._reader = ObjectReader(text)
        except JSONTextError as e:   # valid JSON maybe (an array, a number), but not an object
            raise TraceError(str(e)) from None
        try:
            self._keys = self._reader.members()
            for key in self._keys:
                if key not in _KEYS:
                    raise TraceError(_unknown_top_level(key), field=_field(key))
                if (key == "ops" and header.keys() >= _REQUIRED_HEADER and self._reader.at_array()
                        and ("threads" in header or '"threads"' not in text[self._reader.pos:])):
                    self._streaming = True
                    header["ops"] = []    # read one by one, by ops()
                    break
                header[key] = self._member(key)
        except JSONTextError as e:
            raise TraceError(f"not valid JSON: {e}", field=e.key) from None
        self._parser = _Parser(header)
        self._ops_doc = header["ops"]      # the ops array, when it had to be decoded whole
        self.buffers: Mapping[str, Buffer] = self._parser.buffers
        self.streams: tuple[str, ...] = self._parser.streams
        self.threads: tuple[str, ...] = self._parser.threads
        self._offsets = array("q")     # where each op starts in the text, when streaming
        self._parsed: list[Op] = []    # the ops, when not
        self._read = False

    def _member(self, key: str) -> Any:
        try:
            return self._reader.value()
        except JSONTextError as e:
            raise TraceError(f"not valid JSON: {e}", field=key) from None

    def ops(self) -> Iterator[Op]:
        """The ops in program order, each validated (once: a second call raises RuntimeError)."""
        if self._read:
            raise RuntimeError("TraceText.ops() reads the text once")
        self._read = True
        parser = self._parser
        if not self._streaming:
            raw_ops = self._ops_doc
            if not isinstance(raw_ops, list):
                parser.fail("ops", f"expected an array of ops, got {_type_name(raw_ops)}")
            for i, raw in enumerate(raw_ops):
                op = parser.op(raw, i)
                self._parsed.append(op)
                yield op
            return
        i = 0
        offsets, parse = self._offsets, parser.op
        try:
            for start, raw in self._reader.items():
                offsets.append(start)
                yield parse(raw, i)
                i += 1
            for key in self._keys:   # nothing may follow streamed ops but the end of the trace
                raise TraceError(_unknown_top_level(key), field=_field(key))
        except JSONTextError as e:
            raise TraceError(f"not valid JSON: {e}", op_index=e.item, field=e.key) from None

    def trace(self) -> Trace:
        """The trace, once :meth:`ops` has been read to its end."""
        if self._streaming:
            ops = _TextOps(self.text, self._offsets, self._parser)
        else:
            ops = tuple(self._parsed)
        return Trace(self.buffers, self.streams, ops, threads=self.threads)


class _TextOps(Sequence):
    """The ops of a trace held as its JSON text: op ``i`` is parsed from ``text[offsets[i]:]``
    (the last ``CACHED`` ops asked for are kept: a report names some ops many times)."""

    CACHED = 256

    def __init__(self, text: str, offsets: array, parser: _Parser):
        self._text, self._offsets, self._parser = text, offsets, parser
        self._cache: dict[int, Op] = {}

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        op = self._cache.pop(i, None)
        if op is None:
            raw, _ = decode(self._text, self._offsets[i])
            op = self._parser.op(raw, i)
            if len(self._cache) >= self.CACHED:
                del self._cache[next(iter(self._cache))]     # the least recently asked for
        self._cache[i] = op
        return op

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None


def _field(key: str) -> str:
    """A key, as a field name in a message: cut and escaped."""
    return printable(cut(key, 60))


_REQUIRED_HEADER = frozenset(("version", "buffers", "streams"))


def _did_you_mean(key: Any, known: Iterable[str]) -> str:
    """`` (did you mean 'event'?)`` for a misspelt key, naming the closest known one; else empty."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key[:100], sorted(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _unknown_top_level(key: str) -> str:
    return f"unknown field (a trace has {', '.join(_TOP_LEVEL)}, optionally threads){_did_you_mean(key, _KEYS)}"


# --------------------------------------------------------------------------------------------
# Validation


_COMMON = frozenset(("op", "name", "at", "thread"))
_FIELDS: dict[str, tuple[frozenset, frozenset]] = {
    # kind: (required, optional) besides "op", "name", "at" and "thread"
    "kernel": (frozenset(("stream",)), frozenset(("reads", "writes"))),
    "copy": (frozenset(("stream", "src", "dst")), frozenset()),
    "copy_batch": (frozenset(("stream", "order", "copies")), frozenset()),
    "record": (frozenset(("event", "stream")), frozenset()),
    "wait_event": (frozenset(("stream", "event")), frozenset()),
    "wait_stream": (frozenset(("stream", "on")), frozenset()),
    "sync_event": (frozenset(("event",)), frozenset()),
    "query_event": (frozenset(("event", "result")), frozenset()),
    "sync_stream": (frozenset(("stream",)), frozenset()),
    "sync_device": (frozenset(), frozenset()),
    "host_write": (frozenset(("ranges",)), frozenset()),
    "host_read": (frozenset(("ranges",)), frozenset()),
    "release": (frozenset(("sync",)), frozenset()),
    "acquire": (frozenset(("sync",)), frozenset()),
    "free": (frozenset(("ranges",)), frozenset()),
}
_ALLOWED = {kind: required | optional | _COMMON for kind, (required, optional) in _FIELDS.items()}


def _listed(names: set[str]) -> str:
    """Declared names for a message: the first eight, sorted, and how many more."""
    shown = ", ".join(quote(x) for x in sorted(names)[:8]) or "none"
    more = len(names) - 8
    return shown + (f" and {more} more" if more > 0 else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _type_name(x: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(x), type(x).__name__)


_new = tuple.__new__   # a named tuple from a tuple of all its fields, without the argument machinery


class _NotPlain(Exception):
    """A range the fast path of parsing does not take."""





class _Parser:
    """Validates a trace: the header (version, buffers, streams, threads) when made, each op by :meth:`op`."""

    def __init__(self, doc: Any):
        self.buffers: dict[str, Buffer] = {}
        self.stream_set: set[str] = set()
        self.thread_set: set[str] = set()
        self.i: int | None = None
        self.kind: str | None = None
        if not isinstance(doc, dict):
            self.fail(None, f"a trace is a JSON object, got {_type_name(doc)}")
        for key in doc:
            if key not in _KEYS:
                self.fail(_field(key), _unknown_top_level(key))
        for key in _TOP_LEVEL:
            if key not in doc:
                self.fail(key, "missing")
        version = doc["version"]
        if not _is_int(version) or version != VERSION:
            self.fail("version", f"unknown version {show(version)} (this checker reads version {VERSION})")
        self._buffers(doc["buffers"])
        self.streams = self._streams(doc["streams"])
        self.threads: tuple[str, ...] = self.threads_of(doc["threads"]) if "threads" in doc else ()
        # for the fast path of range parsing, per buffer: the one str object of its name, its size
        # (host accesses look up only host buffers)
        self.plain = {name: (name, b.nbytes) for name, b in self.buffers.items()}
        self.plain_host = {name: v for name, v in self.plain.items() if self.buffers[name].space != DEVICE_SPACE}
        builders = {"kernel": self._kernel, "copy": self._copy, "copy_batch": self._copy_batch,
                    "record": self._record, "wait_event": self._wait_event, "wait_stream": self._wait_stream,
                    "sync_event": self._sync_event, "query_event": self._query_event,
                    "sync_stream": self._sync_stream, "sync_device": self._sync_device,
                    "host_write": self._host_write, "host_read": self._host_read, "release": self._release,
                    "acquire": self._acquire, "free": self._free}
        # per kind: the keys it allows, and its builder
        self._kinds = {kind: (_ALLOWED[kind], build) for kind, build in builders.items()}

    def fail(self, field: str | None, message: str):
        raise TraceError(message, op_index=self.i, field=field, op_kind=self.kind)

    def _buffers(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            self.fail("buffers", f"expected an object of buffers, got {_type_name(raw)}")
        for name, b in raw.items():
            if not isinstance(name, str) or not name:  # JSON keys are strings; a Python dict's need not be
                self.fail("buffers", f"a buffer name is a non-empty string, got {show(name)}")
            where = f"buffers.{_field(name)}"
            if not isinstance(b, dict):
                self.fail(where, f"expected {{\"space\": ..., \"bytes\": ...}}, got {_type_name(b)}")
            for key in sorted(set(b) - {"space", "bytes"})[:1]:
                self.fail(f"{where}.{_field(key)}", f"unknown field{_did_you_mean(key, ('space', 'bytes'))}")
            for key in ("space", "bytes"):
                if key not in b:
                    self.fail(f"{where}.{key}", "missing")
            space, nbytes = b["space"], b["bytes"]
            if space not in SPACES:
                self.fail(f"{where}.space", f"unknown space {show(space)} (expected one of {', '.join(SPACES)})")
            if not _is_int(nbytes) or nbytes <= 0:
                self.fail(f"{where}.bytes", f"expected a positive integer, got {show(nbytes)}")
            self.buffers[name] = Buffer(name, space, nbytes)

    def _streams(self, streams: Any) -> tuple[str, ...]:
        if not isinstance(streams, list):
            self.fail("streams", f"expected an array of stream names, got {_type_name(streams)}")
        for k, s in enumerate(streams):
            if not isinstance(s, str) or not s:
                self.fail(f"streams[{k}]", f"a stream name is a non-empty string, got {show(s)}")
            if s in self.stream_set:
                self.fail(f"streams[{k}]", f"stream {quote(s)} is declared twice")
            self.stream_set.add(s)
        return tuple(streams)

    def threads_of(self, threads: Any) -> tuple[str, ...]:
        """The top-level ``threads`` (format 1.2): unique non-empty names, at least one. Raises
        :class:`TraceError`."""
        self.i = self.kind = None
        if not isinstance(threads, list) or not threads:
            self.fail("threads", f"expected a non-empty array of thread names, got {show(threads)}")
        seen: set[str] = set()
        for k, t in enumerate(threads):
            if not isinstance(t, str) or not t:
                self.fail(f"threads[{k}]", f"a thread name is a non-empty string, got {show(t)}")
            if t in seen:
                self.fail(f"threads[{k}]", f"thread {quote(t)} is declared twice")
            seen.add(t)
        self.thread_set = seen
        return tuple(threads)

    # -- op fields ------------------------------------------------------------------------

    def op(self, raw: Any, i: int) -> Op:
        """Op ``i`` of the trace, validated. Raises :class:`TraceError`."""
        self.i = i
        try:
            # The common case in a few operations: keys the op's kind allows, and a builder that
            # finds its fields valid. Anything amiss (a missing field is a KeyError) is named by
            # the careful way below, which checks in the order the messages promise.
            self.kind = kind = raw["op"]
            allowed, build = self._kinds[kind]
            if type(raw) is dict and allowed.issuperset(raw):
                name, at, thread = raw.get("name"), raw.get("at"), raw.get("thread")
                if (type(name) is str or name is None and "name" not in raw) and \
                        (type(at) is str or at is None and "at" not in raw) and \
                        (thread is None and "thread" not in raw or thread in self.thread_set):
                    return build(raw, name, at, thread)
        except (KeyError, TypeError, TraceError):
            pass
        return self._op(raw, i)

    def _op(self, raw: Any, i: int) -> Op:
        self.i, self.kind = i, None
        if not isinstance(raw, dict):
            self.fail(None, f"an op is a JSON object, got {_type_name(raw)}")
        if "op" not in raw:
            self.fail("op", "missing")
        kind = raw["op"]
        if not isinstance(kind, str) or kind not in _FIELDS:
            self.fail("op", f"unknown op {show(kind)} (expected one of {', '.join(_FIELDS)})")
        self.kind = kind
        required, allowed = _FIELDS[kind][0], _ALLOWED[kind]
        if not (required <= raw.keys() <= allowed):
            # an unknown key first: a misspelt one is the likely cause of a missing one
            for key in sorted(raw.keys() - allowed)[:1]:
                article = "an" if kind[0] in "aeiou" else "a"
                self.fail(_field(key), f"unknown field for {article} {kind} op{_did_you_mean(key, allowed)}")
            for key in sorted(required - raw.keys()):
                self.fail(key, "missing")
        name = raw.get("name")
        if "name" in raw and type(name) is not str:  # optional, and a string when given (null is not one)
            self.fail("name", f"expected a string, got {_type_name(name)}")
        at = raw.get("at")
        if "at" in raw and type(at) is not str:
            self.fail("at", f"expected a string (file:line in function), got {_type_name(at)}")
        thread = raw.get("thread")
        if "thread" in raw:
            if type(thread) is not str:
                self.fail("thread", f"expected a thread name, got {_type_name(thread)}")
            if thread not in self.thread_set:
                if not self.thread_set:
                    self.fail("thread", f"unknown thread {quote(thread)}: the trace declares no threads "
                                        "(a top-level \"threads\" array)")
                self.fail("thread", f"unknown thread {quote(thread)} (declared: {_listed(self.thread_set)})")
        return self._kinds[kind][1](raw, name, at, thread)

    def _kernel(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Kernel:
        return _new(Kernel, (self._stream(raw, "stream"), self._ranges(raw, "reads", True, False),
                             self._ranges(raw, "writes", True, False), name, at, thread))

    def _copy(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Copy:
        src, dst = self._range(raw["src"], "src"), self._range(raw["dst"], "dst")
        self._same_length(src, dst, "dst")
        return _new(Copy, (self._stream(raw, "stream"), src, dst, name, at, thread))

    def _copy_batch(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> CopyBatch:
        stream = self._stream(raw, "stream")
        order = raw["order"]
        if order not in ORDERS:
            self.fail("order", f"unknown order {show(order)} (expected one of {', '.join(ORDERS)})")
        return _new(CopyBatch, (stream, order, self._copies(raw["copies"]), name, at, thread))

    def _record(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Record:
        return _new(Record, (self._event(raw), self._stream(raw, "stream"), name, at, thread))

    def _wait_event(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> WaitEvent:
        return _new(WaitEvent, (self._stream(raw, "stream"), self._event(raw), name, at, thread))

    def _wait_stream(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> WaitStream:
        return _new(WaitStream, (self._stream(raw, "stream"), self._stream(raw, "on"), name, at, thread))

    def _sync_event(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> SyncEvent:
        return _new(SyncEvent, (self._event(raw), name, at, thread))

    def _query_event(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> QueryEvent:
        result = raw["result"]
        if not isinstance(result, bool):
            self.fail("result", f"expected true or false, got {show(result)}")
        return _new(QueryEvent, (self._event(raw), result, name, at, thread))

    def _sync_stream(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> SyncStream:
        return _new(SyncStream, (self._stream(raw, "stream"), name, at, thread))

    def _sync_device(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> SyncDevice:
        return _new(SyncDevice, (name, at, thread))

    def _host_write(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> HostWrite:
        return _new(HostWrite, (self._ranges(raw, "ranges", False, True), name, at, thread))

    def _host_read(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> HostRead:
        return _new(HostRead, (self._ranges(raw, "ranges", False, True), name, at, thread))

    def _release(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Release:
        return _new(Release, (self._sync(raw), name, at, thread))

    def _acquire(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Acquire:
        return _new(Acquire, (self._sync(raw), name, at, thread))

    def _free(self, raw: dict, name: str | None, at: str | None, thread: str | None) -> Free:
        # unlike host_write, a free may name device memory (rule 9)
        return _new(Free, (self._ranges(raw, "ranges", False, False), name, at, thread))

    def _stream(self, raw: dict, field: str) -> str:
        s = raw[field]
        if not isinstance(s, str):
            self.fail(field, f"expected a stream name, got {_type_name(s)}")
        if s not in self.stream_set:
            self.fail(field, f"unknown stream {quote(s)} (declared: {_listed(self.stream_set)})")
        return s

    def _sync(self, raw: dict) -> str:
        x = raw["sync"]
        if not isinstance(x, str) or not x:
            self.fail("sync", f"a sync object's name is a non-empty string, got {show(x)}")
        return x

    def _event(self, raw: dict) -> str:
        e = raw["event"]
        if not isinstance(e, str) or not e:
            self.fail("event", f"an event name is a non-empty string, got {show(e)}")
        return e

    def _ranges(self, raw: dict, field: str, optional: bool, host: bool) -> tuple[Range, ...]:
        """``raw[field]`` as ranges (``optional``: the field may be missing; ``host``: host buffers only)."""
        if optional and field not in raw:
            return ()
        items = raw[field]
        if not isinstance(items, list):
            self.fail(field, f"expected an array of [buffer, offset, length], got {_type_name(items)}")
        try:
            return tuple(self._plain_ranges(self.plain_host if host else self.plain, items))
        except (_NotPlain, ValueError, TypeError, KeyError):
            # the slow path says what is wrong (or accepts an int subclass)
            return tuple(self._range(r, f"{field}[{k}]", host=host) for k, r in enumerate(items))

    def _plain_ranges(self, plain: dict[str, tuple[str, int]], items: list) -> list[Range]:
        """``items`` as Ranges when each is plainly valid (``plain``: the buffers allowed); else
        raises _NotPlain, ValueError, TypeError or KeyError. The common case of parsing, a few
        operations per range: anything else fails one of them (a string of three letters unpacks,
        but its "offset" is no int)."""
        out = []
        append = out.append
        new = _new
        for name, offset, length in items:
            b = plain[name]
            if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0 \
                    or offset + length > b[1]:
                raise _NotPlain
            append(new(Range, (b[0], offset, length)))
        return out

    def _copies(self, items: Any) -> tuple[Transfer, ...]:
        if not isinstance(items, list):
            self.fail("copies", f"expected an array of {{\"src\", \"dst\"}} objects, got {_type_name(items)}")
        if not items:
            self.fail("copies", "a copy_batch needs at least one copy")
        try:
            if all(type(c) is dict and len(c) == 2 for c in items):
                srcs = self._plain_ranges(self.plain, [c["src"] for c in items])
                dsts = self._plain_ranges(self.plain, [c["dst"] for c in items])
                if all(s[2] == d[2] for s, d in zip(srcs, dsts)):
                    return tuple(map(_new, repeat(Transfer), zip(srcs, dsts)))
        except (_NotPlain, ValueError, TypeError, KeyError):
            pass
        return tuple(self._copy_slowly(k, c) for k, c in enumerate(items))

    def _copy_slowly(self, k: int, c: Any) -> Transfer:
        """Copy ``k`` of a batch, validated field by field (the message names what is wrong)."""
        where = f"copies[{k}]"
        if not isinstance(c, dict):
            self.fail(where, f"expected {{\"src\": range, \"dst\": range}}, got {_type_name(c)}")
        for key in sorted(set(c) - {"src", "dst"})[:1]:
            self.fail(f"{where}.{_field(key)}", f"unknown field{_did_you_mean(key, ('src', 'dst'))}")
        for key in ("src", "dst"):
            if key not in c:
                self.fail(f"{where}.{key}", "missing")
        src, dst = self._range(c["src"], f"{where}.src"), self._range(c["dst"], f"{where}.dst")
        self._same_length(src, dst, f"{where}.dst")
        return Transfer(src, dst)

    def _same_length(self, src: Range, dst: Range, field: str) -> None:
        if src.length != dst.length:
            self.fail(field, f"a copy moves one size: dst has {dst.length} bytes, src {src.length}")

    def _range(self, r: Any, field: str, *, host: bool = False) -> Range:
        if type(r) is not list or len(r) != 3:
            self.fail(field, f"expected a range [buffer, offset, length], got {show(r)}")
        name, offset, length = r
        buf = self.buffers.get(name) if type(name) is str else None
        if buf is None:
            if not isinstance(name, str):
                self.fail(field, f"a range starts with a buffer name, got {show(name)}")
            self.fail(field, f"unknown buffer {quote(name)}")
        # type() and not isinstance(): True is no offset
        if type(offset) is not int or offset < 0:
            if not (_is_int(offset) and offset >= 0):
                self.fail(field, f"offset must be an integer >= 0, got {show(offset)}")
            offset = int(offset)
        if type(length) is not int or length <= 0:
            if not (_is_int(length) and length > 0):
                self.fail(field, f"length must be an integer > 0, got {show(length)}")
            length = int(length)
        if offset + length > buf.nbytes:
            self.fail(field, f"range {show(r)} ends at byte {show(offset + length)}, past the end of "
                             f"buffer {quote(name)} ({buf.nbytes} bytes)")
        if host and buf.space == DEVICE_SPACE:
            self.fail(field, f"host access to device memory: buffer {quote(name)} is {buf.space}; "
                             "the host may touch only host buffers")
        return _new(Range, (buf.name, offset, length))   # one str object per buffer name
