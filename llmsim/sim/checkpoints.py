"""Judging a run at shorter windows inside it, for a search that measures an undecided point longer.

A search measures a point over ``[warmup, end of arrivals]``; a verdict that window leaves undecided asks
for a measurement twice as long (:mod:`llmsim.search.window`). Rather than simulate the point again from
the start for each, one run carries the arrivals of the longest measurement ``M`` and is judged at the ends
of the shorter ones: ``warmup + M / 2^j``, ``j = stages .. 1``. Once every request that arrived by such an
end has left the system, ``decide`` is given the records of the requests arrived by then; when it says the
verdict is settled, the run stops (:attr:`StopReason.DECIDED`) and its figures cover ``[warmup, that end]``
(:class:`Stage`). Otherwise the run goes on, its arrivals continuing, to the next end.

A run's requests do not depend on how many there are (a trace's first requests are those of a shorter
one), so the requests of a shorter window are the ones a run of that length would have simulated; they
see the load of the requests arriving after them where that run would have drained its queue, so the
continued run's figures are those of a steady state at least as long. A run no checkpoint stops is the run
without them: the watch only reads its state.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy

from llmsim.scenario.scenario import Scenario
from llmsim.sim.missed import CHECKS
from llmsim.sim.request import RequestRecords
from llmsim.sim.result import StopReason


@dataclass(frozen=True)
class Checkpoints:
    """Judge a run at ``stages`` shorter measurements, each half the next (the last the run's own), and stop
    it at the first whose verdict ``decide(scenario, records, start_s, stop_s)`` says is settled: ``records``
    is the per-request table of the requests arrived by ``stop_s``, every one of them gone from the system."""
    stages: int
    decide: Callable[[Scenario, pd.DataFrame, float, float], bool]


class Stage:
    """The measurement a run is judged on now: the ends of its windows, shortest first (the run's own
    arrival window last), and the one reached. A watch of the run's misses (:mod:`llmsim.sim.missed`)
    follows it, so that a run stopped as sure to miss is so on the window it was being judged on."""

    def __init__(self, rule: Checkpoints, warmup_s: float, window_s: float):
        measure_s = window_s - warmup_s
        self.ends_s = [warmup_s + measure_s / 2 ** j for j in range(rule.stages, 0, -1)] + [window_s]
        self.index = 0

    @property
    def end_s(self) -> float:
        return self.ends_s[self.index]


def watch_checkpoints(env: simpy.Environment, scenario: Scenario, records: RequestRecords, warmup_s: float,
                      rule: Checkpoints, stage: Stage, records_of: Callable[[int], pd.DataFrame],
                      stop: simpy.Event):
    """A SimPy process that, at each of ``stage``'s ends but the last, waits until the requests arrived by it
    have all left (checked ``CHECKS`` times a window), asks ``rule.decide`` on them (``records_of(n)``: the
    table of the first ``n`` requests) and succeeds ``stop`` with :attr:`StopReason.DECIDED` when it says so;
    else moves ``stage`` on to the next end."""
    arrival = records.arrival_s
    while stage.index < len(stage.ends_s) - 1:
        end_s = stage.end_s
        arrived = int(np.searchsorted(arrival, end_s, "right"))
        period = max(end_s - warmup_s, 1e-9) / CHECKS
        yield env.timeout(max(end_s - env.now, 0.0))
        # status is written when a request leaves (finished or rejected): 0 while it is in the system
        while not np.frombuffer(records.status, np.int8)[:arrived].all():
            yield env.timeout(period)
        if stop.triggered:
            return
        if rule.decide(scenario, records_of(arrived), warmup_s, end_s):
            stop.succeed(StopReason.DECIDED)
            return
        stage.index += 1
