"""Traffic classes and scheduling policies against queueing theory and the policies' own guarantees.

With one sequence at a time (``max_num_seqs: 1``) a replica is a single server whose service
time is a request's prefill plus its decode steps, the same whatever order requests are served
in, so the two-class priority formulas of the M/G/1 queue must hold: Cobham's mean waits for
non-preemptive priority, the preemptive-resume times in system (a preempted request is
recomputed in one prefill iteration, which on a memory-bound engine costs what the decode step
it replaces does), and the common Pollaczek-Khinchine wait under FCFS. The engine acts at
iteration boundaries, so an urgent arrival that finds a less urgent request in service waits
for the step in progress: the preemptive formula gets that residual, P(less urgent in service)
x E[step^2] / (2 E[step]), added. Tolerances are four batch-means standard errors.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from llmsim import batch_means, simulate
from llmsim.analysis.metrics import summarize
from llmsim.config.policies import SchedulingPolicy
from llmsim.errors import ConfigError
from llmsim.sim.engine import Engine
from llmsim.sim.scheduling import CLASS_ORDERS, ClassQueue, ClassQueueing
from llmsim.sim.slo import meets_slo
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, make_scenario, roofline_only

SERVICE = {"prompt_tokens": 8, "output_tokens": {"distribution": "exponential", "mean": 10, "max": 10000}}
TWO_CLASSES = {"urgent": {"share": 0.5, "priority": 0}, "relaxed": {"share": 0.5, "priority": 1}}
RATE_PER_S = 9.0        # with the mean service of about 72 ms, a load of about 0.65


def _two_class_runs(num_requests: int):
    """The same trace under FCFS, priority and preemptive priority, on one single-sequence server."""
    runs = {}
    for policy in ("fcfs", "priority", "preemptive_priority"):
        scenario = make_scenario({"engine": {"max_num_seqs": 1, "scheduling_policy": policy},
                                  "workload": {**SERVICE, "num_requests": num_requests, "classes": TWO_CLASSES,
                                               "arrival": {"rate": RATE_PER_S}}})
        runs[policy] = simulate(scenario)
    return runs


@pytest.fixture(scope="module")
def runs():
    return _two_class_runs(8000)


def _moments(runs):
    """Per class: arrival rate, E[S], E[S^2], from the FCFS run's service times (admission to last token)."""
    fcfs = runs["fcfs"].requests
    service = (fcfs["finish_s"] - fcfs["first_scheduled_s"]).to_numpy()
    out = {}
    for name in TWO_CLASSES:
        mine = (fcfs["class"] == name).to_numpy()
        out[name] = (RATE_PER_S * TWO_CLASSES[name]["share"], service[mine].mean(), np.mean(service[mine] ** 2))
    return out, service


def _check(values, expected):
    mean, se = batch_means(values)
    assert abs(mean - expected) < 4 * se, (mean, expected, se)


@pytest.mark.slow
def test_fcfs_over_two_classes_gives_the_common_mg1_wait(runs):
    moments, service = _moments(runs)
    rho = sum(lam * s for lam, s, _ in moments.values())
    assert 0.5 < rho < 0.75
    residual = sum(lam * s2 / 2 for lam, _, s2 in moments.values())
    records = runs["fcfs"].requests
    for name in TWO_CLASSES:
        _check(records.loc[records["class"] == name, "queue_wait_s"], residual / (1 - rho))


@pytest.mark.slow
def test_non_preemptive_priority_matches_cobham(runs):
    moments, _ = _moments(runs)
    (lam1, s1, _), (lam2, s2, _) = moments["urgent"], moments["relaxed"]
    rho1, rho = lam1 * s1, lam1 * s1 + lam2 * s2
    residual = sum(lam * m2 / 2 for lam, _, m2 in moments.values())
    records = runs["priority"].requests
    assert runs["priority"].preemptions == 0
    _check(records.loc[records["class"] == "urgent", "queue_wait_s"], residual / (1 - rho1))
    _check(records.loc[records["class"] == "relaxed", "queue_wait_s"], residual / ((1 - rho1) * (1 - rho)))


@pytest.mark.slow
def test_preemptive_priority_matches_preemptive_resume(runs):
    moments, _ = _moments(runs)
    (lam1, s1, m1), (lam2, s2, m2) = moments["urgent"], moments["relaxed"]
    rho1, rho2 = lam1 * s1, lam2 * s2
    result = runs["preemptive_priority"]
    assert result.preemptions > 0
    steps = runs["fcfs"].iterations["duration_s"].to_numpy()
    step_residual = np.mean(steps ** 2) / (2 * steps.mean())
    records = result.requests
    urgent = s1 + lam1 * m1 / 2 / (1 - rho1) + rho2 * step_residual
    relaxed = s2 / (1 - rho1) + (lam1 * m1 + lam2 * m2) / 2 / ((1 - rho1) * (1 - rho1 - rho2))
    _check(records.loc[records["class"] == "urgent", "e2e_s"], urgent)
    _check(records.loc[records["class"] == "relaxed", "e2e_s"], relaxed)
    # The urgent class never waits behind the relaxed one: its wait is what it would see alone.
    assert records.loc[records["class"] == "urgent", "preemptions"].sum() == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority", "edf"])
def test_conservation_and_littles_law_per_class(policy):
    result = simulate(make_scenario({"engine": {"max_num_seqs": 32, "scheduling_policy": policy},
                                     "slo": {"classes": {"urgent": {"ttft": "100 ms"}, "relaxed": {"e2e": "30 s"}}},
                                     "workload": {"num_requests": 1500, "arrival": {"rate": 12.0},
                                                  "classes": TWO_CLASSES}}))
    records = result.requests
    assert result.preemptions == 0 and (records["status"] == "finished").all()
    summary = summarize(result).to_dict()
    for name, figures in summary["classes"].items():
        mine = records[records["class"] == name]
        assert figures["arrived"] == len(mine) == figures["finished"] + figures["rejected"] + figures["unfinished"]
        # Little's law for the class's queue: time-average length = class arrival rate x mean wait.
        rate = len(mine) / result.end_s
        assert result.mean_queue_length_by_class[name] == pytest.approx(rate * mine["queue_wait_s"].mean(), rel=1e-9)
    assert sum(f["arrived"] for f in summary["classes"].values()) == summary["requests"]["arrived"]


def test_weighted_fair_sharing_gives_backlogged_classes_their_weights_share_of_tokens():
    weights = {"heavy": 3.0, "light": 1.0}
    classes = {"heavy": {"share": 0.5, "weight": weights["heavy"]},
               "light": {"share": 0.5, "weight": weights["light"],
                         "prompt_tokens": {"distribution": "lognormal", "mean": 256, "sigma": 0.5, "max": 2048}}}
    scenario = make_scenario({"engine": {"max_num_seqs": 16, "scheduling_policy": "weighted_fair"},
                              "workload": {"num_requests": 4000, "arrival": {"rate": 200.0}, "classes": classes}})
    # The roofline-priced H100: this checks the scheduler's sharing, and the window's token count (> 20 bounds)
    # was sized for that step time (the measured kernel terms make steps slower, leaving fewer tokens).
    scenario = dataclasses.replace(scenario, hardware=roofline_only(scenario.hardware))
    result = simulate(scenario)
    records = result.requests
    assert result.preemptions == 0
    # Both classes stay backlogged until the last arrival (the offered load is several times capacity).
    stop = records["arrival_s"].max()
    start = 0.2 * stop
    admitted = records[(records["first_scheduled_s"] >= start) & (records["first_scheduled_s"] <= stop)]
    work = admitted["prompt_tokens"] + admitted["output_tokens"]
    tokens = work.groupby(admitted["class"]).sum()
    total = tokens.sum()
    # Deficit round robin: each class's tokens are within 2 (largest request + quantum) of its share.
    from llmsim.sim.scheduling import DRR_QUANTUM_TOKENS
    bound = 2 * (work.max() + DRR_QUANTUM_TOKENS)
    assert total > 20 * bound
    for name, weight in weights.items():
        assert abs(tokens[name] - weight / sum(weights.values()) * total) <= bound, (tokens, total, bound)


def test_classes_draw_their_own_lengths_and_shares():
    scenario = make_scenario({"workload": {"num_requests": 4000, "classes": {
        "interactive": {"share": 0.25, "output_tokens": 16}, "batch": {"share": 0.75, "prompt_tokens": 64}}}})
    trace = generate_trace(scenario.workload, scenario.seed)
    interactive = trace.class_index == 0
    # Shares: binomial, within 4 standard errors.
    assert abs(interactive.mean() - 0.25) < 4 * np.sqrt(0.25 * 0.75 / len(trace))
    assert (trace.output_tokens[interactive] == 16).all() and (trace.prompt_tokens[~interactive] == 64).all()
    # Practice defaults: interactive is tier 0 with a 50 ms timeout, batch tier 2 with 1 s.
    interactive_class, batch_class = scenario.workload.classes
    assert (interactive_class.priority, interactive_class.queue_timeout_s) == (0, 0.05)
    assert (batch_class.priority, batch_class.queue_timeout_s) == (2, 1.0)
    # The arrival times are those of the same scenario without classes (common random numbers).
    plain = make_scenario({"workload": {"num_requests": 4000}})
    assert np.array_equal(generate_trace(plain.workload, plain.seed).arrival_s, trace.arrival_s)


def test_reject_timeout_per_class_and_reserved_slots():
    classes = {"interactive": {"share": 0.5, "queue_timeout": "20 ms", "on_timeout": "reject", "reserved_seqs": 2},
               "batch": {"share": 0.5, "queue_timeout": None}}
    scenario = make_scenario({"engine": {"max_num_seqs": 4},
                              "workload": {"num_requests": 1500, "arrival": {"rate": 60.0}, "classes": classes}})
    result = simulate(scenario)
    records = result.requests
    rejected = records[records["status"] == "rejected"]
    assert len(rejected) > 0 and (rejected["class"] == "interactive").all()
    assert np.allclose(rejected["finish_s"] - rejected["arrival_s"], 0.02)
    # The 2 reserved slots are the interactive class's alone: batch never runs more than 4 - 2 at once
    # (counted from the records at every batch admission).
    batch = records[records["class"] == "batch"].sort_values("first_scheduled_s")
    starts, ends = batch["first_scheduled_s"].to_numpy(), batch["finish_s"].to_numpy()
    running_at_start = [(starts[:i + 1] <= t).sum() - (ends[:i + 1] <= t).sum() for i, t in enumerate(starts)]
    assert max(running_at_start) <= 2


@pytest.mark.parametrize("overrides, key", [
    ({"workload": {"classes": {"a": {"share": 0.5}, "b": {"share": 0.4}}}}, "workload.classes"),
    ({"workload": {"classes": {"a": {"share": 0.5}, "b": {"share": 0.5}}}, "slo": {"classes": {"c": {"ttft": 1}}}},
     "slo.classes.c"),
    ({"engine": {"scheduling_policy": "priority"}}, "engine.scheduling_policy"),
    ({"workload": {"classes": {"a": {"share": 1.0, "on_timeout": "drop"}}}}, "workload.classes.a.on_timeout"),
    ({"engine": {"max_num_seqs": 4}, "workload": {"classes": {"a": {"share": 1.0, "reserved_seqs": 5}}}},
     "workload.classes"),
    ({"workload": {"classes": {"a": {"share": 0.5}, "b": {"arrival": {"rate": 1}}}}}, "workload.classes"),
    ({"workload": {"classes": {"a": {"share": 0.5, "arrival": {"rate": 1}}, "b": {"share": 0.5}}}},
     "workload.classes.a"),
    ({"workload": {"classes": ["interactive", "batch"]}}, "workload.classes"),
])
def test_bad_class_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        make_scenario(overrides)
    assert error.value.key == key, str(error.value)
    assert error.value.file == "<test>" and error.value.allowed


@pytest.mark.parametrize("arrival", [True, False])
def test_empty_classes_exit_2_naming_the_classes_not_the_arrival(tmp_path, capsys, arrival):
    """``classes: {}`` once read as "every class has its own arrival" (true of no classes), so the error
    named workload.arrival; with no arrival it asked for a rate. It names the classes, the value and what
    is allowed, whether or not the workload sets an arrival."""
    import yaml

    from llmsim.cli.main import main

    data = copy.deepcopy(BASE)
    data["workload"]["classes"] = {}
    if not arrival:
        data["workload"].pop("arrival")
    path = tmp_path / "empty.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path)]) == 2
    message = capsys.readouterr().err
    assert "'workload.classes'" in message and "(got {})" in message and str(path) in message
    assert "at least one entry" in message and "or leave out workload.classes" in message
    assert "workload.arrival" not in message


def test_vllm_priority_flag_selects_the_vllm_priority_policy_with_classes():
    scenario = make_scenario({"engine": {"vllm_args": "--scheduling-policy priority"},
                              "workload": {"classes": TWO_CLASSES}})
    assert scenario.engine.scheduling_policy == "vllm_priority" and scenario.vllm_notes == ()


def test_search_verdicts_require_every_class_target():
    """``plan``/``recommend`` judge a point by every traffic class's own targets: a point whose overall
    attainment passes but whose one class misses its percentile fails."""
    from llmsim.analysis import names
    from llmsim.search.window import judge

    def rows(b_attainment):
        base = {"error": ["", ""], names.STEADY: [True, True]}
        for prefix, attainment in (("", 0.99), ("classes.a.", 0.99), ("classes.b.", b_attainment)):
            base.update({prefix + names.SLO_ATTAINMENT: [attainment] * 2,
                         prefix + names.SLO_ATTAINMENT_STDERR: [0.002] * 2,
                         prefix + names.slo_attainment("ttft"): [attainment] * 2,
                         prefix + names.slo_attainment_stderr("ttft"): [0.002] * 2,
                         prefix + names.slo_percentile("ttft"): [95.0] * 2})
        return pd.DataFrame(base)

    missed = judge(rows(0.80))
    assert not missed.met and missed.decided and set(missed.margins) == {"a.ttft", "b.ttft"}
    assert judge(rows(0.98)).met
    assert not judge(rows(0.80), target=0.9).met and judge(rows(0.98), target=0.9).met


@pytest.mark.parametrize("workload, key", [
    ({"arrival": None, "classes": {"a": {"arrival": {"rate": 5}}, "b": {"arrival": {"rate": 5}}}}, "workload.classes"),
    ({"arrival": {"process": "steps", "rates": [{"at": 0, "rate": 5}]}}, "workload.arrival.process"),
    ({"arrival": {"process": "ramp", "rates": [{"at": 0, "rate": 1}, {"at": "10 s", "rate": 5}]}},
     "workload.arrival.process"),
    ({"arrival": {"process": "mmpp", "states": [{"rate": 1, "mean_duration": "5 s"},
                                               {"rate": 9, "mean_duration": "1 s"}]}}, "workload.arrival.process"),
])
def test_plans_refuse_workloads_without_one_rate(workload, key):
    from llmsim.search.plan import check_rate_driven

    base = copy.deepcopy(BASE)
    base["workload"].pop("arrival")
    base["workload"].update({k: v for k, v in workload.items() if v is not None})
    with pytest.raises(ConfigError) as error:
        check_rate_driven(make_scenario(base=base))
    assert error.value.key == key


def _replayed_classes(tmp_path, labels, classes=None):
    rows = "\n".join(f"{0.05 * i:.3f},{64 + 8 * i},{4 + i % 5},{label}" for i, label in enumerate(labels))
    path = tmp_path / "classes.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,class\n" + rows + "\n")
    base = copy.deepcopy(BASE)
    base["workload"] = {"arrival": {"process": "trace", "path": str(path)},
                        "classes": classes or {"interactive": {}, "batch": {"weight": 2}}}
    base["engine"] = {"scheduling_policy": "priority", "max_model_len": 16384}
    return make_scenario(base=base), path


def test_a_replayed_trace_carries_each_requests_class(tmp_path):
    labels = ["interactive", "batch", "batch", "interactive", "batch"] * 8
    scenario, _ = _replayed_classes(tmp_path, labels)
    result = simulate(scenario)
    assert result.requests["class"].tolist() == labels           # in arrival order, as written
    interactive, batch = scenario.workload.classes                # the practice tiers still apply
    assert interactive.priority == 0 and batch.priority == 2 and batch.weight == 2
    counts = {name: figures["arrived"] for name, figures in summarize(result).to_dict()["classes"].items()}
    assert counts == {"interactive": labels.count("interactive"), "batch": labels.count("batch")}


def test_a_trace_class_the_scenario_lacks_names_file_line_and_classes(tmp_path):
    with pytest.raises(ConfigError) as error:
        _replayed_classes(tmp_path, ["interactive", "batch", "urgent", "batch"])
    assert error.value.key == "line 4, column class" and error.value.value == "urgent"
    assert error.value.file.endswith("classes.csv") and "interactive, batch" in error.value.allowed
    with pytest.raises(ConfigError) as error:                    # a share makes no sense for replayed classes
        _replayed_classes(tmp_path, ["batch"] * 3, {"batch": {"share": 1.0}})
    assert error.value.key == "workload.classes.batch.share"


def test_each_request_is_held_to_its_own_classes_limits():
    """``meets_slo`` with traffic classes, against every record checked on its own class's SLO one by one (a
    1-token output has no TPOT and meets it); the same from the records' table as from the simulator's columns."""
    slo = {"classes": {"urgent": {"ttft": "100 ms", "tpot": "20 ms"}, "relaxed": {"e2e": "4 s"}}}
    scenario = make_scenario({"engine": {"max_num_seqs": 32, "scheduling_policy": "priority"}, "slo": slo,
                              "workload": {"num_requests": 600, "arrival": {"rate": 30.0}, "classes": TWO_CLASSES}})
    records = simulate(scenario).requests
    expected = []
    for row in records.to_dict("records"):
        met = row["status"] == "finished"
        for metric, (limit_s, _) in scenario.slo.for_class(row["class"]).targets().items():
            value = row[f"{metric}_s"]
            met = met and (value <= limit_s or (metric == "tpot" and math.isnan(value)))
        expected.append(met)
    assert 0 < sum(expected) < len(expected)           # both outcomes occur
    assert records["meets_slo"].tolist() == expected
    assert meets_slo(records, scenario.slo).tolist() == expected


def _three_classes_past_capacity(policy: str):
    """Three classes (short interactive prompts, longer standard and batch ones) past an engine's capacity under
    ``policy``: several classes wait at many admissions, and heads are forced in by their classes' timeouts."""
    classes = {"interactive": {"share": 0.3},
               "standard": {"share": 0.4, "prompt_tokens": {"distribution": "lognormal", "mean": 1024, "sigma": 0.8,
                                                            "max": 8192}},
               "batch": {"share": 0.3, "prompt_tokens": {"distribution": "lognormal", "mean": 2048, "sigma": 0.6,
                                                         "max": 8192}}}
    return make_scenario({"engine": {"max_num_seqs": 16, "max_batch_tokens": 643, "scheduling_policy": policy},
                          "workload": {"num_requests": 600, "arrival": {"rate": 7.0}, "classes": classes}})


def _queueing_with(monkeypatch, **attributes) -> None:
    """Every ClassQueueing built from now on has ``attributes`` set after its own ``__init__`` (a shortcut off)."""
    init = ClassQueueing.__init__

    def patched(queueing, *args):
        init(queueing, *args)
        for name, value in attributes.items():
            setattr(queueing, name, value)
    monkeypatch.setattr(ClassQueueing, "__init__", patched)


@pytest.mark.parametrize("policy", ["priority", "preemptive_priority", "vllm_priority"])
def test_classes_ranked_by_priority_choose_as_the_heads_keys_do(policy, monkeypatch):
    """Where the policy orders the heads by their class's priority first and the classes' priorities differ, the
    queue takes the most urgent waiting class without building the heads' keys: the run is the one the keys give
    (records and iterations bit for bit), past capacity, with several classes waiting at dozens of admissions, forced
    heads (the classes' queue timeouts) and, under preemptive priority, preemptions."""
    scenario = _three_classes_past_capacity(policy)
    ranked = simulate(scenario)
    policy_key = SchedulingPolicy(policy)
    monkeypatch.setitem(CLASS_ORDERS, policy_key, dataclasses.replace(CLASS_ORDERS[policy_key],
                                                                      by_priority_first=False))
    chosen_among = []
    choose = ClassQueue.choose

    def counted(queue, among):
        chosen_among.append(len(among))
        return choose(queue, among)
    monkeypatch.setattr(ClassQueue, "choose", counted)
    keyed = simulate(scenario)
    assert sum(n > 1 for n in chosen_among) > 40
    assert (ranked.preemptions > 0) == (policy == "preemptive_priority")
    pd.testing.assert_frame_equal(ranked.requests, keyed.requests, check_exact=True)
    pd.testing.assert_frame_equal(ranked.iterations, keyed.iterations, check_exact=True)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "weighted_fair"])
def test_admission_stops_at_a_spent_budget_as_the_fit_would(policy, monkeypatch):
    """Once the iteration's token budget is spent, admission stops at a head its class's timeout does not force
    in, without asking the engine to fit it: the run is the one that asks (records and iterations bit for bit),
    with thousands of fits skipped and forced heads still admitted past a spent budget."""
    scenario = _three_classes_past_capacity(policy)
    fits: list[tuple[int, bool, int]] = []
    fit = Engine.fit

    def counted(engine, request, now, budget, forced):
        chunk = fit(engine, request, now, budget, forced)
        fits.append((budget, forced, chunk))
        return chunk
    monkeypatch.setattr(Engine, "fit", counted)
    stopping = simulate(scenario)
    stopped_fits = len(fits)
    assert sum(budget <= 0 and forced and chunk > 0 for budget, forced, chunk in fits) >= 3
    fits.clear()
    _queueing_with(monkeypatch, _stops_when_spent=False)
    asked = simulate(scenario)
    assert sum(budget <= 0 and not forced for budget, forced, _ in fits) == len(fits) - stopped_fits > 100
    pd.testing.assert_frame_equal(stopping.requests, asked.requests, check_exact=True)
    pd.testing.assert_frame_equal(stopping.iterations, asked.iterations, check_exact=True)


@pytest.mark.parametrize("policy", ["preemptive_priority", "weighted_fair"])
def test_heads_alike_take_a_free_slot_as_each_class_asks(policy, monkeypatch):
    """Where no class reserves or dedicates slots, admission and making room ask once whether a slot is free
    instead of asking each class's head (:meth:`ClassQueueing._may_seat`): the run is the one that asks each
    (records and iterations bit for bit), with preemptions for waiting requests under preemptive priority."""
    scenario = _three_classes_past_capacity(policy)
    alike = simulate(scenario)
    asked = []
    may_seat = ClassQueueing._may_seat

    def counted(queueing, c, now):
        asked.append(c)
        return may_seat(queueing, c, now)
    monkeypatch.setattr(ClassQueueing, "_may_seat", counted)
    _queueing_with(monkeypatch, _seats_alike=False)
    each = simulate(scenario)
    assert len(asked) > 500
    assert (alike.preemptions > 0) == (policy == "preemptive_priority")
    pd.testing.assert_frame_equal(alike.requests, each.requests, check_exact=True)
    pd.testing.assert_frame_equal(alike.iterations, each.iterations, check_exact=True)
