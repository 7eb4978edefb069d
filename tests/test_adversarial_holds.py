"""The adversarial executor never makes the host wait on a held stream (stand-in device).

The stand-in (tests/fake_device.py) runs every op at issue, so a hold cannot block anything
there. This test lays a model of what blocks on the H200 over it:

- a stream is *held* from ``StreamGate.hold`` until the gate's next release, and so is every
  stream that waited (``wait_stream`` / ``wait_event``) on a held one;
- a ``swap_blocks_batch`` of device-to-device copies issued on a held stream blocks the
  calling thread until the hold is released (measured on the H200, driver 580: 2048
  device-to-device copies of one batch on a held stream, each call released only by the
  gate's watchdog 2 s later; H2D / D2H batches from pinned memory returned at once);
- a host wait (an event query) on work behind a hold blocks until the hold is released.

Either one, on the device, is a watchdog expiry (2 s); here it is a recorded violation.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import fake_device
from kvverify import kernels, ops, runner
from kvverify.campaign import load
from kvverify.executors import gate as gate_module
from kvverify.executors import pools as pools_module
from kvverify.geometry import KVLayout, ModelGeometry
from kvverify.scenarios import Params

TINY = KVLayout(ModelGeometry("tiny", 2, 1, 16, 2), block_size=4)  # 128-byte pages, 4 tensors
PARAMS = Params(blocks_per_transfer=2, transfers=3)


class _Model:
    def __init__(self) -> None:
        self.epoch = 0  # gate releases so far
        self.current = None  # the current stream
        self.device_ranges: list[tuple[int, int]] = []
        self.violations: list[str] = []
        self.holds = 0

    def held(self, thing) -> bool:
        return thing is not None and getattr(thing, "gate", 0) > self.epoch

    def on_device(self, address: int) -> bool:
        return any(lo <= address < hi for lo, hi in self.device_ranges)


@pytest.fixture
def model(monkeypatch):
    fake_device.install(monkeypatch)
    m = _Model()

    class Stream(fake_device.FakeStream):
        def __init__(self, device=None, **kw):
            super().__init__(device, **kw)
            self.gate = 0  # held while gate > m.epoch

        def wait_event(self, event):
            self.gate = max(self.gate, event.gate)

        def wait_stream(self, stream):
            self.gate = max(self.gate, stream.gate)

    class Event(fake_device.FakeEvent):
        gate = 0

        def record(self, stream=None):
            self.gate = getattr(stream if stream is not None else m.current, "gate", 0)

        def query(self):
            if m.held(self):
                m.violations.append("the host waited on work behind a hold")
            return True

    @contextlib.contextmanager
    def stream_context(s=None):
        before, m.current = m.current, s
        try:
            yield
        finally:
            m.current = before

    default = Stream()

    def spin(*a, stream=None, **k):  # StreamGate.hold without cuda-python: the hold itself
        if stream is not None:
            stream.gate = m.epoch + 1
            m.holds += 1

    real_release = gate_module.StreamGate.release_all

    def release_all(self):
        real_release(self)
        m.epoch += 1

    real_pools_init = pools_module.Pools.__init__

    def pools_init(self, *a, **k):
        real_pools_init(self, *a, **k)
        for t in (self.gpu, self.snapshot, self.staging):
            m.device_ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    real_swap = ops.swap_blocks_batch

    def swap(src_ptrs, dst_ptrs, sizes, src_access_order=None, **k):
        src, dst = (np.asarray(torch.as_tensor(a), dtype=np.int64) for a in (src_ptrs, dst_ptrs))
        if m.held(m.current) and any(m.on_device(int(s)) and m.on_device(int(d)) for s, d in zip(src, dst)):
            m.violations.append("a device-to-device batch on a held stream")
        real_swap(src_ptrs, dst_ptrs, sizes, src_access_order, **k)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: default)
    monkeypatch.setattr(kernels, "spin", spin)
    monkeypatch.setattr(gate_module.StreamGate, "release_all", release_all)
    monkeypatch.setattr(pools_module.Pools, "__init__", pools_init)
    monkeypatch.setattr(ops, "swap_blocks_batch", swap)
    return m


def _campaign(**changes):
    base = dict(trials=3, max_trials=3, min_checked=1, host_memory=("pageable",), writer_delay_us=0, reader_us=0,
                executors=("adversarial",))
    return load("smoke").override(**(base | changes))


def test_the_model_catches_a_device_to_device_batch_on_a_held_stream(model):
    g = gate_module.StreamGate(torch.device("cpu"))
    s, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    model.device_ranges.append((a.data_ptr(), a.data_ptr() + 64))
    model.device_ranges.append((b.data_ptr(), b.data_ptr() + 64))
    g.hold(s)
    waiter.wait_stream(s)
    with torch.cuda.stream(waiter):
        ops.swap_blocks_batch([b.data_ptr()], [a.data_ptr()], [64], "STREAM")
    assert model.violations == ["a device-to-device batch on a held stream"]
    g.release_all()
    with torch.cuda.stream(waiter):
        ops.swap_blocks_batch([b.data_ptr()], [a.data_ptr()], [64], "STREAM")
    assert len(model.violations) == 1
    g.close()


def test_no_schedule_makes_the_host_wait_on_a_hold(model):
    """Every scenario, order and schedule (three trials: early, mixed, late): no call the
    H200 would block on a hold, and the outcomes of the reference schedule still hold."""
    c = _campaign()
    planned = runner.plan(c, TINY, PARAMS)
    outcomes = runner.execute(planned, c, TINY, PARAMS, device=torch.device("cpu"))
    assert model.holds > 0  # the model saw the holds
    assert not model.violations, sorted(set(model.violations))
    for pc in planned:
        out = outcomes[pc.cell]
        assert out.error is None, out.error
        obs = out.observation
        assert obs.trials == 3 and obs.blocks_checked > 0
        if pc.cell.scenario == "H7-broken":
            assert obs.corrupted_trials == 3 and obs.garbage > 0, pc.cell.label
        else:
            assert not obs.corrupted, (pc.cell.label, obs.counts)
