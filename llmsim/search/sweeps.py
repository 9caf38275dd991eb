"""Sweeps: one scenario, many settings, every point simulated on the same requests.

A *point* is a mapping from dotted key paths of the scenario YAML (``workload.arrival.rate``,
``speculation.k``, ``engine.max_batch_tokens``, ``hardware``...) to values. Each point's
overrides are laid over the scenario file's YAML mapping and validated again exactly as a
file would be (:mod:`llmsim.scenario.overrides`), or, for a :class:`~llmsim.scenario.scenario.Scenario`,
set on it (:func:`~llmsim.scenario.variants.variant`), so a bad value is a
:class:`~llmsim.errors.ConfigError` before anything runs.

Common random numbers: a trace depends only on the workload and the seed
(:func:`~llmsim.workload.generate.generate_trace`; arrival gaps are drawn at unit rate and scaled
by the rate), so every point that shares them runs on the same requests, and two rates
see the same requests in the same order. ``seeds`` replicates every point over several
seeds, for confidence intervals across independent traces.

Points run in parallel: local processes by default, or a Dask cluster
(:mod:`llmsim.search.executors`). With ``out`` each finished point is appended to
``out/results.csv`` as it completes (:mod:`llmsim.search.journal`), keyed by a stable hash
of the scenario, the point and the seed; running the same sweep again with the same
``out`` skips the points already there (failed points are retried). Each line carries a
checksum: a line that fails it (torn, corrupt, edited) is dropped and its point simulated
again. A lock on the folder keeps a second sweep from writing to it at the same time: that one
stops with a ConfigError naming the first one's pid. A point that raises is recorded with its
error and the others carry on.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import Any
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from llmsim.analysis.metrics import summarize
from llmsim.analysis.statistics import ci95_half_width
from llmsim.analysis.summary import flatten
from llmsim.analysis.names import OUTPUT_TOKENS_PER_S, OUTPUT_TOKENS_PER_USD, SLO_MET, STOPPED_BY, USD_PER_HOUR
from llmsim.catalog.hardware import HardwareProfile
from llmsim.config.policies import ExecutorKind, OnInvalid, OnTimeout, SchedulingPolicy
from llmsim.config.progress import QUIET, Progress
from llmsim.config.recent import Keyed, recent_for
from llmsim.config.reader import Node, load_yaml
from llmsim.config.units import UnitError, parse_quantity
from llmsim.errors import ConfigError
from llmsim.scenario.overrides import build_point, grid_points
from llmsim.scenario.scenario import Scenario, read_seed
from llmsim.scenario.variants import COUNT_KEY, DURATION_KEY, RATE_KEY, variant
from llmsim.search.executors import error_text, execute
from llmsim.search.journal import Journal, cell, cell_text
from llmsim.sim.resources import check_run_size
from llmsim.sim.checkpoints import Checkpoints
from llmsim.sim.scheduling import KEYED_POLICIES, class_rules, same_admissions
from llmsim.sim.missed import MissedStop
from llmsim.sim.result import StopReason
from llmsim.sim.simulate import simulate_whole
from llmsim.speculation.config import Eligibility

RESULTS_FILE = "results.csv"
# Class policies whose runs may serve for one another (:func:`llmsim.sim.scheduling.same_admissions`).
SHARING_POLICIES = (*KEYED_POLICIES, SchedulingPolicy.PREEMPTIVE_PRIORITY)
# Kept with a reused run's metrics, never shown in a row: per timeout (:func:`timeout_rules`), the longest wait
# of the requests it applies to (s) and the timeout with its action; and the speculation eligibility rule the run
# held (:func:`eligibility_held`); with traffic classes, the scheduling policy and the run's preemptions
# (:func:`policy_held`); and where the run follows it, the longest wait at which a dispatching timeout could have
# acted (:attr:`~llmsim.sim.result.SimulationResult.dispatch_wait_s`).
LONGEST_WAIT, QUEUE_TIMEOUT, ELIGIBILITY, POLICY = "_longest_wait_s", "_queue_timeout_s", "_eligibility", "_policy"
DISPATCH_WAIT = "_dispatch_wait_s"
HIDDEN = (LONGEST_WAIT, QUEUE_TIMEOUT, ELIGIBILITY, POLICY, DISPATCH_WAIT)
NEUTRAL_ELIGIBILITY = Eligibility(min_sequence_tokens=0, min_concurrent_requests=1)   # never keeps a step plain
ID_COLUMNS = ("point_id", "seed", "error")


def sweep(scenario: str | Path | Scenario | Mapping, grid: str | Path | Mapping[str, Sequence], *,
          out: str | Path | None = None, workers: int | None = None,
          engine: str | ExecutorKind = ExecutorKind.PROCESSES, seeds: Sequence[int] | None = None,
          progress: Progress = QUIET, client=None, on_invalid: str | OnInvalid = OnInvalid.RAISE,
          force: bool = False) -> pd.DataFrame:
    """Simulate the product of ``grid``'s values over ``scenario``; one row per point and seed.

    ``scenario``: a YAML path, a loaded :class:`Scenario` or a raw scenario mapping.
    ``grid``: a YAML path or a mapping from dotted key paths to lists of values, e.g.
    ``{"workload.arrival.rate": [4, 8, 16], "speculation.k": [0, 2, 4]}``; every
    combination is run. The other arguments are those of :func:`run_points`.

    Each row holds the point's values (one column per grid key), ``seed``, ``point_id``,
    ``error`` (empty unless the point failed) and the run's flattened summary
    (:func:`llmsim.flatten`: ``latency.tpot_s.p95``, ``throughput.output_tokens_per_s``...)
    plus ``throughput.output_tokens_per_usd`` (output tokens per dollar of device time).
    """
    grid_file = str(grid) if isinstance(grid, (str, Path)) else None
    points = grid_points(load_yaml(grid) if isinstance(grid, (str, Path)) else grid, grid_file)
    return run_points(scenario, points, out=out, workers=workers, engine=engine, seeds=seeds,
                      progress=progress, client=client, on_invalid=on_invalid, source=grid_file, force=force)


def run_points(scenario: str | Path | Scenario | Mapping, points: Iterable[Mapping[str, Any]], *,
               seeds: Sequence[int] | None = None, workers: int | None = None,
               engine: str | ExecutorKind = ExecutorKind.PROCESSES, out: str | Path | None = None,
               progress: Progress = QUIET, client=None, on_invalid: str | OnInvalid = OnInvalid.RAISE,
               source: str | None = None, force: bool = False) -> pd.DataFrame:
    """Simulate a list of points in parallel; the engine under :func:`sweep`, for searches.

    scenario:   a YAML path, a loaded :class:`Scenario` (its points are set on it by
                :func:`llmsim.scenario.variants.variant`) or a raw scenario mapping (relative
                paths in it start from the current folder).
    points:     dicts of overrides, dotted key path -> value, e.g.
                ``[{"speculation.k": 4, "engine.max_batch_tokens": 4096}, {"speculation": None}]``
                (``speculation: None`` turns speculation off). ``{}`` is the scenario as is.
    seeds:      seeds to run each point with (default: the scenario's seed). A point's trace
                depends only on its workload and seed: points that share them share requests.
    workers:    parallel processes; 1 runs in this process. Default: the idle CPUs, or this process
                alone when a pool cannot pay (:func:`llmsim.search.executors.pool_workers`).
    engine:     ``"processes"`` (a local process pool), ``"dask"`` or ``"serial"``.
    client:     with ``engine="dask"``: a ``distributed.Client`` or a scheduler address
                (``"tcp://host:8786"``); default: a LocalCluster of ``workers`` processes
                made for the call. Needs the ``distributed`` extra.
    out:        a folder; each finished point is appended to ``out/results.csv`` at once,
                and points already there (same scenario, overrides and seed, line checksum
                intact) are not rerun. The folder is locked for the call
                (``out/results.csv.lock``): while another process holds it, a ConfigError
                naming that process's pid, before anything runs.
    on_invalid: ``"raise"``: a point that fails validation raises a ConfigError naming
                ``source`` (the grid file, else the scenario's), the key path and the value,
                before anything runs; ``"record"``: it becomes a row with its ``error``.
    source:     the file the points came from, for error messages.
    progress:   told of each simulation to run and each one done (default: nowhere).
    force:      run points whose estimated size is above the resource guard's limits
                (:func:`llmsim.sim.resources.check_run_size`); without it such a point is
                invalid (``on_invalid`` says what happens), before anything runs.

    Returns one row per (point, seed) in the order given (points outer, seeds inner):
    the point's keys, ``seed``, ``point_id``, ``error`` and the flattened summary. A
    point whose simulation raises gets its error text and no metrics; the rest go on.
    """
    engine, on_invalid = ExecutorKind.of(engine, "engine"), OnInvalid.of(on_invalid, "on_invalid")
    base, build, base_file, base_seed = _base(scenario, source)
    points = [dict(point) for point in points]
    if seeds is not None and any("seed" in point for point in points):
        raise ConfigError("give seeds either as a grid key or as seeds, not both", file=source, key="seed",
                          has_value=False)
    seeds = [base_seed] if seeds is None else [_seed(seed, source) for seed in seeds]
    jobs, rows, seen = [], {}, set()
    # Rows show each point as given; it runs with the request count its rate asks for.
    for shown, point in zip(points, _windows_follow_rate(build, points)):
        for seed in [point["seed"]] if "seed" in point else seeds:
            key = point_hash(base, point, seed)
            if key in seen:
                continue
            seen.add(key)
            row = {**shown, "seed": seed, "point_id": key, "error": ""}
            try:
                built = build({**point, "seed": seed})
                check_run_size(built, force=force)
            except ConfigError as error:
                if on_invalid is OnInvalid.RAISE:
                    raise _point_error(error, shown, source or base_file) from None
                rows[key] = {**row, "error": str(error)}
                continue
            point_id = point_hash(base, point, seed, built)
            rows[point_id] = {**row, "point_id": point_id}
            jobs.append((point_id, built))
    keys = list(dict.fromkeys(key for point in points for key in point if key not in ID_COLUMNS))
    if out is None:
        _run_jobs(jobs, rows, None, engine, workers, client, progress)
        return _keys_first(pd.DataFrame(list(rows.values())), keys)
    with Journal.open(Path(out) / RESULTS_FILE) as journal:
        recorded = {record.get("point_id"): record.get("error") for record in journal.records}
        for point_id, row in rows.items():
            if row["error"] and recorded.get(point_id) != cell_text(row["error"]):
                journal.append(row)
        finished = journal.finished()
        _run_jobs([job for job in jobs if job[0] not in finished], rows, journal, engine, workers, client, progress)
        return _keys_first(journal.read(list(rows)), keys)


def _run_jobs(jobs, rows: dict[str, dict], journal: Journal | None, engine, workers, client,
              progress: Progress) -> None:
    """Simulate the jobs; each finished point's row goes into ``rows`` and, at once, the journal.
    Inside :func:`reusing_runs` a run already simulated there is not simulated again, nor is a run that
    differs from one simulated only in queue timeouts that run's requests never waited for
    (:func:`longest_waits_s`): with traffic classes each class's timeout applies to its own requests
    (:func:`timeout_rules`), so a run serves for another whose timeouts differ only where neither
    run's timeout was reached by that class's longest wait; a timeout that never acts leaves the run as
    it is. Likewise a speculating run serves for one whose eligibility rule differs only in thresholds that
    never kept a sequence-step of it from speculating, each looser (:func:`_same_eligibility`): every check the
    one passed the other passes, and the run is the same. Of jobs that differ only in these rules, the longest
    timeouts (none: the longest) and then the strictest eligibility run first, and the others run only where
    those runs' rules acted. With traffic classes a run without preemptions also serves for another policy that
    orders the classes' heads alike within the run's own waits (:func:`llmsim.sim.scheduling.same_admissions`:
    FCFS, priority, vLLM's priority and EDF; and a preemptive priority run that preempted nothing serves for them,
    being the priority run). Each round runs, of every set of jobs that differ only in these
    rules, the first (in that order) that no run so far serves for.

    Inside :func:`stopping_missed_runs` each run stops once sure to miss its SLO targets, and inside
    :func:`judging_at_checkpoints` once its verdict is settled on a shorter window; such runs are reused only
    as runs under the same rules, and a whole run already simulated serves for one."""
    reused, missed, checkpoints = _REUSED.get(), _STOP.get(), _CHECKPOINTS.get()
    rule = missed if checkpoints is None else (missed, checkpoints)
    evaluate = _evaluate if rule is None else partial(_evaluate, stop_when_missed=missed, checkpoints=checkpoints)
    if reused is None:
        for point_id, metrics in execute(jobs, evaluate, engine, workers, client, progress):
            _record(rows, journal, point_id, metrics)
        return

    def under_rule(key: bytes | None) -> bytes | None:
        return None if key is None else key_under(key, rule)

    scenarios = dict(jobs)
    whole = {point_id: run_key(scenario) for point_id, scenario in jobs}
    keys = {point_id: key_under(key, rule) for point_id, key in whole.items()}
    same_run: dict[str, list[str]] = {}            # point id simulated -> the points that are the same run
    groups: dict[bytes, list[str]] = {}            # timeout-free run key -> point ids to simulate
    fresh: dict[bytes, str] = {}
    for point_id, scenario in jobs:
        key = keys[point_id]
        if key in reused or whole[point_id] in reused:
            _record(rows, journal, point_id, reused[key] if key in reused else reused[whole[point_id]])
        elif key in fresh:
            same_run[fresh[key]].append(point_id)
        else:
            fresh[key] = point_id
            same_run[point_id] = []
            groups.setdefault(under_rule(_rule_free_key(scenario)) or key, []).append(point_id)

    def done(point_id: str, metrics: dict) -> None:
        for same in [point_id, *same_run[point_id]]:
            _record(rows, journal, same, metrics)
        if not metrics.get("error"):
            reused.add(keys[point_id], metrics, under_rule(_rule_free_key(scenarios[point_id])))
            if rule is not None and metrics.get(STOPPED_BY) == StopReason.COMPLETED.value:
                # its rule never stopped it: it is the whole run (the watches only read a run), which serves for
                # the point under any rule
                reused.add(whole[point_id], metrics, _rule_free_key(scenarios[point_id]))

    def settled(point_id: str) -> bool:
        """Done already, as the same run as one simulated whose timeouts, eligibility rule and class order never
        acted where this point's differ."""
        scenario = scenarios[point_id]
        free = _rule_free_key(scenario)
        metrics = None if free is None else reused.same_run(key_under(free, rule), scenario) or (
            reused.same_run(free, scenario) if rule is not None else None)
        if metrics is not None:
            done(point_id, metrics)
        return metrics is not None

    def strictest_first(point_id: str) -> list[float]:
        scenario = scenarios[point_id]
        rule = eligibility_rule(scenario) or (0, 0)
        # preemptive priority first of equal rules: a run of it that preempted nothing serves every keyed policy
        serves_most = scenario.engine.scheduling_policy is SchedulingPolicy.PREEMPTIVE_PRIORITY
        return [-timeout for timeout, _ in timeout_rules(scenario)] + [-rule[0], -rule[1], -float(serves_most)]

    ordered = [sorted(group, key=strictest_first) for group in groups.values()]
    while ordered:
        wave = []
        for group in ordered:
            while group and settled(group[0]):
                group.pop(0)
            if group:
                wave.append(group.pop(0))
        for point_id, metrics in execute([(p, scenarios[p]) for p in wave], evaluate, engine, workers,
                                         client, progress):
            done(point_id, metrics)
        ordered = [group for group in ordered if group]


def queue_timeout_s(scenario: Scenario) -> float:
    """The engine's queue timeout, infinite where it has none."""
    timeout = scenario.engine.queue_timeout_s
    return math.inf if timeout is None else timeout


def timeout_rules(scenario: Scenario) -> tuple[tuple[float, str], ...]:
    """The queue timeouts a run's requests are held to, as (timeout s, infinite where none; its action): one
    per traffic class (its own, else the engine's: :func:`llmsim.sim.scheduling.class_rules`), else the
    engine's alone."""
    if scenario.workload.classes:
        return tuple((math.inf if rule.timeout_s is None else rule.timeout_s, rule.on_timeout.value)
                     for rule in class_rules(scenario))
    action = scenario.engine.on_timeout
    return ((queue_timeout_s(scenario), "" if action is None else action.value),)


def eligibility_rule(scenario: Scenario) -> tuple[int, int] | None:
    """The speculation eligibility rule a run holds, (min_sequence_tokens, min_concurrent_requests); None where
    it does not speculate."""
    spec = scenario.speculation
    if spec is None:
        return None
    return spec.eligibility.min_sequence_tokens, spec.eligibility.min_concurrent_requests


def eligibility_held(result) -> tuple[int, int, bool, bool] | None:
    """A run's eligibility rule (:func:`eligibility_rule`) and whether each of its thresholds acted: whether
    min_sequence_tokens, and whether min_concurrent_requests, kept any sequence-step from speculating (the run's own
    counts, :class:`~llmsim.sim.result.SpeculationSteps`; both taken as acted where the run has none). None where
    the run does not speculate."""
    rule = eligibility_rule(result.scenario)
    if rule is None:
        return None
    blocked = result.speculation_blocked
    if blocked is None:
        return rule[0], rule[1], True, True
    return rule[0], rule[1], bool(blocked.min_sequence_tokens > 0), bool(blocked.min_concurrent_requests > 0)


def _same_eligibility(held: Sequence | None, rule: tuple[int, int] | None) -> bool:
    """Whether a run held to the eligibility rule ``held`` (:func:`eligibility_held`) is the run ``rule`` would
    give: each threshold the same, or no stricter where the run's never acted. A step the run kept plain for too
    few running requests is kept plain by the same threshold whatever min_sequence_tokens is, and a step it let
    through lets every sequence through a looser min_sequence_tokens that never acted; and the other way round."""
    if held is None or rule is None:
        return held is None and rule is None
    return all(want == threshold or (want < threshold and not acted)
               for want, threshold, acted in zip(rule, held[:2], held[2:]))


def _rule_free_key(scenario: Scenario) -> bytes | None:
    """The run key of the scenario with no queue timeout (the engine's and every class's), where the timeouts
    stay as set for the whole run, a speculation eligibility rule that never acts, and with traffic classes one
    scheduling policy for those that may share runs (:data:`SHARING_POLICIES`); None where a
    controller scales the classes' timeouts as it runs."""
    classes = scenario.workload.classes
    if classes and scenario.controller is not None:
        return None
    engine = replace(scenario.engine, queue_timeout_s=None, on_timeout=OnTimeout.DISPATCH)
    if classes and engine.scheduling_policy in SHARING_POLICIES:
        engine = replace(engine, scheduling_policy=KEYED_POLICIES[0])
    untimed = tuple(replace(c, queue_timeout_s=None, on_timeout=None) for c in classes)
    spec = scenario.speculation
    neutral = None if spec is None else replace(spec, eligibility=NEUTRAL_ELIGIBILITY)
    return run_key(replace(scenario, engine=engine, workload=replace(scenario.workload, classes=untimed),
                           speculation=neutral))


def _record(rows: dict[str, dict], journal: Journal | None, point_id: str, metrics: dict) -> None:
    row = rows[point_id]          # the point's own values win over the summary's (hardware, seed)
    shown = {k: v for k, v in metrics.items() if k not in row and k not in HIDDEN}
    rows[point_id] = {**row, **shown, "error": metrics.get("error", "")}
    if journal is not None:
        journal.append(rows[point_id])


class _Runs:
    """The runs simulated inside :func:`reusing_runs`: run key -> the run's metrics; with a journal,
    each is also appended to it as it finishes (one checksummed line, the metrics as JSON). Runs whose
    queue timeouts may not all have acted, whose eligibility rule never acted, or (keyed class policies) that
    preempted nothing, are also kept by their rule-free key (:func:`_rule_free_key`), with their longest waits,
    eligibility rule and policy."""

    def __init__(self):
        self.metrics: dict[bytes, dict] = {}
        self.free: dict[bytes, list[dict]] = {}     # rule-free key -> metrics of runs some such rule never acted in
        self.journal: Journal | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.metrics

    def __getitem__(self, key: bytes) -> dict:
        return self.metrics[key]

    def add(self, key: bytes, metrics: dict, rule_free: bytes | None = None) -> None:
        self.metrics[key] = metrics
        eligibility = metrics.get(ELIGIBILITY)
        policy = metrics.get(POLICY)
        held = metrics.get(QUEUE_TIMEOUT, ())
        if rule_free is not None and (any(wait < timeout for wait, (timeout, _) in
                                          zip(acting_waits(metrics, held, held), held))
                                      or (eligibility is not None and not all(eligibility[2:]))
                                      or (policy is not None and policy[1] == 0)):
            self.free.setdefault(rule_free, []).append(metrics)
        if self.journal is not None:
            self.journal.append({"point_id": key.hex(), "metrics": json.dumps(metrics, default=_json_number)})

    def same_run(self, rule_free: bytes, scenario: Scenario) -> dict | None:
        """A run's metrics that is the same run as ``scenario`` (whose rule-free key is ``rule_free``): the same
        but for its queue timeouts (:func:`timeout_rules`), each either the same (with its action) or, with this
        one, longer than every wait of the requests it applies to (so neither ever acted); for its eligibility
        rule (:func:`eligibility_rule`), each threshold the same or, where the run's never kept a step from
        speculating, looser (:func:`_same_eligibility`); and for its class policy, one that admits alike within
        the run's waits (:func:`llmsim.sim.scheduling.same_admissions`)."""
        timeouts, eligibility = timeout_rules(scenario), eligibility_rule(scenario)
        rules = class_rules(scenario) if scenario.workload.classes else ()

        def same_policy(metrics: dict) -> bool:
            held = metrics.get(POLICY)
            return held is None or same_admissions(SchedulingPolicy(held[0]), scenario.engine.scheduling_policy,
                                                   rules, metrics[LONGEST_WAIT], held[1])

        def same(metrics: dict) -> bool:
            return _same_eligibility(metrics.get(ELIGIBILITY), eligibility) and all(
                rule == tuple(held) or wait < min(held[0], rule[0]) for wait, held, rule in
                zip(acting_waits(metrics, metrics[QUEUE_TIMEOUT], timeouts), metrics[QUEUE_TIMEOUT], timeouts)) \
                and same_policy(metrics)
        return next((m for m in self.free.get(rule_free, ()) if same(m)), None)

    def load(self, journal: Journal) -> None:
        """The runs a journal holds (lines that fail their checksum were dropped by the journal)."""
        self.journal = journal
        for record in journal.records:
            try:
                key, metrics = bytes.fromhex(record["point_id"]), json.loads(record["metrics"])
            except (KeyError, ValueError):         # a journal of something else: its runs are simulated again
                continue
            if isinstance(metrics, dict):
                # JSON has no tuples: the summary's pairs (window_s) come back as they were made.
                self.metrics[key] = {name: tuple(v) if isinstance(v, list) else v for name, v in metrics.items()}


def acting_waits(metrics: dict, held: Sequence, wanted: Sequence) -> tuple[float, ...]:
    """Per timeout rule of a run's ``metrics`` (``held``, as :func:`timeout_rules` gives them), the wait below
    which neither its timeout nor the ``wanted`` one acts: where both dispatch and the run followed it, its
    :data:`DISPATCH_WAIT` (a dispatching timeout acts only on a head it would admit otherwise:
    :meth:`llmsim.sim.engine.Queueing.admit`), else its requests' longest wait (:func:`longest_waits_s`)."""
    waits = tuple(metrics.get(LONGEST_WAIT, ()))
    dispatch = metrics.get(DISPATCH_WAIT)
    dispatching = OnTimeout.DISPATCH.value
    if dispatch is None or not all(h[1] == w[1] == dispatching for h, w in zip(held, wanted)):
        return waits
    return tuple(min(wait, dispatch) for wait in waits)


def _json_number(value):
    """numpy scalars as the Python numbers they hold."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot journal a {type(value).__name__}")


_REUSED: ContextVar[_Runs | None] = ContextVar("llmsim_reused_runs", default=None)
_STOP: ContextVar[MissedStop | None] = ContextVar("llmsim_stop_when_missed", default=None)
_CHECKPOINTS: ContextVar[Checkpoints | None] = ContextVar("llmsim_checkpoints", default=None)


@contextmanager
def stopping_missed_runs(rule: MissedStop):
    """Within this block every point's run stops once it is sure to miss its SLO targets by ``rule``
    (:mod:`llmsim.sim.missed`), for a search that asks only whether points meet them; its summary says
    so (``stopped_by``: ``missed``) and covers what was simulated."""
    token = _STOP.set(rule)
    try:
        yield
    finally:
        _STOP.reset(token)


def missed_stop() -> MissedStop | None:
    """The rule of the :func:`stopping_missed_runs` block this runs in; None outside one."""
    return _STOP.get()


@contextmanager
def judging_at_checkpoints(rule: Checkpoints):
    """Within this block every point's run is judged at shorter windows inside it and stops at the first that
    settles its verdict (:mod:`llmsim.sim.checkpoints`); its summary says so (``stopped_by``: ``decided``)
    and covers that window."""
    token = _CHECKPOINTS.set(rule)
    try:
        yield
    finally:
        _CHECKPOINTS.reset(token)


@contextmanager
def reusing_runs(journal: str | Path | None = None):
    """Within this block a point that is the same run as one already simulated in it (the same resolved
    scenario and seed: :func:`run_key`) is not simulated again but gets that run's metrics; a run is
    deterministic in its scenario and seed, so the numbers are those it would give. A report judges
    some deployments in several stages (the recommendation at the target rate, one replica fewer, the
    load points the breaking point's bisection starts from): each is simulated once, and every figure
    about it has one source. Blocks nest (the outer one's runs are shared).

    ``journal``: a file (:class:`~llmsim.search.journal.Journal`, locked while the block runs) that
    keeps every run as it finishes, and whose runs are reused: a report or recommendation stopped by
    Ctrl-C, a full disk or a crash starts again where it stopped."""
    outer = _REUSED.get()
    runs = _Runs() if outer is None else outer
    opened = None
    if journal is not None and runs.journal is None:
        opened = Journal.open(Path(journal))
        runs.load(opened)
    token = _REUSED.set(runs)
    try:
        yield
    finally:
        _REUSED.reset(token)
        if opened is not None:
            runs.journal = None
            opened.close()


def key_under(key: bytes, rule: object) -> bytes:
    """The key of a run (:func:`run_key`) simulated under a stop rule (None: the whole run's; a
    :class:`MissedStop`, or it with :class:`Checkpoints`): a run that rule may stop is another run than the
    whole one."""
    return key if rule is None else hashlib.sha256(key + pickle.dumps(rule)).digest()


def run_key(scenario: Scenario) -> bytes:
    """What makes a run: the resolved scenario, seed included, whole (pickled, so no figure is left
    out), less where it came from (its file, its folder and the notes on it). The hardware profiles, most of
    the pickle (their kernel tables), enter as their own digests (:func:`profile_digest`): the scenario's, and a
    disaggregated scenario's pools' (pickling an H100's tables again for each of a search's keys cost 1.1 ms)."""
    def but(value, *names: str) -> dict:
        return {field.name: getattr(value, field.name) for field in fields(value) if field.name not in names}
    parts = but(replace(scenario, path=None, source_dir=None, vllm_notes=()), "hardware")
    profiles = [scenario.hardware]
    split = scenario.disaggregation
    if split is not None:
        parts["disaggregation"] = [but(split, "prefill", "decode"), but(split.prefill, "hardware"),
                                   but(split.decode, "hardware")]
        profiles += [split.prefill.hardware, split.decode.hardware]
    return hashlib.sha256(pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
                          + b"".join(map(profile_digest, profiles))).digest()


PROFILE_DIGESTS_KEPT = 64
_profile_digests: Keyed[bytes] = OrderedDict()


def profile_digest(profile: HardwareProfile) -> bytes:
    """The SHA-256 of a hardware profile's pickle, worked out once per profile object (a search's points share
    their scenario's: pickling its 100 kB of tables for every run cost about 1 ms a run; a profile is frozen)."""
    return recent_for(_profile_digests, (profile,), (),
                      lambda: hashlib.sha256(pickle.dumps(profile, protocol=pickle.HIGHEST_PROTOCOL)).digest(),
                      PROFILE_DIGESTS_KEPT)


def _keys_first(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """These points' keys, then ``seed``, ``point_id``, ``error``, then the rest, so that
    :func:`parameter_columns` finds every key of these points and no other: points with
    different keys, or an ``out`` folder that also holds another grid's points, would otherwise
    leave a key after ``seed`` (among the metrics) or another grid's key before it."""
    first = keys + ["seed", "point_id", "error"]
    return frame.reindex(columns=first + [c for c in frame.columns if c not in first])


def parameter_columns(df: pd.DataFrame) -> list[str]:
    """The columns of a sweep's rows that hold the point's own values (they come before ``seed``)."""
    return list(df.columns[:list(df.columns).index("seed")])


def mean_over_seeds(df: pd.DataFrame, metrics: Sequence[str] = ()) -> pd.DataFrame:
    """One row per point: every numeric column averaged over the point's seeds (failed runs left out).

    ``seeds`` counts the runs averaged; each column in ``metrics`` also gets ``<column>.ci95``,
    the half-width of a 95% Student-t confidence interval of the mean across seeds (NaN for
    one seed).
    """
    keys = parameter_columns(df)
    ok = df[df["error"].fillna("") == ""]
    labels = ok[keys].apply(lambda column: column.map(lambda v: json.dumps(cell(v), default=str)))
    groups = ok.groupby([labels[key] for key in keys] or [pd.Series(0, index=ok.index)], sort=False, dropna=False)
    numeric = [c for c in ok.select_dtypes("number").columns if c not in keys and c != "seed"]
    frame = groups[numeric].mean()
    frame.insert(0, "seeds", groups.size())
    for metric in metrics:
        frame[f"{metric}.ci95"] = ci95_half_width(groups[metric].std(ddof=1), groups[metric].count())
    firsts = ok.loc[groups.head(1).index, keys]          # groups keep the order they first appear in
    return pd.concat([firsts.reset_index(drop=True), frame.reset_index(drop=True)], axis=1)


def slo_met(rows: pd.DataFrame) -> pd.Series:
    """Each row's ``slo.met`` as a bool (a column read back from ``results.csv`` may hold text)."""
    return rows[SLO_MET].astype(str).str.lower().eq("true")


def point_hash(base: Mapping, point: Mapping[str, Any], seed: int, resolved: Scenario | None = None) -> str:
    """A stable 16-hex-digit key for (scenario mapping, overrides, seed): the same across runs.

    With ``resolved`` (the point's validated Scenario) the key is that scenario's, whole, in place of the
    mapping: it covers what the files the mapping names resolved to (hardware profile, model, trace,
    replayed acceptance lengths), so a recalibrated profile or an edited trace is simulated again, not read
    back stale from ``out``; and a sweep of a file and one of the same scenario from Python share their
    points' keys.
    """
    text = json.dumps({"scenario": base if resolved is None else None, "point": dict(point), "seed": seed},
                      sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode())
    if resolved is not None:
        trace = resolved.workload.trace
        digest.update(repr(replace(resolved, path=None, workload=replace(resolved.workload, trace=None))).encode())
        if trace is not None:
            for values in (trace.arrival_s, trace.prompt_tokens, trace.output_tokens):
                digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()[:16]


def simulate_point(scenario: Scenario, stop_when_missed: MissedStop | None = None,
                   checkpoints: Checkpoints | None = None) -> dict:
    """One point's row of metrics: the flattened summary and output tokens per dollar. The run's
    size is not checked again: :func:`run_points` checks (or was told to force) every point first.
    ``stop_when_missed``: the run stops once sure to miss its SLO targets (:mod:`llmsim.sim.missed`);
    ``checkpoints``: once its verdict is settled on a shorter window (:mod:`llmsim.sim.checkpoints`)."""
    # Ctrl-C during a serial sweep: record nothing half-run
    result = simulate_whole(scenario, force=True, stop_when_missed=stop_when_missed, checkpoints=checkpoints)
    flat = flatten(summarize(result).to_dict())
    usd_per_hour = flat[USD_PER_HOUR]
    flat[OUTPUT_TOKENS_PER_USD] = flat[OUTPUT_TOKENS_PER_S] * 3600 / usd_per_hour if usd_per_hour else math.nan
    # For reusing_runs, never shown in a row (_record leaves them out).
    flat[LONGEST_WAIT], flat[QUEUE_TIMEOUT] = longest_waits_s(result), timeout_rules(scenario)
    flat[DISPATCH_WAIT] = None if scenario.workload.classes else result.dispatch_wait_s
    flat[ELIGIBILITY] = eligibility_held(result)
    flat[POLICY] = policy_held(result)
    return flat


def policy_held(result) -> tuple[str, int] | None:
    """With traffic classes, the run's scheduling policy and its preemptions (a run without any serves for
    another keyed policy that orders the classes alike: :func:`llmsim.sim.scheduling.same_admissions`)."""
    scenario = result.scenario
    return (scenario.engine.scheduling_policy.value, int(result.preemptions)) if scenario.workload.classes else None


def longest_waits_s(result) -> tuple[float, ...]:
    """Per timeout of :func:`timeout_rules` (each traffic class's, else the engine's), an upper bound on how
    long any request it applies to had waited since its arrival whenever it was waiting: until its first
    admission if never preempted, else until it finished, else (rejected, unfinished) until the run ended.
    A queue timeout longer than this never acts on those requests."""
    requests = result.requests
    finish = requests["finish_s"].fillna(result.end_s).to_numpy(dtype=float)
    started = requests["first_scheduled_s"].to_numpy(dtype=float)
    never_preempted = (requests["preemptions"].to_numpy() == 0) & np.isfinite(started) & \
        (requests["status"].to_numpy() != "rejected")
    waits = np.where(never_preempted, started, finish) - requests["arrival_s"].to_numpy(dtype=float)
    classes = result.scenario.workload.class_names
    if not classes:
        return (float(np.max(waits, initial=0.0)),)
    of_class = requests["class"].to_numpy()
    return tuple(float(np.max(waits[of_class == name], initial=0.0)) for name in classes)


def _evaluate(scenario: Scenario, stop_when_missed: MissedStop | None = None,
              checkpoints: Checkpoints | None = None) -> dict:
    """Run in a worker: metrics, or the error that stopped this point (one line of text)."""
    try:
        # a run without checkpoints is asked for as before (callers that stand in for simulate_point take two)
        return simulate_point(scenario, stop_when_missed, **({} if checkpoints is None else
                                                             {"checkpoints": checkpoints}))
    except Exception as error:          # one failing point must not lose the others
        return {"error": error_text(error)}


def _windows_follow_rate(build: Callable[[Mapping[str, Any]], Scenario],
                         points: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """Points that change the arrival rate of a scenario that counts its requests keep its arrival
    window in seconds: ``workload.num_requests`` scales with the rate (unless the point sets it, or a
    duration), so the warm-up and the measurement mean the same time at every rate. A fixed count
    would be a 4-second burst inside a 30-second warm-up at 1,000 req/s, and an hour at 1 req/s."""
    if not any(RATE_KEY in point and not {COUNT_KEY, DURATION_KEY} & point.keys() for point in points):
        return points
    try:
        own = build({}).workload
    except ConfigError:                    # the base alone is incomplete (the grid supplies the rest)
        return points
    if own.num_requests is None or own.trace is not None:
        return points
    own_rate = own.rate_per_s
    out = []
    for point in points:
        rate = point.get(RATE_KEY)
        if rate is not None and not {COUNT_KEY, DURATION_KEY} & point.keys():
            try:
                rate_per_s = parse_quantity(rate, "rate")
            except UnitError:
                rate_per_s = None              # the point's own validation names the bad value
            if isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0:
                point = {**point, COUNT_KEY: max(1, math.ceil(own.num_requests * rate_per_s / own_rate))}
        out.append(point)
    return out


def scenario_at(scenario: str | Path | Scenario | Mapping, point: Mapping[str, Any]) -> Scenario:
    """The scenario (a path, Scenario or mapping, as :func:`run_points` takes it) with a point's overrides."""
    _, build, _, _ = _base(scenario)
    return build(point)


def _base(scenario, source: str | None = None
          ) -> tuple[dict, Callable[[Mapping[str, Any]], Scenario], str | None, int]:
    """(YAML mapping, or a Scenario's digest, for the points' journal keys; what builds a point's
    scenario; file name for errors; seed) of a sweep's scenario. A file's or mapping's points are laid
    over its YAML; a Scenario's are set on it (:func:`~llmsim.scenario.variants.variant`)."""
    # Each point is validated in full; the base alone need not be complete (a grid may supply
    # its hardware, say), so only its seed is read here.
    if isinstance(scenario, Scenario):
        loaded = scenario
        return ({"scenario": run_key(scenario).hex()}, lambda point: variant(loaded, point),
                scenario.path, scenario.seed)
    if isinstance(scenario, (str, Path)):
        node = Node(load_yaml(scenario), file=str(scenario))      # rejects a file that is not a mapping
        base_dir, file = Path(scenario).parent, str(scenario)
    elif isinstance(scenario, Mapping):
        node = Node(dict(scenario))
        base_dir, file = Path.cwd(), None
    else:
        raise TypeError(f"expected a scenario path, Scenario or mapping, not {type(scenario).__name__}")
    data = node.data
    return data, lambda point: build_point(data, point, base_dir, file, source), file, read_seed(node)


def _seed(seed, source: str | None) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError("expected a non-negative integer seed", file=source, key="seeds", value=seed,
                          allowed="integers >= 0")
    return seed


def _point_error(error: ConfigError, point: Mapping, file: str | None) -> ConfigError:
    """A scenario validation error, told as the grid point that caused it."""
    settings = ", ".join(f"{key}={value!r}" for key, value in point.items())
    return ConfigError(f"sweep point ({settings}): {error.message}", file=file, key=error.key, value=error.value,
                       allowed=error.allowed, has_value=error.has_value)
