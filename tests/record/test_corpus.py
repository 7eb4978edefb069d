"""The race corpus on any host (no GPU): the registry and its case modules, read without running
them; the runner's judgement, the table and the JSON from synthetic results; ``kvverify corpus``'s
listing, refusals and help. ``test_corpus_gpu.py`` runs the cases on a device."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from help_screen import check_screen, help_lines

from kvverify.cli import main
from kvverify.record import corpus
from kvverify.record.corpus import (
    CASES,
    FORMS,
    HAZARDS,
    Case,
    Witness,
    find,
    report,
    runner,
)
from kvverify.record.corpus.case import DEMO_SOURCE, PUBLIC_SOURCE, PUBLIC_URL
from kvverify.record.corpus.results import (
    CorpusRun,
    FormResult,
    RacingPair,
    Recorded,
    Sanitized,
    shortfalls,
)
from kvverify.record.corpus.support import (
    PAGE_BYTES,
    Worker,
    is_fixed,
    swap_args,
    witness,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ["vllm-31341", "vllm-39306", "vllm-50696", "vllm-47282", "vllm-45704", "vllm-45268", "vllm-51667",
         "sglang-20611", "sglang-36738", "sglang-18746", "sglang-28468", "pytorch-130785", "torchrec-4231",
         "demo-descriptor-rewrite", "demo-polled-query"]
HEAVY = ("torch", "numpy", "scipy", "rich", "matplotlib")


def tree_of(case: Case) -> ast.Module:
    path = Path(importlib.util.find_spec(case.module).origin)
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def top_functions(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


# -- the registry and its modules ---------------------------------------------------------------------


def test_the_registry_holds_every_case_once_in_the_table_s_order():
    assert [c.name for c in CASES] == TABLE
    assert len({c.module for c in CASES}) == len(CASES)
    modules = {p.stem for p in Path(corpus.__file__).parent.glob("*.py")} - {
        "__init__", "case", "support", "runner", "results", "report", "sanitized", "cli"}
    assert {c.module.rsplit(".", 1)[1] for c in CASES} == modules, "a case module outside the registry"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_case_module_defines_its_case_and_run_and_its_pair_names_two_of_its_functions(case):
    tree = tree_of(case)
    functions = top_functions(tree)
    assert "run" in functions and set(case.pair) <= functions, (case.pair, sorted(functions))
    assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "CASE" for t in n.targets) for n in tree.body)
    module = importlib.import_module(case.module)
    assert module.CASE is case and case.file == Path(module.__file__).name
    assert list(inspect.signature(module.run).parameters) == ["form"]
    # the module imports torch inside its functions only: listing the corpus needs no torch
    top_imports = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top_imports += [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert not [m for m in top_imports if m.split(".")[0] in HEAVY], top_imports


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_case_names_its_public_source_and_its_docstring_says_root_cause_and_fix(case):
    doc = " ".join((ast.get_docstring(tree_of(case)) or "").split())
    if case.source == DEMO_SOURCE:
        assert case.url == "docs/record.md" and (ROOT / case.url).exists()
        assert DEMO_SOURCE in doc
    else:
        source, url = PUBLIC_SOURCE.match(case.source), PUBLIC_URL.match(case.url)
        assert source and url, (case.source, case.url)
        assert (source["repo"], source["number"]) == (url["repo"], url["number"])
        assert case.url in doc
        assert case.name == f"{source['repo'].split('/')[1]}-{source['number']}"
    assert "Root cause" in doc and "fix" in doc
    assert case.hazard in HAZARDS and case.root_cause and "\n" not in case.root_cause and case.witness


def test_every_case_is_recorded_and_runs_both_forms():
    """A copy thread's cuda-python store, an I/O thread's preadv and the unmap under a held store
    are recorded; no case needs native capture or skips its broken form (the runner's handling of
    such cases is tested on stand-ins below)."""
    assert {c.capture for c in CASES} == {"recorded"} and not any(c.unseen or c.not_run for c in CASES)


def _section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i:text.index(end, i + len(start))]


def test_every_description_of_the_corpus_says_where_its_cases_come_from():
    """The corpus was described as "the races that shipped in public KV-offload code", while two
    cases are the demo's and two come from PyTorch and TorchRec: each description (README, docs,
    both helps, the package's docstring) names every project a case comes from, and the demo."""
    from kvverify.cli import SUBCOMMANDS
    from kvverify.record.corpus import cli as corpus_cli

    projects = {c.source.split("#")[0].split("/")[1].lower() for c in CASES if c.source != DEMO_SOURCE}
    assert projects == {"vllm", "sglang", "pytorch", "torchrec"}  # (a new one: name it in each place below)
    readme, corpus_doc, record_doc = ((ROOT / f).read_text() for f in ("README.md", "docs/corpus.md", "docs/record.md"))
    descriptions = {
        "README.md": _section(readme, "- `kvverify corpus`:", "\n- `"),
        "docs/corpus.md": _section(corpus_doc, "# The race corpus", "Each case runs three ways"),
        "docs/record.md": _section(record_doc, "## The race corpus", "\n## "),
        "kvverify --help": SUBCOMMANDS["corpus"][1],
        "kvverify corpus --help": corpus_cli.DESCRIPTION,
        "kvverify.record.corpus": corpus.__doc__,
    }
    for where, text in descriptions.items():
        words = " ".join(text.split()).lower()
        assert all(p in words for p in projects) and "demo" in words, (where, text)
        assert "shipped in public kv-offload code" not in words, (where, text)


def test_importing_and_listing_the_corpus_imports_no_heavy_library():
    probe = ("import json, sys\nfrom kvverify.cli import main\nstatus = main(['corpus', '--list'])\n"
             f"print(json.dumps([status, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))]), "
             "file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env=dict(os.environ, COLUMNS="80"))
    status, heavy = json.loads(r.stderr.strip().splitlines()[-1])
    assert status == 0 and heavy == [], r.stderr
    header, blank, *lines = r.stdout.splitlines()
    assert header == "case: expected race (kind, the two functions whose lines issue it)" and blank == ""
    assert [line.split(":")[0] for line in lines[0::2]] == TABLE and len(lines) == 2 * len(TABLE)
    assert lines[:2] == ["vllm-31341: RAW write_kv / store",
                         "  source: vllm-project/vllm#31341; capture: recorded; forms: broken,fixed"]
    assert lines[2 * TABLE.index("vllm-45268") + 1].endswith("; capture: recorded; forms: broken,fixed")


def test_a_case_outside_the_vocabulary_is_refused_by_name():
    good = dict(name="x-1", source="o/r#1", url="https://github.com/o/r/pull/1", root_cause="r", hazard="release",
                capture="recorded", kind="RAW", pair=("a", "b"), witness="w", module="m")
    Case(**good)
    for field, value in [("hazard", "nope"), ("capture", "thread"), ("kind", "RAR"), ("pair", ("a",)),
                         ("pair", ("a", "b c")), ("unseen", "x")]:
        with pytest.raises(ValueError, match=f"case x-1: {field.split('_')[0] if field != 'unseen' else 'a native'}"):
            Case(**{**good, field: value})
    with pytest.raises(ValueError, match="unknown form 'both'"):
        CASES[0].run("both")  # refused before anything is imported or run


def test_find_keeps_the_order_asked_and_names_every_known_case_for_an_unknown_one():
    assert find([]) == list(CASES)
    assert [c.name for c in find(["torchrec-4231", "vllm-31341"])] == ["torchrec-4231", "vllm-31341"]
    with pytest.raises(ValueError) as exc:
        find(["NOPE", "vllm-31341", "also-not"])
    assert str(exc.value).startswith("unknown cases NOPE, also-not; known cases: vllm-31341, vllm-39306")
    assert all(name in str(exc.value) for name in TABLE)


# -- shared helpers (CPU tensors stand in for device ones) -----------------------------------------


def test_is_fixed_and_the_swap_arguments_and_the_witness():
    import torch

    assert is_fixed("fixed") and not is_fixed("broken")
    with pytest.raises(ValueError, match="unknown form"):
        is_fixed("Fixed")
    src, dst = torch.zeros(4, PAGE_BYTES, dtype=torch.uint8), torch.zeros(4, PAGE_BYTES, dtype=torch.uint8)
    s, d, z = swap_args(src, dst, n=4)
    assert [t.dtype for t in (s, d, z)] == [torch.int64] * 3
    assert s.tolist() == [src.data_ptr() + i * PAGE_BYTES for i in range(4)] and z.tolist() == [PAGE_BYTES] * 4
    assert swap_args(4096, dst, n=2)[0].tolist() == [4096, 4096 + PAGE_BYTES]
    with pytest.raises(ValueError, match="contiguous memory"):
        swap_args(src, dst, n=5)
    with pytest.raises(ValueError, match="strided"):
        swap_args(src.t(), dst, n=1)
    src[1, 7] = 9
    src[3] = 9
    assert witness(src, 0) == Witness(2, 4, "pages", None)
    assert witness(src, 0, "why").note == "why"


def test_the_worker_runs_jobs_in_order_and_hands_its_first_error_to_the_caller():
    seen = []
    with Worker(seen.append) as w:
        for i in range(5):
            w.put(i)
    assert seen == list(range(5))

    def handle(job):
        if job == 1:
            raise KeyError("job 1")
        seen.append(job)

    seen.clear()
    with pytest.raises(KeyError, match="job 1"):
        with Worker(handle) as w:
            for i in range(3):
                w.put(i)
    assert seen == [0]  # the job after the error is dropped


# -- every case's Python, on a synchronous stand-in for the device --------------------------------


class _Gate:
    """``StreamGate`` on the synchronous stand-in: nothing runs late, so nothing is held."""

    expired = 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def hold(self, stream) -> None:
        pass

    def release_all(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Stream:
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture
def synchronous_device(monkeypatch):
    """torch.cuda as a device that runs everything at once, in program order, on CPU tensors: no
    race can strike, but every line of a case runs (what a GPU round must not be the first to try)."""
    import contextlib
    import ctypes

    import torch

    from kvverify.device import ops

    for case in CASES:
        module = importlib.import_module(case.module)
        if hasattr(module, "DEVICE"):
            monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(corpus.support, "DEVICE", "cpu")
    for name in ("full", "empty", "zeros"):
        factory = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=factory, pin_memory=False, **k: _f(*a, **k))
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    for name in ("synchronize", "_sleep", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(clock_rate=0))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)

    def swap(src, dst, sizes, *order, **options):
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    monkeypatch.setattr(ops, "swap_blocks_batch", swap)
    held = []

    def map_pool(nbytes):
        held.append(torch.zeros(nbytes, dtype=torch.uint8))
        return held[-1].data_ptr(), nbytes, None

    monkeypatch.setattr(corpus.vllm_45268, "map_pool", map_pool)
    monkeypatch.setattr(corpus.vllm_45268, "wake", lambda pool, size: None)
    from kvverify.device import gate

    monkeypatch.setattr(gate, "StreamGate", _Gate)
    driver = pytest.importorskip("cuda.bindings.driver")
    for name in ("cuMemUnmap", "cuMemRelease", "cuMemAddressFree"):
        monkeypatch.setattr(driver, name, lambda *a: (driver.CUresult.CUDA_SUCCESS,))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_case_runs_each_form_through_on_a_synchronous_stand_in(synchronous_device, case, form):
    from kvverify import record as kvrecord

    if case.name == "sglang-28468" and not hasattr(kvrecord, "reuse"):
        pytest.skip("kvverify.record.reuse is not in this tree yet")
    seen = case.run(form)
    if form == "broken" and case.not_run:
        assert seen == Witness(0, 0, "pages", case.not_run)
    else:
        assert seen.corrupted == 0 and seen.total == 16 and seen.unit == "pages", seen


# -- the runner's judgement ------------------------------------------------------------------------


def race(kind, first, second, at_first=None, at_second=None):
    return SimpleNamespace(kind=kind, first=first, second=second, first_at=at_first, second_at=at_second)


def test_the_expected_race_is_found_by_kind_file_and_function_from_either_source_of_at():
    case = find(["vllm-31341"])[0]
    ops = [{"at": "/x/kvverify/record/corpus/vllm_31341.py:40 in write_kv"},
           {"at": "/x/kvverify/record/corpus/vllm_31341.py:55 in store"},
           {"at": "/x/other/vllm_31341_copy.py:55 in store"}]
    assert runner.expected_race(case, [], ops) == (None, False)
    wrong_kind = race("WAR", 0, 1)
    wrong_file = race("RAW", 0, 2)
    right = race("RAW", 0, 1)
    pair, found = runner.expected_race(case, [wrong_kind, wrong_file, right], ops)
    assert found and pair == RacingPair("RAW", ops[0]["at"], ops[1]["at"])
    pair, found = runner.expected_race(case, [wrong_kind, wrong_file], ops)
    assert not found and pair.kind == "WAR"
    # the race's own at wins over the op's
    pair, found = runner.expected_race(case, [race("RAW", 2, 2, ops[0]["at"], ops[1]["at"])], ops)
    assert found
    assert report.race_text(pair) == "RAW vllm_31341.py:40 write_kv / :55 store"
    assert report.race_text(RacingPair("WAW", ops[0]["at"], ops[2]["at"])).endswith(" / vllm_31341_copy.py:55 store")
    assert report.race_text(RacingPair("WAW", None, "?")) == "WAW ? / ?"


def _never_run_broken(case: Case) -> Case:
    """``case`` as a case that needs native capture and whose broken form is never executed."""
    from dataclasses import replace

    return replace(case, capture="native", unseen="what a recording cannot see", not_run="not run: it could fault")


def test_a_native_case_is_blind_for_its_own_reason_and_never_judged():
    from dataclasses import replace

    unmap = _never_run_broken(find(["vllm-45268"])[0])
    threaded = replace(find(["vllm-45704"])[0], capture="native", unseen="a driver call this recorder does not watch")
    assert runner.blindness(find(["vllm-31341"])[0], "broken", True, []) is None
    from kvverify.record.capture.threads import OTHER_THREAD_WORK

    note = f"{OTHER_THREAD_WORK} torch's stream, event and allocator reports from thread 'io': 3"
    assert runner.blindness(threaded, "fixed", False, [note]) == runner.OTHER_THREADS
    assert runner.blindness(threaded, "fixed", False, []) == runner.RECORDER_MISSED
    assert runner.blindness(threaded, "fixed", True, []) == threaded.unseen
    assert runner.blindness(unmap, "broken", True, []) == unmap.not_run
    safe = FormResult(threaded.name, threaded.source, "native", "broken", recorded=Recorded(verdict="SAFE"))
    assert shortfalls(threaded, safe) == []


def row(case: Case, form: str, **recorded) -> FormResult:
    return FormResult(case.name, case.source, case.capture, form, Witness(0, 16), None, Recorded(**recorded))


def test_a_recorded_case_must_race_with_its_pair_when_broken_and_be_safe_and_complete_when_fixed():
    case = find(["sglang-36738"])[0]
    assert shortfalls(case, row(case, "broken", verdict="RACY", races=2, pair_found=True)) == []
    assert shortfalls(case, row(case, "fixed", verdict="SAFE")) == []
    problems = [shortfalls(case, row(case, "broken", verdict="SAFE")),
                shortfalls(case, row(case, "broken", verdict="RACY", races=1)),
                shortfalls(case, row(case, "fixed", verdict="RACY", races=3)),
                shortfalls(case, row(case, "fixed", verdict="SAFE", complete=False)),
                shortfalls(case, row(case, "fixed", error="RuntimeError: boom"))]
    assert [len(p) for p in problems] == [1] * 5
    assert "expected RACY with WAW forward / load_back" in problems[0][0]
    assert "no WAW race between forward and load_back in sglang_36738.py" in problems[1][0]
    assert "expected SAFE" in problems[2][0] and "incomplete" in problems[3][0] and "boom" in problems[4][0]


def synthetic_run() -> CorpusRun:
    a, b, c = find(["vllm-31341", "vllm-45268", "vllm-45704"])
    b = _never_run_broken(b)
    at = "/r/kvverify/record/corpus/vllm_31341.py:{} in {}"
    rows = (
        FormResult(a.name, a.source, a.capture, "broken", Witness(16, 16), None,
                   Recorded("RACY", 2, True, RacingPair("RAW", at.format(40, "write_kv"), at.format(55, "store")), True),
                   Sanitized("nothing")),
        FormResult(a.name, a.source, a.capture, "fixed", Witness(0, 16), None, Recorded("SAFE", 0, True),
                   Sanitized("reported", "CSAN detected a possible data race | on tensor")),
        FormResult(b.name, b.source, b.capture, "broken", Witness(0, 0, note=b.not_run), None,
                   Recorded("SAFE", 0, True, blind=b.not_run), Sanitized("error", "RuntimeError: x")),
        FormResult(c.name, c.source, c.capture, "fixed", None, "RuntimeError: no driver", Recorded(error="boom"), None),
    )
    return CorpusRun(rows, ("vllm-31341 fixed: something",))


def test_the_markdown_table_shows_each_column_and_what_missed():
    text = report.markdown(synthetic_run())
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(report.COLUMNS) + " |" and lines[1].count("---") == 6
    assert lines[2] == ("| vllm-31341 | vllm-project/vllm#31341 | broken | 16 of 16 pages | "
                        "RACY (2 races): RAW vllm_31341.py:40 write_kv / :55 store | nothing |")
    assert lines[3] == ("| vllm-31341 | vllm-project/vllm#31341 | fixed | 0 of 16 pages | SAFE | reported |")
    assert "| not run: it could fault" in lines[4] and "needs native capture: not run:" in lines[4]
    assert "SAFE" not in lines[4].split(" | ")[4]
    assert lines[4].endswith("| error: RuntimeError: x |")
    assert lines[5].endswith("| error: RuntimeError: no driver | error: boom | not run |")
    assert lines[-2:] == ["Not as expected:", "- vllm-31341 fixed: something"]
    for line in lines[2:6]:  # a | inside a cell is escaped: every row has its six cells
        assert len(re.split(r"(?<!\\)\|", line)) == 8, line


def test_the_json_holds_every_row_and_the_judgement():
    doc = json.loads(report.to_json(synthetic_run()))
    assert doc["version"] == 1 and doc["ok"] is False and doc["failures"] == ["vllm-31341 fixed: something"]
    first = doc["rows"][0]
    assert first["native"] == {"corrupted": 16, "total": 16, "unit": "pages", "note": None}
    assert first["recorded"]["race"]["kind"] == "RAW" and first["recorded"]["pair_found"] is True
    assert first["csan"] == {"outcome": "nothing", "detail": None}
    assert doc["rows"][3]["csan"] is None and doc["rows"][3]["native_error"] == "RuntimeError: no driver"


def test_run_corpus_runs_each_form_natively_and_recorded_then_all_under_the_sanitizer(monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "native", lambda case, form: calls.append(("native", case.name, form)) or
                        (Witness(16 if form == "broken" else 0, 16), None))
    monkeypatch.setattr(runner, "recorded", lambda case, form, confirm=False: calls.append(("recorded", case.name, form)) or
                        Recorded("RACY" if form == "broken" else "SAFE", int(form == "broken"), True, None,
                                 form == "broken"))
    monkeypatch.setattr(runner, "sanitized", lambda selection: calls.append(("csan", len(selection))) or
                        {(c.name, f): Sanitized("nothing") for c, f in selection})
    cases = find(["vllm-31341", "sglang-18746"])
    seen = []
    result = runner.run_corpus(cases, FORMS, progress=seen.append)
    assert calls[:2] == [("native", "vllm-31341", "broken"), ("recorded", "vllm-31341", "broken")]
    assert calls[-1] == ("csan", 4) and len(seen) == 4 and seen[0].csan is None
    assert result.ok and [r.csan.outcome for r in result.rows] == ["nothing"] * 4
    assert not runner.run_corpus(cases, ["fixed", "broken"][::-1], csan=False).failures
    monkeypatch.setattr(runner, "recorded", lambda case, form, confirm=False: Recorded("SAFE"))
    failed = runner.run_corpus(cases, ["broken"], csan=False)
    assert not failed.ok and len(failed.failures) == 2


def test_the_sanitized_child_s_lines_are_read_and_a_missing_form_is_an_error():
    out = ("noise\n" + runner.CSAN_MARK + json.dumps({"case": "a", "form": "broken", "outcome": "reported",
                                                       "detail": "x"}) + "\n")
    assert runner.parse_sanitized(out) == {("a", "broken"): Sanitized("reported", "x")}
    selection = [(find(["vllm-31341"])[0], "broken"), (find(["demo-polled-query"])[0], "fixed")]
    found = runner.sanitized(selection, timeout_s=120)  # a real child: on a host without CUDA each form fails
    assert set(found) == {("vllm-31341", "broken"), ("demo-polled-query", "fixed")}
    assert all(s.outcome in ("reported", "nothing", "error") for s in found.values())
    unmap = _never_run_broken(find(["vllm-45268"])[0])
    assert runner.sanitized([(unmap, "broken")]) == {("vllm-45268", "broken"): Sanitized("not run", unmap.not_run)}


def test_the_sanitized_child_refuses_an_unknown_case(capsys):
    from kvverify.record.corpus import sanitized

    assert sanitized.main(["NOPE:broken"]) == 2
    assert "unknown case NOPE" in capsys.readouterr().err


# -- the command ---------------------------------------------------------------------------------


def test_without_a_gpu_it_refuses_with_one_line_and_exit_2(monkeypatch, capsys):
    from kvverify import device

    monkeypatch.setattr(device, "gpu_refusal", lambda: "no CUDA device is visible (test)")
    assert main(["corpus", "--no-csan"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "kvverify corpus: no CUDA device is visible (test)\n"


def test_the_json_file_written_is_said_with_where_it_went(monkeypatch, capsys, tmp_path):
    """``--json`` once wrote its file without a word: a line on stderr says where it went."""
    from kvverify import device
    from kvverify.record.corpus import runner

    monkeypatch.setattr(device, "gpu_refusal", lambda: None)
    monkeypatch.setattr(runner, "run_corpus", lambda *a, **k: CorpusRun(()))
    out = tmp_path / "corpus.json"
    assert main(["corpus", "vllm-31341", "--no-csan", "--json", str(out)]) == 0
    assert capsys.readouterr().err == f"kvverify corpus: results written to {out}\n"
    assert json.loads(out.read_text())["rows"] == []


def test_on_this_host_without_a_gpu_it_refuses_too(capsys):
    from kvverify import device

    if device.gpu_refusal() is None:
        pytest.skip("this host has a CUDA device and kvverify._C: test_corpus_gpu.py runs the corpus")
    assert main(["corpus", "vllm-31341"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvverify corpus: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["NOPE"], "kvverify corpus: unknown case NOPE; known cases: vllm-31341, "),
    (["--forms", "broken,bent"], "kvverify corpus: unknown form bent; use broken, fixed, comma-separated"),
    (["--forms", ","], "kvverify corpus: no form given"),
    (["--list", "vllm-31341"], "kvverify corpus: --list lists every case; give no names with it"),
])
def test_a_bad_name_or_form_is_one_line_and_exit_2_before_any_gpu_check(monkeypatch, capsys, argv, message):
    from kvverify import device

    monkeypatch.setattr(device, "gpu_refusal", lambda: pytest.fail("the GPU was asked for"))
    assert main(["corpus", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_help_fits_a_screen_in_plain_text_and_ends_with_examples():
    examples = check_screen(help_lines("corpus"))
    assert all(e.split()[1] == "corpus" for e in examples)
    assert any("--list" in e for e in examples)
