"""Presentations of a ``StressReport``: the terminal table (rich) and JUnit XML for CI.

Kept apart from ``kvverify.stress.report`` so that building and serialising a report needs
neither rich nor XML; both read only the report's public API.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvverify.stress.report import CONFIDENCE, CellResult
from kvverify.terms import BLOCK_STATES, CellVerdict

if TYPE_CHECKING:
    from kvverify.stress.report import StressReport

__all__ = ["COLUMNS", "render_gpus", "render_table", "write_junit"]

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
_NOT_RUN = "not run"


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


def _row(r: CellResult, footnote: int | None) -> list[str | Text]:
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
        _window(obs.window),
        "-" if bound is None else f"{bound:.3g}",
        verdict,
    ]


def render_table(report: StressReport, console: Console) -> None:
    """Print ``report`` on ``console``: one row per cell, then the witnesses of the RACY
    contracts (numbered, each once), the not-run line, the summary and the headline."""
    title = f"kvverify stress: {report.campaign} (seed {report.seed}"
    if report.layout:
        title += f", {report.layout['model']}, {_bytes(report.layout['page_bytes'])} pages"
    table = Table(title=title + ")")
    for name in COLUMNS:
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
    for r in report.cells:
        note = witnesses.setdefault(r.witness, len(witnesses) + 1) if r.witness else None
        table.add_row(*_row(r, note))
    console.print(table)
    for witness, n in witnesses.items():
        console.print(f"[{n}] {witness}", markup=False, highlight=False)
    if report.not_run_reason:
        console.print(
            f"Observed columns not run: {report.not_run_reason}; contract verdicts only.",
            markup=False,
        )
    ran = {(r.cell.order, r.cell.direction) for r in report.cells}
    for order, directions in report.summary().items():
        parts = []
        for direction, scenarios in directions.items():
            if (order, direction) not in ran:
                continue  # no cell of it in this run: "nowhere" would be a finding it did not make
            names = ", ".join(f"{s} [{'/'.join(h)}]" for s, h in scenarios.items()) or "nowhere"
            parts.append(f"{direction}: {names}")
        console.print(f"{order} safe in " + "; ".join(parts), markup=False, highlight=False)
    headline = report.headline()
    style = {True: "bold green", False: "bold red", None: "bold yellow"}[headline.holds]
    console.print(Text(f"Headline: {headline.text}", style=style))


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
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    for g in report.gpus:
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
