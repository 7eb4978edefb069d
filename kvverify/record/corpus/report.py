"""Renderers of the corpus: the listing of its cases, and a run's table in markdown or JSON.
Standard library only."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvverify.record.corpus.case import FORMS, Case
from kvverify.record.corpus.results import CorpusRun, FormResult, RacingPair, split_at

COLUMNS = ("case", "source", "form", "native: corrupted", "kvverify record: verdict, expected pair", "CSAN")


def forms_of(case: Case) -> str:
    """The forms a case runs natively: ``broken,fixed``, or ``fixed (broken: not run)``."""
    return "fixed (broken: not run)" if case.not_run else ",".join(FORMS)


LISTING_HEADER = "case: expected race (kind, the two functions whose lines issue it)"


def listing(cases: Sequence[Case]) -> str:
    """A header, then two lines per case (short enough for 80 columns, and labelled, so that they
    wrap to a narrower screen and still read): its name and expected race (kind, pair of
    functions); then its source, capture and forms."""
    lines = [LISTING_HEADER, ""]
    for c in cases:
        lines += [f"{c.name}: {c.kind} {c.pair[0]} / {c.pair[1]}",
                  f"  source: {c.source}; capture: {c.capture}; forms: {forms_of(c)}"]
    return "\n".join(lines) + "\n"


def race_text(race: RacingPair) -> str:
    """``RAW vllm_31341.py:40 write_kv / :52 store`` (the second file named only where it differs)."""
    first, second = split_at(race.first_at), split_at(race.second_at)
    if first is None or second is None:
        return f"{race.kind} {race.first_at or '?'} / {race.second_at or '?'}"
    tail = f":{second[1]} {second[2]}" if second[0] == first[0] else f"{second[0]}:{second[1]} {second[2]}"
    return f"{race.kind} {first[0]}:{first[1]} {first[2]} / {tail}"


def native_cell(row: FormResult) -> str:
    """``16 of 16 pages`` (with the witness's note), why the form was not run, or its error."""
    if row.native_error is not None:
        return f"error: {row.native_error}"
    w = row.native
    if w is None:
        return "-"
    if w.total == 0:
        return w.note or "nothing checked"
    return f"{w.corrupted} of {w.total} {w.unit}" + (f" ({w.note})" if w.note else "")


def recorded_cell(row: FormResult) -> str:
    """The verdict with its race (the expected pair, else the first), ``needs native capture: WHY``
    for a case a recording cannot decide, or the error."""
    rec = row.recorded
    if rec.error is not None:
        return f"error: {rec.error}"
    if rec.blind is not None:
        return f"needs native capture: {rec.blind}"
    if rec.verdict == "SAFE":
        return "SAFE" if rec.complete else "SAFE over an incomplete recording"
    text = f"{rec.verdict} ({rec.races} race{'s' if rec.races != 1 else ''})"
    if rec.race is None:
        return text
    if rec.pair_found:
        return f"{text}: {race_text(rec.race)}"
    return f"{text}, expected pair not found; first: {race_text(rec.race)}"


def csan_cell(row: FormResult) -> str:
    """``reported``, ``nothing``, ``not run`` or ``error: ...``."""
    if row.csan is None:
        return "not run"
    if row.csan.outcome == "error":
        return f"error: {row.csan.detail}"
    return row.csan.outcome


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def witness_cell(row: FormResult) -> str:
    """Each racing pair's device witness (``--confirm``), or ``-`` where the form did not race."""
    return "; ".join(row.recorded.witnesses or ()) or "-"


def markdown(run: CorpusRun) -> str:
    """The run as a markdown table, one row per case and form (a witness column where ``--confirm``
    ran), then what missed the corpus's promise."""
    confirmed = any(row.recorded.witnesses is not None for row in run.rows)
    columns = COLUMNS + ("witness (--confirm)",) if confirmed else COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in run.rows:
        cells = (row.case, row.source, row.form, native_cell(row), recorded_cell(row), csan_cell(row))
        if confirmed:
            cells += (witness_cell(row),)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if run.failures:
        lines += ["", "Not as expected:"] + [f"- {f}" for f in run.failures]
    return "\n".join(lines) + "\n"


def to_json(run: CorpusRun) -> str:
    """The run as JSON text (``CorpusRun.to_json``)."""
    return json.dumps(run.to_json(), indent=2) + "\n"
