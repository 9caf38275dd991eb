"""Disaggregated prefill and decode: a prefill pool, a decode pool, and the KV transfers between them.

A request arrives at the router (:class:`DisaggregatedRouter`), which sends it to a prefill replica
(by the deployment's router policy; ``prefix_aware`` places it on the replica holding its longest
cached prefix) or, when its prompt (with prefix caching, the part no prefill replica holds) is
shorter than ``aggregated_below_tokens``, whole to a decode replica, which runs it as an aggregated
engine would. Each pool's replicas are ordinary engines (:class:`~llmsim.sim.engine.Engine`) with
their own chip, parallelism, KV cache and queue.

On a prefill replica the prompt is computed; the engine then hands the request over
(``Engine.handoff``), still holding its KV blocks, and the router picks the decode replica with the
fewest outstanding requests. The KV moves over the link into that replica (one
:class:`SharedLink` per decode replica, ``lanes`` ports wide: transfers into one replica share its
bandwidth equally, processor sharing, so a burst of transfers queues). When the decode replica takes
the request's KV blocks is ``reservation``:

- ``before_transfer`` (vLLM's NixlConnector, where the decode instance allocates the blocks and then
  reads the KV; SGLang's decode pre-allocation queue; NVIDIA Dynamo): the transfer starts only once
  the decode replica has the blocks; until then the request waits in that replica's reservation
  queue (first come, first served) and the prefill replica keeps its copy, so a full decode pool
  holds prefill KV and, in turn, stalls the prefill pool. Once its KV has arrived the request joins
  the decode batch as soon as a sequence slot is free, ahead of the decode queue (whose requests wait
  for blocks it already holds: behind them it could wait for ever);
- ``after_transfer`` (Mooncake, where the KV lands in the decode node's DRAM and the request joins the
  next batch once it is there): the transfer starts when the prefill ends and frees the prefill
  copy when done; the request then waits in the decode replica's queue, its KV staged in host
  memory, until the engine admits it. Loading it from there is not charged, and the staging
  memory is taken to be large enough.

Either way the prefill replica frees its copy when the transfer ends. The decode replica then
admits the request with every prompt token's KV but the last: its first step computes that token
and samples the first output token (vLLM computes the last prompt token again on the decode side
for the same reason), so TTFT is queue + prefill + transfer + first decode. A decode replica that
runs out of KV preempts as any engine does; a preempted request recomputes its prompt there.

With ``streaming`` the KV is sent layer by layer while the prompt computes. The transfer enters the
link when the prefill ends, less what was sent during it: at most all layers but the last, at most
what the link's share (its bandwidth over the transfers on it, this one included) carried over the
request's prefill. Those streamed bytes are not counted against the link's other transfers (an
approximation: streaming overlaps the prefill with the link, not with other transfers).
"""
from __future__ import annotations

import math
from array import array
from collections import deque
from functools import partial
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import simpy
from simpy.events import NORMAL

from llmsim.config.policies import KVReservation
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.disaggregation import Disaggregation
from llmsim.scenario.scenario import Scenario
from llmsim.sim.engine import Engine, Observer
from llmsim.sim.environment import scheduler
from llmsim.sim.kvcache import KVCache
from llmsim.sim.replica_steps import ReplicaSteps, step_together
from llmsim.sim.request import NAN, Request, RequestRecords, WaitingQueue
from llmsim.sim.result import DisaggregationTotals, PoolTotals

# Link time within which transfers finishing together are taken as done together (float sums of shares).
_DONE_S = 1e-9


class SharedLink:
    """A link whose transfers share its bandwidth equally (processor sharing).

    ``n`` transfers on it move at ``rate / n`` each; a transfer is done ``latency_s`` after its
    last byte has left. ``send`` at ``env.now``; ``on_done(now)`` is called when it arrives.
    """

    def __init__(self, env: simpy.Environment, rate_bytes_per_s: float, latency_s: float):
        self.env, self.rate, self.latency_s = env, rate_bytes_per_s, latency_s
        self._jobs: list[list] = []              # [bytes left, on_done]
        self._last_s = 0.0
        self._generation = 0                     # the completion event in force (older ones are void)
        self.busy_s = 0.0                        # time with at least one transfer on the link
        self.bytes_sent = 0.0
        self.transfers = 0

    @property
    def active(self) -> int:
        """Transfers on the link now."""
        return len(self._jobs)

    def send(self, nbytes: float, on_done: Callable[[float], None]) -> None:
        self.transfers += 1
        self.bytes_sent += nbytes
        if nbytes <= 0 or math.isinf(self.rate):
            self._arrive(on_done)
            return
        self._advance()
        self._jobs.append([float(nbytes), on_done])
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        if self._jobs:
            share = self.rate * (now - self._last_s) / len(self._jobs)
            for job in self._jobs:
                job[0] -= share
            self.busy_s += now - self._last_s
        self._last_s = now

    def _reschedule(self) -> None:
        self._generation += 1
        if not self._jobs:
            return
        generation = self._generation
        least = max(min(job[0] for job in self._jobs), 0.0)
        event = self.env.timeout(least * len(self._jobs) / self.rate)
        event.callbacks.append(lambda _: self._complete(generation))

    def _complete(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._advance()
        # This event was timed for the transfer with the fewest bytes left to finish: it and any within a
        # nanosecond of link time of it are done (the shares' float sums leave a few bytes either way).
        cut = max(min(job[0] for job in self._jobs), 0.0) + self.rate * _DONE_S
        done = [job for job in self._jobs if job[0] <= cut]
        self._jobs = [job for job in self._jobs if job[0] > cut]
        for job in done:
            self._arrive(job[1])
        self._reschedule()

    def _arrive(self, on_done: Callable[[float], None]) -> None:
        if self.latency_s > 0:
            self.env.timeout(self.latency_s).callbacks.append(lambda _: on_done(self.env.now))
        else:
            on_done(self.env.now)


class TransferRecords:
    """Per request: which pool path it took and its hand-off times (NaN where it had none)."""

    COLUMNS = ("prefill_end_s", "transfer_start_s", "transfer_end_s", "transfer_bytes")

    def __init__(self, n: int):
        nans = array("d", [NAN]) * n
        self.prefill_end_s, self.transfer_start_s = array("d", nans), array("d", nans)
        self.transfer_end_s, self.transfer_bytes = array("d", nans), array("d", nans)
        self.prefill_replica = array("q", [-1]) * n
        self.decode_replica = array("q", [-1]) * n
        self.aggregated = array("b", bytes(n))

    def columns(self, arrived: int) -> dict[str, np.ndarray]:
        out = {name: np.frombuffer(getattr(self, name), float)[:arrived].copy() for name in self.COLUMNS}
        out["prefill_replica"] = np.frombuffer(self.prefill_replica, np.int64)[:arrived].copy()
        out["decode_replica"] = np.frombuffer(self.decode_replica, np.int64)[:arrived].copy()
        out["aggregated"] = np.frombuffer(self.aggregated, np.int8)[:arrived].astype(bool)
        return out


class DisaggregatedRouter:
    """The front door of a disaggregated deployment (see the module docstring): the prefill pool's
    router (``prefill``, an ordinary :class:`~llmsim.sim.simulate.Router` over its replicas, which
    also keeps the requests in the system and writes their records), the decode pool's
    (``decode``), the links into each decode replica and the reservation queues."""

    def __init__(self, env: simpy.Environment, config: Disaggregation, prefill, decode,
                 kv_bytes_per_token: float, num_layers: int, records: RequestRecords, prefix_caching: bool):
        self.env, self.config, self.prefill, self.decode = env, config, prefill, decode
        self.decode_first_index = len(prefill.replicas)      # decode engines are numbered after the prefill ones
        self.kv_bytes_per_token, self.num_layers = kv_bytes_per_token, num_layers
        self.transfers = TransferRecords(len(records))
        rate = config.link.effective_bytes_per_s * config.lanes
        self.links = [SharedLink(env, rate, config.link.latency_s) for _ in decode.replicas]
        self.waiting_blocks: list[deque[Request]] = [deque() for _ in decode.replicas]
        self.ready: list[deque[Request]] = [deque() for _ in decode.replicas]     # arrived, waiting for a slot
        self._reserved: dict[int, int] = {}      # request id -> decode KV blocks reserved for it
        self._before = config.reservation is KVReservation.BEFORE_TRANSFER
        self._schedule = scheduler(env)
        self._prefix_caching = prefix_caching
        # Set by the simulation once both pools are built: every engine, and the decode pool's deployment.
        self.engines: list[Engine] = []
        self.resolved: ResolvedDeployment | None = None

    # -- arrival -----------------------------------------------------------------------------------
    def dispatch(self, request: Request, now: float) -> None:
        prefill = self.prefill
        if not prefill.arrive(request, now, min(prefill.kv_tokens, self.decode.kv_tokens)):
            return
        if self._uncached(request) < self.config.aggregated_below_tokens:
            self.transfers.aggregated[request.id] = 1
            self._to_decode(request, self.decode.pick(request), now)
            return
        index = prefill.pick(request)
        self.transfers.prefill_replica[request.id] = index
        prefill.enqueue(request, index, now)

    def _uncached(self, request: Request) -> int:
        """The prompt tokens no prefill replica holds cached (the whole prompt without prefix caching)."""
        if not self._prefix_caching:
            return request.prompt_tokens
        block = self.prefill.replicas[0][0].kv.block_size
        hits = max(group[0].kv.cached_prefix(request, request.prompt_tokens)[0] for group in self.prefill.replicas)
        return request.prompt_tokens - hits * block

    def _to_decode(self, request: Request, index: int, now: float) -> None:
        self.transfers.decode_replica[request.id] = index
        self.decode.enqueue(request, index, now)

    # -- prefill done --------------------------------------------------------------------------------
    def handoff(self, request: Request, now: float) -> None:
        """A prefill engine computed ``request``'s prompt at ``now`` (its clock, which may be ahead of
        the event queue's): pick the decode replica and reserve or send at that time."""
        self.transfers.prefill_end_s[request.id] = now
        self._at(now, partial(self._handed_off, request))

    def _handed_off(self, request: Request) -> None:
        index = self.decode.least_outstanding()
        self.decode.count(index, +1)
        self.transfers.decode_replica[request.id] = index
        if self._before:
            self.waiting_blocks[index].append(request)
            self.reserve(index, self.env.now)
        else:
            self._send(request, index)

    def reserve(self, index: int, now: float) -> None:
        """At ``now`` (an engine's clock, possibly ahead of the event queue's), decode replica ``index``
        takes KV blocks for the requests waiting for them, first come first served, while it has them
        free; each one's transfer starts then."""
        waiting, kv = self.waiting_blocks[index], self.decode.replicas[index][0].kv
        while waiting:
            request = waiting[0]
            blocks = kv.blocks_for(request.prompt_tokens)
            if blocks > kv.free_blocks:
                return
            kv.allocate(blocks)
            self._reserved[request.id] = blocks
            waiting.popleft()
            self._at(now, partial(self._send, request, index))

    def _at(self, at_s: float, call: Callable[[], None]) -> None:
        """``call()`` at ``at_s``: now if the event queue is there, else when it gets there."""
        if at_s <= self.env.now:
            call()
        else:
            self._schedule(call, NORMAL, at_s - self.env.now)

    def _send(self, request: Request, index: int) -> None:
        now = self.env.now
        link = self.links[index]
        nbytes = request.prompt_tokens * self.kv_bytes_per_token
        self.transfers.transfer_start_s[request.id] = now
        self.transfers.transfer_bytes[request.id] = nbytes
        left = nbytes
        if self.config.streaming:
            prefill_s = self.transfers.prefill_end_s[request.id] - request.first_scheduled_s
            streamed = min(nbytes * (1 - 1 / self.num_layers), link.rate / (link.active + 1) * prefill_s)
            left = nbytes - streamed
        link.send(left, lambda at: self._arrived(request, index, at))

    def _arrived(self, request: Request, index: int, now: float) -> None:
        """The KV of ``request`` is on decode replica ``index``: the prefill copy is freed and the
        request joins the decode replica's queue with its prompt's KV but the last token's."""
        self.transfers.transfer_end_s[request.id] = now
        prefill = self.transfers.prefill_replica[request.id]
        engines = self.prefill.replicas[prefill]
        engines[0].kv.release(request, now, request.prompt_tokens)
        request.blocks = 0
        self.prefill.count(prefill, -1)
        for engine in engines:
            engine.notify()
        request.prefilled, request.prefill_target = request.prompt_tokens - 1, request.prompt_tokens
        request.replica = index
        engines = self.decode.replicas[index]
        if self._before:
            # Its KV blocks are reserved: it joins the batch when a sequence slot is free, ahead of the queue,
            # whose requests wait for blocks it already holds.
            request.blocks = self._reserved.pop(request.id)
            self.ready[index].append(request)
            self.join(index, now)
        else:
            engines[0].queue.push(request, now)
        for engine in engines:
            engine.notify()

    def join(self, index: int, now: float) -> None:
        """Requests whose KV arrived, blocks reserved, join decode replica ``index``'s batch while it has
        sequence slots (``max_num_seqs`` split over its engines, as its queue's requests are)."""
        ready = self.ready[index]
        for engine in self.decode.replicas[index]:
            while ready and len(engine.running) < engine.config.max_num_seqs:
                engine.join(ready.popleft(), now)
                engine.notify()

    def decode_apart(self, arrivals: object) -> None:
        """Let each decode replica's engines, where they step together
        (:class:`~llmsim.sim.replica_steps.ReplicaSteps`), go on past the calls of ``arrivals`` (the trace's,
        dispatching to this router), of the prefill pool's engines and of this router, run in their turn
        (:attr:`~llmsim.sim.replica_steps.ReplicaSteps.apart`), where none of them can read or change a decode replica
        or schedule anything before it returns that does: with the KV reserved after the transfer, every link's
        latency above zero and no request sent whole to the decode pool (``aggregated_below_tokens`` 0; else the
        arrivals are left out). Then:

        - an arrival enters the system through the prefill router (its records, its count of requests in the system;
          ``decode.kv_tokens``, a constant, bounds its length), is queued on a prefill replica and wakes its engines;
        - a prefill engine's step (one without observers) reads and changes its own queue, batch, KV cache and log;
          a request it rejects on a queue timeout leaves through the prefill router; a prompt it completes is handed
          off (:meth:`handoff`): its time recorded and, at the engine's clock, now or in a call of this router's,
          :meth:`_handed_off`;
        - :meth:`_handed_off` counts the request on the decode router (``outstanding``: read by no decode engine)
          and sends its KV (:meth:`_send`: the link's own state, and a SimPy timeout for its next completion, after
          which the KV lands ``latency_s`` later, in a SimPy event of its own).

        Nothing of a decode replica's (its engines, their clocks, KV cache, queue) is read or changed by them: only
        its own engines and the KV landing on it (:meth:`_arrived`, a SimPy event, which the stretch stops at) do.
        With ``before_transfer`` a hand-off takes decode blocks (:meth:`reserve`): nothing is let past then."""
        if self._before or any(link.latency_s <= 0 for link in self.links):
            return
        owners: list[object] = [self, *(engine for group in self.prefill.replicas for engine in group
                                        if not engine.observers and not engine.hooks)]
        if self.config.aggregated_below_tokens <= 0:
            owners.append(arrivals)
        for group in self.decode.replicas:
            steps = group[0].steps_together
            if isinstance(steps, ReplicaSteps):
                steps.set_apart(owners)

    # -- leaving ------------------------------------------------------------------------------------
    def prefill_rejected(self, index: int) -> Callable[[Request, float], None]:
        """What a prefill engine of replica ``index`` reports through ``on_done``: a request rejected in
        its queue (a queue timeout)."""
        def rejected(request: Request, now: float) -> None:
            self.prefill.count(index, -1)
            self.prefill.leave(request, now)
        return rejected

    def decode_done(self, index: int) -> Callable[[Request, float], None]:
        """What a decode engine of replica ``index`` reports: a request finished (or rejected)."""
        def done(request: Request, now: float) -> None:
            self.decode.count(index, -1)
            self.prefill.leave(request, now)
        return done

    def decode_hooks(self) -> list[Callable[[Engine], None]]:
        """What every decode engine calls after each of its iterations (``Engine.hooks``): with
        ``before_transfer``, :meth:`observe_decode`; none with ``after_transfer``, whose requests wait in the
        engine's own queue, which the engine admits from itself (an engine with hooks pays for them at every
        iteration)."""
        return [self.observe_decode] if self._before else []

    def observe_decode(self, engine: Engine) -> None:
        """After each decode iteration (``before_transfer``): KV or a sequence slot may have been freed for
        requests waiting to reserve blocks or, their KV arrived, to join."""
        index = engine.index - self.decode_first_index
        if self.ready[index]:
            self.join(index, engine.now)
        if self.waiting_blocks[index]:
            self.reserve(index, engine.now)


def pool_totals(name: str, scenario: Scenario, duration_s: pd.Series, end_s: float) -> PoolTotals:
    """A pool's size, price and power, and how busy its replicas were over the run: the share of each
    replica's pipeline time its iterations took (``duration_s``: this pool's iterations' durations; with expert
    parallelism each attention data-parallel rank is such a replica)."""
    dep = scenario.deployment
    devices = dep.replicas * dep.devices_per_replica
    engines = dep.replicas * dep.data_parallel * dep.pipeline_parallel     # each data-parallel rank's pipeline
    busy = float(duration_s.sum()) / (end_s * engines) if end_s > 0 else math.nan
    degree = dep.expert_parallel.degree if dep.expert_parallel is not None else 1
    return PoolTotals(name, scenario.hardware.name, dep.replicas, dep.tensor_parallel, dep.pipeline_parallel,
                      devices * scenario.hardware.price_per_hour_usd, devices * scenario.hardware.tdp_w, min(busy, 1.0),
                      degree, devices)


def totals(router: DisaggregatedRouter, pools: list[PoolTotals], end_s: float) -> DisaggregationTotals:
    config = router.config
    return DisaggregationTotals(
        layout=config.label, link=config.link.name, lanes=config.lanes, streaming=config.streaming,
        reservation=config.reservation.value, link_bytes_per_s=router.links[0].rate if router.links else math.nan,
        transfers=sum(link.transfers for link in router.links),
        transfer_bytes=sum(link.bytes_sent for link in router.links),
        link_utilisation=(sum(link.busy_s for link in router.links) / (end_s * len(router.links))
                          if end_s > 0 and router.links else math.nan),
        pools=tuple(pools))


def transfer_columns(frame: pd.DataFrame, router: DisaggregatedRouter) -> pd.DataFrame:
    """The per-request record with the disaggregated columns and TTFT split into queue, prefill, transfer and
    first decode (they add up to ``ttft_s``; an aggregated request's transfer and first decode are 0)."""
    columns = router.transfers.columns(len(frame))
    for name, values in columns.items():
        frame[name] = values
    aggregated = frame["aggregated"].to_numpy()
    prefill_end = np.where(aggregated, frame["first_token_s"], frame["prefill_end_s"])
    transfer_end = np.where(aggregated, frame["first_token_s"], frame["transfer_end_s"])
    frame["ttft_queue_s"] = frame["first_scheduled_s"] - frame["arrival_s"]
    frame["ttft_prefill_s"] = prefill_end - frame["first_scheduled_s"]
    frame["ttft_transfer_s"] = transfer_end - prefill_end
    frame["ttft_first_decode_s"] = frame["first_token_s"] - transfer_end
    return frame


def make_pool(scenario: Scenario, env: simpy.Environment, make_engine, make_kv: Callable[[], KVCache],
              on_done: Callable[[int], Callable[[Request, float], None]], first_index: int,
              observers: Sequence[Observer]) -> tuple[ResolvedDeployment, list[list[Engine]]]:
    """A pool's replicas: ``make_engine`` engines per micro-batch over ``make_kv`` caches, numbered from
    ``first_index`` (so the two pools' iterations keep apart in the log)."""
    resolved = ResolvedDeployment.of(scenario)
    groups = []
    for replica in range(resolved.replicas):
        kv, queue = make_kv(), WaitingQueue()
        groups.append([make_engine(env, first_index + replica, resolved.cost, kv, queue, resolved.engine,
                                   on_done(replica), micro_batch)
                       for micro_batch in range(resolved.engines_per_replica)])
    for group in groups:
        for engine in group:
            engine.observers.extend(observers)
        step_together(group)
    return resolved, groups

