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
from tests.helpers import BASE, merge, make_scenario

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
