"""deployment.expert_parallel: what a wide-EP scenario amounts to, and the settings refused with exit 2 naming
the key (a degree that does not divide the experts, a layout that does not fit, ...)."""
from __future__ import annotations

import pytest
import yaml

from llmsim.cli.main import main
from llmsim.errors import ConfigError
from llmsim.scenario.deployment import ResolvedDeployment
from llmsim.scenario.scenario import load_scenario

from tests.helpers import REPO, make_scenario, simulate_checked

SHIPPED = REPO / "scenarios" / "deepseek-v3-h200-wide-ep.yaml"
QWEN = {"model": "Qwen3-30B-A3B", "hardware": "H200",
        "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 20.0}}}


def ep(settings: dict, tp: int = 1, **more) -> dict:
    return {**QWEN, "deployment": {"tensor_parallel": tp, "pipeline_parallel": 1, "expert_parallel": settings},
            **more}


def refused(overrides: dict) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        make_scenario(overrides)
    return caught.value


def test_a_replica_is_an_expert_parallel_group_of_data_parallel_ranks():
    scenario = make_scenario(ep({"degree": 8}, tp=2, deployment={"replicas": 3, "tensor_parallel": 2,
                                                                  "pipeline_parallel": 1,
                                                                  "expert_parallel": {"degree": 8}}))
    dep = scenario.deployment
    assert dep.data_parallel == 4 and dep.devices_per_replica == 8
    resolved = ResolvedDeployment.of(scenario)
    assert resolved.replicas == 12                    # 3 groups x 4 ranks, each with its own queue and KV cache
    assert resolved.cost.num_devices == 2


def test_a_wide_ep_run_finishes_every_request_with_the_invariants_held():
    scenario = make_scenario(ep({"degree": 8, "routing": {"distribution": "zipf", "exponent": 1.0}}))
    result = simulate_checked(scenario)
    records = result.requests
    assert len(records) == 200 and (records["status"] == "finished").all()
    assert set(records["replica"]) == set(range(8))   # the eight data-parallel ranks each served requests


def test_the_shipped_deepseek_scenario_runs(tmp_path):
    assert main(["run", str(SHIPPED), "--out", str(tmp_path / "o")]) == 0
    scenario = load_scenario(SHIPPED)
    assert scenario.deployment.devices_per_replica == 32
    assert scenario.deployment.expert_parallel.experts_per_rank(scenario.model) == 9


@pytest.mark.parametrize("settings, tp, key, words", [
    ({"degree": 24}, 1, "deployment.expert_parallel.degree", "do not split evenly"),
    ({"degree": 6}, 2, "deployment.expert_parallel.degree", "do not split evenly"),
    ({"degree": 4}, 8, "deployment.expert_parallel.degree", "multiple of tensor_parallel"),
    ({"degree": 8, "redundant_experts": 8}, 1, "deployment.expert_parallel.redundant_experts", "balance"),
    ({"degree": 16}, 1, "deployment.expert_parallel.scale_out_bandwidth", "spans nodes"),
    ({"degree": 8, "routing": {"distribution": "zipf"}}, 1, "deployment.expert_parallel.routing.exponent", "missing"),
    ({"degree": 8, "routing": {"distribution": "pareto"}}, 1, "deployment.expert_parallel.routing.distribution",
     "unknown"),
    ({"degree": True}, 1, "deployment.expert_parallel.degree", "integer"),
])
def test_bad_settings_are_refused_naming_the_key(settings, tp, key, words):
    error = refused(ep(settings, tp))
    assert error.key == key and words in str(error)


def test_a_dense_model_has_no_experts_to_spread():
    error = refused({**ep({"degree": 2}), "model": "Llama-3.1-8B"})
    assert error.key == "deployment.expert_parallel.degree" and "no routed experts" in str(error)


def test_a_profile_without_a_measured_all_to_all_is_refused():
    error = refused({**ep({"degree": 2}), "hardware": "MI300X"})
    assert error.key == "deployment.expert_parallel.degree" and "all-to-all" in str(error)


def test_a_layout_that_does_not_fit_names_the_degree():
    """DeepSeek-V3 at EP 8 on H100s: 32 fp8 experts of 58 layers per GPU (82 GB) and the rest (19 GB) exceed 80 GB."""
    error = refused({"model": "DeepSeek-V3", "hardware": "H100-SXM", "engine": {"max_model_len": 4096},
                     "deployment": {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": {"degree": 8}}})
    assert error.key == "deployment.expert_parallel.degree" and "does not fit" in str(error)


def test_a_histogram_counts_every_expert(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("tokens\n" + "\n".join(str(10 + i) for i in range(128)) + "\n")
    scenario = make_scenario(ep({"degree": 8, "routing": {"distribution": "histogram", "path": str(good)}}))
    assert scenario.deployment.expert_parallel.routing.counts[5] == 15.0
    short = tmp_path / "short.csv"
    short.write_text("tokens\n1\n2\n")
    error = refused(ep({"degree": 8, "routing": {"distribution": "histogram", "path": str(short)}}))
    assert error.key == "deployment.expert_parallel.routing.path" and "128" in str(error)
    negative = tmp_path / "negative.csv"
    negative.write_text("tokens\n" + "\n".join(["-1"] + ["1"] * 127) + "\n")
    error = refused(ep({"degree": 8, "routing": {"distribution": "histogram", "path": str(negative)}}))
    assert error.key == "deployment.expert_parallel.routing.path" and "data row 1" in str(error)


def test_the_cli_exits_2_naming_the_key(tmp_path, capsys):
    document = yaml.safe_load(SHIPPED.read_text())
    document["deployment"]["expert_parallel"]["degree"] = 40
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    assert main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "deployment.expert_parallel.degree" in capsys.readouterr().err


def test_place_shows_an_expert_parallel_group_and_refuses_what_does_not_fit(capsys):
    assert main(["place", "DeepSeek-V3", "H200", "--ep", "32", "--redundant-experts", "32"]) == 0
    assert "9 experts per GPU" in capsys.readouterr().out
    assert main(["place", "DeepSeek-V3", "H100-SXM", "--ep", "8"]) == 2
    assert "'--ep'" in capsys.readouterr().err
    assert main(["place", "DeepSeek-V3", "H200", "--ep", "24"]) == 2
    assert "do not split evenly" in capsys.readouterr().err


def test_a_profile_without_kernel_terms_is_refused_even_at_degree_one():
    error = refused({**ep({"degree": 1}), "hardware": "CS-3"})
    assert error.key == "deployment.expert_parallel.degree" and "kernel terms" in str(error)
