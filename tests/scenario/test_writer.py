"""The scenario writer (llmsim.scenario.writer) against the reader: a Scenario written out, saved as YAML and
read again is the same Scenario, for every shipped scenario, for scenarios built with each section the reader
knows, and for generated ones; what it cannot name a file for is refused."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario, load_scenario, scenario_from_node
from llmsim.scenario.writer import to_mapping

from tests.fuzz import SMALL, mutated_scenarios, valid_variants
from tests.helpers import BASE, REPO, SCENARIOS, make_scenario, merge, same

TRACES = REPO / "scenarios" / "traces"


def read_back(scenario: Scenario, folder: Path) -> Scenario:
    """``scenario`` written out, saved with yaml.safe_dump, loaded and read as a file in ``folder``."""
    text = yaml.safe_dump(to_mapping(scenario), sort_keys=False)
    return scenario_from_node(Node(yaml.safe_load(text), file=str(folder / "written.yaml"), base_dir=folder))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_a_shipped_scenario_reads_back_equal(path, tmp_path):
    scenario = load_scenario(path)
    assert same(read_back(scenario, tmp_path), scenario)


def pruned(data: dict) -> dict:
    """``data`` without its None values (a key an override drops)."""
    return {key: pruned(value) if isinstance(value, dict) else value for key, value in data.items()
            if value is not None}


def scenario_of(overrides: dict) -> Scenario:
    return make_scenario({}, pruned(merge(BASE, overrides)))


def write_files(tmp_path: Path) -> None:
    """The files :func:`built`'s scenarios read."""
    (tmp_path / "lengths.csv").write_text("prompt_tokens,accepted\n" + "".join(
        f"{100 + 37 * i},{i % 7}\n" for i in range(40)))
    (tmp_path / "routing.csv").write_text("tokens\n" + "".join(f"{10 + i}\n" for i in range(256)))
    (tmp_path / "data.json").write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": "x" * (40 + i)},
                                         {"from": "gpt", "value": "y" * (8 + i)}]} for i in range(20)]))


def built(tmp_path: Path) -> dict[str, dict]:
    """Scenario overrides of tests.helpers.BASE, together using every section and alternative the reader has
    (the files they name in ``tmp_path``: :func:`write_files`)."""
    lengths = str(tmp_path / "lengths.csv")
    classes = {"interactive": {"share": 0.3, "priority": 1, "weight": 2.0, "reserved_seqs": 8},
               "batch": {"share": 0.6, "queue_timeout": "3 s", "on_timeout": "reject", "dedicated_seqs": 2,
                         "prompt_tokens": {"distribution": "uniform", "low": 100, "high": 900}},
               "custom": {"share": 0.1, "output_tokens": 50}}
    return {
        "gamma and lengths": {"workload": {"arrival": {"process": "gamma", "rate": "3/s", "cv": 2.5},
                                           "prompt_tokens": {"distribution": "exponential", "mean": 300, "min": 4},
                                           "output_tokens": {"distribution": "fixed", "value": 64, "max": 512}}},
        "empirical length": {"workload": {"prompt_tokens": {"distribution": "empirical", "path": lengths},
                                          "output_tokens": 80}},
        "deterministic": {"workload": {"arrival": {"process": "deterministic"}}},
        "steps": {"workload": {"arrival": {"process": "steps", "rate": None, "rates": [
            {"at": 0, "rate": 2}, {"at": "30 s", "rate": 8}]}, "duration": "60 s", "num_requests": None}},
        "ramp": {"workload": {"arrival": {"process": "ramp", "rate": None,
                                          "rates": [{"at": 0, "rate": 1}, {"at": 20, "rate": 5}]}}},
        "mmpp": {"workload": {"arrival": {"process": "mmpp", "rate": None,
                                          "states": [{"rate": 1, "mean_duration": "20 s"},
                                                     {"rate": 9, "mean_duration": "5 s"}]}}},
        "diurnal, peak given": {"workload": {"arrival": {"process": "diurnal", "rate": 4, "period": "1 h",
                                                         "peak": "30 min", "amplitude": 0.3}}},
        "classes and their slos": {
            "engine": {"scheduling_policy": "weighted_fair", "max_num_seqs": 64},
            "workload": {"classes": classes},
            "slo": {"ttft": "1 s", "tpot": "50 ms", "percentile": {"ttft": 99},
                    "classes": {"interactive": {"ttft": "1 s", "percentile": 90},
                                "batch": {"e2e": "60 s"}}}},
        "classes with arrivals": {"workload": {"arrival": None, "classes": {
            "a": {"arrival": {"process": "poisson", "rate": 2}, "prompt_tokens": 100, "output_tokens": 10},
            "b": {"arrival": {"process": "diurnal", "rate": 1, "period": "10 min"}, "prompt_tokens": 50,
                  "output_tokens": 20}}, "prompt_tokens": None, "output_tokens": None}},
        "sessions": {"engine": {"prefix_caching": True, "cpu_offload": {"idle_timeout": "1 s", "overlap": True},
                                "router": None},
                     "deployment": {"router": "prefix_aware", "load_bound": 1.5},
                     "workload": {"sessions": {"turns": {"distribution": "uniform", "low": 1, "high": 6},
                                               "think_time": "20 s", "start": "stationary",
                                               "system_prompt": {"tokens": 400, "share": 0.5, "variants": 3}}}},
        "dataset": {"workload": {"dataset": {"path": str(tmp_path / "data.json"), "chars_per_token": 3.5},
                                 "prompt_tokens": None, "output_tokens": None}},
        "replayed trace": {"workload": {
            "arrival": {"process": "trace", "path": str(TRACES / "synthetic-burst.csv"), "sample": 0.5,
                        "window": {"start": "1 s"}, "rate": "4/s"},
            "prompt_tokens": None, "output_tokens": None, "num_requests": None}},
        "engine knobs": {"engine": {"batching": "continuous", "max_num_seqs": 32, "max_batch_tokens": 2048,
                                    "chunked_prefill": False, "block_size": 64, "memory_utilization": 0.8,
                                    "runtime_reserve": "3 GiB", "queue_timeout": "400 ms", "on_timeout": "reject",
                                    "admission": "guaranteed_no_evict", "preemption_mode": "swap",
                                    "async_scheduling": True},
                         "simulation": {"warmup": "5 s", "horizon": "1 h"}},
        "static batching": {"engine": {"batching": "static", "chunked_prefill": False}},
        "auto layout": {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": "auto",
                                                                 "pipeline_parallel": "auto"}},
        "inline model": {"model": {"base": "Llama-3.1-8B", "weight_dtype": "fp8", "name": "Llama-3.1-8B-FP8"}},
        "draft model, predicted": {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4},
                                   "speculation": {"draft": "Llama-3.2-1B", "k": 3, "policy": "adaptive",
                                                   "window": 5, "acceptance": {"process": "predicted",
                                                                               "workload": "code",
                                                                               "distilled": True}}},
        "separate draft, beta": {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4},
                                 "speculation": {"draft": "Llama-3.2-1B", "placement": "separate",
                                                 "draft_devices": 1, "policy": "goodput", "k_max": 6,
                                                 "acceptance": {"process": "beta", "a": 3, "b": 1.5}}},
        "n-gram, replayed acceptance": {"speculation": {"draft": "ngram", "k": 3, "k_max": 5,
                                                        "ngram_cpu_per_sequence": "20 us",
                                                        "eligibility": {"min_sequence_tokens": 0},
                                                        "acceptance": {"process": "replay", "path": lengths,
                                                                       "measured_k": 6}}},
        "batch expansion scorer": {"speculation": {"draft": "ngram", "k": 2, "scorer": "batch_expansion"}},
        "medusa, positional": {"speculation": {"draft": "medusa", "heads": 3, "k": 2,
                                               "acceptance": {"process": "positional", "alpha": 0.8}}},
        "eagle tree, controller of k": {"speculation": {"draft": "eagle", "tree_branching": 2, "k": 4},
                                        "controller": {"knob": "speculation_k", "rule": "aimd"}},
        "controller": {"controller": {"knob": "max_num_seqs", "rule": "pid", "interval": "2 s", "kp": 1.0}},
        "plan": {"plan": {"hardware": ["H200", "A100-80GB"]}},
        "autoscaling": {"deployment": {"replicas": 2},
                        "autoscaling": {"max_replicas": 5, "target_outstanding": 16, "cold_start": "30 s"}},
        "rollout": {"rollout": {"groups": {"canary": {"role": "canary", "fraction": 0.1,
                                                      "engine": {"max_batch_tokens": 4096}},
                                           "shadow": {"role": "shadow", "fraction": 0.2, "hardware": "H200"}},
                                "replications": 2}},
        "expert parallel": {"model": "DeepSeek-V3", "hardware": "H200", "engine": {"max_model_len": 4096},
                            "deployment": {"tensor_parallel": 1, "expert_parallel": {
                                "degree": 16, "redundant_experts": 16, "balance": True,
                                "scale_out_bandwidth": "50 GB/s",
                                "routing": {"distribution": "histogram", "path": str(tmp_path / "routing.csv")}}},
                            "workload": {"prompt_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.8,
                                                           "max": 2048}, "output_tokens": 100}},
        "disaggregated": {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4, "disaggregation": {
            "prefill": {"replicas": 2, "tensor_parallel": 4, "engine": {"max_batch_tokens": 16384}},
            "decode": {"hardware": "H200", "tensor_parallel": 2, "engine": {"max_num_seqs": 128}},
            "link": "roce_400g", "streaming": True, "aggregated_below_tokens": 64}}},
    }


@pytest.mark.parametrize("name", list(built(Path("."))))
def test_every_section_reads_back_equal(name, tmp_path):
    write_files(tmp_path)
    scenario = scenario_of(built(tmp_path)[name])
    assert same(read_back(scenario, tmp_path), scenario)


def test_the_written_scenario_is_readable_yaml():
    """Quantities in base units, policies by name, a shipped chip and model by name, defaults left out."""
    written = to_mapping(make_scenario({"engine": {"queue_timeout": "400 ms", "batching": "static"}}))
    assert written["model"] == "Llama-3.1-8B" and written["hardware"] == "H100-SXM"
    assert written["engine"] == {"batching": "static", "max_model_len": 16384, "queue_timeout": 0.4}
    assert written["deployment"] == {"replicas": 1, "tensor_parallel": 1, "pipeline_parallel": 1}
    assert written["workload"]["prompt_tokens"] == {"distribution": "lognormal", "max": 4096, "mean": 512,
                                                    "sigma": 0.8}


def test_a_default_that_follows_another_setting_is_left_to_follow():
    """Left out in the file, a length's max follows engine.max_model_len, and k_max follows k: written out,
    they are left out again, so a key laid over the written scenario moves them as it would the file's."""
    scenario = make_scenario({"workload": {"prompt_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.8}},
                              "speculation": {"draft": "ngram", "k": 3}})
    written = to_mapping(scenario)
    assert "max" not in written["workload"]["prompt_tokens"] and "k_max" not in written["speculation"]
    given = to_mapping(make_scenario({"speculation": {"draft": "ngram", "k": 3, "k_max": 8}}))
    assert given["speculation"]["k_max"] == 8


def test_a_chip_read_from_a_file_is_written_by_its_path(tmp_path):
    profile = tmp_path / "my-chip.yaml"
    document = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm.yaml").read_text())
    document["name"] = "My-Chip"
    profile.write_text(yaml.safe_dump(document))
    scenario = make_scenario({"hardware": str(profile)})
    assert to_mapping(scenario)["hardware"] == str(profile.resolve())
    assert same(read_back(scenario, tmp_path), scenario)


def test_what_names_no_file_is_refused(tmp_path):
    scenario = make_scenario()
    chip = replace(scenario.hardware, memory_capacity_bytes=1e11, path=None)
    with pytest.raises(ValueError, match="hardware profile H100-SXM"):
        to_mapping(replace(scenario, hardware=chip))
    write_files(tmp_path)
    replayed = scenario_of(built(tmp_path)["replayed trace"])
    with pytest.raises(ValueError, match="replayed trace"):
        to_mapping(replace(replayed, workload=replace(replayed.workload, trace_file=None)))


# The sections that name no file, to lay over generated scenarios.
NOWHERE = Path("/nonexistent")
SECTIONS = [overrides for overrides in built(NOWHERE).values() if str(NOWHERE) not in json.dumps(overrides)]


@st.composite
def generated_scenarios(draw) -> dict:
    """tests.fuzz.SMALL with valid changes and one section laid over it, or with hostile values."""
    if draw(st.booleans()):
        return draw(mutated_scenarios())
    data = json.loads(json.dumps(SMALL))
    for change in draw(st.lists(valid_variants, max_size=3)):
        data = merge(data, change)
    return pruned(merge(data, draw(st.sampled_from(SECTIONS))))


def _property(data: dict, folder: Path) -> None:
    try:
        scenario = scenario_from_node(Node(data, file=str(folder / "generated.yaml"), base_dir=folder))
    except (ConfigError, ValueError, OverflowError):
        return                                      # not a scenario: nothing to write
    assert same(read_back(scenario, folder), scenario)


@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=generated_scenarios())
def test_a_generated_scenario_reads_back_equal(data, tmp_path):
    _property(data, tmp_path)


@pytest.mark.slow
@settings(max_examples=2000, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=generated_scenarios())
def test_a_generated_scenario_reads_back_equal_on_2000_inputs(data, tmp_path):
    _property(data, tmp_path)
