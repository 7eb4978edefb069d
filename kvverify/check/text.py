"""Text that is safe to print, in one bounded line: what a message quotes of a trace (a name, a key,
any decoded JSON value) is escaped where a terminal would act on it (``printable``), cut to a length
(``cut``, ``show``) and quoted (``quote``), whatever the input holds.
"""

from __future__ import annotations

import json
import re
from typing import Any


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(m: re.Match) -> str:
    c = m.group()
    n = ord(c)
    return _ESCAPES.get(c) or (f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}")


def printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped, as Python does (``\\x1b``, ``\\u202e``):
    control characters, line and paragraph separators, bidirectional overrides and isolates, and
    lone surrogates (which cannot be encoded). Letters of every script pass unchanged."""
    return _UNPRINTABLE.sub(_escape, text)


def cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters (>= 40), saying how many were cut."""
    if len(text) <= limit:
        return text
    keep = limit - 40
    return f"{text[:keep]}… (cut: {len(text) - keep} more characters)"


def show(x: Any, limit: int = 100) -> str:
    """A decoded JSON value as a message shows it: JSON, at most about ``limit`` characters, with
    nested or long parts cut and counted (a value with millions of items or nested a thousand deep
    is shown in constant time and stack). Not escaped: see :func:`printable`."""
    if isinstance(x, str):
        more = len(x) - limit
        return json.dumps(x[:limit], ensure_ascii=False) + (f"… (cut: {more} more characters)" if more > 0 else "")
    if isinstance(x, bool) or x is None or isinstance(x, float):
        return json.dumps(x)
    if isinstance(x, int):
        if x.bit_length() > 3 * limit:   # str() of a huge int is slow, or refused
            return f"<an integer of about {int(x.bit_length() * 0.30103)} digits>"
        return cut(str(x), limit)
    if isinstance(x, (list, dict)):
        if limit < 8:
            return "[…]" if isinstance(x, list) else "{…}"
        items = list(x.items() if isinstance(x, dict) else x) if len(x) <= 8 else None
        if items is None:
            items = list(x.items())[:8] if isinstance(x, dict) else x[:8]
        parts, used = [], 2
        for item in items:
            part = (f"{show(item[0], limit // 3)}: {show(item[1], limit // 3)}" if isinstance(x, dict)
                    else show(item, limit // 3))
            if used + len(part) > limit and parts:
                break
            parts.append(part)
            used += len(part) + 2
        more = len(x) - len(parts)
        if more:
            parts.append(f"… ({more} more {'members' if isinstance(x, dict) else 'items'})")
        return ("{" if isinstance(x, dict) else "[") + ", ".join(parts) + ("}" if isinstance(x, dict) else "]")
    return type(x).__name__


def quote(name: str, limit: int = 60) -> str:
    """A name in single quotes for a message: cut and escaped."""
    return "'" + printable(cut(name, limit)) + "'"
