"""``kvverify.screen``: the one rule of every screen: laid out for ``COLUMNS``, else the terminal's
width, else 80 columns (piped), no trailing spaces, and a backquoted command never broken; every
help screen and the corpus's listing keep to it at 80 columns."""

from __future__ import annotations

import io
import re

import pytest

from kvverify import screen

WARNING = ("kvverify: NVTX annotation is off: the nvtx package cannot be imported (ImportError: import of nvtx "
           "halted; None in sys.modules); the run goes on without NVTX ranges (install it with `pip install nvtx`).")
REPORT = ("race 1: RAW on gpu_kv[0:16384] (16384 bytes), rule 5   \n"
          "  why:    op 2 reads its device source gpu_kv[0:16384] with ANY order (rule 5): at any time from the call "
          "until the copy completes, after only what the host has observed complete, so it may happen before "
          "stream 'offload' reaches op 1's wait on 'compute'\n"
          "  fix:    use STREAM order for op 2: run `kvverify check --json trace.json` again after the change\n")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("columns", range(20, 300))
def test_on_a_terminal_lines_fit_keep_every_word_and_never_break_a_command(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    for text in (WARNING, REPORT):
        fitted = screen.fit(text, FakeTerminal())
        lines = fitted.split("\n")
        commands = re.findall(r"`[^`]*`", text)
        # a line may pass the width only to keep a command whole
        assert all(len(line) <= columns or any(c in line for c in commands) for line in lines), fitted
        assert all(line == line.rstrip() for line in lines), fitted
        assert all(any(c in line for line in lines) for c in commands), fitted
        assert words(fitted) == words(text)


def test_continuation_lines_hang_under_the_label(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    lines = screen.fit(REPORT, FakeTerminal()).split("\n")
    why = next(k for k, line in enumerate(lines) if line.startswith("  why:    "))
    fix = next(k for k, line in enumerate(lines) if line.startswith("  fix:    "))
    assert fix - why > 2 and all(line.startswith(" " * 10) and line[10] != " " for line in lines[why + 1:fix])


def test_piped_lines_fit_columns_else_80_without_trailing_spaces(monkeypatch):
    """Piped (a log, a file), a screen is as wide as ``COLUMNS`` says, else 80 columns: the width
    argparse and rich take there too."""
    monkeypatch.setenv("COLUMNS", "40")
    assert screen.width(io.StringIO()) == 40
    fitted = screen.fit(REPORT, io.StringIO()).split("\n")
    assert all(len(line) <= 40 or "`" in line for line in fitted) and words("\n".join(fitted)) == words(REPORT)
    monkeypatch.delenv("COLUMNS")
    assert screen.width(io.StringIO()) == screen.width(None) == 80
    fitted = screen.fit(WARNING, None).split("\n")
    assert len(fitted) > 1 and all(len(line) <= 80 for line in fitted), fitted
    assert all(line == line.rstrip() for line in screen.fit(REPORT, None).split("\n"))


def test_the_width_is_columns_first_then_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "77")
    assert screen.width(FakeTerminal()) == 77
    monkeypatch.delenv("COLUMNS")
    assert screen.width(FakeTerminal()) == 80  # a terminal whose size cannot be read


@pytest.mark.parametrize("pieces", [
    ["a table row   \n", "next\n"],
    ["padded  ", "", "   ", "\n", "x\n"],
    ["cell  ", " more\n"],
    ["styled \x1b[1m  \x1b[0m\n", "  \n"],
    ["progress 10%  ", "\rprogress 20%  ", "\n"],
])
def test_strip_trailing_spaces_passes_everything_but_the_spaces_ending_a_line(pieces):
    out = io.StringIO()
    stream = screen.StripTrailingSpaces(out)
    for piece in pieces:
        assert stream.write(piece) == len(piece)
    assert out.getvalue() == "\n".join(_strip(line) for line in "".join(pieces).split("\n"))


def _strip(line: str) -> str:
    """The line without its trailing spaces; colour codes among them stay, in order."""
    match = re.search(r"(?:[ \t]|\x1b\[[0-9;]*m)*$", line)
    return line[:match.start()] + "".join(re.findall(r"\x1b\[[0-9;]*m", match.group(0)))


def test_strip_trailing_spaces_is_the_file_it_wraps_otherwise():
    out = FakeTerminal()
    stream = screen.StripTrailingSpaces(out)
    assert stream.isatty() and stream.getvalue() == ""


def _screens() -> list[list[str]]:
    from kvverify.cli import SUBCOMMANDS

    return [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS] + [["corpus", "--list"]]


@pytest.mark.parametrize("argv", _screens(), ids=" ".join)
def test_every_help_screen_and_the_corpus_listing_fit_80_columns(monkeypatch, capsys, argv):
    """``kvverify --help``, each command's ``--help`` and ``kvverify corpus --list``, laid out for
    ``COLUMNS=80`` (whatever width this run has), print no line wider and none ending in spaces."""
    from kvverify.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    try:
        status = main(argv)
    except SystemExit as exc:  # --help
        status = exc.code
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    assert status == 0 and len(lines) > 5, out
    assert [line for line in lines if len(line) > 80] == [], out
    assert [line for line in lines if line != line.rstrip()] == [], out
