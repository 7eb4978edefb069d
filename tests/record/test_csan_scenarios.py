"""PyTorch's CUDA Stream Sanitizer's own scenarios (``csan_scenarios.py``) as programs on the CPU
stand-in: a recording gives each the verdict the sanitizer's test expects, kernels on several streams
included (no buffer two streams' kernels touch is summarized). ``test_csan_scenarios_gpu.py`` runs
them on CUDA, with the sanitizer's own verdict beside."""

from __future__ import annotations

import pytest
from csan_scenarios import SCENARIOS, multiple_errors
from fake_cuda import FakeCuda

import kvverify.record as record


class StandIn:
    """The scenarios' device API on the stand-in."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake

    def tensor(self):
        return self.fake.device(1024)

    def stream(self):
        return self.fake.stream()

    def event(self):
        return self.fake.event()

    def on(self, stream):
        return self.fake.use(stream)

    def delete(self, holder: list) -> None:
        holder.pop().destroy()

    def synchronize(self) -> None:
        self.fake.synchronize()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_sanitizer_scenario_is_recorded_with_the_verdict_its_test_expects(name):
    expected, program = SCENARIOS[name]
    fake = FakeCuda()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        program(StandIn(fake))
    assert rec.check().verdict == expected, rec.report()
    assert rec.complete(), rec.summary().notes


def test_every_bad_launch_of_many_is_a_race_of_its_own():
    fake = FakeCuda()
    with record.recording(platform=fake, skip=fake.skip()) as rec:
        multiple_errors(StandIn(fake))
    assert len(rec.check().races) == 10
