"""Independent replications hold the comparison's level where batches within one run cannot.

A loaded replica (64 sequences at a time, 64-token answers, half of 60 requests/s each) correlates its
TPOT over about 7 requests with a long, thin tail that batches of a short run do not hold: there the
single-run batch-means test rejects TPOT's mean and P50 in about 9% of A/A seeds at a nominal 5%. Whole
runs on independent seeds are independent whatever the correlation within each, so Student's t on the
per-run differences (``rollout.replications``) must reject each figure in a share of A/A seeds inside
the 95% binomial interval of 5%. Runs are short (600 requests, 5 replications) so 200 seeds stay
affordable; each run starts empty, which both groups share, so it moves no difference. With 300 requests a
run, a P99 of about 150 requests per group is their second largest, and t on such heavy-tailed differences
is conservative (Efron 1969, JASA 64): TPOT P99 then rejected 3 of 200, below the interval; at 600 every
figure lies inside it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import signal, stats

from llmsim.analysis.canary import compare_replications, detection_time, measured
from llmsim.search.rollout import simulate_replications
from tests.helpers import make_scenario

REPLICATIONS = 5
LOADED = {"engine": {"max_num_seqs": 64},
          "workload": {"num_requests": 600, "arrival": {"rate": 60},
                       "prompt_tokens": {"distribution": "lognormal", "mean": 256, "sigma": 0.8, "max": 2048},
                       "output_tokens": {"distribution": "exponential", "mean": 64, "max": 1024}},
          "rollout": {"replications": REPLICATIONS,
                      "groups": {"twin": {"role": "canary", "fraction": 0.5, "replicas": 1}}}}
FIGURES = {(metric, statistic) for metric in ("ttft_s", "tpot_s", "e2e_s")
           for statistic in ("mean", "p50", "p95", "p99")}


def replicated_rejections(seeds: range) -> dict[tuple[str, str], list[bool]]:
    """Per figure: whether each seed's A/A comparison across its replications rejected equality. Seed ``s``
    runs its replications on seeds ``s R .. s R + R - 1``, so no two seeds share a run."""
    base = make_scenario(LOADED)
    found: dict[tuple[str, str], list[bool]] = {}
    for seed in seeds:
        runs = simulate_replications(base.with_seed(seed * REPLICATIONS))
        pairs = [(measured(run.records("control"), run.user.warmup_s, run.user.arrival_window_s),
                  measured(run.records("twin"), run.user.warmup_s, run.user.arrival_window_s)) for run in runs]
        for d in compare_replications(pairs):
            assert d.has_interval and d.test == f"t across {REPLICATIONS} replications (df {REPLICATIONS - 1})"
            found.setdefault((d.metric, d.statistic), []).append(d.significant)
    return found


def check_level(found: dict[tuple[str, str], list[bool]], seeds: int) -> None:
    """Every figure has an interval on every seed and rejects inside the 95% binomial interval of 5%."""
    assert not any(found.pop(("attainment", "mean")))           # no SLO set: every request meets it in both
    assert set(found) == FIGURES
    low, high = stats.binom.interval(0.95, seeds, 0.05)
    for (metric, statistic), rejected in found.items():
        assert len(rejected) == seeds
        assert low <= sum(rejected) <= high, (metric, statistic, sum(rejected), (low, high))


@pytest.mark.slow
def test_replicated_a_a_false_positive_rate_is_the_nominal_five_percent_over_200_seeds_under_load():
    check_level(replicated_rejections(range(200)), 200)


def test_replicated_a_a_quick_few_seeds_stay_within_the_binomial_interval():
    check_level(replicated_rejections(range(1000, 1003)), 3)


def _frames(rng: np.random.Generator, phi: float, n: int, shift: float = 0.0) -> pd.DataFrame:
    """A run's records whose latencies are one AR(1) series (coefficient ``phi``, unit innovations) plus ``shift``."""
    noise = rng.normal(size=n)
    noise[0] /= np.sqrt(1 - phi ** 2)                        # started stationary
    x = signal.lfilter([1.0], [1.0, -phi], noise) + 10.0 + shift
    return pd.DataFrame({"arrival_s": np.arange(n, dtype=float), "status": "finished", "ttft_s": x, "tpot_s": x,
                         "e2e_s": x, "meets_slo": True})


def test_replications_hold_the_level_on_strongly_correlated_series():
    """Two groups of one AR(1) process with phi 0.97 (tau 66): 200 observations per run hold 3 correlation
    times, so batches within one run are far from independent, while 5 independent runs are independent.
    Over 400 trials the replicated test rejects the mean within three binomial standard errors of 5%."""
    rng = np.random.default_rng(21)
    trials, phi, n = 400, 0.97, 200
    rejected = 0
    for _ in range(trials):
        runs = [(_frames(rng, phi, n), _frames(rng, phi, n)) for _ in range(REPLICATIONS)]
        d, = compare_replications(runs, percentiles=(), metrics=("e2e_s",))
        rejected += d.significant
    assert abs(rejected / trials - 0.05) <= 3 * np.sqrt(0.05 * 0.95 / trials), rejected


def test_replications_detect_a_shift_with_the_power_of_a_t_test():
    """A shift of 2.5 standard errors of the mean of 5 per-run differences, on independent (phi 0) runs:
    a two-sided t test on 4 df detects it with the noncentral t's power (noncentrality 2.5)."""
    rng = np.random.default_rng(8)
    trials, n = 400, 50
    sd_difference = np.sqrt(2.0 / n)                         # of one run's difference of two means of n
    shift = sd_difference / np.sqrt(REPLICATIONS) * 2.5      # noncentrality 2.5
    rejected = 0
    for _ in range(trials):
        runs = [(_frames(rng, 0.0, n), _frames(rng, 0.0, n, shift)) for _ in range(REPLICATIONS)]
        d, = compare_replications(runs, percentiles=(), metrics=("e2e_s",))
        rejected += d.significant
    critical = stats.t.ppf(0.975, REPLICATIONS - 1)
    power = stats.nct.sf(critical, REPLICATIONS - 1, 2.5) + stats.nct.cdf(-critical, REPLICATIONS - 1, 2.5)
    assert abs(rejected / trials - power) <= 3 * np.sqrt(power * (1 - power) / trials), (rejected, power)


def test_detection_time_uses_each_metrics_own_correlation_time():
    """TTFT an AR(1) series with phi 0.5 (tau 3) and TPOT one with phi 0.9 (tau 19), both with unit
    innovations (variance 1 / (1 - phi^2)): the requests to detect a change are the closed form
    ``z^2 (s_t^2 tau + s_c^2 tau f / (1 - f)) / (change x mean)^2`` with each metric's own tau and
    variance. The estimator of tau has an error of about sqrt(2 (2M + 1) / n) of it for a window M of a
    few tau: at 40,000 observations, under 8% for phi 0.9 in each group, and the variance's about 3%;
    the sum over two groups halves the spread, so 20% is over three standard errors."""
    rng = np.random.default_rng(17)
    n, fraction, change, mean = 40_000, 0.5, 0.05, 10.0
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)

    def group() -> pd.DataFrame:
        ttft, tpot = _frames(rng, 0.5, n), _frames(rng, 0.9, n)
        return ttft.assign(tpot_s=tpot["tpot_s"], e2e_s=rng.normal(mean, 1.0, n))

    needed = {t.metric: t.requests for t in detection_time(group(), group(), fraction, 100.0, change)}
    for metric, phi in (("ttft_s", 0.5), ("tpot_s", 0.9), ("e2e_s", 0.0)):
        variance = 1.0 / (1 - phi ** 2)
        tau = (1 + phi) / (1 - phi)
        exact = z ** 2 * variance * tau * (1 + fraction / (1 - fraction)) / (change * mean) ** 2
        assert needed[metric] == pytest.approx(exact, rel=0.2), (metric, needed[metric], exact)

