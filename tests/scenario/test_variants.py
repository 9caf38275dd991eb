"""Variants set on the typed Scenario (llmsim.scenario.variants) against the reader: each equals the scenario
file with the same keys written into it and read again, a bad value names its key as the file's would, and a
Scenario changed with dataclasses.replace keeps its change."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from llmsim.config.reader import Node, load_yaml
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario, load_scenario, scenario_from_node
from llmsim.scenario.variants import (COUNT_KEY, RATE_KEY, REPLICAS_KEY, at_rate, typed, variant, with_replicas,
                                      with_requests)

from tests.helpers import SCENARIOS, make_scenario


def written(path: Path, point: dict, seed: int | None = None) -> Scenario:
    """The scenario file with the point's keys written into its YAML by hand (a None value removes the key,
    so its default applies), read again."""
    data = load_yaml(path)
    for key, value in point.items():
        *parents, leaf = key.split(".")
        holder = data
        for part in parents:
            holder = holder.setdefault(part, {})
        if value is None:
            holder.pop(leaf, None)
        else:
            holder[leaf] = value
    if seed is not None and "seed" not in point:
        data["seed"] = seed
    return scenario_from_node(Node(data, file=str(path), base_dir=path.parent))


def same(a: Scenario, b: Scenario) -> bool:
    """Equal scenarios (a replayed trace's arrays compared by value; where it came from left out)."""
    ta, tb = a.workload.trace, b.workload.trace
    if (ta is None) != (tb is None):
        return False
    if ta is not None and tb is not None and not all(
            np.array_equal(getattr(ta, name), getattr(tb, name)) for name in ("arrival_s", "prompt_tokens",
                                                                              "output_tokens")):
        return False
    return replace(a, path=None, workload=replace(a.workload, trace=None)) == \
        replace(b, path=None, workload=replace(b.workload, trace=None))


def points(scenario: Scenario) -> list[dict]:
    rate = scenario.workload.rate_per_s
    own = {"hardware": scenario.hardware.name}
    return [{RATE_KEY: 2.5 * rate}, {COUNT_KEY: 37, "workload.duration": None, "simulation.warmup": "3.5 s"},
            {REPLICAS_KEY: 3, "seed": 7, "simulation.horizon": "900 s"},
            {RATE_KEY: "3/s", REPLICAS_KEY: 2, COUNT_KEY: 400},
            {**own, "deployment.tensor_parallel": 2, "deployment.pipeline_parallel": 2, REPLICAS_KEY: 1},
            {**own, "deployment.tensor_parallel": 8, "deployment.pipeline_parallel": 1}]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_a_typed_variant_is_the_file_with_its_keys_written(path):
    """Every shipped scenario: each point set on the Scenario equals (or fails with the same key as) the file
    with those keys written into its YAML and read again."""
    scenario = load_scenario(path)
    for point in points(scenario):
        try:
            expected, expected_key = written(path, point, scenario.seed), None
        except ConfigError as error:
            expected, expected_key = None, error.key
        try:
            got, got_key = variant(scenario, point), None
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
    for point in ({"hardware": "H200"}, {"engine.max_batch_tokens": 4096}, {"deployment.tensor_parallel": "auto"},
                  {"speculation": None}):
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


def test_a_key_the_reader_resolves_is_refused_on_a_changed_scenario():
    """Keys laid over the YAML mapping (another engine knob here) would lose a change made with replace:
    a ValueError, not a silent revert; on an unchanged scenario they are read as the file would be."""
    scenario = make_scenario()
    changed = replace(scenario, engine=replace(scenario.engine, max_num_seqs=64))
    with pytest.raises(ValueError, match="differs from the YAML mapping"):
        variant(changed, {"engine.max_batch_tokens": 4096})
    assert variant(scenario, {"engine.max_batch_tokens": 4096}) == make_scenario(
        {"engine": {"max_batch_tokens": 4096}})


def test_the_yaml_mapping_follows_a_typed_variant():
    """A typed variant's mapping carries its settings, so a key laid over it later keeps them."""
    scenario = at_rate(with_replicas(make_scenario(), 3), 4.0)
    laid = variant(scenario, {"engine.max_batch_tokens": 4096})
    assert (laid.workload.rate_per_s, laid.deployment.replicas, laid.engine.max_batch_tokens) == (4.0, 3, 4096)


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


def test_a_scenario_not_read_from_yaml_takes_typed_variants_only():
    built = replace(make_scenario(), source=None)
    assert at_rate(built, 4.0).workload.rate_per_s == 4.0
    with pytest.raises(ValueError, match="not read from YAML"):
        variant(built, {"engine.max_batch_tokens": 4096})
