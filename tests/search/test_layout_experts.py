"""The layout search's expert-parallel candidates: every degree tp x 2^i that splits the experts and fits, as a
replica of degree GPUs; the scenario's own expert settings carry over; dense models get none."""
from __future__ import annotations

from llmsim.scenario.scenario import load_scenario
from llmsim.search.layout import layouts

from tests.helpers import REPO, make_scenario

WIDE_EP = REPO / "scenarios" / "deepseek-v3-h200-wide-ep.yaml"


def test_an_moe_model_gets_expert_parallel_layouts_of_whole_groups():
    scenario = make_scenario({"model": "Qwen3-30B-A3B", "hardware": "H200"})
    found = layouts(scenario, "H200", max_tensor_parallel=4, max_pipeline_parallel=2, max_expert_parallel=8)
    shapes = {(layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel) for layout, _ in found}
    # Qwen3-30B-A3B (61 GB in bf16) fits one H200: every split, and every degree tp x 2^i up to 8 at one stage.
    assert shapes == {(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1), (4, 1, 1), (4, 2, 1),
                      (1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 1, 2), (2, 1, 4), (2, 1, 8), (4, 1, 4), (4, 1, 8)}
    for layout, one in found:
        experts = one.deployment.expert_parallel
        if layout.expert_parallel == 1:
            assert experts is None and layout.devices_per_replica == layout.tensor_parallel * layout.pipeline_parallel
        else:
            assert experts.degree == layout.expert_parallel == layout.devices_per_replica
            assert layout.label.endswith(f"x ep{layout.expert_parallel}")


def test_the_scenarios_own_expert_settings_carry_over_and_what_does_not_fit_is_dropped():
    scenario = load_scenario(WIDE_EP)
    found = layouts(scenario, "H200", max_tensor_parallel=1, max_pipeline_parallel=1, max_expert_parallel=32)
    degrees = {layout.expert_parallel for layout, _ in found}
    # DeepSeek-V3 (671 GB in fp8) cannot sit on one H200, nor 144 or 72 experts of 44 MB x 58 layers per GPU.
    assert 1 not in degrees and 2 not in degrees and 4 not in degrees
    assert {16, 32} <= degrees
    for _, one in found:
        experts = one.deployment.expert_parallel
        assert experts.redundant_experts == 32 and experts.balance and experts.scale_out_bandwidth_bytes_per_s == 50e9
