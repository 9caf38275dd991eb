"""The iteration log: rows packed as the engine plans them, and Iterations built back from them on request.

The engine logs each iteration's fields as it plans it and builds an :class:`Iteration` only when one is
asked for (``Engine.schedule``, the observers): the Iterations and the result's iteration table must both
hold the values the engine planned, the counts as ints, across the log's chunk boundaries too.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.sim.iterations import CHUNK_ROWS, LOG_COLUMNS, Iteration, IterationLog, iterations_columns
from llmsim.sim.simulate import simulate
from tests.helpers import make_scenario


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
