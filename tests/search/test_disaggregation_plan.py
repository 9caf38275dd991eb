"""Aggregated against disaggregated layouts: the verdict names the cheapest layout meeting the SLO and the
reason the other kind lost (checked on tables built by hand), ratios are read strictly, and a comparison
runs every layout on the same requests."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from llmsim.errors import ConfigError
from llmsim.search.disaggregation import compare_layouts, parse_ratios, verdict
from tests.helpers import make_scenario

SLO = {"slo": {"ttft": "1 s", "tpot": "40 ms"}}


def layouts(*rows) -> pd.DataFrame:
    columns = ["kind", "layout", "usd_per_hour", "ttft_p95_s", "tpot_p95_s", "slo_attainment", "slo_met",
               "ttft_attainment", "ttft_percentile", "tpot_attainment", "tpot_percentile"]
    return pd.DataFrame([dict(zip(columns, row)) for row in rows]).sort_values("usd_per_hour", kind="stable")


def scenario():
    return make_scenario(SLO)


def test_disaggregation_wins_when_the_cheaper_aggregated_layouts_miss_tpot():
    table = layouts(("aggregated", "2 x TP4", 20.0, 0.8, 0.055, 0.5, False, 0.99, 95, 0.5, 95),
                    ("disaggregated", "2P1D", 30.0, 0.9, 0.021, 1.0, True, 1.0, 95, 1.0, 95),
                    ("aggregated", "3 x TP4", 30.1, 0.7, 0.039, 0.97, True, 1.0, 95, 0.97, 95))
    line = verdict(table, scenario())
    assert line.startswith("disaggregated wins: 2P1D meets the SLO for 30.00 USD/h")
    assert "aggregated needs 3 x TP4 for 30.10 USD/h" in line
    assert "TPOT within 40 ms for 50% of requests (target 95%) (2 x TP4)" in line


def test_aggregation_wins_when_no_ratio_meets_ttft():
    table = layouts(("aggregated", "1 x TP8", 20.0, 0.5, 0.03, 1.0, True, 1.0, 95, 1.0, 95),
                    ("disaggregated", "1P1D", 20.5, 3.0, 0.02, 0.4, False, 0.4, 95, 1.0, 95))
    line = verdict(table, scenario())
    assert line.startswith("aggregated wins: 1 x TP8")
    assert "no disaggregated layout tried meets it (1P1D misses TTFT within 1,000 ms for 40%" in line


def test_no_layout_meeting_the_slo_is_said_so():
    table = layouts(("aggregated", "1 x TP8", 20.0, 3.0, 0.05, 0.1, False, 0.2, 95, 0.3, 95),
                    ("disaggregated", "1P1D", 20.0, 0.5, 0.06, 0.2, False, 1.0, 95, 0.2, 95))
    assert verdict(table, scenario()).startswith("no layout meets the SLO: the closest, 1P1D (disaggregated)")


def test_ratios_are_read_strictly():
    assert parse_ratios("1P1D, 2p1d,3P2D") == [(1, 1), (2, 1), (3, 2)]
    for bad in ("1P", "0P1D", "2:1", "1P1D;2P1D"):
        with pytest.raises(ConfigError) as error:
            parse_ratios(bad)
        assert error.value.key == "ratios"


def test_a_comparison_simulates_each_layout_on_the_same_requests():
    split = {"deployment": {"replicas": 1, "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                                             "link": "nvlink4"}},
             "workload": {"num_requests": 60}, **SLO}
    comparison = compare_layouts(make_scenario(split), 2.0, [(1, 1), (2, 1)])
    table = comparison.table
    assert sorted(table["layout"]) == ["1 x H100-SXM TP1", "1P1D", "2 x H100-SXM TP1", "2P1D",
                                       "3 x H100-SXM TP1"]
    assert (table["usd_per_hour"].diff().dropna() >= 0).all()
    # Each pool's devices at the H100 profile's price: 1P1D costs what two aggregated replicas cost.
    by_layout = table.set_index("layout")["usd_per_hour"]
    assert by_layout["1P1D"] == pytest.approx(by_layout["2 x H100-SXM TP1"])
    assert comparison.verdict


def test_on_several_seeds_each_layout_gets_its_mean_an_interval_and_met_only_if_every_seed_met():
    """Two seeds: each layout's figures are the means of the one-seed comparisons, the intervals the Student-t
    half-width of two values (t(0.975, 1) x |a - b| / 2), and the SLO is met only where both seeds met it."""
    split = {"deployment": {"replicas": 1, "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                                             "link": "nvlink4"}},
             "workload": {"num_requests": 60}, **SLO}
    scenario = make_scenario(split)
    args = (2.0, [(1, 1)], 2)
    both = compare_layouts(scenario, *args, seeds=[3, 4]).table.set_index("layout")
    one = [compare_layouts(scenario.with_seed(seed), *args).table.set_index("layout") for seed in (3, 4)]
    assert one[0]["tpot_p95_s.ci95"].isna().all()               # one seed: no interval
    t = 12.706204736174707                                     # Student-t 97.5% point, one degree of freedom
    for column in ("ttft_p95_s", "tpot_p95_s", "slo_attainment"):
        a, b = one[0][column], one[1][column]
        np.testing.assert_allclose(both[column], (a + b) / 2, rtol=1e-12)
        np.testing.assert_allclose(both[f"{column}.ci95"], t * (a - b).abs() / 2, rtol=1e-9)
    assert (both["slo_met"] == (one[0]["slo_met"] & one[1]["slo_met"])).all()
    assert (both["seeds"] == 2).all()
