"""The stress harness on a GPU: every scenario of the catalogue, every executor (the kernel copy path
in its STREAM cells), three host memory kinds, with small pages so the whole matrix runs in seconds.

The expectation of each cell comes from the checker (``planning.plan``), never from a table:
a SAFE cell shows no corruption under either executor; a RACY cell shows corruption under
the adversarial executor (the positive controls). Broken and fixed forms of every hazard
are therefore covered under both executors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvverify.geometry import KVLayout, ModelGeometry
from kvverify.scenarios import SCENARIOS, Params
from kvverify.stress import planning, running
from kvverify.stress.campaign import load

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = KVLayout(ModelGeometry("tiny", 2, 2, 64, 2), block_size=16)  # 4 KiB pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


def _campaign(**changes):
    base = dict(trials=3, max_trials=3, min_checked=1, writer_delay_us=1000, reader_us=1000, hold_timeout_s=20.0)
    return load("smoke").override(**(base | changes))


def _run(campaign):
    planned = planning.plan(campaign, TINY, PARAMS)
    outcomes = running.execute(planned, campaign, TINY, PARAMS)
    return planned, outcomes


def _problems(planned, outcomes):
    """Cells whose observation contradicts the contract the way the cell verdicts forbid (docs/report-schema.md)."""
    problems = []
    for pc in planned:
        out = outcomes[pc.cell]
        if out.error:
            problems.append(f"{pc.cell.label}: error {out.error}")
            continue
        obs = out.observation
        if pc.contract == "SAFE" and obs.corrupted:
            problems.append(f"{pc.cell.label}: SAFE but corrupted {obs.counts} in {obs.corrupted_trials}/{obs.trials}")
        if pc.contract == "RACY" and pc.cell.executor == "adversarial" and not obs.corrupted:
            problems.append(f"{pc.cell.label}: RACY but the adversarial executor saw no corruption ({pc.witness})")
    return problems


@pytest.mark.parametrize("host", ["pinned", "registered", "pageable"])
def test_every_cell_matches_its_contract(host):
    planned, outcomes = _run(_campaign(host_memory=(host,)))
    scenario_directions = sum(len(s.directions) for s in SCENARIOS.values())
    kernel_cells = scenario_directions if host != "pageable" else 0  # STREAM only; no kernel reads pageable memory
    assert len(planned) == scenario_directions * 3 * 2 + kernel_cells
    assert sum(pc.cell.executor == "kernel" for pc in planned) == kernel_cells
    problems = _problems(planned, outcomes)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("hazard", [f"H{i}" for i in range(1, 8)])
def test_broken_corrupts_under_adversarial_and_fixed_stays_clean(hazard):
    """Per hazard, on pinned memory: the broken form corrupts under the adversarial executor in
    some order; the fixed form is clean under both executors in STREAM order."""
    planned, outcomes = _run(_campaign(scenarios=(hazard,), host_memory=("pinned",)))
    broken = [pc for pc in planned if pc.scenario.form == "broken" and pc.cell.executor == "adversarial"
              and pc.contract == "RACY"]
    assert broken and all(outcomes[pc.cell].observation.corrupted for pc in broken), \
        [pc.cell.label for pc in broken if not outcomes[pc.cell].observation.corrupted]
    fixed = [pc for pc in planned if pc.scenario.form == "fixed" and pc.cell.order == "STREAM"]
    assert {pc.contract for pc in fixed} == {"SAFE"}
    assert not any(outcomes[pc.cell].observation.corrupted for pc in fixed)


def test_checked_bytes_and_counts_add_up():
    planned, outcomes = _run(_campaign(scenarios=("P2",), host_memory=("pinned",), orders=("ANY",)))
    for pc in planned:
        obs = outcomes[pc.cell].observation
        assert obs.trials == 3 and obs.ok == obs.blocks_checked > 0
        assert obs.bytes_checked == obs.blocks_checked * TINY.page_bytes


def test_random_data_native_is_clean_on_safe_cells():
    c = _campaign(data="random", executors=("native",), scenarios=("P1", "P2", "H3-fixed", "H7-fixed"),
                  orders=("STREAM",))
    planned, outcomes = _run(c)
    assert {pc.contract for pc in planned} == {"SAFE"}
    assert not _problems(planned, outcomes)
    assert all(outcomes[pc.cell].observation.blocks_checked > 0 for pc in planned)


def test_injected_fault_fails_one_cell_and_the_run_goes_on(monkeypatch):
    c = _campaign(scenarios=("P2",), host_memory=("pinned",), orders=("STREAM",))
    planned = planning.plan(c, TINY, PARAMS)
    monkeypatch.setenv(running.FAIL_CELL_ENV, planned[0].cell.label)
    outcomes = running.execute(planned, c, TINY, PARAMS)
    assert outcomes[planned[0].cell].error and "injected" in outcomes[planned[0].cell].error
    assert outcomes[planned[1].cell].observation is not None


def test_stress_cli_quick_run_exits_0(tmp_path):
    campaign = tmp_path / "quick.toml"
    campaign.write_text(
        'models = ["qwen2.5-7b"]\nblock_size = 16\ntrials = 3\nmax_trials = 3\nmin_checked = "1MiB"\n'
        'blocks_per_transfer = 2\ntransfers = 2\nwriter_delay_us = 500\nreader_us = 500\n'
        'scenarios = ["H1", "H3", "H4", "P1", "P2"]\n'
    )
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "kvverify", "stress", "--campaign", str(campaign), "--json", str(out),
                        "--junit", str(tmp_path / "r.xml")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads(out.read_text())
    verdicts = {c["verdict"] for c in doc["cells"]}
    assert "NOT_RUN" not in verdicts and not verdicts & {"UNEXPECTED_CORRUPTION", "SENSITIVITY_FAILURE"}
    assert "CONFIRMED_RACE" in verdicts and "SAFE_CONFIRMED" in verdicts


# -- rounds, memory, ranks -----------------------------------------------------------------------------

# Small: two of these runs (plain and under torchrun) fit the gpu-tests step's time beside the rest.
QUICK = ('block_size = 16\ntrials = 3\nmax_trials = 3\nmin_checked = "1MiB"\nblocks_per_transfer = 2\ntransfers = 2\n'
         'writer_delay_us = 500\nreader_us = 500\nscenarios = ["H1", "H3", "P2"]\n')


def test_rounds_sample_host_and_device_memory():
    from kvverify.stress import memory

    c = _campaign(scenarios=("P2", "H1-broken"), host_memory=("pinned", "pageable"), max_trials=6, min_checked=2**40)
    planned = planning.plan(c, TINY, PARAMS)
    sampler = memory.MemorySampler(device="cuda")
    outcomes = running.execute(planned, c, TINY, PARAMS, memory=sampler)
    assert all(o.rounds == 2 and o.observation.trials == 6 for o in outcomes.values())
    settled = [s for s in sampler.samples if s.settled]
    assert [s.round for s in settled] == [0, 0, 1, 1]  # one per host memory kind and round
    assert all(s.host_rss > 2**20 and s.device_used > 2**20 for s in sampler.samples)
    assert not _problems(planned, outcomes)


def _quick(tmp_path, *launcher_and_args):
    campaign = tmp_path / "quick.toml"
    campaign.write_text(QUICK)
    out = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    launcher = [a for a in launcher_and_args if a != "--shard"]
    extra = ["--shard"] if "--shard" in launcher_and_args else []
    p = subprocess.run([sys.executable, *launcher, "-m", "kvverify", "stress", "--campaign", str(campaign),
                        "--model", "qwen2.5-7b", "--json", str(out), *extra],
                       capture_output=True, text=True, env=env, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


def _decided(doc):
    """Verdicts a faithful harness must reproduce run after run: every adversarial cell and every
    SAFE cell (a native RACY cell may or may not show its race)."""
    return {c["label"]: c["verdict"] for c in doc["cells"]
            if c["executor"] == "adversarial" or c["contract"]["verdict"] == "SAFE"}


def test_torchrun_with_one_rank_gives_the_plain_verdicts(tmp_path):
    plain = _quick(tmp_path)
    one = _quick(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    assert _decided(one) == _decided(plain)
    assert [(g["rank"], g["device"]) for g in one["gpus"]] == [(0, 0)]
    assert one["gpus"][0]["memory"]["samples"] > 0 and one["gpus"][0]["memory"]["series"][0][2] > 0


def test_two_gpus_each_run_every_cell_or_a_share(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    both = _quick(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert [(g["rank"], g["device"]) for g in both["gpus"]] == [(0, 0), (1, 1)]
    for c in both["cells"]:
        assert [p["gpu"] for p in c["per_gpu"]] == [0, 1]
        if c["executor"] == "adversarial" or c["contract"]["verdict"] == "SAFE":
            assert {p["verdict"] for p in c["per_gpu"]} == {c["verdict"]}, c["label"]
    shard = _quick(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--shard")
    assert all(len(c["per_gpu"]) == 1 for c in shard["cells"])
    assert {c["per_gpu"][0]["gpu"] for c in shard["cells"]} == {0, 1}
    assert _decided(shard) == _decided(both)
