"""Figures from a bisection are never finer than its step: the headroom is bisected until its step is
below the headroom (or given as a range), and intervals across seeds are at least the step."""
from __future__ import annotations

import math

import numpy as np
import pytest

from llmsim.report.build import headroom_words
from llmsim.report.document import plus_minus
from llmsim.search.recommend import Recommendation, _ci
from llmsim.search.sustainable_rate import bisect


def threshold(breaking: float):
    calls = []

    def meets(rate: float) -> bool:
        calls.append(rate)
        return rate <= breaking
    return meets, calls


@pytest.mark.parametrize("headroom", [0.063, 0.03, 0.15, 0.41])
def test_bisection_goes_on_until_its_step_is_below_the_headroom(headroom):
    target = 100.0
    meets, _ = threshold(target * (1 + headroom))
    passing, failing = bisect(meets, lo=target, hi=2 * target, tol=0.1 * target, above=target,
                              finest=0.0125 * target)
    assert passing <= target * (1 + headroom) < failing            # the bracket holds the truth
    step = failing - passing
    assert step <= 0.1 * target
    assert step < passing - target                                  # finer than the headroom it gives
    assert abs((passing / target - 1) - headroom) < headroom       # so the figure is right to within itself


def test_a_headroom_below_the_finest_step_is_given_as_a_range():
    target = 100.0
    meets, _ = threshold(target * 1.004)
    passing, failing = bisect(meets, lo=target, hi=1.25 * target, tol=0.1 * target, above=target,
                              finest=0.0125 * target)
    assert failing - passing <= 0.0125 * target
    text = headroom_words(passing, failing, target)
    assert " to " in text and "step" in text
    low, high = (float(part.rstrip("%")) / 100 for part in text.split(" (")[0].split(" to "))
    assert low <= 0.004 <= high


def test_without_a_reference_the_bisection_stops_at_its_tolerance():
    meets, calls = threshold(106.0)
    passing, failing = bisect(meets, lo=100.0, hi=125.0, tol=10.0)
    assert failing - passing <= 10.0 and passing <= 106.0 < failing
    assert len(calls) == 2 + 2           # both ends, then 25 -> 12.5 -> 6.25


def test_a_resolved_headroom_is_one_figure():
    assert headroom_words(131.0, 133.0, 100.0) == "31%"
    assert headroom_words(106.0, 106.5, 100.0) == "6.0%"


def test_seeds_that_agree_to_the_bracket_get_the_bracket_not_zero():
    rates = np.array([156.0, 156.0])
    assert _ci(rates) == 0.0                        # their spread alone says +- 0 ...
    assert _ci(rates, 0.1 * 156.0) == pytest.approx(15.6)   # ... the bisection's step says +- 10%
    spread = np.array([150.0, 170.0])
    assert _ci(spread, 1.0) > 1.0                   # a real spread wins over a fine step
    assert math.isnan(_ci(np.array([156.0]), 1.0))  # one seed: no interval


def test_plus_minus_never_prints_zero():
    assert "± 0" not in plus_minus(156.0, 0.0)
    assert "n/a" in plus_minus(156.0, 0.0)
    assert plus_minus(156.0, 12.0) == "156 ± 12.0"


def _recommendation(improvement: float, ci: float) -> Recommendation:
    return Recommendation(best=None, table=None, defaults=None, at_scenario_rate=None, objective="goodput",
                          improvement=improvement, improvement_ci95=ci, analytic=None, runtime_s=0.0)


def test_a_gain_within_its_interval_is_called_not_significant():
    assert "is not significant" in _recommendation(0.073, 0.09).gain_verdict
    assert "is significant" in _recommendation(0.073, 0.05).gain_verdict
    assert "no interval" in _recommendation(0.073, math.nan).gain_verdict
