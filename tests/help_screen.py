"""What every ``--help`` of kvverify keeps to: one screen of 100 x 50, plain text, an example last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKUP = ("``", "**", "`")  # reStructuredText or Markdown left in a terminal text


def help_lines(*argv: str) -> list[str]:
    """``kvverify ARGV --help`` as printed in a 100-column terminal (argparse reads COLUMNS)."""
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "kvverify", *argv, "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60, check=True).stdout
    return out.rstrip("\n").splitlines()


def check_screen(lines: list[str], max_lines: int = 50) -> list[str]:
    """Assert ``lines`` fit one screen in plain text and end with an example; return the example's
    command lines (without their leading spaces)."""
    text = "\n".join(lines)
    assert len(lines) <= max_lines and max(map(len, lines)) <= 100, text
    assert not any(mark in text for mark in MARKUP), text
    heading = max(i for i, line in enumerate(lines) if line in ("Example:", "Examples:"))
    examples = [line.strip() for line in lines[heading + 1:]]
    assert examples and all(e.startswith("kvverify") for e in examples), text
    return examples
