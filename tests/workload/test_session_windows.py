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


def test_the_window_counts_turns_and_covers_the_fill():
    """The shipped multi-turn scenario: 1.2 sessions/s of 1-10 turns (mean 5.5). The window's
    request count is turns, and the trace of that many turns spans the window's seconds (its
    turns, not its sessions, arrive at rate x 5.5 once filled)."""
    scenario = llmsim.load_scenario(MULTITURN)
    sessions = scenario.workload.sessions
    assert math.isclose(sessions.mean_turns(), 5.5)
    rate = 1.2
    window = measurement_window(scenario, rate, latency_s=5.0)
    assert window.warmup_s >= sessions.fill_time_s() > 60.0          # longer than the scenario's own warm-up
    requests = window.requests(rate)
    assert requests == math.ceil(rate * 5.5 * window.length_s)
    run = variant(scenario, window.overrides(rate))
    trace = generate_trace(run.workload, run.seed)
    assert len(trace) == requests
    # The last turn arrives near the window's end: later than the length alone, since the fill
    # brings fewer turns early, but not by more than the fill time; the Poisson count's noise
    # moves it by about sqrt(requests) / turn rate (4 of those allowed).
    last_s = float(np.max(trace.arrival_s))
    noise_s = 4 * math.sqrt(requests) / (rate * 5.5)
    assert window.length_s - noise_s <= last_s <= window.length_s + sessions.fill_time_s() + noise_s
