"""Plans and recommendations on a replayed trace: its time scale is the rate knob (issue 14)."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim import generate_trace
from llmsim.search.plan import RATE_KEY, plan
from llmsim.scenario.overrides import variant
from llmsim.search.window import measurement_window
from llmsim.workload.trace_transforms import mean_rate_per_s
from tests.helpers import make_scenario


def trace_scenario(tmp_path, n: int = 300):
    rng = np.random.default_rng(5)
    times = np.cumsum(rng.gamma(0.5, 2.0, n))                 # bursty: CV 1.4, about 1 request/s
    path = tmp_path / "BurstGPT.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{t:.3f},{'ChatGPT' if i % 4 else 'GPT-4'},{200 + i % 300},{20 + i % 50},0,API log\n"
        for i, t in enumerate(times)))
    base = {"name": "trace-plan", "seed": 0, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
            "engine": {"max_model_len": 16384},
            "workload": {"arrival": {"process": "trace", "path": str(path), "filter": {"model": "ChatGPT"}}},
            "slo": {"ttft": "1 s", "tpot": "50 ms"}}
    return make_scenario(base=base)


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
    table = plan(scenario, 6.0, seeds=[0], workers=1)
    assert table["replicas"].iloc[0] >= 1
    assert "model in ChatGPT" in table["replayed"].iloc[0] and "rescaled to 6/s" in table["replayed"].iloc[0]
    assert table["requests_per_simulation"].iloc[0] == 225
