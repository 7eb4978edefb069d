"""The executors end to end on a serial stand-in device (tests/fake_device.py).

On it every op runs at issue, in program order: the reference schedule. So the native
executor must see every block OK in every cell, and the adversarial one too, except where it
reorders the copies of one batch (H7-broken), which it must turn into wrong blocks in every
trial. Runs on any CPU host; the race-provoking side needs the GPU (test_stress_gpu.py).
"""

from __future__ import annotations

import pytest

from fake_device import fake_device  # noqa: F401  (fixture)
from kvverify import runner
from kvverify.campaign import load
from kvverify.geometry import KVLayout, ModelGeometry
from kvverify.scenarios import Params

TINY = KVLayout(ModelGeometry("tiny", 2, 1, 16, 2), block_size=4)  # 128-byte pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


def _campaign(**changes):
    base = dict(trials=3, max_trials=3, min_checked=1, host_memory=("pageable",), writer_delay_us=0, reader_us=0)
    return load("smoke").override(**(base | changes))


def _run(campaign, device):
    planned = runner.plan(campaign, TINY, PARAMS)
    return planned, runner.execute(planned, campaign, TINY, PARAMS, device=device)


def test_reference_schedule_is_clean_except_reordered_batches(fake_device):
    planned, outcomes = _run(_campaign(), fake_device)
    assert len(planned) == 18 * 3 * 2
    for pc in planned:
        out = outcomes[pc.cell]
        assert out.error is None, out.error
        obs = out.observation
        assert obs.trials == 3 and obs.blocks_checked > 0
        assert obs.bytes_checked == obs.blocks_checked * TINY.page_bytes
        reordered = pc.cell.scenario == "H7-broken" and pc.cell.executor == "adversarial"
        if reordered:
            # the first-issued copy lands last: the block of another address (GARBAGE), every trial
            assert obs.corrupted_trials == 3 and obs.garbage > 0 and obs.stale == obs.torn == 0, pc.cell.label
        else:
            assert not obs.corrupted, (pc.cell.label, obs.counts)


def test_random_data_native_is_clean(fake_device):
    planned, outcomes = _run(_campaign(data="random", executors=("native",)), fake_device)
    for pc in planned:
        obs = outcomes[pc.cell].observation
        assert obs is not None and not obs.corrupted and obs.blocks_checked > 0, pc.cell.label


def test_a_stale_block_is_seen(fake_device, monkeypatch):
    """Drop every copy: destinations keep their setup content, which the checks must flag."""
    from kvverify import ops

    monkeypatch.setattr(ops, "swap_blocks_batch", lambda *a, **k: None)
    planned, outcomes = _run(_campaign(scenarios=("P2", "H1-fixed"), orders=("STREAM",),
                                       executors=("native",)), fake_device)
    for pc in planned:
        obs = outcomes[pc.cell].observation
        assert obs.corrupted_trials == 3 and obs.ok < obs.blocks_checked, pc.cell.label


def test_injected_fault_fails_one_cell_and_the_run_goes_on(fake_device, monkeypatch):
    c = _campaign(scenarios=("P2",), orders=("STREAM",), executors=("native",))
    planned = runner.plan(c, TINY, PARAMS)
    monkeypatch.setenv(runner.FAIL_CELL_ENV, planned[0].cell.label)
    outcomes = runner.execute(planned, c, TINY, PARAMS, device=fake_device)
    assert "injected" in outcomes[planned[0].cell].error
    assert outcomes[planned[0].cell].observation is None
