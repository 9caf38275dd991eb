"""Searches on a diurnal arrival: probes measure whole cycles, a cycle too long for one run is refused before
any simulation, and a controller's knob is not searched."""
from __future__ import annotations

import math

import numpy as np
import yaml
import pytest

from llmsim.cli.main import main
from llmsim.errors import ConfigError
from llmsim.scenario.variants import RATE_KEY, variant
from llmsim.search import recommend as recommending
from llmsim.search.recommend import Config, _neighbours, batch_token_options, recommend, searches_batch_tokens
from llmsim.search.window import MAX_REQUESTS, check_cycle_fits, measurement_window
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, REPO, make_scenario, merge

DAY = REPO / "scenarios" / "day-of-traffic-diurnal.yaml"
CONTROLLER = {"rule": "practice", "knob": "max_batch_tokens", "interval": "5 s", "window": "10 s",
              "bounds": [1024, 8192]}


def _diurnal(rate: float, period: str, **extra):
    return make_scenario({"workload": {"arrival": {"process": "diurnal", "rate": rate, "amplitude": 0.5,
                                                   "period": period}},
                          "slo": {"ttft": "2 s", "tpot": "50 ms"}, **extra})


def _expected_arrivals(rate: float, amplitude: float, period_s: float, peak_s: float, a: float, b: float) -> float:
    """The integral of rate x (1 + amplitude cos(2 pi (t - peak) / period)) over [a, b]."""
    phase = lambda t: 2 * math.pi * (t - peak_s) / period_s          # noqa: E731
    return rate * ((b - a) + amplitude * period_s / (2 * math.pi) * (math.sin(phase(b)) - math.sin(phase(a))))


@pytest.mark.parametrize("rate", [10.0, 25.0])
def test_a_probe_measures_whole_cycles_at_the_mean_rate(rate):
    # A 600 s cycle peaking at 300 s: the rule's window alone (tens of seconds after a 30 s warm-up) lies in the
    # quiet phase, at about half the mean rate. Measured over whole cycles, the arrivals the measurement holds are
    # the mean rate times its length (the cosine integrates to zero over a period), counted in the trace.
    scenario = _diurnal(rate, "600 s", simulation={"warmup": "30 s"})
    arrival = scenario.workload.arrival
    window = measurement_window(scenario, rate, latency_s=2.0, own_floor=False)
    assert window.measure_s == pytest.approx(arrival.period_s)
    start, end = window.warmup_s, window.warmup_s + window.measure_s
    assert _expected_arrivals(rate, 0.5, 600.0, 300.0, start, end) == pytest.approx(rate * window.measure_s)
    # What the rule's window alone (20 latencies, 500 requests) would have measured: a quiet phase.
    partial_s = max(500 / rate, 20 * 2.0)
    assert _expected_arrivals(rate, 0.5, 600.0, 300.0, start, start + partial_s) < 0.6 * rate * partial_s
    probe = variant(scenario, {RATE_KEY: rate, **window.overrides(rate)})
    arrivals = generate_trace(probe.workload, probe.seed).arrival_s
    measured = np.count_nonzero((arrivals >= start) & (arrivals < end))
    expected = rate * window.measure_s
    assert abs(measured - expected) < 4 * math.sqrt(expected)        # Poisson: 4 standard deviations


def test_longer_measurements_stay_whole_cycles():
    scenario = _diurnal(10.0, "600 s")
    window = measurement_window(scenario, 10.0, latency_s=2.0, own_floor=False)
    assert window.longer().measure_s == pytest.approx(2 * 600.0)
    # A measurement longer than a cycle is rounded up to the next whole one.
    assert measurement_window(_diurnal(10.0, "10 s"), 10.0, latency_s=2.0, own_floor=False).measure_s \
        == pytest.approx(50.0)                                          # 500 requests at 10/s: 50 s, 5 cycles


def test_a_cycle_longer_than_a_run_is_refused_before_any_simulation(monkeypatch):
    # The day of traffic: one 24 h cycle at 100/s is 8.64M requests, above what one run simulates.
    def no_search(*args, **kwargs):
        raise AssertionError("nothing is simulated or generated before the refusal")
    monkeypatch.setattr(recommending, "generate_trace", no_search)
    with pytest.raises(ConfigError) as error:
        recommend(DAY)
    assert error.value.key == "workload.arrival.period" and error.value.file == str(DAY)
    assert "8,640,000 requests" in str(error.value) and "rate: 150/s" in str(error.value)
    # The bound is one cycle at the scenario's rate within MAX_REQUESTS.
    longest_s = MAX_REQUESTS / 100.0
    check_cycle_fits(_diurnal(100.0, f"{longest_s} s"))
    with pytest.raises(ConfigError):
        check_cycle_fits(_diurnal(100.0, f"{longest_s * 1.01} s"))


def test_the_cli_refuses_a_day_long_cycle_with_exit_2(capsys):
    assert main(["recommend", str(DAY)]) == 2
    err = capsys.readouterr().err
    assert "at key 'workload.arrival.period'" in err and "Traceback" not in err


def test_a_controller_on_max_batch_tokens_holds_the_scenarios_value():
    # The controller moves max_batch_tokens within its bounds every interval: the engine's value is where it
    # starts, so the grid, the defaults and the refinement all hold it.
    controlled = _diurnal(4.0, "300 s", engine={"max_batch_tokens": 8192}, controller=CONTROLLER)
    assert not searches_batch_tokens(controlled)
    assert batch_token_options(controlled) == [8192]
    assert {c.max_batch_tokens for c in _neighbours(Config(recommending.OFF, 8192, None), controlled)} == {8192}
    # A controller of another knob leaves max batch tokens to the search.
    other = _diurnal(4.0, "300 s", engine={"max_batch_tokens": 8192},
                     controller={**CONTROLLER, "knob": "max_num_seqs", "bounds": [32, 256]})
    assert searches_batch_tokens(other) and len(batch_token_options(other)) > 1


def test_a_refusal_says_what_each_seed_showed_at_the_scenarios_rate():
    # No decode step takes under 1 ms: every seed of every setting fails at any rate, so each seed's bisection
    # stops at the scenario's rate or below, and the refusal names each seed's failing rate, none passing (the
    # mean of per-seed goodputs, 0 for a seed that failed below the scenario's rate, is no rate it sustains).
    unreachable = make_scenario({"workload": {"num_requests": 400}, "slo": {"ttft": "2 s", "tpot": "1 ms"}})
    with pytest.raises(ConfigError) as error:
        recommend(unreachable, seeds=2, top=1, workers=1)
    message = str(error.value)
    assert error.value.key == "workload.arrival.rate"
    for seed in (unreachable.seed, unreachable.seed + 1):
        failing = float(message.split(f"seed {seed} fails at ")[1].split("/s")[0])
        assert failing <= unreachable.workload.rate_per_s
    assert "passes" not in message


@pytest.mark.slow
def test_a_recommendation_under_a_controller_keeps_and_says_the_scenarios_max_batch_tokens(tmp_path, capsys):
    data = merge(BASE, {"workload": {"num_requests": 400, "arrival": {"rate": 4.0}},
                        "engine": {"max_batch_tokens": 4096}, "slo": {"ttft": "2 s", "tpot": "100 ms"},
                        "controller": {**CONTROLLER, "bounds": [1024, 4096]}})
    path = tmp_path / "controlled.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["recommend", str(path), "--seeds", "2", "--top", "1", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "max_batch_tokens   4096 (the scenario's, not searched: the controller moves it within its bounds)" in out
    assert "max_batch_tokens not searched: the controller moves it within its bounds" in out
