"""Scheduling behaviour: continuous vs static batching, queue timeouts, routers, chunked prefill."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from llmsim import generate_trace
from llmsim.analysis.metrics import summarize

from tests.helpers import make_scenario, simulate_checked

LOAD = {"workload": {"arrival": {"rate": 12.0}, "num_requests": 1500}}


def test_continuous_batching_beats_static_on_the_same_trace():
    """The Orca / vLLM result: iteration-level scheduling serves more at equal load."""
    continuous = make_scenario(LOAD)
    static = make_scenario({**LOAD, "engine": {"batching": "static", "max_num_seqs": 64}})
    trace = generate_trace(continuous.workload, continuous.seed)
    a, b = simulate_checked(continuous, trace), simulate_checked(static, trace)
    assert a.requests[["arrival_s", "prompt_tokens", "output_tokens"]].equals(
        b.requests[["arrival_s", "prompt_tokens", "output_tokens"]])
    fast, slow = summarize(a).to_dict(), summarize(b).to_dict()
    assert fast["throughput"]["output_tokens_per_s"] > 1.5 * slow["throughput"]["output_tokens_per_s"]
    assert fast["latency"]["e2e_s"]["p50"] < slow["latency"]["e2e_s"]["p50"]


def test_static_batch_waits_for_its_longest_member():
    scenario = make_scenario({"engine": {"batching": "static", "max_num_seqs": 8},
                              "workload": {"arrival": {"process": "deterministic", "rate": 1000.0},
                                           "num_requests": 8,
                                           "output_tokens": {"distribution": "uniform", "low": 10, "high": 200}}})
    result = simulate_checked(scenario)
    records = result.requests
    # The engine starts on the first request alone; the other seven arrive meanwhile and form
    # the next batch: admitted together, first tokens together, steps padded to the longest output.
    second = records.iloc[1:]
    assert second["first_scheduled_s"].nunique() == 1 and second["first_token_s"].nunique() == 1
    assert second["first_scheduled_s"].iloc[0] == pytest.approx(records["finish_s"].iloc[0])
    assert len(result.iterations) == records["output_tokens"].iloc[0] + second["output_tokens"].max()
    assert (result.iterations["decode_seqs"].iloc[records["output_tokens"].iloc[0] + 1:] == 7).all()
    assert second["finish_s"].max() == pytest.approx(result.iterations["end_s"].max())


def test_queue_timeout_reject_drops_requests_that_waited_too_long():
    result = simulate_checked(make_scenario({"engine": {"queue_timeout": "500 ms", "on_timeout": "reject"},
                                     "workload": {"arrival": {"rate": 80.0}}}))
    records = result.requests
    rejected = records[records["reason"] == "timeout"]
    assert len(rejected) > 0
    assert np.allclose(rejected["finish_s"] - rejected["arrival_s"], 0.5)
    served = records[records["first_scheduled_s"].notna()]
    # Nobody admitted waited past the timeout by more than one iteration.
    assert served["queue_wait_s"].max() <= 0.5 + result.iterations["duration_s"].max()


def test_queue_timeout_dispatch_goes_past_the_token_budget():
    engine = {"max_batch_tokens": 512, "max_num_seqs": 256}
    workload = {"arrival": {"rate": 16.0}, "num_requests": 600,
                "prompt_tokens": {"distribution": "uniform", "low": 1500, "high": 2500}}
    plain = simulate_checked(make_scenario({"engine": engine, "workload": workload}))
    forced = simulate_checked(make_scenario({"engine": {**engine, "queue_timeout": "300 ms"}, "workload": workload}))
    it = forced.iterations
    over_budget = (it["prefill_tokens"] + it["decode_seqs"]) > 512
    plain_tokens = plain.iterations["prefill_tokens"] + plain.iterations["decode_seqs"]
    assert over_budget.any() and not (plain_tokens > 512).any()
    assert forced.requests["queue_wait_s"].max() <= 0.3 + it["duration_s"].max()
    assert plain.requests["queue_wait_s"].max() > 1.0


def test_round_robin_cycles_and_least_outstanding_balances():
    rr = simulate_checked(make_scenario({"deployment": {"replicas": 4, "router": "round_robin"},
                                 "workload": {"arrival": {"rate": 40.0}}}))
    assert (rr.requests["replica"] == rr.requests["id"] % 4).all()
    lor = simulate_checked(make_scenario({"deployment": {"replicas": 4}, "workload": {"arrival": {"rate": 40.0}}}))
    # Rebuild, from the records alone, how many requests each replica had outstanding when each
    # request arrived: the router must have picked a least-loaded one (ties to the lowest index).
    records = lor.requests
    arrival, finish, replica = (records[c].to_numpy() for c in ("arrival_s", "finish_s", "replica"))
    earlier = np.tri(len(records), k=-1, dtype=bool)                 # j arrived before i
    outstanding_then = earlier & (finish[None, :] > arrival[:, None])   # and had not left yet
    load = np.stack([(outstanding_then & (replica[None, :] == r)).sum(axis=1) for r in range(4)], axis=1)
    assert (replica == load.argmin(axis=1)).all()
    assert len(set(replica)) == 4


def test_least_outstanding_pick_matches_a_scan_of_every_replica():
    """The router keeps replicas grouped by outstanding count to pick in constant time; its pick must
    be what the definition says, the lowest index among the least loaded, found here by scanning a
    count kept apart, over random arrivals and departures at 64 replicas (counts drift upwards, so
    the groups grow past their first length, and ties are frequent)."""
    import simpy
    from llmsim.sim.request import RequestRecords
    from llmsim.config.policies import RouterPolicy
    from llmsim.sim.simulate import Router
    empty = np.zeros(0)
    router = Router(RouterPolicy.LEAST_OUTSTANDING, [[] for _ in range(64)], 1, 1, 1,
                    RequestRecords(empty, empty, empty), simpy.Environment().event())
    held = [0] * 64
    rng = np.random.default_rng(7)
    for _ in range(20_000):
        if rng.random() < 0.55 or not any(held):
            index = router._pick(None)
            assert index == held.index(min(held))
            router._count(index, +1)
            held[index] += 1
        else:
            index = int(rng.choice(np.flatnonzero(held)))
            router._count(index, -1)
            held[index] -= 1
        assert router.outstanding == held
    assert max(held) > 20                       # the groups grew well past their first length


def test_more_replicas_cut_queueing_under_the_same_load():
    def ttft_p95_s(replicas: int) -> float:
        scenario = make_scenario({"deployment": {"replicas": replicas}, "workload": {"arrival": {"rate": 45.0}}})
        return summarize(simulate_checked(scenario)).to_dict()["latency"]["ttft_s"]["p95"]
    waits = [ttft_p95_s(n) for n in (2, 4)]
    assert waits[1] < waits[0]


def test_chunked_prefill_smooths_inter_token_gaps():
    """Sarathi-Serve's point: without chunking, a long prompt stalls every decoding sequence."""
    workload = {"arrival": {"rate": 10.0}, "num_requests": 800,
                "prompt_tokens": {"distribution": "uniform", "low": 2000, "high": 6000}}
    chunked = summarize(simulate_checked(make_scenario({"engine": {"max_batch_tokens": 512},
                                                        "workload": workload}))).to_dict()
    whole = summarize(simulate_checked(make_scenario({"engine": {"chunked_prefill": False, "max_batch_tokens": 8192},
                                    "workload": workload}))).to_dict()
    assert chunked["latency"]["max_itl_s"]["p50"] < whole["latency"]["max_itl_s"]["p50"]
    assert chunked["latency"]["ttft_s"]["p50"] > whole["latency"]["ttft_s"]["p50"]


def test_requests_longer_than_max_model_len_are_rejected_not_run():
    result = simulate_checked(make_scenario({"engine": {"max_model_len": 1024},
                                     "workload": {"prompt_tokens": {"distribution": "uniform",
                                                                    "low": 500, "high": 1200}}}))
    records = result.requests
    too_long = records["prompt_tokens"] + records["output_tokens"] > 1024
    assert (records.loc[too_long, "reason"] == "too_long").all()
    assert (records.loc[~too_long, "status"] == "finished").all()


def test_same_scenario_and_seed_give_identical_records():
    scenario = make_scenario({"deployment": {"replicas": 2}, "engine": {"memory_utilization": 0.3},
                              "workload": {"arrival": {"process": "gamma", "rate": 25.0, "cv": 2.0}}})
    first, second = simulate_checked(scenario), simulate_checked(scenario)
    pd.testing.assert_frame_equal(first.requests, second.requests)
    pd.testing.assert_frame_equal(first.iterations, second.iterations)
    other = simulate_checked(scenario.with_seed(scenario.seed + 1))
    assert not other.requests["arrival_s"].equals(first.requests["arrival_s"])


def test_configurations_see_common_random_numbers():
    a = simulate_checked(make_scenario({"engine": {"max_batch_tokens": 2048}}))
    b = simulate_checked(make_scenario({"engine": {"max_batch_tokens": 8192}}))
    columns = ["arrival_s", "prompt_tokens", "output_tokens"]
    pd.testing.assert_frame_equal(a.requests[columns], b.requests[columns])


def test_interrupted_run_keeps_what_it_finished(monkeypatch):
    from llmsim.sim.simulate import Router

    scenario = make_scenario({"workload": {"num_requests": 2000}})
    calls = {"n": 0}
    original = Router.dispatch            # an arrival entering the router, inside the simulation's event loop

    def dispatch(self, request, now):
        calls["n"] += 1
        if calls["n"] == 1000:                # Ctrl-C at the 1,000th of the 2,000 arrivals: mid-run
            raise KeyboardInterrupt
        return original(self, request, now)

    monkeypatch.setattr(Router, "dispatch", dispatch)
    result = simulate_checked(scenario)
    assert result.interrupted
    statuses = set(result.requests["status"])
    assert "finished" in statuses and "unfinished" in statuses
    assert summarize(result).to_dict()["interrupted"]
