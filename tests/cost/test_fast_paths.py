"""The cost model's per-iteration paths against its vectorised one, to the last bit.

The simulator prices an iteration through :meth:`CostModel.step` (one compiled call and memos keyed by
token counts) and a speculative step's draft rows through :meth:`CostModel.rows_total` (a compiled call
reading tables), and a memo miss prices the GEMMs in Python floats (:func:`gemm_scalar_body_s`). Each
must give exactly what the vectorised numpy formulas give: records of a run are compared bit for bit
before and after a change to the engine's speed (``benchmarks/records_digest.py``).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.cost.features import F, batch_rows
from llmsim.cost.kernels import gemm_body_s, gemm_output_tiles, gemm_scalar_body_s
from llmsim.cost.roofline import FEW_ROWS, _linear_step

from tests.helpers import random_sums

# "@fp8": the model with 8-bit weights, whose GEMMs the profile's CUTLASS dispatch prices from its tables (DeepSeek-V3's
# are 8-bit as shipped; its routed experts keep the smooth form beside them).
CASES = [("Llama-3.1-8B", "H100-SXM", 1), ("Llama-3.1-70B", "H100-SXM", 4), ("Mixtral-8x7B", "H200", 2),
         ("Mistral-7B-v0.1", "A100-80GB", 1), ("Llama-3.2-1B", "B200", 1), ("Llama-3.1-8B@fp8", "H100-SXM", 1),
         ("Llama-3.2-1B@fp8", "B200", 1), ("DeepSeek-V3", "H200", 8)]


def _model(case: str):
    name, _, dtype = case.partition("@")
    model = model_catalog()[name]
    return model.with_dtypes(weight_dtype=dtype) if dtype else model


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_step_prices_an_iteration_as_the_vectorised_model_does(model_name, hardware, tp):
    model = _model(model_name)
    cost = CostModel(model, lookup_hardware(hardware), tp)
    sums = random_sums(np.random.default_rng(34), 400)
    # Twice: the first pass fills the memos (misses), the second reads them (hits).
    for _ in range(2):
        for prefill, pairs, prefill_kv, logits, decode, decode_kv in sums:
            tokens = prefill + decode
            experts = model.expected_experts_touched(tokens) if model.num_experts > 1 else 1.0
            # Tile padding and the longest keys: a profile with a prefill critical path prices them.
            padding, longest = (float(prefill % 4096), prefill_kv) if prefill else (0.0, 0.0)
            row = np.array([1.0, tokens, prefill, pairs, prefill_kv, decode, decode_kv, experts, decode + logits,
                            padding, longest])
            assert (cost.step(prefill, pairs, prefill_kv, logits, decode, decode_kv, padding, longest)
                    == cost.iteration(row))


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_a_decode_only_step_prices_as_the_general_step_does(model_name, hardware, tp):
    """decode_step (its terms remembered by the batch size, the row its own) gives step()'s time, FLOPs and
    bytes to the last bit, whether the batch size is new to it, seen before, or priced by step() between two
    of its calls (which refill the shared feature row)."""
    cost = CostModel(_model(model_name), lookup_hardware(hardware), tp)
    reference = CostModel(_model(model_name), lookup_hardware(hardware), tp)
    rng = np.random.default_rng(8)
    for seqs in [*rng.integers(1, 300, 200), 1, 1, 7, 7]:
        kv_read = int(rng.integers(seqs, seqs * 9000))
        assert cost.decode_step(int(seqs), kv_read) == reference.step(0.0, 0.0, 0.0, 0, int(seqs), kv_read)
        cost.step(512.0, 512.0 * 256, 0.0, 1, 3, 3000)       # a prefill step between decode steps


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_rows_total_sums_rows_as_the_vectorised_model_does(model_name, hardware, tp):
    """Draft rows (one iteration each, one expert) from the tables; rows the tables do not hold (several
    iterations, fractional tokens) by the general path: the same sums either way."""
    model = _model(model_name)
    cost = CostModel(model, lookup_hardware(hardware), tp)
    rng = np.random.default_rng(31)
    for trial in range(300):
        steps = int(rng.integers(1, 13))        # past 8 rows numpy's pairwise sum changes its order
        decode = rng.integers(0, 64, steps).astype(float)
        rows = batch_rows(decode_seqs=decode, decode_kv_read=decode * rng.integers(1, 4000, steps))
        rows[0] = rows[0] + batch_rows(float(rng.integers(0, 3000)), float(rng.integers(0, 10**6)), 100.0,
                                       iterations=0.0)
        if trial % 10 == 0:
            rows[-1, F["one"]] = 2.0            # two iterations in one row: not one the tables hold
        elif trial % 10 == 1:
            rows[-1, F["tokens"]] += 0.5
        times, flops, moved = cost.iteration(rows)
        expected = (float(np.add.reduce(times)), float(np.add.reduce(flops)), float(np.add.reduce(moved)))
        assert cost.rows_total(rows) == expected
        assert cost.rows_total(rows) == expected        # from the tables the first call filled


def test_gemm_in_python_floats_is_numpy_to_the_bit():
    kernels = lookup_hardware("H100-SXM").kernels.for_dtype("bf16")
    rng = np.random.default_rng(7)
    for _ in range(2000):
        tokens, n = float(rng.integers(0, 20000)) * rng.choice([1.0, 0.37]), float(rng.integers(1, 60000))
        memory_s, compute_s = rng.random() * 1e-3, rng.random() * 1e-3 * rng.choice([0.0, 1.0])
        expected = float(gemm_body_s(memory_s, compute_s, gemm_output_tiles(tokens, n), kernels))
        assert gemm_scalar_body_s(memory_s, compute_s, tokens, n, kernels) == expected


def _grid_rows(model, rng, count: int, tiles: bool) -> list[list[float]]:
    """``count`` feature rows of random sums as the fluid model's grids hold them: a row of one or of 2.5 iterations,
    fractional tokens in some, the routed experts the tokens touch, and (``tiles``) a prefill's tile columns."""
    rows = []
    for prefill, pairs, prefill_kv, logits, decode, decode_kv in random_sums(rng, count):
        iterations = float(rng.choice([1.0, 2.5]))
        tokens = prefill + decode + (0.25 if rng.random() < 0.3 else 0.0)
        experts = model.expected_experts_touched(tokens / iterations) * iterations if model.num_experts > 1 else 1.0
        padding, longest = (float(prefill % 4096), prefill_kv) if prefill and tiles else (0.0, 0.0)
        rows.append([iterations, tokens, prefill, pairs, prefill_kv, decode, decode_kv, experts, decode + logits,
                     padding, longest])
    return rows


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_many_rows_price_their_gemms_as_each_row_alone_to_the_bit(model_name, hardware, tp):
    """More rows than FEW_ROWS (the fluid model's grids) price their GEMMs, each GEMM and summed with the all-reduces
    and the LM head, to the bit as each row priced alone in Python floats, whose powers are the C library's ``pow``
    (``math.pow``) on every machine. numpy's array powers are not: on AVX-512 machines its SIMD code differs from
    ``pow`` in the last bit of about one input in twenty, so pricing the grid by numpy's arrays fails here there.
    Rows of one and of several iterations, fractional tokens, dispatch-priced (8-bit) GEMMs and routed experts, and
    runs of rows whose GEMMs read the same features."""
    model = _model(model_name)
    cost = CostModel(model, lookup_hardware(hardware), tp)
    rows = _grid_rows(model, np.random.default_rng(36), 400, tiles=False)
    # Each row twice over, the second with other decode KV reads (as the fluid model's grids repeat a GEMM's inputs
    # along axes it does not read): the grid reuses the first's GEMMs.
    grid = np.repeat(np.array(rows), 2, axis=0)
    grid[1::2, F["decode_kv_read"]] += 1000.0
    assert len(grid) > FEW_ROWS
    by_gemm = np.array([[cost._gemm_sum(row, [gemm]) for gemm in cost._gemm_rows] for row in grid.tolist()])
    np.testing.assert_array_equal(cost._gemm_times(grid), by_gemm)
    np.testing.assert_array_equal(cost._nonlinear_times(grid.reshape(8, 100, -1)).ravel(),
                                  [cost._nonlinear_time(row) for row in grid.tolist()])


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_a_grid_of_rows_prices_each_row_as_one_iteration_does(model_name, hardware, tp):
    """The fluid model prices grids of rows (rates x prompt counts x quantiles; a row may stand for several
    iterations, with fractional tokens): each row of a grid as the one-iteration path prices it, the GEMMs
    (computed GEMM by GEMM over the grid), the all-reduces and the prefill tile columns included. A last bit may
    differ in the linear terms: a matrix product from a vector's, numpy's pairwise sum of the operators from
    Python's."""
    model = _model(model_name)
    cost = CostModel(model, lookup_hardware(hardware), tp)
    rows = _grid_rows(model, np.random.default_rng(35), 60, tiles=True)
    grid = np.array(rows).reshape(3, 4, 5, -1)
    times, flops, moved = cost.iteration(grid)
    assert times.shape == flops.shape == moved.shape == grid.shape[:-1]
    for at in np.ndindex(*grid.shape[:-1]):
        one = cost.iteration(grid[at])
        assert (times[at], flops[at], moved[at]) == pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("model_name, hardware, tp", CASES)
def test_tables_filled_at_once_price_every_token_count_as_the_vectorised_model_does(model_name, hardware, tp):
    """The first row rows_total tabulates fills its tables whole, the GEMMs by a compiled loop and the
    all-reduces (tensor parallelism) vectorised: every entry up to the tables' size must price its row as
    the vectorised model does."""
    cost = CostModel(_model(model_name), lookup_hardware(hardware), tp)
    size = 4096
    tokens = np.arange(size, dtype=float)
    rows = batch_rows(decode_seqs=tokens, decode_kv_read=tokens * 1000)
    cost.rows_total(rows[-1:])                 # the largest count: the tables grow to hold it, and fill
    layers, heads = cost.compiled_terms()[3]    # (shared with other tests' cost models: maybe larger already)
    assert len(layers) == len(heads) >= size and not np.isnan(layers).any() and not np.isnan(heads).any()
    for t in range(size):
        times, flops, moved = cost.iteration(rows[t:t + 1])
        assert cost.rows_total(rows[t:t + 1]) == (times[0], flops[0], moved[0])



_COUNT = st.integers(0, 1 << 40)
_AMOUNT = st.floats(0.0, 1e12, allow_nan=False, allow_subnormal=False)
# An iteration's sums as the engine passes them: token sums, pairs and KV reads as floats, the decode sequences,
# their KV read (an int without a sliding window) and the logit rows as ints, the prefill tile padding and longest
# keys as floats.
_SUMS = st.tuples(_AMOUNT, _AMOUNT, _AMOUNT, _AMOUNT, _COUNT, st.one_of(_COUNT, _AMOUNT), _AMOUNT, _COUNT, _AMOUNT,
                  _AMOUNT)


@functools.cache
def _llama_8b_h100() -> CostModel:
    return CostModel(model_catalog()["Llama-3.1-8B"], lookup_hardware("H100-SXM"), 1)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(_SUMS)
def test_the_step_s_compiled_entry_point_is_the_linear_step_for_int_or_float_sums(sums):
    """:meth:`CostModel.step` calls the linear step's one all-float specialization directly, with ints where
    the engine has them: the same bits, and the same feature row, as the dispatcher's own specialization
    for those types and as its all-float one."""
    cost = _llama_8b_h100()
    stacked, n_ops, x, _ = cost.compiled_terms()
    entry = cost._linear_step(stacked, n_ops, x, *sums)
    entry_row = x.copy()
    assert entry == _linear_step(stacked, n_ops, x, *sums)
    np.testing.assert_array_equal(entry_row, x)
    assert entry == _linear_step(stacked, n_ops, x, *map(float, sums))
    np.testing.assert_array_equal(entry_row, x)


def test_a_shared_cost_model_prices_as_a_fresh_one_after_pricing_other_runs():
    # shared_cost_model hands the same model to every caller with the same model and chip objects, parallelism and
    # placement; what it remembered from earlier calls (memos, tables) must change no price.
    from llmsim.cost.roofline import shared_cost_model
    model, hardware = _model("Llama-3.1-70B"), lookup_hardware("H100-SXM")
    shared = shared_cost_model(model, hardware, 4)
    assert shared_cost_model(model, hardware, 4) is shared
    assert shared_cost_model(model, hardware, 2) is not shared
    assert shared_cost_model(_model("Llama-3.1-70B@fp8"), hardware, 4) is not shared
    sums = random_sums(np.random.default_rng(35), 300)
    for prefill, pairs, prefill_kv, logits, decode, decode_kv in sums[:150]:       # an earlier run's steps
        shared.step(prefill, pairs, prefill_kv, logits, decode, decode_kv, 0.0, 0.0)
    fresh = CostModel(model, hardware, 4)
    rows = []
    for prefill, pairs, prefill_kv, logits, decode, decode_kv in sums:
        assert (shared.step(prefill, pairs, prefill_kv, logits, decode, decode_kv, 0.0, 0.0)
                == fresh.step(prefill, pairs, prefill_kv, logits, decode, decode_kv, 0.0, 0.0))
        rows.append([1.0, prefill + decode, prefill, pairs, prefill_kv, decode, decode_kv, 1.0, decode + logits,
                     0.0, 0.0])
    np.testing.assert_array_equal(shared.iteration(np.array(rows))[0], fresh.iteration(np.array(rows))[0])
