"""Figures and settings that make sense: utilisations within [0, 1], one meaning for --seeds,
lengths whose clipping keeps their mean, a KV cache that holds the longest request, and an
arrival rate that brings requests within the window."""
from __future__ import annotations

import pytest

from llmsim import simulate

from .helpers import make_scenario

UTILISATIONS = ("busy_fraction", "mfu", "mfu_while_busy", "bandwidth_utilisation",
                "kv_occupancy_mean", "kv_occupancy_max")

# Saturated runs (busy all the time), where iterations straddling the window's edges used to
# count in full: static batching, continuous batching, and two pipeline stages of each.
SATURATED = {
    "static": {"engine": {"batching": "static", "max_num_seqs": 32}},
    "continuous": {},
    "pipelined": {"deployment": {"tensor_parallel": 1, "pipeline_parallel": 2}},
    "pipelined-static": {"engine": {"batching": "static", "max_num_seqs": 32},
                         "deployment": {"tensor_parallel": 1, "pipeline_parallel": 2}},
}


@pytest.mark.parametrize("name", SATURATED)
def test_every_utilisation_is_a_fraction(name):
    overrides = {"workload": {"arrival": {"rate": 40.0}, "num_requests": 600}, "simulation": {"warmup": "3 s"}}
    result = simulate(make_scenario({**SATURATED[name], **overrides}))
    util = result.summary()["utilisation"]
    for key in UTILISATIONS:
        assert 0.0 <= util[key] <= 1.0, (key, util[key])
    assert util["busy_fraction"] > 0.95                  # saturated: the bound is what is tested
    assert util["mfu_while_busy"] == pytest.approx(util["mfu"] / util["busy_fraction"])
