"""Cells, the cell-verdict rule, summary and headline, the JSON schema, JUnit and the table."""

from __future__ import annotations

import copy
import dataclasses
import json
import xml.etree.ElementTree as ET

import pytest

# A test dependency (pyproject's `test` extra, installed by ci/cpu.sh); GPU images may lack it,
# and `pytest -m gpu` still collects this module.
jsonschema = pytest.importorskip("jsonschema")
from rich.console import Console

from kvverify.stats import clopper_pearson_upper
from kvverify.stress.render import COLUMNS, render_table, write_junit
from kvverify.stress.report import (
    Cell,
    CellResult,
    CellVerdict,
    Observation,
    Platform,
    StressReport,
    cell_verdict,
    load_schema,
)

WITNESS = (
    "ops 3 (kernel writer) / 5 (copy_batch ANY) RAW: nothing orders the source read after the write"
)


def clean(trials=100, blocks_per_trial=64, page=32768):
    blocks = trials * blocks_per_trial
    return Observation(
        trials=trials,
        corrupted_trials=0,
        blocks_checked=blocks,
        bytes_checked=blocks * page,
        ok=blocks,
        stale=0,
        torn=0,
        garbage=0,
        elapsed_s=2.0,
        window={"writer_spin_ns": 200_000, "reader_ns": 100_000},
    )


def corrupted(trials=100, bad_trials=37):
    blocks = trials * 64
    return Observation(
        trials=trials,
        corrupted_trials=bad_trials,
        blocks_checked=blocks,
        bytes_checked=blocks * 32768,
        ok=blocks - 60,
        stale=40,
        torn=15,
        garbage=5,
        elapsed_s=2.5,
        window={"writer_spin_ns": 200_000},
    )


# Contracts by (scenario, direction) and order, shaped like the catalogue: a fixed store
# is safe only in STREAM order; a fixed load with an untouched host source is safe in
# every order; H3-broken rewrites the source after the call (safe only when read during
# the call); H5-fixed reloads a block whose store is in flight (safe only in stream order).
CONTRACTS = {
    ("H1-fixed", "store"): {"STREAM": "SAFE", "DURING_API_CALL": "RACY", "ANY": "RACY"},
    ("H1-broken", "store"): {"STREAM": "RACY", "DURING_API_CALL": "RACY", "ANY": "RACY"},
    ("H3-fixed", "load"): {"STREAM": "SAFE", "DURING_API_CALL": "SAFE", "ANY": "SAFE"},
    ("H3-broken", "load"): {"STREAM": "RACY", "DURING_API_CALL": "SAFE", "ANY": "RACY"},
    ("H5-fixed", "load"): {"STREAM": "SAFE", "DURING_API_CALL": "RACY", "ANY": "RACY"},
}


def faithful(contract, executor):
    """What a correct harness on a driver that does not reorder would observe."""
    if contract == "SAFE" or executor == "native":
        return clean()
    return corrupted()


def results(observe=faithful, contracts=CONTRACTS, host_memory=("pinned",)):
    out = []
    for (scenario, direction), by_order in contracts.items():
        for order, contract in by_order.items():
            for host in host_memory:
                for executor in ("native", "adversarial"):
                    cell = Cell(scenario, direction, order, host, executor)
                    witness = WITNESS if contract == "RACY" else None
                    out.append(CellResult(cell, contract, witness, observe(contract, executor)))
    return out


def make_report(cells=None, **kwargs):
    kwargs.setdefault(
        "platform",
        Platform(
            "NVIDIA H200", "580.65.06", "13.0", "2.11.0+cu130", ("pinned", "registered", "pageable")
        ),
    )
    return StressReport(
        campaign="smoke", seed=7, cells=tuple(results() if cells is None else cells), **kwargs
    )


def replace_observation(cells, label, observation):
    return [
        dataclasses.replace(r, observation=observation) if r.cell.label == label else r
        for r in cells
    ]


# -- cells and observations ------------------------------------------------------------------


def test_cell_label_and_copy_kind():
    cell = Cell("H1", "store", "ANY", "pinned", "adversarial")
    assert cell.label == "H1 store/D2H/ANY/pinned/adversarial"
    assert Cell("H2", "load", "STREAM", "pageable", "native").copy_kind == "H2D"


@pytest.mark.parametrize(
    "fields",
    [
        ("", "store", "ANY", "pinned", "native"),
        ("H1", "evict", "ANY", "pinned", "native"),
        ("H1", "store", "ANYTIME", "pinned", "native"),
        ("H1", "store", "ANY", "managed", "native"),
        ("H1", "store", "ANY", "pinned", "emulated"),
    ],
)
def test_cell_rejects_unknown_values(fields):
    with pytest.raises(ValueError):
        Cell(*fields)


@pytest.mark.parametrize(
    "change",
    [
        {"trials": 0},
        {"corrupted_trials": 101},
        {"ok": 1},  # states no longer sum to blocks_checked
        {"corrupted_trials": 1},  # a corrupted trial but every block OK
        {"bytes_checked": -1},
        {"elapsed_s": float("nan")},
        {"trials": True},
    ],
)
def test_observation_rejects_inconsistent_counts(change):
    with pytest.raises(ValueError):
        dataclasses.replace(clean(), **change)


def test_observation_derived_values():
    obs = clean(trials=10, blocks_per_trial=4, page=1_000_000)
    assert obs.gb_per_s == pytest.approx(40e6 / 2.0 / 1e9)
    assert obs.counts == {"OK": 40, "STALE": 0, "TORN": 0, "GARBAGE": 0}
    assert not obs.corrupted and corrupted().corrupted
    assert dataclasses.replace(obs, elapsed_s=0.0).gb_per_s is None


# -- the verdict rule ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("contract", "observation", "executor", "verdict"),
    [
        ("RACY", corrupted(), "adversarial", CellVerdict.CONFIRMED_RACE),
        ("RACY", corrupted(), "native", CellVerdict.CONFIRMED_RACE),
        ("RACY", clean(), "native", CellVerdict.NO_RACE_OBSERVED),
        ("RACY", clean(), "adversarial", CellVerdict.SENSITIVITY_FAILURE),
        ("RACY", clean(), "kernel", CellVerdict.NO_RACE_OBSERVED),  # a copy path as a user runs it
        ("RACY", corrupted(), "kernel", CellVerdict.CONFIRMED_RACE),
        ("SAFE", corrupted(), "kernel", CellVerdict.UNEXPECTED_CORRUPTION),
        ("SAFE", clean(), "native", CellVerdict.SAFE_CONFIRMED),
        ("SAFE", clean(), "adversarial", CellVerdict.SAFE_CONFIRMED),
        ("SAFE", corrupted(), "native", CellVerdict.UNEXPECTED_CORRUPTION),
        ("SAFE", corrupted(), "adversarial", CellVerdict.UNEXPECTED_CORRUPTION),
        ("SAFE", None, "native", CellVerdict.NOT_RUN),
        ("RACY", None, "adversarial", CellVerdict.NOT_RUN),
    ],
)
def test_cell_verdict_every_branch(contract, observation, executor, verdict):
    assert cell_verdict(contract, observation, executor) is verdict
    assert verdict.failing == (
        verdict in (CellVerdict.UNEXPECTED_CORRUPTION, CellVerdict.SENSITIVITY_FAILURE)
    )


def test_cell_verdict_rejects_unknown_inputs():
    with pytest.raises(ValueError):
        cell_verdict("MAYBE", None, "native")
    with pytest.raises(ValueError):
        cell_verdict("SAFE", None, "emulated")


def test_cell_result_bound_and_witness():
    cell = Cell("H1", "store", "ANY", "pinned", "native")
    r = CellResult(cell, "RACY", WITNESS, clean(trials=500))
    assert r.verdict is CellVerdict.NO_RACE_OBSERVED
    assert r.rate_upper_bound == pytest.approx(1 - 0.05 ** (1 / 500))
    assert r.rate_upper_bound == clopper_pearson_upper(0, 500)
    assert CellResult(cell, "RACY", WITNESS, corrupted()).rate_upper_bound is None
    assert CellResult(cell, "RACY", WITNESS).rate_upper_bound is None
    with pytest.raises(ValueError, match="witness"):
        CellResult(cell, "RACY", None)
    with pytest.raises(ValueError, match="witness"):
        CellResult(cell, "SAFE", WITNESS)


# -- report: exit status, summary, headline --------------------------------------------------


def test_faithful_run_exits_zero():
    report = make_report()
    verdicts = {r.verdict for r in report.cells}
    assert verdicts == {
        CellVerdict.CONFIRMED_RACE,
        CellVerdict.NO_RACE_OBSERVED,
        CellVerdict.SAFE_CONFIRMED,
    }
    assert report.exit_status() == 0


@pytest.mark.parametrize(
    ("label", "observation", "verdict"),
    [
        ("H3-fixed load/H2D/ANY/pinned/native", corrupted(), CellVerdict.UNEXPECTED_CORRUPTION),
        ("H1-fixed store/D2H/ANY/pinned/adversarial", clean(), CellVerdict.SENSITIVITY_FAILURE),
    ],
)
def test_failing_verdicts_exit_one(label, observation, verdict):
    report = make_report(replace_observation(results(), label, observation))
    assert {r.cell.label: r.verdict for r in report.cells}[label] is verdict
    assert report.exit_status() == 1


def test_summary_names_where_each_order_was_safe():
    summary = make_report().summary()
    assert summary == {
        "STREAM": {
            "store": {"H1-fixed": ["pinned"]},
            "load": {"H3-fixed": ["pinned"], "H5-fixed": ["pinned"]},
        },
        "DURING_API_CALL": {"store": {}, "load": {"H3-broken": ["pinned"], "H3-fixed": ["pinned"]}},
        "ANY": {"store": {}, "load": {"H3-fixed": ["pinned"]}},
    }


def test_summary_lists_host_memory_kinds_separately():
    contracts = {("H3-fixed", "load"): {"ANY": "SAFE"}}
    cells = results(contracts=contracts, host_memory=("pinned", "pageable"))
    # corruption seen with pinned memory only: ANY stays safe for pageable sources
    cells = replace_observation(cells, "H3-fixed load/H2D/ANY/pinned/adversarial", corrupted())
    assert make_report(cells).summary()["ANY"]["load"] == {"H3-fixed": ["pageable"]}


def test_headline_holds_for_the_catalogue():
    h = make_report().headline()
    assert h.holds is True
    assert h.text.startswith("YES")
    assert (h.safe_but_not_quiescent_load, h.quiescent_load_but_not_safe, h.undecided) == (
        (),
        (),
        (),
    )


def test_headline_fails_when_a_quiescent_load_corrupts_under_any():
    label = "H3-fixed load/H2D/ANY/pinned/native"
    h = make_report(replace_observation(results(), label, corrupted())).headline()
    assert h.holds is False
    assert h.quiescent_load_but_not_safe == (label,)
    assert label in h.text and h.text.startswith("NO")


def test_headline_fails_when_any_is_safe_for_a_store():
    # A store after a full device synchronization: every order safe, ANY included.
    contracts = dict(CONTRACTS)
    contracts[("store-after-sync", "store")] = {
        "STREAM": "SAFE",
        "DURING_API_CALL": "SAFE",
        "ANY": "SAFE",
    }
    h = make_report(results(contracts=contracts)).headline()
    assert h.holds is False
    assert h.safe_but_not_quiescent_load == (
        "store-after-sync store/D2H/ANY/pinned/native",
        "store-after-sync store/D2H/ANY/pinned/adversarial",
    )


def test_headline_cannot_tell_without_counterparts_or_any_cells():
    only_any = {("H3-fixed", "load"): {"ANY": "SAFE"}}
    h = make_report(results(contracts=only_any)).headline()
    assert h.holds is None and len(h.undecided) == 2
    no_any = {("H1-fixed", "store"): {"STREAM": "SAFE"}}
    assert make_report(results(contracts=no_any)).headline().holds is None


def test_headline_on_paper_when_nothing_ran():
    """Nothing observed: the contracts' prediction, which the headline never words as a result."""
    h = make_report(results(observe=lambda contract, executor: None)).headline()
    assert h.holds is None and h.text.startswith("on paper only: no cell ran. The contracts predict that ANY")
    assert "YES" not in h.text and "ANY cells are SAFE on paper" in h.text


def test_headline_on_paper_says_when_the_contracts_do_not_predict_the_claim():
    contracts = dict(CONTRACTS)
    contracts[("store-after-sync", "store")] = {"STREAM": "SAFE", "DURING_API_CALL": "SAFE", "ANY": "SAFE"}
    h = make_report(results(contracts=contracts, observe=lambda contract, executor: None)).headline()
    assert h.holds is None and "The contracts do not predict that ANY" in h.text
    assert not h.text.startswith("NO") and "store-after-sync store/D2H/ANY/pinned/native" in h.text
    assert len(h.safe_but_not_quiescent_load) == 2


def test_headline_and_summary_speak_only_of_the_cells_that_ran():
    """A run cut short: contract verdicts of cells that did not run claim nothing."""
    stores_ran = results(observe=faithful)
    stores_ran = [r if r.cell.direction == "store" else dataclasses.replace(r, observation=None) for r in stores_ran]
    report = make_report(stores_ran)
    h = report.headline()
    assert h.holds is True
    assert h.text.endswith("(0 of the 4 ANY cells that ran safe; 6 not run)")
    assert report.summary(ran_only=True)["ANY"] == {"store": {}, "load": {}}
    assert report.summary()["ANY"]["load"] == {"H3-fixed": ["pinned"]}  # the JSON's summary: every cell
    only_stream = [r if r.cell.order == "STREAM" else dataclasses.replace(r, observation=None) for r in results()]
    h = make_report(only_stream).headline()
    assert (h.holds, h.text) == (None, "ANY: no ANY cell ran, nothing to compare")
    assert len(make_report(only_stream).ran()) == 10


def test_report_rejects_duplicates_and_contract_disagreement():
    cells = results()
    with pytest.raises(ValueError, match="twice"):
        make_report(cells + cells[:1])
    first = cells[0]  # H1-fixed store STREAM native: SAFE
    other = CellResult(
        dataclasses.replace(first.cell, executor="adversarial"), "RACY", WITNESS, corrupted()
    )
    with pytest.raises(ValueError, match="disagree"):
        make_report([first, other])


# -- JSON --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator():
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_json_validates_and_round_trips(validator, tmp_path):
    report = make_report(
        layout={
            "model": "llama-3.1-8b",
            "num_layers": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "dtype_bytes": 2,
            "mla_latent_dim": None,
            "kv_split": True,
            "block_size": 16,
            "tp": 1,
            "block_size_factor": 1,
            "kv_heads_per_rank": 8,
            "num_tensors": 64,
            "page_bytes": 32768,
            "block_bytes": 2097152,
            "cpu_block_bytes": 2097152,
        }
    )
    doc = report.to_json()
    validator.validate(doc)
    assert doc["schema_version"] == 2 and doc["headline"]["holds"] is True
    assert doc["platform"]["gpu"] == "NVIDIA H200"
    path = tmp_path / "report.json"
    report.write_json(path)
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(doc))
    assert StressReport.from_json(loaded) == report


def test_json_from_a_real_layout_validates(validator):
    from kvverify.geometry import PRESETS, KVLayout

    for name in PRESETS:
        doc = make_report(layout=KVLayout(PRESETS[name], tp=1).describe()).to_json()
        validator.validate(doc)


def test_no_gpu_report_validates(validator):
    report = make_report(
        results(observe=lambda contract, executor: None),
        platform=Platform(torch="2.11.0+cpu"),
        not_run_reason="no CUDA device",
    )
    doc = report.to_json()
    validator.validate(doc)
    assert {c["verdict"] for c in doc["cells"]} == {"NOT_RUN"}
    assert all(c["observed"] is None and c["rate_upper_bound"] is None for c in doc["cells"])
    assert doc["exit_status"] == 0 and doc["platform"]["gpu"] is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("platform"),
        lambda d: d.pop("schema_version"),
        lambda d: d["platform"].pop("driver"),
        lambda d: d["cells"][0].pop("verdict"),
        lambda d: d["cells"][0]["observed"].pop("trials"),
        lambda d: d["cells"][0]["observed"]["counts"].pop("TORN"),
        lambda d: d.__setitem__("schema_version", 1),
        lambda d: d["cells"][0].__setitem__("verdict", "PROBABLY_FINE"),
        lambda d: d["cells"][0].__setitem__("copy_kind", "H2D"),  # a store is D2H
        lambda d: d["cells"][0].__setitem__("observed", None),  # not run, yet a verdict
        lambda d: d.__setitem__("surprise", 1),
    ],
)
def test_broken_documents_fail_validation(validator, mutate):
    doc = copy.deepcopy(make_report().to_json())
    mutate(doc)
    assert not validator.is_valid(doc)


def test_from_json_rejects_other_versions():
    doc = make_report().to_json() | {"schema_version": 3}
    with pytest.raises(ValueError, match="schema_version"):
        StressReport.from_json(doc)


def test_from_json_reads_a_version_1_report():
    """The H200's smoke report of version 1 (before per-GPU rows): its cells, verdicts and
    headline come back as they were written."""
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "tests" / "data" / "stress-smoke-h200.json").read_text())
    assert doc["schema_version"] == 1
    report = StressReport.from_json(doc)
    assert [r.verdict.value for r in report.cells] == [c["verdict"] for c in doc["cells"]]
    assert report.headline().text == doc["headline"]["text"] and report.gpus == ()


# -- JUnit --------------------------------------------------------------------------------------


def test_junit_one_testcase_per_cell(tmp_path):
    label = "H3-fixed load/H2D/ANY/pinned/native"
    cells = replace_observation(results(), label, corrupted())
    cells = replace_observation(cells, "H1-fixed store/D2H/ANY/pinned/adversarial", clean())
    cells = replace_observation(cells, "H5-fixed load/H2D/ANY/pinned/native", None)
    report = make_report(cells)
    path = tmp_path / "junit.xml"
    write_junit(report, path)

    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [r.cell.label for r in report.cells]
    by_name = {c.get("name"): c for c in cases}
    failing = {n for n, c in by_name.items() if c.find("failure") is not None}
    skipped = {n for n, c in by_name.items() if c.find("skipped") is not None}
    assert failing == {label, "H1-fixed store/D2H/ANY/pinned/adversarial"}
    assert skipped == {"H5-fixed load/H2D/ANY/pinned/native"}
    assert by_name[label].find("failure").get("type") == "UNEXPECTED_CORRUPTION"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == (
        str(len(cases)),
        "2",
        "1",
    )

    props = {p.get("name"): p.get("value") for p in by_name[label].iter("property")}
    assert props["verdict"] == "UNEXPECTED_CORRUPTION"
    assert (props["STALE"], props["TORN"], props["GARBAGE"]) == ("40", "15", "5")
    clean_case = by_name["H3-fixed load/H2D/STREAM/pinned/native"]
    clean_props = {p.get("name"): p.get("value") for p in clean_case.iter("property")}
    assert float(clean_props["rate_upper_bound"]) == pytest.approx(1 - 0.05 ** (1 / 100), rel=1e-5)
    assert clean_case.get("time") == "2.000"


# -- terminal table -------------------------------------------------------------------------------


def render(report, width=260):
    console = Console(record=True, width=width, color_system=None)
    render_table(report, console)
    return console.export_text()


def test_table_has_every_column_and_cell():
    text = render(make_report())
    for column in COLUMNS:
        assert column in text
    for r in make_report().cells:
        assert r.cell.label in text
    assert "RACY [1]" in text and f"[1] {WITNESS}" in text
    assert "w1: writer_spin_ns=200000 reader_ns=100000" in text and "200.0 MiB" in text  # each window once
    assert "ANY safe in store: nowhere; load: H3-fixed [pinned]" in text
    assert "Headline: YES" in text


def test_no_gpu_table_marks_observed_columns_not_run():
    report = make_report(
        results(observe=lambda contract, executor: None),
        platform=Platform(),
        not_run_reason="no CUDA device",
    )
    text = render(report)
    lines = text.splitlines()
    label = "H1-fixed store/D2H/ANY/pinned/native"
    row = next(line for line in lines if label in line)
    # nothing was observed anywhere: the table has no observed columns, only the contract and the verdict
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert len(cells) == 3 and cells[0] == label and cells[1].startswith("RACY") and cells[2] == "NOT_RUN"
    header = next(line for line in lines if "Cell" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["Cell", "Contract", "Verdict"]
    assert sum("Observed columns not run: no CUDA device" in line for line in lines) == 1
    assert report.exit_status() == 0


def test_a_cell_not_run_beside_cells_that_ran_keeps_the_observed_columns_empty():
    ran = results()
    report = make_report([ran[0], dataclasses.replace(ran[1], observation=None)])
    row = next(line for line in render(report).splitlines() if ran[1].cell.label in line)
    assert "not run" in row and "NOT_RUN" in row
    assert row.count(" - ") == len(COLUMNS) - 4  # the other observed columns are empty


# -- several GPUs, memory, rounds (schema version 2) ----------------------------------------------

from kvverify.stress.memory import Sample, trend  # noqa: E402
from kvverify.stress.report import (  # noqa: E402
    EXIT_FAILED,
    EXIT_MEMORY_GREW,
    EXIT_OK,
    Execution,
    Gpu,
    joined_verdict,
    worst_exit_status,
)

H200 = Platform("NVIDIA H200", "580.65.06", "13.0", "2.11.0+cu130")


def two_gpus(observe1=faithful, memory=(None, None), reasons=(None, None)):
    """The catalogue-shaped cells run on GPUs 0 and 1: GPU 0 observes ``faithful``, GPU 1 ``observe1``."""
    cells = []
    for r in results():
        o1 = observe1(r.contract, r.cell.executor)
        cells.append(CellResult.on_gpus(r.cell, r.contract, r.witness, [(0, r.observation), (1, o1)]))
    gpus = tuple(Gpu(k, "node7", k, H200, reasons[k], memory[k]) for k in (0, 1))
    return make_report(cells, gpus=gpus, execution=Execution(rounds_planned=2, rounds_run=2, trials_planned=9,
                                                             trials_run=9))


def test_joined_verdict_prefers_failures_then_races():
    V = CellVerdict
    assert joined_verdict([V.CONFIRMED_RACE, V.SENSITIVITY_FAILURE]) is V.SENSITIVITY_FAILURE
    assert joined_verdict([V.NO_RACE_OBSERVED, V.CONFIRMED_RACE]) is V.CONFIRMED_RACE
    assert joined_verdict([V.SAFE_CONFIRMED, V.UNEXPECTED_CORRUPTION]) is V.UNEXPECTED_CORRUPTION
    assert joined_verdict([V.NOT_RUN, V.SAFE_CONFIRMED]) is V.SAFE_CONFIRMED
    assert joined_verdict([V.NOT_RUN]) is joined_verdict([]) is V.NOT_RUN


def test_combined_observation_sums_counts_and_takes_the_longest_time():
    a, b = clean(trials=10), corrupted(trials=20, bad_trials=3)
    both = Observation.combined([a, None, b])
    assert (both.trials, both.corrupted_trials) == (30, 3)
    assert both.blocks_checked == a.blocks_checked + b.blocks_checked and both.stale == 40
    assert both.elapsed_s == 2.5 and both.window == a.window
    assert Observation.combined([None]) is None and Observation.combined([a]) is a


def test_a_race_missed_on_one_gpu_fails_the_cell_though_another_gpu_caught_it():
    report = two_gpus(observe1=lambda contract, executor: clean())  # GPU 1's adversarial executor sees nothing
    r = next(r for r in report.cells if r.cell.label == "H1-broken store/D2H/ANY/pinned/adversarial")
    assert cell_verdict(r.contract, r.observation, "adversarial") is CellVerdict.CONFIRMED_RACE  # summed
    assert r.verdict is CellVerdict.SENSITIVITY_FAILURE
    assert dict(r.gpu_verdicts) == {0: CellVerdict.CONFIRMED_RACE, 1: CellVerdict.SENSITIVITY_FAILURE}
    assert report.exit_status() == EXIT_FAILED


def test_two_faithful_gpus_pass_with_one_headline():
    report = two_gpus()
    assert report.exit_status() == EXIT_OK and report.headline().holds is True
    r = report.cells[0]
    assert r.observation.trials == 200 and len(r.per_gpu) == 2


def test_unrun_cells_fail_only_where_a_gpu_ran():
    missing = replace_observation(results(), "H3-fixed load/H2D/ANY/pinned/native", None)
    assert make_report(missing).exit_status() == EXIT_FAILED  # a GPU was there (no not_run_reason)
    cells = [CellResult.on_gpus(r.cell, r.contract, r.witness, [(0, r.observation), (1, None)]) for r in results()]
    gpus = (Gpu(0, "a", 0, H200), Gpu(1, "a", None, Platform(), "LOCAL_RANK 1 has no CUDA device of its own"))
    assert make_report(cells, gpus=gpus).exit_status() == EXIT_OK  # GPU 1 ran nothing at all: said in its row
    gpus = (Gpu(0, "a", 0, H200), Gpu(1, "a", 1, H200))
    assert len(make_report(cells, gpus=gpus).unrun_cells()) == len(cells)  # GPU 1 ran, yet not these
    errored = [dataclasses.replace(missing[0], error="GPU 1: HarnessError: stuck")] + missing[1:]
    assert make_report(errored).exit_status() == EXIT_FAILED


def _trend(growth):
    samples = [Sample(60.0 * k, int(2**30 * (1 + growth * k)), 2**31, k, True) for k in range(4)]
    return trend(samples)


def test_memory_growth_on_any_gpu_gives_exit_status_3_unless_a_cell_failed():
    assert two_gpus(memory=(_trend(0.0), _trend(0.0))).exit_status() == EXIT_OK
    grew = two_gpus(memory=(_trend(0.0), _trend(0.02)))
    assert grew.memory_growing() is True and grew.exit_status() == EXIT_MEMORY_GREW
    failed = two_gpus(observe1=lambda contract, executor: clean(), memory=(_trend(0.02), None))
    assert failed.exit_status() == EXIT_FAILED  # a failing cell says more than a leak
    assert two_gpus().memory_growing() is None
    assert worst_exit_status([0, 3, 1]) == 1 and worst_exit_status([0, 3]) == 3 and worst_exit_status([2, 1]) == 2


def test_two_gpu_json_validates_and_round_trips(validator):
    report = two_gpus(observe1=lambda contract, executor: clean(), memory=(_trend(0.0), _trend(0.02)))
    doc = report.to_json()
    validator.validate(doc)
    assert [g["rank"] for g in doc["gpus"]] == [0, 1] and doc["gpus"][1]["memory"]["growing"] is True
    cell = next(c for c in doc["cells"] if c["label"] == "H1-broken store/D2H/ANY/pinned/adversarial")
    assert [(p["gpu"], p["verdict"]) for p in cell["per_gpu"]] == [(0, "CONFIRMED_RACE"), (1, "SENSITIVITY_FAILURE")]
    assert cell["verdict"] == "SENSITIVITY_FAILURE" and doc["exit_status"] == 1
    assert doc["execution"]["rounds_planned"] == 2
    assert StressReport.from_json(json.loads(json.dumps(doc))) == report


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["gpus"][0].pop("memory"),
        lambda d: d["cells"][0]["per_gpu"][0].__setitem__("observed", None),  # not run, yet a verdict
        lambda d: d.__setitem__("exit_status", 2),  # a report is never written by a run that could not start
        lambda d: d["execution"].pop("stopped"),
        lambda d: d["gpus"][0]["memory"]["series"].append([1.0, 2]),
    ],
)
def test_broken_v2_documents_fail_validation(validator, mutate):
    doc = copy.deepcopy(two_gpus(memory=(_trend(0.0), None)).to_json())
    mutate(doc)
    assert not validator.is_valid(doc)


def test_version_1_schema_stays_for_old_reports():
    v1 = load_schema(1)
    assert v1["properties"]["schema_version"] == {"const": 1}
    assert load_schema()["properties"]["schema_version"] == {"const": 2}


def test_cells_must_name_gpus_that_have_rows():
    cells = [CellResult.on_gpus(r.cell, r.contract, r.witness, [(3, r.observation)]) for r in results()]
    with pytest.raises(ValueError, match="no row"):
        make_report(cells, gpus=(Gpu(0, "a", 0, H200),))
    with pytest.raises(ValueError, match="combination"):
        CellResult(results()[0].cell, "SAFE", None, clean(), ((0, clean(trials=3)),))


def test_gpu_section_names_each_gpu_its_memory_and_disagreements():
    from kvverify.stress.render import render_gpus

    report = two_gpus(observe1=lambda contract, executor: clean(), memory=(_trend(0.0), _trend(0.02)))
    console = Console(record=True, width=400, color_system=None)
    render_gpus(report, console)
    text = console.export_text()
    assert "GPU 0 (node7, cuda:0): NVIDIA H200, driver 580.65.06, CUDA 13.0" in text
    assert "flat within 1%" in text and "GREW beyond 1%" in text and "+6.00%" in text
    assert "GPUs disagree on 9 cell(s): H1-fixed store/D2H/DURING_API_CALL/pinned/adversarial (GPU 0 CONFIRMED_RACE, " \
           "GPU 1 SENSITIVITY_FAILURE)" in text
    assert "Rounds: 2 of 2; trials: 9 of 9 planned" in text
