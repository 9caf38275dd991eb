"""The throughput of a whole offline run (ramp-up and draining tail included, as trtllm-bench times it) against the
saturated engine's (:func:`offline_rate`), by the schedule of a run of fixed lengths.

Every request waits at time 0 and has the same prompt and output lengths, so the engine serves them in waves of its
``S`` sequence slots, each wave a lifetime of ``OSL`` steps. A run of ``N`` requests holds about ``N / S`` lifetimes
at the steady rate; the ramp-up (the first wave's prompts) and the tail (the last wave, alone) add at most one
lifetime each, and a batch smaller than the slots never serves faster than a full one. So the whole run's rate lies
between ``steady / (1 + 2 S / N)`` and ``steady``. A last wave of ``r < S`` requests runs a whole lifetime at batch
``r`` after ``W`` whole waves: no longer than a full wave's lifetime, and (decode reading every weight whatever the
batch) at least half of it, so the rate of ``W S + r`` requests is ``(W S + r) / (W S)`` times that of ``W S``
over ``1 + 1 / W`` at most and ``1 + 1 / (2 W)`` at least.
"""
from __future__ import annotations

import pytest

from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.search.sustainable_rate import offline_rate, whole_run_output_rate
from llmsim.search.sweeps import scenario_at

SLOTS = 16
PROMPT, OUTPUT = 64, 32
STEADY_NOISE = 0.01       # of the steady rate: its window starts and ends mid-wave


def fixed_lengths(slots: int = SLOTS) -> dict:
    return {"name": "whole-run", "seed": 3, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
            "engine": {"max_num_seqs": slots, "max_batch_tokens": 2048},
            "workload": {"arrival": {"process": "poisson", "rate": 10}, "num_requests": 100,
                         "prompt_tokens": PROMPT, "output_tokens": OUTPUT}}


def test_a_whole_run_loses_at_most_a_ramp_and_a_tail_to_the_steady_rate():
    requests = 20 * SLOTS
    steady = offline_rate(fixed_lengths(), num_requests=requests).output_tokens_per_s
    whole = whole_run_output_rate(fixed_lengths(), num_requests=requests)
    assert steady / (1 + 2 * SLOTS / requests) <= whole <= steady * (1 + STEADY_NOISE)


def test_a_partial_last_wave_costs_a_lifetime_at_its_own_batch():
    waves, last = 10, SLOTS // 4
    cost = ResolvedDeployment.of(scenario_at(fixed_lengths(), {})).cost
    for context in (PROMPT, PROMPT + OUTPUT):      # the premise: the last wave's step costs half a full one's or more
        full_s = cost.decode_time(SLOTS, context)
        assert full_s / 2 <= cost.decode_time(last, context) <= full_s
    whole_waves = whole_run_output_rate(fixed_lengths(), num_requests=waves * SLOTS)
    partial = whole_run_output_rate(fixed_lengths(), num_requests=waves * SLOTS + last)
    more_tokens = (waves * SLOTS + last) / (waves * SLOTS)
    assert more_tokens / (1 + 1 / waves) <= partial / whole_waves <= more_tokens / (1 + 1 / (2 * waves))


def test_an_unfinished_run_has_no_whole_run_rate():
    scenario = fixed_lengths()
    scenario["engine"]["max_model_len"] = PROMPT + OUTPUT - 1     # every request is rejected as too long
    with pytest.raises(ValueError, match="did not finish"):
        whole_run_output_rate(scenario, num_requests=SLOTS)
