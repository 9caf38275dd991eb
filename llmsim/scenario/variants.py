"""Variants of a scenario, derived from its typed settings: what searches vary, set with ``dataclasses.replace``.

A search asks the same question of many variants of one scenario: another arrival rate, request
count, replica count, engine knob, chip or draft. Each setter here returns a new :class:`Scenario`
with one setting changed, read by the same reader rule as the scenario file's key (so a bad value is a
:class:`~llmsim.errors.ConfigError` naming that key), and :func:`variant` then re-runs the reader's checks
that tie the settings together (the arrival window, batch tokens against sequences, hash blocks and
traffic classes, the experts on the layout and chip, host and spill tiers, ``check_fits``). An ``auto``
layout (``Deployment.auto_layout``) is placed again by the reader's ``resolve_parallelism`` when the chip,
the batch budget or the block size changes. They read nothing but the Scenario: one changed with
``dataclasses.replace`` keeps its change in every variant set here.

Searches name a point's settings by dotted scenario keys, the names their rows, journals and reports show
(``{"workload.arrival.rate": 8, "deployment.replicas": 3}``). :func:`variant` sets on the Scenario itself:
the keys of :data:`TYPED_KEYS` (rate, traffic, window, seed, replicas, chip, layout, expert degree, engine
knobs, the disaggregation split and pool replicas), a traffic class's ``queue_timeout``, and speculation
given as a whole new section (``speculation: None`` first, then its keys: a search's draft candidate, read
as the reader reads ``speculation:``) or as eligibility over the scenario's. The rest (a k policy changed
inside the scenario's own speculation section, any other key, a setting the reader resolves with a
controller, rollout groups, pools or an ``auto`` target's draft) is laid over the scenario written out
(:func:`llmsim.scenario.writer.to_mapping`) and validated again (:mod:`llmsim.scenario.overrides`): the
Scenario is the one source of truth either way.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmsim.config.reader import Node
from llmsim.scenario.overrides import apply_overrides, build_point
from llmsim.scenario.writer import to_mapping
from llmsim.catalog.hardware import lookup_hardware
from llmsim.config.policies import AcceptanceProcess, Batching, ControllerKnob, KPolicyName, KScope, SchedulingPolicy
from llmsim.cost.experts import ExpertParallel
from llmsim.scenario.disaggregation import PoolEngine, check_pool_engines
from llmsim.scenario.expert_parallel import check_given, check_hardware, check_layout, check_span
from llmsim.scenario.scenario import (COUNT, ENGINE, SIMULATION, Scenario, check_batch_tokens, check_classes,
                                     check_fits, check_hash_ids, check_kv_spill, check_kv_tiers, engine_hardware,
                                     read_cpu_offload, read_model, read_parallelism, read_replicas, read_seed,
                                     resolve_parallelism, simulation_from_node)
from llmsim.speculation.config import (KPolicy, read_eligibility, read_k_policy, resolve_draft_parallelism,
                                       speculation_from_node)
from llmsim.workload.classes import PRACTICE_TIERS
from llmsim.workload.arrivals import RenewalProcess, Replay
from llmsim.workload.profiles import Diurnal
from llmsim.workload.trace_transforms import has_time_scale
from llmsim.workload.sessions import SESSION_STARTS
from llmsim.workload.workload import check_session_start, check_window, traffic_amount

RATE_KEY, COUNT_KEY, DURATION_KEY = "workload.arrival.rate", "workload.num_requests", "workload.duration"
REPLICAS_KEY, TP_KEY, PP_KEY = "deployment.replicas", "deployment.tensor_parallel", "deployment.pipeline_parallel"
WARMUP_KEY, HORIZON_KEY, SEED_KEY, HARDWARE_KEY = "simulation.warmup", "simulation.horizon", "seed", "hardware"
BATCH_TOKENS_KEY, NUM_SEQS_KEY, BLOCK_SIZE_KEY = "engine.max_batch_tokens", "engine.max_num_seqs", "engine.block_size"
QUEUE_TIMEOUT_KEY, POLICY_KEY, OFFLOAD_KEY = "engine.queue_timeout", "engine.scheduling_policy", "engine.cpu_offload"
EXPERTS_KEY, SPECULATION_KEY = "deployment.expert_parallel", "speculation"
SESSION_START_KEY = "workload.sessions.start"
ELIGIBILITY_KEY = f"{SPECULATION_KEY}.eligibility"
K_POLICY_KEYS = tuple(f"{SPECULATION_KEY}.{key}" for key in ("policy", "k", "k_max"))
SPLIT_KEY = "deployment.disaggregation"          # null: the deployment aggregated
EXPERT_DEGREE_KEY = f"{EXPERTS_KEY}.degree"


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


def _set_session_start(scenario: Scenario, start: Any) -> Scenario:
    """``workload.sessions.start``: empty (None) or stationary (:mod:`llmsim.workload.sessions`)."""
    node = Node({} if start is None else {"start": start}, file=scenario.path, path="workload.sessions")
    sessions = scenario.workload.sessions
    assert sessions is not None          # the key applies to a workload of sessions
    sessions = replace(sessions, stationary=node.choice("start", SESSION_STARTS, "empty") == "stationary")
    check_session_start(node, sessions, scenario.workload.arrival)
    return replace(scenario, workload=replace(scenario.workload, sessions=sessions))


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
    """``deployment.<key>`` (``tensor_parallel``, ``pipeline_parallel``) as a whole number; the other key, if
    ``auto``, stays so (placed once the whole point is set)."""
    def setter(scenario: Scenario, value: Any) -> Scenario:
        dep = scenario.deployment
        asked = tuple(None if auto else degree for auto, degree in zip(dep.auto_layout, (dep.tensor_parallel,
                                                                                       dep.pipeline_parallel)))
        tp, pp = read_parallelism(Node({key: value}, file=scenario.path, path="deployment"), scenario.model,
                                  (asked[0], asked[1]))
        return replace(scenario, deployment=replace(dep, tensor_parallel=tp or dep.tensor_parallel,
                                                    pipeline_parallel=pp or dep.pipeline_parallel,
                                                    auto_layout=(tp is None, pp is None)))
    return setter


def _place(scenario: Scenario, root: Node) -> Scenario:
    """An ``auto`` layout placed again, as the reader places it, for the scenario's engine settings."""
    dep = scenario.deployment
    tp, pp = (None if auto else degree for auto, degree in zip(dep.auto_layout, (dep.tensor_parallel,
                                                                               dep.pipeline_parallel)))
    placed = resolve_parallelism(root, scenario.model, scenario.hardware, scenario.engine, dep.replicas, tp, pp,
                                 dep.router, scenario.speculation)
    return replace(scenario, deployment=replace(dep, tensor_parallel=placed.tensor_parallel,
                                                pipeline_parallel=placed.pipeline_parallel,
                                                auto_layout=placed.auto_layout))


def _set_engine_count(key: str) -> Callable[[Scenario, Any], Scenario]:
    """``engine.<key>`` (``max_batch_tokens``, ``max_num_seqs``, ``block_size``): a count, None its default."""
    def setter(scenario: Scenario, value: Any) -> Scenario:
        node = Node({} if value is None else {key: value}, file=scenario.path, path="engine")
        return replace(scenario, engine=replace(scenario.engine, **{key: node.number(key, getattr(ENGINE, key),
                                                                                     **COUNT)}))
    return setter


def _set_queue_timeout(scenario: Scenario, value: Any) -> Scenario:
    node = Node({} if value is None else {"queue_timeout": value}, file=scenario.path, path="engine")
    timeout_s = node.quantity("queue_timeout", "duration", ENGINE.queue_timeout_s)
    return replace(scenario, engine=replace(scenario.engine, queue_timeout_s=timeout_s))


def _set_scheduling_policy(scenario: Scenario, value: Any) -> Scenario:
    node = Node({} if value is None else {"scheduling_policy": value}, file=scenario.path, path="engine")
    policy = SchedulingPolicy(node.choice("scheduling_policy", SchedulingPolicy.names(), ENGINE.scheduling_policy))
    return replace(scenario, engine=replace(scenario.engine, scheduling_policy=policy))


def _set_cpu_offload(scenario: Scenario, value: Any) -> Scenario:
    """``engine.cpu_offload`` given a mapping, merged into the scenario's own offload settings."""
    offload = scenario.engine.cpu_offload
    assert offload is not None               # set here only over offload settings (TYPED_KEYS)
    node = Node({"cpu_offload": value}, file=scenario.path, path="engine")
    return replace(scenario, engine=replace(scenario.engine, cpu_offload=read_cpu_offload(node, offload)))


def _engine_knob(scenario: Scenario, value: Any) -> bool:
    """An engine knob set on the scenario, where nothing else was read with it: a controller's bounds and
    rollout groups take the engine's settings, and an ``auto`` layout placed again is set here only without a
    draft or experts, whose own layouts follow the target's. A disaggregated deployment's pools keep only the
    settings they set themselves, checked again with the engine's (:func:`_vary`)."""
    dep = scenario.deployment
    return (scenario.controller is None and scenario.rollout is None
            and not (any(dep.auto_layout) and (scenario.speculation is not None or dep.expert_parallel is not None)))


def _class_timeout_key(key: str) -> str | None:
    """The class of a ``workload.classes.<name>.queue_timeout`` key (None: not such a key)."""
    parts = key.split(".")
    return parts[2] if len(parts) == 4 and parts[:2] == ["workload", "classes"] and parts[3] == "queue_timeout" \
        else None


def _set_class_timeout(scenario: Scenario, key: str, value: Any) -> Scenario:
    name = _class_timeout_key(key)
    workload = scenario.workload
    node = Node({} if value is None else {"queue_timeout": value}, file=scenario.path,
                path=key.rsplit(".", 1)[0])
    timeout_s = node.quantity("queue_timeout", "duration", PRACTICE_TIERS.get(str(name), (0, None))[1])
    classes = tuple(replace(c, queue_timeout_s=timeout_s) if c.name == name else c for c in workload.classes)
    return replace(scenario, workload=replace(workload, classes=classes))


def _speculation_keys(point: Mapping[str, Any]) -> list[str]:
    return [key for key in point if key == SPECULATION_KEY or key.startswith(f"{SPECULATION_KEY}.")]


def _typed_speculation(scenario: Scenario, point: Mapping[str, Any]) -> bool:
    """Whether the point's speculation keys are set on the typed scenario: a whole new section (``speculation:
    None`` first, then its keys, as a search's draft candidate is given) or eligibility over the scenario's,
    where the reader resolves nothing else with them (a controller of the draft length starts from its k)."""
    keys = _speculation_keys(point)
    if not keys:
        return True
    controller = scenario.controller
    if (controller is not None and controller.knob is ControllerKnob.SPECULATION_K) or not _whole_deployment(
            scenario, None) or any(scenario.deployment.auto_layout):
        return False
    if keys[0] == SPECULATION_KEY and point[SPECULATION_KEY] is None:
        return True
    spec = scenario.speculation
    if spec is None or not set(keys) <= {ELIGIBILITY_KEY, *K_POLICY_KEYS} or (
            ELIGIBILITY_KEY in point and not isinstance(point[ELIGIBILITY_KEY], dict)):
        return False
    return not any(key in point for key in K_POLICY_KEYS) or _typed_k_policy(scenario, point)


def _typed_k_policy(scenario: Scenario, point: Mapping[str, Any]) -> bool:
    """A k policy set over the scenario's own: with k_max given (its default follows k), the scope the
    reader would default to for the new policy the scenario's own (so whether its file gave one does not
    matter), and neither replayed acceptance (measured at a k_max) nor static batching to check it against."""
    spec = scenario.speculation
    assert spec is not None
    name = point.get(K_POLICY_KEYS[0], spec.policy.policy)
    if str(name) not in KPolicyName.names() or K_POLICY_KEYS[2] not in point:
        return False
    default_scope = KScope.PER_BATCH if KPolicyName(str(name)) is KPolicyName.GOODPUT else KPolicy.scope
    return (spec.policy.scope is default_scope and spec.acceptance.process is not AcceptanceProcess.REPLAY
            and scenario.engine.batching is Batching.CONTINUOUS)


def _set_speculation(scenario: Scenario, point: Mapping[str, Any]) -> Scenario:
    """A point's speculation keys (:func:`_typed_speculation`): a new section is read from them as the reader
    reads ``speculation:``; eligibility is merged into the scenario's."""
    dep, base_dir = scenario.deployment, None if scenario.source_dir is None else Path(scenario.source_dir)
    if SPECULATION_KEY not in point:
        speculation = scenario.speculation
        assert speculation is not None        # a k policy and eligibility only over a scenario's own speculation
        if any(key in point for key in K_POLICY_KEYS):
            node = Node({key.split(".")[1]: point[key] for key in K_POLICY_KEYS if key in point}, file=scenario.path,
                        path=SPECULATION_KEY)
            speculation = replace(speculation, policy=read_k_policy(node, speculation.proposer, speculation.policy))
        if ELIGIBILITY_KEY in point:
            node = Node(point[ELIGIBILITY_KEY], file=scenario.path, path=ELIGIBILITY_KEY)
            speculation = replace(speculation, eligibility=read_eligibility(node, speculation.eligibility))
        return replace(scenario, speculation=speculation)
    section = apply_overrides({}, {key: point[key] for key in _speculation_keys(point)[1:]}).get(SPECULATION_KEY)
    if section is None:
        return replace(scenario, speculation=None)
    speculation = speculation_from_node(Node(section, file=scenario.path, path=SPECULATION_KEY, base_dir=base_dir),
                                        scenario.model, read_model, dep.tensor_parallel, dep.pipeline_parallel,
                                        scenario.engine.batching)
    return replace(scenario, speculation=resolve_draft_parallelism(speculation, dep.tensor_parallel))


def _set_pool_replicas(pool: str) -> Callable[[Scenario, Any], Scenario]:
    """``deployment.disaggregation.<pool>.replicas`` (``prefill``, ``decode``)."""
    def setter(scenario: Scenario, value: Any) -> Scenario:
        split = scenario.disaggregation
        assert split is not None                 # set here only on a disaggregated deployment (TYPED_KEYS)
        replicas = read_replicas(Node({} if value is None else {"replicas": value}, file=scenario.path,
                                      path=f"{SPLIT_KEY}.{pool}"))
        return replace(scenario, disaggregation=replace(split, **{pool: replace(getattr(split, pool),
                                                                                replicas=replicas)}))
    return setter


def _own_chip(scenario: Scenario, value: Any) -> bool:
    return isinstance(value, str) and value.lower() == scenario.hardware.name.lower()


def _set_hardware(scenario: Scenario, value: Any) -> Scenario:
    """``hardware``: a profile's name or file, priced by the scenario's engine's kernel terms."""
    if _own_chip(scenario, value):
        return scenario
    node = Node({"hardware": value}, file=scenario.path,
                base_dir=None if scenario.source_dir is None else Path(scenario.source_dir))
    hardware = lookup_hardware(node.string("hardware"), node, "hardware", copied=False)   # as the reader does
    hardware = engine_hardware(node.child("engine", {}), scenario.engine, hardware)
    return replace(scenario, hardware=hardware)


def _whole_deployment(scenario: Scenario, value: Any) -> bool:
    """A setting of the deployment where the reader resolves nothing else with it: a disaggregated deployment's
    pools and rollout groups take the top-level chip and layout, and a draft's layout follows an ``auto``
    target's."""
    return (scenario.disaggregation is None and scenario.rollout is None
            and not (any(scenario.deployment.auto_layout) and scenario.speculation is not None))


def _plain_layout(scenario: Scenario, value: Any) -> bool:
    """A whole number of devices, on a deployment whose other settings the reader does not resolve with its
    parallelism (a draft's, the pools', the rollout groups')."""
    return (isinstance(value, int) and not isinstance(value, bool) and scenario.speculation is None
            and _whole_deployment(scenario, value))


def _set_expert_degree(scenario: Scenario, value: Any) -> Scenario:
    """``deployment.expert_parallel.degree``: the scenario's expert settings (or the defaults) at this degree."""
    node = Node({"degree": value}, file=scenario.path, path=EXPERTS_KEY)
    degree = node.number("degree", integer=True, minimum=1)
    dep = scenario.deployment
    experts = ExpertParallel(degree) if dep.expert_parallel is None else replace(dep.expert_parallel, degree=degree)
    return replace(scenario, deployment=replace(dep, expert_parallel=experts))


def _experts_key(scenario: Scenario, value: Any) -> bool:
    """Expert parallelism, where the reader resolves nothing else with it (autoscaling and rollouts are refused
    with it: their replicas are not whole expert-parallel groups)."""
    return scenario.autoscaling is None and _whole_deployment(scenario, value)


def _check_experts(scenario: Scenario) -> None:
    """The reader's checks of the experts on the deployment's layout and chip."""
    dep, experts = scenario.deployment, scenario.deployment.expert_parallel
    if experts is None:
        return
    node = Node({}, file=scenario.path, path=EXPERTS_KEY)
    tp, pp = (None if auto else degree for auto, degree in zip(dep.auto_layout, (dep.tensor_parallel,
                                                                               dep.pipeline_parallel)))
    check_given(node, experts.degree, tp, pp)
    check_layout(node, scenario.model, experts.degree, dep.tensor_parallel, experts.redundant_experts)
    check_span(node, experts)
    check_hardware(node, experts.degree, scenario.hardware, scenario.engine.kernels.value)


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
    SESSION_START_KEY: (_set_session_start, lambda scenario, value: scenario.workload.sessions is not None),
    REPLICAS_KEY: (_set_replicas, lambda scenario, value: scenario.autoscaling is None and scenario.rollout is None),
    COUNT_KEY: (lambda scenario, value: scenario, _anything),
    DURATION_KEY: (lambda scenario, value: scenario, _anything),
    HARDWARE_KEY: (_set_hardware, lambda scenario, value: _own_chip(scenario, value) or (
        isinstance(value, str) and _whole_deployment(scenario, value))),
    EXPERT_DEGREE_KEY: (_set_expert_degree, _experts_key),
    SPLIT_KEY: (lambda scenario, value: replace(scenario, disaggregation=None),
                lambda scenario, value: value is None),
    **{f"{SPLIT_KEY}.{pool}.replicas": (_set_pool_replicas(pool),
                                        lambda scenario, value: scenario.disaggregation is not None)
       for pool in ("prefill", "decode")},
    EXPERTS_KEY: (lambda scenario, value: replace(scenario, deployment=replace(scenario.deployment,
                                                                              expert_parallel=None)),
                  lambda scenario, value: value is None and _experts_key(scenario, value)),
    TP_KEY: (_set_layout("tensor_parallel"), _plain_layout),
    PP_KEY: (_set_layout("pipeline_parallel"), _plain_layout),
    BATCH_TOKENS_KEY: (_set_engine_count("max_batch_tokens"), _engine_knob),
    NUM_SEQS_KEY: (_set_engine_count("max_num_seqs"), _engine_knob),
    BLOCK_SIZE_KEY: (_set_engine_count("block_size"), _engine_knob),
    QUEUE_TIMEOUT_KEY: (_set_queue_timeout, _engine_knob),
    POLICY_KEY: (_set_scheduling_policy, _engine_knob),
    OFFLOAD_KEY: (_set_cpu_offload, lambda scenario, value: (isinstance(value, dict) and _engine_knob(scenario, value)
                                                            and scenario.engine.cpu_offload is not None)),
}
# Keys whose change can change what an ``auto`` layout is placed for (the activation and block sizes).
PLACEMENT_KEYS = (BATCH_TOKENS_KEY, BLOCK_SIZE_KEY)
LAYOUT_KEYS = (TP_KEY, PP_KEY)


def typed(scenario: Scenario, point: Mapping[str, Any]) -> bool:
    """Whether every setting of ``point`` is set on the typed scenario (:data:`TYPED_KEYS`, a traffic class's
    ``workload.classes.<name>.queue_timeout``, and speculation as :func:`_typed_speculation` takes it)."""
    speculation = _speculation_keys(point)
    return _typed_speculation(scenario, point) and all(
        TYPED_KEYS[key][1](scenario, value) if key in TYPED_KEYS else
        _class_timeout_key(key) in scenario.workload.class_names and _engine_knob(scenario, value)
        for key, value in point.items() if key not in speculation)


def variant(scenario: Scenario, point: Mapping[str, Any]) -> Scenario:
    """The scenario with a point's settings, dotted scenario key -> value (``{}``: the scenario itself).

    A point whose every key is set on the typed scenario (:func:`typed`) is set on the Scenario; a point with
    any other key is laid over the scenario written out (:func:`llmsim.scenario.writer.to_mapping`) and read
    again, as a file would be. Either way the Scenario is the one source: a change made with
    ``dataclasses.replace`` is kept."""
    if typed(scenario, point):
        return _vary(scenario, point)
    out = build_point(to_mapping(scenario), point, _base_dir(scenario), scenario.path, scenario.path)
    # The written engine keys are what the scenario's vLLM flags set: the flags' notes stay the scenario's.
    return replace(out, vllm_notes=scenario.vllm_notes)


def _base_dir(scenario: Scenario) -> Path:
    """The folder a point's relative paths start from: the scenario file's."""
    if scenario.source_dir is not None:
        return Path(scenario.source_dir)
    return Path(scenario.path).parent if scenario.path else Path(".")


def _vary(scenario: Scenario, point: Mapping[str, Any]) -> Scenario:
    """A point of typed keys set on the scenario, then checked together as the reader checks them."""
    out = scenario
    speculation = _speculation_keys(point)
    for key, value in point.items():
        if key not in speculation:
            out = TYPED_KEYS[key][0](out, value) if key in TYPED_KEYS else _set_class_timeout(out, key, value)
    if speculation:
        out = _set_speculation(out, point)
    root = Node({}, file=scenario.path)
    chip = out.hardware != scenario.hardware
    if chip or any(key in point for key in (*LAYOUT_KEYS, EXPERT_DEGREE_KEY)):
        _check_experts(out)
    if chip:
        check_kv_tiers(root.child("engine"), out.engine, out.hardware)
        check_kv_spill(root.child("engine"), out.engine, out.hardware)
    if out.engine != scenario.engine:
        if out.disaggregation is not None:
            check_pool_engines(out.disaggregation, PoolEngine.shared_by(out.engine), root.child(SPLIT_KEY))
        check_batch_tokens(root.child("engine"), out.engine)
        check_hash_ids(root, out.engine, out.workload)
        check_classes(root, out.engine, out.workload)
    if COUNT_KEY in point or DURATION_KEY in point:
        workload = scenario.workload
        out = _set_traffic(out, point.get(COUNT_KEY, workload.num_requests),
                           point.get(DURATION_KEY, workload.duration_s))
    out = _check_traffic(out)
    if (chip or any(key in point for key in (*LAYOUT_KEYS, *PLACEMENT_KEYS))) and any(out.deployment.auto_layout):
        out = _place(out, root)
    if (chip or out.engine != scenario.engine or out.deployment != scenario.deployment
            or out.speculation != scenario.speculation or out.disaggregation != scenario.disaggregation):
        check_fits(out, root)
    return out
