"""The error bars' quantiles and the steady-state trend test through scipy.special, held to the bits of the
scipy.stats calls they stand in for (``t.ppf``, ``norm.ppf``, ``linregress``); and a search's modules, which
no longer import scipy.stats or scipy.optimize unless a scenario needs them (sessions, a beta acceptance
process, an acceptance figure to solve)."""
from __future__ import annotations

import math

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from llmsim.analysis.statistics import _trend, ci95_half_width, lag1_correlated, rising_trend
from llmsim.speculation.config import Acceptance, AcceptanceProcess


def _series(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Batch means of every kind a run gives: noise, rises and falls of every size, steps, huge and tiny scales."""
    x = np.arange(n)
    return [rng.normal(size=n), 0.5 + 0.001 * x + rng.normal(0, 0.01, n), 3.0 - 0.2 * x + rng.normal(0, 1e-3, n),
            1e-7 * rng.random(n), 1e9 + rng.random(n), np.where(x < n // 2, 0.1, 0.2), 0.25 + 1e-12 * x,
            rng.exponential(size=n) * 1e-3, np.exp(3.0 * x / n) * 1e-2, -rng.random(n)]


def _bits(value) -> np.ndarray:
    return np.atleast_1d(np.asarray(value, dtype=float)).view(np.int64)


@pytest.mark.parametrize("n", [3, 4, 7, 20, 31])
def test_the_trend_is_linregress_to_the_bit(n):
    rng = np.random.default_rng(n)
    for _ in range(30):
        for means in _series(rng, n):
            fit = stats.linregress(np.arange(n), means)
            slope, one_sided_p = _trend(means)
            assert _bits(slope) == _bits(fit.slope)
            assert _bits(one_sided_p) == _bits(fit.pvalue / 2 if fit.slope > 0 else 1.0)


def test_the_rising_trend_verdict_is_the_one_linregress_gave():
    """The whole verdict against the old code's (``linregress`` on the batch means), on series long and short."""
    rng = np.random.default_rng(7)
    for length in (39, 40, 400, 4_003):
        for means in _series(rng, length):
            values = means + rng.normal(0, 0.01, length)
            for scale in (None, 0.05, 0.5, 5.0):
                batch = values[:length // 20 * 20].reshape(20, -1).mean(axis=1) if length >= 40 else None
                if batch is None:
                    expected: tuple[float, bool] = (np.nan, False)
                else:
                    own = float(batch.mean()) if scale is None else scale
                    if not own > 0 or np.ptp(batch) == 0:
                        expected = (0.0, False)
                    else:
                        fit = stats.linregress(np.arange(20), batch)
                        rise = float(fit.slope * 19 / own)
                        expected = (rise, bool((fit.pvalue / 2 if fit.slope > 0 else 1.0) < 0.01 and rise > 0.1))
                rise, rising = rising_trend(values, scale=scale)
                assert _bits(rise) == _bits(expected[0]) and rising == expected[1]


def test_two_batches_are_too_few_to_tell_a_trend():
    """A line through two means leaves the t test no degree of freedom: NaN and False, as for too short a series,
    not a verdict (linregress gave a p-value of 1 or 0 there, from a perfect fit)."""
    rise, rising = rising_trend(np.arange(100.0), batches=2)
    assert math.isnan(rise) and rising is False
    assert rising_trend(np.arange(100.0), batches=3)[1] is True      # three means: a test, and a steep climb


def test_the_confidence_half_width_is_student_t_to_the_bit():
    rng = np.random.default_rng(3)
    for n in range(60):
        sd = rng.exponential()
        assert _bits(ci95_half_width(sd, n)) == _bits(stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n))
    assert np.isnan(ci95_half_width(1.0, 1))                       # one run: no interval
    counts = pd.Series([1, 2, 3, 10, 200], index=list("abcde"))    # a grouped frame's counts and deviations
    sds = pd.Series(rng.exponential(size=5), index=list("abcde"))
    got, want = ci95_half_width(sds, counts), stats.t.ppf(0.975, counts - 1) * sds / np.sqrt(counts)
    assert isinstance(got, pd.Series) and list(got.index) == list(want.index)
    assert (_bits(got) == _bits(want)).all()


def test_the_lag1_test_reads_the_normal_quantile():
    """Every level's verdict on statistics straddling its threshold, against ``norm.ppf``'s."""
    rng = np.random.default_rng(11)
    for level in (0.01, 0.05, 0.1, 0.2):
        threshold = stats.norm.ppf(1.0 - level)
        for _ in range(200):
            k = int(rng.integers(3, 30))
            x = rng.normal(size=k) + rng.uniform(0, 2) * np.arange(k) / k
            spread = float(np.sum((x - x.mean()) ** 2))
            ratio = 1.0 - float(np.sum(np.diff(x) ** 2)) / (2.0 * spread)
            assert lag1_correlated(x, level) == bool(ratio / np.sqrt((k - 2) / (k * k - 1)) > threshold)


def test_beta_acceptance_draws_its_rates_at_the_beta_quantiles():
    acceptance = Acceptance(process=AcceptanceProcess.BETA, beta_a=7.0, beta_b=3.0)
    q = (np.arange(16) + 0.5) / 16
    assert (_bits(acceptance.beta_quantiles(q)) == _bits(stats.beta.ppf(q, 7.0, 3.0))).all()


def test_a_search_without_sessions_or_beta_acceptance_leaves_scipy_stats_and_optimize_unloaded():
    """A short plain recommendation's whole path: its windows' trend tests and its intervals included."""
    code = ("import sys\nfrom llmsim.search.recommend import recommend\n"
            "recommend('scenarios/llama3-8b-h100-chat.yaml', workers=1, seeds=2, top=1, tolerance=0.3)\n"
            "print('LOADED', *sorted(m for m in ('scipy.stats', 'scipy.optimize') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1].split() == ["LOADED"]
