"""``kvverify --help``: one screen, plain text, examples last; every subcommand it names exists."""

from __future__ import annotations

from help_screen import check_screen, help_lines

from kvverify.cli import SUBCOMMANDS


def test_top_level_help_fits_a_screen_and_ends_with_examples():
    lines = help_lines()
    examples = check_screen(lines)
    assert {e.split()[1] for e in examples} <= set(SUBCOMMANDS)
    assert all(any(line.strip().startswith(name + " ") for line in lines) for name in SUBCOMMANDS)
