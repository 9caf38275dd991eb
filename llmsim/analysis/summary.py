"""The summary of one run, typed: what ``llmsim run`` prints and a sweep's row holds.

:func:`~llmsim.analysis.metrics.summarize` fills these records from a run's per-request
records and iteration log. ``to_dict()`` gives the nested mapping written as
``summary.json``; :func:`flatten` turns
that into one row of dotted names (``latency.tpot_s.p95``), the columns of a sweep's
``results.csv`` (:mod:`llmsim.analysis.names` names the ones code reads). The order of the
fields is the order of the keys and columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

PERCENTILES = (50, 95, 99)

class Section:
    """A record whose mapping is its fields in order, nested records as mappings."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]  # subclasses are dataclasses


def _plain(value):
    return value.to_dict() if isinstance(value, Section) else value


@dataclass(frozen=True)
class Distribution(Section):
    """Mean and percentiles of one latency (NaN when nothing was measured)."""
    mean: float
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values) -> Distribution:
        values = np.asarray(values, dtype=float)
        values = values[~np.isnan(values)]
        if len(values) == 0:
            return cls(math.nan, *(math.nan for _ in PERCENTILES))
        return cls(float(values.mean()), *(float(q) for q in np.percentile(values, PERCENTILES)))


@dataclass(frozen=True)
class RequestCounts(Section):
    """Counts over the whole run (not only the window), so conservation can be checked on them:
    ``arrived`` = finished + rejected + unfinished. A run stopped before the end of its trace
    (horizon, Ctrl-C, fault) counts as arrived only the requests the simulation reached;
    ``not_arrived`` are the trace's later ones, which have no record."""
    arrived: int
    not_arrived: int
    finished: int
    rejected_timeout: int
    rejected_too_long: int
    unfinished_queued: int
    unfinished_running: int
    preemptions: int


@dataclass(frozen=True)
class Latency(Section):
    """Per-request latencies of the window's finished requests; ``itl_s`` is per token instead
    (every gap between consecutive tokens in the window, finished requests or not)."""
    queue_wait_s: Distribution
    ttft_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    max_itl_s: Distribution
    itl_s: Distribution


@dataclass(frozen=True)
class Throughput(Section):
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    output_tokens_per_s_per_device: float
    offered_requests_per_s: float


@dataclass(frozen=True)
class SLOTarget:
    """One limit's attainment (share of the window's requests within it), the standard error of that
    share (batch means over the requests in arrival order; NaN for too few) and its percentile target."""
    attainment: float
    stderr: float
    percentile: float


@dataclass(frozen=True)
class SLOSummary(Section):
    """The limits (None when not set), attainment of all of them, goodput, and per-limit targets."""
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    attainment: float
    attainment_stderr: float          # batch-means standard error of ``attainment``
    goodput_requests_per_s: float
    goodput_output_tokens_per_s: float
    targets: dict[str, SLOTarget]     # metric ("ttft", ...) -> its target, for every limit set
    met: bool                         # every percentile target holds (True when no limit is set)

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in ("ttft_s", "tpot_s", "e2e_s", "attainment", "attainment_stderr",
                                                      "goodput_requests_per_s", "goodput_output_tokens_per_s")}
        for metric, target in self.targets.items():
            out[f"{metric}_attainment"] = target.attainment
            out[f"{metric}_attainment_stderr"] = target.stderr
            out[f"{metric}_percentile"] = target.percentile
        out["met"] = self.met
        return out


@dataclass(frozen=True)
class Utilisation(Section):
    """Shares of the window, each within [0, 1] (see ``metrics.utilisation_from``): devices computing
    (``busy_fraction``), FLOPs and bytes against the devices' peaks (``mfu``, ``mfu_while_busy`` =
    mfu / busy_fraction, ``bandwidth_utilisation``), KV blocks in use; and the mean batch (sequences)."""
    busy_fraction: float
    mfu: float
    mfu_while_busy: float
    bandwidth_utilisation: float
    kv_occupancy_mean: float
    kv_occupancy_max: float
    mean_batch_size: float


@dataclass(frozen=True)
class Memory(Section):
    """Where weights and KV cache live on each replica's devices."""
    tensor_parallel: int
    pipeline_parallel: int
    weights_in: str
    kv_cache_in: str
    weights_per_device_gb: float
    kv_cache_per_device_gb: float
    kv_capacity_tokens_per_replica: int
    draft_devices_per_replica: int
    expert_parallel: int = 1                # GPUs the routed experts are spread over (1: tensor parallel)
    experts_per_device: int = 0             # with expert parallelism, routed experts per GPU (redundant included)


@dataclass(frozen=True)
class Economics(Section):
    """Cost and energy per output token, with every device drawing its TDP (an upper bound)."""
    usd_per_hour: float
    usd_per_million_output_tokens: float
    joules_per_output_token_at_tdp: float
    kwh_per_million_output_tokens_at_tdp: float

    @classmethod
    def at_tdp(cls, usd_per_hour: float, power_w: float, output_tokens_per_s: float) -> Economics:
        per_million = 1e6 / output_tokens_per_s if output_tokens_per_s > 0 else math.nan
        return cls(usd_per_hour, usd_per_hour / 3600 * per_million,
                   power_w / output_tokens_per_s if output_tokens_per_s > 0 else math.nan,
                   power_w * per_million / 3.6e6)


@dataclass(frozen=True)
class QueueSummary(Section):
    """Queue lengths over the run, and whether the window looks like a steady state: ``ttft_rise`` is
    the trend of the window's TTFT from its first to its last twentieth, as a share of the TTFT limit
    (of the mean TTFT when no limit is set), and ``steady`` is False when that rise is significant and
    over 10% (waits still climbing: a load beyond capacity, or a window too short for the queue to
    settle; see ``statistics.rising_trend``)."""
    mean_length: float
    max_length: int
    mean_in_system: float
    ttft_rise: float
    steady: bool


@dataclass(frozen=True)
class SpeculationSummary(Section):
    """Acceptance, draft length and where the time went (see ``metrics.speculation_summary``)."""
    draft: str
    placement: str
    policy: str
    acceptance_rate: float
    mean_accepted_tokens: float
    tokens_per_verify_step: float
    mean_k: float
    speculating_fraction: float
    draft_time_share: float
    verify_time_share: float
    # Over the whole run: the share of decoding sequence-steps that speculated and that each
    # eligibility rule (or the KV cache, or the k policy) kept from it; a warning when it rarely ran.
    blocked_share: dict
    warning: str | None


@dataclass(frozen=True)
class ClassSummary(Section):
    """One traffic class: counts over the whole run; latencies, rates and its own SLO over the window.

    ``output_tokens_per_s`` counts the output of the class's requests that finished in the window
    (the iteration log, which the overall figure uses, does not know classes)."""
    arrived: int
    finished: int
    rejected: int
    unfinished: int
    queue_wait_s: Distribution
    ttft_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    requests_per_s: float
    output_tokens_per_s: float
    offered_requests_per_s: float
    slo: SLOSummary


@dataclass(frozen=True)
class AutoscalingSummary(Section):
    """What the replica pool cost over the whole run: replica-seconds paid for (start to end of
    drain, cold starts included), their mean, the scaling actions and the price of those seconds
    (per replica: its devices at the profile's hourly price) per million output tokens generated.
    ``mean_replicas_in_window`` is the mean over the measurement window, which the run's throughput
    per device, economics and utilisation divide by."""
    min_replicas: int
    max_replicas: int
    devices_per_replica: int
    replica_seconds: float
    mean_replicas: float
    mean_replicas_in_window: float
    max_replicas_serving: int
    scale_ups: int
    scale_downs: int
    usd: float
    usd_per_million_output_tokens: float


@dataclass(frozen=True)
class PoolSummary(Section):
    """One pool of a disaggregated deployment: its layout, its price per hour, and the share of its replicas'
    time spent in iterations within the window (the whole run's when the window is empty)."""
    hardware: str
    replicas: int
    tensor_parallel: int
    pipeline_parallel: int
    usd_per_hour: float
    busy_fraction: float
    expert_parallel: int = 1          # the routed experts' degree (1: tensor parallel like the rest)


@dataclass(frozen=True)
class DisaggregationSummary(Section):
    """Disaggregated prefill and decode: the layout (``xPyD``), the link and what crossed it over the whole
    run, the finished requests' TTFT split into its four parts (they add up to the TTFT) and each pool.
    ``link_utilisation`` is the share of the run each decode replica's link had a transfer on it."""
    layout: str
    link: str
    lanes: int
    streaming: bool
    reservation: str
    aggregated_requests: int
    transfers: int
    transfer_gb: float
    transfer_s: Distribution
    link_utilisation: float
    ttft_queue_s: Distribution
    ttft_prefill_s: Distribution
    ttft_transfer_s: Distribution
    ttft_first_decode_s: Distribution
    pools: dict

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["pools"] = {name: pool.to_dict() for name, pool in self.pools.items()}
        return out


@dataclass(frozen=True)
class RunSummary(Section):
    """One run: what, where, the measurement window, and each section of figures."""
    scenario: str
    seed: int
    model: str
    hardware: str
    devices: int
    window_s: tuple[float, float]         # [warmup, end of arrivals or of the simulation if earlier]
    simulated_s: float
    requests: RequestCounts
    latency: Latency
    throughput: Throughput
    slo: SLOSummary
    utilisation: Utilisation
    memory: Memory
    economics: Economics
    queue: QueueSummary
    speculation: SpeculationSummary | None     # None (and no key in the mapping) for plain decoding
    interrupted: bool                          # stopped early (Ctrl-C or a fault): the figures cover what ran
    stopped_by: str                            # a StopReason's value (llmsim.sim.result); simulated_s is when
    fault: str | None                          # the fault's exception (type: message), else None
    # Stopped as missed: the limits it stopped on, comma-separated ("ttft", "chat.e2e"); None (no key) otherwise.
    stopped_on: str | None = None
    classes: dict[str, ClassSummary] | None = None     # per traffic class; None (no key) without classes
    autoscaling: AutoscalingSummary | None = None      # None (no key) without autoscaling
    # Prefix caching, host tier, swap (llmsim.analysis.kv_cache.KVCacheSummary): None (and no key) without them.
    kv_cache: Section | None = None
    # Disaggregated prefill and decode: None (and no key) for an aggregated deployment.
    disaggregation: DisaggregationSummary | None = None

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["window_s"] = list(self.window_s)
        for optional in ("speculation", "kv_cache", "autoscaling", "disaggregation", "stopped_on"):
            if out[optional] is None:
                del out[optional]
        if self.classes is None:
            del out["classes"]
        else:
            out["classes"] = {name: c.to_dict() for name, c in self.classes.items()}
        return out

    def flat(self) -> dict:
        """One row of dotted names: :func:`flatten` of :meth:`to_dict`."""
        return flatten(self.to_dict())


def flatten(summary: dict, prefix: str = "") -> dict:
    """``{'latency': {'ttft_s': {'p95': x}}}`` -> ``{'latency.ttft_s.p95': x}`` (for DataFrames)."""
    flat = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, list):
            flat[name] = tuple(value)
        else:
            flat[name] = value
    return flat
