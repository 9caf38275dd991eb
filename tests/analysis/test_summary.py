"""The typed summary: its mapping is the run's summary key for key, and every metric name is a column."""
from __future__ import annotations

import json
import math

import pytest

import llmsim
from llmsim.analysis import names
from llmsim.analysis.metrics import summarize
from llmsim.analysis.summary import RunSummary, SpeculationSummary

from tests.helpers import make_scenario


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


@pytest.fixture(scope="module", params=["plain", "speculative"])
def result(request):
    changes = {"slo": {"ttft": "200 ms", "tpot": "15 ms", "percentile": {"ttft": 99, "tpot": 90}},
               "workload": {"arrival": {"rate": 20.0}, "num_requests": 400}}
    if request.param == "speculative":
        changes["speculation"] = {"draft": "Llama-3.2-1B", "k": 3, "acceptance": {"process": "bernoulli", "alpha": 0.7}}
    return llmsim.simulate(make_scenario(changes))


def test_the_typed_summary_is_the_summary_mapping_key_for_key(result):
    record = llmsim.summarize(result)
    assert isinstance(record, RunSummary)
    assert isinstance(record.speculation, SpeculationSummary) == result.scenario.speculating
    summary = summarize(result).to_dict()
    assert json.dumps(record.to_dict()) == json.dumps(summary)        # same keys, same order, same values
    flat = llmsim.flatten(summary)
    assert list(record.flat()) == list(flat)
    assert all(_same(flat[key], value) for key, value in record.flat().items())
    # Typed access reads the same figures as the mapping.
    assert record.latency.tpot_s.p95 == summary["latency"]["tpot_s"]["p95"]
    assert record.slo.targets["ttft"].percentile == 99 and record.slo.targets["tpot"].percentile == 90
    assert record.slo.met == summary["slo"]["met"]
    assert "e2e_attainment" not in summary["slo"]              # only the limits set have targets


def test_every_metric_name_is_a_column_of_a_flattened_summary(result):
    flat = llmsim.flatten(summarize(result).to_dict())
    missing = [name for name in names.SUMMARY_NAMES if name not in flat]
    assert not missing
    for metric in result.scenario.slo.targets():
        assert names.slo_attainment(metric) in flat and names.slo_percentile(metric) in flat


def test_a_sweep_row_adds_output_tokens_per_dollar(result):
    from llmsim.search.sweeps import HIDDEN, run_points, simulate_point

    row = simulate_point(result.scenario)
    flat = llmsim.flatten(summarize(result).to_dict())
    # and, for reusing_runs, the run's longest wait, queue timeout and eligibility rule, which no row of run_points
    # shows
    assert set(row) - set(flat) == {names.OUTPUT_TOKENS_PER_USD, *HIDDEN}
    assert not set(HIDDEN) & set(run_points(result.scenario, [{}], workers=1).columns)
    assert row[names.OUTPUT_TOKENS_PER_USD] == pytest.approx(
        row[names.OUTPUT_TOKENS_PER_S] * 3600 / row[names.USD_PER_HOUR])
