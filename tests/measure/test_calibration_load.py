"""Reading a paths document back (``calibration.load``) and choosing from it (``choose``), whoever
wrote it: every malformed paths document, and every bad argument of ``choose``, is one
CalibrationError (a ValueError) naming the file and the field; never a KeyError, TypeError,
OverflowError or RecursionError, and never a silently wrong choice. The H200's own document
(tests/data/paths-h200.json) is the well-formed start. Making the document: ``test_calibration.py``."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import JSON_VALUES, slots

from kvverify.errors import CalibrationError
from kvverify.measure import calibration

REPO = Path(__file__).resolve().parents[2]
H200 = json.loads((REPO / "tests" / "data" / "paths-h200.json").read_text())
PROPERTY = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
REWRITE = "write the document again with kvverify bench --calibrate -o PATH"


def refused(tmp_path, content, *, raw: bytes | None = None) -> CalibrationError:
    """The error ``load`` raises for ``content`` (a document, dumped as JSON; or text; or ``raw`` bytes)."""
    path = tmp_path / "paths.json"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CalibrationError) as info:
        calibration.load(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    return info.value


def changed(change) -> dict:
    doc = copy.deepcopy(H200)
    change(doc)
    return doc


def test_the_h200_document_loads_and_answers(tmp_path):
    path = tmp_path / "paths.json"
    path.write_text(json.dumps(H200))
    doc = calibration.load(path)
    assert doc == H200
    entry = calibration.choose(doc, "h2d", 16384, 1024)
    assert (entry["direction"], entry["page_bytes"], entry["pages_per_call"]) == ("h2d", 16384, 256)


@pytest.mark.parametrize("change, field, message", [
    (lambda d: d.pop("entries"), "entries", "field 'entries' is missing"),
    (lambda d: d.update(entries=None), "entries", "field 'entries' is null, not an array"),
    (lambda d: d.update(entries={}), "entries", "field 'entries' is {}, not an array"),
    (lambda d: d["entries"].insert(2, {}), "entries[2].direction", "field 'entries[2].direction' is missing"),
    (lambda d: d["entries"].insert(0, "h2d"), "entries[0]", "field 'entries[0]' is \"h2d\", not an object"),
    (lambda d: d["entries"][3].update(direction="sideways"), "entries[3].direction",
     "field 'entries[3].direction' is \"sideways\", not one of h2d, d2h, both"),
    (lambda d: d["entries"][0].update(page_bytes=0), "entries[0].page_bytes",
     "field 'entries[0].page_bytes' is 0, not an integer of at least 8 (bytes)"),
    (lambda d: d["entries"][0].update(page_bytes=-4096), "entries[0].page_bytes", "is -4096, not an integer"),
    (lambda d: d["entries"][0].update(page_bytes="4096"), "entries[0].page_bytes", "is \"4096\", not an integer"),
    (lambda d: d["entries"][0].update(page_bytes=4096.0), "entries[0].page_bytes", "is 4096.0, not an integer"),
    (lambda d: d["entries"][0].update(pages_per_call=True), "entries[0].pages_per_call",
     "is true, not a positive integer"),
    (lambda d: d["entries"][5].update(best=None), "entries[5].best",
     ("field 'entries[5].best' is null, not an object (a point without a measured safe path belongs under "
      "'unmeasured')")),
    (lambda d: d["entries"][5].update(runner_up=[]), "entries[5].runner_up", "is [], not null or an object"),
    (lambda d: d["entries"][1]["best"].update(path="ANY", call={"method": "batch", "src_access_order": "ANY"}),
     "entries[1].best.path", "is \"ANY\", not one of STREAM, loop, kernel"),
    (lambda d: d["entries"][0]["best"]["call"].update(method="batch"), "entries[0].best.call",
     "is {\"method\": \"batch\"}, not {\"method\": \"kernel\"} (the call of path kernel)"),
    (lambda d: d["entries"][0]["best"].update(gbps=0), "entries[0].best.gbps", "is 0, not a positive number"),
    (lambda d: d["entries"][0]["best"].pop("gbps"), "entries[0].best.gbps", "is missing"),
    (lambda d: d["entries"][0]["runner_up"].update(event_gbps="fast"), "entries[0].runner_up.event_gbps",
     "is \"fast\", not a number or null"),
    (lambda d: d["entries"][1].update(if_host_source_untouched=d["entries"][1]["best"]),
     "entries[1].if_host_source_untouched", "not null (ANY is never safe for d2h, only for h2d loads)"),
    (lambda d: d["entries"][0].update(if_host_source_untouched=d["entries"][0]["best"]),
     "entries[0].if_host_source_untouched.path", "is \"kernel\", not one of ANY"),
    (lambda d: d["entries"][0]["candidates"].update(ANY={"gbps": 9.0, "event_gbps": None}), "entries[0].candidates",
     "not an object keyed by safe paths"),
    (lambda d: d["entries"][0]["candidates"].update(loop=7), "entries[0].candidates.loop", "is 7, not an object"),
    (lambda d: d["entries"][0]["candidates"]["loop"].update(gbps=-1.5), "entries[0].candidates.loop.gbps",
     "is -1.5, not a positive number"),
    (lambda d: d["entries"][0].update(ceiling_gbps="54"), "entries[0].ceiling_gbps", "not a number or null"),
    (lambda d: d["entries"].append(copy.deepcopy(d["entries"][4])), f"entries[{len(H200['entries'])}]",
     f"field 'entries[{len(H200['entries'])}]' repeats the shape of entries[4] (d2h 4096 B x 256): which one counts?"),
    (lambda d: d.update(host_memory="cxl"), "host_memory", "is \"cxl\", not one of pinned, registered, pageable"),
    (lambda d: d.update(ranked_by="gbps"), "ranked_by", "is \"gbps\", not \"e2e_gbps\""),
    (lambda d: d.update(safe_paths=["STREAM", "ANY"]), "safe_paths", "not an array of distinct safe paths"),
    (lambda d: d.update(unmeasured=[1]), "unmeasured", "is [1], not an array of strings"),
    (lambda d: d.update(platform="H200"), "platform", "is \"H200\", not an object"),
    (lambda d: d.pop("created"), "created", "field 'created' is missing"),
])
def test_a_malformed_field_is_named(tmp_path, change, field, message):
    err = refused(tmp_path, changed(change))
    assert err.field == field and message in str(err) and str(err).endswith(REWRITE)


@pytest.mark.parametrize("text, message", [
    ("[]", "not a kvverify-paths document of version 1 (a JSON array, not an object)"),
    ('"paths"', "not a kvverify-paths document of version 1 (a JSON value, not an object)"),
    (json.dumps({**H200, "version": True}), "(kind \"kvverify-paths\", version true)"),
    (json.dumps({**H200, "version": 1.0}), "(kind \"kvverify-paths\", version 1.0)"),
    (json.dumps({**H200, "kind": "kvverify-bench"}), "(kind \"kvverify-bench\", version 1)"),
    ("", "not JSON (Expecting value (line 1, column 1))"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply for the JSON decoder"),
    ('{"kind": ' + "9" * 5000 + "}", "not JSON (an integer with more than 4300 digits (more than Python converts"),
    (json.dumps(changed(lambda d: d["entries"][0]["best"].update(gbps=float("nan")))),
     "not JSON (NaN is not JSON (a number must be finite) (line 1"),
    (json.dumps(changed(lambda d: d["entries"][0].update(ceiling_gbps=-float("inf")))),
     "not JSON (-Infinity is not JSON (a number must be finite) (line 1"),
    (json.dumps(H200).replace('"page_bytes": 4096', '"page_bytes": 1e999', 1),
     "not JSON (the number 1e999 is beyond a float's range (line 1"),
    ('{"kind": "kvverify-paths", "version": 1, "entries": [], "entries": []}',
     'not JSON (an object repeats the key "entries": which one counts? (line 1'),
])
def test_text_that_is_not_a_paths_document_is_refused(tmp_path, text, message):
    assert message in str(refused(tmp_path, text))


def test_bytes_that_are_not_utf8_are_refused(tmp_path):
    err = refused(tmp_path, None, raw=b'{"kind": "kvverify-paths\xff"}')
    assert "not UTF-8 (byte 24 is 0xff)" in str(err)


def test_a_file_larger_than_any_paths_document_is_refused_unread(tmp_path):
    text = json.dumps(H200)
    big = text[:-1] + ', "padding": "' + "x" * calibration.MAX_BYTES + '"}'
    assert "larger than 16 MiB, so not a paths document" in str(refused(tmp_path, big))


def test_members_the_schema_does_not_name_are_kept(tmp_path):
    path = tmp_path / "paths.json"
    path.write_text(json.dumps({**H200, "note": "a later field"}))
    assert calibration.load(path)["note"] == "a later field"


# -- any JSON where a field was ---------------------------------------------------------------------

SLOTS = [path for path, _ in slots(H200, opaque=frozenset({("platform",)})) if path[:1] != ("entries",) or len(path) == 1 or path[1] < 3]


@PROPERTY
@given(slot=st.sampled_from(SLOTS), value=JSON_VALUES, drop=st.booleans())
def test_any_value_in_any_field_loads_checked_or_is_refused_naming_it(tmp_path, slot, value, drop):
    """Any JSON in any field (or the field gone): ``load`` either refuses with a CalibrationError
    naming the field, or returns a document ``choose`` answers with a safe path and its call."""
    doc = copy.deepcopy(H200)
    parent = doc
    for key in slot[:-1]:
        parent = parent[key]
    if drop and isinstance(parent, dict):
        del parent[slot[-1]]
    else:
        parent[slot[-1]] = value
    path = tmp_path / "paths.json"
    path.write_text(json.dumps(doc))
    try:
        loaded = calibration.load(path)
    except CalibrationError as err:
        assert str(err).startswith(f"{path}: ")
        if err.field is not None:  # the field named is on the way to the change, or repeats its shape
            named = err.field.replace("[", ".").replace("]", "").split(".")
            assert ([str(k) for k in slot[:len(named)]] == named[:len(slot)]
                    or "repeats the shape" in str(err) and f"entries[{slot[1]}]" in str(err)), (slot, str(err))
        return
    for e in loaded["entries"][:4]:
        for direction in ("h2d", "d2h", "both"):
            if any(x["direction"] == direction for x in loaded["entries"]):
                chosen = calibration.choose(loaded, direction, e["page_bytes"], e["pages_per_call"])
                assert chosen["best"]["path"] in calibration.SAFE_PATHS
                assert chosen["best"]["call"] == calibration.CALLS[chosen["best"]["path"]]


@PROPERTY
@given(data=st.binary(max_size=200))
def test_any_short_bytes_are_one_calibration_error(tmp_path, data):
    path = tmp_path / "paths.json"
    path.write_bytes(data)
    with pytest.raises(CalibrationError, match=f"^{path}: "):
        calibration.load(path)


# -- choose -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (("sideways", 4096, 16), "no calibration entry for direction 'sideways': a direction is one of h2d, d2h, both"),
    ((None, 4096, 16), "no calibration entry for direction None: a direction is one of h2d, d2h, both"),
    ((["h2d"], 4096, 16), "no calibration entry for direction ['h2d']"),
    (("h2d", 0, 16), "page_bytes must be a positive integer, got 0"),
    (("h2d", -4096, 16), "page_bytes must be a positive integer, got -4096"),
    (("h2d", 4096.0, 16), "page_bytes must be a positive integer, got 4096.0"),
    (("h2d", "4096", 16), "page_bytes must be a positive integer, got '4096'"),
    (("h2d", True, 16), "page_bytes must be a positive integer, got True"),
    (("h2d", 4096, 0), "pages_per_call must be a positive integer, got 0"),
    (("h2d", 4096, None), "pages_per_call must be a positive integer, got None"),
])
def test_choose_refuses_bad_arguments(args, message):
    with pytest.raises(CalibrationError) as info:
        calibration.choose(H200, *args)
    assert str(info.value) == message or str(info.value).startswith(message)


def test_choose_refuses_what_is_not_a_paths_document_and_a_direction_it_lacks():
    with pytest.raises(CalibrationError, match="^paths is a str that is not a kvverify-paths document: pass what "
                                               "calibration.load returns$"):
        calibration.choose("paths.json", "h2d", 4096, 16)
    only_d2h = {**H200, "entries": [e for e in H200["entries"] if e["direction"] == "d2h"]}
    with pytest.raises(CalibrationError, match=r"^no calibration entry for direction 'h2d'; the document has "
                                               r"\['d2h'\] \(its 'unmeasured' lists"):
        calibration.choose(only_d2h, "h2d", 4096, 16)


@PROPERTY
@given(direction=st.sampled_from(["h2d", "d2h", "both"]), page_bytes=st.integers(1, 2**2000),
       pages_per_call=st.integers(1, 2**2000))
def test_choose_answers_any_positive_shape_with_its_nearest_entry(direction, page_bytes, pages_per_call):
    """The chosen entry is nearest on a log scale (page size first), also for sizes far beyond a
    float (2**2000 bytes: the largest page size)."""
    mine = [e for e in H200["entries"] if e["direction"] == direction]
    chosen = calibration.choose(H200, direction, page_bytes, pages_per_call)
    assert chosen["direction"] == direction and chosen in mine

    def far(e, key, size):
        return abs(math.log2(e[key]) - math.log2(size))

    for e in mine:
        assert far(chosen, "page_bytes", page_bytes) <= far(e, "page_bytes", page_bytes) + 1e-9
        if e["page_bytes"] == chosen["page_bytes"]:
            assert far(chosen, "pages_per_call", pages_per_call) <= far(e, "pages_per_call", pages_per_call) + 1e-9
    if page_bytes >= 2**64:
        assert chosen["page_bytes"] == max(e["page_bytes"] for e in mine)


def test_entries_of_sizes_beyond_a_float_are_chosen_among(tmp_path):
    """A page size no float holds (10**400 bytes) is an integer the schema allows: the distance to it
    is computed exactly, not as a float that overflows."""
    doc = changed(lambda d: d["entries"][0].update(page_bytes=10**400))
    path = tmp_path / "paths.json"
    path.write_text(json.dumps(doc))
    loaded = calibration.load(path)
    assert calibration.choose(loaded, "h2d", 10**399, 16) is loaded["entries"][0]
    assert calibration.choose(loaded, "h2d", 4096, 16)["page_bytes"] == 4096
