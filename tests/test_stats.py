"""Clopper–Pearson bounds, the paired-ratio median interval and the spread measures: against
values known to more digits than a float holds, exact rational arithmetic, and scipy's."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from kvverify.stats import (
    clopper_pearson_interval,
    clopper_pearson_upper,
    min_pairs,
    paired_ratio_ci,
    spread,
)


@pytest.mark.parametrize("n", [1, 2, 10, 100, 1000, 100_000])
def test_upper_bound_with_no_failure_is_closed_form(n):
    assert clopper_pearson_upper(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)


def test_known_values():
    # Rule of three: 0 of 1000 trials -> about 0.3 % at 95 %.
    assert clopper_pearson_upper(0, 1000) == pytest.approx(0.0029912, abs=1e-7)
    assert clopper_pearson_upper(0, 1000, confidence=0.99) == pytest.approx(1 - 0.01 ** (1 / 1000))
    assert clopper_pearson_upper(5, 5) == 1.0
    # Beta-quantile form of the exact upper bound.
    assert clopper_pearson_upper(3, 50) == pytest.approx(sps.beta.ppf(0.95, 4, 47), rel=1e-9)


def _cdf(k: int, n: int, p: float) -> Fraction:
    """P(X <= k) for X ~ Binomial(n, p), exactly, at the float p."""
    p = Fraction(p)
    return sum(Fraction(math.comb(n, i)) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


@given(k=st.integers(0, 60), extra=st.integers(0, 60))
def test_upper_bound_is_the_exact_root_and_agrees_with_binomtest(k, extra):
    """Within 1e-12 of the rate where exactly 5 % of runs show this few failures (rational
    arithmetic on both sides of it); scipy's binomtest, whose own bound is off by up to 2e-11
    (scipy 1.17), agrees to 1e-10."""
    n = k + max(extra, 1)
    ours = clopper_pearson_upper(k, n)
    tail = Fraction(1 - 0.95)
    assert _cdf(k, n, ours * (1 - 1e-12)) > tail > _cdf(k, n, ours * (1 + 1e-12))
    theirs = sps.binomtest(k, n, alternative="less").proportion_ci(0.95, method="exact").high
    assert ours == pytest.approx(theirs, rel=1e-10)
    assert k / n <= ours <= 1.0


# The exact interval at 95 %, each bound the root of its binomial tail found to 60 digits (mpmath
# 1.3, bisection); the textbook tables give 0.3085 for 0 of 10 and (0.0062, 0.0852) for 3 of 100.
KNOWN = {  # (failures, trials): (two-sided low, two-sided high, one-sided upper)
    (0, 10): (0.0, 0.30849710781876082, 0.25886555089305228),
    (3, 50): (0.012548587835334062, 0.16548194660377289, 0.14783717636418124),
    (3, 100): (0.0062299715383063945, 0.085176052974280035, 0.075710793749830053),
    (50, 100): (0.39832112950330098, 0.60167887049669902, 0.58637828536908824),
    (100, 100): (0.96378330735482358, 1.0, 1.0),
    (7, 1000): (0.0028188587596205257, 0.014369194978918633, 0.013107715416593315),
}


@pytest.mark.parametrize("counts", KNOWN)
def test_bounds_are_the_known_values(counts):
    low, high, upper = KNOWN[counts]
    assert clopper_pearson_interval(*counts) == pytest.approx((low, high), rel=1e-13)
    assert clopper_pearson_upper(*counts) == pytest.approx(upper, rel=1e-13)


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 100), (50, 100), (100, 100)])
def test_two_sided_interval_matches_scipy_and_is_wider(k, n):
    low, high = clopper_pearson_interval(k, n)
    ci = sps.binomtest(k, n).proportion_ci(0.95, method="exact")
    assert (low, high) == pytest.approx((ci.low, ci.high))
    assert high >= clopper_pearson_upper(k, n)
    assert low <= k / n <= high


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((0, 0), ValueError),
        ((-1, 10), ValueError),
        ((11, 10), ValueError),
        ((0, 10, 1.0), ValueError),
        ((0, 10, 0.0), ValueError),
        ((0.5, 10), TypeError),
        ((0, True), TypeError),
    ],
)
def test_degenerate_counts(args, error):
    with pytest.raises(error):
        clopper_pearson_upper(*args)
    with pytest.raises(error):
        clopper_pearson_interval(*args)


# -- paired ratio ----------------------------------------------------------------------------


def test_ratio_ci_order_statistics_by_hand():
    # 10 pairs: P(Binomial(10, 1/2) <= 1) = 11/1024 < 0.025 <= 56/1024, so the interval
    # runs from the 2nd to the 9th smallest ratio.
    ratios = np.array([1.05, 0.98, 1.10, 1.01, 0.95, 1.20, 1.03, 0.99, 1.07, 1.02])
    den = np.linspace(1.0, 2.0, 10)
    r = paired_ratio_ci(ratios * den, den)
    ordered = np.sort(ratios)
    assert r.median == pytest.approx(np.median(ratios))
    assert (r.low, r.high) == pytest.approx((ordered[1], ordered[8]))
    assert (r.n, r.confidence) == (10, 0.95)


def test_ratio_ci_covers_the_true_ratio():
    # Synthetic bench: ANY is 1.08x STREAM; both suffer shared per-repetition drift and
    # their own log-normal noise. The 95 % interval must cover 1.08 in about 95 % of
    # experiments (at least 95 % by construction; allow sampling slack).
    rng = np.random.default_rng(20250611)
    true_ratio, experiments, covered = 1.08, 400, 0
    for _ in range(experiments):
        drift = rng.uniform(0.8, 1.3, size=15)
        stream = 10.0 * drift * rng.lognormal(0, 0.03, 15)
        any_ = 10.0 * true_ratio * drift * rng.lognormal(0, 0.03, 15)
        r = paired_ratio_ci(any_, stream)
        covered += r.low <= true_ratio <= r.high
        assert r.low <= r.median <= r.high
    assert covered / experiments >= 0.93


def test_pairing_removes_shared_drift():
    drift = np.array([1.0, 2.0, 0.5, 3.0, 1.5, 0.7, 2.2, 1.1])
    r = paired_ratio_ci(1.25 * drift, drift)
    assert (r.median, r.low, r.high) == pytest.approx((1.25, 1.25, 1.25))


@pytest.mark.parametrize("confidence", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_ratio_ci_is_the_order_statistics_scipy_s_quantile_test_gives(confidence):
    rng = np.random.default_rng(7)
    for n in range(min_pairs(confidence), 120):
        ratios = rng.lognormal(0, 0.1, n)
        ours = paired_ratio_ci(ratios, np.ones(n), confidence)
        theirs = sps.quantile_test(ratios, q=float(np.median(ratios)), p=0.5).confidence_interval(confidence)
        assert (ours.low, ours.high) == (theirs.low, theirs.high), n


@pytest.mark.parametrize("confidence", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_min_pairs_is_where_scipy_starts_giving_an_interval(confidence):
    n = min_pairs(confidence)
    x = np.arange(1.0, n + 1)
    assert not np.isnan(sps.quantile_test(x).confidence_interval(confidence).low)
    if n > 1:
        shorter = sps.quantile_test(x[:-1]).confidence_interval(confidence)
        assert np.isnan(shorter.low)
    assert (min_pairs(0.95), min_pairs(0.99), min_pairs(0.5)) == (6, 8, 3)


@pytest.mark.parametrize(
    ("num", "den", "match"),
    [
        ([1.0] * 6, [1.0] * 5, "paired"),
        ([1.0] * 5, [1.0] * 5, "needs 6"),
        ([1.0] * 5 + [0.0], [1.0] * 6, "positive"),
        ([1.0] * 6, [1.0] * 5 + [-2.0], "positive"),
        ([1.0] * 5 + [np.nan], [1.0] * 6, "finite"),
        ([1.0] * 5 + [np.inf], [1.0] * 6, "finite"),
        ([[1.0] * 6], [[1.0] * 6], "1-D"),
    ],
)
def test_ratio_degenerate_input(num, den, match):
    with pytest.raises(ValueError, match=match):
        paired_ratio_ci(num, den)


# -- spread ----------------------------------------------------------------------------------


def test_spread_values():
    s = spread([9.0, 10.0, 11.0, 10.0])
    assert s.relative_range == pytest.approx(0.2)
    assert s.cv == pytest.approx(np.std([9, 10, 11, 10], ddof=1) / 10.0)
    assert (s.median, s.n) == (10.0, 4)
    assert spread([5.0, 5.0]).cv == 0.0


@pytest.mark.parametrize(
    "samples", [[], [1.0], [1.0, np.nan], [0.0, 0.0], [-1.0, -2.0], [[1.0, 2.0]]]
)
def test_spread_degenerate_input(samples):
    with pytest.raises(ValueError):
        spread(samples)


def test_the_statistics_need_no_scipy():
    """scipy (143 MB of a 265 MB install without a GPU) served one quantile test: every function
    here runs where it cannot be imported."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['scipy'] = None\n"
            "from kvverify import stats\n"
            "print(stats.clopper_pearson_upper(3, 50), stats.clopper_pearson_interval(3, 100)[0],\n"
            "      stats.paired_ratio_ci([1.1, 1.2, 0.9, 1.0, 1.05, 0.95], [1.0] * 6).low, stats.spread([9.0, 11.0]).n)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[1], check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [repr(clopper_pearson_upper(3, 50)), repr(clopper_pearson_interval(3, 100)[0]), "0.9", "2"]
