"""The recorder's demo (an engine-style CPU offload handler) on the CUDA stand-in: the safe form is
SAFE and each mistake RACY with exactly its pair of ops, at the demo's marked lines. The same
expectations run on the device in ``test_record_gpu.py``."""

from __future__ import annotations

import pytest
from demo_races import EXPECTED, race_marks
from fake_cuda import DemoDevice, FakeCuda

from kvverify.record import demo, recording


@pytest.mark.parametrize("hidden", [0, 16], ids=["no-model", "model"])
@pytest.mark.parametrize("mistake", list(EXPECTED), ids=lambda m: m or "safe")
def test_each_form_of_the_handler_is_reported_as_expected(mistake, hidden):
    # with a model (hidden > 0), its forward step's matmuls on compute touch no KV block: no other race
    fake = FakeCuda()
    engine = demo.Engine(demo.Shape(hidden=hidden, tokens=4), mistake, cuda=DemoDevice(fake))
    with recording(platform=fake, skip=fake.skip()) as rec:
        engine.run()
    verdict = rec.check()
    assert race_marks(rec.trace(), verdict) == EXPECTED[mistake], verdict.render()
    assert rec.summary().unresolved == []


def test_every_mistake_of_the_demo_has_an_expectation():
    assert set(EXPECTED) == {None, *demo.MISTAKES}
    with pytest.raises(ValueError, match="unknown mistake 'typo'"):
        demo.Engine(demo.Shape(), "typo", cuda=DemoDevice(FakeCuda()))


def test_the_demo_counts_a_loaded_page_that_does_not_hold_what_was_loaded():
    engine = demo.Engine(demo.Shape(), None, cuda=DemoDevice(FakeCuda()))
    engine.run()
    assert engine.corrupted_loads() == 0
    block = next(iter(engine.expected))
    engine.gpu[1][block].zero_()  # as a zero-fill landing after the load would
    assert engine.corrupted_loads() == 1


def test_the_demo_help_says_what_each_option_does(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "offload steps" in out and "(default 3)" in out and "(default 4)" in out
