"""``kvverify bench --calibrate``: the paths document from bench results (fake backends), its schema,
reading it back, and choosing a path for a shape the way a serving engine would. Reading back and
choosing from a malformed document: ``test_calibration_load.py``."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_probe_bench_cli import FakeBench, parse

from kvverify.measure import bench, bench_render, calibration, common

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1024, 1024**2


class SizedBench(FakeBench):
    """The H200's shape of things: the batch pays per page on H2D (3.7 GB/s at 16 KiB, the link from
    about 256 KiB), the kernel runs near the link from 16 KiB; ANY 1% above STREAM."""

    def rate(self, method: str, point) -> float:
        if method in ("STREAM", "ANY", "DURING_API_CALL") and point.direction != "d2h":
            base = min(54.0, 3.7 * point.page_bytes / (16 * KiB))
            return base * (1.01 if method == "ANY" else 1.0)
        return self.RATES[method] if point.page_bytes >= 16 * KiB or method != "kernel" else 30.0

    def held(self, issue, hold_ns):
        return issue.point.rep_bytes / (self.rate(issue.method, issue.point) * 1e9), 1e-4, True

    def end_to_end(self, issue):
        return issue.point.rep_bytes / (self.rate(issue.method, issue.point) * 1e9) + 1e-5


@pytest.fixture
def paths(annotate_off):
    args = parse(bench, ["--calibrate", "--page-sizes", "4KiB,16KiB,256KiB,2MiB", "--pages-per-call", "16,4096"])
    doc = bench.run_bench(args, SizedBench(), {"batch_api_available": True, "gpu_name": "fake"}, annotate_off)
    return calibration.build(doc)


@pytest.fixture
def annotate_off():
    from kvverify import annotate

    annotate.configure(False)
    yield annotate
    annotate._reset_for_tests()


def entry(paths, direction, page, pages):
    return next(e for e in paths["entries"]
                if (e["direction"], e["page_bytes"], e["pages_per_call"]) == (direction, page, pages))


def test_best_and_runner_up_are_safe_paths_ranked_end_to_end(paths):
    assert paths["kind"] == "kvverify-paths" and paths["version"] == 1 and paths["ranked_by"] == "e2e_gbps"
    for e in paths["entries"]:
        assert e["best"]["path"] in calibration.SAFE_PATHS and e["runner_up"]["path"] in calibration.SAFE_PATHS
        assert e["best"]["gbps"] >= e["runner_up"]["gbps"]
        assert e["best"]["gbps"] == max(c["gbps"] for c in e["candidates"].values())
        assert set(e["candidates"]) == {"STREAM", "loop", "kernel"}
    small = entry(paths, "h2d", 16 * KiB, 4096)
    assert small["best"]["path"] == "kernel" and small["best"]["call"] == {"method": "kernel"}
    assert small["runner_up"]["path"] == "loop"  # 20 GB/s against the batch's 3.7
    big = entry(paths, "h2d", 2 * MiB, 16)
    assert big["best"]["path"] == "STREAM" and big["best"]["call"] == {"method": "batch", "src_access_order": "STREAM"}
    assert entry(paths, "both", 16 * KiB, 16)["best"]["path"] == "kernel"


def test_any_is_offered_for_loads_only_and_only_where_it_wins(paths):
    big = entry(paths, "h2d", 2 * MiB, 16)
    assert big["if_host_source_untouched"]["path"] == "ANY"  # 1% above STREAM, the best there
    assert big["if_host_source_untouched"]["call"] == {"method": "batch", "src_access_order": "ANY"}
    assert entry(paths, "h2d", 16 * KiB, 16)["if_host_source_untouched"] is None  # the kernel is faster
    assert all(e["if_host_source_untouched"] is None for e in paths["entries"] if e["direction"] != "h2d")


def test_the_document_follows_its_schema(paths, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "kvverify" / "schemas" / "paths-v1.json").read_text())
    out = tmp_path / "paths.json"
    common.write_json(str(out), paths)
    doc = calibration.load(out)
    jsonschema.validate(doc, schema)
    broken = json.loads(out.read_text())
    broken["entries"][0]["best"]["path"] = "DURING_API_CALL"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_every_call_is_a_valid_call_of_the_op():
    from kvverify.device import ops

    for path, call in calibration.CALLS.items():
        inspect.signature(ops.swap_blocks_batch).bind([8], [16], [8], **call)
        assert call["method"] in ops.METHODS
        assert ops.resolve_order(call.get("src_access_order"), None).name == (path if path in ("STREAM", "ANY") else "STREAM")


def test_choose_takes_the_nearest_shape(paths):
    assert calibration.choose(paths, "h2d", 16 * KiB, 4096) is entry(paths, "h2d", 16 * KiB, 4096)
    # 20 KiB is nearest 16 KiB on a log scale; 1000 pages nearest 4096 (log2 distance 2.0 against 5.97)
    assert calibration.choose(paths, "h2d", 20 * KiB, 1000) is entry(paths, "h2d", 16 * KiB, 4096)
    assert calibration.choose(paths, "d2h", 8 * MiB, 1) is entry(paths, "d2h", 2 * MiB, 16)
    # a tie between 4 KiB and 16 KiB (8 KiB) goes to the smaller page
    assert calibration.choose(paths, "both", 8 * KiB, 16)["page_bytes"] == 4 * KiB
    with pytest.raises(ValueError, match="no calibration entry for direction 'sideways'"):
        calibration.choose(paths, "sideways", 4096, 16)
    with pytest.raises(ValueError, match="positive"):
        calibration.choose(paths, "h2d", 0, 16)


def test_points_without_a_safe_path_are_listed(annotate_off):
    args = parse(bench, ["--calibrate", "--page-sizes", "64KiB", "--pages-per-call", "16", "--directions", "h2d",
                         "--orders", "ANY", "--no-loop", "--no-kernel"])
    doc = bench.run_bench(args, SizedBench(), {"batch_api_available": True}, annotate_off)
    paths = calibration.build(doc)
    assert paths["entries"] == [] and paths["unmeasured"] == ["h2d 65536 B x 16: every path raised"]


def test_a_capped_calibration_names_the_shapes_it_did_not_reach(annotate_off):
    """--max-seconds stops a calibration between points: the paths document lists what it left out
    (an engine must not take a missing shape for a measured one)."""
    args = parse(bench, ["--calibrate", "--page-sizes", "16KiB,64KiB", "--pages-per-call", "16", "--directions", "h2d",
                         "--max-seconds", "1e-9"])  # past before the first point
    doc = bench.run_bench(args, SizedBench(), {"batch_api_available": True}, annotate_off)
    assert doc["truncated"] and doc["points"] == [] and len(doc["points_not_reached"]) == 2
    paths = calibration.build(doc)
    assert paths["entries"] == []
    assert paths["unmeasured"] == ["h2d 16384 B x 16: not reached (--max-seconds)",
                                   "h2d 65536 B x 16: not reached (--max-seconds)"]
    # a document of measured points plus the ones the cap left out: both kinds are listed
    full = bench.run_bench(parse(bench, ["--calibrate", "--page-sizes", "16KiB", "--pages-per-call", "16",
                                         "--directions", "h2d"]), SizedBench(), {"batch_api_available": True},
                           annotate_off)
    full["points_not_reached"] = doc["points_not_reached"][1:]
    paths = calibration.build(full)
    assert [e["page_bytes"] for e in paths["entries"]] == [16 * KiB]
    assert paths["unmeasured"] == ["h2d 65536 B x 16: not reached (--max-seconds)"]


def test_load_and_build_refuse_other_documents(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"kind": "kvverify-bench", "version": 1}))
    with pytest.raises(ValueError, match="not a kvverify-paths document"):
        calibration.load(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        calibration.load(bad)
    with pytest.raises(ValueError, match="not a kvverify bench document"):
        calibration.build({"kind": "kvverify-probe"})


def test_calibration_table(paths):
    from rich.console import Console

    console = Console(record=True, width=200)
    bench_render.render_calibration(paths, console)
    text = console.export_text()
    assert "fastest safe path per shape" in text and "kernel 52.0" in text and "ANY 54.5" in text


def test_crossovers_between_the_kernel_and_the_batch(paths, annotate_off):
    args = parse(bench, ["--calibrate", "--page-sizes", "16KiB,256KiB,2MiB", "--pages-per-call", "16",
                         "--directions", "h2d"])
    doc = bench.run_bench(args, SizedBench(), {"batch_api_available": True}, annotate_off)
    # the kernel (52) leads at 16 KiB, the batch (54) from 256 KiB: one crossover, between those two sizes
    assert bench_render.crossovers(doc["points"], "kernel", "STREAM") == [(16 * KiB, 256 * KiB)]
    assert bench_render.crossovers(doc["points"], "kernel", "loop") == []


def test_output_needs_calibrate(capsys):
    assert bench.run(parse(bench, ["-o", "paths.json"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvverify bench: -o/--output writes the paths document of --calibrate; add --calibrate (or use --json)"]


def test_engines_read_the_document_without_heavy_imports(paths, tmp_path):
    out = tmp_path / "paths.json"
    common.write_json(str(out), paths)
    code = ("import sys; from kvverify.measure import calibration; "
            f"e = calibration.choose(calibration.load({str(out)!r}), 'h2d', 16384, 4096); print(e['best']['path']); "
            "print(sorted(m for m in ('torch', 'numpy', 'rich') if m in sys.modules))")
    out_text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.split("\n")
    assert out_text[0] == "kernel" and out_text[1] == "[]"


class SlowKernelBench(SizedBench):
    def rate(self, method, point):
        return 40.0 if method == "kernel" else super().rate(method, point)


@pytest.mark.parametrize("backend, kernel_line", [
    (SizedBench, "kernel 52.0 GB/s (>= 45: met); STREAM 3.7 GB/s; kernel/STREAM 14.1x event-timed, "
                 "end to end 51.9/3.7 = 14.0x (>= 10x: met)"),
    (SlowKernelBench, "kernel 40.0 GB/s (>= 45: NOT MET); STREAM 3.7 GB/s; kernel/STREAM 10.8x event-timed, "
                      "end to end 39.9/3.7 = 10.8x (>= 10x: met)"),
])
def test_the_targets_benchmark_prints_each_figure_against_its_target(backend, kernel_line, paths, annotate_off,
                                                                       tmp_path):
    doc = bench.run_bench(parse(bench, ["--quick", "--no-repeat", "--reps", "3", "--matmul-size", "16"]), backend(),
                          {"batch_api_available": True, "gpu_name": "fake"}, annotate_off)
    common.write_json(str(tmp_path / "bench.json"), doc)
    common.write_json(str(tmp_path / "paths.json"), paths)
    text = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_copy_paths.py"), str(tmp_path / "bench.json"),
                           str(tmp_path / "paths.json")], capture_output=True, text=True, check=True).stdout
    assert f"h2d 4096 pages/call: {kernel_line}" in text
    # 2 MiB H2D: the batch at 54 of 55 GB/s; 16 KiB D2H with a 40 GB/s kernel: STREAM's 50 is the best safe path
    assert "h2d     2 MiB x    32: STREAM 54.0 of 55.0 GB/s = 98.2%: met" in text
    assert "d2h    16 KiB x  4096: " + ("kernel 52.0" if backend is SizedBench else "STREAM 50.0") in text
    assert "kernel +25.0%" in text and "4. calibration" in text
