"""The canary comparison holds its nominal level on autocorrelated runs: an A/A study.

Two identical one-replica groups (a canary of the control's own settings, half the traffic) differ
only by chance, so each metric's test at 5% must reject in a share of seeds inside the binomial
interval of 5%: neither more (the fault: treating the requests of a run as independent, or batches
shorter than the run's correlation) nor much fewer (an interval made wide for nothing). The nine
metrics with intervals are checked together, so each interval is the 1 - 0.05 / 9 one (Bonferroni):
together they hold with 95% for a test at its exact level, where nine separate 95% intervals would
fail one in three such tests by chance alone. Llama-3.1-8B on H100, 16 sequences at a time, half of
40 requests/s each: the batch fills and drains, so TTFT and TPOT correlate over 2-3 requests.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from llmsim.analysis.canary import compare_independent, measured, verdict
from llmsim.analysis.statistics import correlation_time
from llmsim.search.rollout import simulate_rollout
from tests.helpers import make_scenario

A_A = {"engine": {"max_num_seqs": 16},
       "workload": {"num_requests": 1200, "arrival": {"rate": 40},
                    "prompt_tokens": {"distribution": "lognormal", "mean": 256, "sigma": 0.8, "max": 2048},
                    "output_tokens": {"distribution": "exponential", "mean": 16, "max": 1024}},
       "rollout": {"groups": {"twin": {"role": "canary", "fraction": 0.5, "replicas": 1}}}}


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
                assert d.test.startswith("n/a: ") and d.statistic == "p99", d      # too few requests beyond a P99
    return found


def check_level(found: dict[tuple[str, str], list[bool]], seeds: int) -> None:
    tested = len(found) - 1                           # every metric with an interval but attainment
    for key, rejected in found.items():
        if key == ("attainment", "mean"):          # the BASE scenario sets no SLO: every request meets it
            assert not any(rejected)
            continue
        assert len(rejected) >= 0.95 * seeds, (key, len(rejected))     # an interval on (nearly) every seed
        low, high = stats.binom.interval(1 - 0.05 / tested, len(rejected), 0.05)
        assert low <= sum(rejected) <= high, (key, sum(rejected), len(rejected), (low, high))


@pytest.mark.slow
def test_a_a_false_positive_rate_is_the_nominal_five_percent_over_200_seeds():
    seeds = 200
    found = a_a_rejections(range(seeds))
    assert {("tpot_s", "mean"), ("tpot_s", "p95"), ("ttft_s", "mean"), ("e2e_s", "mean")} <= set(found)
    check_level(found, seeds)


def test_a_a_quick_few_seeds_stay_within_the_binomial_interval():
    seeds = 4
    check_level(a_a_rejections(range(1000, 1000 + seeds)), seeds)


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
