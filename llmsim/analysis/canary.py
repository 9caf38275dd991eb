"""Is the canary different? Differences of each metric with confidence intervals, tests, and how
long a canary must run to see a given change.

The requests of one run are not independent: a request that waits makes the next one wait too. So
every interval here comes from *batch means*: each group's requests, in arrival order, are cut into
``batches`` consecutive groups whose means are close to independent (:mod:`llmsim.analysis.statistics`).

Canary against control (independent samples, :func:`compare_independent`)
    a mean or an attainment (the share of requests meeting the SLO): the difference of the two
    groups' means, Welch's t interval and test on the two sets of batch means (``scipy.stats.ttest_ind``,
    unequal variances); a percentile: the difference of the sample percentiles, its interval by a
    block bootstrap that resamples whole batches. Every latency row also carries the Mann-Whitney U
    test's p-value on the requests themselves, a test of a shift in the whole distribution (it treats
    requests as independent, so it is optimistic under heavy queueing).
Shadow against control (paired, :func:`compare_paired`)
    each copied request was served by both, so the difference is taken request by request: the mean
    difference with a one-sample t interval on the batch means of the differences
    (``scipy.stats.ttest_1samp``), percentiles by a paired block bootstrap, and the Wilcoxon
    signed-rank test on the request pairs.

:func:`detection_time` turns the measured variances into the time a canary must run to detect a
change of a given size with a given power (the two-sample normal approximation, with the batch
means' variance per request, so queueing's correlation is counted).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from llmsim.analysis.statistics import BATCHES, batch_series

METRICS = ("ttft_s", "tpot_s", "e2e_s")
PERCENTILES = (50, 95, 99)
BOOTSTRAP_SAMPLES = 400
ATTAINMENT = "attainment"


@dataclass(frozen=True)
class Difference:
    """Treatment minus control for one metric and statistic, with its 95% interval and test."""
    metric: str                  # ttft_s, tpot_s, e2e_s, or attainment (share meeting the SLO)
    statistic: str               # mean, p50, p95, p99
    control: float
    treatment: float
    difference: float
    low: float
    high: float
    p_value: float
    test: str
    rank_p_value: float = math.nan       # Mann-Whitney U (independent) or Wilcoxon signed-rank (paired)

    @property
    def significant(self) -> bool:
        return not (self.low <= 0.0 <= self.high)


def measured(records: pd.DataFrame, start_s: float, stop_s: float) -> pd.DataFrame:
    """The requests that arrived in the measurement window, in arrival order."""
    inside = (records["arrival_s"] >= start_s) & (records["arrival_s"] <= stop_s)
    return records[inside].sort_values("arrival_s", kind="stable")


def _values(records: pd.DataFrame, metric: str) -> np.ndarray:
    """A latency of the finished requests, or each request's 0/1 SLO verdict (unfinished: 0)."""
    if metric == ATTAINMENT:
        return records["meets_slo"].to_numpy(dtype=float)
    finished = records[records["status"] == "finished"]
    values = finished[metric].to_numpy(dtype=float)
    return values[~np.isnan(values)]


MIN_BATCH = 30               # observations per batch at the least: shorter batches stay correlated


def _batches(count: int, batches: int) -> int:
    """As many batches as allowed, each of at least MIN_BATCH observations (and never fewer than 2)."""
    return max(2, min(batches, count // MIN_BATCH))


def _quiet(function):
    """scipy warns of lost precision when batch means are nearly equal (attainment near 100%):
    the interval is then tight and right, so the warning is noise to a user."""
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return function(*args, **kwargs)
    wrapped.__doc__, wrapped.__name__ = function.__doc__, function.__name__
    return wrapped


@_quiet
def compare_independent(control: pd.DataFrame, treatment: pd.DataFrame, batches: int = BATCHES,
                        seed: int = 0, percentiles=PERCENTILES, metrics=(*METRICS, ATTAINMENT)) -> list[Difference]:
    """Canary (``treatment``) against control: the measured requests of each (see :func:`measured`)."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    out = []
    for metric in metrics:
        a, b = _values(control, metric), _values(treatment, metric)
        k = _batches(min(len(a), len(b)), batches)
        if min(len(a), len(b)) < 2 * k:
            continue
        means_a, means_b = batch_series(a, k), batch_series(b, k)
        difference = float(means_b.mean() - means_a.mean())
        if np.ptp(means_a) == 0 and np.ptp(means_b) == 0:        # no spread (every request met the SLO)
            low = high = difference
            p_value = 1.0 if difference == 0 else 0.0
        else:
            welch = stats.ttest_ind(means_b, means_a, equal_var=False)
            interval = welch.confidence_interval(0.95)
            low, high, p_value = interval.low, interval.high, welch.pvalue
        rank = stats.mannwhitneyu(b, a).pvalue if metric != ATTAINMENT else math.nan
        out.append(Difference(metric, "mean", float(means_a.mean()), float(means_b.mean()), difference,
                              float(low), float(high), float(p_value), "Welch t on batch means", float(rank)))
        if metric == ATTAINMENT:
            continue
        if percentiles:
            draws = (_resampled_percentiles(_blocks(b, k), percentiles, rng)
                     - _resampled_percentiles(_blocks(a, k), percentiles, rng))
            out += [_bootstrapped(metric, q, np.percentile(a, q), np.percentile(b, q), draws[:, j])
                    for j, q in enumerate(percentiles)]
    return out


@_quiet
def compare_paired(control: pd.DataFrame, shadow: pd.DataFrame, batches: int = BATCHES,
                   seed: int = 0, percentiles=PERCENTILES) -> list[Difference]:
    """Shadow against control on the requests both served (joined by ``id``, in arrival order)."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    pairs = control.merge(shadow, on="id", suffixes=("_control", "_shadow")).sort_values("arrival_s_control")
    out = []
    for metric in (*METRICS, ATTAINMENT):
        if metric == ATTAINMENT:
            a = pairs["meets_slo_control"].to_numpy(dtype=float)
            b = pairs["meets_slo_shadow"].to_numpy(dtype=float)
        else:
            both = (pairs["status_control"] == "finished") & (pairs["status_shadow"] == "finished")
            a = pairs.loc[both, f"{metric}_control"].to_numpy(dtype=float)
            b = pairs.loc[both, f"{metric}_shadow"].to_numpy(dtype=float)
            keep = ~(np.isnan(a) | np.isnan(b))
            a, b = a[keep], b[keep]
        k = _batches(len(a), batches)
        if len(a) < 2 * k:
            continue
        means = batch_series(b - a, k)
        if np.ptp(means) == 0:                 # no spread: the same difference in every batch
            low = high = float(means[0])
            p_value = 1.0 if means[0] == 0 else 0.0
        else:
            test = stats.ttest_1samp(means, 0.0)
            interval = test.confidence_interval(0.95)
            low, high, p_value = interval.low, interval.high, test.pvalue
        rank = math.nan
        if metric != ATTAINMENT and np.any(b != a):
            rank = stats.wilcoxon(b, a).pvalue
        usable = len(a) // k * k
        out.append(Difference(metric, "mean", float(a[:usable].mean()), float(b[:usable].mean()), float(means.mean()),
                              float(low), float(high), float(p_value), "paired t on batch means", float(rank)))
        if metric == ATTAINMENT:
            continue
        if percentiles:
            state = rng.bit_generator.state            # the same blocks drawn for both: a paired resample
            draws_b = _resampled_percentiles(_blocks(b, k), percentiles, rng)
            rng.bit_generator.state = state
            draws = draws_b - _resampled_percentiles(_blocks(a, k), percentiles, rng)
            out += [_bootstrapped(metric, q, np.percentile(a, q), np.percentile(b, q), draws[:, j])
                    for j, q in enumerate(percentiles)]
    return out


def _blocks(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``len // k * k`` values as ``k`` consecutive blocks (rows)."""
    usable = len(values) // k * k
    return values[:usable].reshape(k, -1)


def _resampled_percentiles(blocks: np.ndarray, percentiles, rng: np.random.Generator,
                           samples: int = BOOTSTRAP_SAMPLES) -> np.ndarray:
    """``samples`` block-bootstrap resamples (``k`` blocks drawn with replacement): each one's
    percentiles, a (samples, len(percentiles)) array. Resamples are taken a few at a time to bound memory."""
    k, size = blocks.shape
    picks = rng.integers(0, k, (samples, k))
    step = max(1, 4_000_000 // max(1, k * size))
    return np.concatenate([np.percentile(blocks[picks[i:i + step]].reshape(len(picks[i:i + step]), -1),
                                         percentiles, axis=1).T for i in range(0, samples, step)])


def _bootstrapped(metric: str, q: int, control: float, treatment: float, draws: np.ndarray) -> Difference:
    """A percentile's difference with the bootstrap's percentile interval and two-sided p-value."""
    low, high = np.percentile(draws, [2.5, 97.5])
    # Two-sided, and never below one draw's weight: 400 draws cannot tell p from 0 below 1/400.
    p_value = min(1.0, max(2 * min(np.mean(draws <= 0), np.mean(draws >= 0)), 1 / len(draws)))
    return Difference(metric, f"p{q}", float(control), float(treatment), float(treatment - control),
                      float(low), float(high), float(p_value), "block bootstrap")


# The smallest relative change whose detection time is reported (``llmsim run --detect``): the
# requests needed grow as 1 / change^2, and at 0.1% a canary already needs about 8e6 x CV^2 of them
# ((z_0.975 + z_0.8)^2 = 7.85, over 0.001^2), beyond any rollout; smaller targets only print
# astronomical times (and 1e-300 squared is 0).
MIN_DETECTABLE_CHANGE = 1e-3


@dataclass(frozen=True)
class DetectionTime:
    """How long a canary must run to detect a change of ``change`` (relative) in a metric's mean."""
    metric: str
    change: float                  # relative change to detect, e.g. 0.05 = 5% of the control's mean
    requests: float                # requests the treatment group must serve
    seconds: float                 # at its share of the arrival rate, warm-up excluded
    detectable_now: float          # relative change this run could detect (same alpha and power)


def detection_time(control: pd.DataFrame, treatment: pd.DataFrame, fraction: float, rate_per_s: float,
                   change: float = 0.05, alpha: float = 0.05, power: float = 0.8, paired: bool = False,
                   batches: int = BATCHES) -> list[DetectionTime]:
    """Per mean metric: the requests and seconds the treatment (a canary at ``fraction`` of
    ``rate_per_s``, or a shadow copying that fraction when ``paired``) needs for a two-sided test at
    ``alpha`` to detect a mean change of ``change`` x the control's mean with probability ``power``.

    Each group's variance per request is ``n x se^2`` from its batch means, which counts the
    correlation between neighbouring requests. For a canary, ``Var(diff) = s_t^2 / n_t + s_c^2 / n_c``
    with ``n_c = n_t (1 - f) / f``; for a shadow, ``s_d^2 / n`` of the paired differences. The
    needed ``n_t`` makes ``(z_{1-alpha/2} + z_power) sqrt(Var) = change x mean_c``.
    """
    from scipy import stats

    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    out = []
    for metric in (*METRICS, ATTAINMENT):
        if paired:
            pairs = control.merge(treatment, on="id", suffixes=("_c", "_t")).sort_values("arrival_s_c")
            column = "meets_slo" if metric == ATTAINMENT else metric
            a = pairs[f"{column}_c"].to_numpy(dtype=float)
            d = pairs[f"{column}_t"].to_numpy(dtype=float) - a
            keep = ~np.isnan(d)
            a, d = a[keep], d[keep]
            if len(d) < 4:
                continue
            n = len(d)
            per_request = _variance_per_request(d, batches)
        else:
            a, b = _values(control, metric), _values(treatment, metric)
            if min(len(a), len(b)) < 4:
                continue
            n = len(b)
            per_request = (_variance_per_request(b, batches)
                           + _variance_per_request(a, batches) * fraction / (1 - fraction))
        target = change * abs(float(np.mean(a)))
        if not (target > 0 and per_request > 0):        # nothing to detect, or no spread to estimate it from
            continue
        needed = z ** 2 * per_request / target ** 2
        out.append(DetectionTime(metric, change, needed, needed / (fraction * rate_per_s),
                                 z * math.sqrt(per_request / n) / abs(float(np.mean(a)))))
    return out


def _variance_per_request(values: np.ndarray, batches: int) -> float:
    """``n x (batch-means standard error)^2``: a series' variance per observation, correlation included."""
    k = _batches(len(values), batches)
    means = batch_series(values, k)
    usable = len(values) // k * k
    return float(means.var(ddof=1) / k * usable)
