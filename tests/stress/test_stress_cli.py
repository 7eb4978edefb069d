"""``kvverify stress`` without a GPU: contract verdicts of every cell, observed columns not run,
one line saying so, exit 0; bad options exit 2 with the reason. Also the runner's planning."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from help_screen import check_screen, help_lines

from kvverify.geometry import KVLayout, ModelGeometry, preset
from kvverify.scenarios import SCENARIOS, Params
from kvverify.stress import planning
from kvverify.stress.campaign import CampaignError, load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stress(*args, cwd=ROOT):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", COLUMNS="240", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "kvverify", "stress", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_bare_stress_without_gpu_prints_contracts_and_exits_0(tmp_path):
    out = tmp_path / "r.json"
    junit = tmp_path / "r.xml"
    p = stress("--json", str(out), "--junit", str(junit))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("Nothing ran on a device: no CUDA device is visible"), p.stdout[:2000]
    assert sum(line.startswith("Contract verdicts only") for line in lines) == 1, p.stdout[:2000]
    doc = json.loads(out.read_text())
    scenario_directions = sum(len(s.directions) for s in SCENARIOS.values())
    n_cells = scenario_directions * (3 * 3 * 2 + 2)  # the kernel path: STREAM cells, pinned and registered
    assert len(doc["cells"]) == n_cells
    assert all(c["observed"] is None and c["verdict"] == "NOT_RUN" for c in doc["cells"])
    assert {c["contract"]["verdict"] for c in doc["cells"]} == {"SAFE", "RACY"}
    assert doc["campaign"] == "smoke" and doc["not_run_reason"] and doc["exit_status"] == 0
    # nothing was observed: the headline is the contracts' prediction, not a finding
    assert doc["headline"]["holds"] is None, doc["headline"]["text"]
    assert junit.read_text().count("<testcase") == n_cells
    headline = next(line for line in lines if line.startswith("Headline: "))
    assert headline.startswith("Headline: on paper only: no cell ran. The contracts predict that ANY is safe "), headline
    assert "YES" not in p.stdout and "NO:" not in p.stdout
    any_doc = [c for c in doc["cells"] if c["order"] == "ANY"]
    shown = {(c["scenario"], c["direction"], c["host_memory"]) for c in any_doc}
    # the matrix shows one cell per form and host memory; the count of executors' cells is explained
    assert f"of the matrix's {len(shown)} ANY cells are SAFE on paper (" in headline
    assert f" of {len(any_doc)} counting each executor's cell" in headline and len(any_doc) > len(shown)
    assert not any(line.startswith("NVTX") for line in lines), p.stdout  # no range marked any device work


def test_json_follows_the_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from kvverify.stress.report import load_schema

    out = tmp_path / "r.json"
    assert stress("--scenarios", "H3", "--json", str(out)).returncode == 0
    jsonschema.validate(json.loads(out.read_text()), load_schema())


def test_selection_options_shape_the_cells(tmp_path):
    out = tmp_path / "r.json"
    p = stress("--scenarios", "H1-fixed,P2", "--orders", "ANY", "--host-memory", "pageable",
               "--executors", "adversarial", "--model", "qwen2.5-7b", "--json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    cells = {(c["scenario"], c["order"], c["host_memory"], c["executor"]): c["contract"]["verdict"] for c in doc["cells"]}
    assert cells == {("H1-fixed", "ANY", "pageable", "adversarial"): "RACY",
                     ("P2", "ANY", "pageable", "adversarial"): "SAFE"}
    assert doc["layout"]["model"] == "qwen2.5-7b"


def test_model_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "hidden_size": 512, "torch_dtype": "bfloat16"}))
    out = tmp_path / "r.json"
    p = stress("--model-config", str(cfg), "--scenarios", "P2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["layout"]["num_layers"] == 4


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--orders", "FOO"], "argument --orders: unknown 'FOO' in 'FOO'; choose from STREAM,DURING_API_CALL,ANY"),
        (["--orders", "STREAM,,ANY"], "argument --orders: an empty name in 'STREAM,,ANY'"),
        (["--host-memory", "managed"], "choose from pinned,registered,pageable (comma-separated) or all"),
        (["--gpu-mem", "lots"], "argument --gpu-mem: 'lots' is not a size"),
        (["--trials", "0"], "argument --trials: must be at least 1"),
        (["--campaign", "nope"], "no campaign named 'nope'"),
        (["--scenarios", "H9"], "unknown scenario 'H9'"),
        (["--model", "gpt5"], "unknown model preset 'gpt5'"),
        (["--transfers", "1"], "command line: transfers"),
        (["--data", "random"], "--data random checks by checksums and runs with the native executor only"),
        (["--gpu-mem", "1KiB"], "does not fit --gpu-mem 1 KiB / --host-mem 6 GiB;"),  # sizes in units, as given
        (["--model-config", "/nonexistent/config.json"], "config.json: cannot read"),
    ],
)
def test_argument_errors_exit_2_with_the_reason(args, reason):
    p = stress(*args)
    assert p.returncode == 2, (p.stdout[-500:], p.stderr)
    assert reason in " ".join(p.stderr.split()), p.stderr


def test_dumped_traces_check_with_kvverify_check(tmp_path):
    folder = tmp_path / "traces"
    assert stress("--scenarios", "P1", "--host-memory", "pinned", "--dump-traces", str(folder)).returncode == 0
    files = sorted(folder.glob("*.json"))
    assert [f.name for f in files] == sorted(f"P1_store_{o}_pinned.json" for o in ("ANY", "DURING_API_CALL", "STREAM"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for f in files:
        rc = subprocess.run([sys.executable, "-m", "kvverify", "check", str(f)], capture_output=True, env=env).returncode
        assert rc == (0 if "STREAM" in f.name else 1), f.name


# -- runner, no GPU ---------------------------------------------------------------------------

TINY = KVLayout(ModelGeometry("tiny", 2, 2, 64, 2), block_size=16)


def test_plan_gives_every_executor_the_same_contract():
    c = load("smoke").override(scenarios=("H5",))
    planned = planning.plan(c, TINY)
    assert len(planned) == 2 * 3 * 3 * 2 + 2 * 2  # native and adversarial everywhere; kernel: STREAM, pinned and registered
    by_key = {}
    for pc in planned:
        key = (pc.cell.scenario, pc.cell.order, pc.cell.host_memory)
        assert by_key.setdefault(key, pc.contract) == pc.contract
        assert (pc.witness is None) == (pc.contract == "SAFE")
    assert by_key[("H5-broken", "ANY", "pinned")] == "RACY"
    assert by_key[("H5-broken", "STREAM", "pinned")] == "SAFE"


def test_the_kernel_path_runs_stream_cells_a_kernel_can_reach():
    for order in ("STREAM", "DURING_API_CALL", "ANY"):
        for host in ("pinned", "registered", "pageable"):
            assert planning.runs("native", order, host) and planning.runs("adversarial", order, host)
            assert planning.runs("kernel", order, host) == (order == "STREAM" and host != "pageable")
    c = load("smoke").override(orders=("ANY",), executors=("kernel", "native"))
    assert {pc.cell.executor for pc in planning.plan(c, TINY)} == {"native"}  # no STREAM cell: no kernel cell


def test_trials_reach_the_checked_bytes_within_bounds():
    c = load("smoke").override(trials=2, max_trials=10, min_checked=2**20)
    assert planning.trials_for(c, 2**18, "native") == 4
    assert planning.trials_for(c, 2**30, "native") == 2
    assert planning.trials_for(c, 2**30, "adversarial") == 3  # each schedule once
    assert planning.trials_for(c, 2**30, "kernel") == 2  # one path, no schedules
    assert planning.trials_for(c, 1, "native") == 10


def test_fit_params_shrinks_blocks_to_the_memory_caps():
    layout = KVLayout(preset("llama-3.1-8b"))
    c = load("smoke")
    params, note = planning.fit_params(c, layout)
    assert params == Params(c.blocks_per_transfer, 4) and note is None
    small = c.override(host_mem=64 * 2**20)
    params, note = planning.fit_params(small, layout)
    assert params.blocks_per_transfer < c.blocks_per_transfer
    assert f"blocks_per_transfer lowered from {c.blocks_per_transfer}" in note
    with pytest.raises(CampaignError, match="does not fit"):
        planning.fit_params(c.override(gpu_mem=2**20), layout)


def test_fit_params_finds_the_largest_fitting_blocks_quickly():
    """Asking for more never gives fewer: the result is the largest count that fits, and an
    absurd request is bounded by the memory caps before any program is built."""
    import time

    layout = KVLayout(preset("llama-3.1-8b"))
    small = load("smoke").override(host_mem=64 * 2**20)
    got = {n: planning.fit_params(small.override(blocks_per_transfer=n), layout)[0].blocks_per_transfer
           for n in (3, 5, 200, 1000, 5000)}
    best = got[5000]
    assert got == {3: min(3, best), 5: min(5, best), 200: best, 1000: best, 5000: best}
    programs = [s.program(d, Params(best + 1, small.transfers)) for s in SCENARIOS.values() for d in s.directions]
    sizes = planning.pool_sizes(programs, layout, staged=True)
    host = sizes.host_bytes(layout) + sizes.snapshot_pages * layout.page_bytes  # + the adversarial snapshot area
    assert host > small.host_mem  # best + 1 would not fit
    start = time.monotonic()
    params, note = planning.fit_params(load("smoke").override(blocks_per_transfer=10**8), layout)
    assert time.monotonic() - start < 30 and "lowered from 100000000" in note
    assert params.blocks_per_transfer <= load("smoke").gpu_mem // layout.block_bytes


def test_pool_sizes_cover_every_program():
    programs = [s.program(d, Params(4, 3)) for s in SCENARIOS.values() for d in s.directions]
    sizes = planning.pool_sizes(programs, TINY, staged=True)
    assert sizes.gpu_slots == max(p.gpu_slots for p in programs)
    assert sizes.staging_pages >= sizes.host_slots * TINY.num_tensors
    assert planning.pool_sizes(programs, TINY, staged=False).staging_pages == 0


def test_no_gpu_flag_gives_contract_verdicts_only():
    p = stress("--no-gpu", "--scenarios", "P2", "--orders", "ANY")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "Nothing ran on a device: --no-gpu was given."


@pytest.mark.parametrize("option", ["--json", "--junit"])
@pytest.mark.parametrize("where", ["directory", "missing-folder"])
def test_unwritable_report_paths_refuse_before_the_run(tmp_path, option, where):
    path = tmp_path if where == "directory" else tmp_path / "no" / "such" / "report.out"
    result = stress("--no-gpu", option, str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvverify stress: cannot start: {option} ")
    assert "Traceback" not in result.stderr and "Contract" not in result.stdout  # nothing ran


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_a_report_that_cannot_be_written_after_the_run_is_exit_2_in_one_line(option):
    result = stress("--no-gpu", option, "/dev/full")  # writable when checked, full when written
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Contract" in result.stdout  # the run ran, its verdicts shown
    said = " ".join(result.stderr.split())
    assert said == (f"kvverify stress: {option} /dev/full: cannot be written (No space left on device); "
                    "the run's verdicts are above"), result.stderr


def test_json_dash_writes_the_report_to_stdout(tmp_path):
    result = stress("--no-gpu", "--json", "-", cwd=tmp_path)
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["cells"] and not (tmp_path / "-").exists()


def test_each_file_written_is_said_in_one_line_with_where_it_went(tmp_path):
    """--json, --junit, --plot and --dump-traces once wrote their files without a word: each says
    on stderr what went where (a path too long for the screen stays whole)."""
    pytest.importorskip("matplotlib")  # --plot draws a PNG
    deep = tmp_path / ("a folder name long enough to pass the edge of any screen " * 3).strip()
    deep.mkdir()
    paths = {name: deep / name for name in ("r.json", "r.xml", "m.png", "traces")}
    p = stress("--no-gpu", "--scenarios", "H3", "--json", str(paths["r.json"]), "--junit", str(paths["r.xml"]),
               "--plot", str(paths["m.png"]), "--dump-traces", str(paths["traces"]))
    assert p.returncode == 0, p.stderr
    traces = len(list(paths["traces"].iterdir()))
    for line in (f"report written to {paths['r.json']}", f"JUnit XML written to {paths['r.xml']}",
                 f"matrix plot written to {paths['m.png']}", f"{traces} traces written to {paths['traces']}"):
        assert f"kvverify stress: {line}\n" in p.stderr, p.stderr
    assert traces > 0 and all(path.exists() for path in paths.values())
    assert "written to" not in stress("--no-gpu", "--scenarios", "H3", "--json", "-").stderr  # stdout is no file


def test_model_config_without_dtype_takes_kv_cache_dtype(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "hidden_size": 1024}))
    missing = stress("--no-gpu", "--model-config", str(config))
    assert missing.returncode == 2 and "--kv-cache-dtype" in missing.stderr
    assert stress("--no-gpu", "--model-config", str(config), "--kv-cache-dtype", "bfloat16").returncode == 0
    both = stress("--no-gpu", "--model", "llama-3.1-8b", "--model-config", str(config))
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_dump_traces_into_a_file_refuses_before_the_run(tmp_path):
    existing = tmp_path / "afile"
    existing.write_text("")
    result = stress("--no-gpu", "--dump-traces", str(existing))
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvverify stress: cannot start: --dump-traces {existing}: exists and is not a folder; give a folder path"


def test_details_prints_one_row_per_cell_with_its_witness():
    p = stress("--no-gpu", "--scenarios", "H3", "--orders", "ANY", "--host-memory", "pinned", "--details")
    assert p.returncode == 0, p.stderr
    assert "H3-broken load/H2D/ANY/pinned/adversarial" in p.stdout and "Verdict" in p.stdout
    assert "[1] ops " in p.stdout  # the witness of the RACY contract, numbered
    assert "Observed columns not run: --no-gpu was given; contract verdicts only." in p.stdout
    header = next(line for line in p.stdout.splitlines() if "Cell" in line)
    assert header.split("┃")[1:-1] and [c.strip() for c in header.split("┃")[1:-1]] == ["Cell", "Contract", "Verdict"]


def test_plot_writes_the_matrix_as_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "matrix.png"
    p = stress("--no-gpu", "--scenarios", "H1,H3", "--orders", "STREAM,ANY", "--plot", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_before_the_run(tmp_path):
    p = stress("--no-gpu", "--plot", str(tmp_path / "no" / "such" / "m.png"))
    assert p.returncode == 2 and p.stderr.startswith("kvverify stress: cannot start: --plot ")
    assert "Contract" not in p.stdout  # nothing ran


def test_help_fits_a_screen_in_plain_text_and_ends_with_an_example(tmp_path):
    (example,) = check_screen(help_lines("stress"))
    # the example runs as written (without a device: contract verdicts), writing the files it names
    pytest.importorskip("matplotlib")  # it draws a PNG
    args = example.split()[2:]
    done = stress("--no-gpu", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(a for a in args if a.endswith((".json", ".png")))


def test_plot_without_matplotlib_refuses_before_the_run(monkeypatch, tmp_path, capsys):
    import importlib.util

    from kvverify import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["stress", "--no-gpu", "--plot", str(tmp_path / "m.png")]) == 2
    captured = capsys.readouterr()
    assert "cannot start: --plot needs matplotlib" in captured.err and "Nothing ran" not in captured.out


def test_without_a_device_each_preset_s_matrix_is_printed_once():
    p = stress("--no-gpu", "--campaign", "nightly")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert sum(line.startswith("Contract verdicts only") for line in lines) == 1, p.stdout[:3000]
    same = [line for line in lines if "the same contract verdicts as llama-3.1-8b" in line]
    assert len(same) == 5 and all(line.startswith("kvverify stress: nightly (") for line in same), p.stdout[-2000:]
    assert len(lines) <= 60


def test_json_dash_with_several_presets_refuses_before_the_run():
    p = stress("--no-gpu", "--campaign", "nightly", "--json", "-")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().startswith("kvverify stress: cannot start: --json - writes one JSON document, and "
                                       "campaign nightly runs 6 model presets")
