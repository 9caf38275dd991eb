"""A streamed run hands each chunk of records to the stream whole, even when Ctrl-C arrives meanwhile."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from llmsim.sim.request import Request, StreamedRecords


class Interrupted(Exception):
    pass


def _raise(signum, frame):
    raise Interrupted


def test_ctrl_c_during_a_chunk_lets_the_chunk_finish_and_stops_after_it():
    """Before, a Ctrl-C inside the stream's writing of a chunk dropped the chunk: the run's end then counted its
    finished requests as never served (a streamed run interrupted there reported 65,536 requests queued)."""
    n, rows = 6, 3
    handed: list[tuple[int, int]] = []

    def emit(chunk, count):
        os.kill(os.getpid(), signal.SIGINT)          # arrives while this chunk is being written
        handed.append((chunk.first_id, count))

    records = StreamedRecords(np.arange(n, dtype=float), np.full(n, 10), np.full(n, 5), emit=emit,
                              chunk_rows=rows)
    previous = signal.signal(signal.SIGINT, _raise)
    try:
        for i in range(rows - 1):
            records.write(Request(i, float(i), 10, 5))
        with pytest.raises(Interrupted):
            records.write(Request(rows - 1, float(rows - 1), 10, 5))
        assert handed == [(0, rows)]                 # the chunk went out whole before the interrupt
        records.flush(rows)                          # the run's end hands over nothing twice
        assert handed == [(0, rows)]
    finally:
        signal.signal(signal.SIGINT, previous)
