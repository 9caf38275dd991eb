"""The cheapest-layout search against brute force: every (replicas, tp, pp) of a small grid simulated.

Brute force judges every point the way plan does (a window that follows the point's load, a
verdict with its uncertainty: :mod:`llmsim.search.window`), without the search's ordering,
analytic bounds or pruning, and its cheapest passing deployment must cost what the search finds.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from llmsim.scenario.variants import variant
from llmsim.scenario.scenario import load_scenario
from llmsim.search.layout import Layout, cheapest_layout, layouts
from llmsim.search.window import measurement_window, simulate_until_decided, typical_latency_s

from tests.helpers import REPO, make_scenario

SMALL = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
SEVENTY_B = REPO / "scenarios" / "llama2-70b-8xh100-tp8.yaml"
RATE, SEEDS = 200.0, [42]      # one H100 serves about 100 req/s of short turns: the grid has misses
MAX_TP, MAX_PP, MAX_REPLICAS = 2, 2, 3


def test_layouts_are_the_fitting_splits():
    seventy = load_scenario(SEVENTY_B)
    found = {(layout.tensor_parallel, layout.pipeline_parallel) for layout, _ in
             layouts(seventy, "H100-SXM", max_tensor_parallel=4, max_pipeline_parallel=3)}
    # Llama-2-70B in bf16 is 138 GB of weights: one H100 (81,559 MiB, 0.9 of it usable: 77 GB) cannot hold it
    # with room for a request; two (154 GB) can, split either way
    assert (1, 1) not in found
    assert {(1, 2), (2, 1), (1, 3), (2, 2), (4, 1)} <= found
    assert all(tp * pp >= 2 for tp, pp in found)
    small = load_scenario(SMALL)            # 8B fits one H100: every split up to tp 2 x pp 2
    assert {(layout.tensor_parallel, layout.pipeline_parallel) for layout, _ in
            layouts(small, "H100-SXM", max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)} == \
        {(1, 1), (1, 2), (2, 1), (2, 2)}


@pytest.mark.slow
def test_cheapest_layout_matches_brute_force():
    scenario = load_scenario(SMALL)
    options = layouts(scenario, "H100-SXM", max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)
    points = [{**layout.overrides(), "workload.arrival.rate": RATE, "deployment.replicas": n}
              for layout, _ in options for n in range(1, MAX_REPLICAS + 1)]
    windows = [measurement_window(scenario, RATE, typical_latency_s(variant(scenario, p), RATE)) for p in points]
    judged = simulate_until_decided(scenario, points, windows, [RATE] * len(points), seeds=SEEDS, workers=2)
    met = {(p["deployment.tensor_parallel"], p["deployment.pipeline_parallel"], p["deployment.replicas"]):
           j.verdict.met for p, j in zip(points, judged)}
    # the search's premise: more replicas of a layout never turn a pass into a miss
    for layout, _ in options:
        row = [met[(layout.tensor_parallel, layout.pipeline_parallel, n)] for n in range(1, MAX_REPLICAS + 1)]
        assert row == sorted(row), (layout.label, row)
    passing = [tp * pp * n for (tp, pp, n), ok in met.items() if ok]
    assert passing and len(passing) < len(met)              # the grid has an answer, and it is not trivial
    cheapest_devices = min(passing)

    choice = cheapest_layout(scenario, "H100-SXM", RATE, seeds=SEEDS, workers=2, max_replicas=MAX_REPLICAS,
                             max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)
    assert choice.devices == cheapest_devices
    assert choice.usd_per_hour == pytest.approx(cheapest_devices * scenario.hardware.price_per_hour_usd)
    assert met[(choice.layout.tensor_parallel, choice.layout.pipeline_parallel, choice.replicas)]
    assert choice.simulations < len(points)                 # pruning saved simulations


def test_a_layout_on_another_chip_keeps_a_change_made_with_replace():
    """plan's layouts on another chip: before, the chip was laid over the YAML mapping, which refused a scenario
    changed with dataclasses.replace (ValueError); now the change stays and the chip is read as in a file."""
    scenario = make_scenario()
    changed = replace(scenario, engine=replace(scenario.engine, max_num_seqs=64))
    shape = Layout("H200", 2, 1, 2, 1.0)
    got = variant(changed, {**shape.overrides(), "deployment.replicas": 1})
    assert got == make_scenario({"hardware": "H200", "engine": {"max_num_seqs": 64},
                                 "deployment": {"tensor_parallel": 2, "pipeline_parallel": 1, "replicas": 1}})
