"""A sweep starts a process pool only when it can be faster than this process, and says why not."""
from __future__ import annotations

import os

import pytest

from llmsim.search import executors
from llmsim.search.executors import pool_workers
from llmsim.sim.resources import estimate_run
from tests.helpers import make_scenario

JOBS = [(str(i), make_scenario({"workload": {"num_requests": 200}})) for i in range(6)]


@pytest.fixture
def machine(monkeypatch):
    """A machine of ``cpus`` CPUs at load average ``load``."""
    def set_machine(cpus: int, load: float) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    return set_machine


def test_workers_asked_for_are_obeyed(machine):
    machine(2, 50.0)
    assert pool_workers(JOBS, 3) == (3, None)


def test_a_busy_machine_runs_the_points_here_and_says_so(machine):
    machine(2, 2.5)                  # one core taken by another job beside this process
    workers, why = pool_workers(JOBS, None)
    assert workers == 1 and "none idle" in why and "load of 2.5" in why


def test_a_pool_is_started_only_when_its_start_up_is_repaid(machine, monkeypatch):
    """Serial takes W, a pool of n workers start + W / n: the pool when W > start x n / (n - 1)."""
    machine(4, 0.0)
    work_events = sum(estimate_run(scenario).events for _, scenario in JOBS)
    n = 4
    breakeven = executors.WORKER_START_CPU_S * n / (n - 1)
    monkeypatch.setattr(executors, "EVENTS_PER_CPU_S", work_events / (0.9 * breakeven))    # W just below
    workers, why = pool_workers(JOBS, None)
    assert workers == 1 and "less than starting a pool of 4 workers saves" in why
    monkeypatch.setattr(executors, "EVENTS_PER_CPU_S", work_events / (1.1 * breakeven))    # W just above
    assert pool_workers(JOBS, None) == (4, None)


def test_the_pool_never_has_more_workers_than_points(machine, monkeypatch):
    machine(16, 0.0)
    monkeypatch.setattr(executors, "EVENTS_PER_CPU_S", 1.0)           # plenty of work
    assert pool_workers(JOBS, None) == (len(JOBS), None)
