"""With an SLO per traffic class and none at top level, the fluid scan (``analytic_rate``) and the window's
typical latency (``typical_latency_s``) hold the shared engine to the strictest class's limits."""
from __future__ import annotations

import pytest

from llmsim.analysis.fluid import FluidModel
from llmsim.search.recommend import analytic_rate
from llmsim.search.window import mean_output_tokens, typical_latency_s
from tests.helpers import BASE, make_scenario

LENGTHS = {"prompt_tokens": BASE["workload"]["prompt_tokens"], "output_tokens": BASE["workload"]["output_tokens"]}
# Two classes with the same lengths: the mix is the class-free workload's, so the fluid model sees the same engine.
CLASSES = {**BASE, "workload": {"arrival": BASE["workload"]["arrival"], "num_requests": 1000,
                                "classes": {"chat": {"share": 0.5, **LENGTHS}, "api": {"share": 0.5, **LENGTHS}}}}


def _classes(slo: dict):
    return make_scenario({"slo": slo}, base=CLASSES)


def _stability_rate() -> float:
    """The fluid scan's rate with a limit no stable mean reaches: stability alone bounds it."""
    return analytic_rate(_classes({"classes": {"chat": {"e2e": "100000 s"}, "api": {"e2e": "100000 s"}}}))


def _p95_ttft_s(rate_per_s: float) -> float:
    """The fluid model's P95 TTFT at this rate: a TTFT limit at P95 that binds there."""
    frame = FluidModel(_classes({"ttft": "1 s"})).evaluate(rate_per_s, None, 95)
    return float(frame["ttft_percentile_s"].iloc[0])


def test_a_class_ttft_limit_binds_the_fluid_scan_as_the_same_limit_at_top_level_does():
    stable = _stability_rate()
    ttft_s = _p95_ttft_s(0.4 * stable)
    per_class = analytic_rate(_classes({"classes": {"chat": {"ttft": f"{ttft_s} s"}, "api": {"e2e": "100000 s"}}}))
    top_level = analytic_rate(_classes({"ttft": f"{ttft_s} s"}))
    assert per_class < 0.5 * stable
    assert per_class == pytest.approx(0.4 * stable, rel=0.1)      # the scan's fine grid step is under 10%
    assert per_class == top_level


def test_the_strictest_class_limit_of_each_metric_binds_the_fluid_scan():
    stable = _stability_rate()
    ttft_s = _p95_ttft_s(0.4 * stable)
    strict, loose = f"{ttft_s} s", f"{4 * ttft_s} s"
    both = analytic_rate(_classes({"classes": {"chat": {"ttft": loose}, "api": {"ttft": strict}}}))
    assert both == analytic_rate(_classes({"ttft": strict}))
    assert both < analytic_rate(_classes({"ttft": loose}))


def test_beyond_the_fluid_capacity_a_window_is_sized_on_the_strictest_classes_request():
    slo = {"classes": {"chat": {"ttft": "300 ms", "tpot": "60 ms"}, "api": {"ttft": "1 s", "tpot": "100 ms"}}}
    scenario = _classes(slo)
    rate = 3 * _stability_rate()
    assert not FluidModel(scenario).evaluate(rate)["stable"].iloc[0]
    expected_s = 0.3 + 0.06 * mean_output_tokens(scenario)     # the mix decodes at the shared engine's TPOT
    assert expected_s > 5.0
    assert typical_latency_s(scenario, rate) == pytest.approx(expected_s)
    assert typical_latency_s(scenario, rate) == pytest.approx(
        typical_latency_s(_classes({"ttft": "300 ms", "tpot": "60 ms"}), rate))
