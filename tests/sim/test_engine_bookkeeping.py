"""The engine's event-driven bookkeeping against a brute-force recount at every iteration.

The one-token decode set never walks its decoding sequences: it keeps the batch's total
context and each sequence's blocks in closed form and counts the blocks due at a step by its
phase. Here an observer
recomputes, after every iteration, the same quantities the slow way from the requests
themselves, and they must agree exactly.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest


from llmsim.sim import decode as decode_module
from tests.helpers import make_scenario, simulate_checked


@pytest.mark.parametrize("overrides", [
    {"engine": {"memory_utilization": 0.25, "max_model_len": 8192},                         # preempting
     "workload": {"arrival": {"rate": 30.0}}},
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
        # (the decode set counts a decoding sequence's blocks in closed form: decode.blocks)
        assert all(decode.blocks(r) == -(-c // size) for r, c in zip(decoding, contexts))
        held = sum(decode.blocks(r) for r in engine.running.values())
        assert held == engine.kv.used_blocks
        checked["iterations"] += 1

    result = simulate_checked(make_scenario(overrides), observers=[recount])
    assert checked["iterations"] == len(result.iterations)
    assert (result.requests["status"] == "finished").all()
    if "model" not in overrides:
        assert result.preemptions > 0


def test_longest_inter_token_gap_matches_the_token_times_rebuilt_from_the_iterations():
    """The decode set looks up a sequence's longest gap in suffix maxima of the step gaps. Rebuilt
    here from the iterations table alone: a request that was never preempted has its first token
    at ``first_token_s`` and then one at the end of every decoding iteration up to ``finish_s``
    (one engine, chunked prefill: every iteration with decoders steps all of them). Prompts of
    very different lengths make the gaps rise and fall."""
    result = simulate_checked(make_scenario({
        "engine": {"max_batch_tokens": 1024},
        "workload": {"arrival": {"rate": 12.0}, "num_requests": 400,
                     "prompt_tokens": {"distribution": "uniform", "low": 50, "high": 6000},
                     "output_tokens": {"distribution": "uniform", "low": 2, "high": 400}}}))
    steps = result.iterations.loc[result.iterations["decode_seqs"] > 0, "end_s"].to_numpy()
    requests = result.requests[(result.requests["status"] == "finished") & (result.requests["preemptions"] == 0)]
    assert len(requests) > 300
    for request in requests.itertuples():
        decoded = steps[(steps > request.first_token_s) & (steps <= request.finish_s)]
        times = np.concatenate([[request.first_token_s], decoded])
        assert len(times) == request.output_tokens
        assert request.max_itl_s == (np.diff(times).max() if len(times) > 1 else 0.0)


def test_dropping_the_decode_steps_no_sequence_reads_changes_no_record_or_gap(monkeypatch):
    """The decode set hands the gaps of steps before the oldest decoding sequence's first one to the
    engine and drops them when its step table fills. Started tiny (it fills every few steps, while
    sequences are preempted and recomputed), it gives the records and inter-token gaps of a set that
    never drops a step, and holds no more steps than a few times the longest decode run."""
    scenario = make_scenario({"engine": {"memory_utilization": 0.25, "max_model_len": 8192},
                              "workload": {"arrival": {"rate": 30.0}, "num_requests": 600}})
    monkeypatch.setattr(decode_module, "STEP_ARRAY", 1 << 22)
    kept = simulate_checked(scenario)
    held = {"steps": 0}

    def watch(engine, iteration):
        held["steps"] = max(held["steps"], len(engine.decode._steps))

    monkeypatch.setattr(decode_module, "STEP_ARRAY", 2)
    dropped = simulate_checked(scenario, observers=[watch])
    assert kept.preemptions > 0 and len(kept.iterations) > 1000
    assert dropped.requests.to_csv(index=False) == kept.requests.to_csv(index=False)
    start, stop = 0.0, kept.end_s
    for a, b in zip(dropped.inter_token_gaps.in_window(start, stop), kept.inter_token_gaps.in_window(start, stop)):
        np.testing.assert_array_equal(a, b)
    longest_run = int(kept.requests["output_tokens"].max()) + 1
    assert held["steps"] <= 4 * longest_run


def test_the_compiled_longest_gap_is_numpy_s_maximum_of_the_rows_gaps():
    """``_longest_gap``'s entry point reads the largest gap of rows ``first .. last - 1`` as numpy's ``max``
    does, wherever the largest lies (first row, last row, ties, each of its four running maxima's rows, the rows
    after the last full four) and for a single row."""
    rng = np.random.default_rng(7)
    steps = rng.random((300, 3))
    steps[40:60, decode_module.GAP] = 0.5                      # ties
    entry = decode_module._longest_gap.compile(decode_module._LONGEST_GAP_SIGNATURE)
    every_length = [(first, first + length) for first in range(100, 104) for length in range(1, 12)]
    for first, last in [(0, 1), (0, 300), (5, 6), (40, 60), (39, 61), *every_length,
                        *rng.integers(0, 150, (40, 2)) + [0, 150]]:
        assert entry(steps, int(first), int(last)) == steps[first:last, decode_module.GAP].max()


@pytest.mark.parametrize("overrides", [
    {"engine": {"memory_utilization": 0.25, "max_model_len": 8192},                         # preempting
     "workload": {"arrival": {"rate": 30.0}}},
    {"deployment": {"replicas": 3}, "engine": {"max_batch_tokens": 1024},                   # three replicas
     "workload": {"arrival": {"rate": 20.0}, "num_requests": 600,
                  "prompt_tokens": {"distribution": "uniform", "low": 50, "high": 6000},
                  "output_tokens": {"distribution": "uniform", "low": 2, "high": 400}}},
])
def test_the_compiled_longest_gap_changes_no_record(overrides, monkeypatch):
    """Whole runs whose finishing sequences read their longest gap through the compiled entry point have the
    records and iterations of the same runs reading it with numpy's ``max``."""
    scenario = make_scenario(overrides)
    compiled = simulate_checked(scenario)
    monkeypatch.setattr(decode_module.EventDecodeSet, "_longest_gap_entry",
                        staticmethod(lambda steps, first, last: float(steps[first:last, decode_module.GAP].max())))
    reference = simulate_checked(scenario)
    assert (compiled.requests["max_itl_s"] > 0).mean() > 0.5
    pd.testing.assert_frame_equal(compiled.requests, reference.requests, check_exact=True)
    pd.testing.assert_frame_equal(compiled.iterations, reference.iterations, check_exact=True)


def test_a_dispatching_timeout_never_reached_gives_the_run_without_one():
    # A dispatching timeout longer than the run forces no fit, so the run is the run without one (Queueing.admit's
    # rule). Chunked prefill with 1,024 batch tokens at 30/s: heads are refused or cut to the budget's rest, so the
    # longest wait of such a head (dispatch_wait_s) is set in both runs, and alike. Records and iterations alike.
    from llmsim.scenario.variants import variant
    from llmsim.sim.simulate import simulate_whole
    scenario = make_scenario({"engine": {"max_batch_tokens": 1024}, "workload": {"arrival": {"rate": 30.0},
                              "num_requests": 400}})
    untimed = simulate_whole(scenario)
    general = simulate_whole(variant(scenario, {"engine.queue_timeout": "100000 s"}))
    assert 0 < untimed.dispatch_wait_s == general.dispatch_wait_s
    pd.testing.assert_frame_equal(untimed.requests, general.requests)
    pd.testing.assert_frame_equal(untimed.iterations, general.iterations)


@pytest.mark.parametrize("admission", ["preempt", "guaranteed_no_evict"])
def test_a_speculative_engines_held_blocks_are_what_its_cache_lends(admission):
    """The speculative set keeps a decoding sequence's blocks in its row: what the admission tests read
    (``decode.blocks``) sums, over the running requests, to the blocks the cache has lent, at every iteration."""
    checked = {"iterations": 0, "stale": 0}

    def recount(engine, iteration):
        running = list(engine.running.values())
        assert sum(engine.decode.blocks(r) for r in running) == engine.kv.used_blocks
        checked["stale"] += sum(engine.decode.blocks(r) != r.blocks for r in running)
        checked["iterations"] += 1

    scenario = make_scenario({"engine": {"memory_utilization": 0.3, "max_model_len": 8192, "admission": admission},
                              "workload": {"arrival": {"rate": 20.0}, "num_requests": 300},
                              "speculation": {"draft": "Llama-3.2-1B", "k": 4,
                                              "acceptance": {"process": "bernoulli", "alpha": 0.7}}})
    result = simulate_checked(scenario, observers=[recount])
    assert checked["iterations"] == len(result.iterations)
    assert checked["stale"] > 0               # rows whose blocks moved on from what the request started with
    assert (result.requests["status"] == "finished").all()
