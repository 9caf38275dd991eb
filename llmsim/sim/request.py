"""A request as it moves through the system, and the queue it waits in."""
from __future__ import annotations

import signal
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from enum import Enum
from typing import Any, Literal, Protocol, cast

import numpy as np

NAN = float("nan")


class RequestStatus(str, Enum):
    """Where a request is; the values are the strings the per-request records hold."""
    PENDING = "pending"            # not arrived yet
    QUEUED = "queued"              # waiting for a replica (again, after a preemption)
    RUNNING = "running"            # admitted: prefilling or decoding, holding KV
    FINISHED = "finished"
    REJECTED = "rejected"          # too long for the engine, or timed out in the queue
    UNFINISHED = "unfinished"      # in records only: not done when the run ended

    def __str__(self) -> str:
        return self.value


PENDING, QUEUED, RUNNING, FINISHED, REJECTED, UNFINISHED = RequestStatus


class Request:
    """One inference request: its sizes, its progress and the times that become its record.

    ``prefill_target`` is the number of tokens to compute before the next token can
    be sampled: the prompt at first, prompt plus generated tokens after a
    preemption (recompute).
    """

    __slots__ = ("id", "arrival_s", "prompt_tokens", "output_tokens", "replica", "status", "reason",
                 "first_scheduled_s", "first_token_s", "finish_s", "last_token_s", "generated",
                 "prefill_target", "prefilled", "blocks", "admit_order", "preemptions", "max_itl_s",
                 "epoch", "decode_start", "finish_step", "context_start", "growing",
                 "alpha", "draft_tokens", "accepted_tokens", "slot", "class_index",
                 "prefix_keys", "cached_blocks", "cached_tokens", "reloaded_tokens", "swapped_tokens")

    def __init__(self, id: int, arrival_s: float, prompt_tokens: int, output_tokens: int):
        self.id = id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.replica = -1
        self.status = PENDING
        self.reason = ""               # why rejected: timeout, too_long
        self.first_scheduled_s = NAN
        self.first_token_s = NAN
        self.finish_s = NAN
        self.last_token_s = NAN
        self.generated = 0
        self.prefill_target = prompt_tokens
        self.prefilled = 0
        # KV blocks held; while it decodes in a decode set, those it started decoding with (the set knows the rest:
        # decode.DecodeSet.blocks) until it leaves the set.
        self.blocks = 0
        self.admit_order = -1
        self.preemptions = 0
        self.max_itl_s = 0.0
        # While decoding one token per step (see decode.EventDecodeSet): which decode run this is (odd during one),
        # the engine's decode step it started at, the step at which it finishes, and its KV length
        # when it started.
        self.epoch = 0
        self.decode_start = -1
        self.finish_step = -1
        self.context_start = 0
        self.growing = False
        # Speculative decoding: the request's acceptance rate, draft tokens proposed and accepted,
        # and its row in the engine's decode arrays (see speculative_decode.DecodeSlots).
        self.alpha = NAN
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.slot = -1
        self.class_index = 0           # its traffic class (an index into the workload's classes)
        # Tiered KV cache (llmsim.sim.prefix_cache), untouched without it: the content keys of the
        # request's full blocks (computed when first looked up), how many leading blocks it shares
        # through the prefix cache, the prompt tokens found cached at its first admission and the
        # part of them reloaded from host memory, and the KV tokens swapped out to host memory.
        self.prefix_keys = None
        self.cached_blocks = 0
        self.cached_tokens = 0
        self.reloaded_tokens = 0
        self.swapped_tokens = 0


class TimeAverage:
    """The time integral of a piecewise-constant count, and (if ``logged``) its change log.

    The log is two packed arrays (time, value after the change), 16 bytes a change,
    rather than lists of boxed numbers: a queue changes twice per request.
    """

    __slots__ = ("value", "area", "last_s", "log_s", "log_value")

    def __init__(self, start_s: float = 0.0, logged: bool = True):
        self.value = 0
        self.area = 0.0
        self.last_s = start_s
        self.log_s = array("d", [start_s]) if logged else None
        self.log_value = array("q", [0]) if logged else None

    def take_log(self) -> tuple[np.ndarray, np.ndarray]:
        """The change log so far (times, values after each change), emptied: a run streamed to disk
        reads it as it goes instead of keeping it whole."""
        assert self.log_s is not None and self.log_value is not None     # asked only of a logged count
        times, values = np.frombuffer(self.log_s, float).copy(), np.frombuffer(self.log_value, np.int64).copy()
        self.log_s, self.log_value = array("d"), array("q")
        return times, values

    def change(self, now: float, delta: int) -> None:
        self.area += self.value * (now - self.last_s)
        self.last_s = now
        self.value += delta
        if self.log_s is not None:
            assert self.log_value is not None           # logged: __init__ made both logs
            self.log_s.append(now)
            self.log_value.append(self.value)

    def mean(self, until_s: float) -> float:
        area = self.area + self.value * (until_s - self.last_s)
        return area / until_s if until_s > 0 else 0.0


class Waiting(Protocol):
    """What an engine and the router use of a waiting queue: :class:`WaitingQueue` (FIFO) and
    :class:`llmsim.sim.scheduling.ClassQueue` (one FIFO per traffic class) both offer it. Expiry
    differs between them and is left to the queueing order that owns the queue."""

    length: TimeAverage

    def __len__(self) -> int: ...                # empty is false, as for any sized object

    def head(self) -> Request:
        """The request that would leave next (it stays)."""

    def pop(self, now: float) -> Request:
        """Remove the request :meth:`head` returned."""

    def push(self, request: Request, now: float) -> None: ...

    def push_front(self, request: Request, now: float) -> None: ...


class WaitingQueue(deque):
    """FIFO of requests waiting for a replica; preempted requests return to the front.

    The queue is the deque itself: the engine asks whether it is empty and how long it is every
    iteration, which a deque answers without a Python call. Its length is in a slot, which Python 3.11 reads
    at a specialized instruction's cost (a deque subclass's instance dictionary it does not)."""

    __slots__ = ("length",)

    def __init__(self) -> None:
        super().__init__()
        self.length = TimeAverage()

    def head(self) -> Request:
        return self[0]

    def push(self, request: Request, now: float) -> None:
        request.status = QUEUED
        self.append(request)
        self.length.change(now, +1)

    def push_front(self, request: Request, now: float) -> None:
        request.status = QUEUED
        self.appendleft(request)
        self.length.change(now, +1)

    def pop(self, now: float) -> Request:                    # type: ignore[override]
        request = self.popleft()
        self.length.change(now, -1)
        return request

    def expire(self, now: float, timeout_s: float) -> list[Request]:
        """Remove and return never-started requests that have waited ``timeout_s`` or more.

        Preempted requests (already started) are never expired. Arrival order means
        the expired ones are the oldest fresh requests, at the front after any
        preempted ones.
        """
        expired: list[Request] = []
        kept_front: list[Request] = []
        while self:
            request = self[0]
            if request.first_scheduled_s == request.first_scheduled_s:   # started: not NaN
                kept_front.append(self.popleft())
            elif now - request.arrival_s >= timeout_s:
                expired.append(self.popleft())
                self.length.change(now, -1)
            else:
                break
        self.extendleft(reversed(kept_front))
        return expired


def _packed(typecode: Literal["b", "q", "d"], initial: bytes | array) -> memoryview[Any]:
    """A packed column of ``typecode`` items (``array``'s codes: integers or floats) holding ``initial``'s, as a
    memoryview of its own copy (bytes: their machine values)."""
    return cast("memoryview[Any]", memoryview(bytearray(initial)).cast(typecode))


class RequestRecords:
    """The per-request records of a run, one row per request of the trace, in packed columns.

    A :class:`Request` object exists only while its request is in the system: the arrival
    process builds it (:meth:`request`) and the router writes its outcome here when it
    leaves (:meth:`write`); requests still in the system at the end are written as they
    stand, and those that never arrived keep their defaults (not scheduled, nothing
    generated). Statuses and reasons are kept as small codes; :meth:`columns` turns
    everything into the record's columns (statuses other than finished and rejected
    become ``unfinished``).
    """

    STATUSES = (UNFINISHED.value, FINISHED.value, REJECTED.value)     # code -> record string

    def __init__(self, arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                 alpha: np.ndarray | None = None, class_index: np.ndarray | None = None,
                 session_id: np.ndarray | None = None, prefix_cache: bool = False, first_id: int = 0):
        n = len(arrival_s)
        self.first_id = first_id           # the id of the first row (a chunk of a streamed run's records)
        self.class_index = class_index
        self.arrival_s = np.asarray(arrival_s, float)
        self.prompt_tokens = np.asarray(prompt_tokens, np.int64)
        self.output_tokens = np.asarray(output_tokens, np.int64)
        self.alpha = np.full(n, NAN) if alpha is None else np.asarray(alpha, float)
        # Written when a request leaves, through memoryviews of packed arrays: a memoryview's item assignment is
        # cheaper than numpy's, and than array.array's (which converts each value through PyArg_Parse).
        zeros, nans = bytes(8 * n), array("d", [NAN]) * n
        self.replica = _packed("q", array("q", [-1]) * n)
        self.status = _packed("b", bytes(n))
        self.reason = _packed("b", bytes(n))
        self.generated, self.preemptions = _packed("q", zeros), _packed("q", zeros)
        self.draft_tokens, self.accepted_tokens = _packed("q", zeros), _packed("q", zeros)
        self.first_scheduled_s, self.first_token_s = _packed("d", nans), _packed("d", nans)
        self.finish_s, self.max_itl_s = _packed("d", nans), _packed("d", zeros)
        # Sessions and the tiered KV cache add columns only when a run has them (records stay as they were).
        self.session_id = None if session_id is None else np.asarray(session_id, np.int64)
        self.cached_tokens = _packed("q", zeros) if prefix_cache else None
        self.reloaded_tokens = _packed("q", zeros) if prefix_cache else None
        self._reasons = {"": 0}                    # reason -> code, in order of first use
        self._status_codes = {status: self.STATUSES.index(status.value) for status in (FINISHED, REJECTED)}

    def __len__(self) -> int:
        return len(self.arrival_s)

    def request(self, i: int, arrival_s: float, prompt_tokens: int, output_tokens: int) -> Request:
        """The request of row ``i`` as it arrives."""
        request = Request(i, arrival_s, prompt_tokens, output_tokens)
        request.alpha = self.alpha.item(i)
        if self.class_index is not None:
            request.class_index = self.class_index.item(i)
        return request

    def write(self, request: Request) -> None:
        """``request``'s outcome, as it stands, into its row."""
        i = request.id - self.first_id
        self.replica[i] = request.replica
        self.status[i] = self._status_codes.get(request.status, 0)
        self.reason[i] = self._reasons.setdefault(request.reason, len(self._reasons))
        self.generated[i] = request.generated
        self.preemptions[i] = request.preemptions
        self.draft_tokens[i] = request.draft_tokens
        self.accepted_tokens[i] = request.accepted_tokens
        self.first_scheduled_s[i] = request.first_scheduled_s
        self.first_token_s[i] = request.first_token_s
        self.finish_s[i] = request.finish_s
        self.max_itl_s[i] = request.max_itl_s
        if self.cached_tokens is not None:
            assert self.reloaded_tokens is not None         # with a tiered cache: __init__ made both columns
            self.cached_tokens[i] = request.cached_tokens
            self.reloaded_tokens[i] = request.reloaded_tokens

    def finished(self) -> np.ndarray:
        """Whether each row's request has finished (so far: rows are written as requests leave)."""
        return np.frombuffer(self.status, np.int8) == self._status_codes[FINISHED]

    def columns(self, strings: Callable[[list[str], np.ndarray], Any]) -> dict[str, Any]:
        """The raw record columns, in record order (the arrays share the packed columns' memory); the statuses
        and reasons as ``strings(labels, codes)`` builds a column of ``labels[codes]``."""
        def as_array(values: memoryview[Any]) -> np.ndarray:
            return np.frombuffer(values, np.int64 if values.format == "q" else float)

        columns = {
            "id": np.arange(self.first_id, self.first_id + len(self), dtype=np.int64),
            "replica": as_array(self.replica),
            "status": strings(list(self.STATUSES), np.frombuffer(self.status, np.int8)),
            "reason": strings(list(self._reasons), np.frombuffer(self.reason, np.int8)),
            "arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "generated_tokens": as_array(self.generated), "first_scheduled_s": as_array(self.first_scheduled_s),
            "first_token_s": as_array(self.first_token_s), "finish_s": as_array(self.finish_s),
            "preemptions": as_array(self.preemptions), "max_itl_s": as_array(self.max_itl_s), "alpha": self.alpha,
            "draft_tokens": as_array(self.draft_tokens), "accepted_tokens": as_array(self.accepted_tokens),
        }
        if self.session_id is not None:
            columns["session_id"] = self.session_id
        if self.cached_tokens is not None:
            assert self.reloaded_tokens is not None         # with a tiered cache: __init__ made both columns
            columns["cached_tokens"] = as_array(self.cached_tokens)
            columns["reloaded_tokens"] = as_array(self.reloaded_tokens)
        return columns


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends: a chunk handed to the stream is written whole, and a run
    interrupted meanwhile stops right after it. Python runs signal handlers in the main thread only, so
    elsewhere nothing can interrupt the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[FrameType | None] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    previous = signal.SIG_DFL if previous is None else previous     # one not installed from Python
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[-1])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


class StreamedRecords(RequestRecords):
    """The records of a run streamed to disk: rows are kept in chunks of ``chunk_rows`` consecutive
    requests, and each chunk, once every request in it has left, is handed to ``emit`` (a
    :class:`RequestRecords` of its rows), in order, and dropped. The run's memory then holds the
    trace and the chunks that requests still in the system belong to, not a row per request.
    ``emit(chunk, rows)``: the chunk's first ``rows`` rows are records (all of them but in the last
    chunk of a run stopped before its trace ended). :meth:`flush` hands over the rest at the end."""

    def __init__(self, arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                 alpha: np.ndarray | None = None, class_index: np.ndarray | None = None,
                 session_id: np.ndarray | None = None, prefix_cache: bool = False, *,
                 emit: Callable[[RequestRecords, int], None], chunk_rows: int):
        n = len(arrival_s)
        self.first_id = 0
        self.class_index = class_index
        self.arrival_s = np.asarray(arrival_s, float)
        self.prompt_tokens = np.asarray(prompt_tokens, np.int64)
        self.output_tokens = np.asarray(output_tokens, np.int64)
        self.alpha = np.full(n, NAN) if alpha is None else np.asarray(alpha, float)
        self.session_id = None if session_id is None else np.asarray(session_id, np.int64)
        self._prefix_cache = prefix_cache
        self._emit, self._rows = emit, chunk_rows
        self._chunks: dict[int, RequestRecords] = {}
        self._left: dict[int, int] = {}           # chunk -> its requests yet to leave
        self._next = 0                             # the first chunk not yet handed over

    def _chunk(self, index: int) -> RequestRecords:
        rows = slice(index * self._rows, min((index + 1) * self._rows, len(self)))
        chunk = self._chunks[index] = RequestRecords(
            self.arrival_s[rows], self.prompt_tokens[rows], self.output_tokens[rows], self.alpha[rows],
            None if self.class_index is None else self.class_index[rows],
            None if self.session_id is None else self.session_id[rows], self._prefix_cache, rows.start)
        self._left[index] = len(chunk)
        return chunk

    def write(self, request: Request) -> None:
        index = request.id // self._rows
        chunk = self._chunks.get(index) or self._chunk(index)
        chunk.write(request)
        self._left[index] -= 1
        if self._left[index] == 0 and index == self._next:
            while self._left.get(self._next) == 0:
                chunk = self._chunks[self._next]
                with _ctrl_c_held():      # a chunk half written and then dropped would lose its requests
                    self._emit(chunk, len(chunk))
                    del self._left[self._next], self._chunks[self._next]
                    self._next += 1

    def flush(self, arrived: int) -> None:
        """End of the run (every arrived request written): hand over the rest of the first ``arrived`` rows."""
        while self._next * self._rows < arrived:
            # A chunk none of whose requests was written (a run stopped early) holds them as they arrived: unfinished.
            chunk = self._chunks.pop(self._next, None) or self._chunk(self._next)
            rows = arrived - self._next * self._rows
            self._emit(chunk, min(rows, len(chunk)))
            self._next += 1
        self._chunks.clear()

    def finished(self) -> np.ndarray:
        raise TypeError("a streamed run keeps no record of requests that left (a controller needs them)")


class InterTokenGaps:
    """Every inter-token gap of a run, kept as weighted samples (gap, how many tokens had it).

    Engines add whole arrays at once (one entry per decode iteration, weighted by the
    sequences that continued through it), so recording costs nothing per token.
    """

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, end_s, gap_s, weight) -> None:
        self._chunks.append((np.asarray(end_s, float), np.asarray(gap_s, float), np.asarray(weight, float)))

    def merge(self, other: InterTokenGaps) -> None:
        self._chunks.extend(other._chunks)

    def chunks(self):
        """The samples as they were added: (end_s, gap_s, weight) arrays, chunk by chunk."""
        return iter(self._chunks)

    def in_window(self, start_s: float, stop_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(gaps, weights) of the tokens emitted in [start_s, stop_s], sorted by gap."""
        if not self._chunks:
            return np.zeros(0), np.zeros(0)
        end, gap, weight = (np.concatenate(parts) for parts in zip(*self._chunks))
        keep = (end >= start_s) & (end <= stop_s) & (weight > 0)
        order = np.argsort(gap[keep], kind="stable")
        return gap[keep][order], weight[keep][order]

    def summary(self, start_s: float, stop_s: float, percentiles=(50, 95, 99)) -> dict[str, float]:
        gaps, weights = self.in_window(start_s, stop_s)
        if weights.sum() == 0:
            return {"mean": float("nan"), **{f"p{p}": float("nan") for p in percentiles}}
        cumulative = np.cumsum(weights)
        result = {"mean": float(np.average(gaps, weights=weights))}
        for p in percentiles:
            index = min(int(np.searchsorted(cumulative, p / 100 * cumulative[-1], side="left")), len(gaps) - 1)
            result[f"p{p}"] = float(gaps[index])
        return result
