"""deployment.disaggregation: bad settings are refused with a ConfigError naming the key (the command line
exits 2 with it), and a good one reads into the pools, link and policies it names."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from llmsim.catalog.links import LINKS
from llmsim.config.policies import KVReservation
from llmsim.errors import ConfigError
from llmsim.scenario.variants import variant
from llmsim.scenario.scenario import load_scenario
from tests.helpers import BASE, REPO, merge, make_scenario, simulate_checked

SPLIT = {"prefill": {"replicas": 2, "tensor_parallel": 1}, "decode": {"replicas": 1, "tensor_parallel": 1},
         "link": "infiniband_ndr"}


def split(**changes) -> dict:
    config = merge(SPLIT, {k: v for k, v in changes.items() if v is not None})
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    return {"deployment": {"disaggregation": config}}


def test_a_good_section_reads_into_pools_link_and_policies():
    scenario = make_scenario(merge(split(streaming=True, reservation="after_transfer", aggregated_below_tokens=64),
                                   {"deployment": {"disaggregation": {"decode": {"hardware": "H200"}}}}))
    config = scenario.disaggregation
    assert (config.prefill.replicas, config.decode.replicas) == (2, 1)
    assert config.prefill.hardware.name == "H100-SXM" and config.decode.hardware.name == "H200"
    assert config.link is LINKS["infiniband_ndr"] and config.streaming
    assert config.reservation is KVReservation.AFTER_TRANSFER and config.aggregated_below_tokens == 64
    assert config.label == "2P1D" and config.lanes == 1


@pytest.mark.parametrize("overrides, key", [
    (split(link="infiniband_hdr9"), "deployment.disaggregation.link"),
    (split(link=None), "deployment.disaggregation.link"),
    (split(link=400), "deployment.disaggregation.link"),
    (merge(split(), {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4, "disaggregation": {
        "decode": {"tensor_parallel": 4}}}}), "deployment.disaggregation.prefill.tensor_parallel"),
    (merge(split(), {"model": "Llama-3.1-70B", "engine": {"max_model_len": 131072}, "deployment": {
        "tensor_parallel": 8, "disaggregation": {"prefill": {"tensor_parallel": 8},
                                                 "decode": {"tensor_parallel": 2}}}}),
     "deployment.disaggregation.decode.tensor_parallel"),
    (merge(split(), {"deployment": {"disaggregation": {"decode": {"tensor_parallel": 3}}}}),
     "deployment.disaggregation.decode.tensor_parallel"),
    (merge(split(), {"deployment": {"disaggregation": {"decode": {"hardware": "H900"}}}}),
     "deployment.disaggregation.decode.hardware"),
    (merge(split(), {"deployment": {"disaggregation": {"prefill": {"replicas": True}}}}),
     "deployment.disaggregation.prefill.replicas"),
    (merge(split(), {"deployment": {"disaggregation": {"prefill": {"chip": "H100"}}}}),
     "deployment.disaggregation.prefill.chip"),
    (split(reservation="during_transfer"), "deployment.disaggregation.reservation"),
    (split(streaming="yes"), "deployment.disaggregation.streaming"),
    (split(aggregated_below_tokens=-1), "deployment.disaggregation.aggregated_below_tokens"),
    (merge(split(), {"deployment": {"router": "shared_queue"}}), "deployment.router"),
    (merge(split(), {"engine": {"chunked_prefill": False}}), "engine.chunked_prefill"),
    (merge(split(), {"speculation": {"draft": "Llama-3.2-1B", "k": 2,
                                     "acceptance": {"process": "bernoulli", "alpha": 0.7}}}), "speculation"),
])
def test_bad_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        make_scenario(overrides)
    assert error.value.key == key


def test_the_command_line_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(merge(BASE, split(link="infiniband_hdr9"))))
    done = subprocess.run([sys.executable, "-m", "llmsim.cli.main", "run", str(path), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "deployment.disaggregation.link" in done.stderr and "infiniband_ndr" in done.stderr
    assert "Traceback" not in done.stderr


MOE = {"model": "Qwen3-30B-A3B", "hardware": "H200"}
DEEPSEEK_POOL = {"tensor_parallel": 1, "expert_parallel": {"degree": 8, "redundant_experts": 0}}


def pools(prefill: dict | None = None, decode: dict | None = None, **more) -> dict:
    return merge(split(), merge(more, {"deployment": {"disaggregation": {"prefill": prefill or {},
                                                                         "decode": decode or {}}}}))


def test_each_pool_reads_its_own_expert_parallelism_and_engine_settings():
    scenario = make_scenario(pools({"expert_parallel": {"degree": 2}, "engine": {"chunked_prefill": False}},
                                   {"expert_parallel": {"degree": 8}, "engine": {"max_num_seqs": 64,
                                                                                  "max_batch_tokens": 256}}, **MOE))
    config = scenario.disaggregation
    assert (config.prefill.expert_parallel.degree, config.decode.expert_parallel.degree) == (2, 8)
    assert (config.prefill.devices_per_replica, config.decode.devices_per_replica) == (2, 8)
    assert config.lanes == 1                      # one GPU per data-parallel rank holds a request's KV
    prefill, decode = scenario.pool("prefill"), scenario.pool("decode")
    assert not prefill.engine.chunked_prefill and prefill.engine.max_num_seqs == scenario.engine.max_num_seqs
    assert (decode.engine.max_num_seqs, decode.engine.max_batch_tokens) == (64, 256)
    assert decode.engine.chunked_prefill and decode.deployment.expert_parallel.degree == 8
    assert scenario.deployment.expert_parallel is None       # the aggregated layout keeps its own (none)


def test_a_pool_without_expert_parallel_settings_has_none_whatever_the_aggregated_layout():
    scenario = make_scenario(pools(**MOE, deployment={"expert_parallel": {"degree": 8}}))
    assert scenario.deployment.expert_parallel.degree == 8
    assert scenario.pool("decode").deployment.expert_parallel is None


def test_a_pools_memory_check_uses_its_own_expert_parallel_degree():
    """DeepSeek-V3 on H200: a pool fits exactly where the same expert-parallel group as a scenario of its own
    fits (the aggregated check is the independent reference)."""
    base = {"model": "DeepSeek-V3", "hardware": "H200", "engine": {"max_model_len": 8192},
            "deployment": DEEPSEEK_POOL}        # the aggregated layout, which must fit too

    def alone(degree: int) -> bool:
        try:
            make_scenario(merge(base, {"deployment": {"expert_parallel": {"degree": degree}}}))
        except ConfigError:
            return False
        return True

    for degree in (4, 8):
        pool = merge(DEEPSEEK_POOL, {"expert_parallel": {"degree": degree}})
        fits = alone(degree)
        try:
            make_scenario(merge(split(), merge(base, {"deployment": {"disaggregation": {
                "prefill": DEEPSEEK_POOL, "decode": pool}}})))
        except ConfigError as error:
            assert not fits and error.key == "deployment.disaggregation.decode.expert_parallel.degree"
            assert "expert-parallel group of 4" in str(error)
        else:
            assert fits
    assert not alone(4) and alone(8)


@pytest.mark.parametrize("overrides, key", [
    (pools(decode={"expert_parallel": {"degree": 3}}, **MOE),
     "deployment.disaggregation.decode.expert_parallel.degree"),
    (pools(prefill={"tensor_parallel": 2, "expert_parallel": {"degree": 1}}, **MOE),
     "deployment.disaggregation.prefill.expert_parallel.degree"),
    (pools(decode={"expert_parallel": {"degree": 8}}), "deployment.disaggregation.decode.expert_parallel.degree"),
    (pools(decode={"expert_parallel": {"degree": 16, "devices_per_node": 8}}, **MOE),
     "deployment.disaggregation.decode.expert_parallel.scale_out_bandwidth"),
    (pools(decode={"engine": {"max_num_seqs": 512, "max_batch_tokens": 256}}),
     "deployment.disaggregation.decode.engine.max_batch_tokens"),
    (pools(prefill={"engine": {"max_num_seqs": 9000}}), "deployment.disaggregation.prefill.engine.max_num_seqs"),
    (pools(decode={"engine": {"max_num_seqs": True}}), "deployment.disaggregation.decode.engine.max_num_seqs"),
    (pools(decode={"engine": {"chunked_prefill": False}}), "deployment.disaggregation.decode.engine.chunked_prefill"),
    (pools(decode={"engine": {"chunked_prefill": "yes"}}), "deployment.disaggregation.decode.engine.chunked_prefill"),
    (pools(prefill={"engine": {"block_size": 16}}), "deployment.disaggregation.prefill.engine.block_size"),
])
def test_bad_pool_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        make_scenario(overrides)
    assert error.value.key == key


def test_a_non_chunking_engine_block_serves_when_the_decode_pool_chunks():
    """The decode pool must chunk (it continues each transferred prompt's last token); the engine block, the
    aggregated layout's, need not when the decode pool says so."""
    scenario = make_scenario(pools(decode={"engine": {"chunked_prefill": True}}, engine={"chunked_prefill": False}))
    assert scenario.pool("decode").engine.chunked_prefill and not scenario.pool("prefill").engine.chunked_prefill


def test_the_shipped_wide_ep_disaggregated_scenario_reads_and_runs():
    scenario = load_scenario(REPO / "scenarios" / "deepseek-v3-h200-disagg-wide-ep.yaml")
    prefill, decode = scenario.disaggregation.prefill, scenario.disaggregation.decode
    assert (prefill.devices_per_replica, prefill.replicas, decode.devices_per_replica) == (8, 2, 32)
    assert decode.expert_parallel.experts_per_rank(scenario.model) == 9
    assert prefill.expert_parallel.experts_per_rank(scenario.model) == 32
    result = simulate_checked(variant(scenario, {"workload.num_requests": 150}))
    assert (result.requests["status"] == "finished").all()
