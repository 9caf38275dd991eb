"""Autoscaling: a pool of replicas that grows when requests wait and shrinks when it idles.

Every replica the pool may ever use (``max_replicas``) is built when the run starts, but only
the serving ones receive requests (:meth:`ReplicaPool.pick`, which the router asks). The
autoscaler process applies :class:`~llmsim.scenario.control.AutoscalingConfig`'s rule every
interval: a replica started is paid for from that moment and serves after the cold start; a
replica drained takes no new requests, finishes what it holds and is switched off at the first
check that finds it empty, losing what its memory held (``switch_off``: a tiered KV cache is
emptied, so a replica started again begins with empty caches). ``provisioned`` integrates the replicas
paid for over time: its area is the run's replica-seconds.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd
import simpy

from llmsim.scenario.control import AutoscalingConfig
from llmsim.sim.request import TimeAverage

OFF, STARTING, SERVING, DRAINING = "off", "starting", "serving", "draining"


class ReplicaPool:
    """Which replicas serve, start, drain or are off; ``pick`` routes among the serving ones."""

    def __init__(self, replicas: int, serving: int, switch_off: Callable[[int, float], None] | None = None):
        self.state = [SERVING] * serving + [OFF] * (replicas - serving)
        self.switch_off = switch_off
        self.routable = list(range(serving))
        self.provisioned = TimeAverage()
        self.provisioned.change(0.0, serving)
        self._turn = -1

    def next_in_turn(self) -> int:
        """The next serving replica in turn (round robin)."""
        routable = self.routable
        self._turn = (self._turn + 1) % len(routable)
        return routable[self._turn]

    def least_outstanding(self, outstanding: list[int]) -> int:
        """The serving replica with the fewest outstanding requests (ties: the first serving)."""
        return min(self.routable, key=outstanding.__getitem__)

    def replica_seconds(self, until_s: float) -> float:
        return self.provisioned.mean(until_s) * until_s

    def provisioned_series(self) -> pd.DataFrame:
        """The replicas paid for after each change (starting and draining ones included), from time 0."""
        log_s, log_value = self.provisioned.log_s, self.provisioned.log_value
        assert log_s is not None and log_value is not None      # the pool's counter is made logged
        return pd.DataFrame({"time_s": np.frombuffer(log_s, np.float64),
                             "replicas": np.frombuffer(log_value, np.int64)})


class ScalingLog:
    def __init__(self):
        self.rows: list[tuple] = []

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["time_s", "serving", "starting", "draining", "outstanding", "wanted",
                                                "action"])


def autoscaler(env: simpy.Environment, pool: ReplicaPool, outstanding: list[int], config: AutoscalingConfig,
               log: ScalingLog):
    """The autoscaler (a SimPy process): ``outstanding[i]`` is replica i's queued plus running
    requests (the router's count)."""
    more = fewer = 0
    state = pool.state

    def start(i):
        yield env.timeout(config.cold_start_s)
        state[i] = SERVING
        pool.routable = sorted(pool.routable + [i])

    while True:
        yield env.timeout(config.interval_s)
        now = env.now
        actions = []
        for i, s in enumerate(state):
            if s == DRAINING and outstanding[i] == 0:
                state[i] = OFF
                pool.provisioned.change(now, -1)
                if pool.switch_off is not None:
                    pool.switch_off(i, now)
                actions.append(f"off {i}")
        serving = pool.routable
        held = sum(outstanding[i] for i in serving)
        wanted = min(max(math.ceil(held / config.target_outstanding), config.min_replicas), config.max_replicas)
        paid = len(serving) + state.count(STARTING)
        more = more + 1 if wanted > paid else 0
        fewer = fewer + 1 if wanted < len(serving) and STARTING not in state else 0
        if more >= config.sustain:
            started = []
            for _ in range(wanted - paid):
                if OFF not in state:
                    break
                i = state.index(OFF)
                state[i] = STARTING
                pool.provisioned.change(now, +1)
                env.process(start(i))
                started.append(i)
            more = 0
            actions += [f"start {i}" for i in started]
        elif fewer >= config.sustain:
            i = serving[-1]
            state[i] = DRAINING
            pool.routable = serving[:-1]
            fewer = 0
            actions.append(f"drain {i}")
        log.rows.append((now, state.count(SERVING), state.count(STARTING), state.count(DRAINING), held, wanted,
                         "; ".join(actions)))
