"""What ``kvverify merge`` makes of any report it is given, whoever wrote it (a careless producer, any
JSON in any field, any bytes): a report it cannot merge exits 2 with one line on stderr naming the
file and what is wrong, never a traceback; a report it merges gives a document that follows
merged-report-v1.json, and its tables print the report's text as text. The H200's own smoke and
probe reports (docs/), cut to a few cells, are the well-formed start."""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_strategies import JSON_VALUES, slots

from kvverify import cli
from kvverify.stress import merge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROPERTY = settings(max_examples=200, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _cut(name: str, cells: int) -> dict:
    with open(os.path.join(ROOT, "tests", "data", name), encoding="utf-8") as f:
        doc = json.load(f)
    doc["cells"] = doc["cells"][:cells]
    return doc


SMOKE = _cut("stress-smoke-h200.json", 4)   # schema version 1: no gpus, a verdict per cell
PROBE = _cut("probe-h200.json", 4)
V2 = {**copy.deepcopy(SMOKE), "schema_version": 2,  # two GPUs on two hosts, a verdict per GPU
      "gpus": [{"rank": r, "host": f"host-{r}", "platform": SMOKE["platform"]} for r in (0, 1)]}
for _c in V2["cells"]:
    _c["per_gpu"] = [{"gpu": r, "observed": None, "verdict": _c["verdict"]} for r in (0, 1)]
REPORTS = {"smoke": SMOKE, "probe": PROBE, "v2": V2}


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(merge.load_schema())


def merged(tmp_path, capsys, *contents, raw: bytes | None = None) -> tuple[int, str, str]:
    """``kvverify merge --json -`` of the reports ``contents`` (documents, or text): the status, the
    merged JSON and stderr. ``raw``: the bytes of one report instead."""
    paths = []
    for k, content in enumerate(contents or [None]):
        path = tmp_path / f"r{k}.json"
        if raw is not None:
            path.write_bytes(raw)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        paths.append(str(path))
    capsys.readouterr()
    status = cli.main(["merge", *paths, "--json", "-"])
    out, err = capsys.readouterr()
    return status, out, err


def refused(tmp_path, capsys, *contents, raw: bytes | None = None) -> str:
    """The one line ``kvverify merge`` prints for the reports, the last of which is refused; it
    starts with the file's name."""
    status, out, err = merged(tmp_path, capsys, *contents, raw=raw)
    assert status == 2 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvverify merge: {tmp_path / f'r{max(len(contents), 1) - 1}.json'}: ")
    return lines[0]


def test_the_starting_reports_merge(tmp_path, capsys, validator):
    status, out, err = merged(tmp_path, capsys, SMOKE, PROBE, V2)
    doc = json.loads(out)
    validator.validate(doc)
    assert status == 0 and "Traceback" not in err and len(doc["sources"]) == 3 and [p["gpus"] for p in doc["platforms"]] == [3]
    assert doc["platforms"][0]["hosts"] == ["host-0", "host-1"]


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply for the JSON decoder"),
    ('{"schema_version": ' + "9" * 5000 + "}", "not JSON (an integer with more than 4300 digits (more than Python converts"),
    (json.dumps({**SMOKE, "created": float("nan")}), "not JSON (NaN is not JSON (a number must be finite) (line 1"),
    (json.dumps({**SMOKE, "seed": float("inf")}), "not JSON (Infinity is not JSON (a number must be finite) (line 1"),
    (json.dumps(SMOKE).replace('"schema_version": 1', '"schema_version": 1e999'),
     "not JSON (the number 1e999 is beyond a float's range (line 1"),
    (json.dumps({**SMOKE, "schema_version": True}), "neither a stress report (schema_version 1 or 2"),
    (json.dumps({**SMOKE, "schema_version": 1.0}), "neither a stress report (schema_version 1 or 2"),
    ("[]", "neither a stress report"),
], ids=["deep", "long-int", "nan", "infinity", "1e999", "version-true", "version-float", "array"])
def test_text_that_is_not_a_report_exits_2_in_one_line(tmp_path, capsys, text, message):
    assert message in refused(tmp_path, capsys, text)


def test_bytes_that_are_not_utf8_exit_2_in_one_line(tmp_path, capsys):
    assert refused(tmp_path, capsys, raw=b'{"kind": "kvverify-probe\xff"}').endswith("not UTF-8 (byte 24 is 0xff)")


def _v2(change):
    doc = copy.deepcopy(V2)
    change(doc)
    return doc


@pytest.mark.parametrize("doc, message", [
    (_v2(lambda d: d["gpus"].append({**d["gpus"][0], "platform": {"gpu": "B"}})),
     "gpus: rank 0 appears twice: which row is that GPU's?"),
    (_v2(lambda d: d["cells"][1]["per_gpu"][1].update(gpu=7)), "per_gpu: gpu 7 is not a rank of gpus (0, 1)"),
    ({**PROBE, "platform": {**PROBE["platform"], "gpu_name": ["H200"]}},
     "platform: field 'gpu_name' is [\"H200\"], not a string"),
    ({**SMOKE, "created": 20261201}, "field 'created' is 20261201, not a string"),
    ({**SMOKE, "campaign": {"name": "smoke"}}, "field 'campaign' is {\"name\": \"smoke\"}, not a string"),
    ({**PROBE, "version": "1"}, "field 'version' is \"1\", not an integer"),
])
def test_a_field_the_merged_document_cannot_hold_exits_2_naming_it(tmp_path, capsys, doc, message):
    assert refused(tmp_path, capsys, doc).endswith(message)


def test_a_cell_without_per_gpu_in_a_report_with_gpus_counts_for_the_report_s_platform(tmp_path, capsys, validator):
    """The GPUs' rows name another platform than the report's: the cell's verdict goes to the
    report's platform (it used to raise a KeyError)."""
    doc = _v2(lambda d: [d["gpus"][0].update(platform={"gpu": "B", "driver": None, "cuda": None}),
                         d["gpus"][1].update(platform={"gpu": "B", "driver": None, "cuda": None}),
                         d["cells"][0].update(per_gpu=None)])
    status, out, err = merged(tmp_path, capsys, doc)
    result = json.loads(out)
    validator.validate(result)
    assert status == 0 and "Traceback" not in err
    assert [(p["gpu"], p["gpus"]) for p in result["platforms"]] == [("B", 2), ("NVIDIA H200", 0)]
    assert result["cells"][0]["verdicts"] == {"P2": SMOKE["cells"][0]["verdict"]}


@pytest.mark.parametrize("where", ["label", "device", "host", "order"])
def test_a_report_s_text_is_printed_as_text_not_rich_markup(tmp_path, capsys, monkeypatch, where):
    """``[/]`` in a label, a GPU's name, a host or a probe's order used to end the tables in a
    rich MarkupError traceback."""
    doc = copy.deepcopy(PROBE if where == "order" else V2)
    if where == "label":
        doc["cells"][0]["label"] = "[/bold]H1 [red]x"
    elif where == "device":
        for g in doc["gpus"]:
            g["platform"]["gpu"] = "[/]H200"
    elif where == "host":
        doc["gpus"][0]["host"] = "[/]"
    else:
        doc["cells"][0].update(order="[/]ANY", source_read={"value": "call"})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "200")  # the text read whole: rich folds table cells to COLUMNS
    assert cli.main(["merge", str(path), "--details"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and {"label": "[/bold]H1 [red]x", "device": "[/]H200", "host": "[/]", "order": "[/]ANY"}[where] in out


# -- any JSON where a field was ---------------------------------------------------------------------

SLOTS = [(name, path) for name, doc in REPORTS.items() for path, _ in slots(doc)
         if "trials" not in path and "observed" not in path[3:]]   # per-trial detail merge never reads


@PROPERTY
@given(slot=st.sampled_from(SLOTS), value=JSON_VALUES, drop=st.booleans())
def test_any_value_in_any_field_merges_to_a_valid_document_or_exits_2_in_one_line(tmp_path, capsys, validator,
                                                                                   slot, value, drop):
    name, at = slot
    doc = copy.deepcopy(REPORTS[name])
    parent = doc
    for key in at[:-1]:
        parent = parent[key]
    if drop and isinstance(parent, dict):
        del parent[at[-1]]
    else:
        parent[at[-1]] = value
    status, out, err = merged(tmp_path, capsys, doc)
    if status == 2:
        assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"kvverify merge: {tmp_path / 'r0.json'}: ")
    else:
        assert status in (0, 1) and "Traceback" not in err and "kvverify merge: platforms" in err
        validator.validate(json.loads(out))


@PROPERTY
@given(data=st.binary(max_size=200))
def test_any_short_bytes_exit_2_in_one_line(tmp_path, capsys, data):
    refused(tmp_path, capsys, raw=data)
