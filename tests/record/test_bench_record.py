"""``benchmarks/bench_record.py``'s per-step figures on the CUDA stand-in: each step of a timed loop
keeps its parts (``STEP_PARTS``) from the demo engine's own methods, plain and recorded, so that
the benchmark, which runs only on a GPU, does not drift from the engine it times. The figures are
not judged (the stand-in waits for nothing); their shape and bounds are."""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

import pytest
from fake_cuda import DemoDevice, FakeCuda

from kvverify.record import demo, recording

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_record  # noqa: E402


@pytest.mark.parametrize("how", ["plain", "recorded"])
def test_each_step_of_a_timed_loop_keeps_its_parts(how):
    fake = FakeCuda()
    shape = demo.Shape(steps=4)
    context = recording(platform=fake, skip=fake.skip()) if how == "recorded" else contextlib.nullcontext()
    steps: list = []
    seconds = bench_record.time_loop(shape, context, steps=steps, cuda=DemoDevice(fake))
    assert len(steps) == shape.steps
    for wall, cpu, polling, staging, faults, switches, core in steps:
        assert 0 <= polling + staging <= wall <= seconds  # the waits are timed inside their step
        assert cpu >= 0 and faults >= 0 and switches >= 0 and core >= 0
        assert all(isinstance(n, int) for n in (faults, switches, core))
    assert sum(t[3] for t in steps) > 0  # every step stages its block ids
    if how == "recorded":
        assert context.check().verdict == "SAFE"  # the timed methods are the engine's own, wrapped
    parts = bench_record.step_parts(steps)
    assert list(parts) == [*bench_record.STEP_PARTS, "cpus"]
    assert parts["wall"] == pytest.approx(1e3 * statistics.median(t[0] for t in steps))
    assert parts["minor_faults"] == statistics.median(t[4] for t in steps)
    assert parts["cpus"] == sorted({t[6] for t in steps})

