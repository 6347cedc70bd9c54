"""Goodness-of-fit helpers for the sampling tests (no scipy here), and tests of the helpers themselves.

The sampling tests compare counts of emitted tokens with exact probabilities by Pearson's
chi-square. Every test uses fixed seeds, so a verdict is reproducible; the thresholds are
far in the tails (p-value 1e-4 to pass, 1e-8 for a control to count as caught).
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import pytest

pytestmark = pytest.mark.statistical

PASS_P = 1e-4  # a correct sampler passes unless its counts are a 1-in-10,000 fluke
CAUGHT_P = 1e-8  # a wrong sampler must be rejected far beyond any fluke
MIN_EXPECTED = 5.0  # bins expecting fewer counts are pooled (the chi-square approximation needs ~5)


def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x): series below a + 1, continued fraction above."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Lentz's method for the continued fraction of Q.
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square with df degrees of freedom."""
    return _gamma_q(df / 2.0, stat / 2.0)


def chisquare(counts: np.ndarray, probs: np.ndarray) -> Tuple[float, int, float]:
    """Pearson's test of counts [V] against exact probabilities [V]: (statistic, df, p-value).

    Bins expecting fewer than MIN_EXPECTED counts are pooled into one; a count in a bin of
    probability 0 (e.g. a token top-p filters out) is an outright failure (p-value 0).
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return math.inf, 0, 0.0
    expected = probs / probs.sum() * n
    big = expected >= MIN_EXPECTED
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    df = max(len(obs_a) - 1, 1)
    return stat, df, chi2_sf(stat, df)


def tv(counts: np.ndarray, probs: np.ndarray) -> float:
    """Total-variation distance between the empirical distribution and probs (for messages)."""
    counts = np.asarray(counts, dtype=np.float64)
    return 0.5 * float(np.abs(counts / counts.sum() - np.asarray(probs) / np.sum(probs)).sum())


# Tests of the helpers ---------------------------------------------------------------------------


def test_chi2_sf_known_quantiles() -> None:
    # Textbook critical values: 0.05 and 0.001 upper quantiles.
    for stat, df, p in [(3.841, 1, 0.05), (18.307, 10, 0.05), (10.828, 1, 0.001), (59.703, 30, 0.001)]:
        assert abs(chi2_sf(stat, df) - p) < 2e-4 * (1 + 1 / p) * p, (stat, df, chi2_sf(stat, df))
    assert chi2_sf(0.0, 5) == 1.0
    assert chi2_sf(200.0, 10) < 1e-30


def test_chisquare_accepts_true_and_rejects_shifted_distribution() -> None:
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.3, 0.2, 0.07, 0.03, 0.0])
    counts = np.bincount(rng.choice(6, size=20_000, p=probs), minlength=6)
    assert chisquare(counts, probs)[2] > PASS_P
    shifted = np.array([0.37, 0.33, 0.2, 0.07, 0.03, 0.0])
    assert chisquare(counts, shifted)[2] < CAUGHT_P
    counts[5] += 1  # a token of probability 0 appeared
    assert chisquare(counts, probs)[2] == 0.0
