"""Values on the command line: byte sizes (``4KiB``, ``2MiB``, ``64MB``, ``4096``), positive
counts, and comma lists of choices (``STREAM,ANY``, ``all``); and the layout of ``--help``.

Binary units (``K``, ``KiB``, ``M``, ``MiB``, ``G``, ``GiB``) are powers of 1024; decimal
units (``KB``, ``MB``, ``GB``) are powers of 1000; a bare number or ``B`` is bytes. Units
are case-insensitive and may be separated from the number by spaces. Every size is a
positive whole number of bytes.
"""

from __future__ import annotations

import argparse
import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Return the number of bytes ``text`` names; raise ``ValueError`` saying why not.

    >>> parse_size("4KiB"), parse_size("2 MiB"), parse_size("64MB"), parse_size("512")
    (4096, 2097152, 64000000, 512)
    """
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 4KiB, 2MiB, 1GiB, 64MB)")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"{text!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, KB, MB or GB)")
    value = float(number) * scale
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if int(value) <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value)


def parse_size_list(text: str) -> list[int]:
    """Parse a comma-separated list of sizes, e.g. ``"4KiB,64KiB,2MiB"``, keeping its order."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise ValueError("an empty list of sizes")
    return [parse_size(item) for item in items]


def size_arg(text: str) -> int:
    """``argparse`` type for one size."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list_arg(text: str) -> list[int]:
    """``argparse`` type for a comma-separated list of sizes."""
    try:
        return parse_size_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(nbytes: int) -> str:
    """Name ``nbytes`` exactly, in the largest binary unit that divides it: ``4 KiB``, ``2 MiB``,
    ``1536 KiB``, ``1000 B``. ``parse_size`` reads every result back to the same number."""
    nbytes = int(nbytes)
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def positive_int_arg(text: str) -> int:
    """argparse ``type=``: an integer >= 1, else an ``ArgumentTypeError`` naming the text."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float_arg(text: str) -> float:
    """argparse ``type=``: a number > 0, else an ``ArgumentTypeError`` naming the text."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def choice_list_arg(allowed: tuple[str, ...], *, upper: bool):
    """An argparse ``type`` for a comma list of ``allowed`` values (or ``all``), matched
    without regard to case; returns the values as a tuple in the order given, without repeats.
    Raises ``argparse.ArgumentTypeError`` for an unknown, an empty or a missing value."""
    def parse(text: str) -> tuple[str, ...]:
        items = [t.strip() for t in text.split(",")]
        if any(i.lower() == "all" for i in items) and len(items) == 1:
            return tuple(allowed)
        items = [i.upper() if upper else i.lower() for i in items]
        bad = [i for i in items if i not in allowed]
        if bad:
            what = ("no value given" if not text.strip() else f"an empty name in {text!r}" if "" in bad
                    else f"unknown {', '.join(repr(b) for b in bad)} in {text!r}")
            raise argparse.ArgumentTypeError(f"{what}; choose from {','.join(allowed)} (comma-separated) or all")
        return tuple(dict.fromkeys(items))

    return parse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as the subcommands write it: descriptions and epilogs keep their own lines
    (plain text, each laid out for 80 columns), and the option column is wide enough that an option
    as long as ``--blocks-per-transfer N`` keeps its help on the same line."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 27, width=None):
        super().__init__(prog, indent_increment, max_help_position, width)
