"""Autoscaling: replicas follow the load, start only after their cold start, and the run pays
for exactly the replica time the pool held (start to end of drain)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.errors import ConfigError

from tests.helpers import BASE, make_scenario

STEP = [{"at": 0, "rate": "20/s"}, {"at": "60 s", "rate": "70/s"}, {"at": "180 s", "rate": "15/s"}]
AUTO = {"max_replicas": 3, "cold_start": "30 s", "target_outstanding": 64}


def scenario(rates, replicas=1, autoscaling=None, duration="300 s"):
    base = copy.deepcopy(BASE)
    base["workload"].pop("num_requests")
    base["workload"].update(duration=duration, arrival={"process": "steps", "rates": rates})
    base["deployment"] = {"replicas": replicas}
    base["slo"] = {"ttft": "1 s"}
    if autoscaling is not None:
        base["autoscaling"] = autoscaling
    return make_scenario(base=base)


def provisioned_seconds(log, start_replicas: int, end_s: float, from_s: float = 0.0) -> float:
    """Replica-seconds in [from_s, end_s] from the log alone: +1 at every start, -1 at every 'off'."""
    times, counts, count = [0.0], [start_replicas], start_replicas
    for time_s, action in zip(log["time_s"], log["action"]):
        count += action.count("start") - action.count("off")
        times.append(time_s)
        counts.append(count)
    times.append(end_s)
    return float(np.dot(np.diff(np.clip(times, from_s, end_s)), counts))


@pytest.mark.slow
def test_autoscaling_follows_a_load_step_and_pays_for_what_it_holds():
    one = simulate(scenario(STEP))
    auto = simulate(scenario(STEP, autoscaling=AUTO))
    log, records = auto.scaling, auto.requests
    assert (log["serving"] + log["starting"] <= 3).all() and (log["serving"] >= 1).all()
    starts = log[log["action"].str.contains("start")]
    assert len(starts) and (starts["time_s"] > 60).all()           # nothing before the step
    # A replica serves no request before its cold start has passed.
    first_start = starts["time_s"].iloc[0]
    added = records[records["replica"] > 0]
    assert len(added) and added["first_scheduled_s"].min() >= first_start + 30.0
    # Conservation of replica time: the log's starts and stops integrate to what the run reports.
    assert auto.replica_seconds == pytest.approx(provisioned_seconds(log, 1, auto.end_s), rel=1e-9)
    assert auto.end_s < auto.replica_seconds < 3 * auto.end_s
    summary, single = summarize(auto).to_dict(), summarize(one).to_dict()
    assert summary["slo"]["attainment"] > single["slo"]["attainment"] + 0.2
    scaling = summary["autoscaling"]
    assert scaling["usd"] == pytest.approx(auto.replica_seconds * 2.5 / 3600, rel=1e-2)   # H100-SXM at 2.5 USD/h
    assert scaling["scale_ups"] >= 1 and scaling["scale_downs"] >= 1
    # Utilisation is busy time over the replica time paid for in the window (from the log), not over
    # the one replica the run started with (which gave a busy fraction clipped at 100%).
    start, stop = summary["window_s"]
    its = auto.iterations
    busy_s = (np.minimum(its["end_s"], stop) - np.maximum(its["start_s"], start)).clip(lower=0).sum()
    paid_s = provisioned_seconds(log, 1, stop, start)
    assert paid_s > 1.3 * (stop - start)
    assert summary["utilisation"]["busy_fraction"] == pytest.approx(busy_s / paid_s, rel=1e-9)
    assert busy_s / (stop - start) > 1.0 > summary["utilisation"]["busy_fraction"]


def test_autoscaling_under_light_load_keeps_one_replica_and_changes_nothing():
    calm = [{"at": 0, "rate": "5/s"}]
    static = simulate(scenario(calm, duration="60 s"))
    auto = simulate(scenario(calm, autoscaling=AUTO, duration="60 s"))
    assert (auto.scaling["action"] == "").all()
    assert auto.replica_seconds == pytest.approx(auto.end_s, rel=1e-12)
    assert auto.requests.equals(static.requests)
    assert summarize(auto).to_dict()["utilisation"] == summarize(static).to_dict()["utilisation"]


@pytest.mark.parametrize("autoscaling, key", [
    ({"max_replicas": 1, "min_replicas": 2}, "autoscaling.max_replicas"),
    ({"min_replicas": 1}, "autoscaling.max_replicas"),                  # required
    ({"max_replicas": 3, "target_outstanding": 0}, "autoscaling.target_outstanding"),
    ({"max_replicas": 3, "cold_start": "-1 s"}, "autoscaling.cold_start"),
])
def test_bad_autoscaling_settings_name_the_key(autoscaling, key):
    with pytest.raises(ConfigError) as error:
        make_scenario({"autoscaling": autoscaling})
    assert error.value.key == key, str(error.value)
