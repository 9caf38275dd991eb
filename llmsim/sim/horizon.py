"""The default horizon of a run: long enough for its arrivals, and for the work they bring.

A run stops at ``simulation.horizon``. Unset, the horizon is twice the arrival window and at least
60 s past it, which serves a load the deployment carries: its requests finish within moments of
arriving. A load it cannot carry as it comes (an offline run, every request at t=0, or a burst
beyond its capacity) leaves a backlog that drains at the deployment's capacity, however short the
arrival window: there the horizon is ``DRAIN_MARGIN`` times the fluid model's time to serve every
request at capacity (:class:`llmsim.analysis.fluid.FluidModel`), whose step times err by up to
about 20% (docs/accuracy/fluid-model.md), so the margin leaves the run time to finish.
"""
from __future__ import annotations

import math

from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario
from llmsim.workload.trace import Trace

DRAIN_MARGIN = 2.0
MIN_TAIL_S = 60.0             # past the last arrival, at least
MAX_HALVINGS = 60             # of the offered rate, looking for one the fluid model finds stable
CAPACITY_STEPS = 8


def default_horizon_s(scenario: Scenario, window_s: float, requests: int, trace: Trace | None = None) -> float:
    """The horizon of a run of ``requests`` arriving over ``window_s`` when the scenario sets none."""
    horizon = max(2 * window_s, window_s + MIN_TAIL_S)
    drain = drain_time_s(scenario, window_s, requests, trace)
    return max(horizon, DRAIN_MARGIN * drain) if math.isfinite(drain) else horizon


def drain_time_s(scenario: Scenario, window_s: float, requests: int, trace: Trace | None = None) -> float:
    """Seconds to serve ``requests`` at the deployment's capacity by the fluid model, when their
    offered rate is beyond it; 0 when it carries them as they come; NaN when the model does not
    apply (static batching, an empty run) or predicts no capacity."""
    from llmsim.analysis.fluid import FluidModel        # the fluid model prices with the whole cost model

    if requests <= 0:
        return math.nan
    try:
        model = FluidModel(scenario, trace)

        def stable(rate: float) -> bool:           # one rate at a time: a run's memory stays the run's
            return bool(model.evaluate(rate)["stable"].iloc[0])

        high = requests / max(window_s, 1e-9)      # the offered rate
        if stable(high):
            return 0.0
        low = high / 2
        for _ in range(MAX_HALVINGS):
            if stable(low):
                break
            low, high = low / 2, low
        else:
            return math.nan
        for _ in range(CAPACITY_STEPS):            # geometric bisection of [low, high]: a factor 2 to 0.3%
            middle = math.sqrt(low * high)
            low, high = (middle, high) if stable(middle) else (low, middle)
    except ConfigError:
        return math.nan
    return requests / low
