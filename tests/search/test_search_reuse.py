"""Runs a search reuses instead of simulating: each reused row must equal the row an independent
simulation of that point gives (the simulator is deterministic in its scenario and seed)."""
from __future__ import annotations

import math

import pandas as pd

import llmsim.search.sweeps as sweeps
from llmsim.scenario.variants import variant
from llmsim.search.sweeps import reusing_runs, run_points
from tests.helpers import REPO, make_scenario

def _counting(monkeypatch) -> list:
    """Every simulation the sweep runs in this process (workers=1), counted."""
    ran = []
    real = sweeps.simulate_whole

    def counted(scenario, *args, **kwargs):
        ran.append(scenario.engine.queue_timeout_s)
        return real(scenario, *args, **kwargs)
    monkeypatch.setattr(sweeps, "simulate_whole", counted)
    return ran


CONTROLLER = {"rule": "practice", "knob": "max_batch_tokens", "interval": "5 s", "window": "10 s",
              "bounds": [1024, 8192]}


def _scenario(rate: float, controller: bool = False):
    return make_scenario({"workload": {"arrival": {"rate": rate}, "num_requests": 400},
                          "slo": {"ttft": "500 ms", "tpot": "50 ms"},
                          **({"controller": CONTROLLER} if controller else {})})


def test_runs_differing_in_a_timeout_never_reached_are_simulated_once(monkeypatch):
    # At a light load requests wait only for the iteration in progress (tens of ms): the rejecting timeouts above
    # the longest wait of the run without one are that run; those at or below it are simulated.
    timeouts_s = [0.05, 0.2, 1.0, 2.0]
    points = [{"engine.queue_timeout": None}] + [{"engine.queue_timeout": f"{t * 1000:g} ms"} for t in timeouts_s]
    scenario = variant(_scenario(5.0), {"engine.on_timeout": "reject"})
    from llmsim.sim.simulate import simulate_whole
    (longest,) = sweeps.longest_waits_s(simulate_whole(scenario))
    assert 0.05 < longest < 0.2                # both cases are exercised
    alone = run_points(scenario, points, workers=1)
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None] + [t for t in timeouts_s if t <= longest]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_dispatching_timeout_shares_the_run_where_it_could_not_have_changed_an_admission(monkeypatch):
    # Chunked prefill with 1,024 batch tokens at 30/s: a head is at times refused or cut to the budget's rest,
    # and the longest wait of such a head (dispatch_wait_s) lies below the longest wait for admission. A
    # dispatching timeout above it forces nothing the run without one did not do: each such run, simulated on
    # its own, has that run's records. One at or below it is simulated.
    from llmsim.sim.simulate import simulate_whole
    scenario = make_scenario({"engine": {"max_batch_tokens": 1024}, "workload": {"arrival": {"rate": 30.0},
                              "num_requests": 400}, "slo": {"ttft": "500 ms", "tpot": "50 ms"}})
    untimed = simulate_whole(scenario)
    (longest,) = sweeps.longest_waits_s(untimed)
    timeouts_s = [0.05, 0.1, 0.2]
    assert timeouts_s[0] <= untimed.dispatch_wait_s < timeouts_s[1] < longest < timeouts_s[2]
    for timeout_s in timeouts_s[1:]:
        own = simulate_whole(variant(scenario, {"engine.queue_timeout": f"{timeout_s * 1000:g} ms"}))
        pd.testing.assert_frame_equal(own.requests, untimed.requests)
        pd.testing.assert_frame_equal(own.iterations, untimed.iterations)
    points = [{"engine.queue_timeout": None}] + [{"engine.queue_timeout": f"{t * 1000:g} ms"} for t in timeouts_s]
    alone = run_points(scenario, points, workers=1)
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None, 0.05]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_run_whose_timeout_forced_only_admissions_it_would_make_anyway_serves_the_others(monkeypatch):
    # At a light load with 8,192 batch tokens a head is never refused nor cut: the 20 ms run forces heads that
    # waited longer (its longest wait is above 20 ms), each as the run without a timeout admits it, so it is
    # that run (simulated on its own: the same records) and serves it and the 50 ms one.
    from llmsim.sim.simulate import simulate_whole
    scenario = _scenario(5.0)
    forcing = simulate_whole(variant(scenario, {"engine.queue_timeout": "20 ms"}))
    untimed = simulate_whole(scenario)
    assert sweeps.longest_waits_s(forcing)[0] > 0.02 > forcing.dispatch_wait_s
    pd.testing.assert_frame_equal(forcing.requests, untimed.requests)
    first = [{"engine.queue_timeout": "20 ms"}]
    then = [{"engine.queue_timeout": None}, {"engine.queue_timeout": "50 ms"}]
    alone = run_points(scenario, then, workers=1)
    ran = _counting(monkeypatch)
    with reusing_runs():
        run_points(scenario, first, workers=1)
        shared = run_points(scenario, then, workers=1)
    assert ran == [0.02]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_timeout_that_acts_is_simulated(monkeypatch):
    # Overloaded (each request brings ~0.1 s of work at 60/s): waits pass 1 ms, so the 1 ms timeout acts and
    # its run differs (requests rejected or dispatched early); each run's row is that of its own simulation.
    points = [{"engine.queue_timeout": None}, {"engine.queue_timeout": "1 ms", "engine.on_timeout": "reject"}]
    scenario = _scenario(400.0)
    alone = run_points(scenario, points, workers=1)
    assert alone["requests.rejected_timeout"].iloc[1] > 0          # the timeout did act
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None, 0.001]
    pd.testing.assert_frame_equal(shared, alone)


def test_longest_wait_bounds_every_wait():
    from llmsim.sim.simulate import simulate_whole
    result = simulate_whole(_scenario(400.0))
    requests = result.requests
    waits = (requests["first_scheduled_s"] - requests["arrival_s"]).dropna()
    (longest,) = sweeps.longest_waits_s(result)
    assert math.isfinite(longest) and longest >= waits.max() > 0


def _classes(controller: bool = False):
    # Both classes wait past their own timeouts at this load (tens of ms behind long prefills), so every
    # run below has a timeout that acts: only a rule per class can share such runs.
    overrides = {"engine": {"scheduling_policy": "priority"},
                 "workload": {"arrival": {"rate": 14.0}, "num_requests": 400,
                              "classes": {"interactive": {"share": 0.5},
                                          "batch": {"share": 0.5, "queue_timeout": "20 ms"}}},
                 "slo": {"ttft": "500 ms", "tpot": "50 ms"}}
    if controller:
        overrides["controller"] = CONTROLLER
    return make_scenario(overrides)


def _class_waits_s(result) -> dict[str, float]:
    """Each class's longest wait for a first admission, from the records (none of these runs preempts)."""
    requests = result.requests
    assert (requests["preemptions"] == 0).all()
    waits = requests["first_scheduled_s"] - requests["arrival_s"]
    return waits.groupby(requests["class"]).max().to_dict()


def test_a_class_timeout_never_reached_shares_the_run_while_another_class_timeout_acts(monkeypatch):
    # The interactive class's timeout varies, the batch class's (20 ms) acts in every run. The longest runs
    # first; a shorter one above every interactive wait of that run is that run, the others are simulated.
    from llmsim.sim.simulate import simulate_whole
    timeouts_s = [2.0, 1.0, 0.2, 0.05, 0.01]
    points = [{"workload.classes.interactive.queue_timeout": f"{t * 1000:g} ms"} for t in timeouts_s]
    scenario = _classes()
    waits = _class_waits_s(simulate_whole(sweeps.scenario_at(scenario, points[0])))
    assert waits["batch"] > 0.02 and 0.01 < waits["interactive"] < 0.2     # both cases are exercised
    alone = run_points(scenario, points, workers=1)
    ran = []
    real = sweeps.simulate_whole

    def counted(one, *args, **kwargs):
        ran.append(sweeps.timeout_rules(one)[0][0])       # the interactive class's timeout
        return real(one, *args, **kwargs)
    monkeypatch.setattr(sweeps, "simulate_whole", counted)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [2.0] + [t for t in timeouts_s if t <= waits["interactive"]]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_controller_without_classes_shares_runs_its_engine_timeout_never_reached(monkeypatch):
    # Without classes the controller moves only its knob, never the engine's queue timeout.
    points = [{"engine.queue_timeout": None}, {"engine.queue_timeout": "30 s"}]
    scenario = _scenario(5.0, controller=True)
    alone = run_points(scenario, points, workers=1)
    ran = _counting(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [None]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_controller_with_classes_simulates_every_timeout(monkeypatch):
    # The practice rule scales the classes' timeouts as the run goes: a wait below the timeout set says
    # nothing of the timeouts in force, so no run is shared.
    points = [{"workload.classes.interactive.queue_timeout": f"{t * 1000:g} ms"} for t in (2.0, 1.0)]
    scenario = _classes(controller=True)
    ran = _counting(monkeypatch)
    with reusing_runs():
        run_points(scenario, points, workers=1)
    assert len(ran) == 2


def _speculating(rule: tuple[int, int]) -> dict:
    return {"speculation.eligibility": {"min_sequence_tokens": rule[0], "min_concurrent_requests": rule[1]}}


def _counting_rules(monkeypatch) -> list:
    """The eligibility rule of every simulation the sweep runs in this process (workers=1)."""
    ran = []
    real = sweeps.simulate_whole

    def counted(scenario, *args, **kwargs):
        ran.append(sweeps.eligibility_rule(scenario))
        return real(scenario, *args, **kwargs)
    monkeypatch.setattr(sweeps, "simulate_whole", counted)
    return ran


def _speculating_scenario():
    return make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "static", "k": 3,
                                          "acceptance": {"process": "beta", "mean": 0.7, "concentration": 10}},
                          "workload": {"num_requests": 300}, "slo": {"ttft": "500 ms", "tpot": "50 ms"}})


def test_eligibility_thresholds_that_never_acted_share_the_run_with_looser_ones(monkeypatch):
    # Prompts are at least a few tokens long, so min_sequence_tokens 2 never keeps a step plain, and
    # min_concurrent_requests 1 never does: (0, 1) is the run of (2, 1). min_concurrent_requests 4 keeps the first
    # request's lone steps plain (it acts) while min_sequence_tokens 2 still never does: (0, 4) is the run of (2, 4),
    # but (2, 1) is not (its concurrency threshold is looser than one that acted). min_sequence_tokens 10^6 keeps
    # every step plain: no looser rule's run is its own.
    from llmsim.sim.simulate import simulate_whole
    scenario = _speculating_scenario()
    rules = [(2, 1), (2, 4), (0, 1), (0, 4), (1_000_000, 1)]
    held = {rule: sweeps.eligibility_held(simulate_whole(variant(scenario, _speculating(rule)))) for rule in rules}
    assert held[(2, 1)] == (2, 1, False, False) and held[(2, 4)] == (2, 4, False, True)    # every case exercised
    assert held[(1_000_000, 1)] == (1_000_000, 1, True, False)
    points = [_speculating(rule) for rule in rules]
    alone = run_points(scenario, points, workers=1)
    assert alone["speculation.blocked_share.min_sequence_tokens"].iloc[4] == 1.0      # the strict rule did act
    ran = _counting_rules(monkeypatch)
    with reusing_runs():
        # as a search asks: one setting's runs first, then its eligibility options
        shared = pd.concat([run_points(scenario, points[:2], workers=1), run_points(scenario, points[2:], workers=1)])
    # each call's strictest rule of a run first
    assert ran == [(2, 4), (2, 1), (1_000_000, 1)]
    def plain(frame: pd.DataFrame) -> pd.DataFrame:        # two frames concatenated spell a missing text apart
        return frame.reset_index(drop=True).astype(object).where(frame.reset_index(drop=True).notna(), None)
    pd.testing.assert_frame_equal(plain(shared), plain(alone))


def test_the_strictest_eligibility_rule_of_a_sweep_runs_first(monkeypatch):
    # Of one sweep's points that differ only in their eligibility rule, the strictest runs first: (2, 1), which never
    # acts, then serves for (0, 1) in the same call.
    scenario = _speculating_scenario()
    points = [_speculating((0, 1)), _speculating((2, 1))]
    alone = run_points(scenario, points, workers=1)
    ran = _counting_rules(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [(2, 1)]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_run_whose_eligibility_rule_acted_serves_for_no_other_rule(monkeypatch):
    # The first request decodes alone at first: min_concurrent_requests 2 acts, so (0, 1), which would let those
    # steps speculate, is simulated (and its rows differ).
    scenario = _speculating_scenario()
    points = [_speculating((0, 2)), _speculating((0, 1))]
    alone = run_points(scenario, points, workers=1)
    assert alone["speculation.blocked_share.min_concurrent_requests"].iloc[0] > 0
    ran = _counting_rules(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    assert ran == [(0, 2), (0, 1)]
    pd.testing.assert_frame_equal(shared, alone)


def _two_classes(slo: dict, rate: float = 14.0, seqs: int = 8) -> object:
    # Overloaded for 8 sequence slots: both classes' heads wait at once (so the policy decides who goes first);
    # under priority interactive waits under 1 s and batch about 20 s, far below the deadlines' gap.
    return make_scenario({"engine": {"scheduling_policy": "priority", "max_num_seqs": seqs},
                          "workload": {"arrival": {"rate": rate}, "num_requests": 400,
                                       "classes": {"interactive": {"share": 0.5, "priority": 0},
                                                   "batch": {"share": 0.5, "priority": 1}}},
                          "slo": {"classes": slo}})


def _counting_policies(monkeypatch) -> list:
    ran = []
    real = sweeps.simulate_whole

    def counted(one, *args, **kwargs):
        ran.append(one.engine.scheduling_policy.value)
        return real(one, *args, **kwargs)
    monkeypatch.setattr(sweeps, "simulate_whole", counted)
    return ran


def _shared_runs(monkeypatch, scenario, points) -> tuple[list, pd.DataFrame]:
    """The policies simulated, in order, and the rows of ``points`` run with runs shared."""
    ran = _counting_policies(monkeypatch)
    with reusing_runs():
        shared = run_points(scenario, points, workers=1)
    return ran, shared


def _metrics(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.drop(columns=["engine.scheduling_policy", "point_id"]).reset_index(drop=True)


def test_keyed_policies_that_order_the_classes_alike_share_a_run_without_preemptions(monkeypatch):
    # Interactive is the more urgent class under priority and vLLM's priority, and has the earlier deadline by
    # far more than batch ever waits, so EDF orders the heads alike: one run serves all three. FCFS orders by
    # arrival and is simulated.
    from llmsim.sim.simulate import simulate_whole
    scenario = _two_classes({"interactive": {"ttft": "300 ms"}, "batch": {"e2e": "120 s"}})
    policies = ["priority", "vllm_priority", "edf", "fcfs"]
    points = [{"engine.scheduling_policy": p} for p in policies]
    alone = run_points(scenario, points, workers=1)
    assert (alone["requests.preemptions"] == 0).all()
    # independent simulations: the three keyed policies that order alike gave the same run, FCFS another
    for i in (1, 2):
        pd.testing.assert_frame_equal(_metrics(alone.iloc[[i]]), _metrics(alone.iloc[[0]]))
    assert not _metrics(alone.iloc[[3]]).equals(_metrics(alone.iloc[[0]]))
    waits = sweeps.longest_waits_s(simulate_whole(sweeps.scenario_at(scenario, points[0])))
    assert 0.3 + waits[1] < 120 and waits[1] > 1          # the deadlines' gap, and batch waits long
    ran, shared = _shared_runs(monkeypatch, scenario, points)
    assert ran == ["priority", "fcfs"]
    pd.testing.assert_frame_equal(shared, alone)


def test_edf_with_deadlines_against_the_priorities_is_simulated(monkeypatch):
    # The urgent class's deadline is the later one: EDF puts batch's heads first, priority interactive's.
    scenario = _two_classes({"interactive": {"e2e": "120 s"}, "batch": {"ttft": "300 ms"}})
    points = [{"engine.scheduling_policy": p} for p in ("priority", "edf")]
    alone = run_points(scenario, points, workers=1)
    assert not _metrics(alone.iloc[[1]]).equals(_metrics(alone.iloc[[0]]))      # they do differ
    ran, shared = _shared_runs(monkeypatch, scenario, points)
    assert ran == ["priority", "edf"]
    pd.testing.assert_frame_equal(shared, alone)


def test_a_preemptive_run_that_preempted_nothing_serves_for_priority(monkeypatch):
    # With 128 slots at 3/s no interactive request lacks one, nothing is preempted, and the preemptive run
    # (simulated first of equal timeouts) is the priority run. With 8 slots at 14/s interactive requests
    # preempt batch ones, and priority is simulated.
    slo = {"interactive": {"ttft": "300 ms"}, "batch": {"e2e": "120 s"}}
    points = [{"engine.scheduling_policy": p} for p in ("priority", "preemptive_priority")]
    for rate, seqs, simulated in ((3.0, 128, ["preemptive_priority"]),
                                  (14.0, 8, ["preemptive_priority", "priority"])):
        scenario = _two_classes(slo, rate, seqs)
        alone = run_points(scenario, points, workers=1)
        preempted = alone["requests.preemptions"].iloc[1] > 0
        assert preempted == (rate > 10)
        assert _metrics(alone.iloc[[1]]).equals(_metrics(alone.iloc[[0]])) != preempted
        ran, shared = _shared_runs(monkeypatch, scenario, points)
        monkeypatch.undo()
        assert ran == simulated
        pd.testing.assert_frame_equal(shared, alone)


def test_a_run_its_stop_rule_never_stopped_serves_as_the_whole_run(monkeypatch):
    """A run simulated under a stop rule that did not stop it is the whole run (the watch only reads the run): the
    point asked for again with no rule, or under another, gets it without a simulation, and each row is the one an
    independent whole run gives. A run the rule stopped serves for no other: the whole run is simulated."""
    from llmsim.search.sweeps import stopping_missed_runs
    from llmsim.sim.missed import ShortfallStop

    for rate, stops in ((5.0, False), (400.0, True)):         # well within the limits; overloaded
        scenario = _scenario(rate)
        alone = run_points(scenario, [{}], workers=1)
        ran = _counting(monkeypatch)
        with reusing_runs():
            with stopping_missed_runs(ShortfallStop(1, 0.0)):
                under = run_points(scenario, [{}], workers=1)
            whole = run_points(scenario, [{}], workers=1)
            with stopping_missed_runs(ShortfallStop(1, 0.05)):
                other = run_points(scenario, [{}], workers=1)
        monkeypatch.undo()
        assert (under["stopped_by"].iloc[0] == "missed") == stops
        assert len(ran) == (2 if stops else 1)
        pd.testing.assert_frame_equal(whole, alone)
        if not stops:
            pd.testing.assert_frame_equal(under, alone)
            pd.testing.assert_frame_equal(other, alone)


def test_a_run_key_follows_every_figure_of_the_hardware_profile():
    # The profile enters the key as the digest of its pickle, worked out once per profile object: a copy with
    # the same figures is the same run, a copy with one figure changed (its kernel tables included) another.
    from dataclasses import replace

    from llmsim.search.sweeps import run_key
    scenario = _scenario(20.0)
    hardware = scenario.hardware
    assert run_key(replace(scenario, hardware=replace(hardware))) == run_key(scenario)
    assert run_key(replace(scenario, hardware=replace(hardware, per_step_overhead_s=hardware.per_step_overhead_s
                                                      * (1 + 1e-12)))) != run_key(scenario)
    if hardware.kernels is not None:
        changed = replace(hardware.kernels, gemm_floor_s=hardware.kernels.gemm_floor_s * 2)
        assert run_key(replace(scenario, hardware=replace(hardware, kernels=changed))) != run_key(scenario)
    # and the rest of the scenario as before
    assert run_key(scenario.with_seed(scenario.seed + 1)) != run_key(scenario)


def test_a_run_key_follows_a_disaggregated_scenarios_pools_and_their_profiles():
    # The pools' profiles enter the key as digests, as the scenario's does: the pool's other fields and every
    # figure of each pool's profile still make another run.
    from dataclasses import replace

    from llmsim.scenario.scenario import load_scenario
    from llmsim.search.sweeps import run_key
    scenario = load_scenario(REPO / "scenarios" / "llama3-70b-h100-prefill-cs3-decode.yaml")
    split = scenario.disaggregation
    assert split is not None

    def with_pools(prefill, decode):
        return replace(scenario, disaggregation=replace(split, prefill=prefill, decode=decode))
    key = run_key(scenario)
    assert run_key(with_pools(replace(split.prefill, hardware=replace(split.prefill.hardware)),
                              replace(split.decode, hardware=replace(split.decode.hardware)))) == key
    for pool, other in ((split.prefill, split.decode), (split.decode, split.prefill)):
        hardware = pool.hardware
        changed = replace(hardware, per_step_overhead_s=hardware.per_step_overhead_s * (1 + 1e-12) + 1e-15)
        pools = [replace(pool, hardware=changed), other]
        assert run_key(with_pools(*(pools if pool is split.prefill else pools[::-1]))) != key
        pools = [replace(pool, replicas=pool.replicas + 1), other]
        assert run_key(with_pools(*(pools if pool is split.prefill else pools[::-1]))) != key
    assert run_key(replace(scenario, disaggregation=replace(split, streaming=not split.streaming))) != key


def test_a_preemptive_run_its_stop_never_stopped_serves_for_priority_under_another_stop(monkeypatch):
    """recommend's class screen runs its candidates under stops of their own (BarStop), those holding a preemptive
    priority candidate first: where that run went to its end without preempting it is the priority run, whole, and
    serves the priority point under another stop; where it preempted, priority is simulated. Each row against an
    independent run of the point under its own stop."""
    from llmsim.search.sweeps import stopping_missed_runs
    from llmsim.sim.missed import ShortfallStop

    slo = {"interactive": {"ttft": "300 ms"}, "batch": {"e2e": "120 s"}}
    preemptive, priority = ({"engine.scheduling_policy": p} for p in ("preemptive_priority", "priority"))
    for rate, seqs, simulated in ((3.0, 128, ["preemptive_priority"]),
                                  (14.0, 8, ["preemptive_priority", "priority"])):
        scenario = _two_classes(slo, rate, seqs)
        with stopping_missed_runs(ShortfallStop(1, 0.4)):
            alone = run_points(scenario, [priority], workers=1)
        ran = _counting_policies(monkeypatch)
        with reusing_runs():
            with stopping_missed_runs(ShortfallStop(1, 1.0)):          # never stops: the whole run
                first = run_points(scenario, [preemptive], workers=1)
            with stopping_missed_runs(ShortfallStop(1, 0.4)):
                shared = run_points(scenario, [priority], workers=1)
        monkeypatch.undo()
        preempted = first["requests.preemptions"].iloc[0] > 0
        assert preempted == (rate > 10)
        assert first["stopped_by"].iloc[0] == "completed"
        pd.testing.assert_frame_equal(shared, alone)
        assert ran == simulated
