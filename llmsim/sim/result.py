"""What one run produced (:class:`SimulationResult`) and what ended it (:class:`StopReason`).

The result is the simulator's one output record: analysis (:func:`llmsim.analysis.metrics.summarize`),
searches and the CLI read it, the simulator never reads them. Its ``requests`` table is the
per-request record every figure derives from.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from enum import Enum

import pandas as pd

from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import InterTokenGaps


class StopReason(str, Enum):
    """What ended a run: every request left the system, the scenario's horizon came first, a search's
    run was sure to miss its SLO targets (:mod:`llmsim.sim.missed`) or had its verdict settled on a shorter
    window (:mod:`llmsim.sim.checkpoints`), Ctrl-C, or an exception inside the simulation. The value is the
    string written to ``summary.json``."""
    COMPLETED = "completed"
    HORIZON = "horizon"
    MISSED = "missed"
    DECIDED = "decided"
    INTERRUPT = "interrupt"
    FAULT = "fault"


@dataclass(frozen=True)
class SpeculationSteps:
    """The speculative decode sets' decoding sequence-steps, summed over engines: all of them, those
    that speculated, and why the others did not: the eligibility rules, the KV cache, or the k policy
    (it chose k = 0) or the last token."""
    sequence_steps: int
    speculated: int
    min_concurrent_requests: int
    min_sequence_tokens: int
    kv_cache: int
    policy: int

    def __add__(self, other: SpeculationSteps) -> SpeculationSteps:
        return SpeculationSteps(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def shares(self) -> dict[str, float]:
        """Each count but ``sequence_steps`` as a share of it (empty when no sequence decoded)."""
        if not self.sequence_steps:
            return {}
        return {f.name: getattr(self, f.name) / self.sequence_steps for f in fields(self)
                if f.name != "sequence_steps"}


@dataclass(frozen=True)
class KVTierTotals:
    """The tiered KV cache's totals over the replicas (prefix caching, a host tier, swap): blocks
    looked up, hit, moved and evicted, transfer seconds, and the cache's shape. The ``host_*``
    fields stay zero without a host tier; ``host_occupancy`` is then None, else the blocks each
    replica's host tier held after each change."""
    lookups: int
    hit_blocks: int
    reloaded_blocks: int
    offloaded_blocks: int
    evicted_blocks: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_resident_blocks: int
    swap_failed_preemptions: int
    transfer_s: float
    offload_s: float
    stall_s: float
    block_size: int
    block_bytes: float
    gpu_blocks: int
    cached_blocks: int
    host_occupancy: pd.DataFrame | None = field(default=None, repr=False)
    host_blocks: int = 0
    host_mean_blocks: float = 0.0
    host_max_blocks: int = 0
    host_evicted_blocks: int = 0
    offload_failed_blocks: int = 0
    host_allocated_blocks: int = 0
    host_freed_blocks: int = 0
    host_held_blocks: int = 0


@dataclass(frozen=True)
class PoolTotals:
    """One pool of a disaggregated deployment: its layout, what it costs and draws at TDP, and the share of
    its replicas' time their iterations took over the run."""
    pool: str
    hardware: str
    replicas: int
    tensor_parallel: int
    pipeline_parallel: int
    usd_per_hour: float
    power_w: float
    busy_fraction: float
    expert_parallel: int              # the routed experts' degree (1: tensor parallel like the rest)
    devices: int                      # replicas x devices per replica (a whole expert-parallel group each)


@dataclass(frozen=True)
class DisaggregationTotals:
    """A disaggregated run's layout (``xPyD``), its link (one per decode replica, ``lanes`` ports of
    ``link``: ``link_bytes_per_s`` of effective bandwidth each) and what crossed them: transfers, bytes,
    and the share of the run each link had a transfer on it; then the pools."""
    layout: str
    link: str
    lanes: int
    streaming: bool
    reservation: str
    link_bytes_per_s: float
    transfers: int
    transfer_bytes: float
    link_utilisation: float
    pools: tuple[PoolTotals, ...]


# The KVTierTotals summed from each replica's cache attribute of the same name.
SUMMED_KV_TOTALS = ("lookups", "hit_blocks", "reloaded_blocks", "offloaded_blocks", "evicted_blocks",
                    "swapped_out_blocks", "swapped_in_blocks", "swap_resident_blocks", "swap_failed_preemptions",
                    "transfer_s", "offload_s", "stall_s")


@dataclass
class SimulationResult:
    """What one run produced; ``requests`` is the per-request record everything else derives from.

    ``requests`` has one row per request that arrived (every request of the trace, unless the
    run stopped before the end of its arrivals: then the first ``len(requests)`` of
    ``planned_requests``). ``stopped_by`` says what ended the run (``fault`` names the
    exception; ``stopped_on``, for a stop as missed, the limits it stopped on: :mod:`llmsim.sim.missed`), and
    ``end_s`` the simulated time it stopped at.
    """
    scenario: Scenario
    requests: pd.DataFrame
    iterations: pd.DataFrame
    queue_length: pd.DataFrame
    end_s: float
    arrival_window_s: float
    warmup_s: float
    kv_blocks_per_replica: int
    kv_allocated_blocks: int
    kv_freed_blocks: int
    kv_held_blocks: int                  # blocks allocated and not freed (with prefix caching: cached ones too)
    preemptions: int
    mean_in_system: float
    mean_queue_length: float
    planned_requests: int
    inter_token_gaps: InterTokenGaps = field(repr=False, default_factory=InterTokenGaps)
    stopped_by: StopReason = StopReason.COMPLETED
    stopped_on: tuple[str, ...] = ()             # stopped as missed: its limits' names (llmsim.sim.missed)
    fault: str | None = None
    mean_queue_length_by_class: dict[str, float] | None = None     # with traffic classes
    control: pd.DataFrame | None = None          # with a controller: its decisions (sim.controller.ControlLog)
    scaling: pd.DataFrame | None = None          # with autoscaling: every check (sim.autoscaling.ScalingLog)
    replica_seconds: float | None = None         # with autoscaling: replica time paid for, start to end
    provisioned: pd.DataFrame | None = None      # with autoscaling: replicas paid for after each change
    speculation_blocked: SpeculationSteps | None = None     # with speculation: its decode steps, summed
    kv_tiers: KVTierTotals | None = None      # with a tiered KV cache (prefix caching, host tier, swap): its totals
    disaggregation: DisaggregationTotals | None = None    # with disaggregated prefill and decode: pools and link
    # The longest wait of a request at an admission a dispatching queue timeout could have changed, over every
    # engine (llmsim.sim.engine.Queueing.admit): the run is the run at any such timeout longer than it. None
    # where not followed (traffic classes, static batching).
    dispatch_wait_s: float | None = None

    @property
    def interrupted(self) -> bool:
        """Stopped before the scenario's own end (Ctrl-C or a fault): the figures cover what ran."""
        return self.stopped_by in (StopReason.INTERRUPT, StopReason.FAULT)
