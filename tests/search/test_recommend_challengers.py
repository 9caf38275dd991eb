"""Challengers of a finished leader in recommend's bisection (``_Search.evaluate`` and ``race``), on settings
whose capacity per seed is known: a setting passes a rate exactly when the rate is at most its capacity for
that seed. The truth is then the capacities themselves, not another run of the search."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

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
    """A search whose settings (told apart by max batch tokens) pass a rate iff it is at most their capacity
    for the seed; counts the probes per setting."""

    def __init__(self, capacities: dict[int, list[float]], racing: bool = True):
        scenario = make_scenario({"engine": {"max_num_seqs": 64}, "workload": {"arrival": {"rate": OWN_RATE}},
                                  "slo": {"ttft": "300 ms", "tpot": "30 ms"}})
        super().__init__(scenario, SEEDS, Objective.GOODPUT, 1, TOLERANCE, QUIET, racing=racing)
        self.capacity = {m: dict(zip(SEEDS, rates)) for m, rates in capacities.items()}
        self.probes: Counter[int] = Counter()
        self.defaults = []

    def analytic(self, config: Config) -> float:
        return 2 * OWN_RATE                # the fluid model's guess: a start, right or wrong

    def judge(self, points: list[dict], escalate: bool = True) -> list[Judged]:
        out = []
        for point in points:
            tokens = point["engine.max_batch_tokens"]
            self.probes[tokens] += 1
            met = point[RATE_KEY] <= self.capacity[tokens][point["seed"]]
            out.append(Judged(Verdict(met=met, decided=True, steady=True),
                              pd.DataFrame([{names.USD_PER_MILLION_OUTPUT_TOKENS: 1.0}]), Window(1.0, 1.0)))
        return out


def _config(tokens: int) -> Config:
    return Config(OFF, tokens, None)


def _run(capacities: dict[int, list[float]], racing: bool = True, kind: type[_KnownCapacity] = _KnownCapacity
         ) -> _KnownCapacity:
    """The first setting bisected alone (the leader), then the others at once (its challengers)."""
    search = kind(capacities, racing)
    first, *rest = capacities
    search.evaluate([_config(first)])
    search.evaluate([_config(m) for m in rest])
    return search


def test_a_clearly_worse_challenger_costs_one_probe_per_seed():
    search = _run({256: [10.0, 11.0, 10.5], 512: [7.0, 7.5, 7.2]})
    assert search.probes[512] == len(SEEDS)
    assert search.best() == _config(256)
    assert search.results[_config(512)]["raced_out"]


def test_a_tied_challenger_stops_within_the_leaders_bracket_and_the_leader_keeps_its_rank():
    leader = [10.0, 11.0, 10.5]
    search = _run({256: leader, 512: leader})      # the same capacities: a tie whatever the bisection
    assert search.probes[512] <= 2 * len(SEEDS)
    assert search.best() == _config(256)
    # what is reported for the challenger is a lower bound on its goodput (every seed passed there)
    assert all(r <= c for r, c in zip(search.results[_config(512)]["per_seed_rates"], leader))


def test_a_better_challenger_is_bisected_to_its_capacity_and_ranks_first():
    better = [13.0, 14.0, 13.5]
    search = _run({256: [10.0, 11.0, 10.5], 512: better})
    assert search.best() == _config(512)
    assert_brackets_hold(search.brackets[_config(512)], better, TOLERANCE)


def _random_capacities(generator) -> tuple[dict[int, list[float]], dict[int, float]]:
    """Per-seed capacities around a common level (settings within a few per cent of each other: ties, near
    ties and clear winners), and each setting's true mean capacity."""
    level = generator.uniform(8.0, 12.0)
    capacities = {tokens: list(level * generator.uniform(0.9, 1.1) * generator.uniform(0.97, 1.03, len(SEEDS)))
                  for tokens in (256, 512, 1024, 2048)}
    return capacities, {tokens: float(np.mean(rates)) for tokens, rates in capacities.items()}


def test_challengers_never_drop_a_setting_better_than_the_search_resolution():
    # Random capacities around a common level (settings within a few per cent of each other: ties, near
    # ties and clear winners): the setting ranked first is within the bisection's resolution of the truly
    # best mean capacity, and the exhaustive search (no racing) is held to the same.
    generator = np.random.default_rng(34)
    for _ in range(40):
        capacities, truth = _random_capacities(generator)
        best_truth = max(truth.values())
        for racing in (True, False):
            chosen = _run(capacities, racing).best().max_batch_tokens
            assert truth[chosen] * (1 + TOLERANCE) >= best_truth, (racing, capacities)


BAND = 0.05      # below its capacity by less than this share, a rate passes undecided in one window


class _UndecidedNearCapacity(_KnownCapacity):
    """As :class:`_KnownCapacity`, but one window leaves a pass within :data:`BAND` below the capacity undecided
    (as a real window does near capacity); measured longer (``escalate``), every verdict is decided. Counts
    the probes judged without escalation."""

    def __init__(self, capacities: dict[int, list[float]], racing: bool = True):
        super().__init__(capacities, racing)
        self.once: Counter[int] = Counter()

    def judge(self, points: list[dict], escalate: bool = True) -> list[Judged]:
        out = super().judge(points, escalate)
        if escalate:
            return out
        for i, (point, judged) in enumerate(zip(points, out)):
            tokens = point["engine.max_batch_tokens"]
            self.once[tokens] += 1
            near = point[RATE_KEY] > (1 - BAND) * self.capacity[tokens][point["seed"]]
            out[i] = Judged(replace(judged.verdict, decided=not (judged.verdict.met and near)), judged.rows,
                            judged.window)
        return out


def test_a_challenger_passing_undecided_at_the_leaders_failing_rate_stops_after_one_window_per_seed():
    # A little better than the leader (within its bracket and the band): one window at the leader's failing
    # rate leaves each seed's pass undecided, which is not measured longer and stops the challenger.
    leader = [10.0, 11.0, 10.5]
    search = _run({256: leader, 512: [1.03 * c for c in leader]}, kind=_UndecidedNearCapacity)
    assert search.probes[512] == search.once[512] == len(SEEDS)
    assert search.results[_config(512)]["raced_out"]
    assert search.best() == _config(256)


def test_a_challenger_shown_to_pass_at_the_leaders_failing_rate_is_bisected_to_its_capacity():
    better = [13.0, 14.0, 13.5]
    search = _run({256: [10.0, 11.0, 10.5], 512: better}, kind=_UndecidedNearCapacity)
    assert search.once[512] == len(SEEDS)         # its probes at the leader's failing rates; the rest escalate
    assert search.best() == _config(512)
    assert_brackets_hold(search.brackets[_config(512)], better, TOLERANCE)


def test_challengers_judged_on_one_window_never_drop_a_setting_better_than_resolution_and_band():
    # As the resolution test above, with passes near capacity left undecided by one window: a challenger so
    # stopped has its capacity within the band above a rate the leader failed, so the setting ranked first is
    # within the bisection's resolution and the band of the truly best.
    generator = np.random.default_rng(35)
    for _ in range(40):
        capacities, truth = _random_capacities(generator)
        chosen = _run(capacities, kind=_UndecidedNearCapacity).best().max_batch_tokens
        assert truth[chosen] * (1 + TOLERANCE) / (1 - BAND) >= max(truth.values()), capacities
