"""The compiled phases of a speculative decode step equal their vectorised definitions, exactly.

The simulator's speculative step runs as numba kernels (``cost.features.speculative_step_sums``,
``sim.speculative_kernels``); runs must not depend on that, so each kernel is checked here
against the numpy builders and rules it replaced, on random batches, value for value.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers import add_prefill, chunk_sums
from llmsim.cost.features import (F, FEATURES, batch_rows, sequential_decode_rows,
                                  speculative_step_sums, visible)
from llmsim.sim.speculative_decode import _STEP_COLUMNS, DecodeSlots
from llmsim import CostModel, model_catalog
from llmsim.catalog.hardware import HardwareProfile
from llmsim.sim.speculative_kernels import (FLOAT_COLUMNS, INT_COLUMNS, advance_rows, eligible_rows, price_step,
                                            reserve_blocks, tree_extras)
from llmsim.speculation.kernels import observe_windows
from llmsim.speculation.policies import MAX_BACKOFF, NO_WINDOWS


def _batch(rng, n, k_max=8):
    k = rng.integers(0, k_max + 1, n) * (rng.random(n) < 0.8)        # some sequences decode plainly
    context = rng.integers(1, 5000, n)
    lag = rng.integers(1, 4, n)
    return k.astype(np.int64), context.astype(np.int64), lag.astype(np.int64)


@pytest.mark.parametrize("window, local_share", [(0, 1.0), (300, 1.0), (300, 0.5)],
                         ids=["no-window", "every-layer", "half-the-layers"])
@pytest.mark.parametrize("draft", [True, False])
def test_step_sums_equal_the_vectorised_builders(window, local_share, draft):
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(1, 70))
        k, context, lag = _batch(rng, n)
        prompt = (float(rng.integers(0, 3000)), float(rng.integers(0, 10 ** 6)), float(rng.integers(0, 5000)))
        chunks = bool(trial % 3)
        rows = np.full((8 if draft else 0, len(FEATURES)), np.nan)          # stale values must not leak
        got = speculative_step_sums(n, k, context, window, lag, rows, *prompt, chunks, local_share)
        # The definition: verify chunks of k + 1 over the visible context, plain rows read context + 1
        # (on half the layers the mean (c + W) / 2 of a global and a local layer: halves, still exact).
        seen = visible(context, window, local_share)
        spec = k > 0
        tokens, pairs, kv_read = chunk_sums(k[spec] + 1, seen[spec]) if spec.any() else (0.0, 0.0, 0.0)
        decode_kv = float(visible(context[~spec] + 1, window, local_share).sum())
        assert got[:6] == (tokens, pairs, kv_read, int(spec.sum()), int(k.sum()), decode_kv)
        if not draft or not (spec.any() or chunks):
            assert got[6] == 0
            continue
        if spec.any():
            expected = sequential_decode_rows(k[spec], seen[spec], int(k.max()))
            behind = lag[spec] - 1
            if behind.any():
                cs = seen[spec]
                add_prefill(expected[0], behind.sum(), (behind * cs).sum(), ((cs + behind) * (behind > 0)).sum())
        else:
            expected = batch_rows()[None, :]
        if chunks:
            add_prefill(expected[0], *prompt)
        assert got[6] == len(expected)
        assert np.array_equal(rows[:got[6]], expected)


def _reserve_reference(chosen, eligible, remaining, context, blocks, budget, size):
    """The numpy rule: cap at remaining - 1, lower a common cap until the budget holds, then block needs."""
    k = np.where(eligible, np.minimum(chosen, remaining - 1), 0) if chosen is not None else np.zeros_like(context)
    if k.sum() > budget:
        cap = int(k.max())
        while cap > 0 and np.minimum(k, cap).sum() > budget:
            cap -= 1
        k = np.minimum(k, cap)
    need = np.maximum(-(-(context + k + 1) // size) - blocks, 0)
    return k, need


def test_reservation_caps_and_needs_equal_the_numpy_rule():
    rng = np.random.default_rng(11)
    size = 16
    for trial in range(300):
        n = int(rng.integers(1, 60))
        ints = np.zeros((len(INT_COLUMNS), 64), dtype=np.int64)
        column = dict(zip(INT_COLUMNS, ints))
        column["context"][:n] = rng.integers(1, 3000, n)
        column["remaining"][:n] = rng.integers(1, 10, n)
        column["blocks"][:n] = -(-column["context"][:n] // size) + rng.integers(0, 2, n)
        # The policy's k for every row of the slots' capacity (a policy returns its whole row): only the first n count.
        chosen = rng.integers(0, 9, 64).astype(np.int64) if trial % 4 else None
        eligible = np.ones(64, dtype=bool)          # the scratch column: stale marks beyond n
        min_sequence_tokens = 32 * int(rng.integers(0, 60))
        # Every other trial the reservation marks eligibility itself (a policy that chooses without reading it).
        marks = trial % 2 == 0
        expected = (np.asarray(column["context"][:n]) + 1 > min_sequence_tokens)
        count = -1 if marks else eligible_rows(n, ints, min_sequence_tokens, eligible)
        budget = int(rng.integers(0, 200))
        free = int(rng.integers(0, 80))
        before = column["blocks"][:n].copy()
        k, need = _reserve_reference(None if chosen is None else chosen[:n], expected, column["remaining"][:n],
                                     column["context"][:n], before, budget, size)
        needed, drafted, reserved, marked = reserve_blocks(n, chosen, eligible, ints, budget, size, free, 1,
                                                           min_sequence_tokens if marks else -1)
        assert np.array_equal(eligible[:n], expected)
        assert (marked if marks else count) == expected.sum()
        assert marked == (expected.sum() if marks else -1)
        assert (needed, drafted, reserved) == (int(need.sum()), int(k.sum()), int(need.sum()) <= free)
        assert np.array_equal(column["k"][:n], k)
        assert np.array_equal(column["blocks"][:n], before + need if reserved else before)


def test_advance_emits_rolls_back_and_lists_the_finished_last_first():
    ints = np.zeros((len(INT_COLUMNS), 8), dtype=np.int64)
    floats = np.zeros((len(FLOAT_COLUMNS), 8))
    column = dict(zip(INT_COLUMNS, ints)) | dict(zip(FLOAT_COLUMNS, floats))
    n, size = 4, 16
    column["k"][:n] = [4, 4, 0, 2]
    column["accepted"][:n] = [4, 1, 0, 2]
    column["context"][:n] = [100, 30, 47, 63]
    column["blocks"][:n] = [7, 3, 3, 5]                  # reserved for context + k + 1
    column["remaining"][:n] = [5, 9, 1, 3]
    column["lag"][:n] = [1, 1, 3, 1]
    column["last_token_s"][:n] = [1.0, 1.0, 0.5, 1.0]
    runs = np.zeros((8, 3))
    speculated, finished_rows = np.zeros(8, dtype=bool), np.zeros(8, dtype=np.int64)
    freed, emitted, finished, count = advance_rows(n, 2.0, ints, floats, speculated, finished_rows, size, runs, 0,
                                                   NO_WINDOWS)
    assert list(column["context"][:n]) == [105, 32, 48, 66] and emitted == 5 + 2 + 1 + 3
    assert list(column["blocks"][:n]) == [7, 2, 3, 5] and freed == 1
    assert list(column["lag"][:n]) == [2, 1, 4, 2]        # all accepted: the draft has not seen its last token
    assert list(finished_rows[:finished]) == [3, 2, 0]    # remaining 0, last row first
    assert list(speculated[:n]) == [True, True, False, True]
    # Gaps in runs of equal values, in row order: 1.0, 1.0, then 1.5, then 1.0.
    assert count == 3 and runs[:3].tolist() == [[2.0, 1.0, 2.0], [2.0, 1.5, 1.0], [2.0, 1.0, 1.0]]
    assert list(column["max_gap_s"][:n]) == [1.0, 1.0, 1.5, 1.0] and list(column["last_token_s"][:n]) == [2.0] * 4


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), window=st.integers(1, 4), raise_above=st.floats(0.0, 1.0, allow_subnormal=False),
       lower_below=st.floats(0.0, 1.0, allow_subnormal=False), k_max=st.integers(1, 8), fallback=st.booleans())
def test_advance_applies_the_adaptive_windows_as_the_policy_observed_them(seed, window, raise_above, lower_below,
                                                                          k_max, fallback):
    """Steps closed with the per-request adaptive rule folded into :func:`advance_rows` leave every column
    as closing them without it and then running the rule's Python body over the step's columns (what the
    policy's observe did after each step), through windows that end, raise, lower, fall back and probe."""
    rng = np.random.default_rng(seed)
    n, size = int(rng.integers(1, 13)), 16
    windows = (window, MAX_BACKOFF, raise_above, lower_below, k_max, fallback)
    fused = (np.zeros((len(INT_COLUMNS), 16), dtype=np.int64), np.zeros((len(FLOAT_COLUMNS), 16)))
    column = dict(zip(INT_COLUMNS, fused[0]))
    column["k_policy"][:n] = rng.integers(0 if fallback else 1, k_max + 1, n)
    column["backoff"][:n] = rng.integers(0, MAX_BACKOFF + 2, n)
    column["lag"][:n] = 1
    apart = (fused[0].copy(), fused[1].copy())
    for step in range(12):
        k = np.minimum(rng.integers(0, k_max + 1, n), column["k_policy"][:n] * (rng.random(n) < 0.9))
        accepted = rng.integers(0, k + 1)
        context, remaining = rng.integers(1, 3000, n), k + 1 + rng.integers(0, 3, n)
        for ints, _ in (fused, apart):
            ints[INT_COLUMNS.index("k"), :n], ints[INT_COLUMNS.index("accepted"), :n] = k, accepted
            ints[INT_COLUMNS.index("context"), :n] = context
            ints[INT_COLUMNS.index("blocks"), :n] = -(-(context + k + 1) // size)
            ints[INT_COLUMNS.index("remaining"), :n] = remaining
        outcomes = []
        for (ints, floats), rule in ((fused, windows), (apart, NO_WINDOWS)):
            speculated, finished_rows, runs = np.zeros(16, dtype=bool), np.zeros(16, dtype=np.int64), np.zeros((16, 3))
            returned = advance_rows(n, 1.0 + step, ints, floats, speculated, finished_rows, size, runs, 0, rule)
            if rule is NO_WINDOWS:
                c = dict(zip(INT_COLUMNS, ints))
                observe_windows.py_func(n, c["k"][:n], c["accepted"][:n], speculated[:n], c["k_policy"],
                                        c["window_proposed"], c["window_accepted"], c["window_rounds"], c["backoff"],
                                        *windows)
            outcomes.append((returned, speculated.tolist(), finished_rows[:returned[2]].tolist(), runs.tolist()))
        assert outcomes[0] == outcomes[1]
        assert np.array_equal(fused[0], apart[0]) and np.array_equal(fused[1], apart[1])
    assert column["window_rounds"][:n].max() < window << MAX_BACKOFF   # each window closed when it was due


def test_decode_slots_declares_the_columns_it_sets():
    """DecodeSlots declares its columns for the type checker; they are exactly the ones _grow sets, each
    with its values (an int column is a row of ``ints``, a float column one of ``floats``); its class
    attributes with values (the kernels' entry points) are not columns."""
    slots = DecodeSlots(4)
    step_columns = {name for name, _ in _STEP_COLUMNS}
    declared = {name for name in DecodeSlots.__annotations__ if name not in vars(DecodeSlots)}
    assert declared == set(INT_COLUMNS) | set(FLOAT_COLUMNS) | step_columns
    for row, name in enumerate(INT_COLUMNS):
        assert np.shares_memory(getattr(slots, name), slots.ints[row])
    for row, name in enumerate(FLOAT_COLUMNS):
        assert np.shares_memory(getattr(slots, name), slots.floats[row])


def _separate_calls(target, draft, n, k, context, window, lag, rows, prompt, chunks, logits, local_share, branching,
                    sequential, prompt_terms=(0.0, 0.0)):
    """A speculative step priced as it was before :func:`price_step`: the sums, the tree's extras, the
    target's ``step`` and the draft's ``rows_total``, one call each (``prompt_terms``: the prompt chunks'
    tile padding and longest keys)."""
    tokens, pairs, kv_read, n_spec, proposed, decode_kv, steps = speculative_step_sums(
        n, k, context, window, lag, rows, *prompt, chunks, local_share, *prompt_terms)
    if branching > 1 and n_spec:
        extra_tokens, extra_pairs = tree_extras(n, k, context, window, branching, rows, steps if sequential else 0,
                                                local_share)
        tokens, pairs, kv_read = tokens + extra_tokens, pairs + extra_pairs, kv_read + extra_tokens
    if not sequential:
        steps = min(steps, 1)
    price = target.step(prompt[0] + tokens, prompt[1] + pairs, prompt[2] + kv_read, logits + tokens, n - n_spec,
                        decode_kv, *prompt_terms)
    draft_price = draft.rows_total(rows[:steps]) if steps and draft is not None else (np.nan, 0.0, 0.0)
    return (n_spec, proposed, steps, *price, *draft_price)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-all-reduce"])
@pytest.mark.parametrize("window, local_share", [(0, 1.0), (300, 0.5)], ids=["no-window", "half-the-layers"])
@pytest.mark.parametrize("branching, sequential, draft_model", [(1, True, True), (2, True, True), (1, False, False)],
                         ids=["chain", "tree", "heads-priced-outside"])
def test_fused_price_equals_the_separate_calls(h100: HardwareProfile, tp, window, local_share, branching, sequential,
                                               draft_model):
    catalog = model_catalog()
    target = CostModel(catalog["Llama-3.1-8B"], h100, tensor_parallel=tp)
    draft = CostModel(catalog["Llama-3.2-1B"], h100) if draft_model else None
    stacked, n_ops, x, tables = target.compiled_terms()
    if draft is not None:
        draft_stacked, draft_n_ops, _, draft_tables = draft.compiled_terms()
    else:
        draft_stacked, draft_n_ops, draft_tables = np.zeros((0, 0)), -1, [np.zeros(0), np.zeros(0)]
    rng = np.random.default_rng(11)
    for trial in range(150):
        n = int(rng.integers(0, 70))
        k, context, lag = _batch(rng, n, k_max=4 if branching > 1 else 8)
        prompt = (float(rng.integers(0, 3000)), float(rng.integers(0, 10 ** 6)), float(rng.integers(0, 5000)))
        chunks, logits = bool(trial % 3), int(rng.integers(0, 4))
        prompt_terms = (prompt[0] % 4096, prompt[2])       # tile padding, longest keys
        rows, expected_rows = (np.full((8, len(FEATURES)), np.nan) for _ in range(2))
        expected = _separate_calls(target, draft, n, k, context, window, lag, expected_rows, prompt, chunks, logits,
                                   local_share, branching, sequential, prompt_terms)
        # The draft's rows_total filled its tables; the target's step keeps its own memos, so a first fused
        # call may miss, as in the engine, which then tabulates the row it left in ``x`` and calls again.
        for _ in range(2):
            got = price_step(n, k, context, window, lag, rows, *prompt, chunks, logits, *prompt_terms, local_share,
                             branching, sequential, False, stacked, n_ops, x, tables[0], tables[1], draft_stacked,
                             draft_n_ops, draft_tables[0], draft_tables[1])
            if not np.isnan(got[3]):
                break
            assert target.tabulate_last_step()
        assert got[:6] == expected[:6]
        assert got[6:] == expected[6:] or (np.isnan(got[6]) and np.isnan(expected[6]))
        assert np.array_equal(rows[:got[2]], expected_rows[:got[2]])


@pytest.mark.parametrize("tp", [1, 4])
def test_batch_expansion_prices_each_chain_as_k_plus_one_decode_sequences(h100: HardwareProfile, tp):
    """vLLM V0's batch expansion (vllm/spec_decode/batch_expansion.py) scores a sequence's k drafts as k + 1
    one-token decode sequences over its context and the drafts before each: the step costs what the target's
    decode of those sequences costs, each reading its whole KV cache (``sum_j (context + j)``, j = 1..k + 1),
    beside the plain sequences and the iteration's prompt chunks."""
    target = CostModel(model_catalog()["Llama-3.1-8B"], h100, tensor_parallel=tp)
    stacked, n_ops, x, tables = target.compiled_terms()
    no_draft = (np.zeros((0, 0)), -1, np.zeros(0), np.zeros(0))
    rng = np.random.default_rng(29)
    for _ in range(60):
        n = int(rng.integers(1, 70))
        k, context, lag = _batch(rng, n)
        prompt = (float(rng.integers(0, 3000)), float(rng.integers(0, 10 ** 6)), float(rng.integers(0, 5000)))
        logits = int(rng.integers(0, 4))
        spec = k > 0
        expanded = int((k[spec] + 1).sum())
        kv = float(sum(context[i] + j for i in np.flatnonzero(spec) for j in range(1, k[i] + 2)))
        plain_kv = float((context[~spec] + 1).sum())
        expected = target.step(prompt[0], prompt[1], prompt[2], logits, int((~spec).sum()) + expanded,
                               plain_kv + kv)
        for _ in range(2):
            got = price_step(n, k, context, 0, lag, np.zeros((0, len(FEATURES))), *prompt, True, logits, 0.0, 0.0,
                             1.0, 1, False, True, stacked, n_ops, x, tables[0], tables[1], *no_draft)
            if not np.isnan(got[3]):
                break
            assert target.tabulate_last_step()
        assert got[3:6] == pytest.approx(expected, rel=1e-12)


def test_fused_price_reports_a_count_missing_from_the_tables(h100: HardwareProfile):
    """A token count the target's tables do not hold yet gives NaN (the engine tabulates it and prices
    again), never a price without its GEMM terms."""
    cost = CostModel(model_catalog()["Llama-3.1-8B"], h100, tensor_parallel=4)
    stacked, n_ops, x, tables = cost.compiled_terms()
    k, context, lag = (np.array([3, 0], dtype=np.int64), np.array([100, 200], dtype=np.int64),
                       np.ones(2, dtype=np.int64))
    rows = np.zeros((4, len(FEATURES)))
    # (The tables are filled whole as they grow, and shared with other tests' cost models: a count past their end.)
    prompt = float(max(len(tables[0]), 12345))
    tokens = 4 + 1 + prompt                      # verify chunk, plain decode, prompt
    no_draft = (np.zeros((0, 0)), -1, np.zeros(0), np.zeros(0))

    def fused():
        return price_step(2, k, context, 0, lag, rows, prompt, 0.0, 0.0, True, 1, 0.0, 0.0, 1.0, 1, True, False,
                          stacked, n_ops, x, tables[0], tables[1], *no_draft)
    assert np.isnan(fused()[3])
    assert x[F["tokens"]] == tokens
    assert cost.tabulate_last_step()
    assert fused()[3] == cost.step(prompt + 4, 4 * 100 + 10, 100 + 4, 1 + 4, 1, 201)[0]
