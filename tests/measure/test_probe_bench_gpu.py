"""GPU smoke tests of ``kvverify probe`` and ``kvverify bench`` (marker ``gpu``; skipped without a
CUDA device and the built extension). Together they take a few seconds on an H200."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from kvverify.device import platform_info
from kvverify.measure import bench, probe

pytestmark = pytest.mark.gpu


def parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_platform_on_gpu():
    info = platform_info.collect()
    assert info["gpu_name"] != "unknown"
    assert info["cuda_driver_version"] != "unknown"
    assert isinstance(info["batch_api_available"], bool)


def test_probe_gives_a_complete_table(tmp_path):
    out = tmp_path / "probe.json"
    assert probe.run(parse(probe, ["--reps", "3", "--hold-ms", "10", "--json", str(out)])) == 0
    doc = json.loads(out.read_text())
    assert len(doc["cells"]) == 2 * 3 * 3
    seen = {(c["direction"], c["order"], c["host_memory"]) for c in doc["cells"]}
    assert len(seen) == 18
    for cell in doc["cells"]:
        assert cell["reps"] == 3 and len(cell["trials"]) == 3
        assert cell["source_read"]["value"] in (*probe.READ_VALUES, "split")
        assert cell["blocks"]["value"] in ("yes", "no", "error", "split")
    by = {(c["direction"], c["order"], c["host_memory"]): c for c in doc["cells"]}
    if doc["platform"]["batch_api_available"]:
        for direction in ("h2d", "d2h"):
            for kind in ("pinned", "registered"):
                assert not by[(direction, "STREAM", kind)]["errors"], by[(direction, "STREAM", kind)]["errors"]
        # STREAM order is a guarantee: the copy must see the pending writer's bytes ...
        assert by[("d2h", "STREAM", "pinned")]["source_read"]["value"] == "stream"
        # ... and, when the call returned before the hold ended, the host bytes rewritten after the call.
        h2d = by[("h2d", "STREAM", "pinned")]
        if h2d["blocks"]["value"] == "no":
            assert h2d["source_read"]["value"] == "stream"


def test_bench_quick_runs_one_point(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--quick", "--page-sizes", "64KiB", "--directions", "h2d", "--reps", "6", "--pool-bytes", "512MiB",
            "--json", str(out)]
    png = tmp_path / "bench.png"
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    assert bench.run(parse(bench, argv)) == 0
    doc = json.loads(out.read_text())
    assert len(doc["points"]) == 1 and not doc["truncated"]
    point = doc["points"][0]
    assert point["page_bytes"] == 64 * 1024 and point["direction"] == "h2d"
    for name, method in point["methods"].items():
        assert method["error"] is None, (name, method["error"])
        assert method["gbps"]["n"] == 6 and method["gbps"]["median"] > 0, name
        assert method["e2e_gbps"]["median"] > 0, name
        assert not math.isnan(method["gbps"]["median"])
    assert doc["ceiling_gbps"]["h2d"] > 1.0  # GB/s; any PCIe link moves more
    if doc["platform"]["batch_api_available"]:
        ratio = point["any_over_stream"]  # 6 pairs: the fewest that give a 95% interval
        assert ratio["low"] <= ratio["median"] <= ratio["high"]
        assert point["repeat"] is not None and point["repeat"]["second_gbps"] > 0
    if png is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_calibrate_small_grid_on_the_device(tmp_path):
    """A small calibration: every path runs in every direction and both at once, the paths document
    reads back, and the kernel path's compute slowdown is measured."""
    from kvverify.measure import calibration

    out, paths_out = tmp_path / "bench.json", tmp_path / "paths.json"
    argv = ["--calibrate", "--compute", "--page-sizes", "16KiB,256KiB", "--pages-per-call", "16,1024", "--reps", "3",
            "--pool-bytes", "512MiB", "--json", str(out), "-o", str(paths_out)]
    assert bench.run(parse(bench, argv)) == 0
    doc = json.loads(out.read_text())
    assert {p["direction"] for p in doc["points"]} == {"h2d", "d2h", "both"} and not doc["skipped_points"]
    for point in doc["points"]:
        for name, method in point["methods"].items():
            assert method["error"] is None, (point["label"], name, method["error"])
            assert method["gbps"]["median"] > 0 and method["compute"]["n"] == 3, (point["label"], name)
    paths = calibration.load(paths_out)
    assert len(paths["entries"]) == len(doc["points"]) and not paths["unmeasured"]
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(paths, json.loads((Path(bench.__file__).parents[1] / "schemas" / "paths-v1.json").read_text()))
