"""CPU tests of ``kvverify probe`` and ``kvverify bench``: argument handling, sizes, the statistics,
the report documents (through fake backends), the plot, and the refusal on a host without a GPU."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from help_screen import check_screen, help_lines
from hypothesis import given
from hypothesis import strategies as st

from kvverify import cli
from kvverify import device
from kvverify.device import platform_info
from kvverify.errors import PlanError
from kvverify.measure import bench, bench_plan, bench_render, common, probe
from kvverify.units import format_size, parse_size, parse_size_list

REPO = Path(__file__).resolve().parents[2]
KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.fixture
def annotate_off():
    """The real kvverify.annotate with annotation off: every range is a no-op, names are still checked."""
    from kvverify import annotate

    annotate.configure(False)
    yield annotate
    annotate._reset_for_tests()


def parse(module, argv):
    parser = argparse.ArgumentParser(prog=f"kvverify {module.__name__.rsplit('.', 1)[1]}")
    module.add_arguments(parser)
    return parser.parse_args(argv)


def mine_only(monkeypatch):
    """The CLI with only probe and bench registered (other subcommands' modules may not have landed)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {k: v for k, v in cli.SUBCOMMANDS.items() if k in ("probe", "bench")})


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text, expected",
    [("4KiB", 4096), ("4kib", 4096), ("4K", 4096), ("2 MiB", 2 * MiB), ("1GiB", GiB), ("64MB", 64_000_000),
     ("512", 512), ("8B", 8), ("1.5KiB", 1536), (" 16KiB ", 16 * KiB)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "KiB", "4 KiX", "-4KiB", "0", "0.3B", "4 KiB 2", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_list_keeps_order():
    assert parse_size_list("2MiB,4KiB, 64KiB") == [2 * MiB, 4 * KiB, 64 * KiB]
    with pytest.raises(ValueError):
        parse_size_list(" , ")


@given(st.integers(min_value=1, max_value=4096), st.sampled_from([1, KiB, MiB, GiB]))
def test_format_then_parse_round_trips(n, unit):
    assert parse_size(format_size(n * unit).replace(" ", "")) == n * unit


def test_format_size_names():
    assert format_size(4096) == "4 KiB"
    assert format_size(2 * MiB) == "2 MiB"
    assert format_size(1000) == "1000 B"
    assert format_size(1536 * KiB) == "1536 KiB"
    assert format_size(18432) == "18 KiB"


# --------------------------------------------------------------------------- argument handling


def test_top_level_help_lists_both(monkeypatch, capsys):
    mine_only(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "probe" in out and "bench" in out


@pytest.mark.parametrize("command, options", [
    ("probe", ["--reps", "--hold-ms", "--page-bytes", "--pages", "--directions", "--orders", "--host-memory", "--json", "--no-nvtx"]),
    ("bench", ["--quick", "--page-sizes", "--model", "--directions", "--orders", "--reps", "--json", "--plot",
               "--host-memory", "--pool-bytes", "--call-bytes", "--max-seconds", "--no-repeat", "--confidence"]),
])
def test_subcommand_help(monkeypatch, capsys, command, options):
    mine_only(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in options:
        assert option in out


@pytest.mark.parametrize("command", ["probe", "bench"])
def test_help_fits_a_screen_in_plain_text_and_ends_with_an_example(command):
    examples = check_screen(help_lines(command))
    module = {"probe": probe, "bench": bench}[command]
    for example in examples:
        assert example.split()[1] == command
        parse(module, example.split()[2:])  # each example's options parse as written


def test_probe_defaults_and_lists():
    args = parse(probe, [])
    assert args.reps == 5 and args.hold_ms == 20.0 and args.page_bytes == 64 * KiB and args.pages == 16
    assert args.directions == ("h2d", "d2h")
    assert args.orders == ("STREAM", "DURING_API_CALL", "ANY")
    assert args.host_memory == ("pinned", "registered", "pageable")
    args = parse(probe, ["--orders", "any,stream", "--directions", "D2H", "--host-memory", "pinned", "--page-bytes", "4KiB"])
    assert args.orders == ("ANY", "STREAM") and args.directions == ("d2h",) and args.host_memory == ("pinned",)
    assert args.page_bytes == 4096
    assert parse(probe, ["--orders", "all"]).orders == probe.ORDERS


@pytest.mark.parametrize("argv", [
    ["--orders", "FAST"], ["--orders", "STREAM,,ANY"], ["--orders", ""], ["--directions", "sideways"],
    ["--host-memory", "managed"], ["--reps", "0"],
    ["--hold-ms", "-1"], ["--page-bytes", "4KiX"], ["--reps", "x"],
])
def test_probe_rejects_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(probe, argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_probe_rejects_page_not_multiple_of_8(capsys):
    args = parse(probe, ["--page-bytes", "1001"])
    assert probe.run(args) == 2
    assert "multiple of 8" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--host-memory", "managed"], ["--confidence", "1.5"], ["--confidence", "0"], ["--page-sizes", ""],
    ["--block-tokens", "0"], ["--max-seconds", "0"], ["--pool-bytes", "lots"],
])
def test_bench_rejects_bad_options(argv):
    with pytest.raises(SystemExit) as exc:
        parse(bench, argv)
    assert exc.value.code == 2


def test_bench_quick_and_explicit_options():
    args = bench_plan.resolve(parse(bench, []))
    assert args.page_sizes == [4 * KiB * 2**i for i in range(10)]
    assert args.page_sizes[-1] == 2 * MiB
    assert args.reps == bench_plan.DEFAULT_REPS and args.max_seconds is None
    args = bench_plan.resolve(parse(bench, ["--quick"]))
    assert args.page_sizes == bench_plan.QUICK_PAGE_SIZES
    assert {16 * KiB, 64 * KiB, 2 * MiB} <= set(args.page_sizes)
    assert args.reps == bench_plan.QUICK_REPS and args.max_seconds == bench_plan.QUICK_MAX_SECONDS
    args = bench_plan.resolve(parse(bench, ["--quick", "--reps", "3", "--page-sizes", "64KiB", "--max-seconds", "9"]))
    assert (args.reps, args.page_sizes, args.max_seconds) == (3, [64 * KiB], 9.0)
    assert args.host_memory == "pinned" and args.pool_bytes == 2 * GiB


def test_plan_points_raw_sizes():
    args = bench_plan.resolve(parse(bench, ["--page-sizes", "4KiB,2MiB", "--directions", "h2d,d2h"]))
    points, skipped = bench_plan.plan_points(args)
    assert not skipped
    assert [(p.direction, p.page_bytes) for p in points] == [
        ("h2d", 4 * KiB), ("d2h", 4 * KiB), ("h2d", 2 * MiB), ("d2h", 2 * MiB)]
    for p in points:
        assert p.call_bytes == 64 * MiB
        assert p.rep_bytes >= bench_plan.MIN_REP_BYTES
        assert p.pages_per_call <= args.pool_bytes // p.page_bytes
    assert points[0].pages_per_call == 16384 and points[2].pages_per_call == 32
    # > 1 GiB timed per method and point with the default and the quick rep counts
    assert points[0].rep_bytes * bench_plan.DEFAULT_REPS > GiB
    assert points[0].rep_bytes * bench_plan.QUICK_REPS > GiB


def test_plan_points_errors():
    with pytest.raises(PlanError, match="larger than --call-bytes"):
        bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--page-sizes", "128MiB"])))
    with pytest.raises(PlanError, match="do not fit"):
        bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--pool-bytes", "32MiB", "--page-sizes", "64KiB"])))
    with pytest.raises(PlanError, match="more than the pool"):
        bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--pool-bytes", "128MiB", "--calls-per-rep", "4", "--page-sizes", "64KiB"])))
    # without an explicit --calls-per-rep the rep shrinks to fit the pool instead
    points, _ = bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--pool-bytes", "128MiB", "--page-sizes", "64KiB"])))
    assert points[0].calls_per_rep == 2
    # a `both` call has half of each pool per direction: 64 MiB does not fit 64 MiB halves of 128 MiB twice
    assert [p.calls_per_rep for p in points if p.direction == "both"] == [1]
    with pytest.raises(PlanError, match="--pages-per-call goes with --page-sizes"):
        bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--model", "llama-3.1-8b", "--pages-per-call", "16"])))


def test_plan_points_pages_per_call():
    args = bench_plan.resolve(parse(bench, ["--page-sizes", "4KiB,2MiB", "--pages-per-call", "16,1024",
                                            "--pool-bytes", "3GiB"]))
    points, skipped = bench_plan.plan_points(args)
    shapes = {(p.direction, p.page_bytes, p.pages_per_call) for p in points}
    # 1024 pages of 2 MiB: 2 GiB per call fits a 3 GiB pool one way, not the 1.5 GiB half of a `both` call
    assert ("h2d", 2 * MiB, 1024) in shapes and ("both", 2 * MiB, 1024) not in shapes
    assert skipped == ["both 2 MiB x 1024: 2 GiB per call do not fit 1536 MiB of pool"]
    assert len(points) == 2 * 2 * 3 - 1
    small = next(p for p in points if (p.direction, p.page_bytes, p.pages_per_call) == ("h2d", 4 * KiB, 16))
    assert small.calls_per_rep == bench_plan.MAX_CALLS_PER_REP  # 64 KiB calls: capped, not 4096 of them
    both = next(p for p in points if (p.direction, p.page_bytes, p.pages_per_call) == ("both", 4 * KiB, 1024))
    assert both.rep_bytes == 2 * both.call_bytes * both.calls_per_rep and both.label == "4 KiB x 1024"


def test_calibrate_defaults_and_explicit_options():
    args = bench_plan.resolve(parse(bench, ["--calibrate"]))
    assert args.page_sizes == bench_plan.DEFAULT_PAGE_SIZES
    assert args.pages_per_call == bench_plan.CALIBRATE_PAGES_PER_CALL == [16, 256, 4096, 16384]
    assert args.orders == ("STREAM", "ANY") and args.reps == bench_plan.CALIBRATE_REPS
    assert args.no_repeat and args.compute is False and tuple(args.directions) == ("h2d", "d2h", "both")
    assert bench_plan.methods_for(args) == ["STREAM", "ANY", "loop", "kernel", "ceiling"]
    points, skipped = bench_plan.plan_points(args)
    # shapes whose call exceeds the 2 GiB pool (or a 1 GiB half for `both`) are left out, and said so
    assert all(p.call_bytes <= 2 * GiB // p.ways for p in points) and skipped
    assert {p.page_bytes for p in points} == set(bench_plan.DEFAULT_PAGE_SIZES)
    assert all(p.rep_bytes // p.ways >= min(bench_plan.CALIBRATE_MIN_REP_BYTES, p.call_bytes * bench_plan.MAX_CALLS_PER_REP)
               for p in points)
    args = bench_plan.resolve(parse(bench, ["--calibrate", "--compute", "--orders", "STREAM", "--reps", "2",
                                            "--pages-per-call", "64"]))
    assert args.compute is True and args.orders == ("STREAM",) and args.reps == 2 and args.pages_per_call == [64]
    args = bench_plan.resolve(parse(bench, []))
    assert args.compute is True and args.orders == ("STREAM", "DURING_API_CALL", "ANY") and args.pages_per_call is None


def test_bench_plan_error_is_one_line(capsys):
    args = parse(bench, ["--page-sizes", "128MiB"])
    assert bench.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvverify bench:")


def test_plan_points_model():
    args = bench_plan.resolve(parse(bench, ["--model", "llama-3.1-8b", "--directions", "h2d"]))
    points, _ = bench_plan.plan_points(args)
    # 16, 32, 64 tokens x 8 KV heads x 128 x 2 bytes; 32 layers x (K, V) = 64 tensors x 16 blocks per transfer
    assert [p.page_bytes for p in points] == [32 * KiB, 64 * KiB, 128 * KiB]
    assert all(p.pages_per_call == 64 * 16 for p in points)
    assert points[0].label == "llama-3.1-8b 16 tok"
    assert points[0].calls_per_rep == 8  # 32 MiB per call, 256 MiB per rep
    args = bench_plan.resolve(parse(bench, ["--model", "DeepSeek-V3", "--block-tokens", "16", "--blocks-per-transfer", "4"]))
    p = bench_plan.plan_points(args)[0][0]
    assert p.page_bytes == 16 * 576 * 2 and p.pages_per_call == 61 * 4
    with pytest.raises(PlanError, match="llama-3.1-8b"):
        bench_plan.plan_points(bench_plan.resolve(parse(bench, ["--model", "nope"])))


# --------------------------------------------------------------------------- statistics and controls


def test_summary():
    s = common.summary([10.0, 12.0, 11.0, float("nan")])
    assert s["n"] == 3 and s["median"] == 11.0 and s["min"] == 10.0 and s["max"] == 12.0
    assert s["rel_spread"] == pytest.approx(2 / 11)
    one = common.summary([5.0])
    assert one["median"] == 5.0 and math.isnan(one["rel_spread"])
    assert common.summary([])["n"] == 0


def test_majority():
    m = common.majority(["stream", "stream", "call", "stream", "stream"])
    assert (m["value"], m["agree"], m["n"]) == ("stream", 4, 5)
    split = common.majority(["a", "b", "a", "b"])
    assert split["value"] == "split" and split["agree"] == 0
    assert common.majority([])["value"] is None


def test_one_noisy_trial_does_not_flip_a_cell():
    trials = ["stream"] * 4 + ["call"]
    assert common.majority(trials)["value"] == "stream"


def test_gbps_is_decimal():
    assert common.gbps(1e9, 1.0) == 1.0
    assert common.gbps(256 * MiB, 0.005) == pytest.approx(53.687091, rel=1e-6)
    assert math.isnan(common.gbps(1, 0))


def test_ratio_ci():
    num = [50.0 + 0.1 * i for i in range(12)]
    den = [50.0] * 12
    r = common.ratio_ci(num, den, 0.95)
    assert r["low"] <= r["median"] <= r["high"] and r["note"] is None
    assert r["median"] == pytest.approx(1.011) and r["n"] == 12 and r["confidence"] == 0.95
    assert r["high"] - r["low"] < 0.02


def test_ratio_ci_without_enough_pairs_has_no_interval():
    r = common.ratio_ci([2.0, 3.0, 4.0], [2.0, 2.0, 2.0], 0.95)
    assert r["median"] == 1.5 and r["low"] is None and r["high"] is None and r["n"] == 3
    assert "needs 6" in r["note"]
    bad = common.ratio_ci([1.0] * 6 + [float("nan")], [1.0] * 7, 0.95)
    assert bad["low"] is None and bad["median"] == 1.0


def test_round_order_interleaves_any_and_stream():
    methods = ["STREAM", "DURING_API_CALL", "ANY", "loop", "ceiling"]
    rounds = [bench_plan.round_order(i, methods) for i in range(4)]
    assert rounds[0][:2] == ["ANY", "STREAM"] and rounds[1][:2] == ["STREAM", "ANY"]
    assert rounds[2][:2] == ["ANY", "STREAM"]
    for r in rounds:
        assert sorted(r) == sorted(methods) and r[2:] == ["DURING_API_CALL", "loop", "ceiling"]
    assert bench_plan.round_order(1, ["STREAM", "loop"]) == ["STREAM", "loop"]


def test_hold_controller_follows_queue_time():
    h = bench.HoldController()
    h.update(0.002, covered=True)
    assert h.hold_ns == 5_000_000  # 2 x 2 ms + 1 ms
    h.update(0.00001, covered=True)
    assert h.hold_ns == 1_020_000
    h.update(0.0, covered=True)
    assert h.hold_ns == h.MIN_NS
    h.update(0.010, covered=False)  # too short: grows past 4 x the queue time
    assert h.hold_ns >= 40_000_000 and not h.blocking
    h.update(0.011, covered=True)
    assert h.uncovered_in_a_row == 0 and h.hold_ns == 23_000_000


def test_hold_controller_detects_blocking_calls():
    h = bench.HoldController()
    for _ in range(h.BLOCKING_AFTER):
        h.update(h.hold_ns / 1e9 + 0.0005, covered=False)  # the call waits for the hold every time
    assert h.blocking and h.hold_ns == h.MIN_NS
    h.update(1.0, covered=False)
    assert h.hold_ns == h.MIN_NS
    capped = bench.HoldController()
    capped.update(10.0, covered=False)
    assert capped.hold_ns == capped.MAX_NS
    capped.update(10.0, covered=False)
    assert capped.blocking


# --------------------------------------------------------------------------- probe logic


def test_classify_words():
    np = pytest.importorskip("numpy")
    n = 64
    old = np.full(n, probe.OLD, dtype=np.uint64)
    new = np.full(n, probe.NEW, dtype=np.uint64)
    assert probe.classify_words(old) == "old"
    assert probe.classify_words(new) == "new"
    assert probe.classify_words(np.concatenate([old[:10], new[10:]])) == "torn"
    assert probe.classify_words(np.full(n, probe.SENTINEL, dtype=np.uint64)) == "sentinel"
    garbage = old.copy()
    garbage[3] = 7
    assert probe.classify_words(garbage) == "garbage"
    assert probe.classify_words(np.concatenate([old[:10], np.full(54, probe.SENTINEL, dtype=np.uint64)])) == "garbage"


def test_generations_fit_int64():
    for g in (probe.OLD, probe.NEW, probe.SENTINEL):
        assert 0 < g < 2**63


@pytest.mark.parametrize("direction, landed, at_return, after_rewrite, expected", [
    ("h2d", "new", True, True, "stream"),
    ("h2d", "old", True, True, "call"),
    ("h2d", "old", False, False, "call"),  # the call waited for the hold, then read
    ("h2d", "old", True, False, "inconclusive"),  # the hold ended before the rewrite finished
    ("h2d", "torn", True, True, "torn"),
    ("d2h", "old", True, None, "call"),
    ("d2h", "new", True, None, "stream"),
    ("d2h", "new", False, None, "stream"),
    ("d2h", "sentinel", True, None, "not-landed"),
    ("d2h", "garbage", True, None, "garbage"),
])
def test_source_read(direction, landed, at_return, after_rewrite, expected):
    assert probe.source_read(direction, landed, at_return, after_rewrite) == expected


class FakeProbe:
    """Trials as a driver that blocks DURING_API_CALL, reads ANY early for H2D, and errs on pageable DURING_API_CALL."""

    def __init__(self):
        self.calls = []

    def trial(self, direction, order, kind, hold_ns):
        self.calls.append((direction, order, kind, hold_ns))
        if order == "DURING_API_CALL" and kind == "pageable":
            return probe.Trial(float("nan"), True, None, "error", "error", error="invalid argument")
        blocked = order == "DURING_API_CALL"
        call_s = hold_ns / 1e9 if blocked else 2e-5
        landed = "old" if (direction == "h2d" and (order == "ANY" or blocked)) else "new"
        after = (not blocked) if direction == "h2d" else None
        return probe.Trial(call_s, not blocked, after, landed, probe.source_read(direction, landed, not blocked, after))


def test_run_probe_document_and_table(tmp_path, annotate_off):
    from rich.console import Console

    args = parse(probe, ["--reps", "3", "--hold-ms", "10"])
    backend = FakeProbe()
    doc = probe.run_probe(args, backend, {"batch_api_available": True, "gpu_name": "fake"}, annotate_off)
    assert len(doc["cells"]) == 18
    assert len(backend.calls) == 18 * (3 + 1)  # one warm-up per cell
    assert {c["hold_s"] for c in doc["cells"]} == {0.01}
    by = {(c["direction"], c["order"], c["host_memory"]): c for c in doc["cells"]}
    assert by[("h2d", "ANY", "pinned")]["source_read"]["value"] == "call"
    assert by[("h2d", "STREAM", "pinned")]["source_read"]["value"] == "stream"
    assert by[("h2d", "STREAM", "pinned")]["blocks"] == {"value": "no", "agree": 3, "n": 3, "counts": {"no": 3}}
    assert by[("d2h", "DURING_API_CALL", "pinned")]["blocks"]["value"] == "yes"
    assert by[("d2h", "DURING_API_CALL", "pinned")]["call_over_hold"] == pytest.approx(1.0)
    assert by[("h2d", "DURING_API_CALL", "pageable")]["errors"] == ["invalid argument"]
    console = Console(record=True, width=200)
    probe.render_table(doc, console)
    text = console.export_text()
    assert "stream 3/3" in text and "call 3/3" in text and "3 counted trials per cell" in text
    out = tmp_path / "probe.json"
    common.write_json(str(out), doc)
    loaded = json.loads(out.read_text())
    assert loaded["kind"] == "kvverify-probe" and len(loaded["cells"]) == 18
    assert loaded["cells"][0]["trials"][0]["landed"] in ("old", "new")


def test_run_probe_without_batch_api_marks_cells(annotate_off):
    args = parse(probe, ["--reps", "2", "--directions", "h2d", "--orders", "ANY"])
    backend = FakeProbe()
    doc = probe.run_probe(args, backend, {"batch_api_available": False}, annotate_off)
    assert backend.calls == []
    assert all(c["errors"] == ["batch API absent"] for c in doc["cells"])


# --------------------------------------------------------------------------- bench logic (fake backend)


class FakeBench:
    """Synthetic timings: each method has a bandwidth in GB/s; DURING_API_CALL waits for the hold; each
    method slows a concurrent matmul by SLOWDOWN."""

    RATES = {"STREAM": 50.0, "ANY": 50.5, "DURING_API_CALL": 40.0, "loop": 20.0, "kernel": 52.0, "ceiling": 55.0}
    SLOWDOWN = {"STREAM": 0.02, "ANY": 0.02, "DURING_API_CALL": 0.02, "loop": 0.01, "kernel": 0.25, "ceiling": 0.0}
    MATMUL_S = 2e-4

    def __init__(self):
        self.prepared = []
        self.held_calls = 0
        self.e2e_calls = 0
        self.matmul_calls = []

    def prepare(self, point, seed):
        self.prepared.append((point, seed))
        return [seed]

    def issuer(self, method, point, calls):
        issue = lambda: None  # noqa: E731
        issue.method, issue.point = method, point
        return issue

    def held(self, issue, hold_ns):
        self.held_calls += 1
        copy_s = issue.point.rep_bytes / (self.RATES[issue.method] * 1e9)
        if issue.method == "DURING_API_CALL":
            return copy_s, hold_ns / 1e9 + 1e-4, False
        return copy_s, 1e-4, True

    def end_to_end(self, issue):
        self.e2e_calls += 1
        return issue.point.rep_bytes / (self.RATES[issue.method] * 1e9) + 1e-4

    def matmuls_alone(self, count, hold_ns):
        self.matmul_calls.append(("alone", count))
        return count * self.MATMUL_S

    def matmuls_during(self, issue, repeats, count, hold_ns):
        self.matmul_calls.append((issue.method, count, repeats))
        copies_s = repeats * issue.point.rep_bytes / (self.RATES[issue.method] * 1e9)
        during_s = count * self.MATMUL_S * (1 + self.SLOWDOWN[issue.method])
        return during_s, copies_s, copies_s >= during_s


@pytest.fixture
def bench_doc(annotate_off):
    args = parse(bench, ["--quick", "--reps", "6"])
    backend = FakeBench()
    doc = bench.run_bench(args, backend, {"batch_api_available": True, "gpu_name": "fake"}, annotate_off)
    return doc, backend


def test_run_bench_document(bench_doc):
    doc, backend = bench_doc
    points = doc["points"]
    assert len(points) == 12 and not doc["truncated"] and doc["points_planned"] == 12  # 4 sizes x h2d, d2h, both
    # 6 methods x (6 reps + 1 warm-up) per point, then STREAM x (6 + 1) again for the repeat series
    assert backend.held_calls == 12 * 6 * 7 + 12 * 7 and backend.e2e_calls == backend.held_calls
    p = next(p for p in points if p["direction"] == "h2d" and p["page_bytes"] == 2 * MiB)
    assert p["methods"]["STREAM"]["gbps"]["median"] == pytest.approx(50.0)
    assert p["methods"]["ceiling"]["gbps"]["median"] == pytest.approx(55.0)
    assert p["methods"]["STREAM"]["of_ceiling"] == pytest.approx(50 / 55)
    assert p["any_over_stream"]["median"] == pytest.approx(1.01)
    assert p["any_over_stream"]["n"] == 6 and p["any_over_stream"]["low"] == pytest.approx(1.01)
    assert p["methods"]["STREAM"]["hold_covered"] == 6
    assert p["methods"]["DURING_API_CALL"]["blocking"] is True
    assert p["repeat"]["checked"] and p["repeat"]["within_tolerance"] and p["repeat"]["rel_delta"] == pytest.approx(0)
    small = next(p for p in points if p["page_bytes"] == 16 * KiB)
    assert small["repeat"]["checked"] is False and small["repeat"]["within_tolerance"] is None
    assert doc["ceiling_gbps"] == {"h2d": pytest.approx(55.0), "d2h": pytest.approx(55.0), "both": pytest.approx(55.0)}
    assert p["bytes_timed_per_method"] == 6 * 256 * MiB
    both = next(p for p in points if p["direction"] == "both" and p["page_bytes"] == 2 * MiB)
    assert both["bytes_per_rep"] == 2 * 256 * MiB  # both directions' bytes count
    # compute slowdown: each method's loop sized to half its copy time, copies lasting twice the loop
    kernel = p["methods"]["kernel"]["compute"]
    assert kernel["slowdown"]["median"] == pytest.approx(0.25) and kernel["n"] == bench.COMPUTE_REPS
    assert kernel["overlapped"] == bench.COMPUTE_REPS
    copy_s = 256 * MiB / 52e9
    assert kernel["matmuls"] == round(0.5 * copy_s / FakeBench.MATMUL_S)
    assert kernel["copy_reps"] * copy_s >= 2 * kernel["matmuls"] * FakeBench.MATMUL_S
    assert kernel["copy_gbps_during"]["median"] == pytest.approx(52.0)
    assert p["methods"]["STREAM"]["compute"]["slowdown"]["median"] == pytest.approx(0.02)
    assert doc["config"]["compute"]["matmul_s"] == pytest.approx(FakeBench.MATMUL_S)
    assert backend.matmul_calls[:2] == [("alone", 1), ("alone", bench.MATMUL_PROBE)]  # warm-up, then the probe
    # every point's draws are distinct from the others' and from the repeat series'
    seeds = [s for _, s in backend.prepared]
    assert len(set(seeds)) == len(seeds)


def test_bench_tables_and_json(bench_doc, tmp_path):
    from rich.console import Console

    doc, _ = bench_doc
    console = Console(record=True, width=250)
    bench_render.render_tables(doc, console)
    text = console.export_text()
    assert "ANY/STREAM" in text and "1.010 [1.010, 1.010]" in text and "55.0" in text and "40.0*" in text
    assert "end-to-end" in text and "kernel" in text and "52.0" in text
    assert "compute slowdown" in text and "+25.0% (52.0)" in text and "+2.0% (50.0)" in text
    out = tmp_path / "bench.json"
    common.write_json(str(out), doc)
    loaded = json.loads(out.read_text())
    assert loaded["kind"] == "kvverify-bench"
    assert loaded["config"]["units"].startswith("GB/s = 1e9")
    assert loaded["points"][0]["methods"]["STREAM"]["samples_gbps"]


def test_bench_plot(bench_doc, tmp_path):
    pytest.importorskip("matplotlib")
    doc, _ = bench_doc
    path = tmp_path / "bench.png"
    bench_render.plot(doc, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_max_seconds_cuts_short(annotate_off):
    args = parse(bench, ["--page-sizes", "64KiB,2MiB", "--reps", "2", "--max-seconds", "1e-9"])
    doc = bench.run_bench(args, FakeBench(), {"batch_api_available": True}, annotate_off)
    assert doc["truncated"] and len(doc["points"]) <= 1


def test_bench_without_batch_api_measures_baselines_only(annotate_off):
    args = parse(bench, ["--page-sizes", "64KiB", "--reps", "2", "--directions", "h2d"])
    doc = bench.run_bench(args, FakeBench(), {"batch_api_available": False}, annotate_off)
    assert set(doc["points"][0]["methods"]) == {"loop", "kernel", "ceiling"}
    assert doc["points"][0]["any_over_stream"] is None and doc["points"][0]["repeat"] is None


class FailingBench(FakeBench):
    """DURING_API_CALL raises from its first call; ANY raises from its third held rep."""

    def __init__(self):
        super().__init__()
        self.recovered = 0
        self.any_calls = 0

    def held(self, issue, hold_ns):
        if issue.method == "DURING_API_CALL":
            raise RuntimeError("cuMemcpyBatchAsync: invalid argument\n(details)")
        if issue.method == "ANY":
            self.any_calls += 1
            if self.any_calls == 4:  # warm-up + 2 counted reps succeed
                raise RuntimeError("transient")
        return super().held(issue, hold_ns)

    def recover(self):
        self.recovered += 1


def test_bench_keeps_going_when_a_method_raises(annotate_off):
    from rich.console import Console

    args = parse(bench, ["--page-sizes", "64KiB", "--reps", "5", "--directions", "h2d", "--no-repeat"])
    backend = FailingBench()
    doc = bench.run_bench(args, backend, {"batch_api_available": True}, annotate_off)
    m = doc["points"][0]["methods"]
    assert m["DURING_API_CALL"]["error"] == "cuMemcpyBatchAsync: invalid argument (details)"
    assert m["DURING_API_CALL"]["gbps"]["n"] == 0
    assert m["ANY"]["error"] == "transient" and m["ANY"]["gbps"]["n"] == 2
    assert m["STREAM"]["gbps"]["n"] == 5 and m["STREAM"]["error"] is None
    assert backend.recovered == 2
    ratio = doc["points"][0]["any_over_stream"]
    assert ratio["n"] == 2 and ratio["low"] is None  # only the rounds where both ran: too few for an interval
    console = Console(record=True, width=250)
    bench_render.render_tables(doc, console)
    text = console.export_text()
    assert "error" in text and "stopped after 0 reps: cuMemcpyBatchAsync" in text and "(n=2: no CI)" in text


def test_write_json_turns_nan_into_null(tmp_path):
    out = tmp_path / "x.json"
    common.write_json(str(out), {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}})
    assert json.loads(out.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


# --------------------------------------------------------------------------- platform and the no-GPU refusal


def test_platform_collect_never_raises():
    info = platform_info.collect()
    for key in ("gpu_name", "driver_version", "cuda_driver_version", "cuda_runtime_version", "torch_version",
                "pcie", "batch_api_available", "errors"):
        assert key in info
    assert set(info["pcie"]) == {"gen_current", "width_current", "gen_max", "width_max", "gen_gpu_max"}
    assert isinstance(platform_info.describe(info), str)


def test_describe_platform():
    info = {"gpu_name": "NVIDIA H200", "driver_version": "580.159.03", "cuda_driver_version": "13.0",
            "torch_version": "2.11.0", "cuda_runtime_version": "13.0", "batch_api_available": True,
            "pcie": {"gen_current": 1, "width_current": 16, "gen_max": 5, "width_max": 16}}
    text = platform_info.describe(info)
    assert "PCIe Gen5 x16 (now Gen1 x16)" in text and "batch API yes" in text and "driver 580.159.03" in text


def test_render_platform_table():
    from rich.console import Console

    info = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0", "l2_cache_bytes": 62914560,
            "driver_version": "580.159.04", "cuda_driver_version": "13.0", "cuda_runtime_version": "13.0",
            "torch_version": "2.11.0", "python_version": "3.12.3", "batch_api_available": True,
            "pcie": {"gen_current": 5, "width_current": 16, "gen_max": 5, "width_max": 16}}
    console = Console(record=True, width=120)
    platform_info.render(info, console)
    text = console.export_text()
    for part in ("NVIDIA H200 (compute 9.0, L2 63 MB)", "580.159.04", "Gen5 x16", "present", "2.11.0 / 3.12.3"):
        assert part in text
    platform_info.render(platform_info.collect(), console)  # every field unknown here: still renders


def test_cuda_version_string():
    assert platform_info._cuda_version_string(13000) == "13.0"
    assert platform_info._cuda_version_string(12080) == "12.8"


@pytest.mark.parametrize("command", ["probe", "bench"])
def test_refusal_in_process(monkeypatch, capsys, command):
    monkeypatch.setattr(device, "gpu_refusal", lambda: "no CUDA device is visible (test)")
    module = {"probe": probe, "bench": bench}[command]
    assert module.run(parse(module, ["--json", "/nonexistent/never-written.json"])) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"kvverify {command}: cannot run: no CUDA device is visible (test)"


_MAIN_MINE = (
    "import sys; from kvverify import cli; "
    "cli.SUBCOMMANDS = {k: v for k, v in cli.SUBCOMMANDS.items() if k in ('probe', 'bench')}; "
    "sys.exit(cli.main(sys.argv[1:]))"
)


@pytest.mark.parametrize("argv", [["probe"], ["bench", "--quick", "--plot", "x.png", "--json", "x.json"]])
def test_refusal_without_a_cuda_device(argv, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _MAIN_MINE, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvverify {argv[0]}: cannot run: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "x.png").exists()
    assert "no CUDA device" in lines[0]


def test_refusal_through_the_real_entry_point(tmp_path):
    """``python -m kvverify probe`` as a user runs it (needs every registered subcommand's module)."""
    import importlib

    for module, _ in cli.SUBCOMMANDS.values():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            pytest.skip(f"another subcommand's module has not landed yet: {exc}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "kvverify", "probe"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
