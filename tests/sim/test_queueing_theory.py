"""The simulator against closed-form queueing results.

With one sequence at a time (``max_num_seqs: 1``) a replica is a single FIFO
server whose service time is one request's prefill plus its decode steps, so
textbook formulas must hold: Pollaczek-Khinchine for M/D/1 and M/G/1, Erlang C
for c servers sharing one queue, and Little's law on every run. Tolerances are
four standard errors of the simulated mean, estimated by batch means (queue
waits are autocorrelated, so the naive i.i.d. standard error would be too small).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from llmsim import batch_means, simulate

from tests.helpers import make_scenario

SERIAL = {"engine": {"max_num_seqs": 1, "max_batch_tokens": 8192}}


def service_times(result):
    """Time from a request's admission to its last token (it has the server to itself)."""
    records = result.requests
    return (records["finish_s"] - records["first_scheduled_s"]).to_numpy()


def test_md1_mean_wait_matches_pollaczek_khinchine():
    fixed = {"workload": {"num_requests": 20000, "prompt_tokens": 32, "output_tokens": 4}}
    probe = simulate(make_scenario({**SERIAL, "workload": {**fixed["workload"], "num_requests": 1}}))
    service_s = float(service_times(probe)[0])
    rho = 0.7
    scenario = make_scenario({**SERIAL, "workload": {**fixed["workload"], "arrival": {"rate": rho / service_s}}})
    result = simulate(scenario)
    # Deterministic service: every request takes exactly the same time.
    assert np.ptp(service_times(result)) < 1e-9 * service_s
    expected = rho * service_s / (2 * (1 - rho))
    mean, se = batch_means(result.requests["queue_wait_s"])
    assert abs(mean - expected) < 4 * se, (mean, expected, se)


@pytest.mark.slow
def test_mg1_mean_wait_matches_pollaczek_khinchine_with_exponential_lengths():
    # Geometric output lengths (the discrete exponential) make service nearly exponential: M/M/1-like.
    workload = {"num_requests": 12000, "prompt_tokens": 8,
                "output_tokens": {"distribution": "exponential", "mean": 10, "max": 10000}}
    result = simulate(make_scenario({**SERIAL, "workload": workload}))
    service = service_times(result)
    rate = 0.75 / service.mean()
    result = simulate(make_scenario({**SERIAL, "workload": {**workload, "arrival": {"rate": rate}}}))
    service = service_times(result)
    rho = rate * service.mean()
    expected = rate * np.mean(service ** 2) / (2 * (1 - rho))
    cv2 = service.var() / service.mean() ** 2
    assert 0.75 < cv2 < 1.0          # the M/M/1 regime: service about as variable as exponential
    mean, se = batch_means(result.requests["queue_wait_s"])
    assert abs(mean - expected) < 4 * se, (mean, expected, se)
    # And the plain M/M/1 formula, corrected for the measured variability (exact for c = 1).
    mm1 = rho / (1 / service.mean() - rate)
    assert abs(mean - mm1 * (1 + cv2) / 2) < 4 * se


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in M/M/c (offered_load = lambda / mu)."""
    rho = offered_load / servers
    terms = sum(offered_load ** k / math.factorial(k) for k in range(servers))
    top = offered_load ** servers / math.factorial(servers) / (1 - rho)
    return top / (terms + top)


@pytest.mark.slow
def test_shared_queue_replicas_match_erlang_c():
    servers = 3
    workload = {"num_requests": 15000, "prompt_tokens": 4,
                "output_tokens": {"distribution": "exponential", "mean": 20, "max": 10000}}
    deployment = {"replicas": servers, "router": "shared_queue"}
    probe = simulate(make_scenario({**SERIAL, "deployment": deployment, "workload": workload}))
    mean_service = service_times(probe).mean()
    rho = 0.8
    rate = rho * servers / mean_service
    result = simulate(make_scenario({**SERIAL, "deployment": deployment,
                                     "workload": {**workload, "arrival": {"rate": rate}}}))
    service = service_times(result)
    mu = 1 / service.mean()
    offered = rate / mu
    cv2 = service.var() / service.mean() ** 2
    # Erlang C for exponential service; the Allen-Cunneen factor (1 + cv^2) / 2 accounts for the
    # measured service variability (here within a few percent of 1, so the factor is ~0.98).
    expected = erlang_c(servers, offered) / (servers * mu - rate) * (1 + cv2) / 2
    mean, se = batch_means(result.requests["queue_wait_s"])
    assert abs(mean - expected) < 4 * se, (mean, expected, se)
    # Each server is busy rho of the time.
    assert set(result.requests["replica"]) == set(range(servers))


@pytest.mark.parametrize("overrides", [
    {},
    {"workload": {"arrival": {"process": "gamma", "rate": 20.0, "cv": 3.0}}},
    {"deployment": {"replicas": 3, "router": "round_robin"}, "workload": {"arrival": {"rate": 40.0}}},
    {"engine": {"chunked_prefill": False}},
    {"engine": {"batching": "static", "max_num_seqs": 32}, "workload": {"arrival": {"rate": 2.0}}},
    {"engine": {"memory_utilization": 0.245, "max_model_len": 8192},           # preempts
     "workload": {"arrival": {"rate": 30.0}}},
])
def test_littles_law_holds(overrides):
    """Time-average number in system = arrival rate x mean time in system, on runs that drain."""
    result = simulate(make_scenario(overrides))
    records = result.requests
    assert (records["status"] == "finished").all()
    arrival_rate = len(records) / result.end_s
    mean_time_in_system = (records["finish_s"] - records["arrival_s"]).mean()
    assert result.mean_in_system == pytest.approx(arrival_rate * mean_time_in_system, rel=1e-9)
    # The same for the queue alone, counting every wait (including after a preemption)
    # from the queue's own length log.
    if result.preemptions == 0:
        mean_wait = records["queue_wait_s"].mean()
        assert result.mean_queue_length == pytest.approx(arrival_rate * mean_wait, rel=1e-9, abs=1e-12)


def test_littles_law_on_a_run_cut_at_the_horizon():
    """Overload: the horizon stops the run; time in system counts up to the horizon."""
    result = simulate(make_scenario({"workload": {"arrival": {"rate": 200.0}, "num_requests": 3000},
                                     "simulation": {"horizon": "20 s"}}))
    records = result.requests
    assert (records["status"] == "unfinished").any()
    horizon = result.end_s
    arrived = records[records["arrival_s"] <= horizon]
    leave = arrived["finish_s"].fillna(horizon).clip(upper=horizon)
    area = (leave - arrived["arrival_s"]).sum()
    assert result.mean_in_system == pytest.approx(area / horizon, rel=1e-9)
