"""The compiled phases of a speculative decode step equal their vectorised definitions, exactly.

The simulator's speculative step runs as numba kernels (``cost.features.speculative_step_sums``,
``sim.speculative_kernels``); runs must not depend on that, so each kernel is checked here
against the numpy builders and rules it replaced, on random batches, value for value.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import add_prefill, chunk_sums
from llmsim.cost.features import (FEATURES, batch_rows, sequential_decode_rows,
                                  speculative_step_sums, visible)
from llmsim.sim.speculative_decode import _STEP_COLUMNS, DecodeSlots
from llmsim.sim.speculative_kernels import FLOAT_COLUMNS, INT_COLUMNS, advance_rows, eligible_rows, reserve_blocks


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
        chosen = rng.integers(0, 9, n).astype(np.int64) if trial % 4 else None
        eligible = np.zeros(64, dtype=bool)
        min_sequence_tokens = 32 * int(rng.integers(0, 60))
        # Every other trial the reservation marks eligibility itself (a policy that chooses without reading it).
        marks = trial % 2 == 0
        expected = (np.asarray(column["context"][:n]) + 1 > min_sequence_tokens)
        count = -1 if marks else eligible_rows(n, ints, min_sequence_tokens, eligible)
        budget = int(rng.integers(0, 200))
        free = int(rng.integers(0, 80))
        before = column["blocks"][:n].copy()
        k, need = _reserve_reference(chosen, expected, column["remaining"][:n], column["context"][:n],
                                     before, budget, size)
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
    freed, emitted, finished, count = advance_rows(n, 2.0, ints, floats, speculated, finished_rows, size, runs, 0)
    assert list(column["context"][:n]) == [105, 32, 48, 66] and emitted == 5 + 2 + 1 + 3
    assert list(column["blocks"][:n]) == [7, 2, 3, 5] and freed == 1
    assert list(column["lag"][:n]) == [2, 1, 4, 2]        # all accepted: the draft has not seen its last token
    assert list(finished_rows[:finished]) == [3, 2, 0]    # remaining 0, last row first
    assert list(speculated[:n]) == [True, True, False, True]
    # Gaps in runs of equal values, in row order: 1.0, 1.0, then 1.5, then 1.0.
    assert count == 3 and runs[:3].tolist() == [[2.0, 1.0, 2.0], [2.0, 1.5, 1.0], [2.0, 1.0, 1.0]]
    assert list(column["max_gap_s"][:n]) == [1.0, 1.0, 1.5, 1.0] and list(column["last_token_s"][:n]) == [2.0] * 4


def test_decode_slots_declares_the_columns_it_sets():
    """DecodeSlots declares its columns for the type checker; they are exactly the ones _grow sets, each
    with its values (an int column is a row of ``ints``, a float column one of ``floats``)."""
    slots = DecodeSlots(4)
    step_columns = {name for name, _ in _STEP_COLUMNS}
    assert set(DecodeSlots.__annotations__) == set(INT_COLUMNS) | set(FLOAT_COLUMNS) | step_columns
    for row, name in enumerate(INT_COLUMNS):
        assert np.shares_memory(getattr(slots, name), slots.ints[row])
    for row, name in enumerate(FLOAT_COLUMNS):
        assert np.shares_memory(getattr(slots, name), slots.floats[row])
