"""What a corpus run found, per case and form: the model that ``report`` renders and ``cli`` judges.
Standard library only."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvverify.record.corpus.case import Case, Witness
from kvverify.terms import RACY, SAFE

JSON_VERSION = 1


def split_at(at: str | None) -> tuple[str, str, str] | None:
    """``(file name, line, function)`` of an ``at`` string (``"dir/file.py:12 in name"``), or None."""
    if not at or " in " not in at:
        return None
    location, _, function = at.partition(" in ")
    path, _, line = location.rpartition(":")
    if not path or not line.isdigit():
        return None
    return Path(path).name, line, function


@dataclass(frozen=True)
class RacingPair:
    """One race of a recording: its kind (RAW / WAR / WAW / FREE) and where the program issued its
    two ops (``at``: ``"path/file.py:123 in function"``; None where the trace does not say)."""

    kind: str
    first_at: str | None
    second_at: str | None


@dataclass(frozen=True)
class Recorded:
    """A form run under ``kvverify.record.recording()`` and checked.

    ``verdict``: SAFE or RACY as the checker decided the trace (None when the run raised: ``error``);
    ``races``: how many; ``complete``: ``Recording.complete()``; ``race``: the race of the case's
    kind between its two functions when there is one (``pair_found``), else the first race;
    ``blind``: for a case that needs native capture, why the recording cannot decide this form (a
    table shows that instead of the verdict, which covers only what the recording saw);
    ``witnesses``: with ``--confirm``, the device witness of each racing pair of lines
    (``kvverify.record.confirm.witness.Outcome.line``)."""

    verdict: str | None = None
    races: int = 0
    complete: bool = True
    race: RacingPair | None = None
    pair_found: bool = False
    blind: str | None = None
    error: str | None = None
    witnesses: tuple[str, ...] | None = None  # with --confirm: each pair of lines' witness, as one line


@dataclass(frozen=True)
class Sanitized:
    """A form run under PyTorch's CUDA Stream Sanitizer: ``outcome`` "reported" (it raised a race),
    "nothing" (the form ran to its end), "error" (anything else; ``detail`` says what), or "not
    run" (a form the corpus never executes; ``detail`` says why)."""

    outcome: str
    detail: str | None = None


@dataclass(frozen=True)
class FormResult:
    """One form of one case: natively (``native``, or ``native_error``), recorded, and under the
    sanitizer (``csan``; None when not run)."""

    case: str
    source: str
    capture: str
    form: str
    native: Witness | None = None
    native_error: str | None = None
    recorded: Recorded = field(default_factory=Recorded)
    csan: Sanitized | None = None


def shortfalls(case: Case, result: FormResult) -> list[str]:
    """Why ``result`` misses what the corpus promises for ``case`` (empty when it holds): a case the
    recording sees is RACY with its pair in the broken form and SAFE over a complete recording in
    the fixed form. A case that needs native capture promises nothing here."""
    if case.capture != "recorded":
        return []
    rec, where = result.recorded, f"{case.name} {result.form}"
    if rec.error is not None:
        return [f"{where}: the recorded run raised: {rec.error}"]
    if result.form == "broken":
        if rec.verdict != RACY:
            return [f"{where}: recorded {rec.verdict}, expected RACY with {case.kind} {case.pair[0]} / {case.pair[1]}"]
        if not rec.pair_found:
            return [f"{where}: RACY, but no {case.kind} race between {case.pair[0]} and {case.pair[1]} in {case.file}"]
        return []
    if rec.verdict != SAFE:
        return [f"{where}: recorded {rec.verdict} ({rec.races} races), expected SAFE"]
    if not rec.complete:
        return [f"{where}: SAFE over an incomplete recording (the recorder missed ops)"]
    return []


@dataclass(frozen=True)
class CorpusRun:
    """Every form run (``rows``, in the table's order) and what misses the corpus's promise."""

    rows: tuple[FormResult, ...]
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when nothing missed the corpus's promise (``kvverify corpus`` exits 0)."""
        return not self.failures

    def to_json(self) -> dict:
        """``{"version", "ok", "failures", "rows"}``, each row its dataclass fields."""
        return {"version": JSON_VERSION, "ok": self.ok, "failures": list(self.failures),
                "rows": [asdict(row) for row in self.rows]}

    @classmethod
    def from_json(cls, doc: dict) -> CorpusRun:
        """The run a corpus JSON report holds (``to_json``, ``kvverify corpus --json``), to render
        again. Raises ValueError for a report of another version, naming both."""
        if doc.get("version") != JSON_VERSION:
            raise ValueError(f"a corpus report of version {doc.get('version')!r}; this kvverify reads version "
                             f"{JSON_VERSION}: run kvverify corpus --json again")
        rows = []
        for row in doc["rows"]:
            recorded = dict(row["recorded"])
            if recorded["race"] is not None:
                recorded["race"] = RacingPair(**recorded["race"])
            if recorded["witnesses"] is not None:
                recorded["witnesses"] = tuple(recorded["witnesses"])
            native, csan = row["native"], row["csan"]
            rows.append(FormResult(**{**row, "native": None if native is None else Witness(**native),
                                      "recorded": Recorded(**recorded), "csan": None if csan is None else Sanitized(**csan)}))
        return cls(tuple(rows), tuple(doc["failures"]))
