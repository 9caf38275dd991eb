"""Is the canary different? Differences of each metric with confidence intervals, tests, a verdict,
and how long a canary must run to see a given change.

The requests of one run are not independent: a request that waits makes the next one wait too,
and a batch that grows slows every sequence in it for a while. So every interval here comes from
*batches* of consecutive requests (in arrival order) long enough that their figures are close to
independent, by a stated rule (:func:`_batch_count`): at most 20 batches (Schmeiser's 10-30), each of
at least ``SPAN`` (5) times the group's correlation time and at least 30 requests (a percentile's: 5
beyond it), then halved while the batch figures still correlate at lag 1 (von Neumann's test at 10%,
as Fishman's LBATCH rule runs it); a group left with fewer than 4 batches has no interval ("n/a",
with the requests it would need). The correlation time is the longest integrated autocorrelation
time of the group's TTFT, TPOT and end-to-end series (:func:`llmsim.analysis.statistics.correlation_time`),
used for every metric: they all follow the one state of the replicas (queue and batch), and a
metric whose own spread is mostly request to request (end-to-end time, through the output length)
hides that slow part from its own estimate while it still moves its mean.

Canary against control (independent samples, :func:`compare_independent`)
    a mean, an attainment (the share of requests meeting the SLO) or a percentile: the
    difference of the two groups' figures over all their requests, with Welch's t interval and
    test (Welch-Satterthwaite degrees of freedom from each group's ``k - 1``) from the spread of
    the figure across each group's batches (batch means for a mean,
    *sectioning* for a percentile: each batch's own percentile, Asmussen and Glynn, Stochastic
    Simulation, III.5; a percentile's batches hold at least 5 requests beyond it). Every latency
    row also carries the Mann-Whitney U test's p-value on the requests themselves, a test of a
    shift in the whole distribution (it treats requests as independent, so it is optimistic
    under heavy queueing).
Shadow against control (paired, :func:`compare_paired`)
    each copied request was served by both, so the difference is taken request by request: the
    mean difference with a one-sample t interval on the batch means of the differences, a
    percentile's difference with one on the batches' percentile differences, and the Wilcoxon
    signed-rank test on the request pairs.

Across independent replications (``rollout.replications: R``, :func:`compare_replications`)
    batches within one run are never quite independent: a loaded replica's TPOT keeps a long, thin
    tail of correlation that batches of a short run cannot hold. The textbook remedy is independent
    replications (Law and Kelton, Simulation Modeling and Analysis, 9.4.1): the whole rollout run
    ``R`` times on independent seeds, each metric's group-minus-control difference taken per run
    (over the requests both served, for a shadow), and Student's t on the ``R`` differences with
    ``R - 1`` degrees of freedom. The runs are independent whatever the correlation within each, so
    the test holds its level for any ``R >= 2`` (5 or more for useful power).

:func:`verdict` says in one line what the differences mean; :func:`detection_time` turns the
measured variances into the time a canary must run to detect a change of a given size with a given
power (the two-sample normal approximation, with each group's variance per request of a metric
times that metric's own correlation time, so queueing's correlation is counted).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from llmsim.analysis.statistics import (BATCHES, MIN_BATCH, MIN_BATCHES, batch_size, correlation_time,
                                        lag1_correlated)
from llmsim.config.policies import RolloutRole

METRICS = ("ttft_s", "tpot_s", "e2e_s")
PERCENTILES = (50, 95, 99)
ATTAINMENT = "attainment"
TAIL = 5                     # requests beyond a percentile in each of its batches at the least
LEVEL = 0.95                 # the intervals' confidence; tests at 1 - LEVEL


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
        """The interval excludes 0 (False when there is no interval: too few batches)."""
        return bool(self.low > 0.0 or self.high < 0.0)

    @property
    def has_interval(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)


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


def _quiet(function):
    """scipy warns of lost precision when batch figures are nearly equal (attainment near 100%):
    the interval is then tight and right, so the warning is noise to a user."""
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return function(*args, **kwargs)
    wrapped.__doc__, wrapped.__name__ = function.__doc__, function.__name__
    return wrapped


Statistic = Callable[[np.ndarray], np.ndarray]      # rows of batches -> one figure per row


def _statistic(name: str) -> tuple[Statistic, int]:
    """The figure named ``name`` (``mean`` or ``p<q>``) of each row, and the fewest requests a batch needs for it."""
    if name == "mean":
        return (lambda rows: rows.mean(axis=-1)), MIN_BATCH
    q = float(name[1:])
    return (lambda rows: np.percentile(rows, q, axis=-1)), max(MIN_BATCH, math.ceil(TAIL / (1 - q / 100)))


def _batch_count(figures: Callable[[int], np.ndarray], length: int, size: int, batches: int) -> int:
    """How many batches a series of ``length`` is cut into: as many of at least ``size`` observations as
    it holds, at most ``batches``, then halved (each batch twice as long) while the batch figures
    ``figures(k)`` still correlate at lag 1 (:func:`~llmsim.analysis.statistics.lag1_correlated`);
    below ``MIN_BATCHES`` the comparison has no interval."""
    k = min(batches, length // size)
    while k >= MIN_BATCHES and lag1_correlated(figures(k)):
        k //= 2
    return k


def _batched(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``len // k * k`` values as ``k`` consecutive batches (rows)."""
    usable = len(values) // k * k
    return values[:usable].reshape(k, -1)


def _unmeasured(metric: str, name: str, control: float, treatment: float, needed: int, tau: float,
                lengths: Sequence[int]) -> Difference:
    """A row without an interval, saying why: too few requests for ``MIN_BATCHES`` batches of ``needed``, or
    enough of them whose batch figures still correlate (a longer run is needed either way)."""
    why = (f"n/a: {MIN_BATCHES} batches of {needed:,} requests per group needed "
           f"(correlation time {tau:.3g} requests)" if min(lengths) < MIN_BATCHES * needed else
           f"n/a: batch figures still correlated at lag 1 with {MIN_BATCHES}+ batches (the correlation time "
           f"{tau:.3g} requests falls short): run longer")
    return Difference(metric, name, control, treatment, treatment - control, math.nan, math.nan, math.nan, why)


def _t_row(metric: str, name: str, control: float, treatment: float, difference: float, se: float, df: float,
           test: str, rank: float = math.nan) -> Difference:
    """A difference with the t interval ``difference +- t_df se`` and its two-sided p-value."""
    from scipy import stats

    if not se > 0:                              # no spread: every batch the same (attainment 100% in both)
        low = high = difference
        p_value = 1.0 if difference == 0 else 0.0
    else:
        half = float(stats.t.ppf(0.5 + LEVEL / 2, df)) * se
        low, high = difference - half, difference + half
        p_value = float(2 * stats.t.sf(abs(difference) / se, df))
    return Difference(metric, name, float(control), float(treatment), float(difference), float(low), float(high),
                      float(p_value), test, float(rank))


def _independent_row(metric: str, name: str, a: np.ndarray, b: np.ndarray, tau: float, batches: int,
                     rank: float = math.nan) -> Difference:
    """Welch's t on each group's batch figures, centred on the figures over all the requests."""
    statistic, minimum = _statistic(name)
    control, treatment = float(statistic(a)), float(statistic(b))
    size = batch_size(tau, minimum)
    ka = _batch_count(lambda k: statistic(_batched(a, k)), len(a), size, batches)
    kb = _batch_count(lambda k: statistic(_batched(b, k)), len(b), size, batches)
    if min(ka, kb) < MIN_BATCHES:
        return _unmeasured(metric, name, control, treatment, size, tau, (len(a), len(b)))
    va = float(np.var(statistic(_batched(a, ka)), ddof=1)) / ka
    vb = float(np.var(statistic(_batched(b, kb)), ddof=1)) / kb
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (ka - 1) + vb ** 2 / (kb - 1)) if se > 0 else math.inf
    how = "batch means" if name == "mean" else "batch percentiles"
    return _t_row(metric, name, control, treatment, treatment - control, se, df,
                  f"Welch t on {how} ({ka} + {kb} batches, df {df:.3g})", rank)


@_quiet
def compare_independent(control: pd.DataFrame, treatment: pd.DataFrame, batches: int = BATCHES,
                        percentiles: Sequence[int] = PERCENTILES,
                        metrics: Sequence[str] = (*METRICS, ATTAINMENT)) -> list[Difference]:
    """Canary (``treatment``) against control: the measured requests of each (see :func:`measured`)."""
    from scipy import stats

    tau = max(_state_correlation_time(control), _state_correlation_time(treatment))
    out = []
    for metric in metrics:
        a, b = _values(control, metric), _values(treatment, metric)
        if min(len(a), len(b)) < 2:
            continue
        rank = float(stats.mannwhitneyu(b, a).pvalue) if metric != ATTAINMENT else math.nan
        out.append(_independent_row(metric, "mean", a, b, tau, batches, rank))
        if metric != ATTAINMENT:
            out += [_independent_row(metric, f"p{q}", a, b, tau, batches) for q in percentiles]
    return out


def _paired_row(metric: str, name: str, a: np.ndarray, b: np.ndarray, tau: float, batches: int,
                rank: float = math.nan) -> Difference:
    """A one-sample t on the batches' differences (of means, or of percentiles), centred on the
    difference over all the pairs."""
    statistic, minimum = _statistic(name)
    control, treatment = float(statistic(a)), float(statistic(b))
    size = batch_size(tau, minimum)
    k = _batch_count(lambda k: statistic(_batched(b, k)) - statistic(_batched(a, k)), len(a), size, batches)
    if k < MIN_BATCHES:
        return _unmeasured(metric, name, control, treatment, size, tau, (len(a),))
    spread = statistic(_batched(b, k)) - statistic(_batched(a, k))
    se = float(np.std(spread, ddof=1)) / math.sqrt(k)
    how = "batch mean differences" if name == "mean" else "batch percentile differences"
    return _t_row(metric, name, control, treatment, treatment - control, se, k - 1, f"paired t on {how} ({k} batches)",
                  rank)


@_quiet
def compare_paired(control: pd.DataFrame, shadow: pd.DataFrame, batches: int = BATCHES,
                   percentiles: Sequence[int] = PERCENTILES) -> list[Difference]:
    """Shadow against control on the requests both served (joined by ``id``, in arrival order)."""
    from scipy import stats

    pairs = control.merge(shadow, on="id", suffixes=("_control", "_shadow")).sort_values("arrival_s_control")
    series = {metric: _paired_values(pairs, metric) for metric in (*METRICS, ATTAINMENT)}
    tau = max(correlation_time(x) for metric in METRICS for a, b in [series[metric]] for x in (a, b, b - a))
    out = []
    for metric, (a, b) in series.items():
        if len(a) < 2:
            continue
        rank = float(stats.wilcoxon(b, a).pvalue) if metric != ATTAINMENT and np.any(b != a) else math.nan
        out.append(_paired_row(metric, "mean", a, b, tau, batches, rank))
        if metric != ATTAINMENT:
            out += [_paired_row(metric, f"p{q}", a, b, tau, batches) for q in percentiles]
    return out


def _state_correlation_time(records: pd.DataFrame) -> float:
    """The longest correlation time of a group's latency series (see the module docstring)."""
    return max(correlation_time(_values(records, metric)) for metric in METRICS)


def _paired_values(pairs: pd.DataFrame, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The control's and the shadow's values of ``metric`` on the pairs both finished (attainment: all pairs)."""
    if metric == ATTAINMENT:
        return pairs["meets_slo_control"].to_numpy(dtype=float), pairs["meets_slo_shadow"].to_numpy(dtype=float)
    both = (pairs["status_control"] == "finished") & (pairs["status_shadow"] == "finished")
    a = pairs.loc[both, f"{metric}_control"].to_numpy(dtype=float)
    b = pairs.loc[both, f"{metric}_shadow"].to_numpy(dtype=float)
    keep = ~(np.isnan(a) | np.isnan(b))
    return a[keep], b[keep]


def _figures(control: pd.DataFrame, treatment: pd.DataFrame, paired: bool, percentiles: Sequence[int],
             metrics: Sequence[str]) -> dict[tuple[str, str], tuple[float, float]]:
    """One run's (control, treatment) figure per (metric, statistic): over the pairs both served when ``paired``."""
    if paired:
        pairs = control.merge(treatment, on="id", suffixes=("_control", "_shadow"))
        series = {metric: _paired_values(pairs, metric) for metric in metrics}
    else:
        series = {metric: (_values(control, metric), _values(treatment, metric)) for metric in metrics}
    figures = {}
    for metric, (a, b) in series.items():
        if min(len(a), len(b)) < 1:
            continue
        for name in ("mean", *(() if metric == ATTAINMENT else (f"p{q}" for q in percentiles))):
            statistic, _ = _statistic(name)
            figures[(metric, name)] = (float(statistic(a)), float(statistic(b)))
    return figures


@_quiet
def compare_replications(runs: Sequence[tuple[pd.DataFrame, pd.DataFrame]], paired: bool = False,
                         percentiles: Sequence[int] = PERCENTILES,
                         metrics: Sequence[str] = (*METRICS, ATTAINMENT)) -> list[Difference]:
    """A group against the control over ``R >= 2`` independent runs (each a pair of measured records:
    control, group): each figure's difference per run, and Student's t on the ``R`` differences
    (``R - 1`` degrees of freedom). The control and group figures shown are the runs' averages. A
    figure missing from a run (no finished request with it) is compared over the runs that have it."""
    per_run = [_figures(control, treatment, paired, percentiles, metrics) for control, treatment in runs]
    keys = list(dict.fromkeys(key for figures in per_run for key in figures))
    out = []
    for metric, name in keys:
        both = np.array([figures[(metric, name)] for figures in per_run if (metric, name) in figures])
        if len(both) < 2:
            continue
        differences = both[:, 1] - both[:, 0]
        replications = len(differences)
        se = float(np.std(differences, ddof=1)) / math.sqrt(replications)
        out.append(_t_row(metric, name, float(both[:, 0].mean()), float(both[:, 1].mean()), float(differences.mean()),
                          se, replications - 1,
                          f"{'paired ' if paired else ''}t across {replications} replications (df {replications - 1})"))
    return out


def verdict(name: str, role: str, differences: Sequence[Difference]) -> str:
    """One line: which figures of the group are significantly worse or better than the control's (each
    tested at ``1 - LEVEL``), and what it means for the rollout."""
    def worse(d: Difference) -> bool:            # higher latency, or lower attainment
        return (d.difference < 0) if d.metric == ATTAINMENT else (d.difference > 0)

    def label(d: Difference) -> str:
        change = (f"{100 * d.difference:+.2g} points" if d.metric == ATTAINMENT
                  else f"{100 * d.difference / d.control:+.1f}%" if d.control else f"{d.difference:+.3g}")
        return f"{d.metric.removesuffix('_s').upper() if d.metric != ATTAINMENT else d.metric} {d.statistic} {change}"

    significant = [d for d in differences if d.significant]
    bad = [label(d) for d in significant if worse(d)]
    good = [label(d) for d in significant if not worse(d)]
    unmeasured = [f"{d.metric.removesuffix('_s').upper()} {d.statistic}" for d in differences if not d.has_interval]
    level = f"{100 * (1 - LEVEL):g}%"
    missing = f"; no interval (run too short): {', '.join(unmeasured)}" if unmeasured else ""
    if differences and len(unmeasured) == len(differences):
        return (f"verdict: none for {name}: no figure has an interval, the run is too short for its correlation "
                "time (the rows above say how many requests each needs)")
    if bad:
        text = (f"{name} is worse than the control ({level} level): {', '.join(bad)}"
                + (f"; better: {', '.join(good)}" if good else "") + missing
                + f": do not {'roll it out' if role == RolloutRole.CANARY else 'promote it'}")
    elif good:
        text = (f"{name} is better than the control ({level} level): {', '.join(good)}; no figure is "
                f"significantly worse{missing}")
    else:
        text = (f"no significant difference between {name} and the control at the {level} level{missing}: this "
                "run cannot tell them apart (the changes it detects are above; run longer to see smaller ones)")
    return f"verdict: {text}"


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
                   change: float = 0.05, alpha: float = 0.05, power: float = 0.8,
                   paired: bool = False) -> list[DetectionTime]:
    """Per mean metric: the requests and seconds the treatment (a canary at ``fraction`` of
    ``rate_per_s``, or a shadow copying that fraction when ``paired``) needs for a two-sided test at
    ``alpha`` to detect a mean change of ``change`` x the control's mean with probability ``power``.

    Each group's variance per request of a metric is its variance times that metric's own correlation
    time (a mean's variance over a long run is ``tau s^2 / n``), which counts the correlation between
    neighbouring requests. For a canary, ``Var(diff) = s_t^2 / n_t + s_c^2 / n_c``
    with ``n_c = n_t (1 - f) / f``; for a shadow, ``s_d^2 / n`` of the paired differences. The
    needed ``n_t`` makes ``(z_{1-alpha/2} + z_power) sqrt(Var) = change x mean_c``.
    """
    from scipy import stats

    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    out = []
    if paired:
        pairs = control.merge(treatment, on="id", suffixes=("_control", "_shadow")).sort_values("arrival_s_control")
        series = {metric: _paired_values(pairs, metric) for metric in (*METRICS, ATTAINMENT)}
    for metric in (*METRICS, ATTAINMENT):
        if paired:
            a, b = series[metric]
            if len(a) < 4:
                continue
            n = len(a)
            per_request = _variance_per_request(b - a)
        else:
            a, b = _values(control, metric), _values(treatment, metric)
            if min(len(a), len(b)) < 4:
                continue
            n = len(b)
            per_request = (_variance_per_request(b)
                           + _variance_per_request(a) * fraction / (1 - fraction))
        target = change * abs(float(np.mean(a)))
        if not (target > 0 and per_request > 0):        # nothing to detect, or no spread to estimate it from
            continue
        needed = z ** 2 * per_request / target ** 2
        out.append(DetectionTime(metric, change, needed, needed / (fraction * rate_per_s),
                                 z * math.sqrt(per_request / n) / abs(float(np.mean(a)))))
    return out


def _variance_per_request(values: np.ndarray) -> float:
    """A series' variance per observation, correlation included: its variance times its own correlation
    time (``n`` times the variance of its mean, for a long series)."""
    return float(np.var(values, ddof=1)) * correlation_time(values)
