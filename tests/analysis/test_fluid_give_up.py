"""The fluid model's early give-up (``evaluate(rates, mean_limits_s)``): a rate is given up only where the full
solve finds it unstable or missing a limit on a mean, so which rates meet the limits is unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim.analysis.fluid import FluidModel
from llmsim.scenario.variants import variant
from llmsim.search.plan import as_scenario

SPECULATIVE = "scenarios/llama3-70b-h100-speculative.yaml"
CHAT = "scenarios/llama3-8b-h100-chat.yaml"


def meets(frame, limits: dict[str, float]) -> np.ndarray:
    ok = frame["stable"].to_numpy().copy()
    for metric, limit in limits.items():
        ok &= frame[f"{metric}_mean_s"].to_numpy() <= limit
    return ok


@pytest.mark.parametrize("path, point, limits", [
    (SPECULATIVE, {}, {"ttft": 2.0, "tpot": 0.06}),
    (SPECULATIVE, {"speculation.policy": "goodput"}, {"tpot": 0.05, "e2e": 20.0}),
    (CHAT, {}, {"ttft": 0.5, "e2e": 8.0}),
    (CHAT, {"engine.max_batch_tokens": 512}, {"ttft": 1.0}),  # no TPOT or E2E limit: stability alone
])
def test_giving_up_keeps_which_rates_meet_the_limits(path, point, limits):
    scenario = variant(as_scenario(path), point)
    model = FluidModel(scenario)
    rates = scenario.workload.rate_per_s * np.geomspace(0.05, 20, 24)
    full = model.evaluate(rates)
    given_up = model.evaluate(rates, limits)
    np.testing.assert_array_equal(meets(given_up, limits), meets(full, limits))
    # Some rates pass and some fail, or the comparison proves little.
    assert 0 < meets(full, limits).sum() < len(rates)
    # Where the full solve's step time passes the bound, the rate misses a limit or is unstable (the bound
    # is sound), and the rates given up are exactly those.
    for work in model.works:
        lam = rates / model.engines
        bound = model._give_up_s(lam, work, limits)
        solved = model._evaluate(rates, work)
        past = solved["step_time_s"].to_numpy() > bound
        assert not meets(solved, limits)[past].any()
        assert past.any()
