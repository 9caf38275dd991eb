"""One micro-batch engine of a replica: iteration-level scheduling over a paged KV cache.

The engine is a loop driven by the simulation's event queue, as a SimPy process would be.
Each turn is one iteration: the scheduler picks a
batch (:meth:`Engine.schedule`, which returns what it scheduled and at what cost as an
:class:`~llmsim.sim.iterations.Iteration`), simulated time advances by that much, and
the batch's tokens appear at the end of it (:meth:`Engine.apply`). Time therefore moves
per iteration, never per token per request. A replica with ``pp`` pipeline stages runs
``pp`` engines sharing its queue and KV cache, one per micro-batch in flight.

Continuous batching (Orca, vLLM) works as vLLM's V1 scheduler does: running
sequences decode first; chunked prefill fills the rest of the token budget
``max_batch_tokens``; new requests join from the queue while there is budget, a free
sequence slot (``max_num_seqs``) and KV room (see ``engine.admission``). Without chunked
prefill the engine alternates, prefill-first, between prefill-only and decode-only
iterations (vLLM V0). When the KV cache runs out, the most recently admitted sequence
is preempted and later recomputed (its prefill target becomes prompt + generated), or,
with swap preemption, resumes from its KV copied back from host memory.
``engine.admission`` chooses what a request needs free to be admitted: blocks for the rest of its
prompt beside what the running prompts still need, above vLLM's watermark (``preempt``: a prompt that
cannot finish beside them waits instead of taking a chunk's blocks, being preempted and recomputed over
and over), for its whole prompt (``max_utilization``, TensorRT-LLM's
MAX_UTILIZATION, which then pauses and recomputes as vLLM does), or for its whole length,
prompt plus output, net of what every running request still has reserved
(``guaranteed_no_evict``, TensorRT-LLM's GUARANTEED_NO_EVICT: nothing is ever preempted). A
queue timeout either forces an old request into the next iteration past the token
budget or rejects it.

With a tiered KV cache (prefix caching, a host tier or swapping,
:mod:`llmsim.sim.prefix_cache`; ``kv.tiered``) the engine calls its hooks: ``advance`` as
time passes, ``match`` and ``admit`` to admit a request (its cached prefix is not computed:
its prefill starts after it), ``filled`` after each prompt chunk, and ``charge`` to add the
host transfers an iteration started to its duration. Without one none of them runs.

The engine keeps the prompts; decoding sequences live in its decode set
(:mod:`llmsim.sim.decode` says what the engine calls and when): one token per step
kept by events, or speculative steps in packed arrays. Static batching is a different
engine altogether (:mod:`llmsim.sim.static_batching`).
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np
import simpy
from simpy.events import NORMAL, URGENT

from llmsim.config.policies import Admission, OnTimeout
from llmsim.cost.roofline import CostModel
from llmsim.scenario.scenario import EngineConfig
from llmsim.sim.decode import DecodeSet, EventDecodeSet
from llmsim.sim.environment import scheduler, waker
from llmsim.sim.iterations import Iteration, IterationLog
from llmsim.sim.kvcache import KVCache
from llmsim.sim.prefix_cache import TieredKV
from llmsim.sim.request import FINISHED, REJECTED, RUNNING, InterTokenGaps, Request, Waiting, WaitingQueue

Observer = Callable[["Engine", Iteration], None]


class StepsTogether(Protocol):
    """A replica's engines stepped together through their decode-only iterations
    (:class:`llmsim.sim.replica_steps.ReplicaSteps`, which imports this module)."""

    def run(self, first: Engine, in_flight: float) -> bool:
        """``first``'s iteration in flight, ``in_flight`` seconds long, is over: step the replica on from there
        (True), or do nothing where ``first`` must go on through its own loop (False)."""

# (A module constant: in Python 3.11 reading an enum member through its class goes through EnumType's __getattr__
# hook, about 0.1 us, and admission reads it at every call.)
DISPATCH = OnTimeout.DISPATCH

# vLLM's block-manager watermark: the share of KV blocks a new prompt must leave free to be admitted
# (vLLM ``BlockSpaceManager(watermark=0.01)``, ``watermark_blocks = int(watermark * num_gpu_blocks)``), so
# that running sequences keep room to grow and a just-admitted prompt is not preempted at once.
VLLM_WATERMARK = 0.01


def rejects_on_timeout(config: EngineConfig) -> bool:
    """Whether waiting requests may time out and be rejected (``on_timeout: reject``)."""
    return config.queue_timeout_s is not None and config.on_timeout is OnTimeout.REJECT


def reject_expired(queue: WaitingQueue, config: EngineConfig, now: float,
                   on_done: Callable[[Request, float], None]) -> None:
    """``on_timeout: reject``: requests that waited ``queue_timeout_s`` without starting leave."""
    timeout_s = config.queue_timeout_s
    assert timeout_s is not None            # called only where rejects_on_timeout(config): a timeout is set
    for request in queue.expire(now, timeout_s):
        reject_timed_out(request, timeout_s, now, on_done)


def reject_timed_out(request: Request, timeout_s: float, now: float,
                     on_done: Callable[[Request, float], None]) -> None:
    """``request`` waited ``timeout_s`` without starting: it leaves, rejected, when the timeout passed."""
    request.status, request.reason = REJECTED, "timeout"
    request.finish_s = request.arrival_s + timeout_s
    on_done(request, now)


class EngineProcess:
    """What the rest of the simulation sees of an engine: a loop serving one micro-batch of
    replica ``index`` from ``queue`` with ``kv``, woken by :meth:`notify` when work may be
    waiting, logging its iterations to ``log`` and reporting every request that leaves through
    ``on_done(request, now)``. :class:`Engine` and the static-batching engine are the two kinds;
    each calls :meth:`start` once it is built. An engine is driven by scheduled calls of its
    ``_resume`` (:mod:`llmsim.sim.environment`), ordered among the simulation's events as a
    SimPy process's timeouts and wake-up events would be, with less bookkeeping: each call runs
    the engine up to its next wait, which it passes to :meth:`_wait` (a delay, or None: until
    notified).

    Engines keep their state in slots, not in a per-object dict: with many replicas each iteration reads
    another engine's state than the last one did, and slots hold it together in a few cache lines.
    """

    # (Those an iteration reads first, in a few cache lines; the slots of Engine follow them.)
    __slots__ = ("env", "kv", "queue", "config", "log", "_wake", "_wake_at", "_idle", "index", "cost", "micro_batch",
                 "on_done", "gaps", "preemptions", "_schedule")

    def __init__(self, env: simpy.Environment, index: int, cost: CostModel, kv: KVCache,
                 queue: Waiting, config: EngineConfig, on_done: Callable[[Request, float], None],
                 micro_batch: int = 0):
        self.env, self.index, self.cost, self.kv, self.queue, self.config = env, index, cost, kv, queue, config
        self.micro_batch = micro_batch              # which of the pipeline's micro-batches this engine runs
        self.on_done = on_done
        self.log = IterationLog()
        self.gaps = InterTokenGaps()
        self.preemptions = 0
        self._idle = False                          # waiting for notify()
        self._schedule, self._wake = scheduler(env), self._resume      # bound once: used at nearly every step
        self._wake_at = waker(env)

    def take_gaps(self) -> InterTokenGaps:
        """The inter-token gaps handed to ``gaps`` so far, taken out of it (a run streamed to disk
        sums them as it goes; the rest come at :meth:`close`)."""
        taken, self.gaps = self.gaps, InterTokenGaps()
        return taken

    def start(self) -> None:
        """Start the engine at the current time, before the events already scheduled for it, as
        SimPy starts a process."""
        self._schedule(self._wake, URGENT)

    def _resume(self) -> None:
        """A scheduled call: run the engine up to its next wait and :meth:`_wait` for it."""
        raise NotImplementedError

    def _wait(self, delay: float | None) -> None:
        """Resume after ``delay`` seconds, or (None) when :meth:`notify` says work may be waiting."""
        if delay is None:
            self._idle = True
        else:
            self._schedule(self._wake, NORMAL, delay)

    def notify(self) -> None:
        """New work may be waiting: wake the engine if it is idle."""
        if self._idle:
            self._idle = False
            self._schedule(self._wake)

    def report_finished(self, request: Request, now: float) -> None:
        """``request`` has all its tokens at ``now`` (its KV already given back): record it and report it."""
        request.blocks = 0
        request.generated = request.output_tokens
        request.finish_s = now
        request.status = FINISHED
        self.on_done(request, now)

    def rejects_on_timeout(self) -> bool:
        """Whether waiting requests may time out and be rejected (``on_timeout: reject``)."""
        return rejects_on_timeout(self.config)

    def expire_waiting(self, now: float) -> None:
        """Reject the waiting requests whose queue timeout has passed."""
        queue = self.queue
        # Only static batching uses this, and it runs without traffic classes (scenario checks): a FIFO queue.
        assert isinstance(queue, WaitingQueue)
        reject_expired(queue, self.config, now, self.on_done)


def timeout_decides(forced: bool, budget: int, whole: int, chunk: int, tested: bool) -> bool:
    """Whether a dispatching queue timeout decides an admission of the queue's head (see :meth:`Queueing.admit`):
    unforced, a fit that refuses it or cuts its first chunk below ``whole`` (``min(prompt left,
    max_batch_tokens)``); forced, a budget below ``whole``, or a ``chunk`` admitted past a skipped admission
    test the unforced fit would fail (``tested`` False). ``chunk``: what the fit took (0: nothing)."""
    return (budget < whole or bool(chunk and not tested)) if forced else chunk < whole


class Queueing:
    """The order in which an engine serves its waiting queue: FIFO here, traffic classes in
    :class:`llmsim.sim.scheduling.ClassQueueing`. It admits waiting requests while the engine has
    room (:meth:`admit`), picks the running request to preempt when the KV cache runs out
    (:meth:`victim`), rejects those that waited too long (:meth:`expire_waiting`) and, where the
    policy preempts for waiting requests, makes room for them before each iteration
    (:meth:`make_room`). The engine tells it who starts and who leaves (:meth:`started`,
    :meth:`left`). Built once per engine, as ``queueing(engine)``.
    """

    preempts_for_waiting = False          # whether make_room runs before every iteration
    tracks_seats = False                  # whether started and left do anything (the engine skips them if not)

    def __init__(self, engine: Engine):
        self.engine = engine
        # The longest wait, since its arrival, of a request at the queue's head at an admission that a dispatching
        # queue timeout could have changed (:meth:`admit`): what lets a run stand for the same run at another timeout
        self.dispatch_wait_s = 0.0

    def rejects_on_timeout(self) -> bool:
        return rejects_on_timeout(self.engine.config)

    def expire_waiting(self, now: float) -> None:
        engine = self.engine
        queue = engine.queue
        assert isinstance(queue, WaitingQueue)    # FIFO order, FIFO queue (ClassQueueing overrides this)
        reject_expired(queue, engine.config, now, engine.on_done)

    def admit(self, now: float, budget: int, chunks: list[tuple[Request, int]]) -> None:
        """Move requests from the queue head into the batch while budget, slots and blocks allow.

        A dispatching queue timeout acts only here, through ``fit``'s ``forced``, and a forced fit differs from
        an unforced one only where the unforced one refuses the head or cuts its first chunk below ``whole =
        min(prompt left, max_batch_tokens)`` (the forced one's limit is ``max(budget, max_batch_tokens)``, and it
        may skip the admission test): an unforced fit that does so, or a forced one with a budget below ``whole``
        or that admits past a skipped test the unforced one would fail, is an admission the timeout decides. The
        run is the run at any dispatching timeout (none included) longer than :attr:`dispatch_wait_s`, the longest
        wait of a head at such an admission: up to the first at which two such runs force differently, they are
        the same run."""
        engine = self.engine
        cfg, queue, running = engine.config, engine.queue, engine.running
        timeout = cfg.queue_timeout_s if cfg.on_timeout is DISPATCH else None
        max_num_seqs, max_batch_tokens = cfg.max_num_seqs, cfg.max_batch_tokens
        while queue and len(running) < max_num_seqs:
            request = queue.head()
            waited_s = now - request.arrival_s
            forced = timeout is not None and waited_s >= timeout
            whole = min(request.prefill_target - request.prefilled, max_batch_tokens)
            # a forced fit that skips the admission test: whether the unforced one would pass it (asked before the
            # fit takes blocks; with a tiered cache, whose match comes first, taken as not)
            tested = not (forced and engine._forced_skips_test) or (engine._tiered is None
                                                                     and engine._admission(engine, request))
            chunk = engine.fit(request, now, budget, forced)
            if waited_s > self.dispatch_wait_s and timeout_decides(forced, budget, whole, chunk, tested):
                self.dispatch_wait_s = waited_s
            if not chunk:
                break
            queue.pop(now)
            engine.start_request(request, now, chunk, chunks)
            budget -= chunk

    def victim(self) -> Request:
        """The running request to preempt for KV room: the most recently admitted."""
        return next(reversed(self.engine.running.values()))

    def make_room(self, now: float) -> None:
        """Preempt running requests for waiting ones (only where ``preempts_for_waiting``)."""

    def started(self, request: Request) -> None:
        """``request`` joined the batch."""

    def left(self, request: Request) -> None:
        """``request`` left the batch: finished or preempted."""


def _room_beside_running_prompts(engine: Engine, request: Request) -> bool:
    """vLLM: the blocks the whole prompt still needs fit beside what the prompts already running still
    need, leaving the watermark free (vLLM's block manager admits a prompt only when
    ``free - needed >= watermark``); an empty engine takes it whatever its length."""
    if not engine.running:
        return True
    kv = engine.kv
    size = kv.block_size                # kv.blocks_for, inline: this runs at every admission
    needed = -(-request.prefill_target // size) + -request.prefilled // size     # ceil(target) - ceil(prefilled)
    pending = 0
    for r in engine.prefilling:
        pending += -(-r.prefill_target // size) - r.blocks
    return needed <= kv.free_blocks - pending - engine.watermark_blocks


def _whole_prompt_free(engine: Engine, request: Request) -> bool:
    """TensorRT-LLM's MAX_UTILIZATION: the whole prompt's blocks are free."""
    kv = engine.kv
    return kv.blocks_for(request.prefill_target) <= kv.free_blocks


def _whole_length_reserved(engine: Engine, request: Request) -> bool:
    """TensorRT-LLM's GUARANTEED_NO_EVICT: the whole length's blocks (prompt + output) are free beyond what
    running requests still have reserved. The simulator knows each request's output length; it stands for
    the max_tokens TensorRT-LLM reserves."""
    kv, held = engine.kv, engine.decode.blocks
    reserved = sum(kv.blocks_for(r.prompt_tokens + r.output_tokens) - held(r) for r in engine.running.values())
    return kv.blocks_for(request.prompt_tokens + request.output_tokens) <= kv.free_blocks - reserved


# What a request needs free in the KV cache to join, beyond its first chunk's blocks.
ADMISSION_TESTS: dict[Admission, Callable[[Engine, Request], bool]] = {
    Admission.PREEMPT: _room_beside_running_prompts, Admission.MAX_UTILIZATION: _whole_prompt_free,
    Admission.GUARANTEED_NO_EVICT: _whole_length_reserved}
# The admissions whose test a request forced in by its queue timeout skips (vLLM: it takes its first chunk).
FORCED_SKIP_TEST = frozenset({Admission.PREEMPT})


class Engine(EngineProcess):
    """A continuous-batching engine for one micro-batch of a replica (see the module docstring).

    ``decode`` builds the decode set from the engine (``EventDecodeSet`` by default), ``queueing``
    the order it serves its queue in (:class:`Queueing`, FIFO, by default).
    ``observers`` are called as ``observer(engine, iteration)`` after every iteration's
    tokens have appeared, then ``hooks`` as ``hook(engine)`` (for callers that need only the engine's state:
    the loop builds the :class:`Iteration` only for observers); with neither the loop does not look at them.
    ``first_gap_end_s`` / ``first_gap_s`` collect, for the first token of every decode run
    after the first, when it appeared and its gap since the token before (the decode sets
    and recomputed prompts write them; ``close`` and ``take_gaps`` hand them to ``gaps``).
    """

    # (Those every iteration reads first, in the order it reads them.)
    __slots__ = ("_in_flight", "now", "observers", "hooks", "_chunks", "decode", "_expires", "_extras", "prefilling",
                 "_admit", "_chunk_rows", "_chunk_rows_w", "_last_end_s", "_decoding",
                 "running", "_tiered", "_handoff", "_admitted", "watermark_blocks", "first_gap_end_s", "first_gap_s",
                 "queueing", "_admission", "_forced_skips_test", "_makes_room", "_tracks_seats", "_async",
                 "_prices_extra", "_log_decode_step", "_log_step", "steps_together")

    def __init__(self, env: simpy.Environment, index: int, cost: CostModel, kv: KVCache,
                 queue: Waiting, config: EngineConfig, on_done: Callable[[Request, float], None],
                 micro_batch: int = 0, decode: Callable[[Engine], DecodeSet] = EventDecodeSet,
                 queueing: Callable[[Engine], Queueing] = Queueing):
        super().__init__(env, index, cost, kv, queue, config, on_done, micro_batch)
        self.now = env.now                          # the engine's clock: may run ahead of env.now, see run()
        self.observers: list[Observer] = []
        self.hooks: list[Callable[[Engine], None]] = []
        self._admitted = 0
        # The rows the decode set sums an iteration's prompt chunks from (llmsim.cost.features.chunk_sums).
        self._hold_chunk_rows(64)
        # The tiered cache whose hooks the engine calls (None: a plain KVCache, whose ``tiered`` is False).
        self._tiered: TieredKV | None = kv if isinstance(kv, TieredKV) else None
        self.watermark_blocks = int(VLLM_WATERMARK * kv.num_blocks)
        self.running: dict[int, Request] = {}       # everything admitted, in admission order
        self.prefilling: list[Request] = []         # admitted, prompt not yet fully computed
        self.first_gap_end_s = array("d")         # packed: one entry per decode run of every request
        self.first_gap_s = array("d")
        self.decode = decode(self)
        # A decode set may price and log a decode-only iteration in one call (the one-token set's, and the speculative
        # set's where its models are tabulated), and one with prompt chunks likewise (the same two sets).
        decode_set = self.decode
        self._log_decode_step = decode_set.log_decode_step
        self._log_step = decode_set.log_step
        self.queueing = queueing(self)
        self._admission = ADMISSION_TESTS[config.admission]
        self._forced_skips_test = config.admission in FORCED_SKIP_TEST
        self._expires = self.queueing.rejects_on_timeout()
        self._makes_room = self.queueing.preempts_for_waiting
        self._tracks_seats = self.queueing.tracks_seats
        self._admit = self.queueing.admit
        # The iteration last planned (:meth:`_plan`): its prompt chunks and whether the decoding sequences step
        # (its row is the log's last), and, while the engine waits for its end, its duration (it began at self.now).
        self._chunks: list[tuple[Request, int]] = []
        self._decoding = False
        self._in_flight: float | None = None
        self._async = config.async_scheduling
        self._last_end_s = -1.0                     # when the last iteration scheduled ends
        # The replica's engines stepped together through their decode-only iterations, where they can be
        # (llmsim.sim.replica_steps.step_together sets it): None, each engine on its own.
        self.steps_together: StepsTogether | None = None
        self.handoff = None
        self.start()

    @property
    def handoff(self) -> Callable[[Request, float], None] | None:
        """A disaggregated prefill pool's engine: a request whose prompt is computed leaves the batch keeping
        its KV blocks and is handed, with the time, to this (llmsim.sim.disaggregated), not decoded here."""
        return self._handoff

    @handoff.setter
    def handoff(self, to: Callable[[Request, float], None] | None) -> None:
        self._handoff: Callable[[Request, float], None] | None = to
        # whether any of the steps most engines skip applies (:meth:`_plan`), and whether one of them changes an
        # iteration's price or row (a tiered cache's transfers, asynchronous scheduling, a hand-off): making room
        # for waiting requests only changes who runs, so such an iteration is still priced and logged in one call
        self._prices_extra = self._tiered is not None or self._async or to is not None
        self._extras = self._makes_room or self._prices_extra

    def _resume(self) -> None:
        """A scheduled call: the iteration in flight (if any) is over; with the replica's other engines where
        they can step together (:attr:`steps_together`), else through :meth:`_run`."""
        duration = self._in_flight                  # the iteration in flight, if any, is over now
        self._in_flight = None
        if duration is None or self.steps_together is None or not self.steps_together.run(self, duration):
            self._run(duration)

    def _run(self, duration: float | None) -> None:
        """The engine's loop, one turn per iteration, from one wait to the next: the iteration in
        flight (``duration`` long, if any) is over, then iterations are scheduled, and run, until one must
        be waited for or there is nothing to do."""
        # (Methods are called through self, not bound to locals first: with many replicas a call
        # usually runs one iteration, and binding them would build each bound method for it. A callable
        # the engine holds in a slot is read into a local instead, which builds nothing: Python 3.11 does
        # not specialize a call through an attribute that is not a method of the class, as ``self._f()``.)
        env, wake_at = self.env, self._wake_at
        while True:
            if duration is not None:
                # The iteration last planned is over at its end (the sum that scheduled this call, or
                # that the loop runs it to at once): its tokens appear.
                self.now = now = self.now + duration
                if self.observers or self.hooks:
                    self._complete()
                elif self._chunks:
                    self._apply(self._chunks, self._decoding)
                else:
                    self.decode.advance(now)        # a decode-only iteration: _apply() would only call this
            if self.now < env._now:                 # SimPy's clock without its property's call
                self.now = env._now
            if self._expires:
                self.queueing.expire_waiting(self.now)
            duration = self._plan()
            if duration is None:
                self._idle = True                   # until notify()
                return
            end = self.now + duration
            # The iteration ends before any other event in the simulation (an arrival,
            # another engine's step, the horizon): nothing can observe it, so run it
            # without a trip through the event queue. Otherwise wait for its end there.
            if wake_at(self._wake, end):
                self._in_flight = duration
                return

    def _complete(self) -> None:
        """The iteration last planned is over at ``self.now``: its tokens appear, then the observers see it and
        the hooks run."""
        self._apply(self._chunks, self._decoding)
        if self.observers:
            iteration = self.last_iteration()
            for observer in self.observers:
                observer(self, iteration)
        for hook in self.hooks:
            hook(self)

    def close(self) -> None:
        """End of the run: bring unfinished requests' token counts up to date and hand the
        inter-token gaps to ``self.gaps`` (call once)."""
        self.decode.close(self.gaps)
        self._hand_over_first_gaps()

    def take_gaps(self) -> InterTokenGaps:
        self._hand_over_first_gaps()
        return super().take_gaps()

    def _hand_over_first_gaps(self) -> None:
        self.gaps.add(np.frombuffer(self.first_gap_end_s), np.frombuffer(self.first_gap_s),
                      np.broadcast_to(1.0, len(self.first_gap_s)))
        self.first_gap_end_s, self.first_gap_s = array("d"), array("d")

    # -- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> Iteration | None:
        """Pick and price the next iteration at ``self.now`` and log it; None if there is nothing to do.

        Admission, prefill chunks and the decode set's KV reservation happen here (they may
        preempt); the tokens appear in :meth:`apply`.
        """
        return None if self._plan() is None else self.last_iteration()

    def last_iteration(self) -> Iteration:
        """The iteration last planned, as its log row and what it scheduled."""
        return self.log.last(self._chunks, self._decoding)

    def _plan(self) -> float | None:
        """:meth:`schedule` without building its :class:`Iteration` (the engine's loop needs only the
        duration): the log gets its row, and ``_chunks`` and ``_decoding`` say what it scheduled."""
        cfg, now, decode, queue = self.config, self.now, self.decode, self.queue
        chunks: list[tuple[Request, int]] = []
        self._chunks = chunks
        # (The membership tests skip calls that would find nothing to do: this is the hot loop. ``_extras``
        # says whether any of the steps most engines skip applies: making room, a tiered cache, a hand-off,
        # asynchronous scheduling; ``_prices_extra`` whether one of them changes the iteration's price or row.)
        if self._extras:
            if self._makes_room and queue and self.running:
                self.queueing.make_room(now)
            if self._tiered is not None:
                self._tiered.advance(now)
        if cfg.chunked_prefill:
            budget = cfg.max_batch_tokens - (decode.prepare(now) if decode.n else 0)
            if self.prefilling:
                budget = self._schedule_prefills(budget, chunks)
            if queue:
                self._admit(now, budget, chunks)
            decoding = decode.n > 0                  # admission may have preempted decoders
        else:
            # Prefill-first: any admissible prompt runs in a prefill-only iteration.
            if queue:
                self._admit(now, cfg.max_batch_tokens, chunks)
            decoding = not chunks and decode.n > 0
            if decoding:
                decode.prepare(now)
                decoding = decode.n > 0              # its KV reservation may have preempted them all
        if chunks:
            prefill_tokens, completed = self._write_chunk_rows(chunks)
            log_step = self._log_step              # (a callable held in a slot: see _run)
            if not self._prices_extra and log_step is not None:
                # Summed, priced and logged by the decode set, as the lines below would.
                kv = self.kv
                duration = log_step(self.log, now, self._chunk_rows, len(chunks), decoding, prefill_tokens, completed,
                                    kv.num_blocks - kv.free_blocks, len(self.running), len(queue))
                if duration == duration:            # (NaN: a price not in the tables, the lines below work it out)
                    self._last_end_s = now + duration
                    self._decoding = decoding
                    return duration
            prefill_tokens, pairs, prefill_kv, completed, padding, longest = decode.sum_chunks(
                self._chunk_rows, len(chunks))
            duration, n, tokens_out, flops, moved, n_spec, proposed, accepted, draft_s = decode.price(
                chunks, decoding, prefill_tokens, pairs, prefill_kv, completed, padding, longest)
        elif decoding:
            log_decode_step = self._log_decode_step
            if not self._prices_extra and log_decode_step is not None:
                # The steady state: priced and logged in one call, as the lines below would.
                kv = self.kv
                duration = log_decode_step(self.log, now, kv.num_blocks - kv.free_blocks, len(self.running),
                                           len(queue))
                if duration == duration:            # (NaN: a speculative step not priced in one call)
                    self._last_end_s = now + duration
                    self._decoding = True
                    return duration
            prefill_tokens = 0.0
            completed = 0
            duration, n, tokens_out, flops, moved, n_spec, proposed, accepted, draft_s = decode.price_decode()
        else:
            return None
        if self._prices_extra:
            if self._handoff is not None:     # a prefill pool's engine: the decode pool emits every token
                tokens_out = 0
            if self._async:
                duration = self._overlap_host(now, duration, n + completed)
            if self._tiered is not None:
                duration = self._tiered.charge(now, duration)
        self._last_end_s = now + duration
        kv = self.kv
        self._decoding = decoding
        self.log.add(now, duration, n, len(chunks), prefill_tokens, tokens_out, flops, moved,
                     kv.num_blocks - kv.free_blocks, len(self.running), len(queue), n_spec, proposed, accepted, draft_s)
        return duration

    def _write_chunk_rows(self, chunks: list[tuple[Request, int]]) -> tuple[float, int]:
        """Write the iteration's prompt chunks into ``_chunk_rows`` as :func:`~llmsim.cost.features.chunk_sums`
        reads them (cached positions, new positions, prompt length), and return their tokens and the prompts they
        complete, summed as it sums them (what the one-call step looks its remembered terms up by)."""
        rows = self._chunk_rows_w
        if 3 * len(chunks) > len(rows):
            self._hold_chunk_rows(2 * len(chunks))
            rows = self._chunk_rows_w
        i, tokens, completed = 0, 0.0, 0
        for request, new in chunks:
            cached, target = request.prefilled, request.prefill_target
            rows[i], rows[i + 1], rows[i + 2] = cached, new, target
            tokens += new
            completed += cached + new == target
            i += 3
        return tokens, completed

    def _hold_chunk_rows(self, chunks: int) -> None:
        """Room in ``_chunk_rows`` for ``chunks`` prompt chunks' rows, written through a memoryview of it (an item
        written through one costs less than through numpy's indexing)."""
        self._chunk_rows = np.zeros(3 * chunks, np.int64)
        # (an int64 array's buffer; typeshed cannot read a memoryview's item type from a numpy array)
        self._chunk_rows_w = cast("memoryview[int]", memoryview(cast(bytearray, self._chunk_rows)))

    def _overlap_host(self, now: float, duration: float, sampled: int) -> float:
        """Asynchronous scheduling (vLLM ``--async-scheduling``): the CPU prepares this step while the GPU
        runs the previous one, so a step that follows another at once takes the longer of its GPU and CPU
        parts. A step after the engine idled has nothing to hide its CPU work behind and pays both: the
        scheduling gap an online server pays at every wake-up and an offline run only at its start."""
        host_s = self.cost.host_time_s(sampled)
        return max(duration - host_s, host_s) if now == self._last_end_s else duration

    def apply(self, iteration: Iteration) -> None:
        """The iteration is over at ``self.now``: its decode tokens and prompt chunks are done."""
        self._apply(iteration.chunks, iteration.decoding)

    def _apply(self, chunks: Sequence[tuple[Request, int]], decoding: bool) -> None:
        now, tiered, handoff = self.now, self._tiered, self._handoff
        if decoding:
            self.decode.advance(now)
        for request, chunk in chunks:
            if request.status is not RUNNING:     # preempted after its chunk was scheduled (by priority)
                continue
            request.prefilled += chunk
            if tiered is not None:
                tiered.filled(request)
            if request.prefilled < request.prefill_target:
                continue
            # The prompt is complete: its first token (or, after a recompute, the next one).
            self.prefilling.remove(request)
            if handoff is not None:
                self.hand_off(request, now)
                continue
            if request.generated == 0:
                request.first_token_s = now
            else:
                request.max_itl_s = max(request.max_itl_s, now - request.last_token_s)
                self.first_gap_end_s.append(now)
                self.first_gap_s.append(now - request.last_token_s)
            request.generated += 1
            request.last_token_s = now
            if request.generated >= request.output_tokens:
                self.finish(request, now)
            else:
                self.decode.start(request)

    # -- prompts --------------------------------------------------------------------------------
    def _schedule_prefills(self, budget: int, chunks: list[tuple[Request, int]]) -> int:
        """Continue prompts already admitted (in admission order) with what the budget allows."""
        for request in list(self.prefilling):
            if budget <= 0:
                break
            if request.status is not RUNNING:        # preempted while making room for an earlier one
                continue
            chunk = min(request.prefill_target - request.prefilled, budget)
            if not self._grow(request, chunk):
                continue
            chunks.append((request, chunk))
            budget -= chunk
        return budget

    def _grow(self, request: Request, chunk: int) -> bool:
        """Allocate blocks for ``chunk`` more tokens of a prefilling request; preempt later ones if needed."""
        kv = self.kv
        while True:
            wanted = kv.blocks_for(request.prefilled + chunk) - request.blocks
            if wanted <= kv.free_blocks:
                kv.allocate(wanted)
                request.blocks += wanted
                return True
            if self.preempt_latest(self.now) is request:
                return False

    def fit(self, request: Request, now: float, budget: int, forced: bool) -> int:
        """The first chunk ``request`` starts with if it joins now, its KV blocks taken; 0 (nothing
        taken) when it does not fit the budget (past it when ``forced``), the admission test or the cache."""
        if self._tiered is not None:
            self._tiered.match(request, now)          # its cached prefix (or swapped-out KV) is not computed
        chunk = self.first_chunk(request, budget, forced)
        return chunk if chunk and self._take_blocks(request, chunk, now) else 0

    def first_chunk(self, request: Request, budget: int, forced: bool) -> int:
        """The first chunk ``request`` would start with under ``budget`` (past it when ``forced``), its blocks
        aside; 0 when it does not fit the budget or the admission test. Takes nothing."""
        cfg = self.config
        todo = request.prefill_target - request.prefilled
        limit = max(budget, cfg.max_batch_tokens) if forced else budget
        chunk = min(todo, limit) if cfg.chunked_prefill else todo
        if chunk <= 0 or chunk > limit:
            return 0
        # A request forced in by its queue timeout takes only its first chunk's blocks under vLLM's admission
        # (it may be preempted later like any other); TensorRT-LLM's tests hold for it as for every request.
        if not (forced and self._forced_skips_test) and not self._admission(self, request):
            return 0
        return chunk

    def blocks_wanted(self, request: Request, chunk: int) -> int:
        """KV blocks ``request`` takes for its first ``chunk``, beyond those it holds (without a tiered cache).

        A request whose KV arrived from a prefill replica holds its prompt but the last token already
        (llmsim.sim.disaggregated), reserved or not yet; any other holds nothing here."""
        return self.kv.blocks_for(request.prefilled + chunk) - request.blocks

    def _take_blocks(self, request: Request, chunk: int, now: float) -> bool:
        """KV blocks for ``request``'s first ``chunk`` (and, with a tiered cache, the cached prefix the
        last ``kv.match`` found); False, taking nothing, when they do not fit."""
        if self._tiered is not None:
            return self._tiered.admit(request, chunk, now)
        kv = self.kv
        wanted = self.blocks_wanted(request, chunk)
        if wanted > kv.free_blocks:
            return False
        kv.allocate(wanted)
        request.blocks += wanted
        return True

    def start_request(self, request: Request, now: float, chunk: int, chunks: list[tuple[Request, int]]) -> None:
        """Admit ``request``, just taken from the queue with its blocks, for its first ``chunk``."""
        self.join(request, now)
        chunks.append((request, chunk))

    def join(self, request: Request, now: float) -> None:
        """``request`` joins the batch holding its blocks; the prompt scheduling continues it from ``prefilled``
        (a disaggregated decode engine takes a request whose KV it reserved this way, past its queue)."""
        request.status = RUNNING
        request.admit_order = self._admitted
        self._admitted += 1
        if request.first_scheduled_s != request.first_scheduled_s:   # NaN: first time
            request.first_scheduled_s = now
        self.running[request.id] = request
        self.prefilling.append(request)
        if self._tracks_seats:
            self.queueing.started(request)

    # -- leaving --------------------------------------------------------------------------------
    def hand_off(self, request: Request, now: float) -> None:
        """``request``'s prompt is computed on a prefill pool's engine: it leaves the batch, its KV blocks
        still held (the decode pool's side frees them once the KV has crossed), and goes to ``handoff``."""
        assert self._handoff is not None          # called only on a prefill pool's engine, which has one
        if self._tracks_seats:
            self.queueing.left(request)
        del self.running[request.id]
        self._handoff(request, now)

    def finish(self, request: Request, now: float) -> None:
        """``request`` has all its tokens: free its KV (all but its last token's was computed) and report it."""
        if self._tracks_seats:
            self.queueing.left(request)
        self.kv.release(request, now, request.prompt_tokens + request.generated - 1)
        del self.running[request.id]
        self.report_finished(request, now)

    def preempt_latest(self, now: float) -> Request:
        """Make room in the KV cache: preempt the request the queueing order gives up first (FIFO: the
        most recently admitted). Returns it."""
        return self.preempt(self.queueing.victim(), now)

    def preempt(self, request: Request, now: float) -> Request:
        """Preempt ``request``: free its KV and send it back to the queue front, to be recomputed
        (prompt plus what it generated) from what the KV cache keeps of it (nothing, unless it
        swaps). Returns it."""
        if self._tracks_seats:
            self.queueing.left(request)
        if request in self.prefilling:
            self.prefilling.remove(request)
            kv_tokens = request.prefilled
        else:
            self.decode.stop(request)
            kv_tokens = request.prompt_tokens + request.generated - 1
        kept = self.kv.preempt(request, now, kv_tokens)
        del self.running[request.id]
        request.prefill_target = request.prompt_tokens + request.generated
        request.prefilled = kept
        request.blocks = 0
        request.preemptions += 1
        self.preemptions += 1
        self.queue.push_front(request, now)
        return request
