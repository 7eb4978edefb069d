"""``kvverify.check(trace, *, max_races=10000) -> Verdict``: whether a trace of stream work races
(``check`` below), and the package of traces and the happens-before checker behind ``kvverify check``.

- :mod:`~kvverify.check.model`: the trace format (``docs/trace-format.md``), the names of the four
  modules that hold it: :mod:`~kvverify.check.ops` (values and ops), :mod:`~kvverify.check.text`
  (text safe to print), :mod:`~kvverify.check.parser` (:class:`Trace`, parsing, validation,
  :class:`TraceText`: a trace read op by op), :mod:`~kvverify.check.builder` (:class:`TraceBuilder`);
- :mod:`~kvverify.check.jsontext`: strict JSON (repeated keys, NaN) read a piece at a time;
- :mod:`~kvverify.check.rules`: the ordering rules 1–9 as vector clocks (one definition);
- :mod:`~kvverify.check.checker`: :func:`check`, the race finder;
- :mod:`~kvverify.check.explain`: why a race is one, and a fix;
- :mod:`~kvverify.check.oracle`: an independent enumerator of executions, the checker's oracle;
- :mod:`~kvverify.check.verdict`: :class:`Verdict`, :class:`Race`;
- :mod:`~kvverify.check.cli`: ``kvverify check``.

The package itself is callable: ``kvverify.check(trace)`` is :func:`check`. Standard library only.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping

from kvverify.check import checker
from kvverify.check.model import (
    ORDERS,
    SPACES,
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
    Trace,
    TraceBuilder,
    TraceError,
    TraceText,
    Transfer,
    WaitEvent,
    WaitStream,
)
from kvverify.check.rules import Access, Ordering, Side, analyze, happens_before
from kvverify.check.verdict import RACY, SAFE, Race, Verdict

__all__ = [
    "ORDERS",
    "RACY",
    "SAFE",
    "SPACES",
    "Access",
    "Acquire",
    "Buffer",
    "Copy",
    "CopyBatch",
    "Free",
    "HostRead",
    "HostWrite",
    "Kernel",
    "Op",
    "Ordering",
    "QueryEvent",
    "Race",
    "Range",
    "Record",
    "Release",
    "Side",
    "SyncDevice",
    "SyncEvent",
    "SyncStream",
    "Trace",
    "TraceBuilder",
    "TraceError",
    "TraceText",
    "Transfer",
    "Verdict",
    "WaitEvent",
    "WaitStream",
    "analyze",
    "check",
    "happens_before",
]


def check(trace: Trace | Mapping | str | bytes | os.PathLike, *, max_races: int | None = checker.DEFAULT_MAX_RACES) -> Verdict:
    """Decide whether ``trace`` races under the ordering rules of the trace format
    (``docs/trace-format.md``; each rule cites the CUDA API section it follows).

    ``trace``: a :class:`Trace`, a decoded JSON document (a dict), JSON text (``bytes``, or a
    ``str`` that starts with ``{`` and ends with ``}``), or the path of a JSON file (read as it is checked: ops are
    parsed one at a time, and the verdict's trace holds the text).
    ``max_races`` bounds how many races are listed (``None``: all); the verdict does not depend on it.

    Returns a :class:`Verdict`: ``.verdict`` is ``"SAFE"`` or ``"RACY"``, ``.races`` the witnesses
    (both ops, the bytes, the kind, why no rule orders them, a fix).

    Raises :class:`TraceError` (a ``ValueError``) naming the op index and field of an invalid
    trace, or for a ``str`` that is JSON text but no object (``"[]"``) and no file either, and
    ``OSError`` when a path cannot be read.
    """
    if isinstance(trace, str) and trace.lstrip().startswith("{") and trace.rstrip().endswith("}"):
        trace = Trace.from_json(trace)
    elif isinstance(trace, (str, os.PathLike)):
        try:
            with open(trace, "rb") as f:
                text = TraceText(f.read())
        except FileNotFoundError:
            if isinstance(trace, str) and (trace.lstrip()[:1] in ("[", '"') or "\n" in trace):
                # JSON text that is no object reads as a path: say that, not "no such file"
                raise TraceError(f"{_excerpt(trace)} is neither a trace file nor a trace: a trace is a JSON "
                                 "object ('{...}'); pass its text, a dict or a file's path") from None
            raise
        return checker.check_ops(text.buffers, text.streams, text.ops(), text.trace, max_races=max_races,
                                 threads=text.threads)
    if not isinstance(trace, Trace):
        trace = Trace.from_json(trace)
    return checker.check(trace, max_races=max_races)


def _excerpt(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class _CallablePackage(types.ModuleType):
    """``kvverify.check`` is this package and, called, :func:`check`: ``import kvverify.check.model``
    and ``kvverify.check(trace)`` both work."""

    def __call__(self, trace, **kwargs) -> Verdict:
        return check(trace, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
