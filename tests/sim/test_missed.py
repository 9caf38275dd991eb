"""A run stopped once it is sure to miss its SLO targets (llmsim.sim.missed): it stops only when the whole run
misses them by the margin, it still accounts for every request, and a run it does not stop is the run without it;
each on one replica and on a disaggregated deployment (one prefill and one decode replica)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from llmsim.analysis.metrics import summarize
from llmsim.cli.render import format_summary
from llmsim.sim.missed import ShortfallStop, _sure_misses
from llmsim.sim.request import RequestRecords
from llmsim.sim.result import StopReason
from llmsim.sim.simulate import simulate

from tests.helpers import make_scenario, simulate_checked
from tests.sim.test_conservation import check_balances

RULE = ShortfallStop(min_requests=40, margin=0.23)
TTFT_S = 0.5
SLO = {"slo": {"ttft": f"{TTFT_S * 1000:g} ms", "tpot": "50 ms", "percentile": 95}, "simulation": {"warmup": "2 s"}}


SPLIT = {"deployment": {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                           "link": "infiniband_ndr"}}}
LAYOUTS = {"one replica": {}, "disaggregated 1P1D": SPLIT}


def overloaded(layout: str):
    # far past one H100's capacity for these lengths: the queue, and with it every TTFT, grows without bound
    return make_scenario({**SLO, **LAYOUTS[layout], "workload": {"arrival": {"rate": 300.0}, "num_requests": 3000}})


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request):
    scenario = overloaded(request.param)
    return simulate_checked(scenario, stop_when_missed=RULE), simulate(scenario)


def test_an_overloaded_run_stops_and_says_so(runs):
    stopped, whole = runs
    assert stopped.stopped_by is StopReason.MISSED
    assert whole.stopped_by is StopReason.COMPLETED
    assert stopped.end_s < whole.end_s / 4
    assert summarize(stopped).to_dict()["stopped_by"] == "missed"
    # on the TTFT limit (the one the whole run misses by more than the margin, below); a run not so stopped
    # names none
    assert stopped.stopped_on == ("ttft",) and summarize(stopped).to_dict()["stopped_on"] == "ttft"
    assert whole.stopped_on == () and "stopped_on" not in summarize(whole).to_dict()
    # and the terminal summary names the limit
    assert "STOPPED by its SLO targets being missed beyond recovery (ttft) at" in format_summary(
        summarize(stopped).to_dict())


def test_a_stopped_run_accounts_for_every_request(runs):
    stopped, _ = runs
    check_balances(stopped)
    counts = summarize(stopped).to_dict()["requests"]
    assert counts["not_arrived"] > 0 and counts["unfinished_queued"] > 0
    assert counts["arrived"] + counts["not_arrived"] == 3000
    assert counts["arrived"] == (counts["finished"] + counts["rejected_timeout"] + counts["rejected_too_long"]
                                 + counts["unfinished_queued"] + counts["unfinished_running"])


def test_the_stop_is_justified_by_the_whole_run(runs):
    """Read from the whole run's records: by the time the run stopped, more of the window's requests than the
    rule allows had already waited past the TTFT limit without a first token, or got it late; and the whole
    run's TTFT attainment over the window is below the target less the margin."""
    stopped, whole = runs
    records = whole.requests
    start, stop = whole.warmup_s, whole.arrival_window_s
    window = records[(records["arrival_s"] >= start) & (records["arrival_s"] <= stop)]
    late = window["ttft_s"].isna() | (window["ttft_s"] > TTFT_S)
    known_at_stop = window["arrival_s"] + TTFT_S < stopped.end_s
    assert (late & known_at_stop).sum() > (1 - 0.95 + RULE.margin) * len(window)
    attainment = summarize(whole).to_dict()["slo"]["ttft_attainment"]
    assert attainment < 0.95 - RULE.margin
    # until the stop, the two runs are the same run: every request the stopped one finished, finished alike
    done = stopped.requests[stopped.requests["status"] == "finished"].set_index("id")
    pd.testing.assert_frame_equal(done, whole.requests.set_index("id").loc[done.index])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_run_meeting_its_targets_is_not_changed(layout):
    scenario = make_scenario({**SLO, **LAYOUTS[layout], "workload": {"arrival": {"rate": 5.0}, "num_requests": 600}})
    watched, plain = simulate(scenario, stop_when_missed=RULE), simulate(scenario)
    assert watched.stopped_by is StopReason.COMPLETED
    pd.testing.assert_frame_equal(watched.requests, plain.requests)
    pd.testing.assert_frame_equal(watched.iterations, plain.iterations)


def test_too_few_requests_in_the_window_are_never_stopped():
    scenario = make_scenario({**SLO, "workload": {"arrival": {"rate": 300.0}, "num_requests": 3000}})
    result = simulate(scenario, stop_when_missed=ShortfallStop(min_requests=10_000, margin=0.23))
    assert result.stopped_by is StopReason.COMPLETED


# Two classes with SLOs of their own only (no top-level limit): under priority scheduling the urgent class
# is served first and meets its target, while the relaxed one starves past its end-to-end limit.
CLASS_SLOS = {"engine": {"scheduling_policy": "priority"}, "simulation": {"warmup": "2 s"},
              "workload": {"arrival": {"rate": 300.0}, "num_requests": 3000,
                           "classes": {"urgent": {"share": 0.1, "priority": 0},
                                       "relaxed": {"share": 0.9, "priority": 1}}},
              "slo": {"classes": {"urgent": {"ttft": "60 s", "percentile": 90},
                                  "relaxed": {"e2e": "4 s", "percentile": 90}}}}


@pytest.fixture(scope="module")
def class_runs():
    scenario = make_scenario(CLASS_SLOS)
    assert not scenario.slo.targets()          # every limit is a class's own
    return simulate_checked(scenario, stop_when_missed=RULE), simulate(scenario)


def test_a_run_sure_to_miss_a_class_target_stops(class_runs):
    """The fault: the watch read only the top-level targets (empty when every class sets its own), so a run
    with traffic classes never stopped. The stop is justified by the whole run: the class it stopped on
    misses its target by more than the margin there, and until the stop the two runs are the same run."""
    stopped, whole = class_runs
    assert stopped.stopped_by is StopReason.MISSED
    assert stopped.end_s < whole.end_s / 2
    check_balances(stopped)
    classes = summarize(whole).to_dict()["classes"]
    assert classes["relaxed"]["slo"]["e2e_attainment"] < 0.90 - RULE.margin
    assert stopped.stopped_on == ("relaxed.e2e",)          # named as a search names a class's limit
    done = stopped.requests[stopped.requests["status"] == "finished"].set_index("id")
    pd.testing.assert_frame_equal(done, whole.requests.set_index("id").loc[done.index])


def test_a_class_run_meeting_its_targets_is_not_changed():
    scenario = make_scenario({**CLASS_SLOS, "workload": {**CLASS_SLOS["workload"], "arrival": {"rate": 5.0},
                                                         "num_requests": 600}})
    watched, plain = simulate(scenario, stop_when_missed=RULE), simulate(scenario)
    assert watched.stopped_by is StopReason.COMPLETED
    pd.testing.assert_frame_equal(watched.requests, plain.requests)


def test_sure_misses_counts_as_the_array_formulation():
    """The watch's compiled count of sure misses, per watched target, against the same rule written as numpy
    array operations over the window (arrived, and rejected or late: on TTFT without a first token past the
    limit or with one after it, on E2E in the system past the limit or finished after it), on requests of
    every state, limits on both metrics and class masks, with waits and latencies landing exactly on a limit."""
    rng = np.random.default_rng(7)
    n, now = 4000, 50.0
    arrival = np.sort(rng.uniform(0.0, 60.0, n))
    arrival[:50] = now                                    # arriving at the check's time: counted
    status = rng.choice(np.array([0, 1, 2], np.int8), n)  # in the system, finished, rejected
    first_token = np.where(rng.random(n) < 0.3, np.nan, arrival + rng.choice([0.25, 0.5, 0.75], n))
    finish = np.where(status == 1, arrival + rng.choice([1.0, 2.0, 3.0], n), np.nan)
    arrival[100:150] = now - 0.5                          # waited exactly the TTFT limit: not late
    ttft = np.array([True, False, True, False])
    limits_s = np.array([0.5, 2.0, 0.5, 2.0])
    classes = rng.integers(0, 2, n)
    mines = np.array([np.ones(n, bool), np.ones(n, bool), classes == 0, classes == 1])
    rejected_code = RequestRecords.STATUSES.index("rejected")
    counts = _sure_misses(now, arrival, status, rejected_code, first_token, finish, ttft, limits_s, mines)
    arrived, waited, rejected = arrival <= now, now - arrival, status == rejected_code
    for t in range(len(ttft)):
        if ttft[t]:
            late = np.where(np.isnan(first_token), waited > limits_s[t], first_token - arrival > limits_s[t])
        else:
            late = np.where(status != 0, finish - arrival > limits_s[t], waited > limits_s[t])
        expected = int(np.count_nonzero(arrived & (rejected | late) & mines[t]))
        assert 0 < expected < n and counts[t] == expected
