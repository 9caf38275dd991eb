"""The report's sensitivity changes (lengths scaled, acceptance moved) are made on the typed scenario: each equals
the scenario read from its file with the change written into the YAML, and a scenario changed with
dataclasses.replace is changed from its own settings, not from those of the file it was read from."""
import math
from dataclasses import replace

import pytest
import yaml

from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.report.build import scaled_lengths, shifted_acceptance
from llmsim.scenario.scenario import Scenario, load_scenario, scenario_from_node
from llmsim.speculation.config import Acceptance
from llmsim.workload.lengths import Lognormal
from tests.helpers import REPO, SCENARIOS, merge

SPECULATIVE = REPO / "scenarios" / "llama3-70b-h100-speculative.yaml"
CHAT = REPO / "scenarios" / "llama3-8b-h100-chat.yaml"
FACTORS = (0.8, 1.2)


def _scaled_yaml(raw, factor: float):
    """A length's YAML with its stated mean times ``factor`` (None: nothing written to scale)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return max(1, round(raw * factor))
    if not isinstance(raw, dict) or raw.get("distribution") == "empirical":
        return None
    if raw.get("distribution") in ("lognormal", "exponential"):
        return {**raw, "mean": raw["mean"] * factor}
    if raw.get("distribution") == "uniform":
        return {**raw, "low": max(1, round(raw["low"] * factor)), "high": max(1, round(raw["high"] * factor))}
    return {**raw, "value": max(1, round(raw["value"] * factor))}           # fixed


def _read(document: dict, path) -> Scenario:
    """``document`` read as the scenario file at ``path`` (its relative paths from that file's folder)."""
    return scenario_from_node(Node(document, file=str(path)))


def _outcome(build, *args):
    try:
        return build(*args)
    except ConfigError as error:
        return error.message


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    return replace(a, path=None, name="") == replace(b, path=None, name="")


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scaled_lengths_equal_the_file_with_the_mean_scaled(path):
    document = yaml.safe_load(path.read_text())
    scenario = load_scenario(path)
    for key in ("prompt_tokens", "output_tokens"):
        for factor in FACTORS:
            written = _scaled_yaml(document["workload"].get(key), factor)
            typed = _outcome(scaled_lengths, scenario, key, factor)
            if written is None:
                assert typed is None, (key, factor)
                continue
            expected = _outcome(_read, merge(document, {"workload": {key: written}}), path)
            assert _same(typed, expected), (key, factor)


@pytest.mark.parametrize("acceptance, shifted", [
    ({"process": "beta", "mean": 0.7, "concentration": 10}, None),      # the shipped scenario's own
    ({}, {"alpha": 0.7}),                                                # the default: bernoulli at 0.7
    ({"process": "bernoulli", "alpha": 0.6}, {"alpha": 0.6}),
    ({"process": "bernoulli", "alpha": 0.95}, {"alpha": 0.95}),         # clipped at 0.99
    ({"process": "positional", "alpha": 0.8, "decay": 0.85}, {"alpha": 0.8}),
    ({"process": "beta", "a": 3, "b": 2}, None),
    ({"process": "predicted"}, "none"),
])
@pytest.mark.parametrize("step", [-0.1, 0.1])
def test_shifted_acceptance_equals_the_file_with_the_acceptance_moved(acceptance, shifted, step):
    document = yaml.safe_load(SPECULATIVE.read_text())
    document["speculation"]["acceptance"] = acceptance
    scenario = _read(document, SPECULATIVE)
    typed = shifted_acceptance(scenario, step)
    if shifted == "none":
        assert typed is None
        return

    def clip(v: float) -> float:
        return min(max(v, 0.01), 0.99)

    if shifted is not None:
        moved = {**acceptance, "alpha": clip(shifted["alpha"] + step)}
    elif "a" in acceptance:
        total = acceptance["a"] + acceptance["b"]
        mean = clip(acceptance["a"] / total + step)
        moved = {**acceptance, "a": mean * total, "b": (1 - mean) * total}
    else:
        moved = {**acceptance, "mean": clip(acceptance["mean"] + step)}
    document["speculation"]["acceptance"] = moved
    assert _same(typed, _read(document, SPECULATIVE))


def test_a_replaced_scenario_is_changed_from_its_own_lengths_and_acceptance():
    """The report scaled and moved what the file said: a scenario changed since kept the file's lengths."""
    scenario = load_scenario(SPECULATIVE)
    prompt = Lognormal(unclipped_mean=300.0, sigma=0.5, maximum=4096)
    changed = replace(scenario, workload=replace(scenario.workload, prompt_tokens=prompt))
    scaled = scaled_lengths(changed, "prompt_tokens", 1.2)
    assert scaled is not None and scaled.workload.prompt_tokens == replace(prompt, unclipped_mean=360.0)
    assert scaled.workload.output_tokens == scenario.workload.output_tokens
    spec = scenario.speculation
    assert spec is not None
    moved = replace(scenario, speculation=replace(spec, acceptance=Acceptance(alpha=0.5)))
    shifted = shifted_acceptance(moved, 0.1)
    assert shifted is not None and shifted.speculation is not None
    assert math.isclose(shifted.speculation.acceptance.alpha, 0.6) and shifted.speculation.acceptance.measured
    assert shifted.speculation.policy == spec.policy                  # nothing else of the section moves


def test_a_scaled_length_whose_mean_clipping_moves_is_refused_as_the_reader_refuses_it():
    scenario = load_scenario(CHAT)
    prompt = Lognormal(unclipped_mean=1000.0, sigma=1.0, maximum=1100)
    with pytest.raises(ConfigError, match="more than the 10% allowed") as error:
        scaled_lengths(replace(scenario, workload=replace(scenario.workload, prompt_tokens=prompt)), "prompt_tokens",
                       1.2)
    assert error.value.key == "workload.prompt_tokens"
