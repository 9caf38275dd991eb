"""What one run produced (:class:`SimulationResult`) and what ended it (:class:`StopReason`).

The result is the simulator's one output record: analysis (:func:`llmsim.analysis.metrics.summarize`),
searches and the CLI read it, the simulator never reads them. Its ``requests`` table is the
per-request record every figure derives from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import pandas as pd

from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import InterTokenGaps


class StopReason(str, Enum):
    """What ended a run: every request left the system, the scenario's horizon came first, Ctrl-C,
    or an exception inside the simulation. The value is the string written to ``summary.json``."""
    COMPLETED = "completed"
    HORIZON = "horizon"
    INTERRUPT = "interrupt"
    FAULT = "fault"


@dataclass
class SimulationResult:
    """What one run produced; ``requests`` is the per-request record everything else derives from.

    ``requests`` has one row per request that arrived (every request of the trace, unless the
    run stopped before the end of its arrivals: then the first ``len(requests)`` of
    ``planned_requests``). ``stopped_by`` says what ended the run (``fault`` names the
    exception), and ``end_s`` the simulated time it stopped at.
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
    fault: str | None = None
    mean_queue_length_by_class: dict[str, float] | None = None     # with traffic classes
    control: pd.DataFrame | None = None          # with a controller: its decisions (sim.controller.ControlLog)
    scaling: pd.DataFrame | None = None          # with autoscaling: every check (sim.autoscaling.ScalingLog)
    replica_seconds: float | None = None         # with autoscaling: replica time paid for, start to end
    provisioned: pd.DataFrame | None = None      # with autoscaling: replicas paid for after each change
    speculation_blocked: dict | None = None      # speculative decode sets' eligibility counts, summed
    kv_tiers: dict | None = None         # the tiered KV cache's totals (prefix caching, host tier, swap), if any

    @property
    def interrupted(self) -> bool:
        """Stopped before the scenario's own end (Ctrl-C or a fault): the figures cover what ran."""
        return self.stopped_by in (StopReason.INTERRUPT, StopReason.FAULT)
