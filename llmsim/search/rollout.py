"""Running a canary or shadow rollout: the control, each canary and each shadow on their requests.

The router's split does not look at the replicas (:mod:`llmsim.scenario.rollout`), so the groups
share nothing but the arrivals: each group is simulated on its own share of the one trace, which is
exactly what one environment with a splitting router would compute. Every group is measured over
the whole trace's window (the same warm-up and end), so their figures compare like with like.

``RolloutResult.user`` is what the users saw: the control's and the canaries' requests merged into
one :class:`~llmsim.sim.result.SimulationResult` (the shadows' are not in it), summarised as any
run is. Each group's own result is in ``groups``, its records' ``id`` the request's index in the
whole trace, so a shadow's request and its twin served to the user share an id.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd

from llmsim.analysis.canary import (compare_independent, compare_paired, compare_replications, detection_time, measured,
                                    verdict)
from llmsim.analysis.metrics import summarize
from llmsim.config.policies import RolloutRole
from llmsim.scenario.rollout import CONTROL
from llmsim.scenario.rollout_groups import group_scenarios
from llmsim.scenario.scenario import Scenario
from llmsim.sim.request import InterTokenGaps
from llmsim.sim.resources import check_run_size
from llmsim.sim.result import SimulationResult, StopReason
from llmsim.sim.simulate import horizon_for, simulate, warmup_for
from llmsim.workload.trace import Trace
from llmsim.workload.generate import generate_trace


@dataclass
class RolloutResult:
    scenario: Scenario
    groups: dict[str, SimulationResult]       # control first, then the canaries, then the shadows
    roles: dict[str, RolloutRole]             # group -> control, canary or shadow
    user: SimulationResult                    # the control's and the canaries' requests: what users saw

    def records(self, group: str) -> pd.DataFrame:
        """One group's per-request records (``id``: the request's index in the whole trace)."""
        return self.groups[group].requests

    @property
    def interrupted(self) -> bool:
        return any(result.interrupted for result in self.groups.values())


def simulate_rollout(scenario: Scenario, trace: Trace | None = None, force: bool = False) -> RolloutResult:
    """Simulate the scenario's control deployment and every rollout group on the shares of ``trace``
    (the scenario's own, from its seed, unless given) the router sends them."""
    rollout = scenario.rollout
    assert rollout is not None, "simulate_rollout needs a scenario with a rollout: section"
    check_run_size(scenario, trace, force)          # before the trace is drawn: drawing may be what is too large
    trace = generate_trace(scenario.workload, scenario.seed) if trace is None else trace
    window, _ = horizon_for(scenario, trace)
    warmup = warmup_for(scenario, window)
    serving, copies = rollout.assign(scenario.seed, len(trace))
    control = replace(scenario, rollout=None)
    shares = {CONTROL: (control, np.flatnonzero(serving == 0))}
    own = {group.name: built.with_seed(scenario.seed)
           for group, built in zip(rollout.groups, group_scenarios(scenario))}
    for i, group in enumerate(rollout.canaries, start=1):
        shares[group.name] = (own[group.name], np.flatnonzero(serving == i))
    for group in rollout.shadows:
        shares[group.name] = (own[group.name], copies[group.name])
    groups = {}
    for name, (served, index) in shares.items():
        result = simulate(served, trace.take(index), force=True)       # the whole trace's size checked above
        result.requests["id"] = index[result.requests["id"].to_numpy()]
        result.requests.insert(1, "group", name)
        groups[name] = replace(result, arrival_window_s=window, warmup_s=warmup)
        if result.interrupted:                   # Ctrl-C: no further groups
            break
    roles = {CONTROL: RolloutRole.CONTROL, **{g.name: g.role for g in rollout.groups}}
    users = [name for name in groups if roles[name] is not RolloutRole.SHADOW]
    return RolloutResult(scenario, groups, roles, merge_results(control, [groups[n] for n in users], len(trace)))


def simulate_replications(scenario: Scenario, force: bool = False) -> list[RolloutResult]:
    """The rollout run ``rollout.replications`` times on independent seeds (the scenario's, then the next
    ones: each run draws its own trace and split), stopping after an interrupted one."""
    assert scenario.rollout is not None, "simulate_replications needs a scenario with a rollout: section"
    results: list[RolloutResult] = []
    for replication in range(scenario.rollout.replications):
        results.append(simulate_rollout(scenario.with_seed(scenario.seed + replication), force=force))
        if results[-1].interrupted:
            break
    return results


def merge_results(scenario: Scenario, parts: list[SimulationResult], planned: int) -> SimulationResult:
    """Several groups' results as one deployment's (``scenario`` with all their replicas): records in
    arrival order, replica and queue numbers offset group by group, counts summed and time averages
    weighted by each group's simulated time. The prefix cache's totals stay per group."""
    replicas = [part.scenario.deployment.replicas for part in parts]
    offsets = np.cumsum([0] + replicas[:-1])
    queues = np.cumsum([0] + [int(part.queue_length["queue"].max()) + 1 for part in parts[:-1]])
    end_s = max(part.end_s for part in parts)
    gaps = InterTokenGaps()
    for part in parts:
        gaps.merge(part.inter_token_gaps)

    def shifted(frame, column, offset):
        frame = frame.copy()
        frame[column] += offset
        return frame

    def time_average(name):
        return sum(getattr(part, name) * part.end_s for part in parts) / end_s if end_s > 0 else 0.0

    by_class = None
    if parts[0].mean_queue_length_by_class is not None:
        tables = [part.mean_queue_length_by_class for part in parts if part.mean_queue_length_by_class is not None]
        assert len(tables) == len(parts)        # the groups serve the same traffic classes: each has the table
        by_class = {name: sum(table[name] * part.end_s for table, part in zip(tables, parts)) / end_s
                    for name in tables[0]}
    blocked = [part.speculation_blocked for part in parts if part.speculation_blocked is not None]
    stopped = [part for part in parts if part.stopped_by != StopReason.COMPLETED]
    first = parts[0]
    return SimulationResult(
        scenario=replace(scenario, deployment=replace(scenario.deployment, replicas=sum(replicas))),
        requests=pd.concat([shifted(p.requests, "replica", o) for p, o in zip(parts, offsets)],
                           ignore_index=True).sort_values("id", kind="stable", ignore_index=True),
        iterations=pd.concat([shifted(p.iterations, "replica", o) for p, o in zip(parts, offsets)], ignore_index=True),
        queue_length=pd.concat([shifted(p.queue_length, "queue", o) for p, o in zip(parts, queues)],
                               ignore_index=True),
        end_s=end_s, arrival_window_s=first.arrival_window_s, warmup_s=first.warmup_s,
        kv_blocks_per_replica=first.kv_blocks_per_replica,
        kv_allocated_blocks=sum(p.kv_allocated_blocks for p in parts),
        kv_freed_blocks=sum(p.kv_freed_blocks for p in parts),
        kv_held_blocks=sum(p.kv_held_blocks for p in parts),
        preemptions=sum(p.preemptions for p in parts),
        mean_in_system=time_average("mean_in_system"), mean_queue_length=time_average("mean_queue_length"),
        planned_requests=planned, inter_token_gaps=gaps,
        stopped_by=stopped[0].stopped_by if stopped else StopReason.COMPLETED,
        stopped_on=stopped[0].stopped_on if stopped else (),
        fault=stopped[0].fault if stopped else None,
        mean_queue_length_by_class=by_class,
        speculation_blocked=sum(blocked[1:], blocked[0]) if blocked else None)


def rollout_summary(result: RolloutResult, change: float = 0.05, others: Sequence[RolloutResult] = ()) -> dict:
    """Each group's share and headline figures, its comparison with the control (canary: independent
    samples; shadow: paired on the requests it copied from the control) and the time a group like it
    must run to detect a ``change`` (relative) in each mean, over the whole trace's window. With
    ``others`` (further independent replications of the rollout, :func:`simulate_replications`) the
    comparison is across the runs; the shares, figures and detection times stay ``result``'s."""
    scenario, start, stop = result.scenario, result.user.warmup_s, result.user.arrival_window_s
    runs = [result, *others]
    rollout = scenario.rollout
    assert rollout is not None              # the result of simulate_rollout, which needs one
    rate = len(measured(result.user.requests, start, stop)) / (stop - start) if stop > start else math.nan
    control = measured(result.records(CONTROL), start, stop)
    fractions = {g.name: g.fraction for g in rollout.groups}
    groups = {}
    for name, group in result.groups.items():
        role, records = result.roles[name], measured(group.requests, start, stop)
        summary = summarize(group).to_dict()
        entry = {"role": role, "replicas": group.scenario.deployment.replicas, "requests": len(records),
                 "fraction": fractions.get(name, 1.0 - sum(g.fraction for g in rollout.canaries)),
                 "latency": summary["latency"], "slo": summary["slo"]}
        if role is not RolloutRole.CONTROL:
            paired = role is RolloutRole.SHADOW
            twins = control[control["id"].isin(records["id"])] if paired else control
            if others:
                differences = compare_replications([_measured_pair(run, name) for run in runs], paired)
            else:
                differences = compare_paired(twins, records) if paired else compare_independent(control, records)
            entry["comparison"] = [asdict(d) | {"significant": d.significant} for d in differences]
            entry["verdict"] = verdict(name, role, differences)
            entry["detection"] = [asdict(d) for d in detection_time(twins if paired else control, records,
                                                                    fractions[name], rate, change, paired=paired)]
        groups[name] = entry
    method = (f"Student t across {len(runs)} independent replications (seeds {scenario.seed}-"
              f"{scenario.seed + len(runs) - 1}; figures and detection times from the first)" if others
              else "batch means within one run (rollout.replications: 5 or more for a test that holds "
                   "whatever the correlation)")
    return {"window_s": [start, stop], "arrival_rate_per_s": rate, "change_to_detect": change, "method": method,
            "groups": groups}


def _measured_pair(result: RolloutResult, name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One run's measured control and group records (a shadow's control: the requests it copied)."""
    start, stop = result.user.warmup_s, result.user.arrival_window_s
    control, group = measured(result.records(CONTROL), start, stop), measured(result.records(name), start, stop)
    return control, group
