"""The footprint of a stress run over time: host RSS and device memory, sampled cheaply, and
their trend.

A growing footprint across rounds is a leak (pools, host buffers, streams or events that a
cell's end should have given back), which fails the run with its own exit status
(``kvverify.stress.report.EXIT_MEMORY_GREW``).

Samples are taken after every cell's share of a round (``peak`` samples: that host memory
kind's pools are live) and right after each host memory kind's pools are freed (*settled*
samples: what the run keeps between kinds). Only settled samples are comparable across the
run (live pools differ by kind: a pageable kind adds a staging area and a bounce buffer), so
the trend is taken over them; peaks are reported beside it. The first round is the warm-up
(allocator caches, lazily loaded kernels, every kind's pools allocated once); the trend starts
at the last settled sample of the first round.

Reading a sample costs a read of ``/proc/self/statm`` and one ``cudaMemGetInfo``: no psutil,
no NVML.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence

# A footprint is flat when its last settled sample lies within this fraction of the first one
# after warm-up (the figure: 1 %).
GROWTH_TOLERANCE = 0.01
# Below this span of settled samples after warm-up, or with fewer than MIN_TREND_SAMPLES of
# them, the run cannot tell: allocator noise dominates and a leak per trial would not show.
MIN_TREND_S = 60.0
MIN_TREND_SAMPLES = 3


def host_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``/proc/self/statm``), None where there is no
    procfs (the run then reports no host trend)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def device_used_bytes(device) -> int | None:
    """Bytes of ``device``'s memory in use (``cudaMemGetInfo``: total - free, every process and
    torch's cache included); None for a device that is not CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading: ``t`` seconds since the sampler started, bytes (None where unreadable),
    the round it was taken in, and whether no pools were live (``settled``)."""

    t: float
    host_rss: int | None
    device_used: int | None
    round: int
    settled: bool


class MemorySampler:
    """Collects samples of this process's footprint on ``device`` during a run.

    Keeps every settled sample and, before each, one sample of the largest readings since the
    previous one (the peak with that kind's pools live): a long run keeps a few samples per round,
    not one per cell, so that the sampler's own memory does not grow with the trials.
    ``read_host`` / ``read_device`` default to ``host_rss_bytes`` / ``device_used_bytes``
    (tests give others); ``clock`` to ``time.monotonic``.
    """

    def __init__(self, device=None, read_host: Callable[[], int | None] | None = None,
                 read_device: Callable[[], int | None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.samples: list[Sample] = []
        self.readings = 0
        self._peak: Sample | None = None
        self._read_host = read_host or host_rss_bytes
        self._read_device = read_device or ((lambda: device_used_bytes(device)) if device is not None else (lambda: None))
        self._clock = clock or time.monotonic
        self._start = self._clock()

    def sample(self, round_index: int, settled: bool) -> Sample:
        """Read the footprint now; keep it if ``settled``, else fold it into the pending peak."""
        s = Sample(self._clock() - self._start, self._read_host(), self._read_device(), round_index, settled)
        self.readings += 1
        if not settled:
            p = self._peak
            self._peak = s if p is None else Sample(s.t, _max(p.host_rss, s.host_rss),
                                                    _max(p.device_used, s.device_used), round_index, False)
            return s
        if self._peak is not None:
            self.samples.append(self._peak)
            self._peak = None
        self.samples.append(s)
        return s

    def trend(self) -> Trend:
        """``trend`` of the kept samples, counting every reading."""
        return trend(self.samples, readings=self.readings)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


@dataclasses.dataclass(frozen=True)
class QuantityTrend:
    """One quantity's trend over the settled samples after warm-up, in bytes: ``first``, ``last``, ``max``;
    ``peak``: the largest of every sample, pools live included; ``slope_per_hour``: least-squares
    slope in bytes per hour; ``growth``: ``(last - first) / first``."""

    first: int
    last: int
    max: int
    peak: int
    slope_per_hour: float
    growth: float


@dataclasses.dataclass(frozen=True)
class Trend:
    """The footprint's trend over a run.

    - ``samples``: readings taken; ``warmup_s``: when the trend starts (seconds from the first
      reading: the end of the first round); ``span_s``: seconds the trend covers;
    - ``host_rss``, ``device_used``: a ``QuantityTrend`` each, None where unreadable or too few samples;
    - ``growing``: True when either grew by more than ``tolerance`` of its first value, False
      when both stayed within it, None when the run cannot tell (``note`` says why);
    - ``series``: the settled samples the trend is taken over, ``(t, host_rss, device_used)``.
    """

    samples: int
    warmup_s: float | None
    span_s: float
    tolerance: float
    host_rss: QuantityTrend | None
    device_used: QuantityTrend | None
    growing: bool | None
    note: str | None
    series: tuple[tuple[float, int | None, int | None], ...] = ()


def _quantity_trend(points: Sequence[tuple[float, int]], peak: int) -> QuantityTrend:
    n = len(points)
    ts = [t for t, _ in points]
    vs = [v for _, v in points]
    mean_t, mean_v = sum(ts) / n, sum(vs) / n
    var_t = sum((t - mean_t) ** 2 for t in ts)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t if var_t > 0 else 0.0
    first, last = vs[0], vs[-1]
    return QuantityTrend(first, last, max(vs), max(peak, max(vs)), slope * 3600.0, (last - first) / first if first else 0.0)


def trend(samples: Sequence[Sample], tolerance: float | None = None, min_span_s: float | None = None,
          min_samples: int | None = None, readings: int | None = None) -> Trend:
    """The trend of ``samples`` (see the module docstring): over the settled samples from the
    last one of round 0 on. ``tolerance``, ``min_span_s``, ``min_samples`` default to
    ``GROWTH_TOLERANCE``, ``MIN_TREND_S``, ``MIN_TREND_SAMPLES``; ``readings``: how many readings
    the samples stand for (default: as many as there are). Raises nothing; a run too short to
    tell gets ``growing`` None and a ``note``."""
    tolerance = GROWTH_TOLERANCE if tolerance is None else tolerance
    min_span_s = MIN_TREND_S if min_span_s is None else min_span_s
    min_samples = MIN_TREND_SAMPLES if min_samples is None else min_samples
    settled = [s for s in samples if s.settled]
    warm = [s for s in settled if s.round == 0]
    after = ([warm[-1]] if warm else []) + [s for s in settled if s.round > 0]
    series = tuple((s.t, s.host_rss, s.device_used) for s in after)
    span = after[-1].t - after[0].t if after else 0.0
    warmup_s = after[0].t if after else None

    def one(field: str) -> QuantityTrend | None:
        points = [(s.t, getattr(s, field)) for s in after if getattr(s, field) is not None]
        if not points:
            return None
        peak = max((getattr(s, field) for s in samples if getattr(s, field) is not None), default=0)
        return _quantity_trend(points, peak)

    host, device = one("host_rss"), one("device_used")
    note = None
    growing: bool | None = None
    if not samples:
        note = "no samples (no cell ran)"
    elif len(after) < min_samples or span < min_span_s:
        note = (f"{len(after)} settled sample(s) over {span:.0f} s after the first round: a trend needs "
                f"{min_samples} over {min_span_s:g} s")
    elif host is None and device is None:
        note = "neither host nor device memory could be read"
    else:
        growing = any(s is not None and s.growth > tolerance for s in (host, device))
    return Trend(len(samples) if readings is None else readings, warmup_s, span, tolerance, host, device, growing,
                 note, series)
