"""A search sizes each probe's window on the fluid model of the probe's setting, built once per setting and
evaluated at every rate and seed it is probed at (``_Search._setting_fluid``). That is sound only because a model
of a workload with length laws of its own reads neither the arrival rate nor the seed: checked here against the
plain path, a model built from the probe's own scenario, figure for figure."""
from __future__ import annotations

import pandas as pd
import pytest

from llmsim.analysis.fluid import has_length_law
from llmsim.analysis.fluid_disaggregated import fluid_model
from llmsim.scenario.variants import RATE_KEY, variant
from llmsim.search.plan import as_scenario
from llmsim.search.window import typical_latency_s

# (scenario, a setting's overrides): plain, speculative (adaptive and static k), disaggregated, multi-replica.
CASES = [
    ("scenarios/llama3-8b-h100-chat.yaml", {"engine.max_batch_tokens": 1024}),
    ("scenarios/llama3-70b-h100-speculative.yaml", {}),
    ("scenarios/llama3-70b-h100-speculative.yaml",
     {"engine.max_batch_tokens": 1235, "speculation.k": 1, "speculation.policy": "static"}),
    ("scenarios/llama3-8b-h100-eagle-tree.yaml", {}),
    ("scenarios/llama3-70b-disagg-h100.yaml", {}),
    ("scenarios/llama2-70b-8xh100-tp8.yaml", {}),
]


@pytest.mark.parametrize(("path", "setting"), CASES)
def test_one_model_per_setting_serves_every_rate_and_seed(path, setting):
    scenario = as_scenario(path)
    assert has_length_law(scenario.workload)
    shared = fluid_model(variant(scenario, setting))
    own_rate = scenario.workload.rate_per_s
    for factor, seed in [(0.3, 1), (1.0, 2), (1.7, 3), (6.0, 4)]:
        rate = own_rate * factor
        at_rate = variant(scenario, {**setting, RATE_KEY: f"{rate!r}/s", "seed": seed})
        assert at_rate.workload.rate_per_s == rate
        rates = [rate, 2 * rate]
        pd.testing.assert_frame_equal(shared.evaluate(rates), fluid_model(at_rate).evaluate(rates), check_exact=True)
        assert typical_latency_s(at_rate, rate, shared) == typical_latency_s(at_rate, rate)
