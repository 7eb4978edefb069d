"""Statistics for the stress report and the bench: exact binomial bounds, paired ratios, spread.

All of it is scipy underneath; this module fixes the conventions (one- or two-sided,
which interval, what the minimum sample is) and checks the inputs. numpy and scipy are
imported by the functions that use them: reports import this module on hosts and paths
that never compute a bound.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "RatioCI",
    "Spread",
    "clopper_pearson_interval",
    "clopper_pearson_upper",
    "min_pairs",
    "paired_ratio_ci",
    "spread",
]


def _check_counts(failures: int, trials: int, confidence: float) -> None:
    for name, value in (("failures", failures), ("trials", trials)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    if not 0 <= failures <= trials:
        raise ValueError(f"failures must lie in [0, trials={trials}], got {failures}")
    _check_confidence(confidence)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")


def clopper_pearson_upper(failures: int, trials: int, confidence: float = 0.95) -> float:
    """One-sided exact (Clopper–Pearson) upper bound on a per-trial failure rate.

    The smallest rate ``p`` with ``P(X <= failures; trials, p) <= 1 - confidence``: at
    95 %, rates above it would have produced this few failures less than 5 % of the time.
    One-sided because the report asks only how *high* the corruption rate could be. With
    no failure it is ``1 - (1 - confidence) ** (1 / trials)`` (about ``3 / trials``, the
    "rule of three"); with ``failures == trials`` it is 1.

    Raises TypeError for non-integer counts; ValueError for ``trials < 1``, ``failures``
    outside ``[0, trials]`` or ``confidence`` outside ``(0, 1)``.
    """
    from scipy import stats

    _check_counts(failures, trials, confidence)
    result = stats.binomtest(int(failures), int(trials), alternative="less")
    return float(result.proportion_ci(confidence_level=confidence, method="exact").high)


def clopper_pearson_interval(
    failures: int, trials: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Two-sided exact (Clopper–Pearson) interval ``(low, high)`` on a failure rate.

    Each tail holds at most ``(1 - confidence) / 2``; so at 95 % its ``high`` is the
    one-sided 97.5 % bound, larger than ``clopper_pearson_upper(..., 0.95)``.

    Raises as ``clopper_pearson_upper``.
    """
    from scipy import stats

    _check_counts(failures, trials, confidence)
    ci = stats.binomtest(int(failures), int(trials)).proportion_ci(
        confidence_level=confidence, method="exact"
    )
    return float(ci.low), float(ci.high)


class RatioCI(NamedTuple):
    """Median of paired ratios and its distribution-free confidence interval.

    ``median``, ``low``, ``high`` are unitless ratios (numerator / denominator); ``n`` the
    number of pairs; ``confidence`` the nominal level (the actual coverage is at least it).
    """

    median: float
    low: float
    high: float
    n: int
    confidence: float


def min_pairs(confidence: float = 0.95) -> int:
    """Fewest pairs for which ``paired_ratio_ci`` has an interval: 6 at 95 %, 8 at 99 %.

    The widest order-statistic interval, from the smallest to the largest ratio, misses
    the median with probability ``2 * 0.5 ** n``, which must be below ``1 - confidence``.
    """
    _check_confidence(confidence)
    return math.floor(math.log2(2 / (1 - confidence))) + 1


def paired_ratio_ci(
    numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95
) -> RatioCI:
    """Median of the per-repetition ratios ``numerators[i] / denominators[i]`` with a CI.

    For the bench's paired comparison (``ANY`` against ``STREAM``, repetitions
    interleaved so that drift hits both alike): pairing cancels what the two runs of one
    repetition share, and the median is robust to the odd slow repetition.

    The interval is the distribution-free one for a median from binomial order
    statistics (Thompson 1936; ``scipy.stats.quantile_test``): ``[r_(k), r_(n+1-k)]``
    with the largest ``k`` for which ``P(Binomial(n, 1/2) < k) < (1 - confidence) / 2``.
    It assumes only independent, identically distributed pairs, no normality, and needs
    no random resampling, so it is reproducible; its coverage is at least ``confidence``.
    The median is invariant under the log, so the interval holds for log-ratios alike.

    Inputs: equal-length 1-D sequences of finite positive numbers (seconds, bytes per
    second, ...; the same unit on both sides). Raises ValueError for unequal lengths,
    non-finite or non-positive values, or fewer than ``min_pairs(confidence)`` pairs.
    """
    import numpy as np
    from scipy import stats

    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.ndim != 1 or num.shape != den.shape:
        raise ValueError(
            f"numerators {num.shape} and denominators {den.shape} must be 1-D and paired"
        )
    if not (np.all(np.isfinite(num)) and np.all(np.isfinite(den))):
        raise ValueError("ratios need finite values")
    if np.any(num <= 0) or np.any(den <= 0):
        raise ValueError("ratios need positive values")
    need = min_pairs(confidence)
    if num.size < need:
        raise ValueError(f"{num.size} pairs; a {confidence:.0%} interval for a median needs {need}")
    ratios = num / den
    ci = stats.quantile_test(ratios, q=float(np.median(ratios)), p=0.5).confidence_interval(
        confidence_level=confidence
    )
    return RatioCI(
        float(np.median(ratios)), float(ci.low), float(ci.high), int(ratios.size), confidence
    )


class Spread(NamedTuple):
    """Repeatability of a set of measurements (unitless).

    ``relative_range`` is ``(max - min) / median``; ``cv`` the coefficient of variation,
    ``std (ddof=1) / mean``; ``median`` in the samples' unit; ``n`` the count.
    """

    relative_range: float
    cv: float
    median: float
    n: int


def spread(samples: Sequence[float]) -> Spread:
    """How much repeated measurements of one quantity disagree.

    ``samples``: 1-D, at least 2 finite values with a positive median and mean (times in
    seconds, rates in bytes per second). Raises ValueError otherwise.
    """
    import numpy as np
    from scipy import stats

    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f"spread needs at least 2 samples in a 1-D sequence, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("spread needs finite samples")
    median = float(np.median(x))
    if median <= 0 or x.mean() <= 0:
        raise ValueError("spread needs a positive median and mean")
    return Spread(
        relative_range=float((x.max() - x.min()) / median),
        cv=float(stats.variation(x, ddof=1)),
        median=median,
        n=int(x.size),
    )
