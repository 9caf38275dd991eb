"""What one engine iteration did, and the log of them all.

:class:`Iteration` is the value an engine's scheduling step returns: the row of the
iteration log (named fields, :data:`LOG_COLUMNS`) plus what was scheduled, for whom
(``chunks``: the prefill chunks, ``decoding``: whether the decoding sequences took a
step). :class:`IterationLog` keeps the rows packed as doubles, 8 bytes a value, and
:func:`iterations_columns` turns the logs into the columns of ``SimulationResult.iterations``.
"""
from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Mapping, Sequence
import typing
from typing import NamedTuple

import numba
import numpy as np

from llmsim.compiled import EntryPoint, kernel
from llmsim.cost.features import CHUNK_SUMS_SIGNATURE, chunk_sums
from llmsim.cost.roofline import _decode_price, _linear_step
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
    chunks: Sequence[tuple[Request, int]] = ()    # (request, prompt tokens computed), in order
    decoding: bool = False


LOG_COLUMNS = Iteration._fields[:Iteration._fields.index("chunks")]
_WIDTH = len(LOG_COLUMNS)
_ROW = struct.Struct(f"{_WIDTH}d")
COUNT_COLUMNS = ["decode_seqs", "prefill_seqs", "prefill_tokens", "tokens_out", "kv_used_blocks", "running",
                 "queued", "spec_seqs", "draft_tokens", "accepted_tokens"]
# The fields an Iteration holds as ints (prefill_tokens, a count in the table, is a sum of floats there).
_INTEGER_FIELDS = frozenset(i for i, (name, kind) in enumerate(typing.get_type_hints(Iteration).items())
                            if name in LOG_COLUMNS and kind is int)

CHUNK_ROWS = 1 << 16                # 7.5 MiB a chunk
_CHUNK_BYTES = CHUNK_ROWS * _ROW.size
_CHUNK_DOUBLES = CHUNK_ROWS * _WIDTH
# The columns a decode-only step writes (compiled code reads them as constants; the others are zeros).
(_START_S, _DURATION_S, _DECODE_SEQS, _PREFILL_SEQS, _PREFILL_TOKENS, _TOKENS_OUT, _FLOPS, _BYTES, _KV_USED_BLOCKS,
 _RUNNING, _QUEUED) = (LOG_COLUMNS.index(name) for name in ("start_s", "duration_s", "decode_seqs", "prefill_seqs",
                                                            "prefill_tokens", "tokens_out", "flops", "bytes",
                                                            "kv_used_blocks", "running", "queued"))


@kernel
def write_row(rows, at, start_s, duration_s, decode_seqs, prefill_seqs, prefill_tokens, tokens_out, flops, moved,
               kv_used_blocks, running, queued):
    """Write an iteration's row into ``rows`` (a chunk's doubles) from ``at`` on, as :meth:`IterationLog.add`
    would pack it (the columns not given are zeros)."""
    rows[at:at + _WIDTH] = 0.0
    rows[at + _START_S] = start_s
    rows[at + _DURATION_S] = duration_s
    rows[at + _DECODE_SEQS] = decode_seqs
    rows[at + _PREFILL_SEQS] = prefill_seqs
    rows[at + _PREFILL_TOKENS] = prefill_tokens
    rows[at + _TOKENS_OUT] = tokens_out
    rows[at + _FLOPS] = flops
    rows[at + _BYTES] = moved
    rows[at + _KV_USED_BLOCKS] = kv_used_blocks
    rows[at + _RUNNING] = running
    rows[at + _QUEUED] = queued


@kernel
def _log_decode_step(rows, at, start_s, seqs, kv_used_blocks, running, queued, stacked, n_ops, kv_read, x,
                     nonlinear_s, extra_s, extra_flops, extra_bytes):
    """Price a decode-only step of ``seqs`` sequences (:func:`~llmsim.cost.roofline._decode_price`) and write
    its row into ``rows`` (a chunk's doubles) from ``at`` on, as :meth:`IterationLog.add` would pack it;
    returns its duration."""
    duration_s, flops, moved = _decode_price(stacked, n_ops, x, kv_read, nonlinear_s, extra_s, extra_flops,
                                             extra_bytes)
    write_row(rows, at, start_s, duration_s, seqs, 0, 0, seqs, flops, moved, kv_used_blocks, running, queued)
    return duration_s


@kernel
def _log_step(rows, at, start_s, kv_used_blocks, running, queued, stacked, n_ops, x, chunk_rows, prefill_seqs, window,
              local_share, tile, query_tile_pairs, decode_seqs, decode_kv_read, experts, nonlinear_s, extra_s,
              extra_flops, extra_bytes):
    """Price an iteration with ``prefill_seqs`` prompt chunks (their rows in ``chunk_rows``, summed by
    :func:`~llmsim.cost.features.chunk_sums` with the window and tile terms after them) as
    :meth:`~llmsim.cost.roofline.CostModel.step` does given its remembered terms
    (:meth:`~llmsim.cost.roofline.CostModel.step_terms`: the product of the row
    :func:`~llmsim.cost.roofline._linear_step` fills, then the non-linear terms added to the time, then what a
    subclass adds to each; NaN: none) and write its row into ``rows`` from ``at`` on, as :meth:`IterationLog.add`
    would pack it; returns its duration."""
    prefill_tokens, prefill_pairs, prefill_kv_read, completed, prefill_padding, prefill_longest = chunk_sums(
        chunk_rows, prefill_seqs, window, local_share, tile, query_tile_pairs)
    logits = decode_seqs + completed
    duration_s, flops, moved = _linear_step(stacked, n_ops, x, prefill_tokens + decode_seqs, prefill_tokens,
                                            prefill_pairs, prefill_kv_read, decode_seqs, decode_kv_read, experts,
                                            logits, prefill_padding, prefill_longest)
    if nonlinear_s == nonlinear_s:
        duration_s += nonlinear_s
    if extra_s == extra_s:
        duration_s, flops, moved = duration_s + extra_s, flops + extra_flops, moved + extra_bytes
    write_row(rows, at, start_s, duration_s, decode_seqs, prefill_seqs, prefill_tokens, logits, flops, moved,
               kv_used_blocks, running, queued)
    return duration_s


# The one specialization called (an entry point: llmsim.compiled).
_LOG_DECODE_STEP_SIGNATURE = (numba.float64[::1], numba.int64, numba.float64, numba.int64, numba.int64, numba.int64,
                              numba.int64, numba.float64[:, ::1], numba.int64, numba.float64, numba.float64[::1],
                              *[numba.float64] * 4)
# :func:`_log_step`'s: the counts as integers, the chunks' rows and terms as chunk_sums takes them, the decode
# sequences, their KV read and the remembered terms as floats (as the product's entry point takes its row).
_LOG_STEP_SIGNATURE = (numba.float64[::1], numba.int64, numba.float64, *[numba.int64] * 3, numba.float64[:, ::1],
                       numba.int64, numba.float64[::1], *CHUNK_SUMS_SIGNATURE, *[numba.float64] * 7)


class IterationLog:
    """Every iteration of one engine, row after row of doubles in chunks of :data:`CHUNK_ROWS` rows.

    Each chunk is its own anonymous memory map: pages not yet written cost nothing, and
    :func:`iterations_columns` copies the log into the result's columns chunk by chunk,
    each chunk going back to the operating system as soon as it is copied (memory from
    the allocator's heap may not), so the log and the table it becomes are never both
    held whole.
    """

    __slots__ = ("_full", "_chunk", "at", "doubles")
    # The two compiled writers (see llmsim.compiled).
    decode_step_entry: EntryPoint[Callable[..., float]] = EntryPoint(_log_decode_step, _LOG_DECODE_STEP_SIGNATURE)
    step_entry: EntryPoint[Callable[..., float]] = EntryPoint(_log_step, _LOG_STEP_SIGNATURE)

    def __init__(self):
        self._full: list[mmap.mmap] = []           # chunks already full, in order
        self._chunk = mmap.mmap(-1, _CHUNK_BYTES)  # the chunk being written, up to double ``at``
        self.at = 0
        self.doubles = np.frombuffer(self._chunk, dtype=float)      # the chunk, as compiled code writes it

    def add(self, start_s: float, duration_s: float, decode_seqs: int, prefill_seqs: int, prefill_tokens: float,
            tokens_out: int, flops: float, moved: float, kv_used_blocks: int, running: int, queued: int,
            spec_seqs: int, draft_tokens: int, accepted_tokens: int, draft_s: float) -> None:
        """Append one iteration's row, its fields given in :data:`LOG_COLUMNS` order (``moved``: its bytes)
        and packed as they come: the engine logs every iteration, and builds an :class:`Iteration` only
        where one is asked for (:meth:`last`)."""
        _ROW.pack_into(self._chunk, self.at << 3, start_s, duration_s, decode_seqs, prefill_seqs, prefill_tokens,
                       tokens_out, flops, moved, kv_used_blocks, running, queued, spec_seqs, draft_tokens,
                       accepted_tokens, draft_s)
        self.row_added()

    def row_added(self) -> None:
        """A compiled writer (:data:`decode_step_entry` or :data:`step_entry`, through
        :meth:`~llmsim.sim.decode.EventDecodeSet.log_decode_step` or :meth:`~llmsim.sim.decode.EventDecodeSet.log_step`)
        wrote the next row into :attr:`doubles` from double :attr:`at` on: count it."""
        self.at += _WIDTH
        if self.at == _CHUNK_DOUBLES:
            self._next_chunk()

    def last(self, chunks: Sequence[tuple[Request, int]], decoding: bool) -> Iteration:
        """The last row as an :class:`Iteration` (its counts as ints) that scheduled ``chunks`` and, if
        ``decoding``, a step of the decoding sequences."""
        if self.at:
            row = _ROW.unpack_from(self._chunk, (self.at - _WIDTH) << 3)
        else:
            row = _ROW.unpack_from(self._full[-1], _CHUNK_BYTES - _ROW.size)
        return Iteration._make([*(int(value) if i in _INTEGER_FIELDS else value for i, value in enumerate(row)),
                                chunks, decoding])

    def extend(self, columns: Mapping[str, np.ndarray | float]) -> None:
        """Append several rows at once, given by column: an array, or one value for every row (a static
        batch logs all its steps)."""
        block = np.zeros((np.size(columns["start_s"]), _WIDTH))
        for name, values in columns.items():
            block[:, LOG_COLUMNS.index(name)] = values
        data = memoryview(block.tobytes())
        while data:
            size = min(len(data), _CHUNK_BYTES - (self.at << 3))
            self._chunk[self.at << 3:(self.at << 3) + size] = data[:size]
            self.at += size >> 3
            data = data[size:]
            if self.at == _CHUNK_DOUBLES:
                self._next_chunk()

    def _next_chunk(self) -> None:
        self._full.append(self._chunk)
        self._new_chunk()

    def _new_chunk(self) -> None:
        self._chunk, self.at = mmap.mmap(-1, _CHUNK_BYTES), 0
        self.doubles = np.frombuffer(self._chunk, dtype=float)

    def __len__(self) -> int:
        return len(self._full) * CHUNK_ROWS + self.at // _WIDTH

    def views(self) -> list[np.ndarray]:
        """The log's chunks as (rows, columns) arrays sharing its memory (drop them before appending)."""
        return [np.frombuffer(chunk, dtype=float, count=size // 8).reshape(-1, _WIDTH) for chunk, size in
                [*((chunk, _CHUNK_BYTES) for chunk in self._full), (self._chunk, self.at << 3)]]

    def take_full(self) -> list[np.ndarray]:
        """The chunks already full, as (rows, columns) arrays, taken out of the log (a run streamed
        to disk sums them as it goes)."""
        full, self._full = self._full, []
        return [np.frombuffer(chunk, dtype=float).reshape(-1, _WIDTH) for chunk in full]

    def take_chunks(self):
        """Yield the log's rows as (rows, columns) arrays, chunk by chunk, emptying the log."""
        self._full.append(self._chunk)
        last_rows = self.at // _WIDTH
        self._new_chunk()
        while self._full:
            chunk = self._full.pop(0)
            rows = CHUNK_ROWS if self._full else last_rows
            yield np.frombuffer(chunk, dtype=float, count=rows * _WIDTH).reshape(-1, _WIDTH)


_START, _DURATION = LOG_COLUMNS.index("start_s"), LOG_COLUMNS.index("duration_s")


def iterations_columns(logs: list[tuple[int, int, IterationLog]], until_s: float) -> dict[str, np.ndarray]:
    """The logs of several engines (``(replica, micro_batch, log)``, in this order) as the columns of one
    table, with the iterations that ended by ``until_s`` (a static batch logs its steps ahead) and their
    ``end_s``; the simulator adds its own columns and builds ``SimulationResult.iterations`` once. Empties the
    logs: each chunk is freed once it is copied.
    """
    ends_by_log = [[chunk[:, _START] + chunk[:, _DURATION] for chunk in log.views()] for _, _, log in logs]
    n = sum(int((end <= until_s).sum()) for ends in ends_by_log for end in ends)
    columns: dict[str, np.ndarray] = {"replica": np.empty(n, np.int64), "micro_batch": np.empty(n, np.int64)}
    columns.update((name, np.empty(n, np.int64 if name in COUNT_COLUMNS else float)) for name in LOG_COLUMNS)
    columns["end_s"] = np.empty(n)
    at = 0
    for (replica, micro_batch, log), ends in zip(logs, ends_by_log):
        for chunk, end in zip(log.take_chunks(), ends):
            keep = end <= until_s
            if not keep.all():
                chunk, end = chunk[keep], end[keep]
            rows = slice(at, at + len(chunk))
            columns["replica"][rows] = replica
            columns["micro_batch"][rows] = micro_batch
            for j, name in enumerate(LOG_COLUMNS):
                columns[name][rows] = chunk[:, j]
            columns["end_s"][rows] = end
            at += len(chunk)
    return columns

