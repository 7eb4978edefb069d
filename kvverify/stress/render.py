"""Presentations of a ``StressReport`` on the terminal (rich) and as JUnit XML for CI.

- ``render_matrix``: what ``kvverify stress`` prints: the verdict matrix
  (``kvverify.stress.matrix``), then only the cells that need a reader's eye, then where each
  order was safe and the headline, both from the cells that ran;
- ``render_table``: ``--details``: one row per cell with its counts, window, bound and witness;
- ``write_junit``: one testcase per cell.

Kept apart from ``kvverify.stress.report`` so that building and serialising a report needs
neither rich nor XML; both read only the report's public API.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvverify.screen import StripTrailingSpaces
from kvverify.stress import matrix
from kvverify.stress.report import CONFIDENCE, CellResult
from kvverify.terms import (
    BLOCK_STATES,
    COPY_KIND,
    HOST_MEMORY_KINDS,
    RACY,
    SAFE,
    CellVerdict,
)

if TYPE_CHECKING:
    from kvverify.stress.report import StressReport

__all__ = ["COLUMNS", "console", "render_gpus", "render_matrix", "render_table", "say", "write_junit"]

# One-sided Clopper-Pearson upper bound on the per-trial corruption rate.
_BOUND = f"Rate ≤ ({CONFIDENCE:.0%})"
COLUMNS = (
    "Cell",
    "Contract",
    "Trials",
    "Blocks",
    "Bytes",
    *BLOCK_STATES,
    "Window",
    _BOUND,
    "Verdict",
)
_NUMERIC = {"Trials", "Blocks", "Bytes", *BLOCK_STATES, _BOUND}
_FOLD = {"Cell", "Window"}
_STYLE = {
    CellVerdict.CONFIRMED_RACE: "yellow",
    CellVerdict.NO_RACE_OBSERVED: "cyan",
    CellVerdict.SAFE_CONFIRMED: "green",
    CellVerdict.UNEXPECTED_CORRUPTION: "bold red",
    CellVerdict.SENSITIVITY_FAILURE: "bold red",
    CellVerdict.NOT_RUN: "dim",
}
_MARK_STYLE = {v.value: style for v, style in _STYLE.items()} | {SAFE: "green", RACY: "yellow"}
_NOT_RUN = "not run"
# Failing cells listed one by one under the matrix before the rest is left to --details.
MAX_LISTED = 10


def _bytes(n: int) -> str:
    # Binary units: block and page sizes are powers of two.
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _window(window) -> str:
    return " ".join(f"{k}={v}" for k, v in window.items()) or "-"


def _row(r: CellResult, footnote: int | None, window: str) -> list[str | Text]:
    contract = r.contract if footnote is None else f"{r.contract} [{footnote}]"
    verdict = Text(r.verdict.value, style=_STYLE[r.verdict])
    obs = r.observation
    if obs is None:
        # "not run" once, dashes after it: a row of repeated words hides the contract.
        empty = [Text("-", style="dim")] * (len(COLUMNS) - 4)
        return [r.cell.label, contract, Text(_NOT_RUN, style="dim"), *empty, verdict]
    bound = r.rate_upper_bound
    return [
        r.cell.label,
        contract,
        str(obs.trials),
        str(obs.blocks_checked),
        _bytes(obs.bytes_checked),
        *(str(v) for v in obs.counts.values()),
        window,
        "-" if bound is None else f"{bound:.3g}",
        verdict,
    ]


def _title(report: StressReport) -> str:
    title = f"kvverify stress: {report.campaign} (seed {report.seed}"
    if report.layout:
        title += f", {report.layout['model']}, {_bytes(report.layout['page_bytes'])} pages"
    return title + ")"


def render_matrix(report: StressReport, console: Console) -> None:
    """Print ``report`` on ``console`` for a person to read at a glance.

    Without observations (no device), first why, then the contract matrix. Otherwise the
    verdict matrix (one mark per executor per cell), its legend, the cells that need a
    reader's eye (failing verdicts one by one, at most ``MAX_LISTED``; then NO_RACE_OBSERVED
    per scenario form and executor with the bound on its corruption rate), where each order
    was safe among the cells that ran, and the headline. Lines fold at the console's width.
    """
    grid = matrix.build(report)
    if grid.contract_only:
        say(console, f"Nothing ran on a device: {report.not_run_reason or 'no cell has an observation'}.")
        say(console, "Contract verdicts only: what the happens-before checker decides of each cell from "
                      "CUDA's ordering rules; the same for every executor.")
        console.print()
    where = f" on {report.platform.gpu}" if report.platform.gpu and not grid.contract_only else ""
    say(console, _title(report) + where + (": contract verdicts" if grid.contract_only else ""))
    for line in _matrix_lines(grid):
        console.print(line, overflow="fold")
    _legend(grid, console)
    if not grid.contract_only:
        _attention(report, console)
    _safe_in(report, console)
    _headline(report, console)
    say(console, "--details: every cell with " + ("the race the checker found (its witness)." if grid.contract_only
                                                    else "its counts, window, bound and witness."))


def _short(kind: str) -> str:
    # pin, reg, pag: the three host memory kinds differ in their first three letters.
    return kind[:3]


def _matrix_lines(grid: matrix.VerdictMatrix) -> list[Text]:
    """The header (orders, then host memory kinds) and one line per row, in fixed-width columns."""
    every_kind = {k for c in grid.columns for k in c.host_memory}
    marks = max(1, len(grid.executors))

    def sub_label(column: matrix.Column) -> str:
        if len(column.host_memory) == 1:
            return _short(column.host_memory[0])
        return "all" if set(column.host_memory) == every_kind else "+".join(map(_short, column.host_memory))

    def centred(text: Text, width: int) -> Text:
        pad = width - len(text)
        return Text(" " * (pad // 2)).append_text(text).append(" " * (pad - pad // 2))

    width = {c: max(len(sub_label(c)), marks) for c in grid.columns}
    orders = {o: [c for c in grid.columns if c.order == o] for o in dict.fromkeys(c.order for c in grid.columns)}
    # An order's span: its columns one space apart, at least as wide as its name.
    span = {o: max(len(o), sum(width[c] + 1 for c in cols) - 1) for o, cols in orders.items()}
    label = max([len(r.scenario) + 2 for r in grid.rows] + [len(matrix.direction_title(r.direction)) for r in grid.rows])
    gap = "  "

    def line(head: Text, group) -> Text:
        out = head.copy()
        for o, cols in orders.items():
            cells = Text(" ").join(group(c) for c in cols)
            out.append(gap).append_text(cells).append(" " * (span[o] - len(cells)))
        out.rstrip()
        return out

    top = Text(" " * label)
    for o in orders:
        top.append(gap + o.ljust(span[o]), style="bold")
    top.rstrip()
    lines = [top, line(Text(" " * label), lambda c: centred(Text(sub_label(c), style="dim"), width[c]))]
    for direction in dict.fromkeys(r.direction for r in grid.rows):
        lines.append(Text(matrix.direction_title(direction), style="bold"))
        for row in grid.section(direction):
            def marks_of(c: matrix.Column, row=row) -> Text:
                glyphs = Text()
                for k in grid.cells[(row, c)]:
                    glyphs.append(" " if k is None else matrix.MARKS[k].glyph, style=_MARK_STYLE.get(k, ""))
                return centred(glyphs, width[c])

            lines.append(line(Text(("  " + row.scenario).ljust(label)), marks_of))
    return lines


def _legend(grid: matrix.VerdictMatrix, console: Console) -> None:
    if grid.executors:
        say(console, f"Each cell: one mark per executor: {' '.join(grid.executors)}")
    legend = Text()
    for k in grid.keys:
        legend.append(f"'{matrix.MARKS[k].glyph}'", style=_MARK_STYLE.get(k, ""))
        legend.append(f" {matrix.MARKS[k].meaning}   ")
    legend.rstrip()
    console.print(legend, overflow="fold")
    kinds = [k for k in HOST_MEMORY_KINDS if any(k in c.host_memory for c in grid.columns)]
    merged = any(len(c.host_memory) > 1 for c in grid.columns)  # a column of kinds that agreed
    say(console, f"Host memory: {', '.join(f'{_short(k)} {k}' for k in kinds)}"
                 + ("; all: every kind alike" if merged else ""))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _span(values) -> str:
    """``"3"`` or ``"3-4"``: the smallest and largest of ``values``, already formatted."""
    values = sorted(set(values), key=float)
    return values[0] if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _attention(report: StressReport, console: Console) -> None:
    """The cells that need a reader's eye: failing ones first, then NO_RACE_OBSERVED."""
    failing = [r for r in report.cells if r.verdict.failing]
    quiet: dict[tuple[str, str, str], list[CellResult]] = {}
    for r in report.cells:
        if r.verdict is CellVerdict.NO_RACE_OBSERVED:
            quiet.setdefault((r.cell.scenario, r.cell.direction, r.cell.executor), []).append(r)
    if not failing and not quiet:
        return
    console.print()
    if failing:
        console.print(Text(f"Cells that contradict their contract (exit status 1): {len(failing)}", style="bold red"))
    for r in failing[:MAX_LISTED]:
        obs = r.observation
        assert obs is not None  # failing verdicts come from observations
        line = Text("  ")
        line.append(matrix.MARKS[r.verdict.value].glyph, style=_STYLE[r.verdict])
        line.append(f" {r.cell.label}: {obs.corrupted_trials} of {obs.trials} trials corrupted")
        bad = ", ".join(f"{k} {v}" for k, v in obs.counts.items() if k != "OK" and v)
        console.print(line.append(f" ({bad})" if bad else ""), overflow="fold")
    if len(failing) > MAX_LISTED:
        say(console, f"  ... and {len(failing) - MAX_LISTED} more (--details lists every cell with its witness)")
    if quiet:
        n = sum(len(v) for v in quiet.values())
        say(console, f"{matrix.MARKS[CellVerdict.NO_RACE_OBSERVED.value].glyph} RACY on paper, no corruption seen "
                      f"in {_count(n, 'cell')}: {CONFIDENCE:.0%} upper bound on the per-trial corruption rate")
        for (scenario, direction, executor), rs in quiet.items():
            trials = _span(str(r.observation.trials) for r in rs)
            bound = _span(f"{r.rate_upper_bound:.2g}" for r in rs)
            say(console, f"  {scenario} {direction}/{COPY_KIND[direction]}, {executor}: "
                          f"{_count(len(rs), 'cell')}, {trials} trials each, rate ≤ {bound}")


def _safe_in(report: StressReport, console: Console) -> None:
    """Where each order was safe, among the cells that ran (nothing when none ran)."""
    ran = {(r.cell.order, r.cell.direction) for r in report.ran()}
    for order, directions in report.summary(ran_only=True).items():
        parts = []
        for direction, scenarios in directions.items():
            if (order, direction) not in ran:
                continue  # no cell of it ran: "nowhere" would be a finding it did not make
            groups: dict[tuple[str, ...], list[str]] = {}
            for name, kinds in scenarios.items():
                groups.setdefault(tuple(k for k in HOST_MEMORY_KINDS if k in kinds), []).append(name)
            names = ", ".join(f"{', '.join(n)} [{'/'.join(k)}{' each' if len(n) > 1 else ''}]"
                              for k, n in groups.items()) or "nowhere"
            parts.append(f"{direction}: {names}")
        say(console, f"{order} safe in " + "; ".join(parts))


def _headline(report: StressReport, console: Console) -> None:
    headline = report.headline()
    style = {True: "bold green", False: "bold red", None: "bold yellow"}[headline.holds]
    console.print(Text(f"Headline: {headline.text}", style=style), overflow="fold")


def console(stderr: bool = False, width: int | None = None) -> Console:
    """A rich console on stdout (or stderr) whose lines never end in spaces: rich pads table cells
    and leaves the space it wrapped at (kvverify.screen's rule for every screen)."""
    return Console(file=StripTrailingSpaces(sys.stderr if stderr else sys.stdout), width=width)


def say(console: Console, text: str) -> None:
    """One message, folded at the console's width (a report line, not an error)."""
    console.print(text, markup=False, highlight=False, overflow="fold")


def render_table(report: StressReport, console: Console) -> None:
    """Print ``report`` on ``console`` (``--details``): one row per cell, then the witnesses of
    the RACY contracts ([1], [2], ...) and the race windows (w1, w2, ...), each once, the not-run
    line, where each order was safe among the cells that ran, and the headline."""
    table = Table(title=_title(report))
    observed = any(r.observation for r in report.cells)
    # nothing ran: the observed columns would be dashes from top to bottom
    columns = COLUMNS if observed else (COLUMNS[0], COLUMNS[1], COLUMNS[-1])
    for name in columns:
        # Where the console is too narrow a number or verdict is cut visibly (…), never
        # split over lines; the label and the window fold (a label has no spaces to wrap
        # at after the scenario).
        table.add_column(
            name,
            justify="right" if name in _NUMERIC else "left",
            overflow="fold" if name in _FOLD else "ellipsis",
            no_wrap=name == "Verdict",  # the column the table exists for
        )
    witnesses: dict[str, int] = {}
    windows: dict[str, int] = {}  # a window is long and shared by many cells: named once, below
    for r in report.cells:
        note = witnesses.setdefault(r.witness, len(witnesses) + 1) if r.witness else None
        window = f"w{windows.setdefault(_window(r.observation.window), len(windows) + 1)}" if r.observation else "-"
        row = _row(r, note, window)
        table.add_row(*(row if observed else (row[0], row[1], row[-1])))
    console.print(table)
    for witness, n in witnesses.items():
        console.print(f"[{n}] {witness}", markup=False, highlight=False)
    for window, n in windows.items():
        console.print(f"w{n}: {window}", markup=False, highlight=False)
    if report.not_run_reason:
        console.print(
            f"Observed columns not run: {report.not_run_reason}; contract verdicts only.",
            markup=False,
        )
    _safe_in(report, console)
    _headline(report, console)


def write_junit(report: StressReport, path: str | os.PathLike) -> None:
    """Write ``report`` as JUnit XML: a ``testsuite`` with one ``testcase`` per cell.

    The testcase is named by the cell label, classed ``kvverify.stress.<scenario>``, timed
    by the observation's elapsed seconds, and carries ``properties`` (verdict, contract,
    counts, bound). UNEXPECTED_CORRUPTION and SENSITIVITY_FAILURE add a ``failure``,
    NOT_RUN a ``skipped``. Raises OSError when the file cannot be written.
    """
    cells = report.cells
    failures = sum(r.verdict.failing for r in cells)
    skipped = sum(r.verdict is CellVerdict.NOT_RUN for r in cells)
    elapsed = sum(r.observation.elapsed_s for r in cells if r.observation)
    counts = {"tests": len(cells), "failures": failures, "errors": 0, "skipped": skipped}
    attrs = {k: str(v) for k, v in counts.items()} | {"time": f"{elapsed:.3f}"}
    root = ET.Element("testsuites", {"name": "kvverify stress"} | attrs)
    suite = ET.SubElement(
        root,
        "testsuite",
        {"name": f"kvverify stress {report.campaign}", "timestamp": report.created} | attrs,
    )
    suite_props = ET.SubElement(suite, "properties")
    platform = report.platform
    for name, value in (
        ("campaign", report.campaign),
        ("seed", report.seed),
        ("gpu", platform.gpu),
        ("driver", platform.driver),
        ("cuda", platform.cuda),
        ("torch", platform.torch),
        ("kvverify", platform.kvverify),
        ("headline", report.headline().text),
    ):
        ET.SubElement(suite_props, "property", name=name, value="" if value is None else str(value))
    for r in cells:
        _testcase(suite, r, report.not_run_reason)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _testcase(suite: ET.Element, r: CellResult, not_run_reason: str | None) -> None:
    obs = r.observation
    case = ET.SubElement(
        suite,
        "testcase",
        classname=f"kvverify.stress.{r.cell.scenario}",
        name=r.cell.label,
        time=f"{obs.elapsed_s:.3f}" if obs else "0",
    )
    props: dict[str, object] = {"verdict": r.verdict.value, "contract": r.contract}
    if r.witness:
        props["witness"] = r.witness
    if obs:
        props |= {
            "trials": obs.trials,
            "corrupted_trials": obs.corrupted_trials,
            "blocks_checked": obs.blocks_checked,
            "bytes_checked": obs.bytes_checked,
            **obs.counts,
            "window": _window(obs.window),
        }
        if r.rate_upper_bound is not None:
            props["rate_upper_bound"] = f"{r.rate_upper_bound:.6g}"
    properties = ET.SubElement(case, "properties")
    for name, value in props.items():
        ET.SubElement(properties, "property", name=name, value=str(value))
    if r.verdict.failing:
        failure = ET.SubElement(case, "failure", type=r.verdict.value, message=_failure_message(r))
        failure.text = f"contract {r.contract}" + (f": {r.witness}" if r.witness else "")
    elif r.verdict is CellVerdict.NOT_RUN:
        ET.SubElement(case, "skipped", message=f"not run: {not_run_reason or 'no observation'}")


def _failure_message(r: CellResult) -> str:
    obs = r.observation
    assert obs is not None  # failing verdicts come from observations
    if r.verdict is CellVerdict.UNEXPECTED_CORRUPTION:
        bad = ", ".join(f"{k} {v}" for k, v in obs.counts.items() if k != "OK" and v)
        return (
            f"contract SAFE but {obs.corrupted_trials} of {obs.trials} trials corrupted ({bad}): "
            "a driver, hardware or harness bug"
        )
    return (
        f"contract RACY but the adversarial executor saw no corruption in {obs.trials} trials: "
        "the harness failed to make a permitted reordering visible"
    )


# -- GPUs, memory and rounds (a compact section below the table) ----------------------------------


def _memory_line(trend) -> str:
    def one(name: str, series) -> str:
        if series is None:
            return f"{name} unreadable"
        return (f"{name} {_bytes(series.first)} -> {_bytes(series.last)} ({series.growth:+.2%}, "
                f"peak {_bytes(series.peak)}, {series.slope_per_hour / 2**20:+.1f} MiB/h)")

    if trend.growing is None:
        return f"memory: cannot tell ({trend.note})"
    verdict = f"GREW beyond {trend.tolerance:.0%}" if trend.growing else f"flat within {trend.tolerance:.0%}"
    return (f"memory: {one('host RSS', trend.host_rss)}, {one('device', trend.device_used)} over "
            f"{trend.span_s:.0f} s after a {trend.warmup_s:.0f} s warm-up: {verdict}")


def render_gpus(report: StressReport, console: Console) -> None:
    """Print one line per GPU of ``report`` (rank, host, device, platform, or why it ran nothing)
    with its memory trend; with several GPUs, each GPU's verdict tally and the cells on which
    GPUs disagree; then the rounds and trials run against the plan."""
    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False, overflow="fold")

    for g in report.gpus:
        if g.not_run_reason and len(report.gpus) == 1:
            continue  # one GPU that ran nothing: the report's first line already says why
        where = f"{g.host}, cuda:{g.device}" if g.device is not None else g.host
        p = g.platform
        line = f"GPU {g.rank} ({where}): {p.gpu or 'no GPU'}, driver {p.driver or '-'}, CUDA {p.cuda or '-'}"
        if g.not_run_reason:
            line += f"; ran nothing: {g.not_run_reason}"
        say(line)
        if g.memory is not None:
            say(f"  {_memory_line(g.memory)}")
    if len(report.gpus) > 1:
        tallies: dict[int, dict[str, int]] = {g.rank: {} for g in report.gpus}
        disagree = []
        for r in report.cells:
            verdicts = r.gpu_verdicts
            for rank, v in verdicts:
                tallies[rank][v.value] = tallies[rank].get(v.value, 0) + 1
            if len({v for _, v in verdicts}) > 1:
                disagree.append(f"{r.cell.label} (" + ", ".join(f"GPU {g} {v.value}" for g, v in verdicts) + ")")
        for rank, tally in tallies.items():
            say(f"GPU {rank} verdicts: " + ", ".join(f"{n} {v}" for v, n in sorted(tally.items())))
        if disagree:
            shown = "; ".join(disagree[:10]) + (f"; and {len(disagree) - 10} more" if len(disagree) > 10 else "")
            say(f"GPUs disagree on {len(disagree)} cell(s): {shown}")
    e = report.execution
    if e is not None and e.trials_planned:
        cap = f" (cap {e.max_seconds:g} s reached)" if e.stopped else ""
        say(f"Rounds: {e.rounds_run} of {e.rounds_planned}{cap}; trials: {e.trials_run} of {e.trials_planned} planned"
            + (", cells split across GPUs" if e.shard else ""))
