"""Racing in recommend's bisection (``_Search.race``) against the exhaustive search: the same best
setting with the same per-seed goodput, and every setting it stopped early is below that best when
bisected to the end."""
from __future__ import annotations

import pandas as pd

from llmsim.analysis import names
from llmsim.config.progress import QUIET
from llmsim.search import recommend as module
from llmsim.search.recommend import OFF, Config, _Search
from llmsim.search.sweeps import reusing_runs
from llmsim.search.window import Judged, Verdict
from tests.helpers import make_scenario


def _searched(racing: bool, as_defaults: bool = False) -> _Search:
    scenario = make_scenario({"engine": {"max_num_seqs": 64},
                              "workload": {"arrival": {"rate": 5.0}, "num_requests": 300},
                              "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
    with reusing_runs():
        search = _Search(scenario, [11, 12], "goodput", 1, 0.04, QUIET, racing=racing)
        configs = [Config(OFF, m, None) for m in (256, 1024, 4096)]
        if as_defaults:
            search.defaults = configs
        search.evaluate(configs)
    return search


def test_racing_keeps_the_exhaustive_answer():
    raced, exhaustive = _searched(True).table(), _searched(False).table()
    assert raced["config"].iloc[0] == exhaustive["config"].iloc[0]
    assert raced["per_seed_rates"].iloc[0] == exhaustive["per_seed_rates"].iloc[0]
    stopped = raced[raced["raced_out"]]
    assert len(stopped) >= 1                              # the small grid does exercise it
    best = exhaustive["max_rate_per_s"].iloc[0]
    full = exhaustive.set_index(exhaustive["config"].map(lambda c: c.label))
    for config in stopped["config"]:
        assert full.loc[config.label, "max_rate_per_s"] < best
        # what the raced search reports for it is a lower bound on its goodput
        assert stopped.set_index(stopped["config"].map(lambda c: c.label)).loc[config.label, "max_rate_per_s"] \
            <= full.loc[config.label, "max_rate_per_s"]


def test_defaults_race_among_themselves_and_keep_the_best_default():
    # The same grid as the baseline defaults: the best of them (the gain's baseline) keeps its exhaustive
    # per-seed goodput, and any default stopped early is below it when bisected to the end.
    raced, exhaustive = _searched(True, as_defaults=True).table(), _searched(False, as_defaults=True).table()
    assert raced["config"].iloc[0] == exhaustive["config"].iloc[0]
    assert raced["per_seed_rates"].iloc[0] == exhaustive["per_seed_rates"].iloc[0]
    full = exhaustive.set_index(exhaustive["config"].map(lambda c: c.label))
    for config in raced[raced["raced_out"]]["config"]:
        assert full.loc[config.label, "max_rate_per_s"] < exhaustive["max_rate_per_s"].iloc[0]


def test_an_undecided_pass_is_measured_longer_only_where_the_answer_rests_on_it(monkeypatch):
    """A bisection against a known boundary (10 req/s): below 9 every window passes beyond doubt; in [9, 10)
    the first window passes undecided and a longer one confirms it; in [10, 11) the first window passes
    undecided but a longer one fails (a short window passes what a long one fails); above, every window
    fails. The answer per seed is below the boundary and within the tolerance of it, and a provisional
    pass that a higher pass overtook is never measured longer."""
    boundary, tolerance = 10.0, 0.04
    first_windows, longer, undecided_passes = set(), [], []

    def fake(scenario, points, windows, rates, **kwargs):
        out = []
        for point, window, rate in zip(points, windows, rates):
            key = (rate, point["seed"])
            long = key in first_windows
            first_windows.add(key)
            if long:
                longer.append(key)
            if rate < 0.9 * boundary or (long and rate < boundary):
                verdict = Verdict(met=True, decided=True, steady=True)
            elif rate < 1.1 * boundary and not long:
                verdict = Verdict(met=True, decided=False, steady=True)
                undecided_passes.append(key)
            else:
                verdict = Verdict(met=False, decided=True, steady=True)
            out.append(Judged(verdict, pd.DataFrame({names.USD_PER_MILLION_OUTPUT_TOKENS: [1.0]}), window))
        return out
    monkeypatch.setattr(module, "simulate_until_decided", fake)
    scenario = make_scenario({"workload": {"arrival": {"rate": 5.0}, "num_requests": 300},
                              "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
    search = _Search(scenario, [11, 12], "goodput", 1, tolerance, QUIET)
    config = Config(OFF, 1024, None)
    search.evaluate([config], start_rate_per_s=5.0)
    for rate in search.results[config]["per_seed_rates"]:
        assert boundary / (1 + tolerance) <= rate < boundary
    assert longer and len(longer) < len(undecided_passes)
