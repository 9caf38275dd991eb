"""Runs a search reuses instead of simulating: each reused row must equal the row an independent
simulation of that point gives (the simulator is deterministic in its scenario and seed)."""
from __future__ import annotations

import math

import pandas as pd

import llmsim.search.sweeps as sweeps
from llmsim.search.sweeps import reusing_runs, run_points
from tests.helpers import make_scenario

def _counting(monkeypatch) -> list:
    """Every simulation the sweep runs in this process (workers=1), counted."""
    ran = []
    real = sweeps.simulate_whole

    def counted(scenario, *args, **kwargs):
        ran.append(scenario.engine.queue_timeout_s)
        return real(scenario, *args, **kwargs)
    monkeypatch.setattr(sweeps, "simulate_whole", counted)
    return ran


def _scenario(rate: float):
    return make_scenario({"workload": {"arrival": {"rate": rate}, "num_requests": 400},
                          "slo": {"ttft": "500 ms", "tpot": "50 ms"}})


def test_runs_differing_in_a_timeout_never_reached_are_simulated_once(monkeypatch):
    # At a light load requests wait only for the iteration in progress (tens of ms): the timeouts above the
    # longest wait of the run without one are that run; those at or below it are simulated.
    timeouts_s = [0.05, 0.2, 1.0, 2.0]
    points = [{"engine.queue_timeout": None}] + [{"engine.queue_timeout": f"{t * 1000:g} ms"} for t in timeouts_s]
    scenario = _scenario(5.0)
    from llmsim.sim.simulate import simulate_whole
    longest = sweeps.longest_wait_s(simulate_whole(scenario))
    assert 0.05 < longest < 0.2                # both cases are exercised
    alone = run_points(scenario, points, workers=1)
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None] + [t for t in timeouts_s if t <= longest]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_timeout_that_acts_is_simulated(monkeypatch):
    # Overloaded (each request brings ~0.1 s of work at 60/s): waits pass 1 ms, so the 1 ms timeout acts and
    # its run differs (requests rejected or dispatched early); each run's row is that of its own simulation.
    points = [{"engine.queue_timeout": None}, {"engine.queue_timeout": "1 ms", "engine.on_timeout": "reject"}]
    scenario = _scenario(400.0)
    alone = run_points(scenario, points, workers=1)
    assert alone["requests.rejected_timeout"].iloc[1] > 0          # the timeout did act
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None, 0.001]
    pd.testing.assert_frame_equal(shared, alone)


def test_longest_wait_bounds_every_wait():
    from llmsim.sim.simulate import simulate_whole
    result = simulate_whole(_scenario(400.0))
    requests = result.requests
    waits = (requests["first_scheduled_s"] - requests["arrival_s"]).dropna()
    longest = sweeps.longest_wait_s(result)
    assert math.isfinite(longest) and longest >= waits.max() > 0
