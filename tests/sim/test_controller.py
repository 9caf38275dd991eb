"""The adaptive controller: on a load step it cuts the time over the SLO against the static setting
on the same trace, and with no violation it changes nothing.

Long prompts (mean 4,000 tokens) make chunked prefill the cause of slow decode steps: every
iteration that carries an 8,192-token chunk stretches the TPOT of the whole batch, and a
smaller ``max_batch_tokens`` bounds that (the practice rule's lever). The time over the SLO is
counted the same way for every run, from the records (:func:`llmsim.analysis.rolling.time_over_slo`).
"""
from __future__ import annotations

import copy

import pytest

from llmsim import simulate
from llmsim.analysis.rolling import rolling_worst_ratio, time_over_slo
from llmsim.errors import ConfigError

from tests.helpers import BASE, make_scenario

WINDOW_S, STEP_S, DURATION_S = 10.0, 5.0, 300.0


def scenario(rates, controller=None, duration_s=DURATION_S):
    base = copy.deepcopy(BASE)
    base["workload"].pop("num_requests")
    base["workload"].update(
        duration=f"{duration_s} s", arrival={"process": "steps", "rates": rates},
        prompt_tokens={"distribution": "lognormal", "mean": 4000, "sigma": 0.5, "max": 12000},
        output_tokens={"distribution": "lognormal", "mean": 200, "sigma": 0.5, "max": 1024})
    base["slo"] = {"tpot": "50 ms", "ttft": "2 s"}
    if controller is not None:
        base["controller"] = {"interval": f"{STEP_S} s", "window": f"{WINDOW_S} s", "hysteresis": 0.5,
                              "bounds": [1024, 8192], **controller}
    return make_scenario(base=base)


def seconds_over(result):
    s = result.scenario
    return time_over_slo(rolling_worst_ratio(result.requests, s.slo, (), WINDOW_S, STEP_S, 0.0, DURATION_S), STEP_S)


# The second step is past what the static setting serves within the SLO.
STEP = [{"at": 0, "rate": "2.5/s"}, {"at": "100 s", "rate": "6/s"}]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["practice", "aimd", "pid"])
def test_controller_cuts_time_over_the_slo_on_a_load_step(rule):
    static = simulate(scenario(STEP))
    adaptive = simulate(scenario(STEP, {"rule": rule, "kp": 4.0, "ki": 0.3}))
    assert (static.requests["arrival_s"] == adaptive.requests["arrival_s"]).all()      # the same trace
    assert seconds_over(static) >= 40
    # At least two windows' steps fewer over the SLO than the static setting.
    assert seconds_over(adaptive) <= seconds_over(static) - 2 * STEP_S, (seconds_over(adaptive), seconds_over(static))
    log = adaptive.control
    assert log["changed"].any() and log["value"].min() < 8192 and log["value"].between(1024, 8192).all()
    # Nothing moves before the step.
    assert not log.loc[log["time_s"] <= 100, "changed"].any()


@pytest.mark.parametrize("rule", ["practice", "aimd", "pid"])
def test_controller_without_violations_changes_nothing(rule):
    calm = [{"at": 0, "rate": "2/s"}]
    static = simulate(scenario(calm, duration_s=100.0))
    adaptive = simulate(scenario(calm, {"rule": rule}, duration_s=100.0))
    assert seconds_over(static) == 0
    assert not adaptive.control["changed"].any()
    assert (adaptive.control["value"] == 8192).all()
    assert adaptive.requests.equals(static.requests)


@pytest.mark.parametrize("controller, key", [
    ({"bounds": [2048, 4096]}, "controller.bounds"),           # does not hold the engine's 8192
    ({"bounds": [0, 8192]}, "controller.bounds"),
    ({"bounds": [100]}, "controller.bounds"),
    ({"rule": "bang-bang"}, "controller.rule"),
    ({"decrease": 1.5}, "controller.decrease"),
    ({"hysteresis": -0.1}, "controller.hysteresis"),
])
def test_bad_controller_settings_name_the_key(controller, key):
    with pytest.raises(ConfigError) as error:
        make_scenario({"controller": controller})
    assert error.value.key == key and error.value.allowed, str(error.value)


def _speculating(tpot: str, controller: dict | None = None):
    base = copy.deepcopy(BASE)
    base["workload"].update(num_requests=200, arrival={"rate": 4.0})
    base["speculation"] = {"draft": "Llama-3.2-1B", "k": 4, "acceptance": {"process": "bernoulli", "alpha": 0.7}}
    base["slo"] = {"tpot": tpot}
    if controller is not None:
        base["controller"] = {"knob": "speculation_k", "interval": "5 s", "window": "10 s", "bounds": [0, 4],
                              **controller}
    return make_scenario(base=base)


def test_controller_moves_the_speculation_k_and_the_engine_drafts_that_many():
    controlled = simulate(_speculating("1 ms", {"rule": "practice"}))     # a limit no step can meet: k goes down
    log = controlled.control
    changes = log[log["changed"]]
    assert list(changes["value"][:3]) == [2, 1, 0]                 # halved at each violation, to the bound
    its = controlled.iterations
    for (start, value), stop in zip(zip(changes["time_s"], changes["value"]), [*changes["time_s"][1:], float("inf")]):
        inside = its[(its["start_s"] >= start) & (its["end_s"] < stop) & (its["spec_seqs"] > 0)]
        assert (inside["draft_tokens"] <= value * inside["spec_seqs"]).all()
    after = its[its["start_s"] >= changes["time_s"].iloc[2]]
    assert after["draft_tokens"].sum() == 0 and its["draft_tokens"].sum() > 0
    # With no violation nothing moves, and the run is the static one's.
    calm = simulate(_speculating("10 s", {"rule": "practice"}))
    assert not calm.control["changed"].any() and calm.requests.equals(simulate(_speculating("10 s")).requests)


@pytest.mark.parametrize("controller, key", [
    ({"knob": "speculation_k", "bounds": [0, 9]}, "controller.bounds"),         # above k_max (8)
    ({"knob": "speculation_k", "bounds": [5, 8]}, "controller.bounds"),         # does not hold k = 4
])
def test_bad_speculation_k_bounds_name_the_key(controller, key):
    base = copy.deepcopy(BASE)
    base["speculation"] = {"draft": "Llama-3.2-1B", "k": 4}
    base["controller"] = controller
    with pytest.raises(ConfigError) as error:
        make_scenario(base=base)
    assert error.value.key == key and error.value.allowed


def test_speculation_k_knob_needs_a_static_k_policy():
    with pytest.raises(ConfigError) as error:
        make_scenario({"controller": {"knob": "speculation_k"}})
    assert error.value.key == "controller.knob"
