"""Traces of stream work and the happens-before checker behind ``kvverify check``.

- :mod:`~kvverify.trace.model`: the trace format (``docs/trace-format.md``), parsing, validation,
  :class:`TraceBuilder`;
- :mod:`~kvverify.trace.rules`: the ordering rules 1–7 as vector clocks (one definition);
- :mod:`~kvverify.trace.checker`: :func:`check`, the race finder;
- :mod:`~kvverify.trace.oracle`: an independent enumerator of executions, the checker's oracle;
- :mod:`~kvverify.trace.report`: :class:`Report`, :class:`Race`.
"""

from kvverify.trace.checker import check
from kvverify.trace.model import (
    ORDERS,
    SPACES,
    Buffer,
    Copy,
    CopyBatch,
    HostRead,
    HostWrite,
    Kernel,
    Op,
    QueryEvent,
    Range,
    Record,
    SyncDevice,
    SyncEvent,
    SyncStream,
    Trace,
    TraceBuilder,
    TraceError,
    Transfer,
    WaitEvent,
    WaitStream,
)
from kvverify.trace.report import RACY, SAFE, Race, Report
from kvverify.trace.rules import Access, Ordering, analyze, happens_before

__all__ = [
    "ORDERS",
    "RACY",
    "SAFE",
    "SPACES",
    "Access",
    "Buffer",
    "Copy",
    "CopyBatch",
    "HostRead",
    "HostWrite",
    "Kernel",
    "Op",
    "Ordering",
    "QueryEvent",
    "Race",
    "Range",
    "Record",
    "Report",
    "SyncDevice",
    "SyncEvent",
    "SyncStream",
    "Trace",
    "TraceBuilder",
    "TraceError",
    "Transfer",
    "WaitEvent",
    "WaitStream",
    "analyze",
    "check",
    "happens_before",
]
