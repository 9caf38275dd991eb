"""The adaptive controller as a SimPy process: every interval it reads the rolling latency
targets and moves an engine knob (and, under the practice rule, the classes' queue timeouts).

:mod:`llmsim.scenario.control` describes the rules; this module runs them. The controller
reads the per-request records as requests leave (``RequestRecords``), so it sees what a
monitoring system would: the latencies of requests that finished in the last ``window``. It
changes the engines' :class:`~llmsim.scenario.scenario.EngineConfig` in place of the old one
(the engine reads its settings every iteration; the KV cache keeps the size it was placed
with). Every decision is logged: ``ControlLog.frame()`` has one row per interval.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import simpy

from llmsim.config.policies import ControlRule, ControllerKnob
from llmsim.scenario.control import ControllerConfig
from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import RequestRecords
from llmsim.sim.scheduling import ClassQueueing
from llmsim.sim.sensor import latencies, targets_of, worst_ratio

class Rule:
    """One control rule and its state: ``step(value, ratio)`` gives the knob's next value;
    ``timeout_scale`` is the classes' queue-timeout scale (1: the scenario's timeouts)."""

    def __init__(self, config: ControllerConfig, start: int):
        self.config, self.start = config, start
        self.timeout_scale = 1.0

    def step(self, value: int, ratio: float) -> int:
        raise NotImplementedError


class AIMD(Rule):
    """Additive increase below the band, multiplicative decrease on a violation."""

    def step(self, value: int, ratio: float) -> int:
        c = self.config
        if ratio > 1.0:
            return self.decrease(value)
        if ratio < 1.0 - c.hysteresis:
            return self.increase(value)
        return value

    def decrease(self, value: int) -> int:
        return max(self.config.low, int(value * self.config.decrease))

    def increase(self, value: int) -> int:
        return min(self.config.high, value + self.config.increase)


class Practice(AIMD):
    """Serving practice: the knob and the queue timeouts scale down together on a violation and back up
    by the inverse factors below the band."""

    def decrease(self, value: int) -> int:
        self.timeout_scale *= self.config.timeout_factor
        return super().decrease(value)

    def increase(self, value: int) -> int:
        c = self.config
        self.timeout_scale = min(1.0, self.timeout_scale / c.timeout_factor)
        return min(c.high, max(value + 1, int(round(value / c.decrease))))


class PID(Rule):
    """The scenario's setting scaled by a PID controller's output on the worst ratio's error."""

    def __init__(self, config: ControllerConfig, start: int):
        super().__init__(config, start)
        self._integral = 0.0
        self._last_error = 0.0

    def step(self, value: int, ratio: float) -> int:
        c = self.config
        error = ratio - (1.0 - c.hysteresis / 2)        # aim at the middle of the band
        derivative = (error - self._last_error) / c.interval_s
        self._last_error = error
        output = c.kp * error + c.ki * (self._integral + error * c.interval_s) + c.kd * derivative
        wanted = self.start * (1.0 - output)
        if c.low < wanted < c.high:         # anti-windup: integrate only off the bounds
            self._integral += error * c.interval_s
        return int(round(min(max(wanted, c.low), c.high)))


RULES: dict[ControlRule, type[Rule]] = {ControlRule.PRACTICE: Practice, ControlRule.AIMD: AIMD, ControlRule.PID: PID}


class ControlLog:
    """The controller's decisions, one row per interval."""

    def __init__(self):
        self.rows: list[tuple] = []

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["time_s", "worst_ratio", "knob", "value", "timeout_scale", "changed"])


def controller(env: simpy.Environment, scenario: Scenario, engines: list, records: RequestRecords, log: ControlLog):
    """The control loop (a SimPy process; it runs until the simulation stops)."""
    config, speculation = scenario.controller, scenario.speculation
    assert config is not None                    # simulate starts this process only for a controlled scenario
    targets = targets_of(scenario.slo, scenario.workload.class_names)
    moves_k = config.knob is ControllerKnob.SPECULATION_K
    if moves_k:
        assert speculation is not None           # the reader refuses a k controller without speculation
        start = speculation.policy.k
    else:
        start = getattr(scenario.engine, config.knob.value)
    rule = RULES[config.rule](config, start)
    value, scale = start, 1.0
    base_rules = {id(e): e.queueing.rules for e in engines if isinstance(e.queueing, ClassQueueing)}
    while True:
        yield env.timeout(config.interval_s)
        now = env.now
        finish = np.frombuffer(records.finish_s)
        finished = records.finished()
        values = latencies(records.arrival_s, np.frombuffer(records.first_token_s), finish, records.output_tokens)
        ratio = worst_ratio(finish, finished, records.class_index, values, targets, now - config.window_s, now)
        if np.isnan(ratio):
            log.rows.append((now, ratio, config.knob, value, scale, False))
            continue
        new = rule.step(value, ratio)
        changed = new != value or rule.timeout_scale != scale
        if changed:
            value, scale = new, rule.timeout_scale
            for engine in engines:
                if moves_k:
                    engine.decode.policy.set_k(value)
                else:
                    engine.config = replace(engine.config, **{config.knob.value: value})
                if id(engine) in base_rules:
                    engine.queueing.scale_timeouts(base_rules[id(engine)], scale)
        log.rows.append((now, ratio, config.knob, value, scale, changed))
