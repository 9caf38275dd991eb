"""The iteration log: rows packed as the engine plans them, and Iterations built back from them on request.

The engine logs each iteration's fields as it plans it and builds an :class:`Iteration` only when one is
asked for (``Engine.schedule``, the observers): the Iterations and the result's iteration table must both
hold the values the engine planned, the counts as ints, across the log's chunk boundaries too.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.config.policies import SchedulingPolicy
from llmsim.cost.features import prefill_sums
from llmsim.sim.decode import EventDecodeSet
from llmsim.sim.iterations import CHUNK_ROWS, LOG_COLUMNS, Iteration, IterationLog, iterations_columns
from llmsim.sim.simulate import simulate
from tests.helpers import make_scenario


class Prompt:
    """A prompt with ``prefilled`` positions cached of ``prefill_target``."""

    def __init__(self, prefilled: int, prefill_target: int):
        self.prefilled, self.prefill_target = prefilled, prefill_target


def _row(i: int) -> tuple:
    """Distinct values for row ``i``: times as floats, counts as ints (as the engine passes them)."""
    return (0.5 * i, 0.25 + i * 1e-3, i % 97, i % 5, float(i % 4096), i % 101, 1e9 + i, 2e9 + i, i % 7919, i % 64,
            i % 13, i % 3, i % 11, i % 9, 1e-4 * (i % 17))


def test_last_gives_the_row_just_added_as_an_iteration_across_chunk_boundaries():
    log = IterationLog()
    chunks = [(object(), 3)]
    for i in range(CHUNK_ROWS + 10):
        log.add(*_row(i))
        if i < 5 or i >= CHUNK_ROWS - 3:
            last = log.last(chunks, i % 2 == 0)
            assert last == Iteration(*_row(i), chunks=chunks, decoding=i % 2 == 0)
            assert all(type(value) is type(expected) for value, expected in zip(last, _row(i)))
    assert len(log) == CHUNK_ROWS + 10


def test_the_table_holds_every_row_added_in_order():
    log = IterationLog()
    rows = [_row(i) for i in range(CHUNK_ROWS + 10)]
    for row in rows:
        log.add(*row)
    columns = iterations_columns([(0, 0, log)], float("inf"))
    expected = pd.DataFrame(rows, columns=list(LOG_COLUMNS))
    for name in LOG_COLUMNS:
        assert np.array_equal(columns[name], expected[name].to_numpy())


def test_observers_see_the_iterations_the_result_records():
    scenario = make_scenario({"workload": {"num_requests": 300, "arrival": {"process": "poisson", "rate": 30}}})
    seen: list[Iteration] = []
    result = simulate(scenario, observers=[lambda engine, iteration: seen.append(iteration)])
    table = result.iterations
    assert len(seen) == len(table) > 300
    assert sum(iteration.prefill_seqs for iteration in seen) >= 300      # every prompt computed, some in chunks
    for name in LOG_COLUMNS:
        assert np.array_equal(np.array([getattr(iteration, name) for iteration in seen]), table[name].to_numpy())
    for iteration in seen:
        assert len(iteration.chunks) == iteration.prefill_seqs
        assert iteration.decoding == (iteration.decode_seqs > 0)
        assert all(isinstance(getattr(iteration, name), int) for name in ("decode_seqs", "running", "queued"))


@pytest.mark.parametrize("hardware", ["H100-SXM", "CS-3"])     # with kernel terms, and the roofline alone
def test_a_decode_step_logged_in_one_call_is_the_row_add_packs_from_decode_step(hardware):
    """IterationLog.decode_step_entry (the engine's steady state: priced and logged in one compiled call, as
    EventDecodeSet.log_decode_step calls it) with row_added writes the row add() packs from
    CostModel.decode_step's price, bit for bit, and returns its duration, across a chunk boundary and for batch
    sizes new and seen."""
    cost = CostModel(model_catalog()["Llama-3.1-70B"], lookup_hardware(hardware), 1 if hardware == "CS-3" else 8)
    fast, reference = IterationLog(), IterationLog()
    rng = np.random.default_rng(12)
    for i in range(CHUNK_ROWS + 50):
        seqs = int(rng.integers(1, 64))
        kv_read = int(rng.integers(seqs, seqs * 8000))
        start_s, used, running, queued = 0.01 * i, i % 5000, seqs + i % 3, i % 17
        duration_s, flops, moved = cost.decode_step(seqs, kv_read)
        reference.add(start_s, duration_s, seqs, 0, 0.0, seqs, flops, moved, used, running, queued, 0, 0, 0, 0.0)
        stacked, n_ops, _, _ = cost.compiled_terms()
        assert fast.decode_step_entry(fast.doubles, fast.at, start_s, seqs, used, running, queued, stacked, n_ops,
                                      kv_read, *cost.decode_terms(seqs, kv_read)) == duration_s
        fast.row_added()
    assert all(np.array_equal(a.view(np.int64), b.view(np.int64)) for a, b in zip(fast.views(), reference.views()))


@pytest.mark.parametrize("hardware", ["H100-SXM", "CS-3"])     # with kernel terms, and the roofline alone
def test_a_step_with_prompts_logged_in_one_call_is_the_row_add_packs_from_step(hardware):
    """IterationLog.step_entry (an iteration with prompt chunks, decoding or not, summed, priced and logged in one
    compiled call given CostModel.step_terms, as EventDecodeSet.log_step calls it) with row_added writes the row
    add() packs from CostModel.step's price of prefill_sums' sums, bit for bit, and returns its duration, across a
    chunk boundary, with and without a sliding window; the terms are not known for a token count step has not
    priced."""
    cost = CostModel(model_catalog()["Llama-3.1-70B"], lookup_hardware(hardware), 1 if hardware == "CS-3" else 8)
    assert (cost.step_terms(123456.0, 7) is None) == (hardware != "CS-3")
    fast, reference = IterationLog(), IterationLog()
    stacked, n_ops, x, _ = cost.compiled_terms()
    rng = np.random.default_rng(13)
    for i in range(CHUNK_ROWS + 50):
        seqs = int(rng.integers(0, 64)) * int(rng.integers(0, 2))
        kv_read = int(rng.integers(seqs, seqs * 8000 + 1))
        window, local_share, tile = [(0, 1.0, 0), (4096, 1.0, 64), (1024, 0.5, 128)][i % 3]
        query_tile_pairs = 0.0 if i % 2 else 300.0
        news = rng.integers(1, 2048, int(rng.integers(1, 5)))
        cached = rng.integers(0, 9000, len(news))
        ends = cached + news
        targets = np.where(rng.integers(0, 2, len(news)) == 1, ends, ends + rng.integers(1, 500, len(news)))
        chunks = [(Prompt(int(c), int(t)), int(n)) for c, n, t in zip(cached, news, targets)]
        prefill_tokens, pairs, prefill_kv, completed, padding, longest = prefill_sums(chunks, window or None,
                                                                                     local_share, tile,
                                                                                     query_tile_pairs)
        start_s, used, running, queued = 0.01 * i, i % 5000, seqs + i % 3, i % 17
        duration_s, flops, moved = cost.step(prefill_tokens, pairs, prefill_kv, completed, seqs, kv_read, padding,
                                             longest)
        reference.add(start_s, duration_s, seqs, len(chunks), prefill_tokens, seqs + completed, flops, moved, used,
                      running, queued, 0, 0, 0, 0.0)
        terms = cost.step_terms(prefill_tokens + seqs, seqs + completed)
        assert terms is not None                      # step just priced these tokens and rows
        rows = np.column_stack([cached, news, targets]).astype(np.int64).reshape(-1)
        assert fast.step_entry(fast.doubles, fast.at, start_s, used, running, queued, stacked, n_ops, x, rows,
                               len(chunks), window, local_share, tile, query_tile_pairs, seqs, kv_read,
                               *terms) == duration_s
        fast.row_added()
    assert all(np.array_equal(a.view(np.int64), b.view(np.int64)) for a, b in zip(fast.views(), reference.views()))


@pytest.mark.parametrize("overrides", [
    {},                                                                     # one engine, kernel terms
    {"deployment": {"pipeline_parallel": 4}, "workload": {"num_requests": 300}},   # four sharing a KV cache
    {"engine": {"chunked_prefill": False}, "workload": {"num_requests": 300}},
    # a burst of short prompts: 255 chunks in its first iteration, past the room the engine first holds for their rows
    {"engine": {"max_num_seqs": 256}, "workload": {
        "prompt_tokens": 16, "output_tokens": {"distribution": "exponential", "mean": 64, "max": 1000},
        "num_requests": 1500, "arrival": {"rate": 1e6}}},
    {"model": "Qwen3-30B-A3B", "hardware": "H200",                        # eight expert-parallel ranks
     "deployment": {"tensor_parallel": 1, "pipeline_parallel": 1,
                    "expert_parallel": {"degree": 8, "routing": {"distribution": "zipf", "exponent": 0.6}}},
     "workload": {"num_requests": 300, "arrival": {"process": "poisson", "rate": 20.0}}},
    # traffic classes under preemptive priority, preempting for waiting requests before iterations
    {"engine": {"max_num_seqs": 16, "max_batch_tokens": 643, "scheduling_policy": "preemptive_priority"},
     "workload": {"num_requests": 400, "arrival": {"rate": 5.0}, "classes": {
         "interactive": {"share": 0.3},
         "standard": {"share": 0.4, "prompt_tokens": {"distribution": "lognormal", "mean": 1024, "sigma": 0.8,
                                                      "max": 8192}},
         "batch": {"share": 0.3, "prompt_tokens": {"distribution": "lognormal", "mean": 2048, "sigma": 0.6,
                                                   "max": 8192},
                   "output_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.6, "max": 2048}}}}},
])
def test_the_engine_s_one_call_steps_change_no_record(overrides, monkeypatch):
    """A run whose iterations are priced and logged in one call (decode-only ones, the engine's steady state, and
    those with prompt chunks where the cost model remembers the step's terms) has the records and iteration table
    of the same run through the general path (decode_step's or step's price, add())."""
    scenario = make_scenario(overrides)
    one_call = {"log_step": 0, "log_decode_step": 0}

    def counting(name):
        step = getattr(EventDecodeSet, name)

        def counted(*args):
            one_call[name] += 1
            return step(*args)
        return counted
    for name in one_call:
        monkeypatch.setattr(EventDecodeSet, name, counting(name))
    fast = simulate(scenario, force=True)
    assert min(one_call.values()) > 100             # both one-call steps taken (a preemptive policy's too)
    # A decode set that offers neither one-call step: the engine's general path for every iteration.
    for name in one_call:
        monkeypatch.setattr(EventDecodeSet, name, None)
    general = simulate(scenario, force=True)
    assert fast.iterations["decode_seqs"].gt(0).mean() > 0.5
    assert fast.iterations["prefill_seqs"].gt(0).sum() > 200
    pd.testing.assert_frame_equal(fast.requests, general.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.iterations, general.iterations, check_exact=True)
    if scenario.engine.scheduling_policy is SchedulingPolicy.PREEMPTIVE_PRIORITY:
        assert fast.preemptions > 0
