"""The canary comparison holds its nominal level on autocorrelated runs: an A/A study.

Two identical one-replica groups (a canary of the control's own settings, half the traffic) differ
only by chance, so each metric's test at 5% must reject in a share of seeds inside the 95% binomial
interval of 5%, each metric on its own (no family-wise correction): neither more (the fault: treating
the requests of a run as independent, or batches shorter than the run's correlation) nor fewer (an
interval made wide for nothing). Llama-3.1-8B on H100, 16 sequences at a time, half of 40 requests/s
each, about 520 requests per group in the window (short runs, so 200 seeds stay affordable): the batch
fills and drains, so TTFT and TPOT correlate over 2-3 requests. On these 200 seeds the method before
the batches followed the correlation (20 batches whatever the correlation, a block bootstrap for
percentiles), and the one with batches of 20 correlation times, reject E2E P50 in 17 (above the
interval's 16).
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmsim.analysis.canary import compare_independent, measured, verdict
from llmsim.analysis.statistics import correlation_time, lag1_correlated
from llmsim.search.rollout import simulate_rollout
from tests.helpers import make_scenario

A_A = {"engine": {"max_num_seqs": 16},
       "workload": {"num_requests": 1200, "arrival": {"rate": 40},
                    "prompt_tokens": {"distribution": "lognormal", "mean": 256, "sigma": 0.8, "max": 2048},
                    "output_tokens": {"distribution": "exponential", "mean": 16, "max": 1024}},
       "rollout": {"groups": {"twin": {"role": "canary", "fraction": 0.5, "replicas": 1}}}}
# Every figure that has an interval on most seeds: a TPOT P95 needs 5 batches of 100 finished requests with
# a TPOT (an answer of one token has none), which a third of these short runs have.
TESTED = {("ttft_s", "mean"), ("ttft_s", "p50"), ("ttft_s", "p95"), ("tpot_s", "mean"), ("tpot_s", "p50"),
          ("e2e_s", "mean"), ("e2e_s", "p50"), ("e2e_s", "p95")}
SHARE = 0.7             # of the seeds with an interval at the least (the lag-1 test lengthens some batches)


def a_a_rejections(seeds: range) -> dict[tuple[str, str], list[bool]]:
    """Per (metric, statistic) with an interval: whether each seed's A/A comparison rejected equality."""
    base = make_scenario(A_A)
    found: dict[tuple[str, str], list[bool]] = {}
    for seed in seeds:
        result = simulate_rollout(base.with_seed(seed))
        start, stop = result.user.warmup_s, result.user.arrival_window_s
        differences = compare_independent(measured(result.records("control"), start, stop),
                                          measured(result.records("twin"), start, stop))
        for d in differences:
            if d.has_interval:
                found.setdefault((d.metric, d.statistic), []).append(d.significant)
            else:
                assert d.test.startswith("n/a: "), d
    return found


def check_level(found: dict[tuple[str, str], list[bool]], seeds: int, share_with_interval: float) -> None:
    """Each tested metric has an interval on at least ``share_with_interval`` of the seeds, and rejects in a
    share inside the 95% binomial interval of 5% over the seeds where it has one."""
    assert not any(found.pop(("attainment", "mean"), []))     # the scenario sets no SLO: every request meets it
    assert set(found) >= TESTED, set(found)
    for key in TESTED:
        rejected = found[key]
        assert len(rejected) >= share_with_interval * seeds, (key, len(rejected))
        low, high = stats.binom.interval(0.95, len(rejected), 0.05)
        assert low <= sum(rejected) <= high, (key, sum(rejected), len(rejected), (low, high))


@pytest.mark.slow
def test_a_a_false_positive_rate_is_the_nominal_five_percent_over_200_seeds():
    seeds = 200
    check_level(a_a_rejections(range(seeds)), seeds, share_with_interval=SHARE)


def test_a_a_quick_few_seeds_stay_within_the_binomial_interval():
    seeds = 4
    check_level(a_a_rejections(range(1000, 1000 + seeds)), seeds, share_with_interval=0.5)


def test_correlation_time_of_an_ar1_series_is_its_closed_form():
    """AR(1) x_t = phi x_{t-1} + e_t has rho_t = phi^t, so tau = (1 + phi) / (1 - phi)."""
    rng = np.random.default_rng(3)
    for phi in (0.0, 0.5, 0.8):
        n = 40_000
        noise = rng.normal(size=n)
        x = np.empty(n)
        x[0] = noise[0]
        for i in range(1, n):
            x[i] = phi * x[i - 1] + noise[i]
        truth = (1 + phi) / (1 - phi)
        # the estimator's standard error is about sqrt(2 (2M + 1) / n) tau for a window M of a few tau
        assert correlation_time(x) == pytest.approx(truth, rel=0.12), phi
        halves = correlation_time(x[: n // 2], x[n // 2:])          # two series of one process, pooled
        assert halves == pytest.approx(truth, rel=0.15), phi


def test_verdict_says_what_the_differences_mean():
    base = make_scenario(A_A)
    same = simulate_rollout(base.with_seed(4))
    start, stop = same.user.warmup_s, same.user.arrival_window_s
    control = measured(same.records("control"), start, stop)
    twin = compare_independent(control, measured(same.records("twin"), start, stop))
    if not any(d.significant for d in twin):
        assert verdict("twin", "canary", twin).startswith("verdict: no significant difference")
    slower = make_scenario({**A_A, "workload": {**A_A["workload"], "num_requests": 2000},
                            "rollout": {"groups": {"slow": {"role": "canary", "fraction": 0.5, "replicas": 1,
                                                            "hardware": "A100-80GB"}}}}).with_seed(4)
    result = simulate_rollout(slower)
    start, stop = result.user.warmup_s, result.user.arrival_window_s
    slow = compare_independent(measured(result.records("control"), start, stop),
                               measured(result.records("slow"), start, stop))
    line = verdict("slow", "canary", slow)
    assert line.startswith("verdict: slow is worse than the control") and line.endswith("do not roll it out"), line
    tpot = next(d for d in slow if (d.metric, d.statistic) == ("tpot_s", "mean"))
    assert tpot.significant and tpot.difference > 0          # an A100 decodes slower than an H100


def test_lag1_test_of_batch_means_holds_its_level_and_sees_a_correlation():
    """von Neumann's ratio on independent normal means rejects at its 10% level (within three binomial
    standard errors), and 20 means correlated at lag 1 by 0.5 (an AR(1) series) in most trials: the
    ratio's null deviation is sqrt(18 / 399) = 0.21 and its mean about 0.5 - (1 + 4 x 0.5) / 20 = 0.35,
    so the normal approximation gives a power of about 0.64 at 10%."""
    rng = np.random.default_rng(11)
    trials, k, level = 4000, 20, 0.10
    independent = sum(lag1_correlated(rng.normal(size=k), level) for _ in range(trials)) / trials
    assert abs(independent - level) <= 3 * np.sqrt(level * (1 - level) / trials), independent
    correlated = 0
    for _ in range(trials // 10):
        x = rng.normal(size=k)
        for i in range(1, k):
            x[i] = 0.5 * x[i - 1] + np.sqrt(1 - 0.25) * x[i]
        correlated += lag1_correlated(x, level)
    assert correlated / (trials // 10) > 0.6, correlated
