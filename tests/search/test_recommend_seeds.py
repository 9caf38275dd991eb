"""How recommend's bisection starts (``_Search.evaluate``), on stand-in settings whose capacity per seed is
known: a setting passes a rate exactly when the rate is at most its capacity for that seed, so the truth is
the capacities themselves. A setting's later seeds start from its first seed's bracket, and with no
simulated rate yet the first setting is a pilot whose ratio to the fluid model's rate starts the others;
neither may move any seed's answer off its own capacity."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

from llmsim.analysis import names
from llmsim.config.policies import Objective
from llmsim.config.progress import QUIET
from llmsim.scenario.variants import RATE_KEY
from llmsim.search.recommend import OFF, Config, _Search
from llmsim.search.window import Judged, Verdict, Window
from tests.helpers import assert_brackets_hold, make_scenario

SEEDS = [11, 12, 13]
TOLERANCE = 0.04
OWN_RATE = 5.0


class _KnownCapacity(_Search):
    """Settings told apart by max batch tokens pass a rate iff it is at most their capacity for the seed;
    the fluid model's rate is ``optimism`` times the mean capacity. Counts the probes per (setting, seed)."""

    def __init__(self, capacities: dict[int, list[float]], optimism: float):
        scenario = make_scenario({"engine": {"max_num_seqs": 64}, "workload": {"arrival": {"rate": OWN_RATE}},
                                  "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
        super().__init__(scenario, SEEDS, Objective.GOODPUT, 1, TOLERANCE, QUIET, racing=False)
        self.capacity = {m: dict(zip(SEEDS, rates)) for m, rates in capacities.items()}
        self.optimism = optimism
        self.probes: Counter[tuple[int, int]] = Counter()
        self.defaults = []

    def analytic(self, config: Config) -> float:
        return self.optimism * float(np.mean(list(self.capacity[config.max_batch_tokens].values())))

    def judge(self, points: list[dict], escalate: bool = True) -> list[Judged]:
        out = []
        for point in points:
            tokens, seed = point["engine.max_batch_tokens"], point["seed"]
            self.probes[(tokens, seed)] += 1
            met = point[RATE_KEY] <= self.capacity[tokens][seed]
            out.append(Judged(Verdict(met=met, decided=True, steady=True),
                              pd.DataFrame([{names.USD_PER_MILLION_OUTPUT_TOKENS: 1.0}]), Window(1.0, 1.0)))
        return out


def _searched(capacities: dict[int, list[float]], optimism: float) -> _KnownCapacity:
    search = _KnownCapacity(capacities, optimism)
    search.evaluate([Config(OFF, tokens, None) for tokens in capacities])
    return search


def _assert_each_seed_bracketed(search: _KnownCapacity, capacities: dict[int, list[float]]) -> None:
    for tokens, rates in capacities.items():
        assert_brackets_hold(search.brackets[Config(OFF, tokens, None)], rates, TOLERANCE)


def test_every_seed_still_ends_in_a_bracket_of_its_own_capacity():
    # Seeds spread by up to 30% around each setting's level, fluid guesses from a third to three times the
    # truth: wherever the first seed's bracket lands, each later seed's answer is its own capacity's.
    generator = np.random.default_rng(34)
    for _ in range(30):
        level = generator.uniform(6.0, 12.0)
        capacities = {tokens: list(level * generator.uniform(0.8, 1.2) * generator.uniform(0.85, 1.15, len(SEEDS)))
                      for tokens in (256, 512, 1024)}
        _assert_each_seed_bracketed(_searched(capacities, generator.choice([0.33, 1.0, 3.0])), capacities)


def test_a_later_seed_within_the_first_seeds_bracket_costs_two_probes():
    capacities = {256: [10.0, 10.05, 10.1]}
    search = _searched(capacities, 1.0)
    first = search.brackets[Config(OFF, 256, None)][0]
    for seed, capacity in zip(SEEDS[1:], capacities[256][1:]):
        if first.passing <= capacity < first.failing:
            assert search.probes[(256, seed)] == 2
    _assert_each_seed_bracketed(search, capacities)


def test_the_pilots_ratio_starts_the_other_settings_near_their_capacity():
    # The fluid model three times too optimistic for every setting: the pilot steps down from there, the
    # others start at their guess times the pilot's ratio, within the tolerance of their capacity.
    capacities = {256: [10.0, 10.0, 10.0], 512: [8.0, 8.0, 8.0], 1024: [12.0, 12.0, 12.0]}
    search = _searched(capacities, 3.0)
    _assert_each_seed_bracketed(search, capacities)
    pilot = search.probes[(256, SEEDS[0])]
    for tokens in (512, 1024):
        assert search.probes[(tokens, SEEDS[0])] < pilot
