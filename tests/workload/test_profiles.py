"""Time-varying arrivals: counts against the integral of the rate profile (Poisson counts: the
variance equals the mean, so tolerances are four square roots of the expected count)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from llmsim.errors import ConfigError
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, make_scenario


def scenario_with(arrival, **workload):
    base = copy.deepcopy(BASE)
    base["workload"]["arrival"] = arrival
    base["workload"].pop("num_requests")
    base["workload"].update(workload)
    return make_scenario(base=base)


def _counts_match(times, edges, expected):
    counts = np.histogram(times, bins=edges)[0]
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected) + 1), (counts, expected)


def test_steps_hold_each_rate_until_the_next():
    scenario = scenario_with({"process": "steps", "rates": [{"at": 0, "rate": "5/s"}, {"at": "100 s", "rate": "40/s"},
                                                            {"at": "150 s", "rate": "10/s"}]}, duration="300 s")
    times = generate_trace(scenario.workload, scenario.seed).arrival_s
    _counts_match(times, [0, 100, 150, 300], np.array([500, 2000, 1500]))


def test_ramp_interpolates_linearly():
    scenario = scenario_with({"process": "ramp", "rates": [{"at": 0, "rate": 0}, {"at": "200 s", "rate": "40/s"}]},
                             duration="200 s")
    times = generate_trace(scenario.workload, scenario.seed).arrival_s
    edges = np.linspace(0, 200, 5)
    # The integral of 0.2 t over each quarter.
    _counts_match(times, edges, 0.1 * (edges[1:] ** 2 - edges[:-1] ** 2))


def test_diurnal_follows_the_cosine():
    period, mean, amplitude = 100.0, 20.0, 0.8
    scenario = scenario_with({"process": "diurnal", "rate": mean, "amplitude": amplitude, "period": period,
                              "peak": "25 s"}, duration="1000 s")
    times = generate_trace(scenario.workload, scenario.seed).arrival_s
    phase = times % period
    edges = np.linspace(0, period, 9)
    integral = lambda t: mean * (t + amplitude * period / (2 * np.pi) * np.sin(2 * np.pi * (t - 25) / period))  # noqa
    _counts_match(phase, edges, 10 * (integral(edges[1:]) - integral(edges[:-1])))
    assert scenario.workload.arrival.rate_per_s == mean


def test_mmpp_long_run_rate_and_burstiness():
    states = [{"rate": "5/s", "mean_duration": "20 s"}, {"rate": "50/s", "mean_duration": "5 s"}]
    scenario = scenario_with({"process": "mmpp", "states": states}, duration="20000 s")
    times = generate_trace(scenario.workload, scenario.seed).arrival_s
    stationary = (5 * 20 + 50 * 5) / 25
    assert scenario.workload.arrival.rate_per_s == stationary
    # Counts per 250 s window (10 mean cycles apart: nearly independent), their mean against the rate.
    counts = np.histogram(times, bins=np.arange(0, 20001, 250))[0]
    assert abs(counts.mean() - 250 * stationary) < 4 * counts.std(ddof=1) / np.sqrt(len(counts))
    # Bursty: counts over 5 s vary far more than Poisson's (index of dispersion well above 1).
    short = np.histogram(times, bins=np.arange(0, 20001, 5))[0]
    assert short.var() / short.mean() > 5


def test_num_requests_prefix_and_per_class_profiles():
    steps = {"process": "steps", "rates": [{"at": 0, "rate": "2/s"}, {"at": "50 s", "rate": "20/s"}]}
    few = scenario_with(steps, num_requests=100)
    many = scenario_with(steps, num_requests=1000)
    # The first requests do not depend on how many are drawn.
    assert np.array_equal(generate_trace(few.workload, 1).arrival_s, generate_trace(many.workload, 1).arrival_s[:100])
    base = copy.deepcopy(BASE)
    base["workload"].pop("arrival")
    base["workload"].pop("num_requests")
    base["workload"].update(duration="100 s", classes={
        "interactive": {"arrival": {"process": "diurnal", "rate": "10/s", "period": "100 s"}},
        "batch": {"arrival": steps}})
    scenario = make_scenario(base=base)
    trace = generate_trace(scenario.workload, scenario.seed)
    assert np.all(np.diff(trace.arrival_s) >= 0)
    batch = trace.arrival_s[trace.class_index == 1]
    _counts_match(batch, [0, 50, 100], np.array([100, 1000]))
    _counts_match(trace.arrival_s[trace.class_index == 0], [0, 100], np.array([1000]))


@pytest.mark.parametrize("arrival, key", [
    ({"process": "steps", "rates": [{"at": 0, "rate": "-5/s"}]}, "workload.arrival.rates[0].rate"),
    ({"process": "steps", "rates": [{"at": "10 s", "rate": 5}, {"at": "5 s", "rate": 5}]}, "workload.arrival.rates"),
    ({"process": "ramp", "rates": [{"at": 0, "rate": 5}, {"at": "10 s", "rate": 0}]}, "workload.arrival.rates"),
    ({"process": "diurnal", "rate": 5, "period": "1 h", "amplitude": 1.5}, "workload.arrival.amplitude"),
    ({"process": "mmpp", "states": [{"rate": 5, "mean_duration": "1 s"}]}, "workload.arrival.states"),
    ({"process": "mmpp", "states": [{"rate": 5}, {"rate": 1, "mean_duration": "1 s"}]},
     "workload.arrival.states[0].mean_duration"),
])
def test_bad_profiles_name_the_key(arrival, key):
    with pytest.raises(ConfigError) as error:
        scenario_with(arrival, duration="100 s")
    assert error.value.key == key, str(error.value)
    assert error.value.allowed or error.value.message.startswith("required key is missing")
