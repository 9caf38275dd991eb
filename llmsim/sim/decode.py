"""The decoding sequences of one engine: what the engine asks of them, and the one-token set.

An :class:`~llmsim.sim.engine.Engine` owns admission, prefill, preemption and KV for
prompts; once a prompt is complete and its first token sampled, the request joins the
engine's decode set until it finishes or is preempted. Per iteration the engine calls,
in this order:

1. :meth:`DecodeSet.prepare` (only when the decoding sequences may step this iteration):
   reserve the KV blocks this step writes, preempting the most recently admitted request
   (``engine.preempt_latest``) when the cache runs out; returns the step's decode tokens,
   which the engine takes out of the token budget before prompts get theirs;
2. :meth:`DecodeSet.price`: the cost of the whole iteration, prompt chunks included
   (their feature sums computed by the engine), as the row fields of its log; without prompt
   chunks :meth:`DecodeSet.price_decode`, or, where nothing but the decode set changes the step's
   price and row, :attr:`DecodeSet.log_decode_step` (the one-token set's and, where its models are
   tabulated, the speculative set's), which also adds the row to the log (one compiled call: the
   engine's steady state), and with prompt chunks :attr:`DecodeSet.log_step` likewise (the same two sets');
3. after the iteration's time has passed, :meth:`DecodeSet.advance` (when it decoded):
   the step's tokens appear, finished sequences go to ``engine.finish``;
4. :meth:`DecodeSet.start` for every prompt the iteration completed that has tokens left.

:meth:`DecodeSet.stop` takes a sequence out early (preemption) with its progress written
back to the request, and :meth:`DecodeSet.close` brings unfinished requests up to date at
the end of the run and hands over the inter-token gaps.

:class:`EventDecodeSet` is the one-token-per-step set, kept per event rather than per
token: the engine counts its decode iterations ("steps"), and a sequence that starts
decoding at step ``s0`` with ``r`` tokens to go finishes at step ``s0 + r``, needs a KV block
every ``block_size`` steps from a step known in advance, and has a context length and a block
count that are closed-form functions of the step (:meth:`EventDecodeSet.blocks`). Who finishes
or fills its sliding window at which step are tables keyed by the step (:func:`add_due`); the
blocks due at a step are counted by the step modulo ``block_size``, not handed out sequence by
sequence; and the longest inter-token gap of a sequence that ends is the largest of the step
table's gaps over the steps it decoded, read once then. A step of any batch size thus costs a
few scalar operations. Speculative decoding emits a variable number of tokens per
step and has its own set (``llmsim.sim.speculative_decode``).
"""
from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import cast

import numba
import numpy as np

from llmsim.compiled import EntryPoint, kernel
from llmsim.cost.features import CHUNK_SUMS_SIGNATURE, chunk_sums
from llmsim.sim.iterations import IterationLog
from llmsim.sim.request import RUNNING, InterTokenGaps, Request

NEVER = sys.maxsize                 # a decode step no sequence reaches
STEP_ARRAY = 1024                   # decode steps the step table holds at first
END, GAP, CONTINUING = range(3)     # the step table's columns


# What one iteration costs and yields, as a decode set prices it (the engine adds the rest of the
# :class:`~llmsim.sim.iterations.Iteration`: its start, prompt chunks and counts), in this order:
# duration_s; decode_seqs, the sequences that took a decode (or verify) step; tokens_out, decode tokens plus
# prompts completed; flops; bytes; then, zero without speculative decoding, spec_seqs (sequences that
# speculated), draft_tokens (proposed), accepted_tokens and draft_s (the part of duration_s spent drafting).
# A plain tuple, which the engine unpacks at once: a named tuple built every iteration cost about a quarter
# of a microsecond more.
StepPrice = tuple[float, int, int, float, float, int, int, int, float]


@kernel
def _longest_gap(steps, first, last):
    """The largest of the step table ``steps``' gaps in rows ``first`` to ``last - 1`` (``last > first``):
    ``steps[first:last, GAP].max()`` without numpy's reduction's fixed cost (a sequence that finishes reads it
    once). Four running maxima, over every fourth row each, then the largest of them: one maximum waits for the
    comparison before it, four do not wait for each other (a row costs about half as much). The gaps are
    differences of later times from earlier ones, never NaN or -0.0, so any order of comparisons gives numpy's."""
    longest0 = longest1 = longest2 = longest3 = steps[first, GAP]
    row = first + 1
    while row + 4 <= last:
        longest0 = max(longest0, steps[row, GAP])
        longest1 = max(longest1, steps[row + 1, GAP])
        longest2 = max(longest2, steps[row + 2, GAP])
        longest3 = max(longest3, steps[row + 3, GAP])
        row += 4
    for rest in range(row, last):
        longest0 = max(longest0, steps[rest, GAP])
    return max(max(longest0, longest1), max(longest2, longest3))


# The one specialization called (an entry point: llmsim.compiled).
_LONGEST_GAP_SIGNATURE = (numba.float64[:, ::1], numba.int64, numba.int64)


def add_due(table: dict[int, list], step: int, entries: list) -> bool:
    """Add ``entries`` to those due at decode ``step`` in ``table``; whether ``step`` is new to it."""
    due = table.get(step)
    if due is None:
        table[step] = entries
        return True
    due.extend(entries)
    return False


def first_due_after(table: dict[int, list], after: int) -> int:
    """The first step after ``after`` that ``table`` holds entries for (NEVER when it holds none).

    The one asked after is always the step just taken out, so a run's walks follow each other
    along the steps: each step is probed about once (again only when an entry lands before a
    due step a walk already reached), and, unlike a heap of the due steps, the walk reads only
    the table.
    """
    if not table:
        return NEVER
    step = after + 1
    while step not in table:
        step += 1
    return step


class DecodeSet(ABC):
    """The interface between an engine and its decoding sequences (see the module docstring).

    ``n`` is the number of decoding sequences; ``engine`` the engine they belong to.
    """

    n: int
    __slots__ = ("engine", "n", "_window", "_local_share", "_cost_step", "_cost_decode_step", "_window_tokens",
                 "_prefill_tile", "_query_tile_pairs")
    # :meth:`price_decode`'s step priced and added to the log in one call, where nothing but the decode set changes
    # its price and row: ``log_decode_step(log, now, kv_used_blocks, running, queued)`` returns its duration, or NaN
    # (nothing logged) for a step it does not price so; None: a set without one.
    log_decode_step: Callable[..., float] | None = None
    # :meth:`price`'s iteration with prompt chunks summed, priced and added to the log in one call, likewise:
    # ``log_step(log, now, chunk_rows, prefill_seqs, decoding, prefill_tokens, completed, kv_used_blocks, running,
    # queued)`` (the chunks' rows as llmsim.cost.features.chunk_sums reads them) returns its duration, or NaN
    # (nothing logged) for a step it does not price so; None: a set without one.
    log_step: Callable[..., float] | None = None
    # :func:`~llmsim.cost.features.chunk_sums` through its entry point (see llmsim.compiled).
    _chunk_sums_entry: EntryPoint[Callable[..., tuple[float, float, float, int, float, float]]] = EntryPoint(
        chunk_sums, CHUNK_SUMS_SIGNATURE)

    def __init__(self, engine):
        self.engine = engine
        self.n = 0
        self._window = engine.cost.model.sliding_window
        self._local_share = engine.cost.model.local_attention_share   # the layers the window bounds
        # the prompt chunks' terms as chunk_sums takes them (a window of 0: none)
        self._window_tokens = self._window or 0
        self._prefill_tile = int(engine.cost.prefill_tile_tokens)
        self._query_tile_pairs = float(engine.cost.prefill_query_tile_pairs)
        self._cost_step = engine.cost.step           # bound once: called every iteration
        self._cost_decode_step = engine.cost.decode_step

    def sum_chunks(self, chunk_rows: np.ndarray, prefill_seqs: int) -> tuple[float, float, float, int, float, float]:
        """The sums :meth:`price` takes of ``prefill_seqs`` prompt chunks, their rows in ``chunk_rows``
        (:func:`~llmsim.cost.features.chunk_sums`, with this set's window and the cost model's tile terms)."""
        return self._chunk_sums_entry(chunk_rows, prefill_seqs, self._window_tokens, self._local_share,
                                      self._prefill_tile, self._query_tile_pairs)

    @abstractmethod
    def prepare(self, now: float) -> int:
        """Reserve KV for this step's decode tokens (may preempt); returns how many tokens they are."""

    @abstractmethod
    def blocks(self, request: Request) -> int:
        """The KV blocks a running ``request`` holds now, as the admission tests read them. A set keeps a decoding
        sequence's count itself (the one-token set in closed form, the speculative set in its row) and writes it
        to ``request.blocks`` when the sequence leaves; a prompt's is ``request.blocks``."""

    @abstractmethod
    def price(self, chunks, decoding: bool, prefill_tokens: float, pairs: float, prefill_kv: float,
              logits: int, padding: float, longest: float) -> StepPrice:
        """Price one iteration: the prompt ``chunks`` (their tokens, attention pairs, KV read,
        prompts completed, tile padding and longest keys, summed by the engine) plus, if
        ``decoding``, a step of every decoding sequence."""

    def price_decode(self) -> StepPrice:
        """:meth:`price` of an iteration without prompt chunks in which the decoding sequences step (the
        engine's steady state, which a set may price at less cost)."""
        return self.price((), True, 0.0, 0.0, 0.0, 0, 0.0, 0.0)

    @abstractmethod
    def advance(self, now: float) -> None:
        """The priced decode step is over at ``now``: its tokens appear; finish who is done."""

    @abstractmethod
    def start(self, request: Request) -> None:
        """``request``'s prompt is complete and a first token sampled; it decodes from the next step."""

    @abstractmethod
    def stop(self, request: Request) -> None:
        """``request`` leaves before finishing (preemption): write its progress back to it."""

    @abstractmethod
    def close(self, gaps: InterTokenGaps) -> None:
        """End of the run: bring unfinished requests' token counts up to date, add the decode gaps."""


class EventDecodeSet(DecodeSet):
    """One token per sequence per step, kept by events (see the module docstring). Its state is in slots, as
    the engine's is (:class:`~llmsim.sim.engine.EngineProcess`)."""

    __slots__ = ("_block_size", "step", "_finishing", "_next_finish", "_given_step", "_late", "_joining",
                 "_next_join", "_joined_through", "_window_due", "_growing", "_offset_sum", "_all_offset_sum",
                 "_joined", "_first_step", "_steps", "_steps_w", "_held_steps", "_decode_terms_by_seqs", "_stacked",
                 "_n_ops", "_x", "_cost", "due_counts", "_due_counts_w", "dues_in_phase")
    # :func:`_longest_gap` through its entry point (see llmsim.compiled).
    _longest_gap_entry: EntryPoint[Callable[..., float]] = EntryPoint(_longest_gap, _LONGEST_GAP_SIGNATURE)

    def __init__(self, engine):
        super().__init__(engine)
        cost = self._cost = engine.cost
        self._stacked, self._n_ops, self._x, _ = cost.compiled_terms()
        self._decode_terms_by_seqs = cost.decode_terms_by_seqs      # read: decode_terms fills it
        self._block_size = engine.kv.block_size
        self.step = 0                               # decode iterations done so far
        # Who finishes or saturates its sliding window at which step. The first step anyone finishes is
        # also kept as a number: the check every step then reads it alone, not a table that 63 other
        # replicas' turns may have pushed out of cache.
        self._finishing: dict[int, list[tuple[int, int, Request]]] = {}   # step -> (admit order, epoch, request)
        self._next_finish = NEVER
        self._window_due: dict[int, list[tuple[Request, int]]] = {}
        # The KV blocks the sequences take, counted, not handed out one by one (see :meth:`blocks`): a sequence
        # needs its next block every block_size steps from its first due step on, so the blocks due at a step are
        # how many sequences are in that step's phase (the step modulo block_size), ``due_counts``: every
        # decoding sequence with a block due before it finishes, from its first due step on (what a replica's
        # engines stepped together, llmsim.sim.replica_steps, also reserve by). ``_given_step``: the last step
        # whose due blocks were given. A sequence whose first due step comes later than block_size steps after
        # its start (it started with more blocks than its context fills) waits in ``_joining`` (step ->
        # (request, epoch)) until that step, ``dues_in_phase`` false from then on; one that starts due at a step
        # whose blocks were given already (only where every decoder was preempted for an admission after the
        # step's reservation) waits in ``_late`` for the step's next reservation.
        self.due_counts = np.zeros(self._block_size, np.int64)
        self._due_counts_w = cast("memoryview[int]", memoryview(self.due_counts))
        self._given_step = -1
        self._late: list[Request] = []
        self._joining: dict[int, list[tuple[Request, int]]] = {}
        self._next_join = NEVER
        self._joined_through = -1                   # the last step whose joining sequences joined the counts
        self.dues_in_phase = True
        self._growing = 0                           # decoding sequences whose context is below the window
        self._offset_sum = 0                        # sum of (context_start - decode_start) over those
        self._all_offset_sum = 0                    # and over every decoding sequence (global layers)
        self._joined = 0                            # sequences whose first decode step is the next one
        # From decode step _first_step on (the steps before were handed to the engine's gaps), a row per decode
        # step: when it ended, the time since the decode step before it, and how many sequences also decoded the
        # step before (a step writes one row, in one place, rather than one item in each of three arrays).
        self._first_step = 0
        self._steps = np.zeros((STEP_ARRAY, 3))
        self._view()

    def count_dues_in(self, counts: np.ndarray) -> None:
        """Keep :attr:`due_counts` in ``counts`` (a replica's engines keep theirs in one array) from now on."""
        counts[:] = self.due_counts
        self.due_counts = counts
        self._due_counts_w = cast("memoryview[int]", memoryview(cast(bytearray, counts)))

    def _view(self) -> None:
        """A flat memoryview of the step table (row ``i``'s column ``c`` at ``3 * i + c``): an element read or
        written through it costs less than numpy's indexing (a step writes three, a finishing sequence reads
        two)."""
        # Float64 items ("d"); typeshed cannot read a memoryview's item type from a numpy array.
        self._steps_w = cast("memoryview[float]", memoryview(self._steps.reshape(-1)))
        self._held_steps = len(self._steps)

    def context(self, request: Request) -> int:
        """A decoding sequence's KV length now (closed form)."""
        return request.context_start + self.step - request.decode_start

    def kv_read(self) -> int:
        """Context the next decode step reads, summed over the sequences: each reads its whole
        context plus the new token, capped by the sliding window on the layers that have one
        (the mean over the layers, :func:`~llmsim.cost.features.visible`). Without a window every
        sequence grows, so it is ``_all_offset_sum + n * (step + 1)``, the form the decode-only paths inline."""
        capped = self._offset_sum + self._growing * (self.step + 1) + (self.n - self._growing) * (self._window or 0)
        if self._local_share == 1.0 or not self._window:
            return capped
        full = self._all_offset_sum + self.n * (self.step + 1)
        return full - self._local_share * (full - capped)

    def prepare(self, now: float) -> int:
        step = self.step
        if self._given_step < step:
            # The step's due blocks, counted (see __init__): they are free, or the latest admitted are preempted
            # (each one's ending takes it out of the counts) until they are.
            if self._next_join == step:
                self._join(step)
            due = self._due_counts_w[step % self._block_size]
            if due:
                kv = self.engine.kv
                while due > kv.free_blocks:
                    self.engine.preempt_latest(now)
                    due = self._due_counts_w[step % self._block_size]
                kv.allocate(due)
            self._given_step = step
        elif self._late:
            self._give_late(now)
        return self.n

    def _join(self, step: int) -> None:
        """The sequences whose first due step, more than block_size steps after their start, is ``step`` join
        the counts (entries of sequences that ended since are stale: their epoch moved on)."""
        entries = self._joining.pop(step)
        self._next_join = first_due_after(self._joining, step)
        self._joined_through = step
        joined = 0
        for request, epoch in entries:
            if request.epoch == epoch and request.status is RUNNING:
                joined += 1
        self._due_counts_w[step % self._block_size] += joined

    def _give_late(self, now: float) -> None:
        """Give the sequences that started due at the current step after its blocks were given their first block,
        preempting the latest admitted while they do not fit; they join the counts."""
        kv = self.engine.kv
        late = self._late
        while len(late) > kv.free_blocks:
            self.engine.preempt_latest(now)             # a late one ending leaves the list
        kv.allocate(len(late))
        self._due_counts_w[self.step % self._block_size] += len(late)
        late.clear()

    def blocks(self, request: Request) -> int:
        """The KV blocks a running ``request`` holds now: a decoding sequence's in closed form, those it started
        with (``request.blocks``, written back when it leaves the set) and one more for each of its due steps, its
        first and every block_size steps after it, given so far; a prompt's as ``request.blocks`` has them."""
        # (Its epoch is odd while it decodes here: start and _end each add one.)
        if not request.epoch & 1 or (self._late and request in self._late):
            return request.blocks
        return request.blocks + self._taken(self._first_due(request))

    def _first_due(self, request: Request) -> int:
        """The decode step at which a decoding sequence's context reaches the end of the blocks it started with:
        its first due step (one more block every block_size steps from it)."""
        return request.decode_start + request.blocks * self._block_size - request.context_start

    def _taken(self, first_due: int) -> int:
        """The blocks a decoding sequence in the counts whose first due step is ``first_due`` took since it started."""
        given = self._given_step
        return (given - first_due) // self._block_size + 1 if first_due <= given else 0

    def reserved_through(self, step: int) -> None:
        """The sequences took their steps up to decode ``step`` (now :attr:`step`) without reserving their blocks,
        and every block they were due fitted (llmsim.sim.replica_steps, which took none from the cache, and runs
        only while no sequence waits to join the counts): give them, as :meth:`prepare` would have step by step, in
        one sum (the counts did not change in between; each full turn of ``block_size`` steps gives every count once,
        the rest a run of them from the first step's phase)."""
        counts, size = self._due_counts_w, self._block_size
        turns, rest = divmod(step - self._given_step, size)
        start = (self._given_step + 1) % size
        end = start + rest
        blocks = sum(counts[start:end]) if end <= size else sum(counts[start:]) + sum(counts[:end - size])
        if turns:                                   # (a stretch is most often shorter than a turn)
            blocks += turns * sum(counts)
        self.engine.kv.allocate(blocks)
        self._given_step = step

    def price(self, chunks, decoding, prefill_tokens, pairs, prefill_kv, logits, padding, longest) -> StepPrice:
        if not decoding:
            duration, flops, moved = self._cost_step(prefill_tokens, pairs, prefill_kv, logits, 0, 0, padding, longest)
            return duration, 0, logits, flops, moved, 0, 0, 0, 0.0
        n = self.n
        # kv_read(), inline without a sliding window: this runs every iteration.
        kv_read = self._all_offset_sum + n * (self.step + 1) if not self._window else self.kv_read()
        duration, flops, moved = self._cost_step(prefill_tokens, pairs, prefill_kv, logits, n, kv_read, padding,
                                                 longest)
        return duration, n, n + logits, flops, moved, 0, 0, 0, 0.0

    def price_decode(self) -> StepPrice:
        n = self.n
        # kv_read(), inline without a sliding window, as in price().
        kv_read = self._all_offset_sum + n * (self.step + 1) if not self._window else self.kv_read()
        duration, flops, moved = self._cost_decode_step(n, kv_read)
        return duration, n, n, flops, moved, 0, 0, 0, 0.0

    def log_decode_step(self, log: IterationLog, now: float, kv_used_blocks: int, running: int,
                        queued: int) -> float:
        """:meth:`price_decode`'s step added to ``log`` as the engine would add it (its counts as given), in
        one compiled call; returns its duration."""
        n = self.n
        kv_read = self._all_offset_sum + n * (self.step + 1) if not self._window else self.kv_read()
        terms = self._decode_terms_by_seqs.get(n)         # cost.decode_terms, its memo read inline
        if terms is None:
            terms = self._cost.decode_terms(n, kv_read)
        # (The terms passed by name, not as *terms: a call of fixed arity builds its arguments' tuple at once.)
        row, nonlinear_s, extra_s, extra_flops, extra_bytes = terms
        duration_s = log.decode_step_entry(log.doubles, log.at, now, n, kv_used_blocks, running, queued,
                                           self._stacked, self._n_ops, kv_read, row, nonlinear_s, extra_s,
                                           extra_flops, extra_bytes)
        log.row_added()
        return duration_s

    def log_step(self, log: IterationLog, now: float, chunk_rows: np.ndarray, prefill_seqs: int, decoding: bool,
                 prefill_tokens: float, completed: int, kv_used_blocks: int, running: int, queued: int) -> float:
        """:meth:`price`'s iteration with ``prefill_seqs`` prompt chunks, their rows in ``chunk_rows`` as
        :func:`~llmsim.cost.features.chunk_sums` reads them (``prefill_tokens`` and ``completed``: their tokens and
        the prompts they complete, as it sums them), added to ``log`` as the engine would add it (its counts as
        given), summed, priced and logged in one compiled call; returns its duration, or NaN (nothing logged) where
        the cost model does not yet remember what its step adds to the product
        (:meth:`~llmsim.cost.roofline.CostModel.step_terms`): the engine's general path then works them out."""
        n = self.n if decoding else 0
        kv_read = 0
        if decoding:                                # kv_read(), inline without a sliding window, as in price()
            kv_read = self._all_offset_sum + n * (self.step + 1) if not self._window else self.kv_read()
        terms = self._cost.step_terms(prefill_tokens + n, n + completed)
        if terms is None:
            return math.nan
        experts, nonlinear_s, extra_s, extra_flops, extra_bytes = terms       # by name, as in log_decode_step
        duration_s = log.step_entry(log.doubles, log.at, now, kv_used_blocks, running, queued, self._stacked,
                                    self._n_ops, self._x, chunk_rows, prefill_seqs, self._window_tokens,
                                    self._local_share, self._prefill_tile, self._query_tile_pairs, n, kv_read,
                                    experts, nonlinear_s, extra_s, extra_flops, extra_bytes)
        log.row_added()
        return duration_s

    def advance(self, now: float) -> None:
        """One token for every decoding sequence: finish those due, saturate sliding windows."""
        step = self.step
        at = step - self._first_step
        if at >= self._held_steps:
            at = self._make_room()
        row = 3 * at
        table = self._steps_w
        table[row + END] = now
        if step:
            table[row + GAP] = now - table[row - 3 + END]
        table[row + CONTINUING] = self.n - self._joined
        self._joined = 0
        self.step = step = step + 1
        if self._next_finish == step:
            finishing = self._finishing.pop(step)
            self._next_finish = first_due_after(self._finishing, step)
            if len(finishing) > 1:
                finishing.sort()                     # in admission order
            for _, epoch, request in finishing:
                if request.epoch == epoch and request.status is RUNNING:
                    self._end(request, step)
                    self.engine.finish(request, now)
        if not self._window:
            return
        saturating = self._window_due.pop(step, None)
        if saturating:
            for request, epoch in saturating:
                if request.epoch == epoch and request.status is RUNNING:
                    request.growing = False
                    self._growing -= 1
                    self._offset_sum -= request.context_start - request.decode_start

    def start(self, request: Request) -> None:
        step = self.step
        request.epoch += 1
        request.decode_start = step
        request.context_start = context = request.prefill_target
        request.finish_step = finish = step + request.output_tokens - request.generated
        add_due(self._finishing, finish, [(request.admit_order, request.epoch, request)])
        if finish < self._next_finish:
            self._next_finish = finish
        # From its first due step on, one block is due every block_size steps, counted in its phase (see __init__).
        due = self._first_due(request)
        if due < finish:
            if due < step:                           # it would never come round: fail loudly, not silently
                raise RuntimeError(f"a KV block fell due at decode step {due}, before the current step {step}")
            if due >= step + self._block_size:
                if add_due(self._joining, due, [(request, request.epoch)]) and due < self._next_join:
                    self._next_join = due
                self.dues_in_phase = False
            elif due == self._given_step:
                self._late.append(request)
            else:
                self._due_counts_w[due % self._block_size] += 1
        self._all_offset_sum += context - step
        window = self._window
        request.growing = not window or context + 1 < window   # else it already reads a full window
        if request.growing:
            self._growing += 1
            self._offset_sum += context - step
            if window:
                self._due(self._window_due, step + window - 1 - context, request)
        self.n += 1
        self._joined += 1

    def _due(self, table: dict, step: int, request: Request) -> None:
        if step < request.finish_step:
            add_due(table, step, [(request, request.epoch)])

    def stop(self, request: Request) -> None:
        self._end(request, self.step)

    def _end(self, request: Request, step: int) -> None:
        """Close a decode run at ``step``: tokens generated, KV length, its inter-token gaps."""
        start = request.decode_start
        done = step - start
        request.generated += done
        request.epoch += 1                           # its heap and due-step entries are now stale
        self._all_offset_sum -= request.context_start - start
        # Out of the counts (or off the late list) if it had a block due before its finish, its blocks written back.
        due = self._first_due(request)
        if due < request.finish_step:
            if self._late and request in self._late:
                self._late.remove(request)
            elif due < start + self._block_size or due <= self._joined_through:
                self._due_counts_w[due % self._block_size] -= 1
                request.blocks += self._taken(due)
        if request.growing:
            request.growing = False
            self._growing -= 1
            self._offset_sum -= request.context_start - start
        self.n -= 1
        if start == self.step:
            self._joined -= 1                        # left before its first decode step
        if done:
            table, engine, first_step = self._steps_w, self.engine, self._first_step
            first_end = table[3 * (start - first_step) + END]
            first = first_end - request.last_token_s
            engine.first_gap_end_s.append(first_end)
            engine.first_gap_s.append(first)
            # The longest gap after the first, over steps start + 1 .. step - 1 (the last step taken): read once
            # per decode run, from the step table (a step only writes its row).
            longest = (self._longest_gap_entry(self._steps, start + 1 - first_step, step - first_step) if done > 1
                       else 0.0)
            request.max_itl_s = max(request.max_itl_s, first, longest)
            request.last_token_s = table[3 * (step - 1 - first_step) + END]

    def _decoding(self):
        """The requests in this set (admitted, running, their prompt complete)."""
        engine = self.engine
        return (request for request in engine.running.values()
                if request.status is RUNNING and request not in engine.prefilling and request.decode_start >= 0)

    def _make_room(self) -> int:
        """The step table is full: hand the gaps of the steps no decoding sequence reads again (before
        the oldest one's first step, and before the last step, which the next gap reads) to the
        engine's ``gaps`` and drop them, doubling the table where more than half of it is still
        needed. Returns the current step's row in it."""
        step = self.step
        keep = min([request.decode_start for request in self._decoding()], default=step)
        keep = max(min(keep, step - 1), 0)
        if keep < self._first_step:                  # a sequence decoding from a step already dropped
            raise RuntimeError(f"decode step {keep} is read after the steps before {self._first_step} were dropped")
        self._hand_over(keep, self.engine.gaps)
        drop = keep - self._first_step
        kept = step - keep
        held = self._steps
        if 2 * kept > len(held):
            self._steps = np.zeros((2 * len(held), 3))
        self._steps[:kept] = held[drop:drop + kept]
        self._view()
        self._first_step = keep
        return kept

    def _hand_over(self, until: int, gaps: InterTokenGaps) -> None:
        """Add the gaps of the steps held before step ``until`` to ``gaps`` (the first step has none)."""
        first_step = self._first_step
        start = max(first_step, 1) - first_step
        stop = until - first_step
        if stop > start:
            rows = self._steps[start:stop]
            gaps.add(rows[:, END].copy(), rows[:, GAP].copy(), rows[:, CONTINUING].copy())

    def close(self, gaps: InterTokenGaps) -> None:
        for request in self._decoding():
            request.generated += self.step - request.decode_start
        self._hand_over(self.step, gaps)
