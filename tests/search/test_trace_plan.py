"""Plans and recommendations on a replayed trace: its time scale is the rate knob (issue 14)."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim import generate_trace
from llmsim.cli.recommend import format_recommendation
from llmsim.search.recommend import recommend, replays_one_trace
from llmsim.search.layout import plan
from llmsim.scenario.variants import RATE_KEY
from llmsim.scenario.variants import variant
from llmsim.search.window import measurement_window
from llmsim.workload.trace_transforms import mean_rate_per_s
from tests.helpers import make_scenario


def _base(path) -> dict:
    return {"name": "trace-plan", "seed": 0, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
            "engine": {"max_model_len": 16384},
            "workload": {"arrival": {"process": "trace", "path": str(path), "filter": {"model": "ChatGPT"}}},
            "slo": {"ttft": "1 s", "tpot": "50 ms"}}


def trace_scenario(tmp_path, n: int = 300):
    rng = np.random.default_rng(5)
    times = np.cumsum(rng.gamma(0.5, 2.0, n))                 # bursty: CV 1.4, about 1 request/s
    path = tmp_path / "BurstGPT.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{t:.3f},{'ChatGPT' if i % 4 else 'GPT-4'},{200 + i % 300},{20 + i % 50},0,API log\n"
        for i, t in enumerate(times)))
    return make_scenario(base=_base(path))


def test_the_rate_knob_rescales_the_whole_trace(tmp_path):
    scenario = trace_scenario(tmp_path)
    own = scenario.workload.arrival.rate_per_s
    assert own == pytest.approx(mean_rate_per_s(generate_trace(scenario.workload, 0).arrival_s))
    doubled = variant(scenario, {RATE_KEY: 2 * own})
    base, fast = generate_trace(scenario.workload, 0), generate_trace(doubled.workload, 0)
    assert len(fast) == len(base) == 225                      # the GPT-4 quarter filtered out
    np.testing.assert_allclose(np.diff(fast.arrival_s), np.diff(base.arrival_s) / 2, rtol=1e-12)
    window = measurement_window(doubled, 2 * own, latency_s=0.5)
    assert window.whole_trace and window.simulated_requests(2 * own) == 225
    assert "workload.num_requests" not in window.overrides(2 * own)


@pytest.mark.slow
def test_plan_on_a_trace_says_what_it_replays(tmp_path):
    scenario = trace_scenario(tmp_path)
    table = plan(scenario, 6.0, seeds=[0], workers=1, keep_layout=True)
    assert table["replicas"].iloc[0] >= 1
    assert "model in ChatGPT" in table["replayed"].iloc[0] and "rescaled to 6/s" in table["replayed"].iloc[0]
    assert table["requests_per_simulation"].iloc[0] == 225


def test_an_unsampled_trace_leaves_nothing_to_the_seed(tmp_path):
    """The premise of one replication: replayed as it is, every seed gives the same requests; with
    ``sample:`` or speculation the seed matters again, and recommend keeps its seeds."""
    scenario = trace_scenario(tmp_path)
    first, second = generate_trace(scenario.workload, 0), generate_trace(scenario.workload, 1)
    assert np.array_equal(first.arrival_s, second.arrival_s) and np.array_equal(first.prompt_tokens,
                                                                                second.prompt_tokens)
    assert replays_one_trace(scenario)
    sampled = make_scenario({"workload": {"arrival": {"sample": 0.5}}}, base=_base(tmp_path / "BurstGPT.csv"))
    assert not np.array_equal(generate_trace(sampled.workload, 0).arrival_s,
                              generate_trace(sampled.workload, 1).arrival_s)
    assert not replays_one_trace(sampled)
    assert not replays_one_trace(make_scenario())                      # synthetic arrivals


@pytest.mark.slow
def test_recommend_on_an_unsampled_trace_runs_one_replication_and_gives_no_interval(tmp_path):
    """Two seeds on the same replayed requests would agree exactly and report a zero-width interval;
    recommend runs one and says that no interval is available."""
    scenario = trace_scenario(tmp_path, n=80)
    rec = recommend(scenario, seeds=2, top=1, workers=1, tolerance=0.3)     # coarse: the interval is the point
    assert all(len(rates) == 1 for rates in rec.table["per_seed_rates"])
    assert rec.table["max_rate_per_s.ci95"].isna().all() and np.isnan(rec.improvement_ci95)
    text = format_recommendation(rec, scenario)
    assert "no confidence interval is available" in text and "+- nan" not in text
