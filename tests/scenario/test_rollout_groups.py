"""Rollout groups' scenarios come from the typed scenario: each equals the scenario a file with the group's
settings reads to, and a scenario changed with dataclasses.replace passes its change on to its groups."""
from dataclasses import replace

import pytest
import yaml

from llmsim.catalog.hardware import lookup_hardware
from llmsim.config.reader import deep_merge
from llmsim.errors import ConfigError
from llmsim.scenario.rollout_groups import group_scenarios
from llmsim.scenario.scenario import Scenario, load_scenario
from tests.helpers import BASE, REPO, merge

CANARY = REPO / "scenarios" / "llama3-8b-h100-canary.yaml"
GROUPS = [
    {"canary": {"role": "canary", "fraction": 0.3, "hardware": "H200"}, "shadow": {"role": "shadow", "fraction": 0.3}},
    {"a": {"role": "canary", "fraction": 0.2, "engine": {"chunked_prefill": False, "memory_utilization": 0.8}}},
    {"a": {"role": "canary", "fraction": 0.2, "engine": {"max_num_batched_tokens": 4096}}},       # a vLLM name
    {"a": {"role": "canary", "fraction": 0.2, "replicas": 2, "engine": {"scheduling_policy": "fcfs",
                                                                        "max_num_seqs": 64}}},
]


def _written(tmp_path, document: dict) -> Scenario:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(document))
    return load_scenario(path)


def _as_files(tmp_path, document: dict) -> list[Scenario]:
    """Each group as its own scenario file: the document without its rollout, with the group's chip, replicas
    and engine keys written in."""
    out = []
    for name, group in document["rollout"]["groups"].items():
        own = {key: value for key, value in document.items() if key != "rollout"}
        if "hardware" in group:
            own["hardware"] = group["hardware"]
        own = deep_merge(own, {"deployment": {"replicas": group.get("replicas", 1)}, "engine": group.get("engine", {})})
        out.append((name, _written(tmp_path, own)))
    return out


def _documents():
    yield yaml.safe_load(CANARY.read_text())
    for groups in GROUPS:
        for layout in (1, "auto"):
            yield merge(BASE, {"rollout": {"groups": groups}, "deployment": {"tensor_parallel": layout}})


def test_each_group_is_the_scenario_its_settings_written_in_a_file_read_to(tmp_path):
    for document in _documents():
        scenario = _written(tmp_path, document)
        built = group_scenarios(scenario)
        assert len(built) == len(document["rollout"]["groups"])
        for group, (name, expected) in zip(built, _as_files(tmp_path, document)):
            assert group == replace(expected, name=f"{scenario.name} [{name}]", seed=scenario.seed,
                                    path=scenario.path)


def test_a_replaced_scenario_passes_its_change_to_its_groups():
    """The groups were built once, when the file was read: a scenario changed since kept the file's groups."""
    scenario = load_scenario(CANARY)
    changed = replace(scenario, engine=replace(scenario.engine, max_num_seqs=64, max_batch_tokens=6144),
                      hardware=lookup_hardware("H200"))
    canary, shadow = group_scenarios(changed)
    assert (canary.engine.max_num_seqs, canary.engine.max_batch_tokens) == (64, 4096)   # the canary's own tokens
    assert (shadow.engine.max_num_seqs, shadow.engine.max_batch_tokens) == (128, 6144)  # the shadow's own seqs
    assert canary.hardware.name == shadow.hardware.name == "H200"
    assert (canary.deployment.replicas, shadow.deployment.replicas) == (1, 1)


def test_a_group_error_names_its_key_under_the_group(tmp_path):
    document = merge(BASE, {"rollout": {"groups": {"a": {"role": "canary", "fraction": 0.1,
                                                          "engine": {"max_num_seqs": 64, "max_batch_tokens": 32}}}}})
    with pytest.raises(ConfigError) as error:
        _written(tmp_path, document)
    assert error.value.key.startswith("rollout.groups.a.engine") and error.value.file.endswith(".yaml")
    assert "rollout group 'a'" in error.value.message and error.value.allowed
