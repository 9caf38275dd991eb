"""The fast lane for engine waits keeps SimPy's order: the same model on llmsim's Environment and on a
plain simpy.Environment (where a scheduled call is an ordinary event) does the same things at the same
times in the same order."""
import gc
import random

import pandas as pd
import pytest
import simpy
from simpy.events import NORMAL, URGENT

import llmsim.sim.simulate as simulate_module
from llmsim.sim.environment import Environment, scheduler, waker
from tests.helpers import make_scenario


def _mixed_model(env: simpy.Environment, seed: int) -> list:
    """Chains of scheduled calls and SimPy processes, on delays drawn from a few values so that many
    fall at the same time (where only the priority and the insertion order decide)."""
    rng = random.Random(seed)
    log = []
    schedule = scheduler(env)
    delays = [0.0, 0.5, 1.0, 1.5]

    def chain(name, left):
        def call():
            log.append((env.now, name, left))
            if left:
                schedule(chain(name, left - 1), rng.choice([URGENT, NORMAL]), rng.choice(delays))
        return call

    def process(name):
        for left in range(30, 0, -1):
            yield env.timeout(rng.choice(delays))
            log.append((env.now, name, left))
            if left % 7 == 0:                 # a process that starts a chain, as an arrival wakes an engine
                schedule(chain(f"{name}-woke-{left}", 2))

    for i in range(6):
        schedule(chain(f"call{i}", 30), URGENT if i % 2 else NORMAL, rng.choice(delays))
        env.process(process(f"proc{i}"))
    env.run()
    return log


def test_scheduled_calls_run_in_simpys_order():
    for seed in range(5):
        fast, plain = _mixed_model(Environment(), seed), _mixed_model(simpy.Environment(), seed)
        assert len(fast) > 300
        assert fast == plain


def _waking_model(env: simpy.Environment, seed: int) -> list:
    """Chains that wait as an engine does at the end of an iteration (``waker``: scheduled unless it is
    the next event, else run on at once), among SimPy processes and scheduled calls on a few delays (ties)."""
    rng = random.Random(seed)
    log = []
    schedule, wake = scheduler(env), waker(env)
    delays = [0.0, 0.25, 0.5, 1.0]

    def runner(name, left):
        def call():
            log.append((env.now, name, left, "woken"))
            at, todo = env.now, left
            while todo:
                at += rng.choice(delays)
                todo -= 1
                next_s = env.peek()                   # the reference: wait unless it comes before all else
                scheduled = wake(runner(name, todo), at)
                assert scheduled == (at >= next_s)
                if scheduled:
                    return
                log.append((at, name, todo, "ran on"))
        return call

    def process(name):
        for left in range(20, 0, -1):
            yield env.timeout(rng.choice(delays))
            log.append((env.now, name, left))
            if left % 5 == 0:
                schedule(runner(f"{name}-woke-{left}", 4), rng.choice([URGENT, NORMAL]))

    for i in range(6):
        schedule(runner(f"runner{i}", 25), URGENT if i % 2 else NORMAL, rng.choice(delays))
        env.process(process(f"proc{i}"))
    env.run()
    return log


def test_waiting_unless_next_runs_in_simpys_order():
    """The engine's wait (one call on llmsim's Environment) schedules exactly when its end is not before
    every other event, and the calls then run in the order a plain SimPy environment gives them."""
    for seed in range(5):
        fast, plain = _waking_model(Environment(), seed), _waking_model(simpy.Environment(), seed)
        assert sum(entry[-1] == "ran on" for entry in fast) >= 10       # both branches are exercised
        assert sum(entry[-1] == "woken" for entry in fast) > 100
        assert fast == plain


def test_a_simulation_gives_the_same_records_on_a_plain_simpy_environment(monkeypatch):
    scenario = make_scenario({"deployment": {"replicas": 4},
                              "workload": {"num_requests": 600, "arrival": {"process": "poisson", "rate": 40}}})
    fast = simulate_module.simulate(scenario)
    monkeypatch.setattr(simulate_module, "Environment", simpy.Environment)
    plain = simulate_module.simulate(scenario)
    pd.testing.assert_frame_equal(fast.requests, plain.requests)
    pd.testing.assert_frame_equal(fast.iterations, plain.iterations)


def _small_scenario():
    return make_scenario({"workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 20}}})


def _freeze_counts(into: list[int]):
    """An observer noting the frozen object count at the first three iterations (gc.get_freeze_count walks
    the frozen objects: not at every one)."""
    def observe(engine, iteration):
        if len(into) < 3:
            into.append(gc.get_freeze_count())
    return observe


def test_a_run_leaves_the_objects_before_it_to_the_collector_only_while_it_runs():
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    during: list[int] = []
    simulate_module.simulate(_small_scenario(), observers=[_freeze_counts(during)])
    assert len(during) == 3 and min(during) > 0      # the heap before the run was frozen while it ran
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_failing_run_gives_the_frozen_objects_back_to_the_collector():
    class Fault(Exception):
        pass

    def fail(engine, iteration):
        if engine.now > 1.0:
            raise Fault("observer failed")

    with pytest.raises(Fault) as raised:
        simulate_module.simulate(_small_scenario(), observers=[fail])
    assert raised.value.partial_result.stopped_by == "fault"
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_caller_s_own_freeze_or_disabled_collector_is_left_as_it_was():
    gc.freeze()
    try:
        simulate_module.simulate(_small_scenario())
        assert gc.get_freeze_count() > 0             # not unfrozen: the caller froze these
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        during: list[int] = []
        simulate_module.simulate(_small_scenario(), observers=[_freeze_counts(during)])
        assert during == [0, 0, 0]
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0
