"""Fixtures of the speculative-decoding tests: Leviathan's fixed-cost device (every step costs its per-layer
overhead, so a target of 100 layers and a draft of d layers have the cost ratio c = d / 100)."""
from __future__ import annotations

import pytest

FIXED_COST_PROFILE = """
name: fixed-cost
description: "a test device whose every step costs its per-layer overhead (Leviathan's fixed-cost model)"
peak_flops:
  bf16: {value: 1e12 PFLOP/s, source: "test: practically infinite", confidence: assumption}
memory_capacity: {value: 80 GB, source: "test", confidence: assumption}
memory_bandwidth: {value: 1e12 TB/s, source: "test: practically infinite", confidence: assumption}
interconnect_bandwidth: {value: 1e12 TB/s, source: "test", confidence: assumption}
interconnect_latency: {value: 0 us, source: "test", confidence: assumption}
tdp: {value: 100 W, source: "test", confidence: assumption}
price_per_hour_usd: {value: 1.0, source: "test", confidence: assumption}
efficiency:
  compute: {value: 1.0, source: "test", confidence: assumption}
  attention: {value: 1.0, source: "test", confidence: assumption}
  memory_bandwidth: {value: 1.0, source: "test", confidence: assumption}
  interconnect: {value: 1.0, source: "test", confidence: assumption}
overhead:
  per_step: {value: 0 ms, source: "test", confidence: assumption}
  per_layer: {value: 1 ms, source: "test", confidence: assumption}
"""


@pytest.fixture(scope="session")
def fixed_cost(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "fixed-cost.yaml"
    path.write_text(FIXED_COST_PROFILE)
    return str(path)
