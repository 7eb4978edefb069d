"""Run corpus cases three ways: natively (the witness), recorded (``kvverify.record`` and the
checker) and under PyTorch's CUDA Stream Sanitizer (one child process for every form: the
sanitizer cannot be turned off once on, and it raises at the first race it finds).

Needs a CUDA device and ``kvverify._C`` (``kvverify.device.gpu_refusal`` says why not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvverify.record.capture.threads import OTHER_THREAD_WORK
from kvverify.record.corpus.case import Case, Witness
from kvverify.record.corpus.results import (
    CorpusRun,
    FormResult,
    RacingPair,
    Recorded,
    Sanitized,
    shortfalls,
    split_at,
)

CSAN_MARK = "kvverify-corpus-csan "  # a line of the sanitized child's standard output that carries a result
CSAN_TIMEOUT_S = 600
OTHER_THREADS = "the recording saw device work of a thread it does not follow"
RECORDER_MISSED = "the recording is incomplete: it missed device work (Recording.complete() is False)"
ERROR_CHARS = 300


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, at most ``ERROR_CHARS`` characters."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


def in_function(at: str | None, file: str, function: str) -> bool:
    """Whether ``at`` names a line of ``function`` in the file named ``file``."""
    parts = split_at(at)
    return parts is not None and parts[0] == file and parts[2] == function


def expected_race(case: Case, races: Sequence, ops: Sequence[dict]) -> tuple[RacingPair | None, bool]:
    """The race of ``case.kind`` whose first op was issued in ``case.pair[0]`` and second in
    ``case.pair[1]`` of the case's module, and True; else the first race (or None) and False.
    ``races``: ``kvverify.check.Race`` objects; ``ops``: the trace's ops (for their ``at``)."""
    pairs = [RacingPair(r.kind, r.first_at or ops[r.first].get("at"), r.second_at or ops[r.second].get("at"))
             for r in races]
    for pair in pairs:
        if pair.kind == case.kind and in_function(pair.first_at, case.file, case.pair[0]) \
                and in_function(pair.second_at, case.file, case.pair[1]):
            return pair, True
    return (pairs[0] if pairs else None), False


def native(case: Case, form: str) -> tuple[Witness | None, str | None]:
    """``case.run(form)``: its witness and None, or None and the error it raised, on one line."""
    try:
        return case.run(form), None
    except Exception as exc:
        return None, one_line(exc)


def blindness(case: Case, form: str, complete: bool, notes: Sequence[str]) -> str | None:
    """Why a recording cannot decide ``form`` of a case that needs native capture (None for a case
    a recording sees): the form is never run, the recording saw other threads' device work or
    missed ops, or what the case says a recording misses."""
    if case.capture != "native":
        return None
    if form == "broken" and case.not_run:
        return case.not_run
    if any(note.startswith(OTHER_THREAD_WORK) for note in notes):
        return OTHER_THREADS
    if not complete:
        return RECORDER_MISSED
    return case.unseen


def recorded(case: Case, form: str, confirm: bool = False) -> Recorded:
    """``case.run(form)`` under ``kvverify.record.recording()``,
    its trace checked: the verdict, the expected race if found, completeness, and for a native case
    why the verdict cannot stand. ``confirm``: where it races, the device witness of each pair of
    lines (``kvverify.record.confirm.witness``, its runs in this process)."""
    from kvverify.record.confirm import witness
    from kvverify.record.session import recording

    try:
        with recording() as rec:
            if confirm:
                rec.follow_calls(witness.Forcer(rec.recorder))
            case.run(form)
        verdict = rec.check()
        ops = rec.trace()["ops"]
        complete = rec.complete()
        notes = rec.summary().notes
    except Exception as exc:
        return Recorded(error=one_line(exc))
    witnesses = None
    if confirm and verdict.races:
        try:
            plans, left = witness.plans(rec.recorder.ops, rec.summary().sources, verdict.races)
            witnesses = tuple(o.line() for o in witness.in_race_order(witness.confirm(
                plans, lambda plan, mode: witness.observe(lambda: _status(case, form), plan, mode)) + left))
        except Exception as exc:  # the recorded verdict stands
            witnesses = (f"{witness.NO_WITNESS}: the witness runs raised: {one_line(exc)}",)
    race, found = expected_race(case, verdict.races, ops)
    return Recorded(verdict=verdict.verdict, races=len(verdict.races), complete=complete, race=race, pair_found=found,
                    blind=blindness(case, form, complete, notes), witnesses=witnesses)


def _status(case: Case, form: str) -> int:
    """``case.run(form)`` as a program's exit status: 0, or 1 where it raised (a check of its own
    that the forced order failed); the witness compares its bytes either way."""
    try:
        case.run(form)
    except Exception:
        return 1
    return 0


def parse_sanitized(stdout: str) -> dict[tuple[str, str], Sanitized]:
    """The results the sanitized child printed: ``(case, form) -> Sanitized``; lines without the
    mark (the cases' own output) are skipped."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith(CSAN_MARK):
            row = json.loads(line[len(CSAN_MARK):])
            out[(row["case"], row["form"])] = Sanitized(row["outcome"], row.get("detail"))
    return out


def sanitized(selection: Sequence[tuple[Case, str]], timeout_s: float = CSAN_TIMEOUT_S) -> dict[tuple[str, str], Sanitized]:
    """Every ``(case, form)`` of ``selection`` under the sanitizer, in one child process
    (``python -m kvverify.record.corpus.sanitized``). A form the child did not report on (it died,
    or ran out of ``timeout_s`` seconds) is an "error" saying so; a form never run is "not run"."""
    never = {(c.name, f): Sanitized("not run", c.not_run) for c, f in selection if f == "broken" and c.not_run}
    selection = [(c, f) for c, f in selection if (c.name, f) not in never]
    if not selection:
        return never
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "kvverify.record.corpus.sanitized", *(f"{c.name}:{f}" for c, f in selection)]
    try:
        child = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
        found, why = parse_sanitized(child.stdout), f"the sanitized process exited with status {child.returncode}"
        tail = " ".join(child.stderr.split())[-200:]
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        found, why, tail = parse_sanitized(stdout), f"the sanitized process ran past {timeout_s:g} s", ""
    missing = Sanitized("error", f"{why} before this form" + (f": {tail}" if tail else ""))
    return {**never, **{(c.name, f): found.get((c.name, f), missing) for c, f in selection}}


def run_corpus(cases: Sequence[Case], forms: Sequence[str], *, csan: bool = True, confirm: bool = False,
               progress: Callable[[FormResult], None] | None = None) -> CorpusRun:
    """Each form of each case natively, then recorded (with ``confirm``: each race's device
    witness too); then all of them under the sanitizer when ``csan``. ``progress`` is called with
    each form's result as it is known (without ``csan``)."""
    selection = [(case, form) for case in cases for form in forms]
    rows = []
    for case, form in selection:
        witness, error = native(case, form)
        row = FormResult(case.name, case.source, case.capture, form, witness, error, recorded(case, form, confirm))
        if progress is not None:
            progress(row)
        rows.append(row)
    if csan:
        found = sanitized(selection)
        rows = [FormResult(r.case, r.source, r.capture, r.form, r.native, r.native_error, r.recorded,
                           found[(r.case, r.form)]) for r in rows]
    failures = [f for (case, _), row in zip(selection, rows) for f in shortfalls(case, row)]
    return CorpusRun(tuple(rows), tuple(failures))
