"""docs/corpus.md's tables of the H200 run are generated from that run's JSON report, kept in
tests/data/ (its README says how it gets there): they cannot go stale.

``KVVERIFY_UPDATE_DOCS=1 python -m pytest tests/record/test_corpus_docs.py`` writes them anew from
the report; without it, a difference fails the test. Without the report, the comparison skips,
saying so."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from kvverify.record.corpus import report
from kvverify.record.corpus.case import Witness
from kvverify.record.corpus.results import CorpusRun, FormResult, RacingPair, Recorded, Sanitized

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "corpus.md"
DATA = ROOT / "tests" / "data" / "corpus-h200.json"
WITNESS_HEADER = ("| case (broken form) | native: corrupted | witness (`--confirm`) |", "| --- | --- | --- |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows_table(run: CorpusRun) -> str:
    """One row per case and form: the table ``kvverify corpus`` prints, without the witness column
    (the witnesses have a table of their own)."""
    rows = tuple(dataclasses.replace(row, recorded=dataclasses.replace(row.recorded, witnesses=None))
                 for row in run.rows)
    return report.markdown(CorpusRun(rows, run.failures))


def witnesses_table(run: CorpusRun) -> str:
    """One row per broken form that ``--confirm`` witnessed: the case, its native count, its witnesses."""
    lines = list(WITNESS_HEADER)
    lines += [f"| {_cell(row.case)} | {_cell(report.native_cell(row))} | {_cell(report.witness_cell(row))} |"
              for row in run.rows if row.form == "broken" and row.recorded.witnesses is not None]
    return "\n".join(lines) + "\n"


BLOCKS = {"corpus-table": rows_table, "corpus-witnesses": witnesses_table}


def blocks(doc: str) -> dict[str, tuple[int, int]]:
    """Where each generated block of ``doc`` lies: name -> (start, end) of the text between its markers."""
    spans = {}
    for name in BLOCKS:
        begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
        start = doc.index(begin) + len(begin)
        spans[name] = (start, doc.index(end, start))
    return spans


def test_the_h200_tables_in_docs_corpus_md_are_its_json_report():
    if not DATA.is_file():
        pytest.skip("tests/data/corpus-h200.json is absent: the H200 run's corpus report supplies it "
                    "(tests/data/README.md); until then docs/corpus.md's H200 tables are as copied by hand")
    run = CorpusRun.from_json(json.loads(DATA.read_text(encoding="utf-8")))
    doc = DOC.read_text(encoding="utf-8")
    new = doc
    for name, (start, end) in sorted(blocks(doc).items(), key=lambda item: -item[1][0]):  # the last first
        new = new[:start] + BLOCKS[name](run) + new[end:]
    if os.environ.get("KVVERIFY_UPDATE_DOCS") == "1":
        DOC.write_text(new, encoding="utf-8")
    assert doc == new, "docs/corpus.md's H200 tables are stale: rerun with KVVERIFY_UPDATE_DOCS=1"


def test_docs_corpus_md_marks_each_generated_table_under_the_header_it_gets():
    """The markers the generator writes between are there, each around one table whose header is
    the one the generator writes: a report's arrival changes rows, not the layout."""
    doc = DOC.read_text(encoding="utf-8")
    empty = CorpusRun(())
    for name, (start, end) in blocks(doc).items():
        header = BLOCKS[name](empty).splitlines()
        lines = doc[start:end].splitlines()
        assert lines[:2] == header and len(lines) > 2 and all(line.startswith("| ") for line in lines), name


def test_a_corpus_report_reads_back_as_the_run_it_was():
    """``CorpusRun.from_json`` is ``to_json`` undone, every field kind included; another version is refused."""
    race = RacingPair("WAR", "x/vllm_1.py:3 in load", None)
    run = CorpusRun((
        FormResult("vllm-1", "vllm-project/vllm#1", "recorded", "broken", native=Witness(16, 16),
                   recorded=Recorded("RACY", 2, True, race, True, witnesses=("CONFIRMED: race 1 (WAR): ...",)),
                   csan=Sanitized("reported")),
        FormResult("vllm-1", "vllm-project/vllm#1", "recorded", "fixed", native_error="RuntimeError: x",
                   recorded=Recorded(error="boom"), csan=Sanitized("error", "a | b")),
        FormResult("demo-x", "kvverify.record.demo", "native", "broken", native=Witness(0, 0, note="not run"),
                   recorded=Recorded(blind="a host write no capture sees")),
    ), failures=("vllm-1 fixed: the recorded run raised: boom",))
    assert CorpusRun.from_json(json.loads(report.to_json(run))) == run
    with pytest.raises(ValueError, match="a corpus report of version 0; this kvverify reads version 1"):
        CorpusRun.from_json({**run.to_json(), "version": 0})
