"""A search's window over multi-turn sessions starts stationary and warms up only until the KV cache has seen
the histories of (nearly) all turns: its steady-state figures match those of an empty start behind a long
warm-up (the turn rate within ``STATIONARY_DEFICIT`` of steady), within the standard error of independent
replications; the empty start behind the short warm-up does not.

The prefix-cache hit rate may fall short by what the cold turns the window still holds cost: a follow-up at
``t`` finds its history uncached with probability ``exp(-t / theta)`` (their expected count in the window is
the closed form below), and each loses at most its prompt's tokens of hits.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import llmsim
from llmsim.scenario.variants import variant
from llmsim.search.window import measurement_window, typical_latency_s
from llmsim.sim.simulate import simulate

from tests.helpers import REPO

MULTITURN = REPO / "scenarios" / "llama3-8b-h100-multiturn-chat.yaml"
RATE = 2.0                  # sessions per second: loaded (about 80% of what the SLO allows), below capacity
MEASURE_S = 120.0
SEEDS = range(6)
Z = 3.0                     # standard errors of the difference allowed between two estimates


def figures(scenario, warmup_s: float, start: str, seed: int) -> np.ndarray:
    """(prefix-cache hit rate in tokens, mean TTFT, turns per second, the longest prompt's share of the prompt
    tokens) of the requests arriving in the measurement window after ``warmup_s``."""
    run = variant(scenario, {"workload.arrival.rate": f"{RATE}/s", "seed": seed, "simulation.warmup": f"{warmup_s} s",
                             "workload.num_requests": math.ceil(RATE * 5.5 * (warmup_s + MEASURE_S)),
                             "workload.sessions.start": start})
    records = simulate(run).requests
    window = records[(records["arrival_s"] >= warmup_s) & (records["arrival_s"] < warmup_s + MEASURE_S)]
    prompt_tokens = window["prompt_tokens"]
    return np.array([window["cached_tokens"].sum() / prompt_tokens.sum(), window["ttft_s"].mean(),
                     len(window) / MEASURE_S, prompt_tokens.max() / prompt_tokens.sum()])


def over_seeds(scenario, warmup_s: float, start: str) -> tuple[np.ndarray, np.ndarray]:
    values = np.array([figures(scenario, warmup_s, start, seed) for seed in SEEDS])
    return values.mean(axis=0), values.std(axis=0, ddof=1) / math.sqrt(len(values))


@pytest.mark.slow      # 18 simulations of a few thousand turns each
def test_a_stationary_start_reaches_the_long_warm_up_steady_state():
    scenario = llmsim.load_scenario(MULTITURN)
    sessions = scenario.workload.sessions
    window = measurement_window(scenario, RATE, typical_latency_s(scenario, RATE), own_floor=False)
    assert window.stationary_sessions and window.warmup_s < sessions.fill_time_s()
    short, short_se = over_seeds(scenario, window.warmup_s, "stationary")
    reference, reference_se = over_seeds(scenario, sessions.lead_s(), "empty")
    tolerance = Z * np.hypot(short_se, reference_se)[:3]
    theta = sessions.think_time_s
    cold_turns = RATE * theta * (sessions.mean_turns() - 1) * (
        math.exp(-window.warmup_s / theta) - math.exp(-(window.warmup_s + MEASURE_S) / theta))
    cold_allowance = cold_turns * short[3]          # each loses at most the window's longest prompt of hits
    assert -tolerance[0] - cold_allowance <= short[0] - reference[0] <= tolerance[0], (short, reference)
    assert np.all(np.abs(short - reference)[1:3] <= tolerance[1:]), (short, reference, tolerance)
    # The empty start behind the same short warm-up is still filling: fewer turns, shorter queues.
    empty, empty_se = over_seeds(scenario, window.warmup_s, "empty")
    differs = np.abs(empty - reference)[:3] > Z * np.hypot(empty_se, reference_se)[:3]
    assert differs[1] and differs[2], (empty, reference)
