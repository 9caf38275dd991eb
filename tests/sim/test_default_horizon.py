"""The default horizon follows the work, not the arrival window alone: an offline run (every request at
t=0) is simulated to its end, where the old rule (twice the window, at least 60 s past it) stopped it
at 60 s with most requests unfinished."""
from __future__ import annotations

from llmsim.sim.horizon import MIN_TAIL_S, default_horizon_s, drain_time_s
from llmsim.sim.result import StopReason
from llmsim.sim.simulate import simulate
from tests.helpers import make_scenario

# 24 requests of 1,024 output tokens, 4 at a time on an L40S: six rounds of 1,024 decode steps, each
# step well over 10 ms, so the work alone takes longer than 60 s (checked below from the run itself).
OFFLINE = {"hardware": "L40S", "engine": {"max_num_seqs": 4},
           "workload": {"num_requests": 24, "arrival": {"rate": 1e9}, "prompt_tokens": 256, "output_tokens": 1024}}


def test_an_offline_run_with_the_default_horizon_finishes_every_request():
    scenario = make_scenario(OFFLINE)
    assert scenario.simulation.horizon_s is None
    result = simulate(scenario)
    assert result.stopped_by == StopReason.COMPLETED
    assert (result.requests["status"] == "finished").sum() == 24
    # the work itself outlasts the old default horizon: every decode step the run took, end to end
    assert result.iterations["duration_s"].sum() > MIN_TAIL_S
    assert result.end_s > MIN_TAIL_S


def test_a_carried_load_keeps_the_old_default():
    scenario = make_scenario({"workload": {"num_requests": 200, "arrival": {"rate": 5}}})
    assert drain_time_s(scenario, 200, 512, 128) < 20.0        # far less than its 40 s of arrivals
    assert default_horizon_s(scenario, 40.0, 200, 512, 128) == 100.0          # window + 60 s
    assert default_horizon_s(scenario, 400.0, 2000, 512, 128) == 800.0        # twice the window


def test_a_set_horizon_is_kept():
    scenario = make_scenario({**OFFLINE, "simulation": {"horizon": "30 s"}})
    result = simulate(scenario)
    assert result.stopped_by == StopReason.HORIZON and result.end_s == 30.0


def test_a_request_count_that_ends_the_arrivals_before_the_duration_sets_the_window():
    """``run --requests N`` on a long scenario: N requests at 10/s arrive over about N / 10 s, and the
    figures are over that span (offered rate about 10/s), not the scenario's hour (offered 300 / 3,600 s)."""
    from llmsim.analysis.metrics import summarize
    from llmsim.sim.simulate import horizon_for
    from llmsim.workload.generate import generate_trace

    capped = make_scenario({"workload": {"num_requests": 300, "duration": "1 h", "arrival": {"rate": 10}}})
    trace = generate_trace(capped.workload, capped.seed)
    assert len(trace) == 300
    window, _ = horizon_for(capped, trace)
    assert window == float(trace.arrival_s[-1]) < 60.0
    offered = summarize(simulate(capped)).to_dict()["throughput"]["offered_requests_per_s"]
    # 270 arrivals in the window after a 10% warm-up: Poisson, so within 3 standard errors of 10/s
    assert abs(offered - 10.0) < 3 * 10.0 / 270 ** 0.5
    # a duration that ends the arrivals first still sets the window
    timed = make_scenario({"workload": {"num_requests": None, "duration": "20 s", "arrival": {"rate": 10}}})
    assert timed.workload.num_requests is None
    assert horizon_for(timed, generate_trace(timed.workload, timed.seed))[0] == 20.0
