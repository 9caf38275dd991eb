"""Nothing is lost: requests, tokens and KV blocks all balance, on every kind of run."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim import load_scenario
from llmsim.analysis.metrics import summarize
from llmsim.config.limits import MAX_RUN_EVENTS
from llmsim.scenario.variants import variant
from llmsim.search.rollout import simulate_rollout
from llmsim.sim.resources import estimate_run

from tests.helpers import SCENARIOS, make_scenario, simulate_checked

RUNS = {
    "chat": {},
    "preempting": {"engine": {"memory_utilization": 0.25, "max_model_len": 8192},
                   "workload": {"arrival": {"rate": 30.0}}},
    "no-chunked-prefill": {"engine": {"chunked_prefill": False}, "workload": {"arrival": {"rate": 20.0}}},
    "static": {"engine": {"batching": "static", "max_num_seqs": 16}, "workload": {"arrival": {"rate": 2.0}}},
    "timeout-reject": {"engine": {"queue_timeout": "1 s", "on_timeout": "reject"},
                       "workload": {"arrival": {"rate": 60.0}}},
    "timeout-dispatch": {"engine": {"queue_timeout": "200 ms", "max_batch_tokens": 512},
                         "workload": {"arrival": {"rate": 30.0}}},
    "overloaded-horizon": {"workload": {"arrival": {"rate": 300.0}, "num_requests": 3000},
                           "simulation": {"horizon": "15 s"}},
    "static-horizon": {"engine": {"batching": "static", "max_num_seqs": 16},
                       "workload": {"arrival": {"rate": 50.0}}, "simulation": {"horizon": "30 s"}},
    "replicas-least-outstanding": {"deployment": {"replicas": 3}, "workload": {"arrival": {"rate": 40.0}}},
    "sliding-window": {"model": "Mistral-7B-v0.1", "engine": {"max_model_len": 16384},
                       "workload": {"prompt_tokens": {"distribution": "uniform", "low": 3000, "high": 6000},
                                    "arrival": {"rate": 4.0}, "num_requests": 300}},
    "moe-tp2": {"model": "Mixtral-8x7B", "deployment": {"tensor_parallel": 2},
                "workload": {"arrival": {"rate": 8.0}, "num_requests": 400}},
}


def check_balances(result):
    records = result.requests
    # Every request is accounted for, exactly once.
    assert records["status"].isin(["finished", "rejected", "unfinished"]).all()
    # Tokens: what the iterations emitted is what the requests received; finished ones got all they asked.
    assert int(result.iterations["tokens_out"].sum()) == int(records["generated_tokens"].sum())
    finished = records[records["status"] == "finished"]
    assert (finished["generated_tokens"] == finished["output_tokens"]).all()
    unfinished = records[records["status"] != "finished"]
    assert (unfinished["generated_tokens"] < unfinished["output_tokens"]).all()
    # KV blocks: allocated = freed + still held, and nothing is held once everyone has left.
    assert result.kv_allocated_blocks == result.kv_freed_blocks + result.kv_held_blocks
    if (records["status"] != "unfinished").all():
        # Nothing is held once everyone has left, but what the prefix cache keeps (idle cached blocks).
        assert result.kv_held_blocks == (result.kv_tiers.cached_blocks if result.kv_tiers else 0)
    assert (result.iterations["kv_used_blocks"] <= result.kv_blocks_per_replica).all()
    # Times are ordered for every request that got that far.
    started = records.dropna(subset=["first_token_s"])
    # SimPy's clock reaches an arrival as now + (arrival - now), which can round one ulp short of the
    # trace's time (seen on a rollout group's share of a trace): a few ulps are allowed, nothing more.
    arrival = started["arrival_s"].to_numpy()
    assert (started["first_scheduled_s"].to_numpy() >= arrival - 4 * np.spacing(arrival)).all()
    assert (started["first_token_s"] > started["first_scheduled_s"]).all()
    assert (finished["finish_s"] >= finished["first_token_s"]).all()


@pytest.mark.parametrize("name", list(RUNS))
def test_requests_tokens_and_blocks_balance(name):
    result = simulate_checked(make_scenario(RUNS[name]))
    check_balances(result)
    summary = summarize(result).to_dict()["requests"]
    assert summary["arrived"] == (summary["finished"] + summary["rejected_timeout"] + summary["rejected_too_long"]
                                  + summary["unfinished_queued"] + summary["unfinished_running"])


def test_preemption_happens_and_recomputes():
    result = simulate_checked(make_scenario(RUNS["preempting"]))
    assert result.preemptions > 0
    assert result.requests["preemptions"].sum() == result.preemptions
    assert (result.requests["status"] == "finished").all()
    # A recompute prefills the prompt and what was generated again: more prefill work than prompts alone.
    assert result.iterations["prefill_tokens"].sum() > result.requests["prompt_tokens"].sum()


def test_overload_is_not_an_error_and_reports_the_queue():
    result = simulate_checked(make_scenario(RUNS["overloaded-horizon"]))
    summary = summarize(result).to_dict()["requests"]
    assert result.end_s == pytest.approx(15.0)
    assert summary["unfinished_queued"] > 0 and summary["unfinished_running"] > 0


DAY_PREFIX_REQUESTS = 3000


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_shipped_scenarios_balance(path):
    scenario = load_scenario(path)
    if estimate_run(scenario).events > MAX_RUN_EVENTS:       # a day of traffic: its first requests balance too
        scenario = variant(scenario, {"workload.num_requests": DAY_PREFIX_REQUESTS})
    if scenario.rollout is None:
        check_balances(simulate_checked(scenario))
        return
    rollout = simulate_rollout(scenario)              # every group: control, canaries and shadows
    for result in (*rollout.groups.values(), rollout.user):
        check_balances(result)
