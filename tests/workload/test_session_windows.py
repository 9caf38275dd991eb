"""A search's window over conversations: the rate counts sessions, the request count turns, and
the turn rate needs a while to fill up to its steady state."""
from __future__ import annotations

import math

import numpy as np

import llmsim
from llmsim.scenario.variants import variant
from llmsim.search.window import measurement_window
from llmsim.workload.lengths import Fixed
from llmsim.workload.sessions import Sessions
from llmsim.workload.generate import generate_trace

from tests.helpers import REPO

MULTITURN = REPO / "scenarios" / "llama3-8b-h100-multiturn-chat.yaml"


def test_fill_time_of_two_turn_sessions_is_the_closed_form():
    """Two turns, the second an exponential think time theta after the first: at time t the turn
    rate is (1 + (1 - exp(-t/theta))) / 2 of its steady rate, which reaches 95% at t = theta ln 10."""
    sessions = Sessions(Fixed(value=2, maximum=2), think_time_s=20.0, system_prompt=None, max_tokens=10_000)
    assert math.isclose(sessions.fill_time_s(), 20.0 * math.log(10), rel_tol=1e-6)
    assert math.isclose(sessions.fill_time_s(0.75), 20.0 * math.log(2), rel_tol=1e-6)
    # Three turns always (the law starts at 3: turns 1 and 2 exist with certainty): at x = t / theta
    # the rate is (1 + (1 - e^-x) + (1 - e^-x (1 + x))) / 3 of its steady rate (Gamma(1) and Gamma(2)).
    three = Sessions(Fixed(value=3, minimum=3, maximum=3), think_time_s=20.0, system_prompt=None, max_tokens=10_000)
    x = three.fill_time_s() / 20.0
    assert math.isclose((1 + (1 - math.exp(-x)) + (1 - math.exp(-x) * (1 + x))) / 3, 0.95, rel_tol=1e-6)
    single = Sessions(Fixed(value=1, maximum=1), think_time_s=20.0, system_prompt=None, max_tokens=10_000)
    assert single.fill_time_s() == 0.0 and single.mean_turns() == 1.0


def test_the_window_counts_turns_and_covers_the_cold_cache():
    """The shipped multi-turn scenario: 1.2 sessions/s of 1-10 turns (mean 5.5) at a constant rate. The
    window starts the run stationary, so its warm-up need only cover the turns whose history the cache has
    not seen (not the empty start's fill, which is longer than the scenario's own 60 s warm-up); its request
    count is turns, and the trace of that many turns spans the window's seconds (turns arrive at rate x 5.5
    from the start)."""
    scenario = llmsim.load_scenario(MULTITURN)
    sessions = scenario.workload.sessions
    assert math.isclose(sessions.mean_turns(), 5.5)
    rate = 1.2
    window = measurement_window(scenario, rate, latency_s=5.0)
    assert window.stationary_sessions
    assert window.warmup_s == max(60.0, sessions.cold_time_s()) < sessions.fill_time_s()
    requests = window.requests(rate)
    assert requests == math.ceil(rate * 5.5 * window.length_s)
    run = variant(scenario, window.overrides(rate))
    assert run.workload.sessions.stationary
    trace = generate_trace(run.workload, run.seed)
    assert len(trace) == requests
    # The last turn arrives near the window's end; the count's noise moves it by about sqrt(requests) /
    # turn rate (4 of those allowed, plus the turns the longest-prompt cut drops).
    last_s = float(np.max(trace.arrival_s))
    noise_s = 4 * math.sqrt(requests) / (rate * 5.5)
    assert window.length_s - noise_s <= last_s <= window.length_s + noise_s


def test_a_rate_profile_keeps_the_empty_start_and_its_fill():
    """A diurnal session rate has no one steady state to start in: the window keeps the empty start and its
    warm-up the fill of the turn rate."""
    scenario = variant(llmsim.load_scenario(MULTITURN),
                       {"workload.arrival": {"process": "diurnal", "rate": "1.2/s", "amplitude": 0.5, "period": "1 h"}})
    window = measurement_window(scenario, 1.2, latency_s=5.0)
    assert not window.stationary_sessions
    assert window.warmup_s >= scenario.workload.sessions.fill_time_s()
    assert "workload.sessions.start" not in window.overrides(1.2)
