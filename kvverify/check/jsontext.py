"""Strict JSON, read a piece at a time: the standard library's decoder, with what a trace needs on
top of it.

- An object with a repeated key is an error (the decoder keeps the last value silently; a trace
  that says ``"order": "STREAM", "order": "ANY"`` must not pass as ANY). The check is one ``len``
  per object, on the dict the decoder builds anyway.
- ``NaN`` and ``Infinity``, which Python accepts and JSON does not, are errors; so is a number
  beyond a float's range (``1e999``, which the decoder makes an infinity).
- Every failure is one :class:`JSONTextError` with the position in the text: syntax errors, nesting
  deeper than the decoder's recursion allows, integers longer than Python converts (its
  ``sys.get_int_max_str_digits()`` limit, 4300 digits by default).
- :class:`ObjectReader` reads the members of the top-level object one by one, and an array member
  item by item, so a document of millions of ops is never decoded into one list; :func:`loads`
  reads a whole document at once (the other documents kvverify reads: stress reports, paths).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from json.decoder import scanstring


class JSONTextError(ValueError):
    """The text is not the JSON expected. ``message`` says why, ``pos`` is the character offset,
    ``line`` / ``column`` (1-based) where that is."""

    def __init__(self, message: str, text: str, pos: int, key: str | None = None):
        self.message = message
        self.pos = pos
        self.key = key          # the repeated key, for an object that repeats one
        self.item: int | None = None   # the index of the array item it is in (ObjectReader.items)
        self.line = text.count("\n", 0, pos) + 1
        self.column = pos - text.rfind("\n", 0, pos)
        super().__init__(f"{message} (line {self.line}, column {self.column})")


class _Repeated(Exception):
    def __init__(self, key: str):
        self.key = key


def _object(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _Repeated(key)
            seen.add(key)
    return d


def _constant(name: str):
    raise _NotJSON(f"{name} is not JSON (a number must be finite)")


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotJSON(f"the number {text[:40]} is beyond a float's range")
    return value


class _NotJSON(Exception):
    def __init__(self, message: str):
        self.message = message


def _key(key: str) -> str:
    # a key as JSON (control characters escaped), cut to 60 characters
    cut = len(key) - 60
    return json.dumps(key[:60]) + (f" (cut: {cut} more characters)" if cut > 0 else "")


_scan = json.JSONDecoder(object_pairs_hook=_object, parse_float=_float, parse_constant=_constant).scan_once
_SPACE = re.compile(r"[ \t\n\r]*")
_NEXT = re.compile(r"[ \t\n\r]*(?:(,)[ \t\n\r]*|(\]))")   # after an array item: a comma, or the end


def decode(text: str, pos: int) -> tuple[object, int]:
    """The JSON value starting at ``text[pos]`` (no leading whitespace) and the offset after it.
    Raises :class:`JSONTextError`."""
    try:
        return _scan(text, pos)
    except StopIteration as e:
        raise JSONTextError("Expecting value", text, e.value) from None
    except json.JSONDecodeError as e:
        raise JSONTextError(e.msg, text, e.pos) from None
    except _Repeated as e:
        raise JSONTextError(f"an object repeats the key {_key(e.key)}: which one counts?", text, pos,
                            e.key) from None
    except _NotJSON as e:
        raise JSONTextError(e.message, text, pos) from None
    except RecursionError:
        raise JSONTextError("nested too deeply for the JSON decoder", text, pos) from None
    except ValueError:   # int(): more digits than sys.get_int_max_str_digits() allows
        raise JSONTextError(f"an integer with more than {sys.get_int_max_str_digits()} digits (more than "
                            "Python converts; no size or offset needs that many)", text, pos) from None


def loads(text: str) -> object:
    """The JSON value that is the whole of ``text`` (whitespace around it allowed), read strictly
    (see the module docstring). Raises :class:`JSONTextError`."""
    value, end = decode(text, _SPACE.match(text).end())
    end = _SPACE.match(text, end).end()
    if end != len(text):
        raise JSONTextError("extra text after the JSON value", text, end)
    return value


class ObjectReader:
    """The members of the JSON object that is the whole of ``text``, in order.

    ``for key in reader.members():`` then, for each key, exactly one of ``reader.value()`` (the
    member's decoded value) or ``reader.items()`` (an array member's items, one by one, each as
    ``(offset in the text, value)``). After the last key, the text must end (whitespace only).
    Raises :class:`JSONTextError`; a repeated top-level key is one too."""

    def __init__(self, text: str):
        self.text = text
        self.pos = _SPACE.match(text).end()
        if not text.startswith("{", self.pos):
            found = repr(text[self.pos]) if self.pos < len(text) else "the end of the text"
            raise JSONTextError(f"a trace is a JSON object: expected '{{', found {found}", text, self.pos)
        self.pos += 1

    def _skip(self) -> str:
        """Skip whitespace; the next character ('' at the end)."""
        self.pos = _SPACE.match(self.text, self.pos).end()
        return self.text[self.pos:self.pos + 1]

    def _fail(self, message: str):
        raise JSONTextError(message, self.text, self.pos)

    def members(self) -> Iterator[str]:
        seen: set[str] = set()
        first = True
        while True:
            c = self._skip()
            if c == "}" and first:
                break
            if c != '"':
                self._fail("expected a key in double quotes" if first else "expected a key after ','")
            try:
                key, self.pos = scanstring(self.text, self.pos + 1)
            except json.JSONDecodeError as e:
                raise JSONTextError(e.msg, self.text, e.pos) from None
            if key in seen:
                raise JSONTextError(f"the trace repeats the key {_key(key)} (the trace format forbids "
                                    "repeated keys: which one counts?)", self.text, self.pos, key)
            seen.add(key)
            if self._skip() != ":":
                self._fail("expected ':' after the key")
            self.pos += 1
            self._skip()
            yield key
            c = self._skip()
            first = False
            if c == ",":
                self.pos += 1
            elif c == "}":
                break
            else:
                self._fail("expected ',' or '}' after a member of the trace")
        self.pos += 1
        if self._skip():
            self._fail("extra text after the trace's closing '}'")

    def value(self) -> object:
        value, self.pos = decode(self.text, self.pos)
        return value

    def at_array(self) -> bool:
        """True when the member's value is an array (read it with :meth:`items`)."""
        return self.text.startswith("[", self.pos)

    def items(self) -> Iterator[tuple[int, object]]:
        self.pos += 1
        if self._skip() == "]":
            self.pos += 1
            return
        text, after = self.text, _NEXT.match
        n, pos = 0, self.pos
        while True:
            try:
                value, end = _scan(text, pos)
            except Exception:       # the rare case: decode() says what was wrong
                try:
                    decode(text, pos)
                except JSONTextError as e:
                    e.item = n
                    raise
                raise
            yield pos, value
            m = after(text, end)
            if m is None:
                self.pos = _SPACE.match(text, end).end()
                e = JSONTextError("expected ',' or ']' after this item of the array", text, self.pos)
                e.item = n
                raise e
            n, pos = n + 1, m.end()
            if m.group(2):
                self.pos = pos
                return
