"""What each form of the recorder's demo (``kvverify.record.demo``) must be reported as: the safe form
with no race, each mistake with exactly its pair of ops, by the lines marked ``# <- NAME`` in the
demo's source. Shared by the CPU test (on the stand-in) and the GPU test (on the device)."""

from __future__ import annotations

import re
from pathlib import Path

from kvverify.record import demo
from kvverify.record.trace.recorder import short_at

# mistake -> {(first op's mark, second op's mark, kind)}: every race the recording shows
EXPECTED: dict[str | None, set[tuple[str, str, str]]] = {
    None: set(),
    "store-any": {("write kv", "swap", "RAW")},
    "load-no-wait": {("zero-fill", "swap", "WAW")},
    "load-into-read": {("attend", "swap", "WAR")},
    "descriptor-rewrite": {("descriptor copy", "descriptor write", "WAR")},
    "aten-race": {("attend", "side write", "WAR"), ("side write", "swap", "WAW")},
}


def marks() -> dict[tuple[str, str], str]:
    """(``demo.py:LINE``, function) -> mark, from the ``# <- NAME`` comments of the demo."""
    out = {}
    function = None
    for number, line in enumerate(Path(demo.__file__).read_text().splitlines(), 1):
        found = re.match(r"\s*def (\w+)", line)
        if found:
            function = found.group(1)
        mark = re.search(r"# <- ([\w -]+)$", line)
        if mark:
            out[(f"demo.py:{number}", function)] = mark.group(1).strip()
    return out


def mark_of(op: dict, table: dict) -> str:
    at = op.get("at") or ""
    function = at.split(" in ", 1)[1] if " in " in at else None
    return table.get((short_at(at), function), f"{op['op']} at {at or '?'}")


def race_marks(trace: dict, verdict) -> set[tuple[str, str, str]]:
    """The races of a recording, as (first mark, second mark, kind)."""
    table = marks()
    ops = trace["ops"]
    return {(mark_of(ops[r.first], table), mark_of(ops[r.second], table), r.kind) for r in verdict.races}
