"""``kvverify check``: exit codes, --json, stdin, one-line errors for every invalid-input class."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from help_screen import MARKUP, help_lines
from terminal import check_fits, pythonpath, run_in_pty
from trace_helpers import STORE_EXAMPLE

from kvverify.cli import main

ROOT = Path(__file__).resolve().parents[2]

SAFE_DOC = STORE_EXAMPLE
RACY_DOC = copy.deepcopy(SAFE_DOC)
RACY_DOC["ops"][2]["order"] = "ANY"


@pytest.fixture(autouse=True)
def whole_lines(monkeypatch):
    """The report read whole, whatever width this run has: a screen is laid out for COLUMNS, and a
    log that wants whole lines sets it wide. The tests of the width set their own."""
    monkeypatch.setenv("COLUMNS", "1000")


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


def test_help_teaches(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps the help to the terminal: the screen help_lines reads
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for words in ("exit status", "0  SAFE", "1  RACY", "2  the trace is invalid", "3  anything unexpected",
                  "example:", "--json", "'-' reads it from standard input", "--max-input-size", "--debug"):
        assert words in out


def test_help_fits_a_screen_and_its_example_says_what_check_prints(tmp_path):
    lines = help_lines("check")
    assert len(lines) <= 50 and max(map(len, lines)) <= 100, "\n".join(lines)
    assert not any(mark in "\n".join(lines) for mark in MARKUP)
    start = lines.index("  $ cat store.json") + 1
    end = lines.index("  $ kvverify check store.json")
    (tmp_path / "store.json").write_text("\n".join(lines[start:end]))
    p = subprocess.run([sys.executable, "-m", "kvverify", "check", "store.json"], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert p.returncode == 1
    printed = [line for line in p.stdout.splitlines() if line.strip()]  # the help leaves out the blank lines
    assert printed[0] == lines[end + 1].strip() and printed[1] == lines[end + 2].strip()
    fix = lines[end + 4].strip().removesuffix("...").rstrip()
    assert any(line.strip().startswith(fix) for line in printed), p.stdout


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


# -- exit statuses 2 and 3, and malformed input (issue #11) -----------------------------------------

MAX_LINE = 1000
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _one_line(err: str) -> str:
    """The single line of an error on stderr: bounded, printable, no traceback."""
    lines = err.splitlines()
    assert len(lines) == 1, err[:2000]
    assert len(lines[0]) <= MAX_LINE, len(lines[0])
    assert not CONTROL.search(lines[0]), repr(lines[0][:200])
    assert "Traceback" not in err
    return lines[0]


def _text_with(doc, old: str, new: str) -> str:
    text = json.dumps(doc)
    assert old in text
    return text.replace(old, new, 1)


def _named(name: str, order: str = "ANY") -> dict:
    """The store example with its GPU buffer renamed (RACY in ANY order, SAFE in STREAM)."""
    doc = copy.deepcopy(RACY_DOC)
    doc["ops"][2]["order"] = order
    doc["buffers"][name] = doc["buffers"].pop("gpu")
    doc["ops"][0]["writes"][0][0] = name
    doc["ops"][2]["copies"][0]["src"][0] = name
    return doc


def test_an_unexpected_error_exits_3_with_one_line_asking_for_a_report(tmp_path, capsys, monkeypatch):
    from kvverify.check import checker

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(checker, "check_ops", broken)
    path = _file(tmp_path, SAFE_DOC)
    assert main(["check", path]) == 3
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert "internal error (RuntimeError: a bug)" in line and "report" in line and "--debug" in line
    assert captured.out == ""
    assert main(["check", "--debug", path]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug" in err


def test_an_integer_longer_than_python_reads(tmp_path, capsys):
    digits = sys.get_int_max_str_digits() + 700
    text = _text_with(SAFE_DOC, '"bytes": 8192', f'"bytes": {"9" * digits}')
    assert main(["check", _file(tmp_path, text)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "field 'buffers'" in line and f"more than {sys.get_int_max_str_digits()} digits" in line


def test_an_integer_python_reads_but_no_buffer_holds(tmp_path, capsys):
    text = _text_with(SAFE_DOC, '["gpu", 0, 4096]]', f'["gpu", {"9" * 4000}, 4096]]')
    assert main(["check", _file(tmp_path, text)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "op 0 (kernel), field 'writes[0]'" in line and "an integer of about 4000 digits" in line


@pytest.mark.parametrize("depth, words", [(400, "expected a range"), (100_000, "nested too deeply")])
def test_nesting_under_and_over_the_decoders_limit(tmp_path, capsys, depth, words):
    text = _text_with(SAFE_DOC, '[["gpu", 0, 4096]]', "[" + "[" * depth + "]" * depth + "]")
    assert main(["check", _file(tmp_path, text)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("kvverify check: invalid trace: op 0") and words in line


def test_a_value_of_three_million_items_is_cut_with_a_count(tmp_path, capsys):
    text = _text_with(SAFE_DOC, '[["gpu", 0, 4096]]', "[[" + "0, " * 2_999_999 + "0]]")
    assert main(["check", _file(tmp_path, text)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "field 'writes[0]'" in line and "more items)" in line


@pytest.mark.parametrize("old, new, op, field", [
    ('"order": "STREAM"', '"order": "STREAM", "order": "ANY"', 2, "order"),       # the last would win: ANY
    ('"dst": ["cpu", 0, 4096]', '"dst": ["cpu", 0, 4096], "src": ["gpu", 4096, 4096]', 2, "src"),
    ('"cpu": {"space": "host_pinned", "bytes": 8192}',
     '"cpu": {"space": "host_pinned", "bytes": 8192}, "cpu": {"space": "device", "bytes": 8}', None, "buffers"),
    ('"streams":', '"version": 1, "streams":', None, "version"),
    ('"ops": [', '"opps": [], "ops": [', None, "opps"),                               # an unknown key
])
def test_repeated_and_unknown_keys_are_invalid(tmp_path, capsys, old, new, op, field):
    path = _file(tmp_path, _text_with(SAFE_DOC, old, new))
    assert main(["check", path]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"field '{field}'" in line
    assert main(["check", "--json", path]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out == {"verdict": "INVALID", "error": line.removeprefix("kvverify check: "), "op": op, "field": field}


def test_nan_is_not_json(tmp_path, capsys):
    assert main(["check", _file(tmp_path, _text_with(SAFE_DOC, '"bytes": 8192', '"bytes": NaN'))]) == 2
    assert "NaN is not JSON" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("doc, status", [(SAFE_DOC, 0), (RACY_DOC, 1)])
def test_json_always_says_its_verdict(tmp_path, capsys, doc, status):
    assert main(["check", "--json", _file(tmp_path, doc)]) == status
    assert json.loads(capsys.readouterr().out)["verdict"] == ("SAFE", "RACY")[status]
    assert main(["check", "--json", _file(tmp_path, "{")]) == 2
    assert json.loads(capsys.readouterr().out)["verdict"] == "INVALID"


def test_names_that_would_repaint_the_terminal_are_escaped_in_the_report(tmp_path):
    name = "\r\x1b[2K\x1b[32mSAFE\u202e\ud800"
    path = _file(tmp_path, _named(name))
    p = _cli(path)
    assert p.returncode == 1 and p.stdout.startswith("RACY in ")
    assert not CONTROL.search(p.stdout.replace("\n", "")), repr(p.stdout[:300])
    assert "\\r\\x1b[2K\\x1b[32mSAFE\\u202e\\ud800[0:4096]" in p.stdout
    q = _cli("--json", path)
    assert q.returncode == 1 and json.loads(q.stdout)["races"][0]["overlap"][0] == name


def test_names_in_any_script_print_as_they_are(tmp_path):
    name = "显存-キャッシュ-кэш-ذاكرة"
    racy, safe = _cli(_file(tmp_path, _named(name), "racy.json")), _cli(_file(tmp_path, _named(name, "STREAM"), "safe.json"))
    assert racy.returncode == 1 and f"RAW on {name}[0:4096]" in racy.stdout
    assert safe.returncode == 0 and safe.stdout.startswith("SAFE in ")


def test_races_name_where_the_program_issued_both_ops(tmp_path, capsys):
    doc = copy.deepcopy(RACY_DOC)
    doc["ops"][0]["at"] = "model.py:12 in forward"
    doc["ops"][2]["at"] = "offload.py:88 in store"
    assert main(["check", "--json", _file(tmp_path, doc)]) == 1
    (race,) = json.loads(capsys.readouterr().out)["races"]
    assert (race["first_at"], race["second_at"]) == ("model.py:12 in forward", "offload.py:88 in store")
    assert main(["check", _file(tmp_path, doc)]) == 1
    assert "op 2 (copy_batch on 'offload', ANY) at offload.py:88 in store" in capsys.readouterr().out


def _shell(command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          check=False, **kwargs)


def test_standard_input_closed(tmp_path):
    p = _shell(f"{sys.executable} -m kvverify check - <&-")
    assert p.returncode == 2 and "standard input is closed" in _one_line(p.stderr)


def test_reading_dev_zero_stops_at_once():
    for command in ("check /dev/zero", "check - < /dev/zero"):
        p = _shell(f"{sys.executable} -m kvverify {command}")
        assert p.returncode == 2 and "expected '{', found '\\x00'" in _one_line(p.stderr)


def test_a_directory_is_unreadable(tmp_path):
    p = _cli(str(tmp_path))
    assert p.returncode == 2 and "cannot read" in _one_line(p.stderr)


def test_the_input_size_cap_and_the_flag_that_raises_it(tmp_path):
    path = _file(tmp_path, SAFE_DOC)
    for p in (_cli("--max-input-size", "100", path), _cli("--max-input-size", "100", "-", stdin=json.dumps(SAFE_DOC))):
        assert p.returncode == 2 and "--max-input-size" in _one_line(p.stderr)
    assert _cli("--max-input-size", "1MiB", path).returncode == 0


@pytest.mark.parametrize("doc, status", [(SAFE_DOC, 3), (RACY_DOC, 1)])
def test_a_report_that_cannot_be_written(tmp_path, doc, status):
    p = _shell(f"{sys.executable} -m kvverify check {_file(tmp_path, doc)} > /dev/full")
    assert p.returncode == status and "cannot write the report: No space left on device" in _one_line(p.stderr)


def _into_a_closed_pipe(*args) -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)          # nobody will read: every write fails (EPIPE)
    try:
        return subprocess.run([sys.executable, "-m", "kvverify", "check", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=60, check=False)
    finally:
        os.close(write)


@pytest.mark.parametrize("doc, status", [(SAFE_DOC, 3), (RACY_DOC, 1)])
def test_a_broken_pipe_ends_quietly(tmp_path, doc, status):
    p = _into_a_closed_pipe("--json", _file(tmp_path, doc))
    assert p.returncode == status and p.stderr == ""


def test_json_into_head_ends_quietly_with_the_verdicts_status(tmp_path):
    doc = {"version": 1, "buffers": {"gpu": {"space": "device", "bytes": 64}}, "streams": ["a", "b"],
           "ops": [{"op": "kernel", "stream": "a", "writes": [["gpu", 0, 8]]}]
           + [{"op": "kernel", "stream": "b", "reads": [["gpu", 0, 8]]}] * 3000}
    p = _shell(f"{sys.executable} -m kvverify check --json {_file(tmp_path, doc)} | head -c 100; exit ${{PIPESTATUS[0]}}")
    assert p.returncode == 1 and p.stderr == "" and p.stdout.startswith('{\n  "verdict": "RACY"')


RACY_EXAMPLE = ROOT / "examples" / "store-any-racy.json"


@pytest.mark.parametrize("columns", [60, 100])
def test_in_a_terminal_the_report_wraps_to_its_width(columns):
    status, lines = run_in_pty([sys.executable, "-m", "kvverify", "check", str(RACY_EXAMPLE)], columns=columns,
                               env={"PYTHONPATH": pythonpath()})
    assert status == 1, "\n".join(lines)
    check_fits(lines, columns)
    why = next(k for k, line in enumerate(lines) if line.startswith("  why:    "))
    assert lines[why + 1].startswith(" " * 10)  # continuation lines hang under the text, not the label


@pytest.mark.parametrize("columns", [None, "60", "1000"])
def test_piped_the_report_fits_columns_else_80_as_every_screen(columns):
    """Piped (a log, a file), the report is laid out as stress's and every help are: for COLUMNS,
    else 80 columns; COLUMNS=1000 keeps each line whole. Not a word is lost."""
    from kvverify import check

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"PYTHONPATH": pythonpath()}
    if columns is not None:
        env["COLUMNS"] = columns
    p = subprocess.run([sys.executable, "-m", "kvverify", "check", str(RACY_EXAMPLE)], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 1, p.stderr
    whole = check(RACY_EXAMPLE).render(source=str(RACY_EXAMPLE))
    assert p.stdout.split() == whole.split()
    if columns == "1000":
        assert p.stdout == whole and max(map(len, p.stdout.splitlines())) > 200  # the why line, whole
    else:
        check_fits(p.stdout.splitlines(), int(columns or 80))
