"""recommend's expert-parallel degree (step 3b): each degree's setting is a valid scenario with that many GPUs per
replica, the degree chosen is the cheapest per output token among those meeting the SLO at the scenario's rate,
and the rest of the recommendation (its best setting, the printout) is at that degree."""
from __future__ import annotations

import pandas as pd
import pytest

from llmsim.config.progress import QUIET
from llmsim.scenario.variants import variant
from llmsim.search.recommend import OFF, Config, ExpertSearch, _Search, choose_degree, searches_experts
from llmsim.search.sweeps import reusing_runs
from tests.helpers import BASE, make_scenario, merge

# Qwen3-30B-A3B (128 experts) on H200 with two GPUs a node: degrees 1 and 2 are layouts, wider ones need a
# scale-out network the scenario does not give.
MOE = merge(BASE, {"model": "Qwen3-30B-A3B", "hardware": "H200",
                   "deployment": {"expert_parallel": {"degree": 2, "devices_per_node": 2}},
                   "workload": {"num_requests": 80, "arrival": {"rate": 8}},
                   "slo": {"ttft": "1 s", "tpot": "40 ms"}})


def degrees(*rows) -> pd.DataFrame:
    return pd.DataFrame([{"expert_parallel": d, "refused": refused, "devices_per_replica": d,
                          "usd_per_million_output_tokens": usd, "meets_scenario_rate": meets}
                         for d, usd, meets, refused in rows])


def test_the_cheapest_degree_meeting_the_slo_is_chosen_not_the_cheapest():
    table = degrees((1, 0.30, True, ""), (4, 0.20, True, ""), (8, 0.10, False, ""), (16, float("nan"), False, "x"))
    assert choose_degree(table, own=8) == 4
    assert choose_degree(degrees((1, 0.3, False, ""), (8, 0.2, False, "")), own=8) == 8      # none meets: its own
    assert choose_degree(degrees((2, 0.2, True, ""), (4, 0.2, True, "")), own=4) == 2        # equals: fewer GPUs


def test_the_reason_names_the_runner_up_and_what_misses():
    table = degrees((1, 0.30, True, ""), (4, 0.20, True, ""), (8, 0.10, False, ""))
    reason = ExpertSearch(table, 4, 8).reason()
    assert "next, EP 1, costs 50% more" in reason and "EP 8 misses the SLO" in reason


def test_each_degrees_setting_is_a_valid_scenario_with_its_devices():
    scenario = make_scenario(MOE)
    assert searches_experts(scenario)
    one = variant(scenario, Config(OFF, 2048, None, expert_parallel=1).overrides(scenario))
    node = make_scenario(merge(MOE, {"deployment": {"expert_parallel": {"devices_per_node": 8}}}))
    four = variant(node, Config(OFF, 2048, None, expert_parallel=4).overrides(node))
    assert one.deployment.expert_parallel is None and one.devices_per_replica == 1
    assert four.deployment.expert_parallel.degree == 4 and four.devices_per_replica == 4
    assert not searches_experts(make_scenario(BASE))                     # a dense model has no experts to spread


@pytest.mark.slow
def test_the_search_at_each_degree_ranks_the_chosen_degree_first():
    """Degrees 1 and 2 are simulated and their costs compared; 4 and up are reported as no layout here; the
    search's best setting is at the chosen degree, which is the cheapest of the two per output token."""
    scenario = make_scenario(MOE)
    with reusing_runs():
        search = _Search(scenario, [11, 12], "goodput", 2, 0.5, QUIET)
        experts = search.experts(Config(OFF, 2048, None))
    table = experts.table.set_index("expert_parallel")
    assert list(table.index[table["refused"] == ""]) == [1, 2]
    assert table.loc[4:, "refused"].str.contains("scale-out").all()
    simulated = table.loc[[1, 2]]
    assert simulated["meets_scenario_rate"].all()
    cheapest = int(simulated["usd_per_million_output_tokens"].idxmin())
    assert experts.chosen == cheapest
    assert search.table()["expert_parallel"].iloc[0] == cheapest
    assert f"chose EP {cheapest}" in experts.text()
