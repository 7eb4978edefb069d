"""The report a person reads: the verdict matrix (``kvverify.stress.matrix``), the terminal view
(``render_matrix``) and the PNG (``kvverify.stress.plot``), checked on the H200's smoke report
(``tests/data/stress-smoke-h200.json``), on runs cut short, and in a pseudo-terminal of 100 columns."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from terminal import check_fits, pythonpath, run_in_pty

from kvverify.stress import matrix
from kvverify.stress.render import MAX_LISTED, render_matrix
from kvverify.stress.report import Cell, CellResult, Observation, Platform, StressReport

ROOT = Path(__file__).resolve().parents[2]
H200_SMOKE = ROOT / "tests" / "data" / "stress-smoke-h200.json"
WITNESS = "ops 3 and 4 (RAW): nothing orders the source read after the write"


def h200_smoke() -> StressReport:
    return StressReport.from_json(json.loads(H200_SMOKE.read_text()))


def cut_short(report: StressReport, ran: int) -> StressReport:
    """``report`` as if the run had stopped after its first ``ran`` cells."""
    cells = [r if i < ran else dataclasses.replace(r, observation=None) for i, r in enumerate(report.cells)]
    return dataclasses.replace(report, cells=tuple(cells))


def shown(report: StressReport, width: int = 100) -> list[str]:
    console = Console(record=True, width=width, color_system=None)
    render_matrix(report, console)
    return console.export_text().splitlines()


def observed(trials: int, bad: int = 0) -> Observation:
    blocks = trials * 4
    return Observation(trials=trials, corrupted_trials=bad, blocks_checked=blocks, bytes_checked=blocks * 4096,
                       ok=blocks - bad, stale=bad, torn=0, garbage=0, elapsed_s=0.5)


def report_of(rows: list[tuple[str, str, str, str, str, str, Observation | None]], **kwargs) -> StressReport:
    """rows: (scenario, direction, order, host memory, executor, contract, observation)."""
    cells = [CellResult(Cell(s, d, o, h, e), c, WITNESS if c == "RACY" else None, obs) for s, d, o, h, e, c, obs in rows]
    return StressReport(platform=Platform(gpu="test GPU"), campaign="t", seed=0, cells=tuple(cells), **kwargs)


# -- the matrix ------------------------------------------------------------------------------


def test_matrix_of_the_h200_smoke():
    grid = matrix.build(h200_smoke())
    assert not grid.contract_only and grid.executors == ("native", "adversarial")
    assert len(grid.rows) == 18 and [r.direction for r in grid.rows[:7]] == ["store"] * 7
    assert len(grid.columns) == 9  # every order's host memory kinds differ somewhere on the device
    h1 = matrix.Row("H1-broken", "store")
    assert grid.glyphs(h1, matrix.Column("ANY", ("pinned",))) == "ox"  # native quiet, adversarial confirms
    assert grid.glyphs(matrix.Row("P2", "load"), matrix.Column("ANY", ("pageable",))) == ".."
    assert set(grid.keys) == {"SAFE_CONFIRMED", "CONFIRMED_RACE", "NO_RACE_OBSERVED"}


def test_the_legend_explains_all_only_where_a_column_merges_kinds():
    merged = shown(cut_short(h200_smoke(), 0))  # contract only: DURING_API_CALL's kinds agree
    assert any(line.startswith("Host memory:") and "all: every kind alike" in line for line in merged)
    assert any(re.match(r"\s+pin reg pag\s+all\b", line) for line in merged)
    per_kind = shown(h200_smoke())  # every order's kinds differ somewhere on the device: no "all" column
    host = [line for line in per_kind if line.startswith("Host memory:")]
    assert host == ["Host memory: pin pinned, reg registered, pag pageable"]


def test_contract_matrix_has_one_mark_per_cell_and_collapses_kinds_that_agree():
    report = cut_short(h200_smoke(), 0)
    grid = matrix.build(report)
    assert grid.contract_only and grid.executors == ()
    during = [c for c in grid.columns if c.order == "DURING_API_CALL"]
    assert during == [matrix.Column("DURING_API_CALL", ("pinned", "registered", "pageable"))]
    assert len([c for c in grid.columns if c.order == "STREAM"]) == 3  # H3-broken, H5-broken differ by kind
    assert grid.glyphs(matrix.Row("H5-broken", "load"), matrix.Column("STREAM", ("pageable",))) == "x"
    assert grid.glyphs(matrix.Row("H5-broken", "load"), matrix.Column("STREAM", ("pinned",))) == "."
    assert len(matrix.build(report, collapse=False).columns) == 9


def test_matrix_takes_its_executors_and_columns_from_the_data():
    report = report_of([
        ("H3-fixed", "load", "ANY", "pinned", "adversarial", "SAFE", observed(3)),
        ("H3-fixed", "load", "STREAM", "pinned", "adversarial", "SAFE", observed(3)),
        ("H1-broken", "store", "ANY", "pinned", "adversarial", "RACY", observed(3, bad=2)),
    ])
    grid = matrix.build(report)
    assert grid.executors == ("adversarial",)
    assert [c.order for c in grid.columns] == ["STREAM", "ANY"]  # ORDERS order; no DURING_API_CALL column
    assert [r.scenario for r in grid.rows] == ["H1-broken", "H3-fixed"]  # stores first
    assert grid.cells[(matrix.Row("H1-broken", "store"), matrix.Column("STREAM", ("pinned",)))] == (None,)
    assert grid.glyphs(matrix.Row("H1-broken", "store"), matrix.Column("ANY", ("pinned",))) == "x"


# -- the terminal view -------------------------------------------------------------------------


def test_h200_smoke_report_fits_100_columns_and_a_screen():
    lines = shown(h200_smoke())
    assert max(map(len, lines)) <= 100
    # the CLI adds the plan line, the throughput line and the NVTX line (2 lines each at most)
    assert len(lines) <= 80 - 6, "\n".join(lines)
    assert lines[0] == "kvverify stress: smoke (seed 0, llama-3.1-8b, 32.0 KiB pages) on NVIDIA H200"
    assert "  H1-broken  ox  ox  ox   ox  ox  ox       ox  ox  ox" in lines
    assert "  H1-broken store/D2H, native: 9 cells, 4 trials each, rate ≤ 0.53" in lines
    text = "\n".join(lines)
    assert "(38 of \n108 ANY cells safe)" in text or "(38 of 108 ANY cells safe)" in text


def test_no_gpu_view_gives_the_reason_first_and_the_contract_matrix():
    report = dataclasses.replace(cut_short(h200_smoke(), 0), not_run_reason="no CUDA device is visible")
    lines = shown(report)
    assert lines[0] == "Nothing ran on a device: no CUDA device is visible."
    assert lines[1].startswith("Contract verdicts only")
    assert "  H5-broken   .   .   x    x                x   x   x" in lines
    assert not any(" safe in " in line for line in lines)  # nothing ran: the matrix is the paper view
    assert any("on paper only: no cell ran" in line for line in lines)
    assert len(lines) <= 45 and max(map(len, lines)) <= 100


def test_a_run_cut_short_speaks_only_of_the_cells_that_ran():
    report = cut_short(h200_smoke(), 42)  # H1-broken, H1-fixed and part of H2-broken
    text = " ".join(" ".join(shown(report)).split())
    assert "38 of 108" not in text
    assert report.headline().text.endswith("(0 of the 12 ANY cells that ran safe; 96 not run)")
    assert "ANY safe in store: nowhere" in text and "H3-fixed [" not in text  # no load ran under ANY
    assert "STREAM safe in store: H1-fixed [pinned/registered/pageable]; load: nowhere" in text
    assert report.summary()["ANY"]["load"]  # the JSON document keeps every cell, as before


def test_failing_cells_come_first_then_the_quiet_ones_with_their_bounds():
    rows = [("H3-fixed", "load", "ANY", "pinned", "native", "SAFE", observed(10, bad=3)),
            ("H1-broken", "store", "ANY", "pinned", "native", "RACY", observed(4))]
    rows += [(f"S{i}", "store", "ANY", "pinned", "adversarial", "RACY", observed(3)) for i in range(MAX_LISTED + 2)]
    lines = shown(report_of(rows))
    first = lines.index("Cells that contradict their contract (exit status 1): 13")
    assert lines[first + 1] == "  ! H3-fixed load/H2D/ANY/pinned/native: 3 of 10 trials corrupted (STALE 3)"
    assert lines[first + 2] == "  ? S0 store/D2H/ANY/pinned/adversarial: 0 of 3 trials corrupted"
    assert lines[first + MAX_LISTED + 1].startswith("  ... and 3 more")
    quiet = lines.index("o RACY on paper, no corruption seen in 1 cell: 95% upper bound on the per-trial "
                        "corruption rate")
    assert quiet > first and lines[quiet + 1] == "  H1-broken store/D2H, native: 1 cell, 4 trials each, rate ≤ 0.53"


# -- the PNG ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ran", [324, 42, 0])
def test_plot_writes_a_png(tmp_path, ran):
    pytest.importorskip("matplotlib")
    from kvverify.stress.plot import plot_matrix

    path = tmp_path / "matrix.png"
    plot_matrix(cut_short(h200_smoke(), ran), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 < width < 3000 and 800 < height < 3000


def test_the_legend_names_each_verdict_once():
    from kvverify.stress.plot import legend_label
    from kvverify.terms import RACY, SAFE, CellVerdict

    assert legend_label(SAFE) == ".  SAFE on paper" and legend_label(RACY) == "x  RACY on paper"
    assert legend_label(CellVerdict.CONFIRMED_RACE.value) == "x  CONFIRMED_RACE: racy, corruption seen"
    assert legend_label(CellVerdict.NOT_RUN.value) == "-  NOT_RUN: not run"


# -- in a terminal ---------------------------------------------------------------------------


def test_no_gpu_stress_in_a_100_column_terminal():
    status, lines = run_in_pty([sys.executable, "-m", "kvverify", "stress"],
                               env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath()})
    assert status == 0, "\n".join(lines)
    assert len(lines) <= 60, "\n".join(lines)
    check_fits(lines, 100)
    assert lines[0].startswith("Nothing ran on a device: no CUDA device is visible"), "\n".join(lines)


REPLAY = """
import json, sys
import pytest
sys.path.insert(0, sys.argv[1])
import fake_device
from kvverify import cli
from kvverify.stress import cli as stress_cli, running
from kvverify.stress.report import StressReport

saved = StressReport.from_json(json.load(open(sys.argv[2])))
seen = {r.cell: r.observation for r in saved.cells}
mp = pytest.MonkeyPatch()
fake_device.install_for_stress(mp)
mp.setattr(stress_cli, "_platform", lambda gpu: saved.platform)

def replay(planned, campaign, layout, params, on_cell_done=lambda pc, o, r: None, device=None, deadline=None,
           memory=None):
    out = {}
    for pc in planned:
        if pc.cell not in out:  # the H200 run's whole observation, as one round of the cell's planned trials
            obs = seen[pc.cell]
            out[pc.cell] = running.CellOutcome(obs, phase_s={"write": 0.03, "swap": 0.2, "verify": 0.01},
                                               planned_trials=obs.trials, rounds=1)
            on_cell_done(pc, out[pc.cell], 0)
    return out

mp.setattr(running, "execute", replay)
sys.exit(cli.main(["stress", *sys.argv[3:]]))
"""


def test_the_h200_smoke_in_a_100_column_terminal(tmp_path):
    """The whole of ``kvverify stress`` (plan line, progress, report, throughput, NVTX) with the
    H200's observations replayed into the stand-in device's run."""
    script = tmp_path / "replay.py"
    script.write_text(REPLAY)
    # The saved run predates the kernel executor: replay the executors it has.
    status, lines = run_in_pty([sys.executable, str(script), str(ROOT / "tests"), str(H200_SMOKE),
                                "--executors", "native,adversarial"], env={"PYTHONPATH": pythonpath()})
    assert status == 0, "\n".join(lines)
    assert len(lines) <= 80, "\n".join(lines)
    check_fits(lines, 100)
    assert lines[0].startswith("planned: 324 cells") and any(line.startswith("Headline: YES") for line in lines)


@pytest.mark.gpu
def test_every_scenario_on_the_gpu_in_a_100_column_terminal(tmp_path):
    """The smoke's 360 cells with small blocks, on the device, as a person sees them: the whole
    output (plan line, progress bar, report, throughput, NVTX) fits 80 lines of 100 columns."""
    campaign = tmp_path / "every-cell.toml"
    campaign.write_text('models = ["llama-3.1-8b"]\nblock_size = 16\ntrials = 3\nmax_trials = 3\n'
                        'min_checked = "1MiB"\nblocks_per_transfer = 8\ntransfers = 4\n')
    status, lines = run_in_pty([sys.executable, "-m", "kvverify", "stress", "--campaign", str(campaign)],
                               env={"PYTHONPATH": pythonpath()})
    text = "\n".join(lines)
    assert status in (0, 1), text  # 1: a cell contradicts its contract; the report must fit all the same
    assert len(lines) <= 80, text
    check_fits(lines, 100)
    plan = next((k for k, line in enumerate(lines) if line.startswith("planned: ")), None)
    assert plan is not None and lines[plan].startswith("planned: 360 cells"), text
    # before the plan, nothing but the notice that NVTX is off (a host without the nvtx package)
    assert plan == 0 or lines[0].startswith("kvverify: NVTX annotation is off"), text
    assert any(line.startswith("kvverify stress: every-cell (") and " on " in line for line in lines), text
    assert "Each cell: one mark per executor: native adversarial kernel" in text and "Headline: " in text


def test_piped_output_honours_columns():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), COLUMNS="72")
    p = subprocess.run([sys.executable, "-m", "kvverify", "stress", "--scenarios", "H3"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert max(map(len, p.stdout.splitlines())) <= 72, p.stdout
