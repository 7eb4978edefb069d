"""Statistics for the stress report and the bench: exact binomial bounds, paired ratios, spread.

The bounds are exact binomial computations in the standard library (the binomial
distribution's terms summed in log space, the bound found by bisection to the last bit),
so that a host without a GPU installs no scipy for them; tests hold them to published
values and to scipy's. This module fixes the conventions (one- or two-sided, which
interval, what the minimum sample is) and checks the inputs. numpy is imported by the
functions that use it: reports import this module on hosts and paths that never
compute a bound.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from fractions import Fraction
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


def _lower_tail(k: int, n: int, log_p: float, log_q: float) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, p)``, given ``log p`` and ``log(1 - p)``: the terms
    ``comb(n, i) p^i (1 - p)^(n - i)`` in log space, each from the one before (times
    ``(n - i) / (i + 1) * p / (1 - p)``), summed with ``math.fsum`` after scaling by the largest."""
    logs, log_term, odds = [n * log_q], n * log_q, log_p - log_q
    for i in range(k):
        log_term += math.log((n - i) / (i + 1)) + odds
        logs.append(log_term)
    top = max(logs)
    return math.exp(top) * math.fsum(math.exp(x - top) for x in logs)


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, p)`` with ``0 < p < 1``, summed over the shorter tail
    (``P(X <= k) = 1 - P(n - X <= n - k - 1)``, ``n - X ~ Binomial(n, 1 - p)``)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if k <= n - 1 - k:
        return _lower_tail(k, n, math.log(p), math.log1p(-p))
    return 1.0 - _lower_tail(n - 1 - k, n, math.log1p(-p), math.log(p))


def _crossing(f: Callable[[float], float], level: float, lo: float, hi: float) -> float:
    """The ``p`` in ``(lo, hi)`` where the decreasing ``f`` falls to ``level``, by bisection until
    the bracket's ends are neighbouring floats."""
    while True:
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            return mid
        if f(mid) > level:
            lo = mid
        else:
            hi = mid


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
    _check_counts(failures, trials, confidence)
    return _upper(int(failures), int(trials), 1 - confidence)


def _upper(k: int, n: int, tail: float) -> float:
    """The exact upper bound: the rate ``p`` at which ``P(X <= k) = tail`` (1 when ``k == n``)."""
    if k == n:
        return 1.0
    if k == 0:
        return -math.expm1(math.log(tail) / n)  # 1 - tail ** (1 / n), without the cancellation
    return _crossing(lambda p: _binomial_cdf(k, n, p), tail, k / n, 1.0)


def clopper_pearson_interval(
    failures: int, trials: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Two-sided exact (Clopper–Pearson) interval ``(low, high)`` on a failure rate.

    Each tail holds at most ``(1 - confidence) / 2``; so at 95 % its ``high`` is the
    one-sided 97.5 % bound, larger than ``clopper_pearson_upper(..., 0.95)``.

    Raises as ``clopper_pearson_upper``.
    """
    _check_counts(failures, trials, confidence)
    k, n, tail = int(failures), int(trials), (1 - confidence) / 2
    # low: the rate at which P(X >= k) = tail, i.e. P(X <= k - 1) = 1 - tail (0 when k == 0)
    low = 0.0 if k == 0 else _crossing(lambda p: _binomial_cdf(k - 1, n, p), 1 - tail, 0.0, k / n)
    return low, _upper(k, n, tail)


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
    statistics (Thompson 1936; what ``scipy.stats.quantile_test`` gives): ``[r_(k), r_(n+1-k)]``
    with the largest ``k`` for which ``P(Binomial(n, 1/2) < k) < (1 - confidence) / 2``,
    computed exactly (``math.comb``, ``Fraction``).
    It assumes only independent, identically distributed pairs, no normality, and needs
    no random resampling, so it is reproducible; its coverage is at least ``confidence``.
    The median is invariant under the log, so the interval holds for log-ratios alike.

    Inputs: equal-length 1-D sequences of finite positive numbers (seconds, bytes per
    second, ...; the same unit on both sides). Raises ValueError for unequal lengths,
    non-finite or non-positive values, or fewer than ``min_pairs(confidence)`` pairs.
    """
    import numpy as np

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
    ratios = np.sort(num / den)
    n, tail = int(ratios.size), Fraction((1 - confidence) / 2)
    # k: the first j with P(Binomial(n, 1/2) <= j) >= tail, so P(Binomial(n, 1/2) < k) < tail;
    # min_pairs makes k >= 1. The interval: the k-th smallest ratio to the k-th largest.
    below, k = Fraction(1, 2**n), 0
    while below < tail:
        k += 1
        below += Fraction(math.comb(n, k), 2**n)
    return RatioCI(
        float(np.median(ratios)), float(ratios[k - 1]), float(ratios[n - k]), n, confidence
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
        cv=float(x.std(ddof=1) / x.mean()),
        median=median,
        n=int(x.size),
    )
