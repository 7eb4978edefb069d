"""The one rule every screen of kvverify follows.

A screen (a report, a help, a listing, a warning) is laid out for one width: ``COLUMNS`` when it is
set, else the terminal's, else 80 columns (a pipe, a file, a log). argparse lays the help out for
that width and rich's consoles (``kvverify stress``, ``kvverify merge``) theirs; ``fit`` gives it to
the rest. No line ends in spaces. A span in backquotes (a command or a path meant for copying) is
never broken, even where it makes its line longer than the width. A log that wants whole lines sets
``COLUMNS`` wide. Two things are not laid out for the width: a one-line message on stderr
(``kvverify CMD: ...``, an error), which stays one line so that a search of a log finds it whole,
and a wide table (``stress --details``, probe's and bench's in a log without ``COLUMNS``, the
corpus's markdown), which keeps one line per row.

Standard library only: ``kvverify check`` prints through it. ``StripTrailingSpaces`` takes the
spaces off the lines of rich's consoles.
"""

from __future__ import annotations

import os
import re
import textwrap

# A backquoted span, and the character its spaces become while textwrap cuts the line: one of
# Unicode's private-use characters, which no message of kvverify holds and textwrap does not split on.
_CODE = re.compile(r"`[^`\n]*`")
_GLUE = "\ue000"
# Continuation lines hang under the text that follows a one-word label ("  why:    op 2 reads ..."),
# or two columns in where a line has none.
_LABEL = re.compile(r"\s*(?:[\w-]+:\s+)?")
# Trailing spaces, and the colour codes a terminal line may end with after them.
_TAIL = re.compile(r"(?:[ \t]|\x1b\[[0-9;]*m)*\Z")


def width(stream) -> int:
    """The columns a screen on ``stream`` is laid out for: ``COLUMNS`` when set (as in
    ``shutil.get_terminal_size``), else the terminal's where ``stream`` is one, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    try:
        if stream is not None and stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):  # closed, not a file at all, or a size not read
        pass
    return 80


def fit(text: str, stream) -> str:
    """``text`` as ``stream`` should get it: wrapped to ``width(stream)``, a backquoted span never
    broken, and no line ending in spaces."""
    columns = width(stream)
    return "\n".join(_fit_line(line, columns) for line in text.split("\n"))


def _fit_line(line: str, columns: int) -> str:
    line = line.rstrip(" \t")
    if len(line) <= columns:
        return line
    indent = line[: len(line) - len(line.lstrip())]
    label = len(_LABEL.match(line).group(0)) - len(indent)
    hang = indent + " " * (label or 2)
    # an indent that leaves too little room on the line reads worse than none
    first = indent if len(indent) <= columns // 3 else ""
    hang = hang if len(hang) <= columns // 3 else first
    glued = _CODE.sub(lambda m: m.group(0).replace(" ", _GLUE), line[len(indent):])
    lines = textwrap.wrap(glued, width=columns, initial_indent=first, subsequent_indent=hang,
                          break_long_words=False, break_on_hyphens=False)
    return "\n".join(wrapped.replace(_GLUE, " ").rstrip(" ") for wrapped in lines)


class StripTrailingSpaces:
    """A text stream that passes everything to ``file`` but the spaces at the end of each line.

    What follows the last newline written is passed on at once, except its trailing spaces (and
    colour codes after them): those wait until the line goes on, or are dropped at its end. Every
    other attribute (``isatty``, ``fileno``, ``encoding``, ...) is ``file``'s.
    """

    def __init__(self, file) -> None:
        self._file = file
        self._held = ""

    def write(self, text: str) -> int:
        pending = self._held + text
        *complete, last = pending.split("\n")
        out = "".join(_strip_line(line) + "\n" for line in complete)
        tail = _TAIL.search(last).start()
        self._held = last[tail:]
        self._file.write(out + last[:tail])
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _strip_line(line: str) -> str:
    tail = _TAIL.search(line).start()
    return line[:tail] + "".join(re.findall(r"\x1b\[[0-9;]*m", line[tail:]))
