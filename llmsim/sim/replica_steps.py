"""A replica's micro-batch engines stepped together through their decode-only iterations, in one compiled loop.

A replica with ``pp`` pipeline stages runs ``pp`` engines over one KV cache and one queue
(:mod:`llmsim.sim.engine`). In the steady state each of them runs a decode-only iteration of the same sequences
after another, and their ends interleave: the next event is almost always another of these engines' ends, so
each iteration goes through the event queue, and an engine alone never gets past one step.
:class:`ReplicaSteps` takes over when one of them resumes: it lifts the others' pending calls off the event
queue and runs the engines' iterations in the order the queue would (time, priority, then scheduling order;
an iteration that ends before every other event runs on at once, as :meth:`Environment.call_unless_next`
says), each writing its step-table row and its log row, pricing its step as
:meth:`~llmsim.sim.decode.EventDecodeSet.log_decode_step` does and taking the KV blocks its sequences are due
(:attr:`~llmsim.sim.decode.EventDecodeSet.due_counts`), up to whichever comes first:

- the first other event (an arrival, a transfer, another pool's step, a watcher, the horizon, an engine of
  the replica that is not in this steady state), but a call of one of the objects in :attr:`ReplicaSteps.apart`,
  which cannot reach the replica (on a disaggregated decode pool: arrivals, the prefill pool's steps, hand-offs,
  :meth:`~llmsim.sim.disaggregated.DisaggregatedRouter.decode_apart`): that runs in its turn, the engines' pending
  calls on the event queue around it, and the stretch goes on (:meth:`ReplicaSteps._go_past`);
- an engine about to take the step in which a sequence finishes, whose blocks do not fit (it preempts),
  whose step table or log chunk is full, or at which a queue timeout acts (rejecting the oldest request never
  started, or forcing the head in).

The engine stopped at resumes at once through the general path, and the others' calls go back on the
queue with the keys they got, the queue's counter moved on by as many, so the run is the run the general
path makes, row for row and bit for bit. Nothing in such a stretch changes what an engine's admission reads
but the free blocks, which only fall, and the head's wait, which only grows: an engine takes part only where
its queue head fails admission at the start (forced in by a dispatching timeout or not, as at the stretch's
first step; then it fails at every step, all three admission tests and the block check being monotone in the
free blocks), and its failed tries leave :attr:`~llmsim.sim.engine.Queueing.dispatch_wait_s` as the last one
would. Engines take part only where no step of theirs does anything else: no observers or hooks, chunked
prefill, no prompts in flight, FIFO queueing, a plain KV cache, the one-token decode set without a sliding
window, no hand-off or asynchronous scheduling. The blocks taken are then given to their sequences step by step
(:meth:`~llmsim.sim.decode.EventDecodeSet.reserved_through`) and the admission's last wait recorded. An engine's
row in the compiled loop's arrays is kept from one stretch to the next and read again only where the engine
took a step on its own since. (A Ctrl-C, which halts a run between two events, halts it after the stretch it
falls in.)
"""
from __future__ import annotations

import math
import struct
from functools import cache
from heapq import heapify, heappop, heappush
from itertools import count
from typing import cast

import numba
import numpy as np
from simpy.events import NORMAL

from llmsim.compiled import kernel
from llmsim.config.policies import OnTimeout
from llmsim.sim.decode import EventDecodeSet
from llmsim.sim.engine import Engine, Queueing, timeout_decides
from llmsim.sim.environment import Environment
from llmsim.sim.iterations import _CHUNK_DOUBLES, _WIDTH, _log_decode_step
from llmsim.sim.request import WaitingQueue

# The engines' state, a row each: integers, then floats.
(STEP, FIRST_STEP, HELD_STEPS, SEQS, OFFSETS, JOINED, NEXT_FINISH, LOG_AT, LOG_END, RUNNING, PENDING, PRIORITY,
 EID, TRIES, TAKEN) = range(15)
NOW, IN_FLIGHT, KEY_S, TRIED_S, LAST_END_S = range(5)
_INT_COLUMNS, _FLOAT_COLUMNS = TAKEN + 1, LAST_END_S + 1
# The replica's: integers, then floats.
FREE, NUM_BLOCKS, QUEUED, NEXT_EID, CURRENT, BLOCK_SIZE, OTHER_PRIORITY, OTHER_EID = range(8)
ENV_NOW, OTHER_S, WAITING_SINCE_S, TIMEOUT_S = range(4)
_NO_KEY = int(np.iinfo(np.int64).max)
_UNREAD = np.zeros(1)                   # an engine's feature row, before it takes part
_UNTIMED = (0.0, math.inf, False)       # no queue timeout to act (ReplicaSteps._timed)
# What a stretch sets in the arrays, packed into their memory (a numpy assignment from Python values converts them one
# by one, about 1 us a row): an engine's call fields (PENDING to TAKEN) and times (IN_FLIGHT, KEY_S), the replica's.
_CALL, _TIMES, _SHARED, _SHARED_S = struct.Struct("5q"), struct.Struct("2d"), struct.Struct("8q"), struct.Struct("4d")


@kernel
def _step_together(ints, floats, shared, shared_s, dues, tables, rows, xs, terms, stacked, n_ops):
    """Run the engines' decode-only iterations, from engine ``shared[CURRENT]`` resuming at ``shared_s[ENV_NOW]``,
    up to the first that is not one (see the module docstring); leaves in ``shared[CURRENT]`` the engine due to
    resume then (-1: none, the next event is another's)."""
    free, queued, eid, i = shared[FREE], shared[QUEUED], shared[NEXT_EID], shared[CURRENT]
    block_size = shared[BLOCK_SIZE]
    env_now, other_s = shared_s[ENV_NOW], shared_s[OTHER_S]
    waiting_since_s, timeout_s = shared_s[WAITING_SINCE_S], shared_s[TIMEOUT_S]
    other_priority, other_eid = shared[OTHER_PRIORITY], shared[OTHER_EID]
    members = ints.shape[0]
    while True:
        step = ints[i, STEP]
        row = step - ints[i, FIRST_STEP]
        at = ints[i, LOG_AT]
        due = dues[i, (step + 1) % block_size]
        now = floats[i, NOW] + floats[i, IN_FLIGHT]
        if (ints[i, NEXT_FINISH] == step + 1 or row >= ints[i, HELD_STEPS] or at + _WIDTH >= ints[i, LOG_END]
                or due > free or (now if now >= env_now else env_now) - waiting_since_s >= timeout_s):
            break
        # The iteration in flight is over: its tokens appear (EventDecodeSet.advance, no one finishing).
        table = tables[i]
        table[row, 0] = now
        if step:
            table[row, 1] = now - table[row - 1, 0]
        table[row, 2] = ints[i, SEQS] - ints[i, JOINED]
        ints[i, JOINED] = 0
        step += 1
        ints[i, STEP] = step
        if now < env_now:
            now = env_now
        floats[i, NOW] = now
        # The next one: its blocks, a failed admission, its price and row.
        free -= due
        if ints[i, TRIES]:
            floats[i, TRIED_S] = now
        seqs = ints[i, SEQS]
        x = terms[i]
        duration = _log_decode_step(rows[i], at, now, seqs, shared[NUM_BLOCKS] - free, ints[i, RUNNING], queued,
                                    stacked, n_ops, float(ints[i, OFFSETS] + seqs * (step + 1)), xs[i], x[0], x[1],
                                    x[2], x[3])
        ints[i, LOG_AT] = at + _WIDTH
        ints[i, TAKEN] += 1
        end = now + duration
        floats[i, IN_FLIGHT] = duration
        floats[i, LAST_END_S] = end
        first_s = other_s
        for j in range(members):
            if ints[j, PENDING] and floats[j, KEY_S] < first_s:
                first_s = floats[j, KEY_S]
        if end < first_s:
            continue                                # before every other event: it runs on at once
        floats[i, KEY_S] = env_now + (end - env_now)
        ints[i, PRIORITY] = 1                       # NORMAL
        ints[i, EID] = eid
        eid += 1
        ints[i, PENDING] = 1
        i = -1
        for j in range(members):
            if ints[j, PENDING] and (i < 0 or floats[j, KEY_S] < floats[i, KEY_S] or (
                    floats[j, KEY_S] == floats[i, KEY_S] and (ints[j, PRIORITY] < ints[i, PRIORITY] or (
                        ints[j, PRIORITY] == ints[i, PRIORITY] and ints[j, EID] < ints[i, EID])))):
                i = j
        if other_s < floats[i, KEY_S] or (other_s == floats[i, KEY_S] and (other_priority < ints[i, PRIORITY] or (
                other_priority == ints[i, PRIORITY] and other_eid < ints[i, EID]))):
            i = -1
            break
        env_now = floats[i, KEY_S]
        ints[i, PENDING] = 0
    shared[FREE], shared[NEXT_EID], shared[CURRENT] = free, eid, i
    shared_s[ENV_NOW] = env_now


@cache
def _entry(engines: int):
    """:func:`_step_together`'s compiled entry point for a replica of ``engines`` engines (called directly: the
    dispatcher's matching of three tuples of arrays to a specialization costs more than most stretches)."""
    ints, floats, vector = numba.int64[:, ::1], numba.float64[:, ::1], numba.float64[::1]
    return _step_together.compile((ints, floats, numba.int64[::1], vector, ints, numba.types.UniTuple(floats, engines),
                                   numba.types.UniTuple(vector, engines), numba.types.UniTuple(vector, engines),
                                   floats, floats, numba.int64))


class ReplicaSteps:
    """The engines of one replica (sharing its KV cache and queue) stepped together where they can be (see the
    module docstring); built by :func:`step_together`, which gives each engine its ``steps_together``."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.env = cast(Environment, engines[0].env)              # step_together checks
        self._decodes = [cast(EventDecodeSet, engine.decode) for engine in engines]
        self.kv, self.queue = engines[0].kv, cast(WaitingQueue, engines[0].queue)     # step_together checks
        size = len(engines)
        self._ints = np.zeros((size, _INT_COLUMNS), np.int64)
        self._floats = np.zeros((size, _FLOAT_COLUMNS))
        self._shared = np.zeros(8, np.int64)
        self._shared_s = np.zeros(4)
        self._bytes = tuple(array.data.cast("B") for array in (self._ints, self._floats, self._shared, self._shared_s))
        self._terms = np.zeros((size, 4))
        self._index = {id(engine._wake): i for i, engine in enumerate(engines)}
        # Each engine's row in the arrays above is kept between stretches, with what it was gathered or written
        # back from (its log chunk and position, its time and its sequences: a step of the engine's own writes a
        # log row and moves its time, and a sequence it loses changes the count), its feature row, its step table
        # and its log chunk: a stretch gathers again only the rows of engines that changed since.
        self._synced: list[tuple[np.ndarray, int, float, int] | None] = [None] * size
        self._xs = [_UNREAD] * size
        self._tables = [decode._steps for decode in self._decodes]
        self._logs = [engine.log.doubles for engine in engines]
        block_size = self.kv.block_size
        # The engines' due block counts in one array (each decode set keeps its row).
        self._dues = np.zeros((size, block_size), np.int64)
        for i, decode in enumerate(self._decodes):
            decode.count_dues_in(self._dues[i])
        self._shared[BLOCK_SIZE] = block_size
        self._stacked, self._n_ops, _, _ = engines[0].cost.compiled_terms()
        self._step = _entry(size)
        self._wakes = [engine._wake for engine in engines]
        # The objects whose scheduled calls (their bound methods, or partials of them) can neither read nor change
        # anything of this replica's (its engines, KV cache and queue), nor schedule anything before they return that
        # does: a stretch runs each in its turn and goes on (see :meth:`_go_past`). Set by whoever can prove it
        # (:meth:`llmsim.sim.disaggregated.DisaggregatedRouter.decode_apart`); none by default.
        self.apart: tuple[object, ...] = ()
        self._apart_ids: frozenset[int] = frozenset()

    def _steady(self, i: int) -> bool:
        """Whether engine ``i``'s iteration in flight is decode-only and its next steps can be taken here (the
        static conditions :func:`step_together` checked)."""
        engine, decode = self.engines[i], self._decodes[i]
        return (engine._decoding and not engine._chunks and not engine.prefilling and not engine.observers
                and not engine.hooks and not engine._extras and decode.dues_in_phase
                and not decode._late)

    def _admits_none(self, engine: Engine, forced: bool) -> bool:
        """Whether :meth:`Queueing.admit` takes nothing at ``engine``'s steps while the free blocks only fall and
        nothing else changes (the head ``forced`` in by a dispatching queue timeout at all of them, or at none):
        no head, no free seat, or a head that ``fit`` refuses now (no first chunk, or not its blocks)."""
        queue, cfg = self.queue, engine.config
        if not queue or len(engine.running) >= cfg.max_num_seqs:
            return True
        head = queue.head()
        chunk = engine.first_chunk(head, cfg.max_batch_tokens - engine.decode.n, forced)
        return not chunk or engine.blocks_wanted(head, chunk) > self.kv.free_blocks

    def _tries(self, engine: Engine, forced: bool) -> bool:
        """Whether each of ``engine``'s failed admissions (nothing taken, the admission test passed or skipped)
        would set its queueing's ``dispatch_wait_s`` to the head's wait where longer (:func:`timeout_decides`)."""
        queue, cfg = self.queue, engine.config
        if not queue or len(engine.running) >= cfg.max_num_seqs:
            return False
        head = queue.head()
        whole = min(head.prefill_target - head.prefilled, cfg.max_batch_tokens)
        return timeout_decides(forced, cfg.max_batch_tokens - engine.decode.n, whole, 0, True)

    def _timed(self, engine: Engine, now: float) -> tuple[float, float, bool]:
        """The arrival of the queued request a queue timeout acts on first and the timeout, where a step whose
        ``now`` is past it (``now - arrival >= timeout``, as the queue reckons it) would reject it (``on_timeout:
        reject``: the first never started) or force it in (``dispatch``: the head), else (0, inf); and whether
        the head is forced in already at ``now`` (then at every later step)."""
        cfg, queue = engine.config, self.queue
        timeout_s = cfg.queue_timeout_s
        if timeout_s is None or not queue:
            return _UNTIMED
        if cfg.on_timeout is OnTimeout.DISPATCH:
            arrival_s = queue.head().arrival_s
            return (0.0, math.inf, True) if now - arrival_s >= timeout_s else (arrival_s, timeout_s, False)
        assert cfg.on_timeout is OnTimeout.REJECT             # (dedicated slots: traffic classes, not here)
        for request in queue:
            if request.first_scheduled_s != request.first_scheduled_s:      # NaN: never started
                return request.arrival_s, timeout_s, False
        return _UNTIMED

    def _gather(self, i: int) -> None:
        """Engine ``i``'s row (but what its call on the event queue and the queue's head give: pending, key,
        priority, counter, the iteration in flight, whether its admissions fail trying), its feature row, step
        table and log chunk, from the engine, and what they were read from."""
        engine, decode = self.engines[i], self._decodes[i]
        log, n = engine.log, decode.n
        x, *rest = decode._cost.decode_terms(n, decode._all_offset_sum + n * (decode.step + 2))
        self._xs[i] = x
        self._terms[i] = rest
        self._tables[i] = decode._steps
        self._logs[i] = log.doubles
        self._ints[i, :PENDING] = (decode.step, decode._first_step, decode._held_steps, n, decode._all_offset_sum,
                                   decode._joined, decode._next_finish, log.at, _CHUNK_DOUBLES, len(engine.running))
        self._floats[i, NOW] = engine.now
        self._floats[i, LAST_END_S] = engine._last_end_s
        self._synced[i] = (log.doubles, log.at, engine.now, n)

    def run(self, first: Engine, in_flight: float) -> bool:
        """``first`` resumes with its decode-only iteration of ``in_flight`` seconds over: step the replica's
        engines together from here if ``first`` can be (then True, and every engine's next call is scheduled or
        made), else do nothing and return False."""
        env, engines = self.env, self.engines
        first_i = engines.index(first)
        decode = self._decodes[first_i]
        # (The first step's own end of a stretch, told apart before anything is gathered for it: a finish.)
        if env.halted or decode._next_finish == decode.step + 1 or not self._steady(first_i):
            return False
        # (An empty queue, as at most resumes: no timeout acts, every admission takes nothing and none tries.)
        queue = self.queue
        if queue:
            now = first.now + in_flight                 # its next step's, as Engine._run reckons it
            waiting_since_s, timeout_s, forced = self._timed(first, now if now >= env._now else env._now)
            if not self._admits_none(first, forced):
                return False
        else:
            waiting_since_s, timeout_s, forced = _UNTIMED
        ints, floats = self._ints, self._floats
        index = self._index
        calls = env._calls
        # The others' pending calls, where they take part, come off the queue.
        taken: dict[int, tuple] = {}
        for call in calls:
            i = index.get(id(call[3]), -1)
            if i >= 0 and self._steady(i) and (not queue or self._admits_none(engines[i], forced)):
                taken[i] = call
        if taken:
            calls[:] = [call for call in calls if index.get(id(call[3]), -1) not in taken]
            heapify(calls)
        shared, shared_s = self._shared, self._shared_s
        # The first other event's key (time, priority, counter).
        events = env._queue
        other_s, *other_key = min(calls[0][:3], events[0][:3]) if calls and events else (
            calls[0][:3] if calls else events[0][:3] if events else (np.inf, _NO_KEY, _NO_KEY))
        synced, xs, tables, logs = self._synced, self._xs, self._tables, self._logs
        # What the call on the event queue and the queue's head give (an engine not taking part is not pending,
        # and its other fields are not read).
        ints_bytes, floats_bytes, shared_bytes, shared_s_bytes = self._bytes
        for i, (engine, decode) in enumerate(zip(engines, self._decodes)):
            entry = taken.get(i)
            if entry is None and i != first_i:
                ints[i, PENDING] = 0
                continue
            log, stamp = engine.log, synced[i]
            if (stamp is None or stamp[0] is not log.doubles or stamp[1] != log.at or stamp[2] != engine.now
                    or stamp[3] != decode.n):
                self._gather(i)
            time_s = engine._in_flight if entry else in_flight
            assert time_s is not None                     # pending: its iteration in flight is the one taken off
            tries = self._tries(engine, forced) if queue else False
            key_s, priority, eid = entry[:3] if entry else (0.0, NORMAL, 0)
            _CALL.pack_into(ints_bytes, (i * _INT_COLUMNS + PENDING) * 8, entry is not None, priority, eid, tries, 0)
            _TIMES.pack_into(floats_bytes, (i * _FLOAT_COLUMNS + IN_FLIGHT) * 8, time_s, key_s)
        kv = self.kv
        _SHARED.pack_into(shared_bytes, 0, kv.free_blocks, kv.num_blocks, len(queue), next(env._eid), first_i,
                          kv.block_size, *other_key)
        _SHARED_S.pack_into(shared_s_bytes, 0, env._now, other_s, waiting_since_s, timeout_s)
        step, dues, terms, stacked, n_ops = self._step, self._dues, self._terms, self._stacked, self._n_ops
        tables_in, logs_in, xs_in = tuple(tables), tuple(logs), tuple(xs)
        try:
            while True:
                step(ints, floats, shared, shared_s, dues, tables_in, logs_in, xs_in, terms, stacked, n_ops)
                if shared[CURRENT] >= 0 or not self._apart_ids or not self._go_past():
                    break
        finally:
            current = self._write_back(first_i, taken)
        if current >= 0:
            engine = engines[current]
            engine._in_flight = None
            engine._run(floats[current, IN_FLIGHT].item())
        return True

    def set_apart(self, owners: list[object]) -> None:
        """The objects whose scheduled calls a stretch runs in their turn and goes on past (:attr:`apart`: kept, so
        that the ids :meth:`_go_past` looks calls' owners up by stay theirs); never the replica's own engines."""
        self.apart = tuple(owners)
        self._apart_ids = frozenset(map(id, owners))
        assert not self._apart_ids & set(map(id, self.engines))

    def _go_past(self) -> bool:
        """The stretch's next event is another's, every engine taking part waiting on its own call: while that event
        is a call of one of :attr:`apart`'s, run it in its turn, the engines' pending calls put back on the event
        queue around it as the general path would have them there (its own waits read the queue's first time, and
        its calls take the counter's next values after theirs); then, where the engine due first comes before
        anything else, set the arrays for :func:`_step_together` to go on with it (True). False, the stretch ending
        (the engines' state still in the arrays, :meth:`_write_back`'s to give back), at any other event: a SimPy
        event, a call of any other object's (the replica's own engines' not taking part included), a halt.

        Exact: the events run in the order, at the times and with the counter values the general path gives them;
        the only difference is that the engines' state is still in this object's arrays while such a call runs,
        which by :attr:`apart`'s definition reads none of it, changes none of it and schedules nothing that does
        before it returns (a call of the replica's engines' is never one)."""
        if not self._apart_next():
            return False
        env, ints, floats, shared, shared_s = self.env, self._ints, self._floats, self._shared, self._shared_s
        calls, events = env._calls, env._queue
        # The engines' call due first is the only one on the queue while others' calls run: the queue is read only
        # at its first entry (Environment.peek, call_unless_next, step) and pushed to, so it reads as it would with
        # all of theirs there.
        keys, rows = floats[:, KEY_S].tolist(), ints[:, PENDING:EID + 1].tolist()
        due_s, priority, eid, first = min((keys[i], row[1], row[2], i) for i, row in enumerate(rows) if row[0])
        due = (due_s, priority, eid, self._wakes[first])
        env._eid = count(shared[NEXT_EID].item())
        heappush(calls, due)                # after the call to run first, which comes before it
        try:
            while True:
                env._now, _, _, call = heappop(calls)
                call()
                if calls[0] is due and (not events or due < events[0]):  # type: ignore[operator]
                    break
                if not self._apart_next():
                    return False
        finally:
            if calls[0] is due:
                heappop(calls)
            else:
                calls.remove(due)
                heapify(calls)
            shared[NEXT_EID] = next(env._eid)
            shared_s[ENV_NOW] = env._now
        other = calls[0] if calls and (not events or calls[0] < events[0]) else (  # type: ignore[operator]
            events[0] if events else None)
        shared[CURRENT] = first
        ints[first, PENDING] = 0
        shared_s[ENV_NOW] = due_s
        shared_s[OTHER_S], shared[OTHER_PRIORITY], shared[OTHER_EID] = (
            other[:3] if other is not None else (np.inf, _NO_KEY, _NO_KEY))
        return True

    def _apart_next(self) -> bool:
        """Whether the event queue's next event is a call of one of :attr:`apart`'s (the engines taking part
        waiting off the queue), the run not halted."""
        env = self.env
        calls, events = env._calls, env._queue
        if env._halted_with is not None or not calls or (events and events[0] < calls[0]):  # type: ignore[operator]
            return False
        call = calls[0][3]
        owner = getattr(call, "__self__", None)
        if owner is None:                     # a partial of a bound method
            owner = getattr(getattr(call, "func", None), "__self__", None)
        return id(owner) in self._apart_ids

    def _write_back(self, first_i: int, taken: dict[int, tuple]) -> int:
        """The stretch is over: the engines' state from the arrays back into them and the KV cache, the pending
        calls of those taking part back on the event queue, the queue's clock and counter where the stretch left
        them; returns the engine due to resume through the general path (-1: none, the next event is another's)."""
        env, engines, ints, floats = self.env, self.engines, self._ints, self._floats
        calls, synced, logs, queue = env._calls, self._synced, self._logs, self.queue
        free, _, _, next_eid, current, *_ = self._shared.tolist()
        env._eid = count(next_eid)
        env._now = self._shared_s[ENV_NOW].item()
        head_arrival_s = queue.head().arrival_s if queue else 0.0
        for i, (row, times) in enumerate(zip(ints.tolist(), floats.tolist())):
            engine, decode = engines[i], self._decodes[i]
            entry = taken.get(i)
            if entry is None and i != first_i:
                continue
            if row[TAKEN]:
                engine.now = times[NOW]
                decode.step = row[STEP]
                decode._joined = 0
                engine.log.at = row[LOG_AT]
                engine._last_end_s = times[LAST_END_S]
                decode.reserved_through(decode.step)
                synced[i] = (logs[i], row[LOG_AT], engine.now, row[SEQS])
                if row[TRIES]:
                    waited_s = times[TRIED_S] - head_arrival_s
                    if waited_s > engine.queueing.dispatch_wait_s:
                        engine.queueing.dispatch_wait_s = waited_s
            if row[PENDING]:
                engine._in_flight = times[IN_FLIGHT]
                heappush(calls, entry if entry is not None and not row[TAKEN] else (
                    times[KEY_S], NORMAL, row[EID], engine._wake))
        assert free == self.kv.free_blocks             # every block the stretch took, given
        return current


def step_together(engines: list[Engine]) -> None:
    """Let the engines of one replica (sharing its KV cache and queue) step together (:class:`ReplicaSteps`)
    where nothing but their decode-only iterations can happen in them between other events: more than one
    engine, on an :class:`~llmsim.sim.environment.Environment`, each a plain engine of the one-token decode set
    without a sliding window, FIFO queueing, chunked prefill, a plain KV cache, no asynchronous scheduling."""
    if len(engines) < 2 or not isinstance(engines[0].env, Environment):
        return
    for engine in engines:
        if (type(engine) is not Engine or type(engine.decode) is not EventDecodeSet or engine.decode._window
                or type(engine.queueing) is not Queueing or not isinstance(engine.queue, WaitingQueue)
                or not engine.config.chunked_prefill
                or engine.config.on_timeout not in (OnTimeout.DISPATCH, OnTimeout.REJECT)
                or engine._tiered is not None or engine._async
                or engine._log_decode_step is None):
            return
    steps = ReplicaSteps(engines)
    for engine in engines:
        engine.steps_together = steps
