"""``recommend`` with traffic classes, end to end, against what queueing theory says the answer must be.

The scenario: Llama-3.1-70B on one MI300X serving one sequence at a time (``max_num_seqs: 1``, a single
server), two classes sharing a Poisson stream. ``bulk`` (70%) generates 14 tokens: a service of 14 decode
steps, S_b ~ 0.44 s, the same for every request. ``chat`` (30%) generates 2 and wants P90 TTFT <= L = 200 ms;
its queue timeout sends it, once expired, into a small batch of its own past ``max_num_seqs``
(``on_timeout: dedicated``). The scenario starts from FCFS with a 1 s chat timeout.

What theory decides, at any arrival rate lambda where the server is stable:

- **A non-preemptive policy with a chat timeout T >= L misses chat's target.** By PASTA a chat request
  finds a bulk request in service with probability rho_b = 0.7 lambda S_b; the engine does not interrupt
  it, and with deterministic service its residual is uniform on [0, S_b], so with probability
  rho_b (1 - L / S_b) the chat waits more than L before it can start (the dedicated lane opens at T >= L,
  too late). At the rates below that share is >= 0.25, 2.5 times the 10% a P90 target allows.
- **A chat timeout T with T + 2 steps < L meets it under every policy.** After T the request joins at the
  next iteration boundary (at most one step away) and its first token comes out of its own first
  iteration (one more step): TTFT <= T + 2 x the longest step. With T = 50 ms and steps of ~32 ms that is
  ~114 ms < 200 ms, whatever the policy.
- **Preemptive priority meets it with any timeout**: at the next boundary the chat request preempts the
  bulk one, so TTFT <= 2 steps as well.

So at the scenario's own timeout only ``preemptive_priority`` meets chat's target (the policy decides);
with every other policy the chat timeout must be short (the timeout decides). The search is checked
against these verdicts on every candidate it screened, its answer must lie in the set theory allows,
and the answer and a setting it rejected are re-simulated on fresh seeds, outside the search.
"""
from __future__ import annotations

import contextlib
import copy

import pytest

import llmsim
from llmsim.analysis.metrics import summarize
from llmsim.cli.recommend import format_recommendation
from llmsim.scenario.variants import variant
from llmsim.search.recommend import recommend

from tests.helpers import make_scenario

TTFT_LIMIT_S, PERCENTILE = 0.2, 90
SHORT_S, LONG_S = 0.05, 1.0          # the chat timeouts the test's search tries (besides its own 1 s)
NON_PREEMPTIVE = ("fcfs", "priority", "weighted_fair", "edf", "vllm_priority")
SCENARIO = {
    "name": "chat-and-bulk", "seed": 5, "model": "Llama-3.1-70B", "hardware": "MI300X",
    "engine": {"max_num_seqs": 1, "max_model_len": 4096, "scheduling_policy": "fcfs"},
    "workload": {"arrival": {"process": "poisson", "rate": 1.8}, "num_requests": 100,
                 "prompt_tokens": 8, "output_tokens": 14,
                 "classes": {"chat": {"share": 0.3, "priority": 0, "output_tokens": 2,
                                      "queue_timeout": f"{LONG_S} s", "on_timeout": "dedicated"},
                             "bulk": {"share": 0.7, "priority": 1}}},
    # bulk's limit is far from binding: its mean E2E is about 1.3 s at the probe rate (Cobham's formula), so by
    # Markov's inequality at most ~7% of bulk requests exceed 20 s under any of these policies.
    "slo": {"classes": {"chat": {"ttft": f"{TTFT_LIMIT_S * 1000:g} ms", "percentile": PERCENTILE},
                        "bulk": {"e2e": "20 s", "percentile": PERCENTILE}}},
}


@pytest.fixture(scope="module")
def scenario():
    return make_scenario(base=copy.deepcopy(SCENARIO))


@pytest.fixture(scope="module")
def rec(scenario):
    return recommend(scenario, seeds=2, workers=2, search="classes", tolerance=0.25,
                     class_timeouts_s=(SHORT_S, LONG_S))


def _service_and_step_s(scenario, rate_per_s):
    """Bulk's service time (deterministic) and the longest step any request saw, from a run at this rate in
    which chat requests also share iterations (the dedicated lane): the inputs of the bounds above."""
    run = llmsim.simulate(variant(scenario, {"workload.arrival.rate": rate_per_s, "workload.num_requests": 1500,
                                             "workload.classes.chat.queue_timeout": f"{SHORT_S} s"}))
    requests = run.requests[run.requests["status"] == "finished"]
    bulk = requests[requests["class"] == "bulk"]
    service = (bulk["finish_s"] - bulk["first_scheduled_s"]).to_numpy()
    assert service.std() < 0.01 * service.mean()          # deterministic, as the residual argument assumes
    return float(service.mean()), float(requests["max_itl_s"].max())


def _chat_timeout(config):
    return dict(config.class_timeouts)["chat"]


@pytest.mark.slow
def test_the_search_agrees_with_theory_on_every_candidate_it_screened(rec, scenario):
    probe = rec.classes.probe_rate_per_s
    service_s, step_s = _service_and_step_s(scenario, probe)
    rho_bulk = 0.7 * probe * service_s
    missed_share = rho_bulk * (1 - TTFT_LIMIT_S / service_s)
    assert missed_share >= 0.25 > 1 - PERCENTILE / 100         # the bound is far from the target, not near it
    assert SHORT_S + 2 * step_s < 0.75 * TTFT_LIMIT_S            # the sure bound holds with room to spare
    screened = rec.classes.screened
    assert set(screened["scheduling_policy"]) == {*NON_PREEMPTIVE, "preemptive_priority"}
    for row in screened.itertuples():
        chat_s, chat_margin = row.class_timeouts["chat"], row.margins["chat.ttft"]   # attainment - 0.9
        if row.scheduling_policy == "preemptive_priority" or chat_s + 2 * step_s < TTFT_LIMIT_S:
            assert chat_margin == pytest.approx(0.1), row                         # every chat request within L
        elif chat_s >= TTFT_LIMIT_S:
            assert chat_margin < 0 and not row.met, row
    # At the scenario's own timeout only preemption meets chat's target: there the policy decides.
    own = screened[screened["class_timeouts"].map(lambda t: t["chat"] == LONG_S and t["bulk"] is None)]
    assert set(own[own["met"]]["scheduling_policy"]) == {"preemptive_priority"}


@pytest.mark.slow
def test_a_screen_stopped_sure_to_miss_is_one_theory_says_misses(rec, scenario):
    """Screens run under the missed-target stop: every candidate stopped is one theory says misses chat's
    target (non-preemptive, chat timeout >= L), and the stop prunes some of them."""
    stopped = rec.classes.screened[rec.classes.screened["stopped"]]
    assert len(stopped)
    for row in stopped.itertuples():
        assert row.scheduling_policy in NON_PREEMPTIVE and row.class_timeouts["chat"] >= TTFT_LIMIT_S, row
        assert not row.met


@pytest.mark.slow
def test_the_stop_leaves_every_policy_s_pick_as_it_was(rec, scenario, monkeypatch):
    """The same search with no run stopped picks the same timeouts for every policy, and the same answer."""
    monkeypatch.setattr("llmsim.search.recommend.stopping_decided_runs", contextlib.nullcontext)
    whole = recommend(scenario, seeds=2, workers=2, search="classes", tolerance=0.25,
                      class_timeouts_s=(SHORT_S, LONG_S))
    assert not whole.classes.screened["stopped"].any()
    assert whole.classes.best_per_policy == rec.classes.best_per_policy
    assert whole.best == rec.best


@pytest.mark.slow
def test_the_recommendation_is_one_theory_allows_and_meets_every_target_on_fresh_seeds(rec, scenario):
    best = rec.best
    assert best.policy == "preemptive_priority" or _chat_timeout(best) <= SHORT_S
    assert rec.table.iloc[0]["meets_scenario_rate"]
    # Every policy's best meets the targets at the scenario's rate; the scenario's own setting does not.
    assert rec.policies["meets_scenario_rate"].all() and len(rec.policies) == 6
    assert not rec.defaults.iloc[0]["meets_scenario_rate"] and rec.improvement > 0

    def summary(overrides, seed):
        point = {**overrides, "seed": seed, "workload.num_requests": 1500}
        return summarize(llmsim.simulate(variant(scenario, point))).to_dict()

    rejected = {"engine.scheduling_policy": "priority", "workload.classes.chat.queue_timeout": f"{LONG_S} s"}
    for seed in (101, 102):                     # seeds the search never used
        chosen = summary(best.overrides(scenario), seed)
        assert all(figures["slo"]["met"] for figures in chosen["classes"].values()), chosen["classes"]
        for overrides in ({}, rejected):        # the scenario's own FCFS, and strict priority, at the long timeout
            classes = summary(overrides, seed)["classes"]
            assert not classes["chat"]["slo"]["met"] and classes["bulk"]["slo"]["met"]


@pytest.mark.slow
def test_the_printout_says_which_policy_and_timeouts_and_why(rec, scenario):
    text = format_recommendation(rec, scenario)
    row = rec.table.iloc[0]
    assert f"scheduling_policy  {row['scheduling_policy']}" in text
    assert f"chat {_chat_timeout(rec.best) * 1000:g} ms, bulk none" in text
    assert "the scenario's own settings: k off, max_batch_tokens 8192, queue timeout none, policy fcfs, class " \
           "timeouts chat 1000 ms, bulk none" in text and "rule-of-thumb" not in text
    for policy in rec.policies["scheduling_policy"]:       # one line per policy, with each class's attainment
        line = next(line for line in text.splitlines() if line.strip().startswith(policy + " "))
        assert "req/s" in line and line.count("%") == 2 and "meets every class's targets" in line
    assert f"screened {len(rec.classes.screened)} policy and class-timeout combinations" in text


def test_a_scenario_without_classes_cannot_search_them(capsys):
    from llmsim.errors import ConfigError
    from tests.helpers import BASE

    plain = make_scenario({"slo": {"ttft": "1 s"}}, base=BASE)
    with pytest.raises(ConfigError) as error:
        recommend(plain, search="classes")
    assert error.value.key == "workload.classes"
    for bad in ((), (0.0,), (-1.0, 0.05)):
        with pytest.raises(ConfigError) as error:
            recommend(make_scenario(base=copy.deepcopy(SCENARIO)), search="classes", class_timeouts_s=bad)
        assert error.value.key == "class_timeouts_s"      # the parameter; the command line names its flag




@pytest.mark.slow
def test_a_screen_rules_out_only_candidates_whose_screen_on_every_seed_is_below_their_bar(scenario):
    """Screened with a bar (the key each must beat), candidates stop after fewer seeds, or with a run stopped
    inside once its sure misses keep them below it (BarStop), only where their screen on every seed, simulated
    apart and whole, indeed ranks below it; the others' screens are those every seed gives. Every bar between the
    candidates' keys, with the seeds in the search's order and the other way round."""
    from dataclasses import replace

    from llmsim.config.policies import Objective, SchedulingPolicy
    from llmsim.config.progress import QUIET
    from llmsim.search.recommend import _screen_key, _Search, class_timeouts
    from llmsim.search.window import measurement_window, typical_latency_s

    seeds = [5, 6, 7]

    def searcher():
        return _Search(scenario, seeds, Objective.GOODPUT, 1, 0.25, QUIET, own_settings=True)
    base = searcher().defaults[0]
    start = class_timeouts(base, scenario)
    candidates = [replace(base, policy=policy, class_timeouts=(("chat", chat_s), start[1]))
                  for policy in SchedulingPolicy for chat_s in (SHORT_S, LONG_S)]
    rate = scenario.workload.rate_per_s
    window = measurement_window(scenario, rate, typical_latency_s(scenario, rate), own_floor=False)
    reference = searcher()
    reference.screen(candidates, rate, window)
    keys = {c: _screen_key(reference.screened[(c, rate)]) for c in candidates}
    stopped_inside = 0
    for bar in sorted(set(keys.values())):
        for order in (seeds, seeds[::-1]):
            barred = searcher()
            barred.screen(candidates, rate, window, dict.fromkeys(candidates, bar), dict.fromkeys(candidates, order))
            ruled_out = [c for c in candidates if (c, rate) in barred.ruled_out]
            assert len(ruled_out) < len(candidates)
            for c in candidates:
                if c in ruled_out:
                    reach, judged = barred.ruled_out[(c, rate)]
                    assert keys[c] < bar and keys[c] <= reach, (bar, c)
                    stopped_inside += judged.stopped
                else:
                    assert barred.screened[(c, rate)].verdict == reference.screened[(c, rate)].verdict
    assert stopped_inside          # the stop on the bar is exercised


def test_a_bar_stop_allows_exactly_the_sure_misses_that_leave_a_candidate_within_reach_of_its_bar(scenario):
    """BarStop's count on a limit, against judge() itself: a next seed with one sure miss more than it allows (every
    other request within the limit, every later seed at its best) leaves the candidate's key below its bar and at
    most the key it says the candidate can reach; with the misses it allows, the limit's pooled margin still
    reaches that key's (the stop comes no sooner than it must). Bars on both sides of the first seed's margin,
    meeting the targets and not, for windows of 40 to 4,001 requests."""
    from llmsim.analysis import names
    from llmsim.config.policies import Objective
    from llmsim.config.progress import QUIET
    from llmsim.search.recommend import _screen_key, _Search
    from llmsim.search.window import Judged, best_case, judge, limit_checks, measurement_window, typical_latency_s
    import pandas as pd

    seeds = [5, 6, 7]
    search = _Search(scenario, seeds, Objective.GOODPUT, 1, 0.25, QUIET, own_settings=True)
    config, rate = search.defaults[0], scenario.workload.rate_per_s
    window = measurement_window(scenario, rate, typical_latency_s(scenario, rate), own_floor=False)
    search.screen([config], rate, window)
    first = search.screened[(config, rate)].rows.iloc[:1].reset_index(drop=True)
    own = judge(first).worst_margin[0]
    checked = {True: 0, False: 0}       # beyond the count, within it
    for met in (False, True):
        for bar_margin in (own - 0.3, own - 0.05, own, own + 0.02, -0.02, 0.05):
            bar = (met, True, bar_margin)
            stop = search._bar_stop([first], bar)
            if stop is None:
                continue
            reach, rule = stop
            assert reach <= bar
            for name, _ in rule.spare:
                column, _, wanted = limit_checks(first)[name]
                for counted in (40, 97, 500, 4001):
                    allowed = rule.allowed_on(name, wanted, counted)
                    for misses in (allowed, allowed + 1):
                        if not 0 <= misses <= counted:
                            continue
                        nxt = first.copy()
                        nxt[column], nxt[names.STEADY] = 1 - misses / counted, True
                        rows = best_case(pd.concat([first, nxt], ignore_index=True), len(seeds))
                        verdict = judge(rows)
                        if misses > allowed:
                            key = _screen_key(Judged(verdict, rows, window))
                            assert key < bar and key <= reach, (bar, name, counted, misses)
                        else:
                            assert verdict.margins[name][0] >= reach[2] - 1e-9, (bar, name, counted, misses)
                        checked[misses > allowed] += 1
    assert min(checked.values()) > 10, checked
