"""Racing in recommend's bisection (``_Search.race``) against the exhaustive search: the same best
setting with the same per-seed goodput, and every setting it stopped early is below that best when
bisected to the end."""
from __future__ import annotations

from llmsim.config.policies import Objective
from llmsim.config.progress import QUIET
from llmsim.search.recommend import OFF, Config, _Search
from llmsim.search.sweeps import reusing_runs
from tests.helpers import make_scenario


def _searched(racing: bool, as_defaults: bool = False) -> _Search:
    scenario = make_scenario({"engine": {"max_num_seqs": 64},
                              "workload": {"arrival": {"rate": 5.0}, "num_requests": 300},
                              "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
    with reusing_runs():
        search = _Search(scenario, [11, 12], Objective.GOODPUT, 1, 0.04, QUIET, racing=racing)
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
