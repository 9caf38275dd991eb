"""Shared helpers: scenarios built from plain dicts through the same validation as YAML files."""
from __future__ import annotations

import copy
from pathlib import Path
from llmsim.search.compare import REPLACED_WHOLE
from llmsim.config.reader import Node, deep_merge
from llmsim.scenario.scenario import scenario_from_node

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))

BASE = {
    "name": "test",
    "seed": 11,
    "model": "Llama-3.1-8B",
    "hardware": "H100-SXM",
    "engine": {"max_model_len": 16384},
    "workload": {
        "arrival": {"process": "poisson", "rate": 10.0},
        "num_requests": 1000,
        "prompt_tokens": {"distribution": "lognormal", "mean": 512, "sigma": 0.8, "max": 4096},
        "output_tokens": {"distribution": "lognormal", "mean": 128, "sigma": 0.8, "max": 1024},
    },
}


def merge(base: dict, overrides: dict) -> dict:
    return deep_merge(copy.deepcopy(base), overrides, REPLACED_WHOLE)


def make_scenario(overrides: dict | None = None, base: dict = BASE):
    data = merge(base, overrides or {})
    return scenario_from_node(Node(data, file="<test>", base_dir=REPO / "scenarios"))


