"""Variants set on the typed Scenario (llmsim.scenario.variants) against the reader: each equals the scenario
file with the same keys written into it and read again, a bad value names its key as the file's would, and a
Scenario changed with dataclasses.replace keeps its change."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from llmsim.config.policies import Batching
from llmsim.config.reader import Node, load_yaml
from llmsim.errors import ConfigError
from llmsim.scenario.control import ControllerConfig
from llmsim.scenario.overrides import build_point
from llmsim.scenario.scenario import CPUOffload, Scenario, load_scenario, scenario_from_node
from llmsim.scenario.variants import (COUNT_KEY, EXPERT_DEGREE_KEY, EXPERTS_KEY, RATE_KEY, REPLICAS_KEY, at_rate,
                                      typed, variant, with_replicas, with_requests)
from llmsim.scenario.writer import to_mapping

from tests.helpers import SCENARIOS, make_scenario, same


def written(path: Path, point: dict, seed: int | None = None) -> Scenario:
    """The scenario file with the point's keys written into its YAML by hand (a None value removes the key,
    so its default applies), read again. The file's ``engine.vllm_args`` are written as the engine keys they
    set (as the reader rewrites them), so that a point may set those keys. A YAML alias is a copy of its
    anchor's settings: a key written into the one is not written into the other."""
    data = json.loads(json.dumps(load_yaml(path)))
    if "vllm_args" in data.get("engine", {}):
        data["engine"] = to_mapping(load_scenario(path))["engine"]
    for key, value in point.items():
        *parents, leaf = key.split(".")
        holder = data
        for part in parents:
            holder = holder.setdefault(part, {})
        if value is None:
            holder.pop(leaf, None)
        elif isinstance(value, dict) and isinstance(holder.get(leaf), dict):
            holder[leaf] = {**holder[leaf], **value}           # a mapping is merged into the file's
        else:
            holder[leaf] = value
    if seed is not None and "seed" not in point:
        data["seed"] = seed
    return scenario_from_node(Node(data, file=str(path), base_dir=path.parent))


def points(scenario: Scenario) -> list[dict]:
    rate = scenario.workload.rate_per_s
    own = {"hardware": scenario.hardware.name}
    return [{RATE_KEY: 2.5 * rate}, {COUNT_KEY: 37, "workload.duration": None, "simulation.warmup": "3.5 s"},
            {REPLICAS_KEY: 3, "seed": 7, "simulation.horizon": "900 s"},
            {RATE_KEY: "3/s", REPLICAS_KEY: 2, COUNT_KEY: 400},
            {**own, "deployment.tensor_parallel": 2, "deployment.pipeline_parallel": 2, REPLICAS_KEY: 1},
            {**own, "deployment.tensor_parallel": 8, "deployment.pipeline_parallel": 1},
            {"engine.max_batch_tokens": 4096}, {"engine.max_batch_tokens": 262144, RATE_KEY: "2/s"},
            {"engine.max_num_seqs": 64, "engine.queue_timeout": "500 ms"}, {"engine.max_batch_tokens": 16},
            {"engine.block_size": 64}, {"engine.queue_timeout": None, "engine.max_num_seqs": 100000},
            {"engine.scheduling_policy": "priority"}, {"engine.cpu_offload": {"idle_timeout": "0.5 s"}},
            *({f"workload.classes.{name}.queue_timeout": "150 ms", "engine.scheduling_policy": "edf"}
              for name in scenario.workload.class_names[:1]),
            {"hardware": "H200"}, {"hardware": "A100-80GB", RATE_KEY: "1/s"}, {"hardware": "l40s"},
            {"hardware": "H200", "deployment.tensor_parallel": 8, "deployment.pipeline_parallel": 1},
            {"hardware": "b200", "deployment.tensor_parallel": 4, "deployment.pipeline_parallel": 1,
             EXPERT_DEGREE_KEY: 8}, {EXPERT_DEGREE_KEY: 16}, {EXPERT_DEGREE_KEY: 3}, {EXPERTS_KEY: None},
            {"hardware": "H100-SXM", "deployment.tensor_parallel": 1, "deployment.pipeline_parallel": 1,
             EXPERT_DEGREE_KEY: 8, "engine.max_batch_tokens": 4096},
            {"speculation": None}, {"speculation.eligibility": {"min_concurrent_requests": 4}},
            {"speculation": None, "speculation.draft": "ngram", "speculation.acceptance": {"process": "bernoulli",
                                                                                          "alpha": 0.6},
             "speculation.eligibility": {"min_sequence_tokens": 0, "min_concurrent_requests": 1},
             "speculation.policy": "static", "speculation.k": 3, "speculation.k_max": 5},
            {"speculation": None, "speculation.draft": "Llama-3.2-1B", "speculation.policy": "adaptive",
             "speculation.k": 2, "speculation.k_max": 6, "engine.max_batch_tokens": 4096},
            {"speculation": None, "speculation.draft": "medusa", "speculation.heads": 4, "speculation.k": 3},
            {"speculation": None, "speculation.draft": "ngram", "speculation.k": 9, "speculation.k_max": 4},
            {"speculation.policy": "static", "speculation.k": 3, "speculation.k_max": 6},
            {"speculation.policy": "goodput", "speculation.k": 2, "speculation.k_max": 5,
             "speculation.eligibility": {"min_sequence_tokens": 64, "min_concurrent_requests": 2}},
            {"speculation.policy": "adaptive", "speculation.k": 0, "speculation.k_max": 4},
            {"speculation.policy": "static", "speculation.k": 0, "speculation.k_max": 4},
            {"speculation.k": 5, "speculation.k_max": 9},
            {"deployment.disaggregation": None, REPLICAS_KEY: 2},
            {"deployment.disaggregation.prefill.replicas": 2, "deployment.disaggregation.decode.replicas": 3},
            {"deployment.disaggregation.decode.replicas": 0},
            # Keys laid over the scenario written out (llmsim.scenario.writer), and what follows from them.
            {"engine.memory_utilization": 0.8}, {"engine.max_model_len": 4096}, {"slo.ttft": "3 s"},
            {"engine.batching": "static"}, {"speculation.k": 3}, {"speculation.acceptance.alpha": 0.5},
            {"speculation.acceptance.mean": 0.5},
            {"controller.hysteresis": 0.2, "engine.max_batch_tokens": 4096},
            {"workload.arrival.period": "600 s"}, {"hardware": "H200", "engine.memory_utilization": 0.85}]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_a_typed_variant_is_the_file_with_its_keys_written(path):
    """Every shipped scenario: each point set on the Scenario, and each laid over the scenario written out
    (llmsim.scenario.writer: the route of the keys the typed scenario does not set), equals (or fails with the
    same key as) the file with those keys written into its YAML and read again."""
    scenario = load_scenario(path)
    routes = (lambda point: variant(scenario, point),
              lambda point: build_point(to_mapping(scenario), point, path.parent, str(path)))
    for point in points(scenario):
        try:
            expected, expected_key = written(path, point, scenario.seed), None
        except ConfigError as error:
            expected, expected_key = None, error.key
        for route in routes:
            try:
                got, got_key = route(point), None
            except ConfigError as error:
                got, got_key = None, error.key
            assert got_key == expected_key, point
            assert got is None or expected is not None and same(got, expected), point


def test_the_searches_points_are_set_on_the_typed_scenario():
    """What plans, sweeps and recommendations vary most is set without the YAML: a rate, a request count, a
    window, replicas, a layout on the scenario's own chip; another chip, an engine knob or auto placement is not."""
    scenario = make_scenario()
    assert typed(scenario, {RATE_KEY: 4.0, COUNT_KEY: 100, "workload.duration": None, "simulation.warmup": "2 s",
                            REPLICAS_KEY: 2, "seed": 3, "hardware": "H100-SXM", "deployment.tensor_parallel": 2,
                            "deployment.pipeline_parallel": 1})
    assert typed(scenario, {"engine.max_batch_tokens": 4096, "engine.max_num_seqs": 64, "engine.block_size": 64,
                            "engine.queue_timeout": "1 s", "engine.scheduling_policy": "fcfs"})
    assert typed(scenario, {"hardware": "H200", "deployment.tensor_parallel": 1, EXPERT_DEGREE_KEY: 8})
    for point in ({"engine.memory_utilization": 0.8}, {"deployment.tensor_parallel": "auto"},
                  {"speculation.k": 3}, {EXPERTS_KEY: {"degree": 8}}):
        assert not typed(scenario, point), point


def test_a_scenario_changed_with_replace_keeps_its_change():
    """Before, every variant was rebuilt from the YAML mapping, which does not hold a change made with
    dataclasses.replace (sweeps and plans refused such a scenario)."""
    changed = replace(make_scenario(), engine=replace(make_scenario().engine, max_num_seqs=64))
    got = variant(changed, {RATE_KEY: 4.0, COUNT_KEY: 200, REPLICAS_KEY: 2, "deployment.tensor_parallel": 2})
    expected = make_scenario({"engine": {"max_num_seqs": 64}, "workload": {"arrival": {"rate": 4.0},
                                                                           "num_requests": 200},
                              "deployment": {"replicas": 2, "tensor_parallel": 2}})
    assert same(got, expected)


def test_an_engine_knob_keeps_a_change_made_with_replace():
    """Before, an engine knob was laid over the YAML mapping, which refused a scenario changed with replace."""
    scenario = make_scenario()
    changed = replace(scenario, engine=replace(scenario.engine, max_num_seqs=64))
    assert same(variant(changed, {"engine.max_batch_tokens": 4096, "engine.queue_timeout": "2 s"}),
                make_scenario({"engine": {"max_num_seqs": 64, "max_batch_tokens": 4096, "queue_timeout": "2 s"}}))


def test_an_auto_layout_is_placed_again_for_the_engine_knobs():
    """Llama-3.1-70B placed by the reader on H100s: 1 x 2 stages at the default batch budget (70.6 GB of 16-bit
    weights and 3.2 GB of activations a stage, within 0.9 of 81,559 MiB, 77.0 GB); a 262,144-token budget's
    activations need tensor parallelism 4, as the file with that budget reads."""
    auto = {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": "auto", "pipeline_parallel": "auto"}}
    scenario = make_scenario(auto)
    assert (scenario.deployment.tensor_parallel, scenario.deployment.pipeline_parallel) == (1, 2)
    for point in ({"engine.max_batch_tokens": 262144}, {"deployment.tensor_parallel": 2},
                  {"deployment.pipeline_parallel": 2}):
        assert typed(scenario, point)
        key, value = next(iter(point.items()))
        section, leaf = key.split(".")
        expected = make_scenario({**auto, section: {**auto.get(section, {}), leaf: value}})
        assert same(variant(scenario, point), expected), point
    assert variant(scenario, {"engine.max_batch_tokens": 262144}).deployment.tensor_parallel == 4
    with pytest.raises(ConfigError) as caught:
        variant(scenario, {"engine.max_batch_tokens": 2097152})   # 2^21 tokens: 137 GB of hidden states alone
    assert caught.value.key == "deployment"


def test_a_key_laid_over_a_typed_variant_keeps_its_settings():
    """A key laid over a typed variant is laid over that variant written out, so its settings stay."""
    scenario = at_rate(with_replicas(make_scenario(), 3), 4.0)
    laid = variant(scenario, {"engine.memory_utilization": 0.8})
    assert (laid.workload.rate_per_s, laid.deployment.replicas, laid.engine.memory_utilization) == (4.0, 3, 0.8)


@pytest.mark.parametrize("vary, key", [
    (lambda s: at_rate(s, -1), RATE_KEY),
    (lambda s: at_rate(s, "fast"), RATE_KEY),
    (lambda s: at_rate(s, 1e-300), RATE_KEY),                     # 1,000 requests would take ~1e303 s to arrive
    (lambda s: with_requests(s, 0), COUNT_KEY),
    (lambda s: with_requests(s, 2.5), COUNT_KEY),
    (lambda s: with_replicas(s, True), REPLICAS_KEY),              # a bool is not a count
    (lambda s: variant(s, {"simulation.warmup": "ten"}), "simulation.warmup"),
    (lambda s: variant(s, {"seed": -1}), "seed"),
    (lambda s: variant(s, {"deployment.tensor_parallel": 3}), "deployment.tensor_parallel"),   # 32 heads
    (lambda s: variant(s, {COUNT_KEY: None, "workload.duration": None}), COUNT_KEY),           # no traffic at all
])
def test_a_bad_variant_is_a_config_error_naming_its_key(vary, key):
    with pytest.raises(ConfigError) as caught:
        vary(make_scenario())
    assert caught.value.key == key


def test_a_layout_that_does_not_fit_names_its_key():
    """Llama-3.1-70B's 141 GB of weights on one 80 GB H100: the reader's own fit check, naming tensor_parallel."""
    big = make_scenario({"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4}})
    with pytest.raises(ConfigError, match="does not fit") as caught:
        variant(big, {"hardware": "H100-SXM", "deployment.tensor_parallel": 1, "deployment.pipeline_parallel": 1})
    assert caught.value.key == "deployment.tensor_parallel"


def test_a_scenario_not_read_from_yaml_takes_any_variant():
    """Before, a key the typed scenario does not set needed the YAML mapping the scenario was read from."""
    built = replace(make_scenario(), source_dir=None)
    assert same(variant(built, {"engine.memory_utilization": 0.8}),
                make_scenario({"engine": {"memory_utilization": 0.8}}))


@pytest.mark.parametrize("change, point, overrides", [
    (lambda s: replace(s, engine=replace(s.engine, memory_utilization=0.7)), {"engine.max_model_len": 8192},
     {"engine": {"memory_utilization": 0.7, "max_model_len": 8192}}),
    (lambda s: replace(s, engine=replace(s.engine, batching=Batching.STATIC)), {"slo.ttft": "2 s"},
     {"engine": {"batching": "static"}, "slo": {"ttft": "2 s"}}),
    (lambda s: replace(s, controller=ControllerConfig(window_s=30.0, low=1024, high=8192, increase=64)),
     {"engine.memory_utilization": 0.8},
     {"engine": {"memory_utilization": 0.8}, "controller": {"bounds": [1024, 8192], "increase": 64}}),
    (lambda s: replace(s, slo=replace(s.slo, tpot_s=0.05)), {"controller": {"knob": "max_num_seqs"}},
     {"slo": {"tpot": "50 ms"}, "controller": {"knob": "max_num_seqs"}}),
])
def test_a_change_made_with_replace_is_kept_under_any_variant(change, point, overrides):
    """Before, a key laid over the YAML mapping refused (ValueError) a scenario changed with replace, whose
    change the mapping did not hold; now it is laid over the scenario written out."""
    got = variant(change(make_scenario()), point)
    assert same(got, make_scenario(overrides))


def test_an_offload_idle_timeout_is_merged_into_the_offload_settings():
    """recommend's idle timeout is a mapping merged into the scenario's offload settings: overlap stays."""
    offload = {"engine": {"prefix_caching": True, "cpu_offload": {"overlap": True}}}
    got = variant(make_scenario(offload), {"engine.cpu_offload": {"idle_timeout": "0.5 s"}})
    assert same(got, make_scenario({"engine": {"prefix_caching": True,
                                               "cpu_offload": {"overlap": True, "idle_timeout": "0.5 s"}}}))
    assert got.engine.cpu_offload == CPUOffload(idle_timeout_s=0.5, overlap=True)


def test_an_engine_knob_on_a_disaggregated_deployment_is_checked_with_the_pools_own(tmp_path):
    """The engine block's knobs are set on a disaggregated scenario's engine (its pools keep only what they set
    themselves): each variant equals the file with the knob written in and read again, a pool's own
    max_batch_tokens below the block's new max_num_seqs failing at the pool's key as the file does."""
    data = load_yaml(next(path for path in SCENARIOS if path.stem == "llama3-70b-disagg-h100"))
    data["deployment"]["disaggregation"]["decode"]["engine"] = {"max_batch_tokens": 512}
    path = tmp_path / "disagg.yaml"
    path.write_text(json.dumps(data))
    scenario = load_scenario(path)
    for point in ({"engine.max_num_seqs": 128, "engine.max_batch_tokens": 4096}, {"engine.queue_timeout": "1 s"},
                  {"engine.max_num_seqs": 1024},            # over the decode pool's own 512-token budget
                  {"engine.max_batch_tokens": 100},         # under the block's own 256 sequences
                  {"engine.block_size": 32, "engine.scheduling_policy": "priority"}):
        assert typed(scenario, point), point
        try:
            expected, expected_key = written(path, point), None
        except ConfigError as error:
            expected, expected_key = None, error.key
        try:
            got, got_key = variant(scenario, point), None
        except ConfigError as error:
            got, got_key = None, error.key
        assert got_key == expected_key, point
        assert got is None or same(got, expected), point
    with pytest.raises(ConfigError) as caught:
        variant(scenario, {"engine.max_num_seqs": 1024})
    assert caught.value.key == "deployment.disaggregation.decode.engine.max_batch_tokens"
