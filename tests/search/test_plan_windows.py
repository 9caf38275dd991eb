"""Searches measure over windows that follow the rate, and their verdicts carry their uncertainty."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import llmsim
from llmsim.analysis import names
from llmsim.analysis.metrics import share_with_stderr
from llmsim.analysis.statistics import rising_trend
from llmsim.scenario.variants import variant
from llmsim.search import plan as planning
from llmsim.search import window as windows
from llmsim.search import sweeps
from llmsim.search.sweeps import run_points
from llmsim.search.window import MEASURED_LATENCIES, Window, judge, measurement_window

from tests.helpers import REPO

CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"


def test_the_window_follows_the_rate_not_the_request_count():
    """4,000 requests at 1,000 req/s arrive in 4 s, inside the chat scenario's 30 s warm-up: the
    search's window keeps the warm-up in seconds and measures for many request lifetimes."""
    scenario = llmsim.load_scenario(CHAT)
    for rate in (16.0, 1000.0):
        window = measurement_window(scenario, rate, latency_s=3.0)
        assert window.warmup_s >= scenario.simulation.warmup_s == 30.0
        assert window.measure_s >= MEASURED_LATENCIES * 3.0
        assert window.requests(rate) == math.ceil(rate * (window.warmup_s + window.measure_s))
        assert window.requests(rate) >= scenario.workload.num_requests     # the scenario's count is a floor
    assert measurement_window(scenario, 1000.0, 3.0).requests(1000.0) > 15 * scenario.workload.num_requests
    run = variant(scenario, {"workload.arrival.rate": 1000.0, **Window(np.float64(30.0), 60.0).overrides(1000.0)})
    assert run.workload.num_requests == 90_000 and run.simulation.warmup_s == 30.0


def test_a_probe_without_the_scenarios_floor_measures_what_the_window_rule_asks():
    """recommend's probes: the warm-up as before, the measurement the larger of 500 requests and 20 mean
    latencies, whatever the scenario's own request count (here 4,000 requests at 16/s: 250 s)."""
    scenario = llmsim.load_scenario(CHAT)
    for rate, latency_s in ((16.0, 3.0), (16.0, 0.5), (1000.0, 3.0)):
        floored = measurement_window(scenario, rate, latency_s)
        probe = measurement_window(scenario, rate, latency_s, own_floor=False)
        assert probe.warmup_s == floored.warmup_s == max(30.0, 5 * latency_s)
        assert probe.measure_s == pytest.approx(max(500 / rate, MEASURED_LATENCIES * latency_s))
        assert probe.measure_s <= floored.measure_s
    assert measurement_window(scenario, 16.0, 3.0, own_floor=False).requests(16.0) < scenario.workload.num_requests


def test_attainment_standard_error_of_independent_requests_is_binomial():
    """With independent hits the batch-means standard error estimates sqrt(p (1 - p) / n)."""
    rng = np.random.default_rng(5)
    p, n = 0.9, 20_000
    errors = [share_with_stderr(pd.Series(rng.random(n) < p))[1] for _ in range(40)]
    # The batch-means estimate from 20 batches has a relative spread of about 1/sqrt(2 x 19) = 16%;
    # the mean of 40 of them is within 3 x 16% / sqrt(40) = 8% of the truth.
    assert np.mean(errors) == pytest.approx(math.sqrt(p * (1 - p) / n), rel=0.08)


def test_a_rising_trend_is_found_and_a_stationary_series_passes():
    rng = np.random.default_rng(7)
    flat = rng.exponential(0.1, 20_000)
    ramp = flat + np.linspace(0.0, 0.2, flat.size)          # waits climbing by 0.2 s over the window
    assert not rising_trend(flat, scale=0.5)[1]
    rise, rising = rising_trend(ramp, scale=0.5)
    assert rising and rise == pytest.approx(0.2 / 0.5, rel=0.15)
    assert not rising_trend(ramp, scale=5.0)[1]             # 4% of a 5 s limit: not material


def _rows(attainment, stderr, steady=True, seeds=1, percentile=95.0):
    return pd.DataFrame({"error": [""] * seeds, names.STEADY: [steady] * seeds,
                         names.slo_attainment("ttft"): [attainment] * seeds,
                         names.slo_attainment_stderr("ttft"): [stderr] * seeds,
                         names.slo_percentile("ttft"): [percentile] * seeds,
                         names.SLO_ATTAINMENT: [attainment] * seeds, names.SLO_ATTAINMENT_STDERR: [stderr] * seeds})


@pytest.mark.parametrize("attainment, stderr, steady, met, decided", [
    (0.97, 0.005, True, True, True),        # 2 standard errors above the target
    (0.955, 0.005, True, True, False),      # within 2: simulate more
    (0.945, 0.005, True, False, False),
    (0.93, 0.005, True, False, True),       # 2 standard errors below
    (0.99, 0.001, False, False, False),     # passing, but waits still climbing: simulate more
    (0.97, math.nan, True, True, False),    # too few requests to know the error
])
def test_verdicts_carry_their_uncertainty(attainment, stderr, steady, met, decided):
    verdict = judge(_rows(attainment, stderr, steady))
    assert (verdict.met, verdict.decided) == (met, decided)
    assert judge(_rows(attainment, stderr, steady), target=0.95).met == met


def test_seeds_pool_their_standard_errors():
    """Four seeds at the same attainment halve the standard error: 0.955 +- 2 x 0.005 / 2 passes."""
    assert not judge(_rows(0.955, 0.005, seeds=1)).decided
    assert judge(_rows(0.955, 0.005, seeds=4)).decided


def test_an_undecided_point_is_simulated_again_longer(monkeypatch):
    """The first window leaves the verdict open: the point runs again with twice the measurement (a verdict
    pooled over seeds; one seed's run continues instead, tests/search/test_checkpoints.py)."""
    scenario = llmsim.load_scenario(CHAT)
    seen = []
    calls = iter([_rows(0.955, 0.005, seeds=2), _rows(0.955, 0.002, seeds=2)])

    def fake_run_points(scenario, jobs, **kwargs):
        seen.append([job["workload.num_requests"] for job in jobs])
        return next(calls)
    monkeypatch.setattr(windows, "run_points", fake_run_points)
    first = Window(30.0, 100.0)
    judged, = windows.simulate_until_decided(scenario, [{}], [first], [10.0], seeds=[1, 2])
    assert seen == [[1300], [2300]] and judged.verdict.decided and judged.window == first.longer()


def test_an_undecided_fail_is_taken_as_failed_when_asked(monkeypatch):
    """escalate_failing=False: of two undecided points only the one whose estimate passes runs longer."""
    scenario = llmsim.load_scenario(CHAT)
    seen = []
    calls = iter([pd.concat([_rows(0.955, 0.005, seeds=2), _rows(0.945, 0.005, seeds=2)], ignore_index=True),
                  _rows(0.955, 0.002, seeds=2)])

    def fake_run_points(scenario, jobs, **kwargs):
        seen.append([job["workload.num_requests"] for job in jobs])
        return next(calls)
    monkeypatch.setattr(windows, "run_points", fake_run_points)
    first = Window(30.0, 100.0)
    passing, failing = windows.simulate_until_decided(scenario, [{"a": 1}, {"a": 2}], [first, first], [10.0, 10.0],
                                                      seeds=[1, 2], escalate_failing=False)
    assert seen == [[1300, 1300], [2300]]
    assert passing.verdict.met and passing.verdict.decided and passing.window == first.longer()
    assert not failing.verdict.met and not failing.verdict.decided and failing.window == first


def test_a_plan_below_the_analytic_bound_says_so(monkeypatch):
    """The cross-check: a simulated answer below the fluid model's capacity bound (less its stated
    error) is reported in the note, not silently returned."""
    scenario = llmsim.load_scenario(CHAT)
    monkeypatch.setattr(planning, "capacity_bound", lambda one, rate, capacity=None: 3.0)
    row = llmsim.plan(scenario, 16.0, workers=1, keep_layout=True).iloc[0]
    assert row["replicas"] == 1 and "disagrees with the analytic capacity bound" in row["note"]


@pytest.mark.slow
def test_a_plan_at_a_high_rate_does_not_depend_on_the_scenarios_request_count():
    """At 250 req/s the chat scenario's 4,000 requests arrive in 16 s, inside its 30 s warm-up: a window
    counted in the scenario's requests would measure nothing (as at 1,000 req/s, where plans once came out
    44% short). The 4,000 requests and 10x as many give the same plan, never below the analytic capacity
    bound less its stated error. The windows follow the rate (the fluid model reads the length laws, not
    the requests drawn from them), so the two searches simulate the same runs: the second finds each of
    them already made (reusing_runs) and must reach the same count."""
    scenario = llmsim.load_scenario(CHAT)
    rows = []
    with sweeps.reusing_runs():
        for requests in (4_000, 40_000):
            at_count = variant(scenario, {"workload.num_requests": requests})
            row = llmsim.plan(at_count, 250.0, workers=2, keep_layout=True).iloc[0]
            assert row["replicas"] >= row["analytic_capacity_bound"] / (1 + planning.FLUID_CAPACITY_ERROR)
            assert row["note"] == ""
            rows.append(row)
    same = ["replicas", "analytic_lower", "analytic_upper", "analytic_capacity_bound", "requests_per_simulation",
            "warmup_s", "window_s", "simulations", "slo_margin"]
    assert rows[0][same].to_dict() == rows[1][same].to_dict()


@pytest.mark.slow
def test_the_planned_count_holds_on_fresh_seeds_and_a_longer_window_and_one_fewer_does_not():
    scenario = llmsim.load_scenario(CHAT)
    rate = 100.0
    row = llmsim.plan(scenario, rate, workers=2, keep_layout=True).iloc[0]
    replicas = int(row["replicas"])
    longer = Window(row["warmup_s"], 4 * (row["window_s"] - row["warmup_s"]))

    def met(count: int) -> bool:
        rows = run_points(scenario, [{"workload.arrival.rate": rate, "deployment.replicas": count,
                                      **longer.overrides(rate)}], seeds=[1001, 1002], workers=2)
        return judge(rows).met
    assert met(replicas)
    assert not met(replicas - 1)


def test_a_sweep_over_the_rate_keeps_the_arrival_window_in_seconds():
    """4,000 requests at 16/s arrive over 250 s; at 64/s the sweep simulates 16,000 so the 30 s warm-up
    is still an eighth of the window, and a point that sets its own count keeps it."""
    scenario = llmsim.load_scenario(CHAT)
    _, build, _, _ = sweeps._base(scenario)
    points = sweeps._windows_follow_rate(build, [
        {"workload.arrival.rate": 64}, {"workload.arrival.rate": "4/s"},
        {"workload.arrival.rate": 64, "workload.num_requests": 10}, {"engine.max_batch_tokens": 4096}])
    assert [p.get("workload.num_requests") for p in points] == [16_000, 1_000, 10, None]


def test_a_tolerance_finer_than_the_floats_ends(monkeypatch):
    """Bisection on [lo, hi] stops when the midpoint is no longer between them, whatever tol asks."""
    from llmsim.search import sustainable_rate as module
    calls = []

    def fake(scenario, points, windows_, rates, **kwargs):
        calls.append(rates[0])
        met = rates[0] <= 5.0
        return [windows.Judged(windows.Verdict(met, True, True), pd.DataFrame([{"rate": rates[0]}]), windows_[0])]
    monkeypatch.setattr(module, "simulate_until_decided", fake)
    found = module.max_sustainable_rate(CHAT, lo=1.0, hi=10.0, tol=1e-300)
    assert found.rate_per_s <= 5.0 < found.failing_rate_per_s and len(calls) <= 2 + module.MAX_BISECTIONS


def test_no_cross_check_where_the_fluid_model_cannot_bound(monkeypatch):
    """Prefix caching saves prefill work the fluid model never sees: its capacity bound could exceed the
    true need, so plan does not use it (no refusal, no disagreement) and says so."""
    scenario = variant(llmsim.load_scenario(CHAT), {"engine.prefix_caching": True})
    assert planning.fluid_blind_spots(scenario) == ["prefix caching"]
    row = llmsim.plan(scenario, 16.0, workers=1, max_replicas=1, keep_layout=True).iloc[0]
    assert math.isnan(row["analytic_capacity_bound"]) and row["replicas"] == 1
    assert "no analytic cross-check: the fluid model does not model prefix caching" in row["note"]
