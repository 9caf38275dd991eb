"""The cheapest-layout search against brute force: every (replicas, tp, pp) of a small grid simulated."""
from __future__ import annotations

import pytest

from llmsim.scenario.overrides import variant
from llmsim.scenario.scenario import load_scenario
from llmsim.search.layout import cheapest_layout, layouts
from llmsim.search.sweeps import run_points, slo_met

from .helpers import REPO

SEVENTY_B = REPO / "scenarios" / "llama2-70b-8xh100-tp8.yaml"
RATE, REQUESTS, SEEDS = 6.0, 200, [7]
MAX_TP, MAX_PP, MAX_REPLICAS = 4, 3, 3


@pytest.fixture(scope="module")
def scenario():
    own = load_scenario(SEVENTY_B)
    return variant(own, {"workload.num_requests": REQUESTS, "simulation.warmup": None})


def test_layouts_are_the_fitting_splits(scenario):
    found = {(layout.tensor_parallel, layout.pipeline_parallel) for layout, _ in
             layouts(scenario, "H100-SXM", max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)}
    # Llama-2-70B in bf16 is 138 GB of weights: one or two 80 GB devices cannot hold it with room for a request
    assert (1, 1) not in found and (2, 1) not in found and (1, 2) not in found
    assert {(1, 3), (2, 2), (4, 1)} <= found
    assert all(tp * pp >= 3 for tp, pp in found)


@pytest.mark.slow
def test_cheapest_layout_matches_brute_force(scenario):
    options = layouts(scenario, "H100-SXM", max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)
    points = [{**layout.overrides(), "workload.arrival.rate": RATE, "deployment.replicas": n}
              for layout, _ in options for n in range(1, MAX_REPLICAS + 1)]
    rows = run_points(scenario, points, seeds=SEEDS, workers=1, progress=False)
    assert (rows["error"] == "").all()
    rows["met"] = slo_met(rows)
    rows["devices"] = rows["deployment.tensor_parallel"] * rows["deployment.pipeline_parallel"] * rows["deployment.replicas"]
    # the search's premise: more replicas of a layout never turn a pass into a miss
    for _, group in rows.groupby(["deployment.tensor_parallel", "deployment.pipeline_parallel"]):
        met = group.sort_values("deployment.replicas")["met"].tolist()
        assert met == sorted(met)
    passing = rows[rows["met"]]
    assert len(passing) and len(passing) < len(rows)        # the grid has an answer, and it is not trivial
    cheapest_devices = passing["devices"].min()

    choice = cheapest_layout(scenario, "H100-SXM", RATE, seeds=SEEDS, workers=1, max_replicas=MAX_REPLICAS,
                             max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP)
    assert choice.devices == cheapest_devices
    assert choice.usd_per_hour == pytest.approx(cheapest_devices * scenario.hardware.price_per_hour_usd)
    answer = rows[(rows["deployment.tensor_parallel"] == choice.layout.tensor_parallel)
                  & (rows["deployment.pipeline_parallel"] == choice.layout.pipeline_parallel)
                  & (rows["deployment.replicas"] == choice.replicas)]
    assert answer["met"].all()
    assert choice.simulations < len(points)                 # pruning saved simulations
    # the fewest devices that hold the model (the shape llmsim plan places) is not the cheapest here
    fewest = min(options, key=lambda o: (o[0].devices_per_replica, o[0].tensor_parallel))[0]
    of_fewest = passing[(passing["deployment.tensor_parallel"] == fewest.tensor_parallel)
                        & (passing["deployment.pipeline_parallel"] == fewest.pipeline_parallel)]
    assert of_fewest.empty or of_fewest["devices"].min() > cheapest_devices
