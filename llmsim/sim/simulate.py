"""Putting a scenario in motion: arrivals, a router, replicas, and what they record.

``simulate(scenario)`` builds a SimPy environment with one arrival process (the
scenario's trace, replayed in time), a router that hands each request to a
replica, and per replica one engine process per pipeline micro-batch
(:class:`~llmsim.sim.engine.Engine`, or
:class:`~llmsim.sim.static_batching.StaticBatchEngine`), as the scenario's
:class:`~llmsim.scenario.deployment.ResolvedDeployment` says. It runs until every
request is done or the horizon is reached, and returns a :class:`SimulationResult`
whose per-request records feed every metric.

A run stopped early keeps what was simulated: the horizon, Ctrl-C (SIGINT ends the run between
two steps, :func:`~llmsim.sim.environment.ctrl_c_between_steps`; a second one raises
``KeyboardInterrupt`` at once) or a fault (any other exception inside it) ends the
run at that simulated time, and the result holds only the requests that arrived by then
(requests still in the system recorded as they stood, ``unfinished``); later requests of
the trace have no row and are counted as ``not_arrived`` in the summary, whose rates are
over the simulated time (:func:`llmsim.analysis.metrics.summarize`). ``stopped_by`` says
what ended it. A fault is never hidden: the exception is raised again, carrying the
partial result as its ``partial_result`` attribute (and a note saying so), for a caller
to write before reporting the error.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from functools import partial
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np
import pandas as pd
import simpy
from simpy.events import NORMAL, URGENT

from llmsim.config.policies import Batching, PreemptionMode, RouterPolicy
from llmsim.config.recent import recent
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import Scenario, host_kv_blocks
from llmsim.sim.autoscaling import ReplicaPool, ScalingLog, autoscaler
from llmsim.sim.controller import ControlLog, controller
from llmsim.sim.disaggregated import DisaggregatedRouter, make_pool, pool_totals, totals, transfer_columns
from llmsim.sim.engine import Engine, Observer, Queueing
from llmsim.sim.environment import Environment, ctrl_c_between_steps, frozen_heap, scheduler
from llmsim.sim.horizon import default_horizon_s
from llmsim.sim.checkpoints import Checkpoints, Stage, watch_checkpoints
from llmsim.sim.iterations import iterations_columns
from llmsim.sim.kvcache import KVCache
from llmsim.sim.missed import MissedStop, watch_misses
from llmsim.sim.prefix_cache import HostTier, PrefixKeys, TieredKV
from llmsim.sim.replica_steps import step_together
from llmsim.sim.resources import check_run_size
from llmsim.sim.result import SUMMED_KV_TOTALS, KVTierTotals, SimulationResult, SpeculationSteps, StopReason
from llmsim.sim.request import (REJECTED, InterTokenGaps, Request, RequestRecords, StreamedRecords, TimeAverage,
                                Waiting, WaitingQueue)
from llmsim.sim.slo import meets_slo
from llmsim.sim.scheduling import ClassQueue, class_mean_queue_lengths, class_queue_factory, class_queueing
from llmsim.sim.speculative_decode import SpeculativeDecodeSet
from llmsim.sim.static_batching import StaticBatchEngine
from llmsim.speculation.config import Acceptance, stream_key
from llmsim.workload.trace import Trace
from llmsim.workload.generate import generate_trace


class RoutePolicy:
    """How the router picks a replica: ``pick`` among every replica, ``pick_serving`` among the serving
    ones of an autoscaled pool; -1 is the shared queue."""

    def pick(self, router: Router, request: Request) -> int:
        raise NotImplementedError

    def pick_serving(self, router: Router, request: Request, pool: ReplicaPool) -> int:
        return pool.least_outstanding(router.outstanding)


class RoundRobin(RoutePolicy):
    def pick(self, router: Router, request: Request) -> int:
        return next(router.cycle)

    def pick_serving(self, router: Router, request: Request, pool: ReplicaPool) -> int:
        return pool.next_in_turn()


class LeastOutstanding(RoutePolicy):
    def pick(self, router: Router, request: Request) -> int:
        return router.least_outstanding()


class SharedQueue(RoutePolicy):
    def pick(self, router: Router, request: Request) -> int:
        return -1


class PrefixAware(RoutePolicy):
    def pick(self, router: Router, request: Request) -> int:
        return router.holding_prefix(request, router.everyone)

    def pick_serving(self, router: Router, request: Request, pool: ReplicaPool) -> int:
        return router.holding_prefix(request, pool.routable)


ROUTE_POLICIES: dict[RouterPolicy, RoutePolicy] = {
    RouterPolicy.ROUND_ROBIN: RoundRobin(), RouterPolicy.LEAST_OUTSTANDING: LeastOutstanding(),
    RouterPolicy.SHARED_QUEUE: SharedQueue(), RouterPolicy.PREFIX_AWARE: PrefixAware()}


class Router:
    """Sends each arriving request to a replica (a group of engines, one per pipeline micro-batch).

    ``round_robin`` cycles; ``least_outstanding`` picks the replica with the fewest
    queued plus running requests (ties to the lowest index); ``shared_queue`` keeps
    one queue that every replica pulls from when it has room (an M/M/c system
    when each replica serves one request at a time). ``prefix_aware`` (with prefix
    caching) picks the replica holding the longest cached prefix of the request (GPU or
    host memory: a session returns to the replica that holds its history), among the
    replicas under a load bound: a replica may take a request while its outstanding
    requests stay under ``ceil(load_bound x (all outstanding + 1) / replicas)``
    (consistent hashing with bounded loads, Mirrokni et al. 2018); ties go to the
    least outstanding. The least loaded replica is always under the bound.

    ``least_outstanding`` finds its replica in constant time, not by a scan of every replica
    per arrival: the replicas are kept grouped by their outstanding count (``_by_count[c]``, a
    bitmask of the replicas holding ``c``), and the pick is the lowest set bit of the lowest
    non-empty group (``_fewest``), the same replica the scan finds.

    The router also keeps the requests in the system (``in_system_requests``, by id): a
    request's record is written to ``records`` when it leaves, and the object dropped.
    Requests arrive in trace order, so the first ``arrived`` rows of ``records`` are the
    requests that reached the system.
    """

    def __init__(self, policy: RouterPolicy, replicas: list[list[Engine]], max_tokens: int, kv_blocks: int,
                 block_size: int, records: RequestRecords, all_done: simpy.Event, load_bound: float = 1.25):
        self.policy, self.replicas = ROUTE_POLICIES[policy], replicas
        self.load_bound = load_bound
        self.max_tokens, self.kv_tokens = max_tokens, kv_blocks * block_size
        self.outstanding = [0] * len(replicas)
        self._by_count = [(1 << len(replicas)) - 1]     # outstanding count -> bitmask of the replicas at it
        self._fewest = 0                                # the lowest count any replica has
        self.cycle = itertools.cycle(range(len(replicas)))
        self.everyone = list(range(len(replicas)))
        self.in_system = TimeAverage(logged=False)
        self.in_system_requests: dict[int, Request] = {}
        self.arrived = 0
        self.records = records
        self._left_to_finish = len(records)
        self._all_done = all_done
        self.pool: ReplicaPool | None = None

    def leave(self, request: Request, now: float) -> None:
        """``request`` leaves the system: its record is written."""
        self.in_system.change(now, -1)
        del self.in_system_requests[request.id]
        self.records.write(request)
        self._left_to_finish -= 1
        if self._left_to_finish == 0 and not self._all_done.triggered:
            self._all_done.succeed(StopReason.COMPLETED)

    def arrive(self, request: Request, now: float, kv_tokens: int | None = None) -> bool:
        """``request`` enters the system; it leaves at once, rejected as too long, when prompt plus output
        exceed the longest request or ``kv_tokens`` (default: a replica's KV cache). False then."""
        self.arrived += 1
        self.in_system.change(now, +1)
        self.in_system_requests[request.id] = request
        total = request.prompt_tokens + request.output_tokens
        if total > self.max_tokens or total > (self.kv_tokens if kv_tokens is None else kv_tokens):
            request.status, request.reason, request.finish_s = REJECTED, "too_long", now
            self.leave(request, now)
            return False
        return True

    def dispatch(self, request: Request, now: float) -> None:
        if not self.arrive(request, now):
            return
        index = self.pick(request)
        if index >= 0:
            self.enqueue(request, index, now)
        else:
            self.replicas[0][0].queue.push(request, now)
            for engines in self.replicas:
                for engine in engines:
                    engine.notify()

    def enqueue(self, request: Request, index: int, now: float) -> None:
        """``request`` joins replica ``index``'s queue (one more outstanding there) and its engines wake."""
        request.replica = index
        self.count(index, +1)
        engines = self.replicas[index]
        engines[0].queue.push(request, now)
        for engine in engines:
            engine.notify()

    def pick(self, request: Request) -> int:
        """The replica for ``request`` (-1: the shared queue)."""
        if self.pool is not None:                 # autoscaling: a serving replica
            return self.policy.pick_serving(self, request, self.pool)
        return self.policy.pick(self, request)

    def least_outstanding(self) -> int:
        """The lowest index among the replicas with the fewest outstanding requests."""
        fewest = self._by_count[self._fewest]
        return (fewest & -fewest).bit_length() - 1

    def holding_prefix(self, request: Request, candidates: list[int]) -> int:
        """The replica of ``candidates`` under the load bound with the longest cached prefix of ``request``."""
        outstanding = self.outstanding
        limit = -(-self.load_bound * (sum([outstanding[i] for i in candidates]) + 1) // len(candidates))
        best, best_hits = -1, -1
        replicas = self.replicas
        for index in candidates:
            load = outstanding[index]
            if load >= limit:
                continue
            kv = replicas[index][0].kv
            assert isinstance(kv, TieredKV)              # prefix-aware routing requires engine.prefix_caching
            hits = kv.cached_prefix(request, request.prompt_tokens)[0]
            if hits > best_hits or (hits == best_hits and load < outstanding[best]):
                best, best_hits = index, hits
        return best

    def done(self, request: Request, now: float, replica: int) -> None:
        if request.replica < 0:          # shared queue: credit the replica that served it
            request.replica = replica
        else:
            self.count(request.replica, -1)
        self.leave(request, now)

    def count(self, index: int, delta: int) -> None:
        """Replica ``index`` holds ``delta`` (+1 or -1) more outstanding requests: move it between the groups."""
        outstanding, by_count = self.outstanding, self._by_count
        was = outstanding[index]
        now_at = outstanding[index] = was + delta
        bit = 1 << index
        by_count[was] ^= bit
        if now_at == len(by_count):
            by_count.append(bit)
        else:
            by_count[now_at] |= bit
        if now_at < self._fewest:
            self._fewest = now_at
        elif not by_count[self._fewest]:             # the last replica at the fewest moved up
            self._fewest += 1

    def write_in_system(self) -> None:
        """End of the run: write the records of the requests still in the system, as they stand."""
        for request in self.in_system_requests.values():
            self.records.write(request)


class Dispatcher(Protocol):
    """Where arrivals go: the router, or the disaggregated router in front of its two pools."""

    def dispatch(self, request: Request, now: float) -> object: ...


ARRIVAL_BATCH = 4096                 # trace rows turned into Python numbers at a time


class Arrivals:
    """Replays the trace: each request is built when it arrives and enters the router.

    Each wait for the next arrival is a scheduled call (:func:`~llmsim.sim.environment.scheduler`),
    keyed as the timeout of a SimPy process replaying the trace would be, and started as such a
    process starts (urgent, now): the same order among the simulation's events, without an event
    object and a generator resumption per request.
    """

    def __init__(self, env: simpy.Environment, records: RequestRecords, router: Dispatcher):
        self.env, self.records, self.router = env, records, router
        # (Bound once, as an engine's _wake: a wait is scheduled for every arrival.)
        self._schedule, self._wake = scheduler(env), self._arrive
        self._next = 0                       # the row of the next request to arrive
        self._rows: list[tuple[int, float, int, int]] = []    # the current batch, reversed: pop() is the next
        self._due = False                    # the next request's wait is over: it arrives now
        self._schedule(self._wake, URGENT)

    def _arrive(self) -> None:
        env, rows, records, schedule = self.env, self._rows, self.records, self._schedule
        while rows or self._load_batch():
            i, arrival_s, prompt, output = rows[-1]
            now = env._now                   # SimPy's clock without its property's call
            if not self._due:
                delay = arrival_s - now
                if delay > 0:
                    self._due = True
                    schedule(self._wake, NORMAL, delay)
                    return
            self._due = False
            rows.pop()
            self.router.dispatch(records.request(i, arrival_s, prompt, output), now)

    def _load_batch(self) -> bool:
        """The next :data:`ARRIVAL_BATCH` rows of the trace as Python numbers (into the batch, empty
        now); False at its end."""
        first, records = self._next, self.records
        if first >= len(records):
            return False
        rows = slice(first, first + ARRIVAL_BATCH)
        self._rows.extend(zip(range(first, first + ARRIVAL_BATCH), records.arrival_s[rows].tolist(),
                              records.prompt_tokens[rows].tolist(), records.output_tokens[rows].tolist()))
        self._rows.reverse()
        self._next = first + len(self._rows)
        return True


def horizon_for(scenario: Scenario, trace: Trace) -> tuple[float, float]:
    """(arrival window, horizon): the window is the last arrival, or the workload's duration when that ended
    the arrivals; the horizon defaults to twice the window and at least 60 s past it,
    or longer where the requests bring more work than that serves (:mod:`llmsim.sim.horizon`)."""
    window = float(trace.arrival_s[-1]) if len(trace) else 0.0
    workload = scenario.workload
    # A duration bounds the window, unless the request count ended the arrivals first (``run --requests N``
    # on a day-long scenario measures the N requests' span, not the day).
    if workload.duration_s is not None and (workload.num_requests is None or len(trace) < workload.num_requests):
        window = max(window, workload.duration_s)
    horizon = scenario.simulation.horizon_s
    if horizon is None:
        horizon = default_horizon_s(scenario, window, len(trace), float(np.mean(trace.prompt_tokens)) if len(trace)
                                    else 0.0, float(np.mean(trace.output_tokens)) if len(trace) else 0.0)
    return window, horizon


def warmup_for(scenario: Scenario, window_s: float) -> float:
    """The warm-up excluded from the figures: the scenario's, default 10% of the arrival window."""
    warmup = scenario.simulation.warmup_s
    return min(warmup if warmup is not None else 0.1 * window_s, window_s)


class RunStream(Protocol):
    """Where a streamed run's records and logs go as the run makes them (see :func:`simulate`):
    :class:`llmsim.analysis.streaming.StreamedRun` sums them into the summary and writes the records.
    ``chunk_rows``: the requests in each records chunk."""

    chunk_rows: int

    def begin(self, scenario: Scenario, window_s: float, warmup_s: float) -> None: ...

    def records(self, frame: pd.DataFrame) -> None: ...

    def iterations(self, rows: np.ndarray, settled_s: float) -> None: ...

    def queue(self, times_s: np.ndarray, lengths: np.ndarray) -> None: ...

    def gaps(self, gaps: InterTokenGaps, settled_s: float) -> None: ...

    def close(self, end_s: float) -> None: ...


def simulate(scenario: Scenario, trace: Trace | None = None, observers: Sequence[Observer] = (),
             force: bool = False, stream: RunStream | None = None,
             stop_when_missed: MissedStop | None = None, checkpoints: Checkpoints | None = None) -> SimulationResult:
    """Run one scenario on its trace (sampled from its seed unless given: pass one to compare configs).

    A run whose estimated memory or event count is above the resource guard's limits is refused
    before anything is drawn (:func:`llmsim.sim.resources.check_run_size`), unless ``force``.

    ``observers`` are attached to every continuous-batching engine: each is called as
    ``observer(engine, iteration)`` after every iteration (invariant checks, traces).
    Ctrl-C returns the partial result (``stopped_by == "interrupt"``); a second one while it
    is assembled is not caught. Any other exception during the run is raised again with the
    partial result attached as ``partial_result`` (see the module docstring).

    ``stream``: the per-request records go to ``stream.records`` in chunks of consecutive requests,
    in order, as soon as every request of a chunk has left, and the iteration log, the queue
    lengths and the inter-token gaps to its other methods as the run goes (:class:`RunStream`), so
    the run never holds them whole; the result's ``requests``, ``iterations`` and ``queue_length``
    are then empty. Not with a controller (it reads every record) or a tiered KV cache.

    ``stop_when_missed``: the run stops (``stopped_by == "missed"``) once it is sure to miss its SLO targets
    (:mod:`llmsim.sim.missed`; with traffic classes, each class's own targets). ``checkpoints``: the run is
    judged at shorter windows inside it, and stops (``stopped_by == "decided"``) at the first that settles its
    verdict, its figures then over that window (:mod:`llmsim.sim.checkpoints`).
    """
    if trace is None and scenario.workload.trace is not None:      # in memory already: estimate on it
        trace = generate_trace(scenario.workload, scenario.seed)
    check_run_size(scenario, trace, force)
    trace = generate_trace(scenario.workload, scenario.seed) if trace is None else trace
    window, horizon = horizon_for(scenario, trace)
    dep = scenario.deployment
    resolved = ResolvedDeployment.of(scenario)
    env = Environment()
    make_queue = class_queue_factory(scenario) or WaitingQueue
    shared = make_queue() if dep.router is RouterPolicy.SHARED_QUEUE else None
    record_columns = (trace.arrival_s, trace.prompt_tokens, trace.output_tokens, _alphas(scenario, len(trace)),
                      trace.class_index, trace.session_id, scenario.engine.tiered_kv)
    if stream is None:
        records = RequestRecords(*record_columns)
    else:
        if scenario.controller is not None or scenario.engine.tiered_kv or scenario.disaggregation is not None:
            raise ValueError("a streamed run cannot have a controller, a tiered KV cache or disaggregated pools")

        def emit(chunk: RequestRecords, rows: int) -> None:
            stream.records(_records(chunk, rows, scenario))
            _drain(env, engines, stream)
        records = StreamedRecords(*record_columns, emit=emit, chunk_rows=stream.chunk_rows)

    def on_done(replica):
        # Bound late: the router is built after its replicas.
        return lambda request, now: router.done(request, now, replica)

    warmup = warmup_for(scenario, window)
    stop = env.event()
    stopped_on: list[str] = []           # the limits a stop_when_missed stop held on (llmsim.sim.missed)
    stage = Stage(checkpoints, warmup, window) if checkpoints is not None and window > warmup else None
    if scenario.disaggregation is not None:
        split = _disaggregated(scenario, env, records, trace, observers, stop)
        split.decode_apart(Arrivals(env, records, split))
        env.process(_horizon(env, horizon, stop))
        if stop_when_missed is not None:
            # The prefill pool's router keeps the requests in the system, wherever they are.
            env.process(watch_misses(env, scenario, records, split.prefill.in_system_requests, warmup, window,
                                     stop_when_missed, stop, stopped_on, stage))
        _judge_at_checkpoints(env, scenario, records, warmup, checkpoints, stage, stop)
        assert split.resolved is not None                # set by _disaggregated
        return _run(scenario, env, stop, split.prefill, split.engines, records, split.resolved, window, warmup,
                    split=split, stage=stage, stopped_on=stopped_on)
    make_engine = _engine_factory(scenario, resolved)
    make_kv = _kv_factory(scenario, resolved, trace)
    groups = []
    pool_size = scenario.autoscaling.max_replicas if scenario.autoscaling is not None else resolved.replicas
    for index in range(pool_size):
        kv = make_kv()
        queue = shared if shared is not None else make_queue()
        groups.append([make_engine(env, index, resolved.cost, kv, queue, resolved.engine, on_done(index), micro_batch)
                       for micro_batch in range(resolved.engines_per_replica)])
    for group in groups:
        step_together(group)
    engines = [engine for group in groups for engine in group]
    if stream is not None:
        stream.begin(scenario, window, warmup)
    for engine in engines:
        if isinstance(engine, Engine):
            engine.observers.extend(observers)
    router = Router(dep.router, groups, scenario.max_model_len, resolved.kv_blocks, resolved.block_size,
                    records, stop, dep.load_bound)
    Arrivals(env, records, router)
    control = ControlLog() if scenario.controller is not None else None
    if control is not None:
        env.process(controller(env, scenario, engines, records, control))
    autoscaling = scenario.autoscaling
    scaling = ScalingLog() if autoscaling is not None else None
    if autoscaling is not None and scaling is not None:
        # A replica switched off loses its KV, GPU and host tiers: started again, it begins empty.
        switch_off = ((lambda i, now: groups[i][0].kv.clear(now)) if scenario.engine.tiered_kv else None)
        router.pool = ReplicaPool(pool_size, resolved.replicas, switch_off)
        env.process(autoscaler(env, router.pool, router.outstanding, autoscaling, scaling))
    env.process(_horizon(env, horizon, stop))
    if stop_when_missed is not None:
        env.process(watch_misses(env, scenario, records, router.in_system_requests, warmup, window,
                                 stop_when_missed, stop, stopped_on, stage))
    _judge_at_checkpoints(env, scenario, records, warmup, checkpoints, stage, stop)
    return _run(scenario, env, stop, router, engines, records, resolved, window, warmup, control, scaling,
                stream=stream, stage=stage, stopped_on=stopped_on)


def _judge_at_checkpoints(env: simpy.Environment, scenario: Scenario, records: RequestRecords, warmup: float,
                          checkpoints: Checkpoints | None, stage: Stage | None, stop: simpy.Event) -> None:
    """Start the watch that judges the run at its shorter windows (:mod:`llmsim.sim.checkpoints`), if any."""
    if checkpoints is not None and stage is not None:
        env.process(watch_checkpoints(env, scenario, records, warmup, checkpoints, stage,
                                      lambda arrived: _records(records, arrived, scenario), stop))


def _run(scenario: Scenario, env: simpy.Environment, stop: simpy.Event, router: Router, engines: list[Engine],
         records: RequestRecords, resolved: ResolvedDeployment, window: float, warmup: float,
         control: ControlLog | None = None, scaling: ScalingLog | None = None,
         split: DisaggregatedRouter | None = None, stream: RunStream | None = None,
         stage: Stage | None = None, stopped_on: Sequence[str] = ()) -> SimulationResult:
    """Run the simulation built in ``env`` until ``stop`` and return its result (see :func:`simulate` for a
    run stopped by Ctrl-C or a fault). ``stage``: a run judged at shorter windows is measured over the one it
    was being judged on when it ended (:mod:`llmsim.sim.checkpoints`). ``stopped_on``: the limits a stop as
    missed held on, filled by the watch (:func:`~llmsim.sim.missed.watch_misses`) when it stops the run."""
    stopped_by, fault = StopReason.COMPLETED, None
    try:
        if len(records):
            with frozen_heap(), ctrl_c_between_steps(env, StopReason.INTERRUPT):
                stopped_by = cast(StopReason, env.run(until=stop))      # the stop event's value, or INTERRUPT
    except KeyboardInterrupt:
        if isinstance(env, Environment) and env.halted:       # a second Ctrl-C: abort
            raise
        # Keep what was simulated: everything still in flight is reported unfinished.
        stopped_by = StopReason.INTERRUPT
    except Exception as error:               # raised again below, with what was simulated attached
        stopped_by, fault = StopReason.FAULT, error
    if stage is not None:
        window = stage.end_s
    if fault is None:
        return _result(scenario, env, router, engines, records, resolved, window, warmup, stopped_by, control=control,
                       scaling=scaling, split=split, stream=stream,
                       stopped_on=tuple(stopped_on) if stopped_by is StopReason.MISSED else ())
    try:
        partial = _result(scenario, env, router, engines, records, resolved, window, warmup,
                          StopReason.FAULT, f"{type(fault).__name__}: {fault}", control, scaling, split, stream)
        fault.partial_result = partial        # type: ignore[attr-defined]  # the module docstring's contract
        fault.add_note(f"llmsim: the run stopped at {partial.end_s:,.3f} s simulated; "
                       "what was simulated is in this exception's partial_result")
    except Exception as secondary:           # the fault, not this, is what is reported
        fault.add_note(f"llmsim: no partial result ({type(secondary).__name__}: {secondary})")
    raise fault


def _result(scenario: Scenario, env: simpy.Environment, router: Router, engines: list[Engine],
            records: RequestRecords, resolved: ResolvedDeployment, window: float, warmup: float,
            stopped_by: StopReason, fault: str | None = None, control: ControlLog | None = None,
            scaling: ScalingLog | None = None, split: DisaggregatedRouter | None = None,
            stream: RunStream | None = None, stopped_on: tuple[str, ...] = ()) -> SimulationResult:
    """The result of a run that ended (by ``stopped_by``; ``stopped_on``: the limits a stop as missed held on):
    records of the requests that arrived (with a ``stream``: handed to it, the result's tables empty)."""
    # Engines may have run ahead of the event queue's clock (see Engine.run): the run ends
    # at the last departure when that is later.
    end_s = max(env.now, router.in_system.last_s)
    if stopped_by in (StopReason.INTERRUPT, StopReason.FAULT):   # stopped in an engine's run-ahead: up to its clock
        end_s = max([end_s] + [engine.now for engine in engines if isinstance(engine, Engine)])
    gaps = InterTokenGaps()
    for engine in engines:
        engine.close()
        if stream is None:
            gaps.merge(engine.gaps)
    router.write_in_system()
    queues = list({id(e.queue): e.queue for e in engines}.values())
    kv_caches = list({id(e.kv): e.kv for e in engines}.values())
    if stream is not None:
        assert isinstance(records, StreamedRecords)        # a streamed run's records are made so in simulate
        records.flush(router.arrived)
        for engine in engines:
            for rows in engine.log.take_chunks():
                stream.iterations(rows, end_s)
            stream.gaps(engine.take_gaps(), env.now)
        for queue in queues:
            stream.queue(*queue.length.take_log())
        stream.close(end_s)
        requests, iterations, queue_length = pd.DataFrame(), pd.DataFrame(), pd.DataFrame()
    else:
        requests = _records(records, router.arrived, scenario)
        iterations = _iterations(engines, end_s, None if split is None else split.decode_first_index)
        queue_length = _queue_series(queues)
    disaggregation = None
    if split is not None:
        requests = transfer_columns(requests, split)
        decoding = iterations["replica"] >= split.decode_first_index
        durations = iterations["duration_s"]
        disaggregation = totals(split, [pool_totals(name, scenario.pool(name), durations[rows], end_s)
                                        for name, rows in (("prefill", ~decoding), ("decode", decoding))], end_s)
    return SimulationResult(
        scenario=scenario,
        requests=requests,
        iterations=iterations,
        queue_length=queue_length,
        end_s=end_s,
        arrival_window_s=window,
        warmup_s=warmup,
        kv_blocks_per_replica=resolved.kv_blocks,
        kv_allocated_blocks=sum(kv.allocated_total for kv in kv_caches),
        kv_freed_blocks=sum(kv.freed_total for kv in kv_caches),
        kv_held_blocks=sum(kv.held_blocks for kv in kv_caches),
        preemptions=sum(e.preemptions for e in engines),
        mean_in_system=router.in_system.mean(end_s),
        mean_queue_length=sum(q.length.mean(end_s) for q in queues),
        planned_requests=len(records),
        inter_token_gaps=gaps,
        stopped_by=stopped_by,
        stopped_on=stopped_on,
        fault=fault,
        mean_queue_length_by_class=dict(zip(scenario.workload.class_names, class_mean_queue_lengths(
            [queue for queue in queues if isinstance(queue, ClassQueue)], end_s)))
        if scenario.workload.classes else None,
        control=control.frame() if control is not None else None,
        scaling=scaling.frame() if scaling is not None else None,
        replica_seconds=router.pool.replica_seconds(end_s) if router.pool is not None else None,
        provisioned=router.pool.provisioned_series() if router.pool is not None else None,
        speculation_blocked=_blocked_counts(engines),
        kv_tiers=_kv_tiers([kv for kv in kv_caches if kv.tiered], end_s),     # a decode pool's are not
        disaggregation=disaggregation,
        dispatch_wait_s=_dispatch_wait_s(engines),
    )


def _dispatch_wait_s(engines: list[Engine]) -> float | None:
    """:attr:`SimulationResult.dispatch_wait_s`: the engines' own (FIFO queueing); None where any engine admits
    otherwise (static batching, traffic classes)."""
    if not all(isinstance(engine, Engine) and type(engine.queueing) is Queueing for engine in engines):
        return None
    return max((engine.queueing.dispatch_wait_s for engine in engines), default=0.0)


def _disaggregated(scenario: Scenario, env: simpy.Environment, records: RequestRecords, trace: Trace,
                   observers: Sequence[Observer], stop: simpy.Event) -> DisaggregatedRouter:
    """The prefill and decode pools of a disaggregated scenario and the router between them
    (:mod:`llmsim.sim.disaggregated`); ``engines`` and ``resolved`` (the decode pool's) are set on it."""
    dep, config = scenario.deployment, scenario.disaggregation
    assert config is not None                                 # called only for a disaggregated scenario
    prefill_scenario, decode_scenario = scenario.pool("prefill"), scenario.pool("decode")
    late: list[DisaggregatedRouter] = []                      # the router between the pools, built after them

    def hand_off(request: Request, now: float) -> None:
        late[0].handoff(request, now)

    prefill_resolved = ResolvedDeployment.of(prefill_scenario)
    prefill_kv = _kv_factory(prefill_scenario, prefill_resolved, trace)
    _, prefill_groups = make_pool(prefill_scenario, env, _engine_factory(prefill_scenario, prefill_resolved),
                                  prefill_kv, lambda i: lambda request, now: late[0].prefill_rejected(i)(request, now),
                                  0, observers)
    decode_resolved = ResolvedDeployment.of(decode_scenario)
    # The decode pool keeps no prefix cache: a transferred prompt's KV is the request's own.
    decode_kv = partial(KVCache, decode_resolved.kv_blocks, decode_resolved.block_size)
    _, decode_groups = make_pool(decode_scenario, env, _engine_factory(decode_scenario, decode_resolved), decode_kv,
                                 lambda i: lambda request, now: late[0].decode_done(i)(request, now),
                                 len(prefill_groups), observers)
    prefill = Router(dep.router, prefill_groups, scenario.max_model_len, prefill_resolved.kv_blocks,
                     prefill_resolved.block_size, records, stop, dep.load_bound)
    decode = Router(RouterPolicy.LEAST_OUTSTANDING if dep.router is RouterPolicy.PREFIX_AWARE else dep.router,
                    decode_groups, scenario.max_model_len, decode_resolved.kv_blocks, decode_resolved.block_size,
                    records, stop)
    split = DisaggregatedRouter(env, config, prefill, decode, scenario.model.kv_bytes_per_token,
                                scenario.model.num_layers, records, scenario.engine.prefix_caching)
    late.append(split)
    for group in prefill_groups:
        for engine in group:
            engine.handoff = hand_off
    for group in decode_groups:
        for engine in group:
            engine.hooks.extend(split.decode_hooks())
    split.engines = [engine for group in prefill_groups + decode_groups for engine in group]
    split.resolved = decode_resolved
    return split


def _drain(env: simpy.Environment, engines: list[Engine], stream: RunStream) -> None:
    """Hand the engines' full iteration-log chunks, the inter-token gaps they handed over so far and
    the queues' change logs to ``stream`` (rows and gaps that end after ``env.now`` may fall outside
    what the summary measures: it holds them until then)."""
    for engine in engines:
        for rows in engine.log.take_full():
            stream.iterations(rows, env.now)
        stream.gaps(engine.take_gaps(), env.now)
    for queue in {id(e.queue): e.queue for e in engines}.values():
        stream.queue(*queue.length.take_log())


def _blocked_counts(engines) -> SpeculationSteps | None:
    """The speculative decode sets' counts of sequence-steps and why they did not speculate, summed."""
    counts = [SpeculationSteps(**engine.decode.blocked) for engine in engines
              if isinstance(getattr(engine, "decode", None), SpeculativeDecodeSet)]
    return sum(counts[1:], counts[0]) if counts else None


def simulate_whole(scenario: Scenario, trace: Trace | None = None, **options) -> SimulationResult:
    """:func:`simulate`, for a search or a report whose figures need the whole run: Ctrl-C raises
    KeyboardInterrupt (for the command to stop, keeping what it finished) instead of returning
    the partial result."""
    result = simulate(scenario, trace, **options)
    if result.interrupted:
        raise KeyboardInterrupt
    return result


ALPHA_STREAMS_KEPT = 16             # (acceptance, seed) streams _alphas remembers: a search's seeds, a few drafts
_alpha_streams: OrderedDict[tuple[Acceptance, int], np.ndarray] = OrderedDict()


def _alphas(scenario: Scenario, n: int) -> np.ndarray | None:
    """Each request's acceptance rate when the scenario speculates (None otherwise).

    Acceptance is keyed by the seed and the request, not by the replica or the run's
    settings: every configuration sees the same draft successes (common random numbers).
    A request's rate depends on its index alone, so the first ``n`` of a longer stream are the
    stream of ``n``: each (acceptance, seed) stream is drawn once at the longest count asked for
    and sliced (a search runs a seed's requests at many counts; the beta process's quantiles cost
    about 0.3 us a request).
    """
    if scenario.engine.batching is Batching.STATIC or not scenario.speculating:
        return None
    assert scenario.speculation is not None                  # scenario.speculating says so
    acceptance = scenario.speculation.acceptance
    key = (acceptance, scenario.seed)

    def drawn() -> np.ndarray:
        return acceptance.request_alphas(stream_key(scenario.seed, 1), np.arange(n, dtype=np.int64))
    stream = recent(_alpha_streams, key, drawn, ALPHA_STREAMS_KEPT)
    if len(stream) < n:
        stream = _alpha_streams[key] = drawn()
    return stream[:n].copy()


def _engine_factory(scenario: Scenario, resolved: ResolvedDeployment):
    """Static batching engines, plain ones, or ones whose decode set speculates with the draft's
    cost model and the acceptance stream (keyed by the seed, like the acceptance rates)."""
    if scenario.engine.batching is Batching.STATIC:
        return StaticBatchEngine
    engine: Callable[..., Engine] = Engine
    if scenario.workload.classes:
        engine = partial(Engine, queueing=class_queueing(scenario))
    if not scenario.speculating:
        return engine
    spec = scenario.speculation
    assert spec is not None                                   # scenario.speculating says so
    decode = partial(SpeculativeDecodeSet, speculation=spec, draft_cost=resolved.draft_cost,
                     acceptance_key=stream_key(scenario.seed, 2),
                     handoff_s=resolved.handoff_s if resolved.draft_separate else None)
    return partial(engine, decode=decode)


def _kv_factory(scenario: Scenario, resolved: ResolvedDeployment, trace: Trace):
    """A replica's KV cache: plain counting, or tiered when the engine caches prefixes, offloads or swaps."""
    engine, blocks, size = scenario.engine, resolved.kv_blocks, resolved.block_size
    if not engine.tiered_kv:
        return lambda: KVCache(blocks, size)
    keys = (PrefixKeys(size, trace.prompt_tokens, trace.output_tokens, trace.session_id, trace.system_prompt_id,
                       trace.system_prompt_tokens, trace.hash_ids, scenario.workload.hash_block_tokens)
            if engine.prefix_caching else None)
    placement, offload = resolved.memory, engine.cpu_offload
    block_bytes_per_device = placement.kv_bytes_per_token_per_device * size
    if not engine.host_tier:
        return lambda: TieredKV(blocks, size, keys)
    host_blocks = host_kv_blocks(scenario, placement)
    host = scenario.hardware.host_memory
    assert host is not None                                   # engine.host_tier needs a profile with host memory
    transfer_s = block_bytes_per_device / host.link_bandwidth_bytes_per_s
    return lambda: TieredKV(blocks, size, keys, HostTier(host_blocks),
                            offload.idle_timeout_s if offload is not None else None,
                            swap=engine.preemption_mode is PreemptionMode.SWAP,
                            overlap=offload is not None and offload.overlap,
                            block_transfer_s=transfer_s, block_bytes=block_bytes_per_device * placement.devices)


def _kv_tiers(caches: list[KVCache], end_s: float) -> KVTierTotals | None:
    """Totals of the replicas' tiered KV caches (None without them), host occupancy averaged over time."""
    kv_caches = [kv for kv in caches if isinstance(kv, TieredKV)]
    if not kv_caches or not kv_caches[0].tiered:
        return None
    first = kv_caches[0]
    totals = {name: sum(getattr(kv, name) for kv in kv_caches) for name in SUMMED_KV_TOTALS}
    totals.update(block_size=first.block_size, block_bytes=first.block_bytes, gpu_blocks=first.num_blocks,
                  cached_blocks=sum(len(kv.cached) for kv in kv_caches))
    hosts = [kv.host for kv in kv_caches if kv.host is not None]
    if hosts:
        means, peaks, series = [], [], []
        for replica, host in enumerate(hosts):
            times = np.frombuffer(host.occupancy_s, float)
            order = np.argsort(times, kind="stable")
            times, held = times[order], np.frombuffer(host.occupancy_blocks, np.int64)[order]
            series.append(pd.DataFrame({"replica": replica, "time_s": times, "blocks": held}))
            spans = np.clip(np.diff(np.append(times, end_s)), 0, None)
            means.append(float((held * spans).sum() / end_s) if end_s > 0 else 0.0)
            peaks.append(int(held.max()))
        totals.update(host_occupancy=pd.concat(series, ignore_index=True),     # blocks held after each change
                      host_blocks=hosts[0].capacity_blocks, host_mean_blocks=float(np.mean(means)),
                      host_max_blocks=max(peaks), host_evicted_blocks=sum(h.evicted for h in hosts),
                      offload_failed_blocks=sum(h.failed for h in hosts),
                      host_allocated_blocks=sum(h.allocated_total for h in hosts),
                      host_freed_blocks=sum(h.freed_total for h in hosts), host_held_blocks=sum(h.held for h in hosts))
    return KVTierTotals(**totals)


def _horizon(env: simpy.Environment, horizon_s: float, stop: simpy.Event):
    yield env.timeout(horizon_s)
    if not stop.triggered:
        stop.succeed(StopReason.HORIZON)


def _records(records: RequestRecords, arrived: int, scenario: Scenario) -> pd.DataFrame:
    """The per-request table of the first ``arrived`` requests: raw times plus the latencies derived from them.

    Every column is computed on numpy arrays and the table built once: pandas' per-column inserts and
    Series arithmetic were most of a short run's fixed cost (a search runs hundreds of them)."""
    columns = {name: column[:arrived] for name, column in records.columns(_strings).items()}
    if scenario.workload.classes:
        assert records.class_index is not None                # a trace with classes carries each request's
        classes = np.array(scenario.workload.class_names, dtype=object)[records.class_index[:arrived]]
        columns = {"id": columns.pop("id"), "class": classes, **columns}
    arrival_s, first_token_s, finish_s = columns["arrival_s"], columns["first_token_s"], columns["finish_s"]
    finished = columns["status"] == "finished"
    decode_tokens = columns["output_tokens"] - 1
    columns["queue_wait_s"] = columns["first_scheduled_s"] - arrival_s
    columns["ttft_s"] = first_token_s - arrival_s
    columns["e2e_s"] = np.where(finished, finish_s - arrival_s, np.nan)
    columns["tpot_s"] = np.where(finished & (decode_tokens > 0),
                                 (finish_s - first_token_s) / np.maximum(decode_tokens, 1), np.nan)
    columns["meets_slo"] = meets_slo(columns, scenario.slo)
    return pd.DataFrame(columns, copy=False)


def _iterations(engines: list[Engine], end_s: float, decode_first_index: int | None = None) -> pd.DataFrame:
    """One row per iteration that completed by ``end_s``, with its utilisations of its own replica's devices
    (empties the engines' logs); a disaggregated run's (``decode_first_index``: its first decode replica's index)
    start with each row's pool. The table is built once: a column inserted into it afterwards copied it."""
    columns = iterations_columns([(engine.index, engine.micro_batch, engine.log) for engine in engines], end_s)
    if decode_first_index is not None:
        columns = {"pool": _strings(["prefill", "decode"], columns["replica"] >= decode_first_index), **columns}
    costs = {engine.index: engine.cost for engine in engines}
    if len({id(cost) for cost in costs.values()}) == 1:
        cost = engines[0].cost
        peak_flops, peak_bytes = cost.peak_flops_per_s, cost.peak_bandwidth_bytes_per_s
    else:                                    # pools of different chips or layouts: each replica's, by its index
        peaks = np.zeros((2, max(costs) + 1))
        for index, cost in costs.items():
            peaks[:, index] = cost.peak_flops_per_s, cost.peak_bandwidth_bytes_per_s
        peak_flops, peak_bytes = peaks[:, columns["replica"]]
    columns["mfu"] = columns["flops"] / (columns["duration_s"] * peak_flops)
    columns["bandwidth_utilisation"] = columns["bytes"] / (columns["duration_s"] * peak_bytes)
    return pd.DataFrame(columns, copy=False)


def _strings(labels: list[str], codes: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """The column ``labels[codes]`` of pandas' string dtype, taken from a column of the labels: pandas reads strings
    from a numpy array one row at a time (5-12 ms on 100,000 rows), and this is the same column, of the same dtype."""
    return pd.Series(labels).array.take(codes.astype(np.intp))


def _queue_series(queues: Sequence[Waiting]) -> pd.DataFrame:
    frames = []
    for i, queue in enumerate(queues):
        log_s, log_value = queue.length.log_s, queue.length.log_value
        assert log_s is not None and log_value is not None   # a queue's length is always logged
        frames.append(pd.DataFrame({"queue": i, "time_s": np.frombuffer(log_s, np.float64),
                                    "length": np.frombuffer(log_value, np.int64)}))
    return pd.concat(frames, ignore_index=True)
