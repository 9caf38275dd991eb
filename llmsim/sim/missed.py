"""Stopping a run once it is sure to miss its SLO targets (for searches, which ask only whether a point meets them).

A search judges a point on the requests arriving in its measurement window ``[warmup, end of arrivals]``:
for each limit, the share of them within it must reach the percentile target. A request that has waited
longer than the TTFT limit without its first token, or has been in the system longer than the E2E limit
without finishing, or was rejected, misses whatever the rest of the run does. So once the window's requests
already sure to miss a limit are more than ``1 - target + margin`` of them, the share within it cannot reach
``target - margin`` however the run ends, and the run is stopped (``StopReason.MISSED``) instead of
simulated to the end: an overloaded run would otherwise serve its whole backlog first.

The caller picks ``margin`` so that the verdict the whole run would have given is the one the stop gives
(``llmsim.search.window``: wider than any standard error the verdict could pool). The watch only reads the
run's state, so a run it does not stop is the run without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import simpy

from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import RequestRecords
from llmsim.sim.result import StopReason

CHECKS = 64                     # the watch looks this many times across the measurement window
WATCHED = ("ttft", "e2e")       # the limits a request can be sure to miss before it finishes


@dataclass(frozen=True)
class MissedStop:
    """Stop a run once, for some limit, the share of its window's requests within it is sure to stay below
    the limit's percentile target less ``margin``; only where the window holds at least ``min_requests``."""
    margin: float
    min_requests: int


def watch_misses(env: simpy.Environment, scenario: Scenario, records: RequestRecords, in_system: dict,
                 warmup_s: float, window_s: float, rule: MissedStop, stop: simpy.Event):
    """A SimPy process that succeeds ``stop`` with :attr:`StopReason.MISSED` once ``rule`` holds (see the
    module docstring). ``in_system``: the router's requests in the system, by id (their records are
    written when they leave). Limits on TTFT and E2E are watched (a TPOT is known only at the end)."""
    targets = {metric: (limit, percentile / 100) for metric, (limit, percentile) in scenario.slo.targets().items()
               if metric in WATCHED}
    arrival = records.arrival_s
    first, last = int(np.searchsorted(arrival, warmup_s, "left")), int(np.searchsorted(arrival, window_s, "right"))
    counted = last - first
    if not targets or counted < rule.min_requests:
        return
    # more than this many sure misses of a limit and its share within it stays below target - margin
    allowed = {metric: math.floor((1 - share + rule.margin) * counted) for metric, (_, share) in targets.items()}
    period = max(window_s - warmup_s, 1e-9) / CHECKS
    yield env.timeout(warmup_s + period)
    while not stop.triggered:
        now = env.now
        arrived = arrival[first:last] <= now
        status = np.frombuffer(records.status, np.int8)[first:last]
        left = status != 0                      # written when they left: finished or rejected
        rejected = status == RequestRecords.STATUSES.index("rejected")
        first_token = np.frombuffer(records.first_token_s, float)[first:last].copy()
        finish = np.frombuffer(records.finish_s, float)[first:last].copy()
        for request in in_system.values():
            if first <= request.id < last:
                first_token[request.id - first] = request.first_token_s
        waited = now - arrival[first:last]
        for metric, (limit, _) in targets.items():
            if metric == "ttft":
                # no first token yet after the limit, or one after it
                late = np.where(np.isnan(first_token), waited > limit, first_token - arrival[first:last] > limit)
            else:
                late = np.where(left, finish - arrival[first:last] > limit, waited > limit)
            misses = int(np.count_nonzero(arrived & (rejected | late)))
            if misses > allowed[metric]:
                stop.succeed(StopReason.MISSED)
                return
        yield env.timeout(period)
