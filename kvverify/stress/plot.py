"""``kvverify stress --plot PATH``: the verdict matrix (``kvverify.stress.matrix``) as a PNG.

One square per executor in each cell, coloured by its verdict and marked with the terminal's
glyph; racy-on-paper-but-quiet and not-run squares are hatched too, so that the figure reads
the same printed in grey. matplotlib (the ``plot`` extra) is imported only here, when called.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvverify.stress import matrix
from kvverify.terms import RACY, SAFE, CellVerdict

if TYPE_CHECKING:
    from kvverify.stress.report import StressReport

__all__ = ["FILL", "legend_label", "plot_matrix"]

# Verdict → (face colour, hatch, glyph colour). Light faces for the expected outcomes, dark ones
# for the failing verdicts; luminance and hatching differ wherever hue alone would.
FILL: dict[str, tuple[str, str, str]] = {
    CellVerdict.SAFE_CONFIRMED.value: ("#d9efd3", "", "black"),
    CellVerdict.CONFIRMED_RACE.value: ("#f0a23b", "", "black"),
    CellVerdict.NO_RACE_OBSERVED.value: ("#9ccbea", "//", "black"),
    CellVerdict.UNEXPECTED_CORRUPTION.value: ("#a50f15", "", "white"),
    CellVerdict.SENSITIVITY_FAILURE.value: ("#3f007d", "xx", "white"),
    CellVerdict.NOT_RUN.value: ("#ffffff", "..", "#555555"),
    SAFE: ("#d9efd3", "", "black"),
    RACY: ("#f0a23b", "", "black"),
}

_SQUARE = 0.32  # inches per mark
_GAP = 0.5  # squares between two orders


def legend_label(key: str) -> str:
    """The legend's entry for a ``matrix.MARKS`` key: its glyph, the verdict and what it means
    (``"x  CONFIRMED_RACE: racy, corruption seen"``); a contract verdict's meaning names it
    already (``".  SAFE on paper"``)."""
    mark = matrix.MARKS[key]
    return f"{mark.glyph}  " + (mark.meaning if mark.meaning.startswith(key) else f"{key}: {mark.meaning}")


def plot_matrix(report: StressReport, path: str | os.PathLike) -> None:
    """Write the verdict matrix of ``report`` to ``path`` as a PNG (150 dpi).

    Every host memory kind gets its own column (no collapsing: a figure is read slowly).
    Raises ImportError (naming the ``plot`` extra) without matplotlib, OSError when ``path``
    cannot be written.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError as exc:
        raise ImportError(f"--plot needs matplotlib: pip install 'kvverify[plot]' ({exc})") from None

    grid = matrix.build(report, collapse=False)
    marks = max(1, len(grid.executors))
    # x of each column's first square: columns of one order side by side, a gap between orders.
    x0: dict[matrix.Column, float] = {}
    x = 0.0
    for i, column in enumerate(grid.columns):
        if i and column.order != grid.columns[i - 1].order:
            x += _GAP
        x0[column] = x
        x += marks + 0.15
    width = x
    # y of each row from the top; a heading line before each direction's rows.
    y_of: dict[matrix.Row, float] = {}
    headings: list[tuple[float, str]] = []
    y = 0.0
    for direction in dict.fromkeys(r.direction for r in grid.rows):
        headings.append((y, matrix.direction_title(direction)))
        y += 1
        for row in grid.section(direction):
            y_of[row] = y
            y += 1
    height = y

    label_in, header_in, legend_in = 1.6, 1.2, 0.3 + 0.22 * (len(grid.keys) + 1)
    fig = Figure(figsize=(label_in + width * _SQUARE + 0.4, header_in + height * _SQUARE + legend_in))
    ax = fig.add_axes((label_in / fig.get_figwidth(), legend_in / fig.get_figheight(),
                       width * _SQUARE / fig.get_figwidth(), height * _SQUARE / fig.get_figheight()))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_axis_off()

    for row, top in y_of.items():
        ax.text(-0.3, top + 0.5, row.scenario, ha="right", va="center", fontsize=9)
        for column in grid.columns:
            for i, key in enumerate(grid.cells[(row, column)]):
                if key is None:
                    continue
                face, hatch, ink = FILL[key]
                ax.add_patch(Rectangle((x0[column] + i, top + 0.04), 0.96, 0.92, facecolor=face, hatch=hatch,
                                       edgecolor="#555555", linewidth=0.5))
                # The glyph on a patch of the face colour, so that hatching never crosses it.
                ax.text(x0[column] + i + 0.48, top + 0.5, matrix.MARKS[key].glyph, ha="center", va="center",
                        fontsize=9, fontweight="bold", color=ink, family="monospace",
                        bbox={"boxstyle": "square,pad=0.15", "facecolor": face, "edgecolor": "none"})
    for top, title in headings:
        ax.text(-0.3 - (label_in / _SQUARE) + 0.4, top + 0.5, title, ha="left", va="center", fontsize=9,
                fontweight="bold")
    for order in dict.fromkeys(c.order for c in grid.columns):
        cols = [c for c in grid.columns if c.order == order]
        middle = (x0[cols[0]] + x0[cols[-1]] + marks) / 2
        ax.text(middle, -1.3, order, ha="center", va="bottom", fontsize=9, fontweight="bold", clip_on=False)
        for c in cols:
            ax.text(x0[c] + marks / 2, -0.3, "/".join(c.host_memory), ha="center", va="bottom", fontsize=7,
                    rotation=45 if len(c.host_memory[0]) * 0.12 > marks else 0, rotation_mode="anchor",
                    clip_on=False)

    title = f"kvverify stress: {report.campaign}"
    if report.layout:
        title += f", {report.layout['model']}"
    if report.platform.gpu and not grid.contract_only:
        title += f", {report.platform.gpu}"
    fig.suptitle(title + (" (contract verdicts: nothing ran)" if grid.contract_only else ""), fontsize=10,
                 y=1 - 0.1 / fig.get_figheight(), va="top")
    handles = [Rectangle((0, 0), 1, 1, facecolor=FILL[k][0], hatch=FILL[k][1], edgecolor="#555555", linewidth=0.5)
               for k in grid.keys]
    labels = [legend_label(k) for k in grid.keys]
    note = f"each cell: {' | '.join(grid.executors)}" if grid.executors else "one mark per cell"
    fig.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.02, 0.0), fontsize=8, frameon=False,
               title=note, title_fontsize=8, alignment="left")
    fig.savefig(path, dpi=150)
