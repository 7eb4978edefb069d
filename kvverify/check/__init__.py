"""Traces of stream work and the happens-before checker behind ``kvverify check``.

- :mod:`~kvverify.check.model`: the trace format (``docs/trace-format.md``), parsing, validation,
  :class:`TraceBuilder`;
- :mod:`~kvverify.check.rules`: the ordering rules 1–7 as vector clocks (one definition);
- :mod:`~kvverify.check.checker`: :func:`check`, the race finder;
- :mod:`~kvverify.check.oracle`: an independent enumerator of executions, the checker's oracle;
- :mod:`~kvverify.check.verdict`: :class:`Report`, :class:`Race`.
"""

from kvverify.check.checker import check
from kvverify.check.model import (
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
from kvverify.check.rules import Access, Ordering, analyze, happens_before
from kvverify.check.verdict import RACY, SAFE, Race, Report

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
