"""The report's replica searches (peak, sensitivity) against a threshold verdict: every count from some ``t`` up
passes. The answer is ``t`` however far it lies from the recommended count, a count the fluid model's capacity
bound rules out is never simulated, and the recommended count's runs are there for the sensitivity table unless
the bound rules it out too (the table then judges it on its own)."""
from __future__ import annotations

import pandas as pd

from llmsim.report.build import ReportBuilder, traffic_from_rate
from llmsim.scenario.variants import RATE_KEY, REPLICAS_KEY, variant
from llmsim.search import plan as planning
from llmsim.search.window import Judged, Verdict, Window

from tests.helpers import REPO

CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"
LAYOUT = {"hardware": "H100-SXM", "deployment.tensor_parallel": 1, "deployment.pipeline_parallel": 1}
RATE, RECOMMENDED = 60.0, 3


def test_the_fewest_passing_count_is_found_without_simulating_ruled_out_counts(monkeypatch):
    builder = ReportBuilder(CHAT, traffic_from_rate(RATE), hardware=["H100-SXM"], seeds=[1, 2], workers=1)
    builder.config, builder.replicas = dict(LAYOUT), RECOMMENDED
    simulated: list[int] = []
    threshold = 0

    def fake(scenario, points, windows, rates, **kwargs):
        counts = [point[REPLICAS_KEY] for point in points]
        simulated.extend(counts)
        return [Judged(Verdict(n >= threshold, True, True), pd.DataFrame(), window)
                for n, window in zip(counts, windows)]
    monkeypatch.setattr(planning, "simulate_until_decided", fake)
    monkeypatch.setattr(planning, "measurement_window", lambda *args: Window(1.0, 1.0))
    checked = set()
    for rate in (40.0, 60.0, 72.0):          # the bound rules out 1, 2 and 3 replicas
        too_few = planning.proven_failing(variant(builder.scenario, {**LAYOUT, RATE_KEY: rate, REPLICAS_KEY: 1}),
                                          rate)
        assert too_few >= 1
        for threshold in range(too_few + 1, 9):     # the bound is a proof: a count it rules out cannot pass
            simulated.clear()
            found, at_recommended = builder._replicas_at({RATE_KEY: rate}, around=RECOMMENDED)
            assert found == threshold
            assert simulated and all(n > too_few for n in simulated)
            assert (at_recommended is not None) == (too_few < RECOMMENDED)
            checked.add((rate, threshold))
    assert len(checked) == 7 + 6 + 5
