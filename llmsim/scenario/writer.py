"""A Scenario written out: the YAML mapping that the scenario reader reads back to an equal Scenario.

The typed :class:`~llmsim.scenario.scenario.Scenario` is the one source of truth; this is its way back to
YAML, for a variant whose settings are laid over the file's keys (:func:`llmsim.scenario.variants.variant`)
and for a user who saves a scenario (``yaml.safe_dump(to_mapping(scenario))``). The mapping holds plain
dicts, lists, strings, numbers and booleans; quantities are in their base units (seconds, bytes, per
second). A setting is written where it differs from what the reader would take for a key left out, and a
default that follows another setting is left out when it is that setting's (``speculation.k_max`` after
``k``, a controller's ``bounds`` after its knob, a length's ``max`` after ``engine.max_model_len``, an
``auto`` layout), so a key laid over the mapping moves what follows from it as it would in the file.
A model is written by its catalog name when it is that entry, else by its fields; a chip by its profile
name when it is that shipped profile, else by the path it was read from; a replayed trace, a dataset, an
empirical length, measured acceptances and a routing histogram by their files.
"""
from __future__ import annotations

import copy
from dataclasses import fields
from pathlib import Path
from typing import Any

from llmsim.catalog.hardware import HardwareProfile, lookup_hardware
from llmsim.catalog.links import LINKS
from llmsim.catalog.models import ModelSpec, model_catalog
from llmsim.config.policies import AcceptanceProcess, ControllerKnob, DraftPlacement, FailedRequests, KPolicyName, \
    KScope
from llmsim.config.reader import Node
from llmsim.cost.experts import ExpertParallel, HistogramRouting, ZipfRouting
from llmsim.errors import ConfigError
from llmsim.scenario.control import AutoscalingConfig, ControllerConfig
from llmsim.scenario.disaggregation import Disaggregation, Pool
from llmsim.scenario.rollout import RolloutConfig
from llmsim.scenario.scenario import DEPLOYMENT, ENGINE, PLAN, SLO, SLO_DEFAULTS, SLO_METRICS, EngineConfig, \
    Scenario, engine_hardware
from llmsim.speculation.config import Acceptance, Eligibility, KPolicy, SpeculationConfig
from llmsim.speculation.proposers import MEDUSA, MODEL, MTP, NGRAM, Proposer
from llmsim.workload.arrivals import Gamma, RenewalProcess
from llmsim.workload.classes import DEDICATED_SEQS, PRACTICE_TIERS, TrafficClass
from llmsim.workload.lengths import Empirical, Exponential, Fixed, LengthDistribution, Lognormal, Uniform
from llmsim.workload.profiles import MMPP, Diurnal, Piecewise, RateProfile
from llmsim.workload.sessions import MAX_TURNS, Sessions
from llmsim.workload.workload import TraceFile, Workload

# EngineConfig fields written under another key (a quantity's unit is in its field's name only).
ENGINE_KEYS = {"runtime_reserve_bytes": "runtime_reserve", "queue_timeout_s": "queue_timeout"}


def to_mapping(scenario: Scenario) -> dict[str, Any]:
    """``scenario`` as a scenario YAML mapping (see the module docstring). A setting that names no file the
    reader could read it from again (a profile, trace or CSV built in code) is a ValueError."""
    out: dict[str, Any] = {"name": scenario.name, "seed": scenario.seed, "model": _model(scenario.model),
                           "hardware": _hardware(scenario.hardware, scenario.engine),
                           "deployment": _deployment(scenario)}
    engine = _engine(scenario.engine)
    if engine:
        out["engine"] = engine
    if scenario.speculation is not None:
        out["speculation"] = _speculation(scenario.speculation, scenario)
    out["workload"] = _workload(scenario.workload, scenario.max_model_len)
    if scenario.controller is not None:
        out["controller"] = _controller(scenario.controller, scenario)
    if scenario.autoscaling is not None:
        out["autoscaling"] = _autoscaling(scenario.autoscaling)
    if scenario.rollout is not None:
        out["rollout"] = _rollout(scenario.rollout)
    slo = _slo(scenario.slo, SLO_DEFAULTS)
    if scenario.slo.classes:
        slo["classes"] = {name: _slo(own, scenario.slo) for name, own in scenario.slo.classes}
    if slo:
        out["slo"] = slo
    simulation = _set({"warmup": scenario.simulation.warmup_s, "horizon": scenario.simulation.horizon_s})
    if simulation:
        out["simulation"] = simulation
    if scenario.plan != PLAN:
        out["plan"] = {"hardware": list(scenario.plan.hardware)}
    return out


def _set(mapping: dict[str, Any]) -> dict[str, Any]:
    """The entries that are set (not None)."""
    return {key: value for key, value in mapping.items() if value is not None}


def _changed(value: Any, default: Any) -> Any:
    """``value`` where it differs from ``default``, else None (left out)."""
    return None if value == default else value


def _follows(owner: Any, key: str, value: Any, derived: Any) -> Any:
    """``value``, or None (left out) where the reader derived it from another setting (``owner.given`` does
    not name ``key``) and would derive the same again: a key laid over the mapping then moves it too."""
    return None if key not in owner.given and value == derived else value


def _model(model: ModelSpec) -> str | dict[str, Any]:
    """A catalog name where the model is that entry, else its fields (what ``model:`` reads inline)."""
    for name, entry in model_catalog().items():
        if entry == model:
            return name
    return _set({f.name: getattr(model, f.name) for f in fields(model)})


def _priced(profile: HardwareProfile, engine: EngineConfig) -> HardwareProfile | None:
    """``profile`` as the scenario reader prices it for ``engine`` (None: it cannot)."""
    try:
        return engine_hardware(Node({}), engine, profile)
    except ConfigError:
        return None


def _hardware(profile: HardwareProfile, engine: EngineConfig) -> str:
    """The chip's profile name where that shipped profile is this one, else the file it was read from."""
    try:
        if _priced(lookup_hardware(profile.name, copied=False), engine) == profile:
            return profile.name
    except ConfigError:
        pass
    path = None if profile.path is None else str(Path(profile.path).resolve())
    if path is not None and _priced(lookup_hardware(path, copied=False), engine) == profile:
        return path
    raise ValueError(f"the hardware profile {profile.name} is neither a shipped profile nor read from a file "
                     "as it is: a scenario with it cannot be written out")


def _file(path: str | None, what: str) -> str:
    if path is None:
        raise ValueError(f"{what} was not read from a file: a scenario with it cannot be written out")
    return str(Path(path).resolve())


def _deployment(scenario: Scenario) -> dict[str, Any]:
    dep = scenario.deployment
    out: dict[str, Any] = {"replicas": dep.replicas,
                           "tensor_parallel": "auto" if dep.auto_layout[0] else dep.tensor_parallel,
                           "pipeline_parallel": "auto" if dep.auto_layout[1] else dep.pipeline_parallel}
    out.update(_set({"router": _changed(dep.router.value, DEPLOYMENT.router.value),
                     "load_bound": _changed(dep.load_bound, DEPLOYMENT.load_bound)}))
    if dep.expert_parallel is not None:
        out["expert_parallel"] = _experts(dep.expert_parallel)
    if scenario.disaggregation is not None:
        out["disaggregation"] = _disaggregation(scenario.disaggregation, scenario)
    return out


def _experts(experts: ExpertParallel) -> dict[str, Any]:
    default = ExpertParallel(experts.degree)
    out: dict[str, Any] = {"degree": experts.degree}
    out.update(_set({"redundant_experts": _changed(experts.redundant_experts, default.redundant_experts),
                     "balance": _changed(experts.balance, default.balance),
                     "devices_per_node": _changed(experts.devices_per_node, default.devices_per_node),
                     "scale_out_bandwidth": _changed(experts.scale_out_bandwidth_bytes_per_s,
                                                     default.scale_out_bandwidth_bytes_per_s)}))
    routing = experts.routing
    if isinstance(routing, ZipfRouting):
        out["routing"] = {"distribution": "zipf", "exponent": routing.exponent}
    elif isinstance(routing, HistogramRouting):
        out["routing"] = {"distribution": "histogram", "path": _file(routing.path or None, "a routing histogram")}
    return out


def _disaggregation(split: Disaggregation, scenario: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {name: _pool(getattr(split, name), scenario) for name in ("prefill", "decode")}
    out["link"] = next(name for name, link in LINKS.items() if link == split.link)
    default = Disaggregation(split.prefill, split.decode, split.link)
    out.update(_set({"streaming": _changed(split.streaming, default.streaming),
                     "reservation": _changed(split.reservation.value, default.reservation.value),
                     "aggregated_below_tokens": _changed(split.aggregated_below_tokens,
                                                         default.aggregated_below_tokens)}))
    return out


def _pool(pool: Pool, scenario: Scenario) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _follows(pool, "hardware", pool.hardware, scenario.hardware) is not None:
        out["hardware"] = _hardware(pool.hardware, scenario.engine)
    out.update({"replicas": pool.replicas, "tensor_parallel": pool.tensor_parallel,
                "pipeline_parallel": pool.pipeline_parallel})
    if pool.expert_parallel is not None:
        out["expert_parallel"] = _experts(pool.expert_parallel)
    if pool.engine.settings():
        out["engine"] = pool.engine.settings()
    return out


def _engine(engine: EngineConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(engine):
        value, default = getattr(engine, f.name), getattr(ENGINE, f.name)
        if value == default:
            continue
        if f.name == "cpu_offload":
            value = True if value == type(value)() else _set(
                {"idle_timeout": value.idle_timeout_s, "overlap": value.overlap, "capacity": value.capacity_bytes})
        out[ENGINE_KEYS.get(f.name, f.name)] = getattr(value, "value", value)
    return out


def _speculation(spec: SpeculationConfig, scenario: Scenario) -> dict[str, Any]:
    proposer, draft, target = spec.proposer, spec.draft, scenario.model
    out: dict[str, Any] = {}
    if proposer.kind is MODEL:
        assert draft is not None                # a draft model's proposer has its model
        out["draft"] = _model(draft)
        out.update(_set({"allow_different_vocabulary": True if draft.vocab_size != target.vocab_size else None,
                         "allow_larger_draft": True if draft.param_count >= target.param_count else None}))
    else:
        out["draft"] = proposer.kind.value
    default = Proposer()
    out.update(_set({
        "heads": proposer.heads if proposer.kind is MEDUSA else None,
        "allow_missing_mtp": True if proposer.kind is MTP and not target.mtp_modules else None,
        "tree_branching": _changed(proposer.branching, default.branching) if proposer.kind is not NGRAM else None,
        "ngram_cpu_per_sequence": _changed(proposer.cpu_s_per_sequence, default.cpu_s_per_sequence)
        if proposer.kind is NGRAM else None,
        "ngram_cpu_per_context_token": _changed(proposer.cpu_s_per_context_token, default.cpu_s_per_context_token)
        if proposer.kind is NGRAM else None}))
    if spec.scorer is not SpeculationConfig.scorer:
        out["scorer"] = spec.scorer.value
    if spec.placement is not DraftPlacement.COLOCATED:
        out["placement"] = spec.placement.value
        out["draft_devices"] = spec.draft_devices
    tp = scenario.deployment.tensor_parallel
    # Left out, a colocated draft shards like the target where its heads allow (resolve_draft_parallelism).
    follows = tp if draft is not None and draft.num_heads % tp == 0 else 1
    out.update(_set({"draft_tensor_parallel": _follows(spec, "draft_tensor_parallel", spec.draft_tensor_parallel,
                                                       follows)}))
    out.update(_k_policy(spec.policy, proposer))
    acceptance = _acceptance(spec.acceptance)
    if acceptance:
        out["acceptance"] = acceptance
    eligibility = _set({f.name: _changed(getattr(spec.eligibility, f.name), getattr(Eligibility(), f.name))
                        for f in fields(Eligibility)})
    if eligibility:
        out["eligibility"] = eligibility
    return out


def _k_policy(policy: KPolicy, proposer: Proposer) -> dict[str, Any]:
    default = KPolicy()
    k_max = max(proposer.heads, policy.k) if proposer.kind is MEDUSA else max(default.k_max, policy.k)
    scope = KScope.PER_BATCH if policy.policy is KPolicyName.GOODPUT else default.scope
    return _set({"policy": _changed(policy.policy.value, default.policy.value), "k": _changed(policy.k, default.k),
                 "k_max": _follows(policy, "k_max", policy.k_max, k_max),
                 "scope": _follows(policy, "scope", policy.scope.value, scope.value),
                 **{name: _changed(getattr(policy, name), getattr(default, name))
                    for name in ("window", "raise_above", "lower_below", "fallback", "prior_alpha")}})


def _acceptance(acceptance: Acceptance) -> dict[str, Any]:
    """The acceptance section; left out where it is the reader's for none (bernoulli at the default alpha,
    not stated: ``measured`` false). One built in code at another alpha but not marked measured (a draft
    candidate's) is written as stated: a file cannot give an alpha without stating it."""
    process = acceptance.process
    if process is AcceptanceProcess.PREDICTED:
        return {"process": process.value, "workload": acceptance.workload,
                **_set({"distilled": acceptance.distilled or None, "same_family": acceptance.same_family})}
    if acceptance == Acceptance():
        return {}
    if process is AcceptanceProcess.BETA:
        given = acceptance.beta_mean_concentration
        if given is not None and (given[0] * given[1], (1 - given[0]) * given[1]) == (acceptance.beta_a,
                                                                                     acceptance.beta_b):
            return {"process": process.value, "mean": given[0], "concentration": given[1]}
        return {"process": process.value, "a": acceptance.beta_a, "b": acceptance.beta_b}
    if process is AcceptanceProcess.REPLAY:
        return {"process": process.value, "path": _file(acceptance.path, "a replayed acceptance"),
                "column": acceptance.column, "measured_k": acceptance.measured_k}
    decay = {"decay": acceptance.decay} if process is AcceptanceProcess.POSITIONAL else {}
    return {"process": process.value, "alpha": acceptance.alpha, **decay}


def _workload(workload: Workload, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if workload.trace is not None:
        out["arrival"] = _replay(workload)
    elif workload.arrival is not None:
        assert isinstance(workload.arrival, (RenewalProcess, RateProfile))    # a Replay comes with its trace
        out["arrival"] = _arrival(workload.arrival)
    out.update(_set({"num_requests": workload.num_requests, "duration": workload.duration_s}))
    if workload.dataset is not None:
        out["dataset"] = _trace_file(workload.dataset_file, "a dataset")
    if workload.classes:
        out["classes"] = {c.name: _traffic_class(c, max_tokens) for c in workload.classes}
    for key in ("prompt_tokens", "output_tokens"):
        length = getattr(workload, key)
        if length is not None:
            out[key] = _length(length, max_tokens)
    if workload.sessions is not None:
        out["sessions"] = _sessions(workload.sessions)
    return out


def _trace_file(file: TraceFile | None, what: str) -> dict[str, Any]:
    if file is None:
        raise ValueError(f"{what} was not read from a file: a scenario with it cannot be written out")
    return {"path": _file(file.path, what), **_set({
        "format": _changed(file.format, "auto"), "failed": _changed(file.failed.value, FailedRequests.DROP.value),
        "tokenizer": file.tokenizer, "chars_per_token": file.chars_per_token})}


def _replay(workload: Workload) -> dict[str, Any]:
    transforms = workload.transforms
    assert transforms is not None               # a replayed trace is read with its transforms
    out: dict[str, Any] = {"process": "trace", **_trace_file(workload.trace_file, "a replayed trace")}
    if transforms.window_start_s > 0 or transforms.window_end_s is not None:
        out["window"] = _set({"start": _changed(transforms.window_start_s, 0.0), "end": transforms.window_end_s})
    if transforms.labels:
        out["filter"] = {label: list(values) for label, values in transforms.labels}
    out.update(_set({"sample": transforms.sample_fraction, "speed": transforms.speed, "rate": transforms.rate_per_s,
                     "hash_block_tokens": _changed(workload.hash_block_tokens, Workload.hash_block_tokens)}))
    return out


def _arrival(arrival: RenewalProcess | RateProfile) -> dict[str, Any]:
    if isinstance(arrival, RenewalProcess):
        cv = {"cv": arrival.cv} if isinstance(arrival, Gamma) and arrival.cv != Gamma.cv else {}
        return {"process": arrival.process, "rate": arrival.rate_per_s, **cv}
    if isinstance(arrival, Diurnal):
        return {"process": arrival.process, "rate": arrival.mean_rate_per_s, "period": arrival.period_s,
                **_set({"amplitude": _changed(arrival.amplitude, 0.5),
                        "peak": _follows(arrival, "peak", arrival.peak_s, arrival.period_s / 2)})}
    if isinstance(arrival, Piecewise):
        return {"process": "ramp" if arrival.linear else "steps",
                "rates": [{"at": at, "rate": rate} for at, rate in zip(arrival.at_s, arrival.rates_per_s)]}
    assert isinstance(arrival, MMPP)
    return {"process": arrival.process, "states": [{"rate": rate, "mean_duration": duration} for rate, duration
                                                   in zip(arrival.rates_per_s, arrival.mean_durations_s)]}


def _length(length: LengthDistribution, max_tokens: int) -> int | dict[str, Any]:
    """A length: a whole number where it is one fixed count up to ``max_tokens`` (the key's default max)."""
    written_max = _follows(length, "max", length.maximum, max_tokens)
    if isinstance(length, Fixed) and length.minimum == 1 and written_max is None:
        return int(length.value)
    params: dict[str, Any]
    if isinstance(length, Fixed):
        params = {"value": length.value}
    elif isinstance(length, Uniform):
        params = {"low": length.low, "high": length.high}
    elif isinstance(length, Lognormal):
        params = {"mean": length.unclipped_mean, "sigma": length.sigma}
    elif isinstance(length, Exponential):
        params = {"mean": length.unclipped_mean}
    else:
        assert isinstance(length, Empirical)
        params = {"path": _file(length.path, "an empirical length"), "column": length.column}
    return {"distribution": length.name, **_set({"min": _changed(length.minimum, 1),
                                                 "max": written_max}),
            **params}


def _traffic_class(traffic: TrafficClass, max_tokens: int) -> dict[str, Any]:
    priority, timeout_s = PRACTICE_TIERS.get(traffic.name, (0, None))
    out: dict[str, Any] = _set({"share": traffic.share,
                                "arrival": None if traffic.arrival is None else _arrival(traffic.arrival)})
    for key in ("prompt_tokens", "output_tokens"):
        length = getattr(traffic, key)
        if length is not None:
            out[key] = _length(length, max_tokens)
    on_timeout = "dispatch" if timeout_s is not None else None     # the reader's default follows the tier's
    out.update(_set({"priority": _changed(traffic.priority, priority), "weight": _changed(traffic.weight, 1.0),
                     "reserved_seqs": _changed(traffic.reserved_seqs, 0),
                     "queue_timeout": _changed(traffic.queue_timeout_s, timeout_s),
                     "on_timeout": _changed(None if traffic.on_timeout is None else traffic.on_timeout.value,
                                            on_timeout),
                     "dedicated_seqs": _changed(traffic.dedicated_seqs, DEDICATED_SEQS)}))
    return out


def _sessions(sessions: Sessions) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": _length(sessions.turns, MAX_TURNS),
                           **_set({"think_time": _changed(sessions.think_time_s, 0.0)})}
    if sessions.stationary:
        out["start"] = "stationary"
    system = sessions.system_prompt
    if system is not None:
        out["system_prompt"] = {"tokens": system.tokens, "share": system.share, "variants": system.variants}
    return out


def _controller(controller: ControllerConfig, scenario: Scenario) -> dict[str, Any]:
    """The controller's settings, its defaults that follow the knob's setting (bounds, window, increase)
    left out where they are the ones that follow."""
    if controller.knob is ControllerKnob.SPECULATION_K:
        assert scenario.speculation is not None    # the reader refuses the knob without speculation
        start, floor = scenario.speculation.policy.k, 0
    else:
        start, floor = getattr(scenario.engine, controller.knob.value), 1
    default = ControllerConfig(window_s=3 * controller.interval_s, low=max(floor, start // 8), high=start)
    bounds = [controller.low, controller.high]
    return _set({
        "rule": _changed(controller.rule.value, default.rule.value),
        "knob": _changed(controller.knob.value, default.knob.value),
        "interval": _changed(controller.interval_s, default.interval_s),
        "window": _follows(controller, "window", controller.window_s, default.window_s),
        "bounds": _follows(controller, "bounds", bounds, [default.low, default.high]),
        "increase": _follows(controller, "increase", controller.increase,
                             max(default.increase, (controller.high - controller.low) // 10)),
        **{name: _changed(getattr(controller, name), getattr(default, name))
           for name in ("hysteresis", "decrease", "timeout_factor", "kp", "ki", "kd")}})


def _autoscaling(autoscaling: AutoscalingConfig) -> dict[str, Any]:
    return {"min_replicas": autoscaling.min_replicas, "max_replicas": autoscaling.max_replicas,
            "target_outstanding": autoscaling.target_outstanding, "interval": autoscaling.interval_s,
            "cold_start": autoscaling.cold_start_s, "sustain": autoscaling.sustain}


def _rollout(rollout: RolloutConfig) -> dict[str, Any]:
    groups = {group.name: {"role": group.role.value, "fraction": group.fraction, "replicas": group.replicas,
                           **_set({"engine": copy.deepcopy(group.engine), "hardware": group.hardware})}
              for group in rollout.groups}
    return {"groups": groups, "replications": rollout.replications}


def _slo(slo: SLO, top: SLO) -> dict[str, Any]:
    """An SLO's limits and percentiles where given or differing from ``top``'s (the defaults, or the top-level
    SLO for a traffic class's, which a class's others follow)."""
    out = _set({metric: _follows(slo, metric, getattr(slo, f"{metric}_s"), getattr(top, f"{metric}_s"))
                for metric in SLO_METRICS})
    written = _set({metric: _follows(slo, f"{metric}_percentile", getattr(slo, f"{metric}_percentile"),
                                     getattr(top, f"{metric}_percentile")) for metric in SLO_METRICS})
    percentiles = {getattr(slo, f"{metric}_percentile") for metric in SLO_METRICS}
    if written:
        out["percentile"] = percentiles.pop() if len(percentiles) == 1 else written    # one number: every limit's
    return out
