"""``kvverify.check(trace)``, the checker's Python API (README): the same verdict whichever form
the trace comes in, and a TraceError, never another exception, for a trace that is not one."""

from __future__ import annotations

import json

import pytest

import kvverify
import kvverify.check
from kvverify.check import Trace, TraceError

RACY_STORE = {
    "version": 1,
    "buffers": {"gpu": {"space": "device", "bytes": 8192}, "cpu": {"space": "host_pinned", "bytes": 8192}},
    "streams": ["compute", "offload"],
    "ops": [
        {"op": "kernel", "stream": "compute", "name": "write_kv", "writes": [["gpu", 0, 4096]]},
        {"op": "wait_stream", "stream": "offload", "on": "compute"},
        {"op": "copy_batch", "stream": "offload", "order": "ANY",
         "copies": [{"src": ["gpu", 0, 4096], "dst": ["cpu", 0, 4096]}]},
    ],
}


@pytest.mark.parametrize("form", ["dict", "Trace", "path", "PathLike", "str", "bytes"])
def test_every_form_of_a_trace_gets_the_same_verdict(tmp_path, form):
    text = json.dumps(RACY_STORE)
    path = tmp_path / "store.json"
    path.write_text(text)
    trace = {"dict": RACY_STORE, "Trace": Trace.from_json(RACY_STORE), "path": str(path), "PathLike": path,
             "str": "\n " + text, "bytes": text.encode()}[form]
    verdict = kvverify.check(trace)
    assert verdict.verdict == "RACY" and len(verdict.races) == 1
    race = verdict.races[0]
    assert (race.first, race.second, race.kind) == (0, 2, "RAW")


def test_a_python_dict_with_a_key_json_cannot_have_is_a_trace_error():
    bad = {**RACY_STORE, "buffers": {1: {"space": "device", "bytes": 8}}}
    with pytest.raises(TraceError, match=r"field 'buffers': a buffer name is a non-empty string, got 1"):
        kvverify.check(bad)


def test_a_missing_path_is_an_os_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        kvverify.check(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("text", ["[]", '"trace"', '[{"op": "alloc"}]', "not json\nat all"])
def test_json_text_that_is_no_object_says_so_instead_of_no_such_file(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceError, match=r"is neither a trace file nor a trace: a trace is a JSON object"):
        kvverify.check(text)


def test_help_on_the_package_starts_with_the_call():
    assert kvverify.check.__doc__.startswith("``kvverify.check(trace, *, max_races=10000) -> Verdict``")
    assert kvverify.check.check.__doc__ and "Raises :class:`TraceError`" in kvverify.check.check.__doc__


def test_a_path_that_starts_with_a_brace_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{run1}.json").write_text(json.dumps(RACY_STORE))
    assert kvverify.check("{run1}.json").verdict == "RACY"
