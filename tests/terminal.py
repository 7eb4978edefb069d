"""Run a command in a pseudo-terminal of a given width and read back what a person would see."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    """This checkout first, then whatever the environment adds (wheels carried to a GPU host)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def run_in_pty(argv: list[str], columns: int = 100, env: dict | None = None) -> tuple[int, list[str]]:
    """Run ``argv`` in a pseudo-terminal ``columns`` wide; return its exit status and what it printed
    as lines, with escape sequences removed and each line as the last carriage return left it (an
    upper bound on what stays on the screen: a progress bar that erases itself still counts).
    Trailing spaces are kept: a screen must not print them."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal's size is set before it starts
        try:
            os.execve(argv[0], argv, dict(os.environ, **(env or {}), COLUMNS=str(columns)))
        finally:
            os._exit(127)  # never back into pytest
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    out = b""
    while select.select([fd], [], [], 300)[0]:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))
    lines = [line.rstrip("\r").split("\r")[-1] for line in text.split("\n")]
    return os.waitstatus_to_exitcode(status), lines[:-1] if lines and not lines[-1] else lines


def check_fits(lines: list[str], columns: int) -> None:
    """Assert every line fits ``columns`` and none ends in a space."""
    text = "\n".join(lines)
    assert max(map(len, lines)) <= columns, text
    assert not [line for line in lines if line != line.rstrip()], "trailing spaces:\n" + "\n".join(
        repr(line) for line in lines if line != line.rstrip())
