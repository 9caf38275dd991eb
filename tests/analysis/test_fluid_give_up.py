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


def test_rates_without_a_step_time_are_unstable_rows_and_leave_the_others_alone():
    scenario = as_scenario(SPECULATIVE)
    model = FluidModel(scenario)
    limits = {"ttft": 2.0, "tpot": 0.06}
    rates = scenario.workload.rate_per_s * np.geomspace(0.05, 20, 24)
    frame = model.evaluate(rates, limits, ttft_percentile=95)
    gone = ~np.isfinite(frame["step_time_s"].to_numpy())
    assert 0 < gone.sum() < len(rates)
    rows = frame[gone]
    assert not rows["stable"].any()
    for column in ("batch_size", "in_system", "utilisation", "ttft_mean_s", "tpot_mean_s", "e2e_mean_s",
                   "ttft_percentile_s"):
        assert np.isinf(rows[column]).all()
    assert rows["output_tokens_per_s"].isna().all()
    # What the frame's other rows rest on: a row of no load (where such a rate's step time stood as 0) changes
    # no other row's figures, bit for bit, the Poisson counts' truncation included.
    work = model.works[0]
    lam = rates[~gone] / model.engines
    tau = frame["step_time_s"].to_numpy()[~gone]
    alone = model._stable_rows(lam, tau, work, 95)
    beside = model._stable_rows(np.concatenate([lam, rates[gone] / model.engines]),
                                np.concatenate([tau, np.zeros(gone.sum())]), work, 95)
    for name, values in alone.items():
        np.testing.assert_array_equal(values, beside[name][:len(lam)])


def test_a_batch_given_up_at_no_load_is_not_solved_further(monkeypatch):
    # A give-up bound below any step time: the bracket's lower end, g(0), already passes it for every rate, so
    # the solve prices g(0) alone and gives every rate up; without the bound the same rates are solved.
    scenario = as_scenario(CHAT)
    model = FluidModel(scenario)
    work = model.works[0]
    lam = scenario.workload.rate_per_s * np.array([0.5, 1.0]) / model.engines
    priced = []
    real = model._mean_step
    monkeypatch.setattr(model, "_mean_step", lambda *args: priced.append(1) or real(*args))
    assert np.isinf(model._solve(lam, work, np.full_like(lam, 1e-9))).all()
    assert len(priced) == 1
    priced.clear()
    assert np.isfinite(model._solve(lam, work)).all()
    assert len(priced) > 1
