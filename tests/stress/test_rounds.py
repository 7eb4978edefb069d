"""Rounds of trials over every cell (``planning.rounds``) and a run cut short by its cap: any
stopping point after the first round has seen every cell; the exit status and the JSON agree."""

from __future__ import annotations

import json

import fake_device as stand_in
import pytest
from fake_device import fake_device  # noqa: F401  (fixture)

from kvverify.geometry import KVLayout, ModelGeometry, preset
from kvverify.scenarios import Params
from kvverify.stress import planning, running
from kvverify.stress.campaign import load

TINY = KVLayout(ModelGeometry("tiny", 2, 1, 16, 2), block_size=4)  # 128-byte pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


def _campaign(**changes):
    base = dict(trials=3, max_trials=9, min_checked=2**30, host_memory=("pageable",), writer_delay_us=0, reader_us=0)
    return load("smoke").override(**(base | changes))


def test_first_round_covers_every_cell_and_later_rounds_add_three_trials():
    c = _campaign(trials=2, max_trials=10, host_memory=("pinned", "pageable"))
    planned = planning.plan(c, TINY, PARAMS)
    schedule = planning.rounds(planned, c, TINY)
    assert [pc for pc, _ in schedule[0]] == planned  # every cell, in plan order
    assert {pc.cell.executor: n for pc, n in schedule[0]} == {"native": 2, "adversarial": 3, "kernel": 2}
    totals = {pc.cell: 0 for pc in planned}
    for r, this in enumerate(schedule):
        for pc, n in this:
            totals[pc.cell] += n
            if r and totals[pc.cell] < 10:
                assert n == planning.round_trials() == 3
    assert set(totals.values()) == {10}  # min_checked asks for more than max_trials
    assert len(schedule) == 1 + 3  # 2 + 3 + 3 + 2 for native; 3 + 3 + 3 + 1 for adversarial


def test_rounds_give_each_cell_what_trials_for_asks():
    c = load("smoke")
    layout = KVLayout(preset("llama-3.1-8b"))
    params, _ = planning.fit_params(c, layout)
    planned = planning.plan(c, layout, params)
    schedule = planning.rounds(planned, c, layout)
    per_cell = {}
    for this in schedule:
        for pc, n in this:
            per_cell[pc.cell] = per_cell.get(pc.cell, 0) + n
    expected = {pc.cell: planning.trials_for(c, planning.program_blocks(pc.program)["checked"] * layout.block_bytes,
                                             pc.cell.executor) for pc in planned}
    assert per_cell == expected
    assert sum(per_cell.values()) == planning.estimate(planned, c, layout).trials


def test_soak_spreads_over_many_rounds():
    """The soak campaign is long in rounds, not in first rounds: any cap past its first round
    has covered the whole matrix."""
    c = load("soak")
    layout = KVLayout(preset(c.models[0]), block_size=c.block_size, tp=c.tp)
    params, _ = planning.fit_params(c, layout)
    planned = planning.plan(c, layout, params)
    schedule = planning.rounds(planned, c, layout)
    first = planning.estimate([pc for pc, _ in schedule[0]], c.override(max_trials=3, trials=3), layout)
    whole = planning.estimate(planned, c, layout)
    assert len(schedule[0]) == len(planned) and len(schedule) >= 20
    assert first.seconds < 0.1 * whole.seconds, (first.seconds, whole.seconds)


def _stop_after_first_round(monkeypatch):
    """Make the run's deadline pass once every cell has finished its first round."""
    state = {"past": False}
    monkeypatch.setattr(running, "_past", lambda deadline: deadline is not None and state["past"])
    real = running.execute

    def execute(planned, *args, on_cell_done=lambda pc, o, r: None, **kwargs):
        def done(pc, outcome, round_index):
            on_cell_done(pc, outcome, round_index)
            if round_index == 0 and pc is planned[-1]:
                state["past"] = True

        return real(planned, *args, on_cell_done=done, **kwargs)

    monkeypatch.setattr(running, "execute", execute)


def test_a_stop_after_the_first_round_has_seen_every_cell(fake_device, monkeypatch):
    c = _campaign(scenarios=("P2", "H7-broken"))
    planned = planning.plan(c, TINY, PARAMS)
    _stop_after_first_round(monkeypatch)
    outcomes = running.execute(planned, c, TINY, PARAMS, device=fake_device, deadline=0.0)
    assert set(outcomes) == {pc.cell for pc in planned}
    for pc in planned:
        o = outcomes[pc.cell]
        assert o.error is None and o.rounds == 1 and o.planned_trials == 9
        assert o.observation.trials == planning.first_round_trials(c, pc.cell.executor)


def test_trials_are_numbered_on_across_rounds(fake_device, monkeypatch):
    """The adversarial schedule is trial mod 3: each round goes on where the last one stopped."""
    from kvverify.stress.executors import adversarial

    seen = []
    real = adversarial.AdversarialExecutor.run_trial

    def run_trial(self, prepared, order, trial, inject_fault=False):
        seen.append(trial)
        return real(self, prepared, order, trial, inject_fault)

    monkeypatch.setattr(adversarial.AdversarialExecutor, "run_trial", run_trial)
    c = _campaign(scenarios=("P2",), orders=("ANY",), executors=("adversarial",), max_trials=8)
    planned = planning.plan(c, TINY, PARAMS)
    outcomes = running.execute(planned, c, TINY, PARAMS, device=fake_device)
    assert seen == list(range(8)) and outcomes[planned[0].cell].rounds == 3
    assert outcomes[planned[0].cell].observation.trials == 8


CAMPAIGN = ('trials = 3\nmax_trials = 9\nmin_checked = "1GiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
            'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["P2", "H7-broken"]\nwriter_delay_us = 0\n'
            'reader_us = 0\n')
# A two-layer model: the stand-in device checks every page in numpy.
CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 32,
          "torch_dtype": "bfloat16"}


def _files(tmp_path, campaign=CAMPAIGN):
    (tmp_path / "c.toml").write_text(campaign)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return ["--campaign", str(tmp_path / "c.toml"), "--model-config", str(tmp_path / "config.json"), "--no-nvtx"]


def test_capped_run_with_every_cell_seen_exits_0_and_says_so(monkeypatch, tmp_path, capsys):
    from kvverify import cli

    monkeypatch.setenv("COLUMNS", "200")  # the messages read whole: rich wraps them to COLUMNS
    stand_in.install_for_stress(monkeypatch)
    _stop_after_first_round(monkeypatch)
    out = tmp_path / "r.json"
    status = cli.main(["stress", *_files(tmp_path), "--json", str(out), "--max-seconds", "1000"])
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert status == doc["exit_status"] == 0, captured.err[-3000:]
    assert "--max-seconds 1000 reached in round 1 of 3: every cell ran" in captured.err
    assert doc["execution"] | {"trials_run": None} == {
        "shard": False, "rounds_planned": 3, "rounds_run": 1, "trials_planned": 18 * 9, "trials_run": None,
        "max_seconds": 1000.0, "stopped": True}
    assert doc["execution"]["trials_run"] == sum(c["observed"]["trials"] for c in doc["cells"]) == 18 * 3
    assert "NOT_RUN" not in {c["verdict"] for c in doc["cells"]}


def test_cap_that_leaves_cells_unrun_exits_1_in_the_shell_and_the_json(monkeypatch, tmp_path, capsys):
    from kvverify import cli

    stand_in.install_for_stress(monkeypatch)
    out = tmp_path / "r.json"
    status = cli.main(["stress", *_files(tmp_path), "--json", str(out), "--max-seconds", "1e-9"])
    doc = json.loads(out.read_text())
    assert status == doc["exit_status"] == 1
    assert doc["execution"]["stopped"] is True and doc["execution"]["trials_run"] == 0
    assert "18 of 18 cells not run" in capsys.readouterr().err


@pytest.mark.parametrize("growth_per_sample, status", [(0.0, 0), (0.002, 3)])
def test_memory_growth_fails_with_its_own_status(monkeypatch, tmp_path, capsys, growth_per_sample, status):
    """Settled samples that creep up by 0.2 % each (about 2 % over the run) fail it with exit
    status 3, in the shell and in the JSON; a flat footprint passes."""
    from kvverify import cli
    from kvverify.stress import memory

    monkeypatch.setenv("COLUMNS", "200")  # the messages read whole: rich wraps them to COLUMNS
    stand_in.install_for_stress(monkeypatch)
    readings = iter(int(2**30 * (1 + growth_per_sample) ** k) for k in range(10**6))
    monkeypatch.setattr(memory, "host_rss_bytes", lambda: next(readings))
    monkeypatch.setattr(memory, "MIN_TREND_S", 0.0)
    out = tmp_path / "r.json"
    code = cli.main(["stress", *_files(tmp_path, CAMPAIGN.replace('"H7-broken"', '"H3-fixed"')), "--json", str(out)])
    captured = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert code == doc["exit_status"] == status, captured.err[-3000:]
    trend = doc["gpus"][0]["memory"]
    assert doc["memory_growing"] is trend["growing"] is (status == 3)
    assert len(trend["series"]) == 3  # the end of round 0, then rounds 1 and 2 (one host memory kind)
    assert (trend["host_rss"]["growth"] > 0.01) is (status == 3)
    assert ("GREW beyond 1%" in captured.out) is (status == 3) and ("flat within 1%" in captured.out) is (status == 0)
    assert ("memory grew over the run (exit status 3)" in captured.err) is (status == 3)
