"""A scenario's deployment, resolved once: cost models, memory, engines and their limits.

The simulator and the fluid model both run a scenario on the same thing: replicas of
``tp x pp`` devices (with expert parallelism, each attention data-parallel rank of an expert-parallel
group is such a replica, :mod:`llmsim.cost.experts`), each running one engine per pipeline micro-batch in flight (a
pipeline of ``pp`` stages keeps ``pp`` micro-batches going, each iteration taking the
full trip through all stages), the engines of a replica sharing its queue and KV cache
and splitting its ``max_num_seqs``. With speculative decoding the draft has its own cost
model, on the target's devices (colocated, over ``draft_tensor_parallel`` of them) or on
devices of its own (separate), where draft and target hand tokens over the interconnect.

Resolving builds cost models (the operator tables, the measured kernel terms), a fixed cost that a search
running hundreds of short simulations would pay per run, three times (the run-size guard, the default
horizon, the run): :meth:`ResolvedDeployment.of` keeps the last :data:`RESOLVED_KEPT` resolutions, keyed by
the very objects they were read from (a scenario's parts are frozen, and a variant made with
``dataclasses.replace`` shares the parts it did not change), so a run at another seed, rate or request
count resolves nothing again. A resolution holds no state that a run changes: sharing it changes no result.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

from llmsim.catalog.placement import Placement
from llmsim.config.recent import Keyed, recent_for
from llmsim.cost.experts import BusiestRank, ExpertParallelCostModel, all_to_all_terms, rank_shares
from llmsim.cost.roofline import CostModel, shared_cost_model
from llmsim.speculation.proposers import draft_cost_model
from llmsim.scenario.scenario import EngineConfig, Scenario


@dataclass(frozen=True)
class ResolvedDeployment:
    """What a scenario's deployment amounts to (see the module docstring)."""
    cost: CostModel                  # the target model on one replica's devices
    memory: Placement                # weights and KV cache per replica (``scenario.memory``)
    replicas: int                    # serving engines' groups: with expert parallelism, data-parallel ranks
    engines_per_replica: int         # pipeline micro-batches in flight
    engine: EngineConfig             # per engine: ``max_num_seqs`` is the replica's split over its engines
    draft_cost: CostModel | None     # None: no speculation, or a speculator without a model (n-gram)
    draft_separate: bool             # the draft runs on devices of its own
    handoff_s: float                 # draft to target hand-off per step when separate, else 0

    @property
    def kv_blocks(self) -> int:
        """KV blocks per replica (shared by its engines)."""
        return self.memory.num_blocks

    @property
    def block_size(self) -> int:
        return self.memory.block_size

    @property
    def kv_tokens_per_engine(self) -> float:
        return self.memory.kv_capacity_tokens / self.engines_per_replica

    @classmethod
    def of(cls, scenario: Scenario) -> ResolvedDeployment:
        """The scenario's deployment resolved: kept from an earlier call on the same parts (see the module
        docstring)."""
        seed = scenario.seed if scenario.deployment.expert_parallel is not None else None
        return recent_for(_RESOLVED, _resolved_from(scenario), (seed,), lambda: cls._resolve(scenario), RESOLVED_KEPT)

    @classmethod
    def _resolve(cls, scenario: Scenario) -> ResolvedDeployment:
        dep, memory = scenario.deployment, scenario.memory
        if dep.expert_parallel is None:
            cost = shared_cost_model(scenario.model, scenario.hardware, dep.tensor_parallel, dep.pipeline_parallel,
                                     memory)
        else:
            cost = expert_parallel_cost_model(scenario)
        micro_batches = dep.pipeline_parallel
        engine = replace(scenario.engine, max_num_seqs=-(-scenario.engine.max_num_seqs // micro_batches))
        spec = scenario.speculation if scenario.speculating else None
        draft_cost, separate = None, False
        if spec is not None:
            separate = spec.extra_devices > 0
            draft_tp = spec.draft_devices if separate else spec.draft_tensor_parallel
            assert draft_tp is not None     # reading the scenario resolves it (resolve_draft_parallelism)
            draft_cost = draft_cost_model(spec.proposer, spec.draft, scenario.hardware, draft_tp,
                                          scenario.draft_memory if separate else memory)
        return cls(cost, memory, dep.replicas * dep.data_parallel, micro_batches, engine, draft_cost, separate,
                   scenario.hardware.interconnect_latency_s if separate else 0.0)


RESOLVED_KEPT = 16        # resolutions kept (a search varies a few settings at a time)
_RESOLVED: Keyed[ResolvedDeployment] = OrderedDict()


def _resolved_from(scenario: Scenario) -> tuple[object, ...]:
    """The parts of ``scenario`` a resolution reads: the model, the chip, the deployment, the engine and the
    speculation when it speculates (and the seed, a value in the key, when expert parallelism draws its
    busiest-rank table)."""
    return (scenario.model, scenario.hardware, scenario.deployment, scenario.engine,
            scenario.speculation if scenario.speculating else None)


def expert_parallel_cost_model(scenario: Scenario) -> ExpertParallelCostModel:
    """One attention data-parallel rank's cost model (:mod:`llmsim.cost.experts`): its busiest-rank table
    drawn from the scenario's seed."""
    dep, model, hardware = scenario.deployment, scenario.model, scenario.hardware
    layout = dep.expert_parallel
    assert layout is not None               # asked only of a deployment with expert parallelism
    busiest = BusiestRank(rank_shares(model, layout, scenario.seed), scenario.seed)
    return ExpertParallelCostModel(model, hardware, dep.tensor_parallel, dep.pipeline_parallel, scenario.memory,
                                   layout, busiest, all_to_all_terms(hardware, scenario.engine.kernels.value))
