"""The engine's event-driven bookkeeping against a brute-force recount at every iteration.

The one-token decode set never walks its decoding sequences: it keeps the batch's total
context in closed form and learns of block needs from due steps. Here an observer
recomputes, after every iteration, the same quantities the slow way from the requests
themselves, and they must agree exactly.
"""
from __future__ import annotations

import pytest


from .helpers import make_scenario, simulate_checked


@pytest.mark.parametrize("overrides", [
    {"engine": {"memory_utilization": 0.25, "max_model_len": 8192}, "workload": {"arrival": {"rate": 30.0}}},     # preempting
    {"model": "Mistral-7B-v0.1", "engine": {"memory_utilization": 0.3},                     # sliding window
     "simulation": {"horizon": "2000 s"},
     "workload": {"arrival": {"rate": 6.0}, "num_requests": 300,
                  "prompt_tokens": {"distribution": "uniform", "low": 3000, "high": 5000},
                  "output_tokens": {"distribution": "uniform", "low": 200, "high": 1500}}},
])
def test_closed_form_context_and_blocks_match_a_recount(overrides):
    checked = {"iterations": 0}

    def recount(engine, iteration):
        decode = engine.decode
        decoding = [r for r in engine.running.values() if r not in engine.prefilling]
        assert len(decoding) == decode.n
        window = engine.cost.model.sliding_window or float("inf")
        contexts = [decode.context(r) for r in decoding]
        # KV holds the prompt and every token sampled so far but the last (its KV is written by
        # the next step); tokens sampled: those before this decode run plus one per step of it.
        assert contexts == [r.prompt_tokens + r.generated + decode.step - r.decode_start - 1 for r in decoding]
        # What the next decode step reads: every context plus the new token, capped by the window.
        assert decode.kv_read() == sum(min(c + 1, window) for c in contexts)
        # Every decoding sequence holds exactly the blocks of its KV, its tokens so far.
        size = engine.kv.block_size
        assert all(r.blocks == -(-c // size) for r, c in zip(decoding, contexts))
        held = sum(r.blocks for r in engine.running.values())
        assert held == engine.kv.used_blocks
        checked["iterations"] += 1

    result = simulate_checked(make_scenario(overrides), observers=[recount])
    assert checked["iterations"] == len(result.iterations)
    assert (result.requests["status"] == "finished").all()
    if "model" not in overrides:
        assert result.preemptions > 0
