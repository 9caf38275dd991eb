"""Canary and shadow rollouts: the split, what users see, and intervals that cover the truth.

The coverage test needs a true difference that is known without simulating for hours. With one
sequence at a time (``max_num_seqs: 1``) each replica is an M/G/1 queue (as in
test_traffic_classes.py), and the router's split thins the Poisson arrivals into Poisson streams,
so a group's steady-state mean end-to-end time under full traffic at its per-replica load is the
Pollaczek-Khinchine value E[S] + lambda E[S^2] / (2 (1 - rho)). Service times do not depend on the
queue, so their moments come from all the runs' requests pooled, which leaves the truth's own error
far below the intervals' widths. Control on H100, canary on H200 (the same engine, a faster device).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from llmsim.analysis.canary import compare_independent, compare_paired, detection_time, measured
from llmsim.analysis.metrics import summarize
from llmsim.errors import ConfigError
from llmsim.search.rollout import rollout_summary, simulate_rollout

from tests.helpers import make_scenario

SERVICE = {"prompt_tokens": 8, "output_tokens": {"distribution": "exponential", "mean": 6, "max": 1000}}
# short answers: batches turn over fast, so the latencies' correlation time is a few requests and a
# quarter of 2,400 requests fills enough batches of 20 correlation times for intervals
SHORT = {"num_requests": 2400, "arrival": {"rate": 12},
         "output_tokens": {"distribution": "lognormal", "mean": 32, "sigma": 0.8, "max": 1024}}


def _rollout(groups: dict, workload: dict | None = None, engine: dict | None = None):
    workload = workload or {"num_requests": 300, "arrival": {"rate": 12}}
    return make_scenario({"engine": engine or {}, "workload": workload,
                          "rollout": {"groups": groups}})


def _window(result):
    return result.user.warmup_s, result.user.arrival_window_s


@pytest.mark.slow
def test_canary_interval_covers_the_true_difference_95_percent_of_the_time():
    rate, fraction, seeds = 16.0, 0.5, 150
    base = make_scenario({"engine": {"max_num_seqs": 1},
                          "workload": {**SERVICE, "num_requests": 2000, "arrival": {"rate": rate}},
                          "rollout": {"groups": {"canary": {"role": "canary", "fraction": fraction,
                                                            "hardware": "H200"}}}})
    intervals, service = [], {"control": [], "canary": []}
    for seed in range(seeds):
        result = simulate_rollout(base.with_seed(seed))
        start, stop = _window(result)
        for name in service:
            records = result.records(name)
            service[name].append((records["finish_s"] - records["first_scheduled_s"]).to_numpy())
        mean, = compare_independent(measured(result.records("control"), start, stop),
                                    measured(result.records("canary"), start, stop), percentiles=(),
                                    metrics=("e2e_s",))
        intervals.append((mean.low, mean.high))

    def pollaczek_khinchine(samples, arrival_rate):
        s = np.concatenate(samples)
        rho = arrival_rate * s.mean()
        assert 0.15 < rho < 0.5
        return s.mean() + arrival_rate * np.mean(s ** 2) / (2 * (1 - rho))

    truth = (pollaczek_khinchine(service["canary"], rate * fraction)
             - pollaczek_khinchine(service["control"], rate * (1 - fraction)))
    assert truth < 0                                   # the faster device is faster
    low, high = np.array(intervals).T
    given = np.isfinite(low) & np.isfinite(high)        # a run too short for its correlation has none
    assert given.mean() >= 0.95, given.mean()
    coverage = np.mean((low[given] <= truth) & (truth <= high[given]))
    standard_error = np.sqrt(0.95 * 0.05 / given.sum())      # of a binomial share over the seeds
    assert abs(coverage - 0.95) < 3 * standard_error, (coverage, truth)


def test_the_split_serves_every_request_once_and_shadows_stay_out_of_user_figures():
    canary = {"role": "canary", "fraction": 0.3, "engine": {"max_batch_tokens": 1024}}
    shadow = {"role": "shadow", "fraction": 0.4, "engine": {"max_num_seqs": 8}}
    with_shadow = simulate_rollout(_rollout({"canary": canary, "shadow": shadow}))
    without = simulate_rollout(_rollout({"canary": canary}))
    users = with_shadow.user.requests
    assert users["id"].tolist() == list(range(300))                 # every request served once, in order
    assert set(users["group"]) == {"control", "canary"}
    served = (users["group"] == "canary").sum()
    assert abs(served - 0.3 * 300) < 4 * np.sqrt(300 * 0.3 * 0.7)     # a binomial share
    copies = with_shadow.records("shadow")
    assert abs(len(copies) - 0.4 * 300) < 4 * np.sqrt(300 * 0.4 * 0.6)
    assert set(copies["id"]) <= set(users["id"])
    # The shadow consumed its own replica and changed nothing users saw.
    assert len(with_shadow.groups["shadow"].iterations) > 0
    assert with_shadow.user.requests.equals(without.user.requests)
    assert summarize(with_shadow.user).to_dict() == summarize(without.user).to_dict()
    # The merged user-facing run counts every replica that served users.
    assert summarize(with_shadow.user).to_dict()["devices"] == 2


def test_a_shadow_identical_to_the_control_reproduces_it_request_for_request():
    result = simulate_rollout(_rollout({"mirror": {"role": "shadow", "fraction": 1.0}}, SHORT))
    control, mirror = result.records("control"), result.records("mirror")
    columns = ["id", "arrival_s", "first_token_s", "finish_s", "e2e_s"]
    assert control[columns].equals(mirror[columns])
    start, stop = _window(result)
    differences = compare_paired(measured(control, start, stop), measured(mirror, start, stop))
    assert all(d.has_interval for d in differences if d.statistic == "mean")
    for d in differences:          # a P99 of 300 requests has no interval (too few beyond it), and no difference
        assert d.difference == 0 and not d.significant
        assert not d.has_interval or (d.low == 0 and d.high == 0)


def test_detection_time_gives_the_power_it_promises():
    """On independent normal samples, a canary run for the time asked detects the change in ~80% of trials."""
    rng = np.random.default_rng(5)
    fraction, rate, sd, mean, change = 0.2, 100.0, 0.3, 1.0, 0.05

    def frame(values):
        return pd.DataFrame({"arrival_s": np.arange(len(values), dtype=float), "status": "finished", "e2e_s": values,
                             "ttft_s": values, "tpot_s": values, "meets_slo": True})

    pilot_c, pilot_t = frame(rng.normal(mean, sd, 4000)), frame(rng.normal(mean, sd, 1000))
    need = next(t for t in detection_time(pilot_c, pilot_t, fraction, rate, change) if t.metric == "e2e_s")
    z = 1.959964 + 0.841621
    exact = z ** 2 * (sd ** 2 + sd ** 2 * fraction / (1 - fraction)) / (change * mean) ** 2
    assert need.requests == pytest.approx(exact, rel=0.15)          # a variance estimated from 1,000 samples
    assert need.seconds == pytest.approx(need.requests / (fraction * rate))
    n_t = int(exact)
    n_c = int(n_t * (1 - fraction) / fraction)
    trials = 150
    detected = 0
    for _ in range(trials):
        control, canary = frame(rng.normal(mean, sd, n_c)), frame(rng.normal(mean * (1 + change), sd, n_t))
        d, = compare_independent(control, canary, percentiles=(), metrics=("e2e_s",))
        detected += d.significant
    power_se = np.sqrt(0.8 * 0.2 / trials)
    assert abs(detected / trials - 0.8) < 3 * power_se + 0.03      # 0.03: 20 batch means' t against z


def test_rollout_summary_reports_each_group_against_the_control():
    result = simulate_rollout(_rollout({"canary": {"role": "canary", "fraction": 0.25, "hardware": "H200"},
                                        "shadow": {"role": "shadow", "fraction": 0.25}},
                                       SHORT))
    summary = rollout_summary(result)
    groups = summary["groups"]
    assert list(groups) == ["control", "canary", "shadow"]
    assert groups["control"]["fraction"] == 0.75
    rows = {(d["metric"], d["statistic"]): d for d in groups["canary"]["comparison"]}
    tpot = rows[("tpot_s", "mean")]
    assert tpot["difference"] < 0 and tpot["significant"]        # H200's bandwidth: faster decode steps
    assert {t["metric"] for t in groups["canary"]["detection"]} >= {"ttft_s", "tpot_s", "e2e_s"}
    assert groups["shadow"]["comparison"][0]["test"].startswith("paired t on batch mean differences")
    assert groups["canary"]["verdict"].startswith("verdict: canary is better than the control")


@pytest.mark.parametrize("rollout, key", [
    ({"groups": {"a": {"role": "canary", "fraction": 0.6}, "b": {"role": "canary", "fraction": 0.4}}},
     "rollout.groups"),
    ({"groups": {"a": {"role": "blue", "fraction": 0.1}}}, "rollout.groups.a.role"),
    ({"groups": {"a": {"role": "canary", "fraction": 1.5}}}, "rollout.groups.a.fraction"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1, "engine": {"max_batch_tokens": -4}}}},
     "rollout.groups.a.engine.max_batch_tokens"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1, "engine": {"max_batch_token": 4096}}}},
     "rollout.groups.a.engine.max_batch_token"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1, "hardware": "H900"}}}, "rollout.groups.a.hardware"),
    ({"groups": {"control": {"role": "canary", "fraction": 0.1}}}, "rollout.groups.control"),
    ({"groups": []}, "rollout.groups"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1}}, "replications": True}, "rollout.replications"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1}}, "replications": 0}, "rollout.replications"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1}}, "replications": 2.5}, "rollout.replications"),
    ({"groups": {"a": {"role": "canary", "fraction": 0.1}}, "replications": "5"}, "rollout.replications"),
])
def test_bad_rollouts_name_the_key(rollout, key):
    with pytest.raises(ConfigError) as error:
        make_scenario({"rollout": rollout})
    assert error.value.key == key and error.value.file == "<test>"
    assert error.value.allowed


def test_rollout_with_autoscaling_is_refused():
    with pytest.raises(ConfigError) as error:
        make_scenario({"rollout": {"groups": {"a": {"role": "canary", "fraction": 0.1}}},
                       "autoscaling": {"max_replicas": 2}})
    assert error.value.key == "rollout"


def test_llmsim_run_prints_and_writes_the_rollout(tmp_path, capsys):
    import yaml

    from llmsim.cli.main import main
    from tests.helpers import BASE, merge

    document = merge(BASE, {"workload": {"num_requests": 300, "arrival": {"rate": 12}},
                            "rollout": {"groups": {"canary": {"role": "canary", "fraction": 0.3, "hardware": "H200"},
                                                   "shadow": {"role": "shadow", "fraction": 0.3}}}})
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--detect", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "canary - control (independent samples" in printed and "shadow - control (paired" in printed
    assert "detect a 10% change in mean e2e_s" in printed
    assert printed.rstrip().splitlines()[-1].startswith("verdict: ")          # the printout ends in the verdict
    users, shadow = pd.read_csv(out / "requests.csv"), pd.read_csv(out / "shadow.csv")
    assert len(users) == 300 and set(users["group"]) == {"control", "canary"} and set(shadow["group"]) == {"shadow"}
    table = pd.read_csv(out / "rollout.csv")
    assert set(table["group"]) == {"canary", "shadow"}


def test_llmsim_run_compares_across_replications_and_says_so(tmp_path, capsys):
    """``rollout.replications: 3``: every comparison row is a paired t across the 3 runs (a shadow identical
    to the control and copying every request differs by exactly 0 in each run), the printout names the
    method and ends in the verdict; the figures and files are the first run's, the scenario's own seed."""
    import yaml

    from llmsim.cli.main import main
    from tests.helpers import BASE, merge

    groups = {"mirror": {"role": "shadow", "fraction": 1.0}}
    document = merge(BASE, {"workload": {"num_requests": 300, "arrival": {"rate": 12}},
                            "rollout": {"replications": 3, "groups": groups}})
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Student t across 3 independent replications" in printed
    assert printed.rstrip().splitlines()[-1].startswith("verdict: no significant difference between mirror")
    mirror = pd.read_csv(out / "rollout.csv")
    assert set(mirror["test"]) == {"paired t across 3 replications (df 2)"}
    assert (mirror["difference"] == 0).all() and (mirror["low"] == 0).all() and (mirror["high"] == 0).all()
    single = simulate_rollout(make_scenario({"workload": {"num_requests": 300, "arrival": {"rate": 12}},
                                             "rollout": {"groups": groups}}))
    assert len(pd.read_csv(out / "requests.csv")) == len(single.user.requests) == 300
