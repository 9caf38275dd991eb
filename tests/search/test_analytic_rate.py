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

    def evaluate(self, rates, mean_limits_s=None):
        rates = np.atleast_1d(rates)
        _Stub.solved.append(len(rates))
        ok = _Stub.passes(rates)
        return pd.DataFrame({"stable": np.ones(len(rates), dtype=bool),
                             "tpot_mean_s": np.where(ok, 0.01, 1.0), "ttft_mean_s": np.zeros(len(rates)),
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
