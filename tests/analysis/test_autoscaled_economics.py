"""An autoscaled run's cost, energy and throughput per device come from the replica-seconds it paid
for, integrated here from its own scaling log (+1 at every start, -1 at every switch-off), not from
the one replica it started with."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.cli.render import format_summary
from llmsim.scenario.scenario import load_scenario
from tests.helpers import REPO

SCENARIO = REPO / "scenarios" / "llama3-8b-h100-autoscaling.yaml"


def paid_replica_seconds(log, start_replicas: int, from_s: float, to_s: float) -> float:
    """Replica-seconds paid in [from_s, to_s], from the autoscaler's actions alone."""
    times, counts, count = [0.0], [start_replicas], start_replicas
    for time_s, action in zip(log["time_s"], log["action"]):
        count += action.count("start") - action.count("off")
        times.append(time_s)
        counts.append(count)
    times.append(np.inf)
    return float(np.dot(np.diff(np.clip(times, from_s, to_s)), counts))


@pytest.fixture(scope="module")
def run():
    result = simulate(load_scenario(SCENARIO))
    return result, summarize(result).to_dict()


def test_cost_energy_and_per_device_throughput_follow_the_replica_seconds(run):
    result, summary = run
    scenario = result.scenario
    start, stop = summary["window_s"]
    paid_s = paid_replica_seconds(result.scaling, scenario.deployment.replicas, start, stop)
    assert paid_s > 1.3 * (stop - start)              # the pool grew: the scenario tests what it should
    its = result.iterations
    tokens = float(its.loc[(its["end_s"] > start) & (its["end_s"] <= stop), "tokens_out"].sum())
    devices = scenario.devices_per_replica
    hw = scenario.hardware
    eco = summary["economics"]
    assert eco["usd_per_million_output_tokens"] == pytest.approx(
        paid_s * devices * hw.price_per_hour_usd / 3600 / tokens * 1e6, rel=1e-9)
    assert eco["kwh_per_million_output_tokens_at_tdp"] == pytest.approx(
        paid_s * devices * hw.tdp_w / 3.6e6 / tokens * 1e6, rel=1e-9)
    assert eco["usd_per_hour"] == pytest.approx(paid_s / (stop - start) * devices * hw.price_per_hour_usd, rel=1e-9)
    assert summary["throughput"]["output_tokens_per_s_per_device"] == pytest.approx(tokens / paid_s / devices,
                                                                                   rel=1e-9)


def test_the_whole_run_is_priced_by_its_replica_seconds(run):
    result, summary = run
    scenario = result.scenario
    paid_s = paid_replica_seconds(result.scaling, scenario.deployment.replicas, 0.0, result.end_s)
    scaling = summary["autoscaling"]
    assert scaling["replica_seconds"] == pytest.approx(paid_s, rel=1e-9)
    tokens = float(result.requests["generated_tokens"].sum())
    usd = paid_s * scenario.devices_per_replica * scenario.hardware.price_per_hour_usd / 3600
    assert scaling["usd"] == pytest.approx(usd, rel=1e-9)
    assert scaling["usd_per_million_output_tokens"] == pytest.approx(usd / tokens * 1e6, rel=1e-9)


def test_the_printout_names_the_pool_not_the_replica_it_started_with(run):
    result, summary = run
    text = " ".join(format_summary(summary).split())
    start, stop = summary["window_s"]
    mean = paid_replica_seconds(result.scaling, 1, start, stop) / (stop - start)
    assert f"on 1-3 replicas of 1 x H100-SXM (mean {mean:.2f} paid for)" in text
    assert "on 1 x H100-SXM" not in text
    scaling = summary["autoscaling"]
    assert (f"autoscale 1-3 replicas of 1 x H100-SXM: {scaling['scale_ups']} started, {scaling['scale_downs']} drained"
            in text)
