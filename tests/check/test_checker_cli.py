"""``kvverify check``: exit codes, --json, stdin, one-line errors for every invalid-input class."""

from __future__ import annotations

import copy
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trace_helpers import STORE_EXAMPLE

from kvverify.cli import main

ROOT = Path(__file__).resolve().parents[2]

SAFE_DOC = STORE_EXAMPLE
RACY_DOC = copy.deepcopy(SAFE_DOC)
RACY_DOC["ops"][2]["order"] = "ANY"


def _file(tmp_path, doc, name="trace.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def _stdin(monkeypatch, text: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))


def test_safe_exits_0_with_a_report(tmp_path, capsys):
    assert main(["check", _file(tmp_path, SAFE_DOC)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SAFE in ")


def test_racy_exits_1_and_lists_the_race(tmp_path, capsys):
    assert main(["check", _file(tmp_path, RACY_DOC)]) == 1
    out = capsys.readouterr().out
    assert "RACY" in out and "1 race" in out
    assert "op 0 (kernel 'write_kv' on 'compute')" in out
    assert "op 2 (copy_batch on 'offload', ANY)" in out
    assert "RAW on gpu[0:4096]" in out and "why:" in out and "fix:" in out


@pytest.mark.parametrize("doc, status, verdict", [(SAFE_DOC, 0, "SAFE"), (RACY_DOC, 1, "RACY")])
def test_json_shape(tmp_path, capsys, doc, status, verdict):
    assert main(["check", "--json", _file(tmp_path, doc)]) == status
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"verdict", "races"}
    assert out["verdict"] == verdict
    if verdict == "RACY":
        (race,) = out["races"]
        assert race["first"] == 0 and race["second"] == 2 and race["kind"] == "RAW"
        assert race["overlap"] == ["gpu", 0, 4096]
        assert race["rule"] == "5"
        assert isinstance(race["reason"], str) and race["fix"].startswith("use STREAM order for op 2")
    else:
        assert out["races"] == []


def test_stdin(monkeypatch, capsys):
    _stdin(monkeypatch, json.dumps(RACY_DOC))
    assert main(["check", "-", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "RACY"
    _stdin(monkeypatch, json.dumps(SAFE_DOC))
    assert main(["check", "-"]) == 0
    assert "SAFE in <stdin>" in capsys.readouterr().out


def test_max_races(tmp_path, capsys):
    doc = copy.deepcopy(RACY_DOC)
    doc["ops"].insert(1, {"op": "kernel", "stream": "offload", "reads": [["gpu", 0, 8]]})
    assert main(["check", "--json", "--max-races", "1", _file(tmp_path, doc)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert len(out["races"]) == 1 and out["truncated"] is True
    assert main(["check", "--max-races", "0", _file(tmp_path, doc)]) == 2


def _set(i, **kw):
    def f(doc):
        doc["ops"][i].update(kw)
        return doc
    return f


def _pop(i, key):
    def f(doc):
        del doc["ops"][i][key]
        return doc
    return f


INVALID = [
    # (id, mutation of SAFE_DOC, op index or None, field or None, words)
    ("bad-json", lambda d: json.dumps(d)[:-3], None, None, "not valid JSON"),
    ("unknown-version", lambda d: {**d, "version": 3}, None, "version", "unknown version 3"),
    ("unknown-op", _set(3, op="event_record"), 3, "op", "unknown op"),
    ("unknown-buffer", _set(0, writes=[["gpu_kv", 0, 4096]]), 0, "writes[0]", "unknown buffer 'gpu_kv'"),
    ("unknown-stream", _set(1, on="comptue"), 1, "on", "unknown stream 'comptue'"),
    ("unknown-order", _set(2, order="FAST"), 2, "order", "unknown order"),
    ("range-outside", _set(5, ranges=[["cpu", 4096, 8192]]), 5, "ranges[0]", "past the end"),
    ("zero-length", _set(2, copies=[{"src": ["gpu", 0, 0], "dst": ["cpu", 0, 0]}]), 2, "copies[0].src",
     "length must be"),
    ("host-on-device", _set(5, ranges=[["gpu", 0, 4096]]), 5, "ranges[0]", "host access to device memory"),
    ("missing-field", _pop(3, "event"), 3, "event", "missing"),
    ("wrong-type-offset", _set(0, writes=[["gpu", "0", 4096]]), 0, "writes[0]", "offset must be an integer"),
    ("wrong-type-result", lambda d: {**d, "ops": d["ops"] + [{"op": "query_event", "event": "end", "result": 1}]},
     6, "result", "true or false"),
    ("wrong-type-ops", lambda d: {**d, "ops": {"op": "sync_device"}}, None, "ops", "expected an array"),
    ("unknown-field", _set(0, wrties=[]), 0, "wrties", "unknown field"),
    ("unknown-space", lambda d: {**d, "buffers": {**d["buffers"], "x": {"space": "vram", "bytes": 8}}}, None,
     "buffers.x.space", "unknown space"),
]


@pytest.mark.parametrize("mutate, op_index, field, words", [p[1:] for p in INVALID], ids=[p[0] for p in INVALID])
def test_invalid_input_exits_2_with_one_line(tmp_path, capsys, mutate, op_index, field, words):
    doc = mutate(copy.deepcopy(SAFE_DOC))
    assert main(["check", _file(tmp_path, doc)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith("kvverify check: invalid trace: ")
    assert words in line
    if op_index is not None:
        assert re.match(rf"kvverify check: invalid trace: op {op_index}\b", line)
    if field is not None:
        assert f"field '{field}'" in line
    assert "Traceback" not in captured.err


def test_unreadable_file_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for words in ("exit status", "0  SAFE", "1  RACY", "2  the trace is invalid", "example:", "--json",
                  "'-' reads it from standard input"):
        assert words in out


def _cli(*args, stdin: str = ""):
    return subprocess.run([sys.executable, "-m", "kvverify", "check", *args], input=stdin, text=True,
                          capture_output=True, cwd=ROOT, timeout=60, check=False)


def test_as_a_process_from_stdin():
    p = _cli("--json", "-", stdin=json.dumps(RACY_DOC))
    assert p.returncode == 1 and json.loads(p.stdout)["verdict"] == "RACY"


def test_as_a_process_invalid_input_never_prints_a_traceback():
    for text in ("{", "[]", '{"version": 1, "buffers": [], "streams": [], "ops": []}', "\x00", "null",
                 '{"version": 1, "buffers": {}, "streams": [], "ops": [[]]}'):
        p = _cli("-", stdin=text)
        assert p.returncode == 2, (text, p.stderr)
        assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr
