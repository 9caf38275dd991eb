"""Stopping a run once it is sure to miss its SLO targets (for searches, which ask only whether a point meets them).

A search judges a point on the requests arriving in its measurement window ``[warmup, end of arrivals]``:
for each limit, the share of them within it must reach the percentile target. A request that has waited
longer than the TTFT limit without its first token, or has been in the system longer than the E2E limit
without finishing, or was rejected, misses whatever the rest of the run does. So once the window's requests
already sure to miss a limit are more than the rule allows (``1 - target + margin`` of them), the share within
it cannot reach ``target - margin`` however the run ends, and the run is stopped (``StopReason.MISSED``) instead of
simulated to the end: an overloaded run would otherwise serve its whole backlog first. The run says which limits
it stopped on (``stopped_on``: every limit whose sure misses were more than allowed at the check that stopped it,
named as a search names them, ``ttft`` or ``<class>.e2e``): on those only its share is known to be below the bound.

How far below the target the share must be sure to stay is the rule's (:class:`MissedStop`): a fixed margin
(:class:`ShortfallStop`), or one that follows the share, chosen so that the verdict the whole run would have
given is the one the stop gives (``llmsim.search.window.DecidedFailStop``). The watch only reads the run's
state, so a run it does not stop is the run without it.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import simpy

from llmsim.compiled import kernel
from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import RequestRecords
from llmsim.sim.result import StopReason
from llmsim.sim.sensor import Target, targets_of

CHECKS = 64                     # the watch looks this many times across the measurement window
WATCHED = ("ttft", "e2e")       # the limits a request can be sure to miss before it finishes


@dataclass(frozen=True)
class MissedStop(ABC):
    """Stop a run once, for some limit, the window's requests sure to miss it are more than :meth:`allowed`;
    only where the window holds at least ``min_requests``."""
    min_requests: int

    @abstractmethod
    def allowed(self, share: float, counted: int) -> int:
        """The most requests of a window of ``counted`` that may be sure to miss a limit whose percentile target
        is ``share`` before the run stops."""

    @abstractmethod
    def highest(self, share: float) -> float:
        """The share within a limit (target ``share``) a run this rule stopped on that limit is below."""

    def allowed_on(self, name: str, share: float, counted: int) -> int:
        """:meth:`allowed` for the limit named ``name`` (:func:`limit_name`): the same for every limit, unless a
        rule holds limits to bounds of their own."""
        return self.allowed(share, counted)


@dataclass(frozen=True)
class ShortfallStop(MissedStop):
    """Stop once the share within a limit is sure to stay below its target less ``margin``."""
    margin: float

    def allowed(self, share: float, counted: int) -> int:
        return math.floor((1 - share + self.margin) * counted)

    def highest(self, share: float) -> float:
        return share - self.margin


def limit_name(target: Target, class_names: tuple[str, ...]) -> str:
    """A limit's name in a run's ``stopped_on``: its metric, with traffic classes ``<class>.<metric>``."""
    return target.metric if target.class_index is None else f"{class_names[target.class_index]}.{target.metric}"


def watch_misses(env: simpy.Environment, scenario: Scenario, records: RequestRecords, in_system: dict,
                 warmup_s: float, window_s: float, rule: MissedStop, stop: simpy.Event, stopped_on: list[str],
                 stage=None):
    """A SimPy process that succeeds ``stop`` with :attr:`StopReason.MISSED` once ``rule`` holds (see the
    module docstring), having put into ``stopped_on`` the names (:func:`limit_name`) of the limits it held on.
    ``in_system``: the router's requests in the system, by id (their records are written when they leave).
    Limits on TTFT and E2E are watched (a TPOT is known only at the end); with
    traffic classes each class's own limits, over the window's requests of that class (each class must meet
    its own targets, so one class sure to miss one of them decides the run). ``stage``: a run judged at
    shorter windows inside it (:class:`llmsim.sim.checkpoints.Stage`): the window watched is the one it is
    being judged on (its ``end_s``), and moves on with it."""
    arrival = records.arrival_s
    first = int(np.searchsorted(arrival, warmup_s, "left"))

    def window(end_s: float) -> tuple[int, Watched | None, float]:
        """(the window's last request + 1, its watched targets (None: none), the time between checks)."""
        last = int(np.searchsorted(arrival, end_s, "right"))
        classes = records.class_index[first:last] if records.class_index is not None else None
        targets, mines, allowed = [], [], []
        for target in targets_of(scenario.slo, scenario.workload.class_names):
            if target.metric not in WATCHED:
                continue
            mine = (np.ones(last - first, bool) if target.class_index is None or classes is None
                    else classes == target.class_index)
            counted = int(np.count_nonzero(mine))
            if counted >= rule.min_requests:
                targets.append(target)
                mines.append(mine)
                allowed.append(rule.allowed_on(limit_name(target, scenario.workload.class_names),
                                               target.percentile / 100, counted))
        watched = Watched(targets, np.array([t.metric == "ttft" for t in targets]),
                          np.array([t.limit_s for t in targets], dtype=float),
                          np.array(mines, dtype=bool).reshape(len(targets), last - first),
                          np.array(allowed, dtype=np.int64)) if targets else None
        return last, watched, max(end_s - warmup_s, 1e-9) / CHECKS

    end_s = window_s if stage is None else stage.end_s
    last, watched, period = window(end_s)
    if not watched and stage is None:
        return
    yield env.timeout(warmup_s + period)
    while not stop.triggered:
        if stage is not None and stage.end_s != end_s:
            end_s = stage.end_s
            last, watched, period = window(end_s)
        missed = _missed(env.now, records, in_system, arrival, first, last, watched) if watched is not None else []
        if missed:
            stopped_on.extend(limit_name(target, scenario.workload.class_names) for target in missed)
            stop.succeed(StopReason.MISSED)
            return
        yield env.timeout(period)


@dataclass(frozen=True)
class Watched:
    """A window's watched targets: each one's ``targets`` entry, whether its limit is on TTFT (``ttft``; else on
    E2E), its limit (``limits_s``), its requests among the window's (``mines``, a row per target) and how many
    sure misses leave its share within the limit below target - margin (``allowed``)."""
    targets: list[Target]
    ttft: np.ndarray
    limits_s: np.ndarray
    mines: np.ndarray
    allowed: np.ndarray


def _missed(now: float, records: RequestRecords, in_system: dict, arrival: np.ndarray, first: int, last: int,
            watched: Watched) -> list[Target]:
    """The watched targets whose window's requests already sure to miss them are more than allowed."""
    first_token = np.frombuffer(records.first_token_s, float)[first:last].copy()
    for request in in_system.values():
        if first <= request.id < last:
            first_token[request.id - first] = request.first_token_s
    counts = _sure_misses(float(now), arrival[first:last], np.frombuffer(records.status, np.int8)[first:last],
                          RequestRecords.STATUSES.index("rejected"), first_token,
                          np.frombuffer(records.finish_s, float)[first:last], watched.ttft, watched.limits_s,
                          watched.mines)
    return [target for target, count, allowed in zip(watched.targets, counts.tolist(), watched.allowed.tolist())
            if count > allowed]


@kernel
def _sure_misses(now, arrival, status, rejected_code, first_token, finish, ttft, limits_s, mines):
    """Per watched target (``ttft``, ``limits_s``, ``mines``: :class:`Watched`'s), how many of its window's
    requests (their ``arrival``, ``status``: 0 while in the system, else written when they left, finished or
    rejected; ``first_token``, ``finish``) have arrived by ``now`` and are sure to miss its limit: rejected, or
    late: on TTFT, no first token yet after the limit, or one after it; on E2E, in the system past the limit,
    or finished after it. One pass, with the comparisons and float subtractions numpy's arrays would make."""
    counts = np.zeros(len(ttft), np.int64)
    for i in range(len(arrival)):
        if not arrival[i] <= now:
            continue
        rejected = status[i] == rejected_code
        waited = now - arrival[i]
        for t in range(len(ttft)):
            if not mines[t, i]:
                continue
            if ttft[t]:
                late = waited > limits_s[t] if np.isnan(first_token[i]) else first_token[i] - arrival[i] > limits_s[t]
            else:
                late = finish[i] - arrival[i] > limits_s[t] if status[i] != 0 else waited > limits_s[t]
            if rejected or late:
                counts[t] += 1
    return counts
