"""The batch features: every way of building a row agrees with the definition from sequence lengths."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from tests.helpers import add_prefill, chunk_sums
from llmsim.cost.features import (F, FEATURES, attention_pairs, batch_features, batch_rows, causal_tile_padding,
                                  prefill_sums, sequential_decode_rows, set_iterations, visible,
                                  windowed_context_sum)
from llmsim.cost.features import chunk_sums as chunk_sums_kernel

DENSE = model_catalog()["Llama-3.1-8B"]
MOE = model_catalog()["Mixtral-8x7B"]
WINDOWED = replace(DENSE, sliding_window=300)


class Chunk:
    def __init__(self, prefilled, prefill_target):
        self.prefilled, self.prefill_target = prefilled, prefill_target


def test_attention_pairs_count_every_causal_query_key_pair():
    for cached, new in [(0, 1), (0, 512), (1000, 7), (37, 200)]:
        brute = sum(cached + i + 1 for i in range(new))      # query i sees the cache and positions 0..i
        assert attention_pairs(new, cached) == brute
    # Several chunks whose contexts sum to `seen`: the sum of their pairs.
    assert attention_pairs(4, 10 + 20 + 30, chunks=3) == sum(attention_pairs(4, c) for c in (10, 20, 30))


def test_windowed_context_sum_is_the_sum_it_names():
    for first, last, window in [(5, 20, None), (5, 20, 12), (30, 40, 12), (8, 7, 12), (1, 1, 1)]:
        brute = sum(min(c, window) if window else c for c in range(first, last + 1))
        assert windowed_context_sum(np.array(first), np.array(last), window) == brute


@pytest.mark.parametrize("model", [DENSE, MOE, WINDOWED], ids=["dense", "moe", "window"])
def test_the_simulators_scalar_row_equals_the_definition(model):
    prefill = [(Chunk(0, 800), 512), (Chunk(400, 450), 50), (Chunk(1000, 3000), 100)]
    decode_context = [10, 250, 299, 300, 5000]
    tokens, pairs, kv, completed, padding, longest = prefill_sums(prefill, model.sliding_window, tile=64)
    assert completed == 1
    decode_kv = sum(visible(c + 1, model.sliding_window) for c in decode_context)
    expected = batch_features([c for _, c in prefill], [r.prefilled for r, _ in prefill], decode_context,
                              completed, model, tile=64)
    # The simulator builds the row inside the cost model's step: priced as the definition's row is.
    cost = CostModel(model, lookup_hardware("H100-SXM"))
    assert (cost.step(tokens, pairs, kv, completed, len(decode_context), decode_kv, padding, longest)
            == cost.iteration(expected))
    assert expected[F["logit_tokens"]] == len(decode_context) + 1 and expected[F["one"]] == 1


def test_vector_rows_equal_scalar_rows():
    rng = np.random.default_rng(0)
    sums = rng.integers(0, 5000, size=(20, 6)).astype(float)
    rows = batch_rows(*sums.T, model=MOE)
    assert rows.shape == (20, len(FEATURES))
    cost = CostModel(MOE, lookup_hardware("H100-SXM"))
    for i in range(20):
        assert np.allclose(cost.step(*sums[i]), cost.iteration(rows[i]), rtol=1e-15)
    # Spread over iterations: the fixed term and the experts count per iteration.
    spread = set_iterations(rows.copy(), 4.0, MOE)
    assert np.all(spread[:, F["one"]] == 4.0)
    assert np.allclose(spread[:, F["experts_touched"]], 4 * MOE.expected_experts_touched(rows[:, F["tokens"]] / 4))


def test_verify_chunks_and_draft_steps():
    # A verify step is a (k + 1)-position chunk per sequence that does not end a prompt.
    k, seen = np.array([3, 1, 4]), np.array([100, 20, 7])
    as_prefill = prefill_sums([(Chunk(int(c), 10 ** 6), int(t)) for c, t in zip(seen, k + 1)], None)
    assert chunk_sums(k + 1, seen) == as_prefill[:3]
    # The draft's step j decodes one token for every sequence with k > j, over context + j.
    rows = sequential_decode_rows(k, seen, int(k.max()))
    for j in range(int(k.max())):
        contexts = [int(c) + j for c, kk in zip(seen, k) if kk > j]
        assert np.array_equal(rows[j], batch_features([], [], contexts, 0, DENSE))
    row = add_prefill(rows[0].copy(), 5, 50, 25)
    assert row[F["tokens"]] == rows[0][F["tokens"]] + 5 and row[F["prefill_pairs"]] == 50


def test_causal_tile_padding_counts_the_tiles_a_causal_chunk_touches():
    """Chunk ``c`` after ``s`` cached tokens in ``t x t`` tiles: every (query tile, key tile) pair with a key its
    tile's queries see is computed whole; the padding is those tiles' pairs less the causal pairs, counted here tile
    by tile (query tiles from the chunk's first position)."""
    for tile in (64, 128):
        for new, cached in [(1, 0), (64, 0), (65, 0), (100, 0), (2048, 0), (7, 1000), (512, 64), (300, 4097)]:
            touched = 0
            for first in range(cached, cached + new, tile):            # query positions first..last (0-based)
                last = min(first + tile, cached + new) - 1
                touched += sum(1 for key_tile in range(0, last + 1, tile))   # a key tile up to the last query's
            assert causal_tile_padding(new, cached, tile) == touched * tile * tile - attention_pairs(new, cached)
            # A query tile's fixed cost: q more pairs for each of the chunk's ceil(new / t) query tiles.
            assert (causal_tile_padding(new, cached, tile, 300.0) - causal_tile_padding(new, cached, tile)
                    == 300.0 * len(range(cached, cached + new, tile)))
    assert causal_tile_padding(0, 500, 64) == 0
    assert causal_tile_padding(0, 500, 64, 300.0) == 0
    # One tile holds a 64-token prompt: 64 x 64 pairs computed for its 2,080 causal ones.
    assert causal_tile_padding(64, 0, 64) == 64 * 64 - 64 * 65 / 2


def test_prefill_sums_give_the_longest_keys_and_the_summed_padding():
    chunks = [(Chunk(0, 800), 512), (Chunk(400, 450), 50), (Chunk(1000, 3000), 100)]
    *_, padding, longest = prefill_sums(chunks, None, tile=64)
    assert longest == 1100
    assert padding == sum(causal_tile_padding(new, c.prefilled, 64) for c, new in chunks)
    *_, padding, _ = prefill_sums(chunks, None, tile=64, query_tile_pairs=300.0)
    assert padding == pytest.approx(sum(causal_tile_padding(new, c.prefilled, 64, 300.0) for c, new in chunks))
    assert prefill_sums(chunks, None)[4] == 0.0          # no tile: exact pairs


@pytest.mark.parametrize("window, local_share", [(None, 1.0), (4096, 1.0), (1024, 0.5), (300, 0.3)])
def test_the_compiled_prefill_sums_are_the_scalar_arithmetic_float_for_float(window, local_share):
    """prefill_sums (compiled, chunk_sums) gives the sums the same function gives interpreted by Python, to the
    last bit: with and without a window and tile, chunks below, across and past the window, prompts completed and
    not."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        news = rng.integers(1, 3000, int(rng.integers(1, 6)))
        cached = rng.integers(0, 12000, len(news)) * rng.integers(0, 2, len(news))
        targets = cached + news + rng.integers(0, 2, len(news)) * rng.integers(1, 900, len(news))
        chunks = [(Chunk(int(c), int(t)), int(n)) for c, n, t in zip(cached, news, targets)]
        for tile, query_tile_pairs in ((0, 0.0), (64, 0.0), (128, 3.184e-25), (64, 0.37)):
            compiled = prefill_sums(chunks, window, local_share, tile, query_tile_pairs)
            rows = np.array([(c.prefilled, new, c.prefill_target) for c, new in chunks], np.int64).reshape(-1)
            interpreted = chunk_sums_kernel.py_func(rows, len(chunks), window or 0, local_share, tile, query_tile_pairs)
            assert compiled == interpreted and [type(v) for v in compiled] == [float, float, float, int, float, float]
