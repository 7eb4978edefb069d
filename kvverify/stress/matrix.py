"""The verdict matrix of a stress report: what the terminal report and the ``--plot`` PNG draw.

Rows are the scenario forms (scenario, direction), stores (D2H) first, then loads (H2D), each in
the order the report lists them. Columns are source access orders, each split by host memory
kind; an order whose kinds agree in every row becomes one column (``collapse=True``, the
terminal's choice: the eye goes to where host memory matters). A cell holds one mark per
executor, in the order of ``kvverify.terms.EXECUTORS`` (executors come from the report, so a
campaign with one, or a new one, draws as many). When nothing ran (no device), a cell holds one
mark: the contract verdict, which does not depend on the executor.

Standard library only: ``kvverify.stress.render`` (rich) and ``kvverify.stress.plot``
(matplotlib) read this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvverify.terms import (
    COPY_KIND,
    DIRECTIONS,
    EXECUTORS,
    HOST_MEMORY_KINDS,
    ORDERS,
    RACY,
    SAFE,
    CellVerdict,
)

if TYPE_CHECKING:
    from kvverify.stress.report import StressReport

__all__ = ["MARKS", "Column", "Mark", "Row", "VerdictMatrix", "build", "direction_title"]


@dataclasses.dataclass(frozen=True)
class Mark:
    """How one verdict is drawn: ``glyph`` (one character, readable without colour) and
    ``meaning`` (the legend's words)."""

    glyph: str
    meaning: str


# Cell verdicts of a run, and the two contract verdicts of a matrix where nothing ran. A safe
# cell is the quiet "." in both, a race the "x": a reader's eye goes to what is neither.
MARKS: dict[str, Mark] = {
    CellVerdict.SAFE_CONFIRMED.value: Mark(".", "safe, no corruption"),
    CellVerdict.CONFIRMED_RACE.value: Mark("x", "racy, corruption seen"),
    CellVerdict.NO_RACE_OBSERVED.value: Mark("o", "racy on paper, none seen"),
    CellVerdict.UNEXPECTED_CORRUPTION.value: Mark("!", "SAFE but corrupted: a bug"),
    CellVerdict.SENSITIVITY_FAILURE.value: Mark("?", "RACY, adversarial saw none: a harness bug"),
    CellVerdict.NOT_RUN.value: Mark("-", "not run"),
    SAFE: Mark(".", "SAFE on paper"),
    RACY: Mark("x", "RACY on paper"),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A scenario form: ``scenario`` name and ``direction`` (``"store"`` or ``"load"``)."""

    scenario: str
    direction: str


@dataclasses.dataclass(frozen=True)
class Column:
    """An ``order`` and the host memory kinds its cells stand for: one kind, or several that
    agree in every row."""

    order: str
    host_memory: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class VerdictMatrix:
    """The report as a grid.

    - ``contract_only``: nothing ran; each cell's one mark is its contract verdict;
    - ``executors``: whose mark is where in a cell (``()`` when ``contract_only``);
    - ``cells[(row, column)]``: one ``MARKS`` key per executor (one key when
      ``contract_only``), ``None`` where the report has no such cell;
    - ``keys``: the ``MARKS`` keys that appear, in ``MARKS`` order (what a legend lists).
    """

    contract_only: bool
    executors: tuple[str, ...]
    rows: tuple[Row, ...]
    columns: tuple[Column, ...]
    cells: dict[tuple[Row, Column], tuple[str | None, ...]]

    @property
    def keys(self) -> tuple[str, ...]:
        seen = {k for marks in self.cells.values() for k in marks if k is not None}
        return tuple(k for k in MARKS if k in seen)

    def glyphs(self, row: Row, column: Column) -> str:
        """The cell's marks as glyphs, one character per executor (a space where missing)."""
        return "".join(" " if k is None else MARKS[k].glyph for k in self.cells.get((row, column), ()))

    def section(self, direction: str) -> tuple[Row, ...]:
        """The rows of one direction, in report order."""
        return tuple(r for r in self.rows if r.direction == direction)


def _ranked(values, order: tuple[str, ...]) -> tuple[str, ...]:
    # Known names in their canonical order, any other after them in order of appearance.
    present = list(dict.fromkeys(values))
    return tuple(sorted(present, key=lambda v: (order.index(v) if v in order else len(order), present.index(v))))


def build(report: StressReport, *, collapse: bool = True) -> VerdictMatrix:
    """The verdict matrix of ``report``. ``collapse``: an order whose host memory kinds agree in
    every row becomes one column. Only rows, orders, kinds and executors present in the report
    appear, so no row or column is empty."""
    contract_only = not report.ran()
    executors = () if contract_only else _ranked((r.cell.executor for r in report.cells), EXECUTORS)
    by_row: dict[Row, None] = {}
    found: dict[tuple[Row, str, str], dict[str, str]] = {}
    for r in report.cells:
        c = r.cell
        row = Row(c.scenario, c.direction)
        by_row.setdefault(row)
        key = r.contract if contract_only else r.verdict.value
        found.setdefault((row, c.order, c.host_memory), {})[c.executor] = key
    rows = tuple(row for d in _ranked((row.direction for row in by_row), DIRECTIONS)
                 for row in by_row if row.direction == d)
    orders = _ranked((r.cell.order for r in report.cells), ORDERS)
    kinds = _ranked((r.cell.host_memory for r in report.cells), HOST_MEMORY_KINDS)

    def marks(row: Row, order: str, kind: str) -> tuple[str | None, ...]:
        got = found.get((row, order, kind))
        if got is None:
            return (None,) * max(1, len(executors))
        if contract_only:
            return (next(iter(got.values())),)
        return tuple(got.get(e) for e in executors)

    columns: list[Column] = []
    cells: dict[tuple[Row, Column], tuple[str | None, ...]] = {}
    for order in orders:
        here = [k for k in kinds if any((row, order, k) in found for row in rows)]
        same = all(len({marks(row, order, k) for k in here}) == 1 for row in rows)
        groups = [tuple(here)] if collapse and len(here) > 1 and same else [(k,) for k in here]
        for group in groups:
            column = Column(order, group)
            columns.append(column)
            for row in rows:
                cells[(row, column)] = marks(row, order, group[0])
    return VerdictMatrix(contract_only, executors, rows, tuple(columns), cells)


def direction_title(direction: str) -> str:
    """``"store (D2H)"``, ``"load (H2D)"``: a section's heading."""
    return f"{direction} ({COPY_KIND[direction]})"
