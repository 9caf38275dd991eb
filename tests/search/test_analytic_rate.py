"""recommend's fluid scan (``analytic_rate``): solved top down in chunks, it finds the highest passing
rate of the whole grid, where the passing rates need not form one interval."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import llmsim.search.recommend as recommend_module
from llmsim.search.recommend import analytic_rate
from tests.helpers import make_scenario

RATE = 4.0


class _Stub:
    """A fluid model whose mean TPOT passes its 30 ms limit exactly on the rates ``passes`` says."""
    passes = staticmethod(lambda rates: rates < 2 * RATE)
    solved: list[int] = []

    def __init__(self, scenario, trace=None):
        pass

    def evaluate(self, rates, mean_limits_s=None, ttft_percentile=None):
        rates = np.atleast_1d(rates)
        _Stub.solved.append(len(rates))
        ok = _Stub.passes(rates)
        return pd.DataFrame({"stable": np.ones(len(rates), dtype=bool),
                             "tpot_mean_s": np.where(ok, 0.01, 1.0), "ttft_mean_s": np.zeros(len(rates)),
                             "ttft_percentile_s": np.zeros(len(rates)),
                             "e2e_mean_s": np.zeros(len(rates))})


def _whole_grid(passes) -> float:
    """The highest passing rate of the coarse then the fine grid, every rate of them judged: the scan's truth."""
    coarse = RATE * np.geomspace(0.05, 20, 40)
    ok = np.flatnonzero(passes(coarse))
    if not len(ok):
        return 0.0
    last = int(ok[-1])
    if last == len(coarse) - 1:
        return float(coarse[-1])
    fine = np.linspace(coarse[last], coarse[last + 1], 17)
    fine_ok = np.flatnonzero(passes(fine))
    return float(fine[fine_ok[-1]]) if len(fine_ok) else float(coarse[last])


@pytest.mark.parametrize("passes", [
    lambda r: r < 2 * RATE,                                   # one interval
    lambda r: (r < 1.5 * RATE) | ((r > 9 * RATE) & (r < 11 * RATE)),   # an island far above the first failure
    lambda r: r > 1e9,                                        # nothing passes
    lambda r: r > 0,                                          # everything passes
    lambda r: (r < 3 * RATE) & ~((r > 0.5 * RATE) & (r < 0.6 * RATE)),  # a hole below the edge
    lambda r: r > 70.0,                                       # only the grid's top rate
])
def test_the_chunked_scan_finds_the_whole_grids_highest_passing_rate(monkeypatch, passes):
    monkeypatch.setattr(recommend_module, "fluid_model", _Stub)
    monkeypatch.setattr(_Stub, "passes", staticmethod(passes))
    scenario = make_scenario({"workload": {"arrival": {"rate": RATE}}, "slo": {"tpot": "30 ms"}})
    assert analytic_rate(scenario) == _whole_grid(passes)


def test_rates_far_below_the_edge_are_not_solved(monkeypatch):
    monkeypatch.setattr(recommend_module, "fluid_model", _Stub)
    monkeypatch.setattr(_Stub, "solved", [])
    scenario = make_scenario({"workload": {"arrival": {"rate": RATE}}, "slo": {"tpot": "30 ms"}})
    analytic_rate(scenario)
    assert sum(_Stub.solved) < 40 + 17


PATTERNS = [
    lambda r: r < 2 * RATE,
    lambda r: (r < 1.5 * RATE) | ((r > 9 * RATE) & (r < 11 * RATE)),
    lambda r: r > 1e9,
    lambda r: r > 0,
    lambda r: (r < 3 * RATE) & ~((r > 0.5 * RATE) & (r < 0.6 * RATE)),
    lambda r: r > 70.0,
]


@pytest.mark.parametrize("passes", PATTERNS)
@pytest.mark.parametrize("floor_over_rate", [0.01, 0.5, 1.49, 1.5, 1.95, 2.0, 2.05, 10.5, 25.0, 100.0])
def test_a_scan_stopped_by_its_floor_lies_below_it_and_one_not_stopped_is_exact(monkeypatch, passes, floor_over_rate):
    monkeypatch.setattr(recommend_module, "fluid_model", _Stub)
    monkeypatch.setattr(_Stub, "passes", staticmethod(passes))
    scenario = make_scenario({"workload": {"arrival": {"rate": RATE}}, "slo": {"tpot": "30 ms"}})
    floor = floor_over_rate * RATE
    rate, truth = analytic_rate(scenario, None, floor), _whole_grid(passes)
    if np.isnan(rate):
        assert truth < floor
    else:
        assert rate == truth


def test_the_screened_grid_keeps_the_whole_grids_best_settings_and_their_rates():
    # Every setting scored in full against the screen: the same best `top` in the same order with the same rates,
    # every rate the screen gives exact, and every setting it screened out below the top-th best.
    from llmsim.search.recommend import Config, Objective, _Search, batch_token_options, k_options
    from llmsim.config.progress import QUIET
    scenario = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "static", "k": 2, "k_max": 2,
                                              "acceptance": {"process": "beta", "mean": 0.7, "concentration": 10}},
                              "workload": {"arrival": {"rate": RATE}}, "slo": {"ttft": "1 s", "tpot": "30 ms"}})
    grid = [Config(k, m, None) for k in k_options(scenario) for m in batch_token_options(scenario)]
    top = 3
    screened = _Search(scenario, [1, 2], Objective.GOODPUT, 1, 0.04, QUIET).screen_grid(grid, top)
    whole = _Search(scenario, [1, 2], Objective.GOODPUT, 1, 0.04, QUIET)
    truth = {(str(c.k), c.max_batch_tokens): whole.analytic(c) for c in grid}
    assert screened["screened_out"].any()              # the screen stopped some scans: the test compares something
    best = sorted((rate for rate in truth.values() if not np.isnan(rate)), reverse=True)[:top]
    assert list(screened["analytic_rate_per_s"].head(top)) == best
    for row in screened.itertuples():
        exact = truth[(str(row.k), row.max_batch_tokens)]
        if row.screened_out:
            assert exact < best[-1]
        else:
            assert row.analytic_rate_per_s == exact or (np.isnan(row.analytic_rate_per_s) and np.isnan(exact))


def test_settings_differing_only_in_the_eligibility_rule_share_the_fluid_rate_each_would_get():
    # The fluid model lets every sequence speculate: each eligibility rule's own scenario, scored afresh, gets the
    # rate the search remembers for them all (one fluid scan).
    from llmsim.config.progress import QUIET
    from llmsim.config.policies import KPolicyName
    from llmsim.scenario.variants import variant
    from llmsim.search.recommend import Config, KChoice, Objective, _Search
    scenario = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "static", "k": 2,
                                              "eligibility": {"min_sequence_tokens": 64,
                                                              "min_concurrent_requests": 4}},
                              "workload": {"arrival": {"rate": RATE}}, "slo": {"ttft": "1 s", "tpot": "30 ms"}})
    search = _Search(scenario, [1, 2], Objective.GOODPUT, 1, 0.04, QUIET)
    base = Config(KChoice(KPolicyName.STATIC, 2), 2048, None)
    shared = search.analytic(base)
    assert shared > 0
    for rule in ((0, 1), (64, 1), (0, 4)):
        config = Config(base.k, base.max_batch_tokens, None, eligibility=rule)
        own = variant(scenario, config.overrides(scenario))
        assert (own.speculation.eligibility.min_sequence_tokens,
                own.speculation.eligibility.min_concurrent_requests) == rule
        assert search.analytic(config) == analytic_rate(own, search.trace)
    assert len(search._analytic) == 1
