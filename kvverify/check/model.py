"""The trace model of ``docs/trace-format.md`` (version 1.2): the names the checker, the scenarios and
the recorder import, each from the module of ``kvverify.check`` that holds it.

A :class:`Trace` is what a program asked a CUDA device to do, in the order its host threads
issued it (format 1.2: ops may name their thread; ``release`` / ``acquire`` order threads, and
``free`` gives bytes back). It lives in four modules, one job each:

- ``kvverify.check.ops``: the values and the ops. Every op is a small named tuple; a byte range is a
  :class:`Range` named tuple ``(buffer, offset, length)``, which is also how :class:`TraceBuilder`
  takes ranges, and each copy of a batch a :class:`Transfer` named tuple ``(src, dst)``;
- ``kvverify.check.text``: text that is safe to print (``printable``, ``cut``, ``show``);
- ``kvverify.check.parser``: :class:`Trace` and its one parser. All validation lives there, behind
  :meth:`Trace.from_json` (a decoded document or JSON text) and :class:`TraceText` (JSON text, its
  ops validated one at a time as a checker consumes them); invalid input raises
  :class:`TraceError`, which names the op index and the field in one printable line of bounded
  length, whatever the input holds;
- ``kvverify.check.builder``: :class:`TraceBuilder`, whose ``build`` goes through the same parser,
  so a trace built in code and one read from a file are checked by the same lines.
"""

from __future__ import annotations

from kvverify.check.builder import RangeLike, TraceBuilder
from kvverify.check.ops import (
    PAGEABLE,
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
    union,
)
from kvverify.check.parser import Trace, TraceText, gc_paused
from kvverify.check.text import cut, printable, show
from kvverify.errors import TraceError
from kvverify.terms import DEVICE_SPACE, HOST_SPACE, ORDERS, SPACES

__all__ = [
    "DEVICE_SPACE", "HOST_SPACE", "ORDERS", "PAGEABLE", "SPACES", "VERSION",
    "Acquire", "Buffer", "Copy", "CopyBatch", "Free", "HostRead", "HostWrite", "Kernel", "Op", "QueryEvent", "Range",
    "RangeLike", "Record", "Release", "SyncDevice", "SyncEvent", "SyncStream", "Trace", "TraceBuilder", "TraceError",
    "TraceText", "Transfer", "WaitEvent", "WaitStream",
    "cut", "describe_op", "gc_paused", "op_to_json", "printable", "show", "union",
]
