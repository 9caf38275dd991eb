"""The engine's event-driven bookkeeping against a brute-force recount at every iteration.

The replica never walks its decoding sequences: it keeps the batch's total context in closed
form and learns of block needs from due steps. Here, at every iteration, the same quantities
are recomputed the slow way from the requests themselves and must agree exactly.
"""
from __future__ import annotations

import pytest

import llmsim.sim.engine as engine_module
from llmsim import simulate
from llmsim.cost.features import F

from .helpers import make_scenario


@pytest.mark.parametrize("overrides", [
    {"engine": {"memory_utilization": 0.25}, "workload": {"arrival": {"rate": 30.0}}},     # preempting
    {"model": "Mistral-7B-v0.1", "engine": {"memory_utilization": 0.3},                     # sliding window
     "simulation": {"horizon": "2000 s"},
     "workload": {"arrival": {"rate": 6.0}, "num_requests": 300,
                  "prompt_tokens": {"distribution": "uniform", "low": 3000, "high": 5000},
                  "output_tokens": {"distribution": "uniform", "low": 200, "high": 1500}}},
])
def test_closed_form_context_and_blocks_match_a_recount(monkeypatch, overrides):
    checked = {"iterations": 0}
    original = engine_module.Replica._schedule

    def schedule(self):
        plan = original(self)
        if plan is None:
            return plan
        chunks, decoding, _ = plan
        n = self.n_decode if decoding else 0
        decoding = [r for r in self.running.values() if r not in self.prefilling and r.decode_start >= 0
                    and r.finish_step > self.step]
        assert len(decoding) == n
        window = self.cost.model.sliding_window or float("inf")
        contexts = [r.context_start + self.step - r.decode_start for r in decoding]
        assert self._x[F["decode_kv_read"]] == sum(min(c + 1, window) for c in contexts)
        # Every decoding sequence has room for the token it is about to write.
        size = self.kv.block_size
        assert all(r.blocks * size > c for r, c in zip(decoding, contexts))
        # And holds no more blocks than that token needs.
        assert all(r.blocks == -(-(c + 1) // size) for r, c in zip(decoding, contexts))
        held = sum(r.blocks for r in self.running.values())
        assert held == self.kv.used_blocks
        checked["iterations"] += 1
        return plan

    monkeypatch.setattr(engine_module.Replica, "_schedule", schedule)
    result = simulate(make_scenario(overrides))
    assert checked["iterations"] == len(result.iterations)
    assert (result.requests["status"] == "finished").all()
