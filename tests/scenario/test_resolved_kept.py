"""A resolved deployment is kept for the scenario's variants that share its parts (another seed, rate or
request count), and resolved again, as a fresh resolution would be, when a part it reads changes."""
from __future__ import annotations

import numpy as np

from llmsim.cost.roofline import CostModel
from llmsim.scenario.deployment import ResolvedDeployment, expert_parallel_cost_model
from llmsim.scenario.variants import at_rate, variant, with_requests

from tests.helpers import make_scenario


def test_a_variant_sharing_the_parts_reads_the_kept_resolution():
    scenario = make_scenario()
    resolved = ResolvedDeployment.of(scenario)
    for other in (scenario.with_seed(99), at_rate(scenario, 3.0), with_requests(scenario, 10)):
        assert ResolvedDeployment.of(other) is resolved


def test_a_changed_part_is_resolved_again():
    scenario = make_scenario({"deployment": {"pipeline_parallel": 2}})
    resolved = ResolvedDeployment.of(scenario)
    fewer = variant(scenario, {"engine.max_num_seqs": 63})
    # Each of the two pipeline engines takes half the replica's sequences, rounded up.
    assert ResolvedDeployment.of(fewer).engine.max_num_seqs == 32
    assert resolved.engine.max_num_seqs == -(-scenario.engine.max_num_seqs // 2)
    other_chip = ResolvedDeployment.of(variant(scenario, {"hardware": "H200"}))
    assert other_chip.cost.hardware.name == "H200" and resolved.cost.hardware.name == "H100-SXM"
    assert other_chip.kv_blocks > resolved.kv_blocks           # 141 GB against 80 GB


def test_expert_parallelism_resolves_each_seed_s_busiest_rank_table():
    scenario = make_scenario({"model": "Qwen3-30B-A3B", "hardware": "H200",
                              "deployment": {"tensor_parallel": 1, "pipeline_parallel": 1,
                                             "expert_parallel": {"degree": 8}}})
    def busiest_mean(seed: int) -> np.ndarray:
        return ResolvedDeployment.of(scenario.with_seed(seed)).cost.busiest.mean

    for seed in (1, 2, 1):
        assert np.array_equal(busiest_mean(seed), expert_parallel_cost_model(scenario.with_seed(seed)).busiest.mean)
    assert not np.array_equal(busiest_mean(1), busiest_mean(2))


def test_a_remembered_decode_step_is_the_step_priced_afresh():
    scenario = make_scenario()
    cost = ResolvedDeployment.of(scenario).cost
    fresh = CostModel(scenario.model, scenario.hardware, 1, 1, scenario.memory)
    pairs = [(8, 2000), (2000, 8), (64, 700), (8, 2000)]
    remembered = [cost.decode_time(batch, context) for batch, context in pairs]
    assert remembered == [fresh.step_time(fresh.features([], [], [context] * batch)) for batch, context in pairs]
    assert remembered[0] != remembered[1]
