"""``kvverify --help``: one screen, plain text, examples last; every subcommand it names exists."""

from __future__ import annotations

import pytest
from help_screen import check_screen, help_lines

from kvverify.cli import SUBCOMMANDS, main


def test_top_level_help_fits_a_screen_and_ends_with_examples():
    lines = help_lines()
    examples = check_screen(lines)
    assert {e.split()[1] for e in examples} <= set(SUBCOMMANDS)
    assert all(any(line.strip().startswith(name + " ") for line in lines) for name in SUBCOMMANDS)


def test_a_bad_option_of_a_subcommand_shows_that_subcommand_s_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--jsn", "trace.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvverify check ") and err.rstrip().endswith(
        "kvverify check: error: unrecognized arguments: --jsn")


def test_no_command_is_a_usage_line_on_stderr_and_exit_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: kvverify ") and "name a command" in out.err
