"""A stationary start of multi-turn sessions (``workload.sessions.start: stationary``) against the M/G/inf
closed forms: Poisson session arrivals at rate lambda, each session in progress for its think times' sum L
(turns - 1 exponential gaps of mean theta), so the sessions in progress at a time are Poisson with mean
``lambda E[L] = lambda theta E[turns - 1]`` in the steady state, and the turns arrive at ``lambda E[turns]``."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from llmsim.errors import ConfigError
import llmsim
from llmsim.scenario.variants import variant
from llmsim.workload.arrivals import Poisson
from llmsim.workload.lengths import Fixed, Uniform
from llmsim.workload.sessions import COLD_SHARE, Sessions

from tests.helpers import REPO

RATE, THINK_S, INPUT, OUTPUT = 1.2, 20.0, 100, 50
SEEDS = range(300)
Z = 4.0                 # standard errors allowed between an estimate over SEEDS and its closed form
TURNS = Uniform(low=1, high=10, maximum=10)


def sessions(stationary: bool) -> Sessions:
    return Sessions(TURNS, THINK_S, None, max_tokens=100_000, stationary=stationary)


def trace(stationary: bool, seed: int, num_requests: int = 1500):
    prompt, output = Fixed(value=INPUT, maximum=INPUT), Fixed(value=OUTPUT, maximum=OUTPUT)
    return sessions(stationary).trace(Poisson(RATE), num_requests, None, prompt, output, seed)


def turn_index(t) -> np.ndarray:
    """Each turn's place in its session (0: the first): its prompt is k earlier turns' input and output plus its own."""
    return (t.prompt_tokens - INPUT) // (INPUT + OUTPUT)


def cold(t) -> np.ndarray:
    """Turns whose previous turn is not in the trace (it arrived before the run): a session's first turn in the
    trace that is not its first turn."""
    order = np.argsort(t.session_id, kind="stable")
    ids = t.session_id[order]
    first_seen = np.ones(len(ids), bool)
    first_seen[1:] = ids[1:] != ids[:-1]
    out = np.zeros(len(ids), bool)
    out[order] = first_seen & (turn_index(t)[order] > 0)
    return out


def test_sessions_in_progress_at_the_start_are_the_m_g_inf_equilibrium():
    """A session is in progress at the start when it began before it and has a turn after it: exactly one cold
    turn each. Their count over seeds has the Poisson law's mean and variance, ``lambda theta E[turns - 1]``;
    an empty start has none."""
    mean = RATE * THINK_S * (TURNS.mean() - 1)
    counts = np.array([np.count_nonzero(cold(trace(True, seed))) for seed in SEEDS])
    n = len(counts)
    assert abs(counts.mean() - mean) <= Z * math.sqrt(mean / n)
    # The sample variance of n Poisson counts has variance mean / n + 2 mean^2 / (n - 1).
    assert abs(counts.var(ddof=1) - mean) <= Z * math.sqrt(2 * mean ** 2 / (n - 1) + mean / n)
    assert not cold(trace(False, 0)).any()


def test_the_turn_rate_is_steady_from_a_stationary_start_and_fills_from_an_empty_one():
    """Turns arriving in the first 30 s: ``lambda E[turns] 30`` from a stationary start; from an empty one
    the M/G/inf transient ``lambda int_0^30 (1 + sum_k P(turns > k) P(Gamma(k, theta) <= u)) du``."""
    window_s = 30.0
    lengths, p = TURNS.probabilities()
    follow_ups = np.arange(1, 10)
    survival = np.array([p[lengths > k].sum() for k in follow_ups])
    filling = integrate.quad(lambda u: 1 + survival @ stats.gamma.cdf(u, follow_ups, scale=THINK_S), 0, window_s)[0]
    for stationary, expected in ((True, RATE * TURNS.mean() * window_s), (False, RATE * filling)):
        counts = np.array([np.count_nonzero(trace(stationary, seed).arrival_s < window_s) for seed in SEEDS])
        assert abs(counts.mean() - expected) <= Z * counts.std(ddof=1) / math.sqrt(len(counts)), stationary
    assert filling < 0.75 * TURNS.mean() * window_s          # the two differ: the test tells them apart


def test_cold_turns_decay_as_the_closed_form_and_the_cold_time_leaves_their_share():
    """A follow-up turn at ``t`` is cold with probability ``exp(-t / theta)``: the cold turns arriving after
    ``t`` are Poisson with mean ``lambda theta E[turns - 1] exp(-t / theta)``, which at the cold time is
    ``COLD_SHARE`` of the steady turn rate times theta."""
    cold_s = sessions(True).cold_time_s()
    expected = RATE * THINK_S * (TURNS.mean() - 1) * math.exp(-cold_s / THINK_S)
    assert math.isclose(expected, COLD_SHARE * RATE * TURNS.mean() * THINK_S)
    counts = []
    for seed in SEEDS:
        t = trace(True, seed)
        counts.append(np.count_nonzero(cold(t) & (t.arrival_s >= cold_s)))
    assert abs(np.mean(counts) - expected) <= Z * math.sqrt(expected / len(counts))


def test_a_stationary_trace_keeps_its_histories_and_counts():
    """The turns of sessions begun before the start keep their whole history in their prompts, the run has
    the turns asked for, all arriving from the start, and the same seed gives the same trace."""
    t = trace(True, 7)
    assert len(t) == 1500 and t.arrival_s.min() >= 0 and np.all(np.diff(t.arrival_s) >= 0)
    assert turn_index(t).max() >= 5            # late turns of long sessions: histories from before the start
    again = trace(True, 7)
    assert np.array_equal(t.arrival_s, again.arrival_s) and np.array_equal(t.prompt_tokens, again.prompt_tokens)


def test_the_key_reads_writes_and_refuses_a_rate_profile():
    scenario = llmsim.load_scenario(REPO / "scenarios" / "llama3-8b-h100-multiturn-chat.yaml")
    assert not scenario.workload.sessions.stationary
    stationary = variant(scenario, {"workload.sessions.start": "stationary"})
    assert stationary.workload.sessions.stationary
    # Through the written scenario (another key not set on the typed scenario makes variant write and read it).
    reread = variant(stationary, {"workload.sessions.think_time": "20 s"})
    assert reread.workload.sessions.stationary
    with pytest.raises(ConfigError) as error:
        variant(scenario, {"workload.sessions.start": "warm"})
    assert error.value.key == "workload.sessions.start" and "stationary" in error.value.allowed
    diurnal = {"process": "diurnal", "rate": "1.2/s", "amplitude": 0.5, "period": "1 h"}
    with pytest.raises(ConfigError) as error:
        variant(scenario, {"workload.arrival": diurnal, "workload.sessions.start": "stationary"})
    assert error.value.key == "workload.sessions.start" and "diurnal" in error.value.message
