"""`plan` searches each chip's layouts by default: its answer costs what a brute-force enumeration of
every (replicas, tensor parallel, pipeline parallel) of a small grid finds cheapest, where keeping the
scenario's own layout (tp2 x pp2 here, as the 70B scenario keeps tp8) overpays."""
from __future__ import annotations

import pytest

import llmsim
from llmsim.cli.main import main
from llmsim.scenario.variants import variant
from llmsim.scenario.scenario import load_scenario
from llmsim.search.window import measurement_window, simulate_until_decided, typical_latency_s
from tests.helpers import REPO

SHORT_TURNS = REPO / "scenarios" / "llama3-8b-h100-short-turns.yaml"
RATE, SEEDS = 150.0, [42]          # one H100 serves about 100 req/s of short turns: one tp1 replica is too few
MAX_TP, MAX_PP, MAX_REPLICAS = 2, 2, 3
OWN = {"deployment.tensor_parallel": 2, "deployment.pipeline_parallel": 2}


@pytest.fixture(scope="module")
def scenario():
    return variant(load_scenario(SHORT_TURNS), OWN)


def brute_force_devices(scenario) -> int:
    """The fewest devices of any passing point of the grid, every point simulated and judged as plan does."""
    points = [{"deployment.tensor_parallel": tp, "deployment.pipeline_parallel": pp, "deployment.replicas": n,
               "workload.arrival.rate": RATE}
              for tp in range(1, MAX_TP + 1) for pp in range(1, MAX_PP + 1) for n in range(1, MAX_REPLICAS + 1)]
    windows = [measurement_window(scenario, RATE, typical_latency_s(variant(scenario, p), RATE)) for p in points]
    judged = simulate_until_decided(scenario, points, windows, [RATE] * len(points), seeds=SEEDS, workers=2)
    passing = [p["deployment.tensor_parallel"] * p["deployment.pipeline_parallel"] * p["deployment.replicas"]
               for p, j in zip(points, judged) if j.verdict.met]
    assert passing and min(passing) < MAX_TP * MAX_PP * MAX_REPLICAS      # an answer, and not the largest point
    return min(passing)


def test_plan_finds_the_cheapest_layout_where_keeping_the_scenarios_overpays(scenario):
    cheapest = brute_force_devices(scenario)
    searched = llmsim.plan(scenario, RATE, seeds=SEEDS, workers=2, max_replicas=MAX_REPLICAS,
                           max_tensor_parallel=MAX_TP, max_pipeline_parallel=MAX_PP).iloc[0]
    kept = llmsim.plan(scenario, RATE, seeds=SEEDS, workers=2, max_replicas=MAX_REPLICAS, keep_layout=True).iloc[0]
    price = scenario.hardware.price_per_hour_usd
    assert searched["devices"] == cheapest and searched["usd_per_hour"] == pytest.approx(cheapest * price)
    tp, pp = (int(part[2:]) for part in searched["placement"].split(" x "))
    assert searched["devices"] == searched["replicas"] * tp * pp and bool(searched["layout_search"])
    assert kept["placement"] == "tp2 x pp2" and not kept["layout_search"]
    assert kept["usd_per_hour"] > searched["usd_per_hour"]


def test_the_cli_says_which_layout_each_row_uses(scenario, tmp_path, capsys):
    path = tmp_path / "own-layout.yaml"
    text = SHORT_TURNS.read_text().replace("hardware: H100-SXM", "hardware: H100-SXM\ndeployment: "
                                           "{tensor_parallel: 2, pipeline_parallel: 2}")
    path.write_text(text)
    assert main(["plan", str(path), "--target-rate", "40", "--keep-layout", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "layout: the scenario's (--keep-layout)" in out and "tp2 x pp2" in out
