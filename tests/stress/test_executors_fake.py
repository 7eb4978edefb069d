"""The executors end to end on a serial stand-in device (tests/fake_device.py).

On it every op runs at issue, in program order: the reference schedule. So the native
executor must see every block OK in every cell, and the adversarial one too, except where it
reorders the copies of one batch (H7-broken), which it must turn into wrong blocks in every
trial. Runs on any CPU host; the race-provoking side needs the GPU (test_stress_gpu.py).
"""

from __future__ import annotations

import fake_device as stand_in
import pytest
from fake_device import fake_device  # noqa: F401  (fixture)

from kvverify.geometry import KVLayout, ModelGeometry
from kvverify.scenarios import Params
from kvverify.stress import planning, running
from kvverify.stress.campaign import load

TINY = KVLayout(ModelGeometry("tiny", 2, 1, 16, 2), block_size=4)  # 128-byte pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


def _campaign(**changes):
    base = dict(trials=3, max_trials=3, min_checked=1, host_memory=("pageable",), writer_delay_us=0, reader_us=0)
    return load("smoke").override(**(base | changes))


def _run(campaign, device):
    planned = planning.plan(campaign, TINY, PARAMS)
    return planned, running.execute(planned, campaign, TINY, PARAMS, device=device)


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


def test_the_kernel_executor_copies_with_the_kernel_path(fake_device, monkeypatch):
    """Kernel cells (STREAM, host memory a kernel reaches) run every swap through
    ``method="kernel"``, the native ones through the batch, and the reference schedule leaves
    every block OK. Pinned memory is the stand-in's pageable memory here (no CUDA)."""
    from kvverify.device import host_memory, ops
    from kvverify.stress.executors import pools

    monkeypatch.setattr(pools, "allocate_host", lambda kind, n: host_memory.allocate_host("pageable", n))
    methods: list[str] = []
    copy = ops.swap_blocks_batch

    def recording(*args, method="batch", **kwargs):
        methods.append(method)
        copy(*args, **kwargs)

    monkeypatch.setattr(ops, "swap_blocks_batch", recording)
    campaign = _campaign(host_memory=("pinned",), orders=("STREAM", "ANY"), executors=("native", "kernel"),
                         scenarios=("P2", "H1", "H3"))
    planned = planning.plan(campaign, TINY, PARAMS)
    kernel_cells = [pc for pc in planned if pc.cell.executor == "kernel"]
    assert kernel_cells and all(pc.cell.order == "STREAM" for pc in kernel_cells)
    for pc in planned:
        methods.clear()
        outcome = running.execute([pc], campaign, TINY, PARAMS, device=fake_device)[pc.cell]
        assert outcome.error is None and not outcome.observation.corrupted, pc.cell.label
        assert methods and set(methods) == {"kernel" if pc.cell.executor == "kernel" else "batch"}, pc.cell.label


def test_random_data_native_is_clean(fake_device):
    planned, outcomes = _run(_campaign(data="random", executors=("native",)), fake_device)
    for pc in planned:
        obs = outcomes[pc.cell].observation
        assert obs is not None and not obs.corrupted and obs.blocks_checked > 0, pc.cell.label


def test_a_stale_block_is_seen(fake_device, monkeypatch):
    """Drop every copy: destinations keep their setup content, which the checks must flag."""
    from kvverify.device import ops

    monkeypatch.setattr(ops, "swap_blocks_batch", lambda *a, **k: None)
    planned, outcomes = _run(_campaign(scenarios=("P2", "H1-fixed"), orders=("STREAM",),
                                       executors=("native",)), fake_device)
    for pc in planned:
        obs = outcomes[pc.cell].observation
        assert obs.corrupted_trials == 3 and obs.ok < obs.blocks_checked, pc.cell.label


def test_injected_fault_fails_one_cell_and_the_run_goes_on(fake_device, monkeypatch):
    c = _campaign(scenarios=("P2",), orders=("STREAM",), executors=("native",))
    planned = planning.plan(c, TINY, PARAMS)
    monkeypatch.setenv(running.FAIL_CELL_ENV, planned[0].cell.label)
    outcomes = running.execute(planned, c, TINY, PARAMS, device=fake_device)
    assert "injected" in outcomes[planned[0].cell].error
    assert outcomes[planned[0].cell].observation is None


def test_stress_cli_with_observations_on_the_stand_in_device(monkeypatch, tmp_path, capsys):
    """The CLI's GPU path end to end (progress, table, throughput line, JSON, JUnit, exit
    status) with observations from the stand-in device."""
    import json

    from kvverify import cli
    from kvverify.stress.report import load_schema

    stand_in.install_for_stress(monkeypatch)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "hidden_size": 32, "torch_dtype": "bfloat16"}))
    campaign = tmp_path / "c.toml"
    campaign.write_text('trials = 3\nmax_trials = 3\nmin_checked = "1KiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
                        'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["H7-broken", "P2"]\n')
    out = tmp_path / "r.json"
    status = cli.main(["stress", "--campaign", str(campaign), "--model-config", str(config), "--json", str(out),
                       "--junit", str(tmp_path / "r.xml"), "--no-nvtx"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "Checked " in printed and "wall time per phase" in printed
    doc = json.loads(out.read_text())
    verdicts = {(c["scenario"], c["executor"]): c["verdict"] for c in doc["cells"]}
    assert verdicts[("H7-broken", "adversarial")] == "CONFIRMED_RACE"
    assert verdicts[("H7-broken", "native")] == "NO_RACE_OBSERVED"  # the serial device never reorders
    assert verdicts[("P2", "native")] == verdicts[("P2", "adversarial")] == "SAFE_CONFIRMED"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, load_schema())


def test_ctrl_c_frees_every_pool(fake_device, monkeypatch):
    """A KeyboardInterrupt in the middle of a trial propagates, and host memory (pool and bounce
    buffer) is freed on the way out."""
    from kvverify.stress.executors import native, pools

    made = []
    real = pools.allocate_host

    def tracking(kind, nbytes):
        made.append(real(kind, nbytes))
        return made[-1]

    def interrupted(self, stream, data, order):
        raise KeyboardInterrupt

    monkeypatch.setattr(pools, "allocate_host", tracking)
    monkeypatch.setattr(native.NativeExecutor, "_swap", interrupted)
    c = _campaign(scenarios=("P2",), executors=("native",), data="random")
    planned = planning.plan(c, TINY, PARAMS)
    with pytest.raises(KeyboardInterrupt):
        running.execute(planned, c, TINY, PARAMS, device=fake_device)
    assert len(made) == 2 and not any(buf._live for buf in made)


# -- the stream gate and the run's exits ------------------------------------------------------


class _FakeDriver:
    """cuStreamWaitValue32 (GEQ) recorded, not executed: what each hold waits for."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUstreamWaitValue_flags:
        class CU_STREAM_WAIT_VALUE_GEQ:
            value = 0

    def __init__(self):
        self.waits = []

    CUstream = CUdeviceptr = staticmethod(lambda x: x)

    def cuStreamWaitValue32(self, stream, ptr, value, flags):
        self.waits.append(value)
        return (0,)


def _driven_gate(deadline_s=60.0):
    import numpy as np
    import torch

    from kvverify.device import gate

    g = gate.StreamGate(torch.device("cpu"), deadline_s=deadline_s)
    g._driver, g._geq = _FakeDriver(), 0
    g._flags = torch.zeros(16, dtype=torch.int32)
    g._view = g._flags.numpy().view(np.uint32)
    return g


def _released(g, value) -> bool:
    return (int(g._view[0]) - value) & 0xFFFFFFFF < 2**31  # (int32)(flag - value) >= 0


def test_gate_releases_are_monotonic_so_no_hold_is_ever_rearmed():
    import types

    g = _driven_gate()
    s = types.SimpleNamespace(cuda_stream=1)
    g.hold(s)
    g.hold(s)
    first = g._driver.waits[:]
    assert not any(_released(g, v) for v in first) and g.holding
    g.release_all()
    assert all(_released(g, v) for v in first) and not g.holding
    g.reset()  # a new trial: nothing is re-armed, an old wait the device has not reached stays released
    g.hold(s)
    assert all(_released(g, v) for v in first) and not _released(g, g._driver.waits[-1])
    g.close()
    assert _released(g, g._driver.waits[-1])


def test_gate_watchdog_and_release_everything():
    import time
    import types

    from kvverify.device import gate

    g = _driven_gate(deadline_s=0.1)
    gate._start_watchdog()
    s = types.SimpleNamespace(cuda_stream=1)
    g.hold(s)
    time.sleep(0.5)
    assert g.expired == 1 and _released(g, g._driver.waits[-1])
    g.hold(s)
    gate.release_everything(disarm=True)
    assert _released(g, g._driver.waits[-1])
    n = len(g._driver.waits)
    g.hold(s)  # disarmed: an interrupted run holds nothing more
    assert len(g._driver.waits) == n
    g.close()


def test_max_seconds_stops_cleanly_with_not_run_cells(monkeypatch, tmp_path, capsys):
    import json

    from kvverify import cli

    stand_in.install_for_stress(monkeypatch)
    campaign = tmp_path / "c.toml"
    campaign.write_text('trials = 3\nmax_trials = 3\nmin_checked = "1KiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
                        'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["P2"]\nmodels = ["qwen2.5-7b"]\n')
    out = tmp_path / "r.json"
    status = cli.main(["stress", "--campaign", str(campaign), "--json", str(out), "--max-seconds", "1e-9",
                       "--no-nvtx"])
    err = capsys.readouterr().err
    assert status == 1
    assert "planned: 6 cells" in err and "--max-seconds" in err and "6 of 6 cells not run" in err
    assert {c["verdict"] for c in json.loads(out.read_text())["cells"]} == {"NOT_RUN"}


SIGNAL_DRIVER = """
import sys, time
import pytest
sys.path.insert(0, sys.argv[1])
import fake_device
from kvverify import cli
from kvverify.device import ops
from kvverify.stress.executors import pools

mp = pytest.MonkeyPatch()
fake_device.install_for_stress(mp)

def stuck(*a, **k):
    print("SWAP", flush=True)
    while True:
        time.sleep(0.01)

mp.setattr(ops, "swap_blocks_batch", stuck)
if sys.argv[3] == "stuck-cleanup":
    real_close = pools.Pools.close
    def close(self):
        print("CLOSING", flush=True)
        while True:
            time.sleep(0.01)
    mp.setattr(pools.Pools, "close", close)
sys.exit(cli.main(["stress", "--campaign", sys.argv[2], "--model", "qwen2.5-7b", "--no-nvtx"]))
"""


@pytest.mark.parametrize("mode", ["clean", "stuck-cleanup"])
def test_sigterm_unwinds_and_a_second_one_exits_at_once(tmp_path, mode):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "driver.py"
    script.write_text(SIGNAL_DRIVER)
    campaign = tmp_path / "c.toml"
    campaign.write_text('trials = 3\nmax_trials = 3\nmin_checked = "1KiB"\nblock_size = 4\nblocks_per_transfer = 2\n'
                        'transfers = 2\nhost_memory = ["pageable"]\nscenarios = ["P2"]\n')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    p = subprocess.Popen([sys.executable, str(script), os.path.join(root, "tests"), str(campaign), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "SWAP"
        p.send_signal(signal.SIGTERM)
        if mode == "clean":
            assert p.wait(timeout=60) == 130
            assert "interrupted" in p.stderr.read()
        else:
            assert p.stdout.readline().strip() == "CLOSING"
            time.sleep(0.2)
            assert p.poll() is None  # cleanup goes on after the first signal ...
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=10) == 128 + signal.SIGTERM  # ... and a second one ends it at once
            assert "second signal" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
