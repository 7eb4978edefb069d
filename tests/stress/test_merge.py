"""``kvverify merge``: reports from several platforms in one document, on reports made here (the
stand-in device, two platforms) and on the H200's own smoke and probe reports (docs/). Reports
that are malformed, or hold any JSON in any field: ``test_merge_input.py``."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import fake_device as stand_in
import pytest
from help_screen import check_screen, help_lines

from kvverify import cli
from kvverify.stress import merge
from kvverify.stress.report import Platform

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H200_SMOKE = os.path.join(ROOT, "tests", "data", "stress-smoke-h200.json")  # schema version 1
H200_PROBE = os.path.join(ROOT, "tests", "data", "probe-h200.json")
CAMPAIGN = ('trials = 3\nmax_trials = 3\nmin_checked = "1KiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
            'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["P2", "H7-broken"]\nwriter_delay_us = 0\n'
            'reader_us = 0\n')
CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 32,
          "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def stand_in_reports(tmp_path_factory):
    """Two stress reports made here on the stand-in device, as if on two platforms."""
    tmp = tmp_path_factory.mktemp("merge")
    (tmp / "c.toml").write_text(CAMPAIGN)
    (tmp / "config.json").write_text(json.dumps(CONFIG))
    from kvverify.stress import cli as stress_cli

    paths = []
    for name, platform in (("a", Platform(gpu="stand-in A", driver="1.0", cuda="13.0")),
                           ("b", Platform(gpu="stand-in B", driver="2.0", cuda="13.0"))):
        mp = pytest.MonkeyPatch()
        try:
            stand_in.install_for_stress(mp)
            mp.setattr(stress_cli, "_platform", lambda gpu, platform=platform: platform)
            out = tmp / f"{name}.json"
            status = cli.main(["stress", "--campaign", str(tmp / "c.toml"), "--model-config", str(tmp / "config.json"),
                               "--json", str(out), "--no-nvtx"])
            assert status == 0
        finally:
            mp.undo()
        paths.append(str(out))
    return paths


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = merge.load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _merged(paths):
    return merge.merge([merge.read(p) for p in paths], paths)


def test_platforms_side_by_side_with_what_their_probes_read_early(stand_in_reports, validator):
    paths = [H200_SMOKE, H200_PROBE, *stand_in_reports]
    doc = _merged(paths)
    validator.validate(doc)
    assert doc["exit_status"] == 0 and doc["conflicts"] == [] and doc["failing"] == []
    h200, a, b = doc["platforms"]
    assert (h200["gpu"], h200["driver"], h200["cuda"], h200["sources"]) == ("NVIDIA H200", "580.159.04", "13.0", [0, 1])
    assert h200["reads_early"] == [
        {"direction": "h2d", "host_memory": "pageable", "order": "STREAM"},
        {"direction": "h2d", "host_memory": "pageable", "order": "DURING_API_CALL"},
        {"direction": "h2d", "host_memory": "pinned", "order": "DURING_API_CALL"},
        {"direction": "h2d", "host_memory": "registered", "order": "DURING_API_CALL"},
        {"direction": "h2d", "host_memory": "pageable", "order": "ANY"},
    ]
    assert h200["probe_undecided"] == [] and a["reads_early"] is None  # no probe of the stand-in
    assert (a["gpu"], a["gpus"], b["gpu"]) == ("stand-in A", 1, "stand-in B")
    cells = {c["label"]: c for c in doc["cells"]}
    assert len(cells) == 324  # the smoke's cells; the stand-in's are among them
    label = "H7-broken store/D2H/ANY/pageable/adversarial"
    assert cells[label]["verdicts"] == {"P1": "CONFIRMED_RACE", "P2": "CONFIRMED_RACE", "P3": "CONFIRMED_RACE"}
    native = cells["H7-broken store/D2H/ANY/pageable/native"]["verdicts"]
    assert native["P2"] == native["P3"] == "NO_RACE_OBSERVED"  # the serial stand-in never reorders
    assert set(cells["H1-fixed store/D2H/ANY/pinned/native"]["verdicts"]) == {"P1"}  # only the H200 ran it


def test_conflicting_contracts_are_flagged_with_the_versions(stand_in_reports, tmp_path, validator):
    old = merge.read(stand_in_reports[1])
    old["platform"]["kvverify"] = "0.0.9"
    flipped = 0
    for c in old["cells"]:
        if c["scenario"] == "P2" and c["order"] == "ANY":
            c["contract"] = {"verdict": "RACY", "witness": "an older checker's race"}
            flipped += 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    doc = _merged([stand_in_reports[0], str(path)])
    validator.validate(doc)
    assert doc["exit_status"] == 1 and flipped == 2
    assert sorted(c["label"] for c in doc["conflicts"]) == ["P2 load/H2D/ANY/pageable/adversarial",
                                                            "P2 load/H2D/ANY/pageable/native"]
    assert {(k["kvverify"], k["verdict"]) for k in doc["conflicts"][0]["contracts"]} == {("0.1.0", "SAFE"),
                                                                                       ("0.0.9", "RACY")}
    assert {c["label"]: c["contract"] for c in doc["cells"]}["P2 load/H2D/ANY/pageable/native"] == "CONFLICT"


def test_a_failure_on_one_platform_fails_the_merge(stand_in_reports):
    docs = [merge.read(p) for p in stand_in_reports]
    bad = copy.deepcopy(docs[1])
    cell = next(c for c in bad["cells"] if c["label"] == "P2 load/H2D/STREAM/pageable/native")
    cell["per_gpu"][0]["verdict"] = "UNEXPECTED_CORRUPTION"
    doc = merge.merge([docs[0], bad], stand_in_reports)
    assert doc["failing"] == ["P2 load/H2D/STREAM/pageable/native"] and doc["exit_status"] == 1
    verdicts = {c["label"]: c["verdicts"] for c in doc["cells"]}["P2 load/H2D/STREAM/pageable/native"]
    assert verdicts == {"P1": "SAFE_CONFIRMED", "P2": "UNEXPECTED_CORRUPTION"}


def test_command_prints_both_tables_and_writes_json(stand_in_reports, tmp_path, capsys, validator, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a row per line
    out = tmp_path / "merged.json"
    status = cli.main(["merge", H200_PROBE, *stand_in_reports, "--json", str(out)])
    printed, err = capsys.readouterr()
    assert status == 0
    assert err == f"kvverify merge: merged report written to {out}\n"  # where the file went
    assert "kvverify merge: platforms" in printed and "kvverify merge: cells per verdict" in printed
    assert "DURING_API_CALL: h2d pageable, h2d pinned, h2d registered" in printed
    assert "no probe report" in printed
    assert "Platforms disagree on 0 of 18 cells. --details lists every cell." in printed
    assert "/native" not in printed  # no cell needs a reader's eye: none is listed
    validator.validate(json.loads(out.read_text()))
    assert cli.main(["merge", H200_PROBE, *stand_in_reports, "--details"]) == 0
    printed = capsys.readouterr().out
    assert "kvverify merge: verdicts per platform" in printed and printed.count("/native") == 9


def test_by_default_only_the_cells_that_need_a_reader_s_eye_are_listed(stand_in_reports, tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a row per line
    docs = [merge.read(p) for p in stand_in_reports]
    bad = copy.deepcopy(docs[1])
    cell = next(c for c in bad["cells"] if c["label"] == "P2 load/H2D/STREAM/pageable/native")
    cell["per_gpu"][0]["verdict"] = "UNEXPECTED_CORRUPTION"
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bad))
    assert cli.main(["merge", stand_in_reports[0], str(path)]) == 1
    printed = capsys.readouterr().out
    listed = [line for line in printed.splitlines() if line.startswith("│") and ("/native" in line or "/adversarial" in line)]
    assert len(listed) == 1 and "P2 load/H2D/STREAM/pageable/native" in listed[0], printed
    assert "SAFE_CONFIRMED" in listed[0] and "UNEXPECTED_CORRUPTION" in listed[0]
    assert "Platforms disagree on 1 of 18 cells." in printed


@pytest.mark.parametrize("content, message", [
    (None, "cannot be read"),
    ("{not json", "not JSON"),
    (json.dumps({"schema_version": 7, "cells": []}), "neither a stress report (schema_version 1 or 2"),
    (json.dumps({"schema_version": 2, "cells": [{"label": "x"}]}), "missing field 'platform.kvverify'"),
])
def test_unreadable_reports_exit_2_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["merge", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvverify merge: {path}: ") and message in err


@pytest.mark.parametrize("change, message", [
    (lambda d: d["cells"][0].update(label=123), "a cell: field 'label' is 123, not a string"),
    (lambda d: d.update(cells={}), "field 'cells' is {}, not an array"),
    (lambda d: d["cells"].__setitem__(0, "H1"), 'a cell is "H1", not an object'),
    (lambda d: d["cells"][0]["per_gpu"][0].update(gpu=True), "per_gpu: field 'gpu' is true, not an integer"),
    (lambda d: d["gpus"][0].update(platform=None), "gpus: field 'platform' is null, not an object"),
    (lambda d: d["gpus"][0]["platform"].update(gpu=["H200"]), "gpus: platform: field 'gpu' is [\"H200\"], not a string"),
    (lambda d: d["gpus"][0].update(host=7), "gpus: field 'host' is 7, not a string"),
    (lambda d: d["cells"][0].update(per_gpu=True), "field 'per_gpu' is true, not an array"),
    (lambda d: d["platform"].update(driver=True), "platform: field 'driver' is true, not a string"),
])
def test_a_badly_typed_field_exits_2_naming_the_file_and_field(stand_in_reports, tmp_path, capsys, change, message):
    doc = merge.read(stand_in_reports[0])
    change(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert cli.main(["merge", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvverify merge: {path}: ") and message in err and "Traceback" not in err


def test_the_same_report_given_twice_is_refused(stand_in_reports, tmp_path, capsys):
    twin = tmp_path / "copy.json"
    twin.write_text(Path(stand_in_reports[0]).read_text())
    assert cli.main(["merge", stand_in_reports[0], str(twin)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"kvverify merge: {twin}: the same report as {stand_in_reports[0]} (given twice?): its GPUs "
                           "and verdicts would count twice")


def test_help_fits_a_screen_in_plain_text_and_ends_with_an_example():
    (example,) = check_screen(help_lines("merge"))
    assert example.startswith("kvverify merge ")


def test_a_report_where_nothing_ran_is_refused_naming_why(tmp_path, capsys):
    contract_only = tmp_path / "nogpu.json"
    assert cli.main(["stress", "--no-gpu", "--scenarios", "H1", "--json", str(contract_only)]) == 0
    capsys.readouterr()
    assert cli.main(["merge", str(contract_only), H200_PROBE]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"kvverify merge: {contract_only}: nothing ran on a device there (--no-gpu was given): a "
                           "report of contract verdicts only has no platform to compare; leave it out")


def test_at_80_columns_every_report_path_stays_on_one_line(stand_in_reports, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    deep = tmp_path / "reports from the second host" / "a folder name long enough to pass the terminal's edge"
    deep.mkdir(parents=True)
    far = deep / "b.json"
    far.write_text(Path(stand_in_reports[1]).read_text())
    paths = [H200_PROBE, stand_in_reports[0], str(far)]
    assert cli.main(["merge", *paths]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(str(far)) > 80
    for number, path in enumerate(paths, 1):
        assert f"[{number}] {path}" in lines, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines if not line.startswith("[")), "\n".join(lines)
    assert all(line == line.rstrip() for line in lines), "\n".join(lines)
    assert "P1 read early (probe): STREAM: h2d pageable;" in "\n".join(lines)
