"""Reading a trace's JSON text: strict JSON (repeated keys, NaN, long integers, nesting), the ops
read one at a time (TraceText) and parsed again on demand, and messages that stay one printable
line of bounded length whatever the input holds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_helpers import STORE_EXAMPLE
from trace_strategies import small_traces

from kvverify.check import Trace, TraceError, TraceText, check
from kvverify.check.jsontext import JSONTextError, ObjectReader, decode, loads
from kvverify.check.model import cut, printable, show

TEXT = json.dumps(STORE_EXAMPLE)


def test_trace_text_streams_the_ops_and_gives_the_same_trace():
    text = TraceText(TEXT)
    assert list(text.streams) == ["compute", "offload"] and set(text.buffers) == {"gpu", "cpu"}
    ops = list(text.ops())
    trace = text.trace()
    assert trace == Trace.from_json(STORE_EXAMPLE) and list(trace.ops) == ops
    assert trace.ops[-1] == ops[-1] and trace.ops[1:3] == ops[1:3] and len(trace) == 6
    with pytest.raises(RuntimeError, match="once"):
        next(text.ops())


def test_trace_text_takes_bytes_with_or_without_a_byte_order_mark():
    assert Trace.from_json(TEXT.encode()) == Trace.from_json(b"\xef\xbb\xbf" + TEXT.encode())
    with pytest.raises(TraceError, match="not UTF-8 text: byte 0"):
        TraceText(b"\xff" + TEXT.encode())


def test_ops_before_the_header_are_read_whole():
    doc = {"ops": STORE_EXAMPLE["ops"], **{k: v for k, v in STORE_EXAMPLE.items() if k != "ops"}}
    text = TraceText(json.dumps(doc))
    assert list(text.ops()) == list(Trace.from_json(STORE_EXAMPLE).ops)
    assert text.trace() == Trace.from_json(STORE_EXAMPLE)


def test_a_verdict_names_ops_parsed_again_from_the_text():
    doc = json.loads(TEXT)
    doc["ops"][2]["order"] = "ANY"
    doc["ops"][2]["at"] = "offload.py:88 in store"
    text = TraceText(json.dumps(doc))
    from kvverify.check.checker import check_ops

    report = check_ops(text.buffers, text.streams, text.ops(), text.trace)
    assert report.pairs() == {(0, 2)} and report.races[0].second_at == "offload.py:88 in store"
    assert "op 2 (copy_batch on 'offload', ANY) at offload.py:88 in store" in report.render()
    assert report.to_json() == check(Trace.from_json(doc)).to_json()


@pytest.mark.parametrize("text, words, op_index, field", [
    ('{"version": 1, "version": 1, "buffers": {}, "streams": [], "ops": []}', 'repeats the key "version"', None,
     "version"),
    ('{"version": 1, "buffers": {"a": {"space": "device", "space": "device", "bytes": 1}}, "streams": [], "ops": []}',
     'repeats the key "space"', None, "buffers"),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [{"op": "sync_device"}, {"op": "sync_device", "op": "x"}]}',
     'repeats the key "op"', 1, "op"),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [{"op": "sync_device"}] , "ops": []}',
     'repeats the key "ops"', None, "ops"),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": []} {}', "extra text after", None, None),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [{"op": "sync_device"} {"op": "sync_device"}]}',
     "expected ',' or ']'", 0, None),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [], "comment": "hi"}', "unknown field", None, "comment"),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [{"op": "sync_device", "name": NaN}]}', "NaN is not JSON",
     0, None),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [{"op": "sync_device", "name": 1e999}]}',
     "the number 1e999 is beyond a float's range", 0, None),
    ('{"version": 1, "buffers": {}, "streams": [], "ops": [' + "[" * 50_000 + "]" * 50_000 + "]}",
     "nested too deeply", 0, None),
    ("[]", "a trace is a JSON object", None, None),
])
def test_strict_json_names_where(text, words, op_index, field):
    with pytest.raises(TraceError) as e:
        list(TraceText(text).ops())
    assert words in str(e.value) and (e.value.op_index, e.value.field) == (op_index, field)
    assert "\n" not in str(e.value) and len(str(e.value)) < 1000


@pytest.mark.parametrize("text", ["[]", "3", '"trace"', "", "  "])
def test_a_trace_that_is_no_object_is_not_called_invalid_json(text):
    """``[]`` is valid JSON: the message says what a trace is, not that the JSON is broken."""
    with pytest.raises(TraceError) as e:
        TraceText(text)
    assert "a trace is a JSON object" in str(e.value) and "not valid JSON" not in str(e.value)


@pytest.mark.parametrize("text, words", [
    ("", "Expecting value"), ("[1] 2", "extra text after the JSON value"), ('{"a": 1, "a": 2}', 'repeats the key "a"'),
    ("[Infinity]", "Infinity is not JSON"), ("-1e400", "beyond a float's range"), ("[" * 100_000, "nested too deeply"),
    ("9" * 5000, "more than Python converts"),
])
def test_loads_reads_a_whole_document_strictly(text, words):
    with pytest.raises(JSONTextError, match=words):
        loads(text)


def test_loads_returns_the_value_with_whitespace_around():
    assert loads(' \n{"a": [1, 2.5, null]}\t') == {"a": [1, 2.5, None]}


def test_decode_and_object_reader_report_positions():
    with pytest.raises(JSONTextError) as e:
        decode('{"a": 1,\n "a": 2}', 0)
    assert e.value.key == "a" and "repeats the key" in str(e.value)
    with pytest.raises(JSONTextError) as e:
        decode("[1,\n  ]", 0)
    assert (e.value.line, e.value.column) == (2, 3)
    reader = ObjectReader(' {"a": [1, 2, {"b": 3}], "c": 4} ')
    got = []
    for key in reader.members():
        got.append((key, list(reader.items()) if reader.at_array() else reader.value()))
    assert got == [("a", [(8, 1), (11, 2), (14, {"b": 3})]), ("c", 4)]


def test_printable_escapes_what_a_terminal_acts_on_and_nothing_else():
    assert printable("\r\x1b[32mSAFE\t\n\x7f\u202e\u2066\ud800") == "\\r\\x1b[32mSAFE\\t\\n\\x7f\\u202e\\u2066\\ud800"
    for text in ("显存 кэш ذاكرة é 🙂", "plain ascii [0:4096]"):
        assert printable(text) == text


def test_cut_and_show_bound_what_they_echo():
    assert cut("x" * 50, 50) == "x" * 50
    assert cut("x" * 1000, 100) == "x" * 60 + "… (cut: 940 more characters)"
    assert show([0] * 3_000_000) == "[0, 0, 0, 0, 0, 0, 0, 0, … (2999992 more items)]"
    assert show("y" * 500, 20) == '"' + "y" * 20 + '"… (cut: 480 more characters)'
    assert show(10 ** 4000) == "<an integer of about 4000 digits>" and show(12) == "12"
    deep = []
    for _ in range(100_000):      # nested far beyond any recursion limit
        deep = [deep]
    assert len(show(deep)) < 100 and show({"a": 1, "b": [1, 2]}) == '{"a": 1, "b": [1, 2]}'
    assert show(True) == "true" and show(None) == "null" and show(1.5) == "1.5"


def _shuffled(value, rng):
    """``value`` with the members of every object in another order (arrays keep theirs)."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@settings(max_examples=300, deadline=None)
@given(trace=small_traces(), seed=st.integers(0, 2**32 - 1))
def test_the_members_of_a_trace_may_come_in_any_order(trace, seed):
    """RFC 8259: an object's members are unordered. The text of a trace whose top-level members and
    op fields are shuffled (``threads`` after ``ops`` too) gives the same trace and the same races."""
    import random

    doc = trace.to_json()
    text = json.dumps(_shuffled(doc, random.Random(seed)))
    assert Trace.from_json(text) == Trace.from_json(doc)
    expected, got = check(doc), check(text)
    assert got.verdict == expected.verdict
    assert [(r.first, r.second, r.kind) for r in got.races] == [(r.first, r.second, r.kind) for r in expected.races]
