"""Settings that change while a run goes on: the adaptive controller (``controller:`` in a scenario)
and autoscaling (``autoscaling:``, :class:`AutoscalingConfig`).

The controller (:mod:`llmsim.sim.controller`) wakes every ``interval``, reads the worst ratio of
a rolling ``window``'s latency percentiles to their SLO limits (:mod:`llmsim.sim.sensor`)
and moves one engine ``knob`` (``max_batch_tokens`` or ``max_num_seqs``) within ``bounds``
(default: an eighth of the scenario's setting up to the setting itself), by a ``rule``:

``practice``
    the rule of thumb of serving practice ("when P95 latency exceeds the SLA, lower max batch
    tokens or shorten queue timeouts"): on a violation the knob is multiplied by ``decrease``
    and every class's queue timeout by ``timeout_factor``; when every ratio is below
    ``1 - hysteresis`` both step back by the inverse factors towards the scenario's settings.
``aimd``
    additive increase, multiplicative decrease: on a violation the knob times ``decrease``;
    below ``1 - hysteresis`` the knob plus ``increase``.
``pid``
    the knob is the scenario's setting times ``1 - (kp e + ki integral(e) + kd de/dt)``, where the
    error ``e`` is the worst ratio minus ``1 - hysteresis / 2`` (the middle of the band below);
    the integral stops while the knob sits on a bound (anti-windup).

Under ``practice`` and ``aimd`` nothing moves while the worst ratio is between
``1 - hysteresis`` and 1 (hysteresis). Under every rule a run whose ratios stay below
``1 - hysteresis``, with the knob at its upper bound (the default), is left as configured.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmsim.config.policies import ControlRule, ControllerKnob, KPolicyName, RouterPolicy, members_of
from llmsim.config.reader import Node, NumberRange



@dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings; the reader takes each default from here. ``window_s`` defaults to
    three intervals and ``bounds`` (``low``, ``high``) to the knob's setting over eight up to it."""
    window_s: float
    low: int
    high: int
    rule: ControlRule = ControlRule.PRACTICE
    knob: ControllerKnob = ControllerKnob.MAX_BATCH_TOKENS
    interval_s: float = 10.0
    hysteresis: float = 0.3
    decrease: float = 0.5
    increase: int = 1                    # the reader's default: a tenth of the bounds' range, at least this
    timeout_factor: float = 0.8
    kp: float = 2.0
    ki: float = 0.2
    kd: float = 0.0
    # ``window``, ``bounds`` and ``increase`` where the scenario gave them (else they follow the interval,
    # the knob's setting and the bounds).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self):
        members_of(self, rule=ControlRule, knob=ControllerKnob)


def controller_from_node(node: Node, engine, speculation=None) -> ControllerConfig:
    """``controller:``; ``engine`` is the scenario's EngineConfig and ``speculation`` its SpeculationConfig
    (or None): where the knob starts. ``speculation_k`` moves a static k policy's k within [0, k_max]
    (0: plain decoding); the adaptive and goodput policies choose k themselves."""
    rule = ControlRule(node.choice("rule", ControlRule.names(), ControllerConfig.rule))
    knob = ControllerKnob(node.choice("knob", ControllerKnob.names(), ControllerConfig.knob))
    floor, ceiling, setting = 1, None, f"engine.{knob}"
    if knob is ControllerKnob.SPECULATION_K:
        if speculation is None or not speculation.enabled or speculation.policy.policy is not KPolicyName.STATIC:
            raise node.key_error("knob", "speculation_k moves the draft length of a static k policy, and this "
                                         "scenario does not speculate with one", knob,
                                 "speculation with policy: static (the adaptive and goodput policies choose k), "
                                 "or " + ", ".join(ControllerKnob.names()[:2]))
        start, floor, ceiling = speculation.policy.k, 0, max(speculation.policy.k, speculation.policy.k_max)
        setting = "speculation.k"
    else:
        start = getattr(engine, knob.value)
    interval = node.quantity("interval", "duration", ControllerConfig.interval_s)
    window = node.quantity("window", "duration", 3 * interval)
    bounds = node.raw("bounds", [max(floor, start // 8), start])
    if (not isinstance(bounds, list) or len(bounds) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)):
        raise node.key_error("bounds", "expected [low, high], two whole numbers", bounds,
                             f"e.g. [{max(1, start // 8)}, {start}]")
    low, high = bounds
    if not floor <= low <= start <= high:
        raise node.key_error("bounds", f"the range must hold {setting} ({start}), the setting the run starts "
                             f"from, and start at {floor} or more", bounds,
                             f"[low, high] with {floor} <= low <= {start} <= high")
    if ceiling is not None and high > ceiling:
        raise node.key_error("bounds", f"the draft length cannot exceed the policy's k_max ({ceiling}): the draft's "
                                       "buffers are sized by it", bounds,
                             f"high <= {ceiling}, or raise speculation.k_max")
    if knob is ControllerKnob.MAX_BATCH_TOKENS and low < engine.max_num_seqs:
        raise node.key_error("bounds", f"max_batch_tokens below max_num_seqs ({engine.max_num_seqs}) would starve "
                             "running sequences", bounds, f"low >= {engine.max_num_seqs}")
    fraction = NumberRange(minimum=0.0, maximum=1.0, exclusive_minimum=True)
    config = ControllerConfig(
        rule=rule, knob=knob, interval_s=interval, window_s=window, low=low, high=high,
        hysteresis=node.number("hysteresis", ControllerConfig.hysteresis, minimum=0.0, maximum=0.9),
        decrease=node.number("decrease", ControllerConfig.decrease, **fraction),
        increase=node.number("increase", max(ControllerConfig.increase, (high - low) // 10), integer=True, minimum=1),
        timeout_factor=node.number("timeout_factor", ControllerConfig.timeout_factor, **fraction),
        kp=node.number("kp", ControllerConfig.kp, minimum=0.0), ki=node.number("ki", ControllerConfig.ki, minimum=0.0),
        kd=node.number("kd", ControllerConfig.kd, minimum=0.0),
        given=frozenset(key for key in ("window", "bounds", "increase") if node.has(key)))
    if config.decrease == 1.0:
        raise node.key_error("decrease", "a factor of 1 never moves the knob", 1.0, "a number in (0, 1)")
    node.done()
    return config


@dataclass(frozen=True)
class AutoscalingConfig:
    """Replicas added while requests pile up and removed while they are few.

    Every ``interval`` the autoscaler counts the requests held by the serving replicas (waiting
    plus running) and, as Kubernetes' horizontal pod autoscaler does, wants
    ``ceil(held / target_outstanding)`` replicas, within ``[min_replicas, max_replicas]``. When it
    has wanted more than are paid for (serving plus starting) for ``sustain`` checks in a row, it
    starts the difference; each serves after ``cold_start``. When it has wanted fewer than are
    serving for ``sustain`` checks (and none is starting), it drains the last one: no new
    requests; off once empty, noticed at the next check. A replica costs from its start to the end
    of its drain: ``replica_seconds`` is what is paid for.
    """
    max_replicas: int
    min_replicas: int = 1
    target_outstanding: float = 32.0
    interval_s: float = 10.0
    cold_start_s: float = 60.0
    sustain: int = 3


def autoscaling_from_node(node: Node, replicas: int, router: RouterPolicy) -> AutoscalingConfig:
    """``autoscaling:``; ``replicas`` (deployment.replicas) is how many serve at the start."""
    count = NumberRange(integer=True, minimum=1)
    low = node.number("min_replicas", AutoscalingConfig.min_replicas, **count)
    high = node.number("max_replicas", **count)
    if not low <= replicas <= high:
        raise node.key_error("max_replicas", f"the run starts with deployment.replicas ({replicas}), which must "
                             f"lie within [min_replicas, max_replicas] = [{low}, {high}]", high,
                             f"min_replicas <= {replicas} <= max_replicas")
    if router is RouterPolicy.SHARED_QUEUE:
        raise node.error("autoscaling routes each request to a serving replica", key="deployment.router",
                         value=router, allowed=", ".join(p for p in RouterPolicy.names() if p != router))
    config = AutoscalingConfig(
        min_replicas=low, max_replicas=high,
        target_outstanding=node.number("target_outstanding", AutoscalingConfig.target_outstanding, minimum=0.0,
                                       exclusive_minimum=True),
        interval_s=node.quantity("interval", "duration", AutoscalingConfig.interval_s),
        cold_start_s=node.quantity("cold_start", "duration", AutoscalingConfig.cold_start_s, minimum=0.0,
                                   exclusive_minimum=False),
        sustain=node.number("sustain", AutoscalingConfig.sustain, **count))
    node.done()
    return config
