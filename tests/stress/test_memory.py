"""The footprint trend: settled samples after the first round, growth against the tolerance,
too-short runs that cannot tell, and cheap sampling of this process."""

from __future__ import annotations

import pytest

from kvverify.stress import memory
from kvverify.stress.memory import MemorySampler, Sample, trend

GIB = 2**30


def run(values, rounds_of=None, device=None, step_s=30.0):
    """Settled samples ``values`` (bytes), one per round from round 0, ``step_s`` apart, each
    after a peak sample 1 GiB higher (a kind's pools live)."""
    samples = []
    for k, v in enumerate(values):
        r = k if rounds_of is None else rounds_of[k]
        samples.append(Sample(k * step_s, None if v is None else v + GIB, device, r, False))
        samples.append(Sample(k * step_s + 1, v, device, r, True))
    return samples


def test_flat_run_is_flat_and_the_first_round_is_warm_up():
    t = trend(run([3 * GIB, 2 * GIB, 2 * GIB + 10 * 2**20, 2 * GIB + 5 * 2**20]))  # round 0 frees more later
    assert t.growing is False and t.note is None
    assert t.host_rss.first == 3 * GIB  # the last settled sample of round 0 starts the trend ...
    assert t.warmup_s == 1.0 and t.span_s == 90.0
    assert t.host_rss.peak == 4 * GIB  # ... and peaks count every sample
    assert t.host_rss.last == 2 * GIB + 5 * 2**20 and t.host_rss.max == 3 * GIB
    assert t.device_used is None


def test_growth_beyond_the_tolerance_fails():
    values = [2 * GIB + k * 8 * 2**20 for k in range(5)]  # +8 MiB per round: 1.6 % over the run
    t = trend(run(values))
    assert t.growing is True
    assert t.host_rss.growth == pytest.approx(32 / 2048)
    assert t.host_rss.slope_per_hour == pytest.approx(8 * 2**20 / 30 * 3600)


def test_device_growth_alone_fails():
    samples = [Sample(s.t, s.host_rss, 4 * GIB + int(s.t) * 2**20, s.round, s.settled) for s in run([GIB] * 4)]
    t = trend(samples)
    assert t.growing is True and t.host_rss.growth == 0 and t.device_used.growth > 0.01


def test_too_short_or_too_few_cannot_tell():
    assert trend(run([GIB, GIB, GIB], step_s=10)).growing is None  # 20 s after warm-up
    t = trend(run([GIB, 2 * GIB]))  # two settled samples after warm-up: not a trend
    assert t.growing is None and "a trend needs 3" in t.note
    assert trend([]).note == "no samples (no cell ran)"
    unreadable = trend(run([None] * 5))
    assert unreadable.growing is None and unreadable.host_rss is None and "could be read" in unreadable.note


def test_several_settled_samples_per_round_all_count():
    """With three host memory kinds a round has three settled samples; the trend starts at round
    0's last."""
    values = [5 * GIB, 4 * GIB, 2 * GIB, 2 * GIB, 2 * GIB, 2 * GIB]
    t = trend(run(values, rounds_of=[0, 0, 0, 1, 1, 1]), min_span_s=0)
    assert t.host_rss.first == 2 * GIB and len(t.series) == 4 and t.growing is False


def test_the_memory_sampler_reads_this_process():
    rss = memory.host_rss_bytes()
    assert rss is not None and 10 * 2**20 < rss < 64 * GIB  # a Python process with numpy loaded
    clock = iter([0.0, 1.5, 2.5])
    rec = MemorySampler(read_device=lambda: 7, clock=lambda: next(clock))
    s = rec.sample(0, settled=True)
    assert s == Sample(1.5, s.host_rss, 7, 0, True) and rec.samples == [s]
    assert memory.device_used_bytes("cpu") is None


def test_the_memory_sampler_keeps_the_peak_between_settled_samples_not_every_reading():
    host = iter([5, 9, 7, 3, 6, 4, 2])
    device = iter([1, 1, 8, 1, None, 2, 1])
    clock = iter(range(100))
    rec = MemorySampler(read_host=lambda: next(host), read_device=lambda: next(device), clock=lambda: next(clock))
    for settled in (False, False, False, True, False, False, True):
        rec.sample(0 if len(rec.samples) < 2 else 1, settled)
    assert [(s.host_rss, s.device_used, s.settled) for s in rec.samples] == [
        (9, 8, False), (3, 1, True), (6, 2, False), (2, 1, True)]
    assert rec.readings == 7 and rec.trend().samples == 7
