"""Variants of a scenario, derived from its typed settings: what searches vary, set with ``dataclasses.replace``.

A search asks the same question of many variants of one scenario: another arrival rate, request
count, warm-up or replica count. Each function here returns a new :class:`Scenario` with one of these
settings changed, validated by the same reader rules as the scenario file's key (so a bad value is a
:class:`~llmsim.errors.ConfigError` naming that key) and by the checks that tie it to the rest of the
scenario (an arrival window too long to simulate, no amount of traffic). They read nothing but the
Scenario: one changed with ``dataclasses.replace`` keeps its change in every variant.

Searches still name a point's settings by dotted scenario keys, the names their rows, journals and
reports show (``{"workload.arrival.rate": 8, "deployment.replicas": 3}``); :func:`variant` sets each key
that has a typed setter (:data:`TYPED_KEYS`) on the Scenario itself. Other keys (another chip or layout,
engine knobs, speculation settings) change settings the reader resolves together (``auto`` parallelism,
a draft's placement, kernel terms): they are laid over the YAML mapping the scenario was read from and
validated again (:mod:`llmsim.scenario.overrides`), which needs a scenario that still matches it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from llmsim.config.reader import Node
from llmsim.scenario.overrides import apply_overrides, build_point
from llmsim.scenario.scenario import (SIMULATION, Scenario, check_fits, read_parallelism, read_replicas, read_seed,
                                     simulation_from_node)
from llmsim.workload.arrivals import RenewalProcess, Replay
from llmsim.workload.profiles import Diurnal
from llmsim.workload.trace_transforms import has_time_scale
from llmsim.workload.workload import check_window, traffic_amount

RATE_KEY, COUNT_KEY, DURATION_KEY = "workload.arrival.rate", "workload.num_requests", "workload.duration"
REPLICAS_KEY, TP_KEY, PP_KEY = "deployment.replicas", "deployment.tensor_parallel", "deployment.pipeline_parallel"
WARMUP_KEY, HORIZON_KEY, SEED_KEY, HARDWARE_KEY = "simulation.warmup", "simulation.horizon", "seed", "hardware"


def at_rate(scenario: Scenario, rate_per_s: Any) -> Scenario:
    """The scenario at another mean arrival rate (``workload.arrival.rate``): a renewal process's rate,
    a diurnal profile's mean, or a replayed trace's time scale (rescaled to this rate)."""
    return _vary(scenario, {RATE_KEY: rate_per_s})


def with_requests(scenario: Scenario, num_requests: Any) -> Scenario:
    """The scenario with another request count (``workload.num_requests``; a duration still bounds it)."""
    return _vary(scenario, {COUNT_KEY: num_requests})


def with_replicas(scenario: Scenario, replicas: Any) -> Scenario:
    """The scenario with another number of replicas (``deployment.replicas``). An autoscaled deployment's
    bounds and a rollout's groups are read with its replica count: :func:`variant` reads those again."""
    if not typed(scenario, {REPLICAS_KEY: replicas}):
        raise ValueError("autoscaling and rollout groups are read with the replica count: vary it with variant()")
    return _vary(scenario, {REPLICAS_KEY: replicas})


def _set_replicas(scenario: Scenario, replicas: Any) -> Scenario:
    node = Node({} if replicas is None else {"replicas": replicas}, file=scenario.path, path="deployment")
    return replace(scenario, deployment=replace(scenario.deployment, replicas=read_replicas(node)))


def _set_simulation(scenario: Scenario, key: str, value: Any) -> Scenario:
    """``simulation.<key>`` (``warmup``, ``horizon``): a duration, or None for its default."""
    node = Node({} if value is None else {key: value}, file=scenario.path, path="simulation")
    simulation = simulation_from_node(node, replace(scenario.simulation, **{f"{key}_s": getattr(SIMULATION,
                                                                                                 f"{key}_s")}))
    return replace(scenario, simulation=simulation)


def _set_seed(scenario: Scenario, seed: Any) -> Scenario:
    return scenario.with_seed(read_seed(Node({"seed": seed}, file=scenario.path)))


def _set_rate(scenario: Scenario, rate_per_s: Any) -> Scenario:
    workload = scenario.workload
    arrival_node = Node({"rate": rate_per_s}, file=scenario.path, path="workload.arrival")
    rate = arrival_node.quantity("rate", "rate")
    arrival = workload.arrival
    if isinstance(arrival, RenewalProcess):
        arrival = replace(arrival, rate_per_s=rate)
    elif isinstance(arrival, Diurnal):
        arrival = replace(arrival, mean_rate_per_s=rate)
    elif isinstance(arrival, Replay):
        transforms, trace = workload.transforms, workload.trace
        assert transforms is not None and trace is not None      # a replay is read with both
        if transforms.speed is not None:
            raise arrival_node.key_error("rate", "give either speed or rate, not both (each sets the time scale)",
                                         rate_per_s, "speed: FACTOR, or rate: REQUESTS PER SECOND")
        if not has_time_scale(trace):
            raise arrival_node.key_error("rate", f"the {len(trace):,} selected requests all arrive at one time: "
                                         "there is no time scale to rescale", rate_per_s,
                                         "no rate (replay the burst as it is), or a trace whose arrival times differ")
        workload = replace(workload, transforms=replace(transforms, rate_per_s=rate))
        arrival = Replay(rate)
    else:
        process = "per-class arrivals" if arrival is None else f"a {arrival.process} profile"
        raise arrival_node.key_error("rate", f"{process} has no single rate to set", rate_per_s,
                                     "poisson, gamma, deterministic, diurnal or a replayed trace")
    return replace(scenario, workload=replace(workload, arrival=arrival))


def _set_traffic(scenario: Scenario, num_requests: Any, duration_s: Any) -> Scenario:
    workload = scenario.workload
    data = {key: value for key, value in (("num_requests", num_requests), ("duration", duration_s))
            if value is not None}
    count, duration = traffic_amount(Node(data, file=scenario.path, path="workload"), workload.trace is not None)
    return replace(scenario, workload=replace(workload, num_requests=count, duration_s=duration))


def _check_traffic(scenario: Scenario) -> Scenario:
    """The reader's check of a synthetic workload's arrival window (rate and request count together)."""
    workload = scenario.workload
    if workload.trace is None and workload.arrival is not None:
        rate = workload.arrival.rate_per_s
        check_window(Node({"arrival": {"rate": rate}}, file=scenario.path, path="workload"), workload.arrival,
                     workload.num_requests, workload.duration_s)
    return scenario


def _set_layout(key: str) -> Callable[[Scenario, Any], Scenario]:
    def setter(scenario: Scenario, value: Any) -> Scenario:
        dep = scenario.deployment
        tp, pp = read_parallelism(Node({key: value}, file=scenario.path, path="deployment"), scenario.model,
                                  (dep.tensor_parallel, dep.pipeline_parallel))
        assert tp is not None and pp is not None         # "auto" is laid over the YAML (placement decides)
        return replace(scenario, deployment=replace(dep, tensor_parallel=tp, pipeline_parallel=pp))
    return setter


def _own_chip(scenario: Scenario, value: Any) -> bool:
    return isinstance(value, str) and value.lower() == scenario.hardware.name.lower()


def _plain_layout(scenario: Scenario, value: Any) -> bool:
    """A whole number of devices, on a deployment whose other settings the reader does not resolve with its
    parallelism (a draft's, the experts', the pools', the rollout groups')."""
    return (isinstance(value, int) and not isinstance(value, bool) and scenario.speculation is None
            and scenario.deployment.expert_parallel is None and scenario.disaggregation is None
            and scenario.rollout is None)


def _anything(scenario: Scenario, value: Any) -> bool:
    return True


# Dotted scenario keys set on the typed Scenario: (setter, whether it sets this value on this scenario);
# a value None sets the key's default. The amount of traffic (COUNT_KEY, DURATION_KEY) is set by both keys
# together, after the others, and a layout is checked to fit once all of the point is set.
TYPED_KEYS: dict[str, tuple[Callable[[Scenario, Any], Scenario], Callable[[Scenario, Any], bool]]] = {
    SEED_KEY: (_set_seed, _anything),
    RATE_KEY: (_set_rate, _anything),
    WARMUP_KEY: (lambda scenario, value: _set_simulation(scenario, "warmup", value), _anything),
    HORIZON_KEY: (lambda scenario, value: _set_simulation(scenario, "horizon", value), _anything),
    REPLICAS_KEY: (_set_replicas, lambda scenario, value: scenario.autoscaling is None and scenario.rollout is None),
    COUNT_KEY: (lambda scenario, value: scenario, _anything),
    DURATION_KEY: (lambda scenario, value: scenario, _anything),
    HARDWARE_KEY: (lambda scenario, value: scenario, _own_chip),
    TP_KEY: (_set_layout("tensor_parallel"), _plain_layout),
    PP_KEY: (_set_layout("pipeline_parallel"), _plain_layout),
}
LAYOUT_KEYS = (TP_KEY, PP_KEY)


def typed(scenario: Scenario, point: Mapping[str, Any]) -> bool:
    """Whether every setting of ``point`` is set on the typed scenario (:data:`TYPED_KEYS`)."""
    return all(key in TYPED_KEYS and TYPED_KEYS[key][1](scenario, value) for key, value in point.items())


def variant(scenario: Scenario, point: Mapping[str, Any]) -> Scenario:
    """The scenario with a point's settings, dotted scenario key -> value (``{}``: the scenario itself).

    A point of :data:`TYPED_KEYS` only is set on the Scenario (:func:`at_rate`...); a point with any other
    key is laid over the YAML mapping the scenario was read from and validated again, as a file would be.
    That mapping must still describe the scenario: one changed since (``dataclasses.replace``) raises a
    ValueError there, since its change would be lost."""
    if typed(scenario, point):
        return _vary(scenario, point)
    if scenario.source is None:
        raise ValueError("this Scenario was not read from YAML (no source mapping), and this variant changes "
                         f"settings read from it ({', '.join(k for k in point if k not in TYPED_KEYS)}): pass "
                         "its file or mapping")
    _check_matches_source(scenario)
    return build_point({**scenario.source, "seed": scenario.seed}, point, Path(scenario.source_dir or "."),
                       scenario.path, scenario.path)


def _vary(scenario: Scenario, point: Mapping[str, Any]) -> Scenario:
    """A point of typed keys set on the scenario, then checked together as the reader checks them."""
    out = scenario
    for key, value in point.items():
        out = TYPED_KEYS[key][0](out, value)
    if COUNT_KEY in point or DURATION_KEY in point:
        workload = scenario.workload
        out = _set_traffic(out, point.get(COUNT_KEY, workload.num_requests),
                           point.get(DURATION_KEY, workload.duration_s))
    out = _check_traffic(out)
    if any(key in point for key in LAYOUT_KEYS):
        check_fits(out, Node({}, file=scenario.path))
    if scenario.source is None:
        return out
    # The YAML mapping follows, so that a variant laid over it later keeps these settings (the own chip is
    # no change, and the mapping may name it by a profile file's path).
    out = replace(out, source=apply_overrides(scenario.source, {k: v for k, v in point.items() if k != HARDWARE_KEY}))
    if _MATCHING.get(id(scenario)) is scenario:
        _MATCHING[id(out)] = out
    return out


# Scenarios found to match their YAML mapping, by id (a Scenario holds unhashable fields).
_MATCHING: weakref.WeakValueDictionary[int, Scenario] = weakref.WeakValueDictionary()


def _check_matches_source(scenario: Scenario) -> None:
    """Refuse (ValueError) a scenario that differs from the YAML mapping it was read from: a variant
    laid over that mapping would silently lose the difference."""
    if _MATCHING.get(id(scenario)) is scenario:
        return
    assert scenario.source is not None
    rebuilt = build_point({**scenario.source, "seed": scenario.seed}, {}, Path(scenario.source_dir or "."),
                          scenario.path, scenario.path)
    trace, own_trace = rebuilt.workload.trace, scenario.workload.trace
    same_trace = (trace is None) == (own_trace is None) and (trace is None or all(
        np.array_equal(getattr(trace, name), getattr(own_trace, name))
        for name in ("arrival_s", "prompt_tokens", "output_tokens")))
    if not (same_trace and replace(rebuilt, path=scenario.path, workload=replace(rebuilt.workload, trace=None))
            == replace(scenario, workload=replace(scenario.workload, trace=None))):
        raise ValueError("this Scenario differs from the YAML mapping it was read from (changed with "
                         "dataclasses.replace?), and this variant changes settings the reader resolves from that "
                         f"mapping: only {', '.join(TYPED_KEYS)} are set on the Scenario itself. Pass the change "
                         "as a key of the point instead, e.g. {'engine.max_batch_tokens': 4096}, or a mapping of "
                         "the whole scenario")
    _MATCHING[id(scenario)] = scenario
