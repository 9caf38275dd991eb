"""What one engine iteration did, and the log of them all.

:class:`Iteration` is the value an engine's scheduling step returns: the row of the
iteration log (named fields, :data:`LOG_COLUMNS`) plus what was scheduled, for whom
(``chunks``: the prefill chunks, ``decoding``: whether the decoding sequences took a
step). :class:`IterationLog` keeps the rows packed as doubles in one ``bytearray``,
8 bytes a value, and turns them into ``SimulationResult.iterations``.
"""
from __future__ import annotations

import struct
from functools import partial
from typing import NamedTuple

import numpy as np
import pandas as pd

from llmsim.sim.request import Request


class Iteration(NamedTuple):
    """One iteration of one engine; the log keeps its first ``len(LOG_COLUMNS)`` fields.

    Counts are as the scheduler saw them when it priced the step (``kv_used_blocks``,
    ``running`` and ``queued`` before the step's tokens appear).
    """
    start_s: float
    duration_s: float
    decode_seqs: int             # sequences that took a decode (or verify) step
    prefill_seqs: int            # sequences that computed a prompt chunk
    prefill_tokens: float
    tokens_out: int              # tokens emitted: decode tokens plus prompts completed
    flops: float
    bytes: float
    kv_used_blocks: int
    running: int
    queued: int
    spec_seqs: int = 0           # speculative decoding (zero without it): sequences that speculated,
    draft_tokens: int = 0        # draft tokens proposed, draft tokens accepted, and the part of
    accepted_tokens: int = 0     # duration_s spent drafting
    draft_s: float = 0.0
    chunks: list[tuple[Request, int]] = ()        # (request, prompt tokens computed), in order
    decoding: bool = False


# The engine's hot path builds iterations positionally, every field given, without the
# generated __new__'s argument handling (a third of the cost).
new_iteration = partial(tuple.__new__, Iteration)

LOG_COLUMNS = Iteration._fields[:Iteration._fields.index("chunks")]
_WIDTH = len(LOG_COLUMNS)
_ROW = struct.Struct(f"{_WIDTH}d")
COUNT_COLUMNS = ["decode_seqs", "prefill_seqs", "prefill_tokens", "tokens_out", "kv_used_blocks", "running",
                 "queued", "spec_seqs", "draft_tokens", "accepted_tokens"]


class IterationLog:
    """Every iteration of one engine, row after row of doubles in one ``bytearray``."""

    __slots__ = ("_rows",)

    def __init__(self):
        self._rows = bytearray()

    def append(self, iteration: Iteration) -> None:
        self._rows += _ROW.pack(*iteration[:_WIDTH])

    def extend(self, columns: dict[str, np.ndarray]) -> None:
        """Append several rows at once, given by column (a static batch logs all its steps)."""
        block = np.zeros((len(columns["start_s"]), _WIDTH))
        for name, values in columns.items():
            block[:, LOG_COLUMNS.index(name)] = values
        self._rows += block.tobytes()

    def __len__(self) -> int:
        return len(self._rows) // _ROW.size

    def frame(self) -> pd.DataFrame:
        values = np.frombuffer(bytes(self._rows), dtype=float).reshape(-1, _WIDTH)
        frame = pd.DataFrame(values, columns=list(LOG_COLUMNS))
        frame[COUNT_COLUMNS] = frame[COUNT_COLUMNS].astype(np.int64)
        return frame
