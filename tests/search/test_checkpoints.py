"""A search's undecided point measured longer by continuing its run (llmsim.sim.checkpoints, used by
llmsim.search.window.simulate_until_decided) instead of simulating it again from the start.

Checked against what does not come from the checkpoints: the whole run (a run no checkpoint stops is that
run, figure for figure), a run of the shorter window started afresh (the same requests, figures within their
standard errors), a run four times longer than the longest window (a decided verdict must agree with its
estimate where that run settles it), and the doubling chain's request counts."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from llmsim.analysis.metrics import summarize
from llmsim.analysis.summary import flatten
from llmsim.cli.render import format_summary
from llmsim.config.progress import Progress
from llmsim.scenario.variants import RATE_KEY, variant
from llmsim.search.plan import as_scenario
from llmsim.search.window import (ESCALATIONS, Window, judge, measurement_window, simulate_until_decided,
                                  stopping_decided_runs, typical_latency_s, window_rows)
from llmsim.sim.checkpoints import Checkpoints
from llmsim.sim.result import StopReason
from llmsim.sim.simulate import simulate_whole

SCENARIO = as_scenario("scenarios/llama3-8b-h100-chat.yaml")
NEAR = 21.0           # req/s, near one H100's capacity at the chat SLO: undecided on a first window for some seeds
BELOW = 16.0          # the scenario's own rate: well within it


def window_at(rate: float) -> Window:
    at = variant(SCENARIO, {RATE_KEY: rate})
    return measurement_window(at, rate, typical_latency_s(at, rate), own_floor=False)


def run(rate: float, seed: int, times: int, checkpoints: Checkpoints | None = None):
    """A run over the window at ``rate`` measured ``2^times`` as long."""
    scenario = variant(SCENARIO, {RATE_KEY: rate, "seed": seed, **window_at(rate).longer(times).overrides(rate)})
    return simulate_whole(scenario, force=True, checkpoints=checkpoints)


def rows_of(result) -> pd.DataFrame:
    return pd.DataFrame([{**flatten(summarize(result).to_dict()), "error": ""}])


class Asked:
    """A checkpoint rule that records what it was given and settles at the ``settle_at``-th checkpoint."""

    def __init__(self, settle_at: int | None = None):
        self.settle_at = settle_at
        self.seen: list[tuple] = []

    def __call__(self, scenario, records, start_s, stop_s) -> bool:
        self.seen.append((records, start_s, stop_s, judge(window_rows(scenario, records, start_s, stop_s))))
        return len(self.seen) == self.settle_at


def same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_a_run_no_checkpoint_settles_is_the_whole_run():
    asked = Asked()
    judged = run(NEAR, 42, ESCALATIONS, Checkpoints(ESCALATIONS, asked))
    whole = run(NEAR, 42, ESCALATIONS)
    a, b = flatten(summarize(judged).to_dict()), flatten(summarize(whole).to_dict())
    assert a.keys() == b.keys() and [k for k in a if not same(a[k], b[k])] == []
    # asked at each shorter window, each twice as long as the last, once its requests had all left
    measures = [stop - start for _, start, stop, _ in asked.seen]
    assert len(measures) == ESCALATIONS
    assert np.allclose(np.diff(np.log2(measures)), 1.0)
    assert all((records["status"] != "unfinished").all() and records["arrival_s"].iloc[-1] <= stop
               for records, _, stop, _ in asked.seen)


def test_a_run_settled_at_a_checkpoint_is_measured_over_that_window():
    asked = Asked(settle_at=2)
    result = run(NEAR, 42, ESCALATIONS, Checkpoints(ESCALATIONS, asked))
    _, start, stop, verdict = asked.seen[-1]
    assert result.stopped_by is StopReason.DECIDED
    rows = rows_of(result)
    assert rows["window_s"].iloc[0] == (start, stop)
    assert judge(rows).margins == verdict.margins       # the summary's figures are the ones the stop was judged on
    assert "STOPPED by its SLO verdict being settled on a shorter window" in format_summary(summarize(result).to_dict())


@pytest.mark.parametrize("seed", [42, 43])
def test_the_shorter_window_is_the_fresh_runs_requests_with_consistent_figures(seed):
    asked = Asked(settle_at=1)
    continued = run(BELOW, seed, ESCALATIONS, Checkpoints(ESCALATIONS, asked))
    fresh = run(BELOW, seed, 0)
    n = len(fresh.requests)
    columns = ["arrival_s", "prompt_tokens", "output_tokens"]
    assert continued.requests[columns].iloc[:n].equals(fresh.requests[columns])
    a, b = judge(rows_of(continued)), judge(rows_of(fresh))
    for limit, (margin, spread) in a.margins.items():
        other, other_spread = b.margins[limit]
        # spreads are Z standard errors: the two estimates within Z standard errors of their difference
        assert abs(margin - other) <= math.hypot(spread, other_spread)


class Counted(Progress):
    def __init__(self):
        self.simulations = 0

    def add(self, steps: int) -> None:
        self.simulations += steps

    def advance(self, steps: int = 1) -> None:
        pass

    def note(self, text: str) -> None:
        pass


@pytest.fixture(scope="module")
def escalated():
    """Single-seed points around capacity, judged as recommend's bisection judges them (undecided fails
    measured longer too, so that every verdict has the chance to settle)."""
    points = [{RATE_KEY: rate, "seed": seed} for rate in (BELOW, 20.5, NEAR, 21.5) for seed in (42, 43, 44)]
    rates = [p[RATE_KEY] for p in points]
    counted = Counted()
    with stopping_decided_runs():
        judged = simulate_until_decided(SCENARIO, points, [window_at(r) for r in rates], rates, workers=1,
                                        progress=counted)
    return points, judged, counted


def test_each_point_is_one_run_never_more_requests_than_the_doubling_chain(escalated):
    points, judged, counted = escalated
    assert counted.simulations == len(points)
    assert any(one.window.measure_s > window_at(p[RATE_KEY]).measure_s for p, one in zip(points, judged))
    for point, one in zip(points, judged):
        rate, first = point[RATE_KEY], window_at(point[RATE_KEY])
        reached = round(math.log2(one.window.measure_s / first.measure_s))
        arrived = int(one.rows["requests.arrived"].iloc[0])
        chain = sum(first.longer(j).simulated_requests(rate) for j in range(reached + 1))
        assert arrived <= chain if reached else one.stopped or first.simulated_requests(rate) <= arrived


@pytest.mark.slow
def test_escalated_verdicts_agree_with_a_run_four_times_longer(escalated):
    """Every point measured longer and decided there says what a run four times as long as its longest window
    settles (a point decided on its first window is judged as before: the continued run is not involved)."""
    points, judged, _ = escalated
    compared = 0
    for point, one in zip(points, judged):
        if not one.verdict.decided or one.window.measure_s == window_at(point[RATE_KEY]).measure_s:
            continue
        reference = judge(rows_of(run(point[RATE_KEY], point["seed"], ESCALATIONS + 2)))
        if reference.decided:
            compared += 1
            assert one.verdict.met == reference.met, point
    assert compared >= 2
