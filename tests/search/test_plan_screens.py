"""The searches' analytic screens: what they skip or evaluate first leaves the answers as they were.

- ``analytic_bracket`` evaluates the first counts before the rest: the same bracket as evaluating every
  count at once;

- ``fewest_replicas`` with ``known_failing`` against a threshold verdict (every count from some ``t`` up passes):
  the same answer as without it, and no count up to ``known_failing`` simulated;
- the independent truth for the screen: a count :func:`~llmsim.search.plan.proven_failing` rules out fails
  when simulated, and the layout search skips a layout whose every count worth trying is ruled out.
"""
from __future__ import annotations

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from llmsim.analysis.fluid import FluidModel
from llmsim.scenario.scenario import load_scenario
from llmsim.scenario.variants import variant
from llmsim.search import plan as planning
from llmsim.search.layout import cheapest_layout, layouts
from llmsim.search.window import (Judged, Verdict, Window, measurement_window, simulate_until_decided,
                                  typical_latency_s)

from tests.helpers import REPO

CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"
ONE_LAYOUT = {"hardware": "H100-SXM", "deployment.tensor_parallel": 1, "deployment.pipeline_parallel": 1}


def threshold_search(monkeypatch, threshold: int):
    """fewest_replicas whose simulations are a verdict passing from ``threshold`` replicas up; the counts it
    simulated are recorded."""
    simulated: list[int] = []

    def fake(scenario, points, windows, rates, **kwargs):
        counts = [point["deployment.replicas"] for point in points]
        simulated.extend(counts)
        return [Judged(Verdict(n >= threshold, True, True), pd.DataFrame(), window)
                for n, window in zip(counts, windows)]
    monkeypatch.setattr(planning, "simulate_until_decided", fake)
    monkeypatch.setattr(planning, "measurement_window", lambda *args: Window(1.0, 1.0))
    monkeypatch.setattr(planning, "typical_latency_s", lambda *args: 1.0)
    return simulated


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(threshold=st.integers(1, 12), lower=st.integers(1, 12), start=st.integers(1, 12), cap=st.integers(1, 12),
       known=st.integers(0, 12), workers=st.sampled_from([1, 2, 3]))
def test_known_failing_counts_are_not_simulated_and_the_answer_stays(threshold, lower, start, cap, known, workers):
    scenario = load_scenario(CHAT)
    known = min(known, threshold - 1)           # the bound is a proof: the counts it rules out do fail
    with pytest.MonkeyPatch.context() as monkeypatch:
        simulated = threshold_search(monkeypatch, threshold)
        found, outcomes = planning.fewest_replicas(scenario, {}, 10.0, lower, start, cap, seeds=[1],
                                                   workers=workers, known_failing=known)
        screened = list(simulated)
        simulated.clear()
        plain, _ = planning.fewest_replicas(scenario, {}, 10.0, lower, start, cap, seeds=[1], workers=workers)
    expected = threshold if threshold <= cap else None
    assert found == plain == expected
    assert all(n > known for n in screened)
    if found is not None and found - 1 > known:      # the count below the answer is still confirmed
        assert found - 1 in outcomes


def test_a_count_the_bound_rules_out_fails_when_simulated():
    """The chat scenario on one H100 per replica at 60 requests/s: the bound rules out two replicas, and two
    replicas simulated miss the targets; the layout search, capped at two, skips the layout unsimulated."""
    scenario = load_scenario(CHAT)
    rate = 60.0
    one = variant(scenario, {**ONE_LAYOUT, "deployment.replicas": 1, "workload.arrival.rate": rate})
    too_few = planning.proven_failing(one, rate)
    assert too_few == 2
    point = {**ONE_LAYOUT, "deployment.replicas": too_few, "workload.arrival.rate": rate}
    window = measurement_window(scenario, rate, typical_latency_s(variant(scenario, point), rate))
    judged, = simulate_until_decided(scenario, [point], [window], [rate], seeds=[7], workers=1)
    assert not judged.verdict.met and judged.verdict.decided

    choice = cheapest_layout(scenario, "H100-SXM", rate, seeds=[7], workers=1, max_replicas=too_few,
                             max_tensor_parallel=1, max_pipeline_parallel=1)
    assert choice.layout is None and choice.simulations == 0
    assert "capacity bound rules out 2 replicas" in choice.tried["note"].iloc[0]


def test_no_bound_proves_nothing(monkeypatch):
    """Where the fluid model gives no bound (NaN), no count is ruled out."""
    monkeypatch.setattr(planning, "capacity_bound", lambda one, rate, capacity=None: float("nan"))
    assert planning.proven_failing(load_scenario(CHAT), 60.0) == 0


def every_count_bracket(one, rate: float, max_replicas: int) -> tuple[int, int]:
    """The bracket from every count 1..max_replicas evaluated at once: its definition, written out."""
    counts = np.arange(1, max_replicas + 1)
    frame = FluidModel(one).evaluate(rate / counts)
    plausible = frame["stable"].to_numpy().copy()
    roomy = plausible & (frame["utilisation"].to_numpy() <= planning.ROOMY_UTILISATION)
    for metric, (limit, _) in one.slo.targets().items():
        plausible &= frame[f"{metric}_mean_s"].to_numpy() <= limit
        roomy &= frame[f"{metric}_mean_s"].to_numpy() <= planning.ROOMY_LATENCY * limit
    lower = int(counts[plausible][0]) if plausible.any() else max_replicas
    upper = int(counts[roomy][0]) if roomy.any() else max_replicas
    return lower, max(upper, lower)


def test_the_bracket_is_the_one_every_count_gives():
    """Answers within the first counts, past them, and none within the cap (both ends at the cap)."""
    scenario = load_scenario(CHAT)
    seen = set()
    for layout, one in layouts(scenario, "H100-SXM", max_tensor_parallel=2, max_pipeline_parallel=2):
        for rate, cap in ((5.0, 256), (60.0, 256), (600.0, 256), (600.0, 20), (6000.0, 64)):
            bracket = planning.analytic_bracket(one, rate, cap)
            assert bracket == every_count_bracket(one, rate, cap), (layout.label, rate, cap)
            seen.add("first" if bracket[1] <= planning.FIRST_COUNTS else "past" if bracket[1] < cap else "none")
    assert seen == {"first", "past", "none"}
