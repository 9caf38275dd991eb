"""Capacity plans: how many replicas of which chip, in which layout, serve a target rate within the SLO.

By default each candidate chip's layouts are searched for the cheapest deployment
(:func:`llmsim.search.layout.cheapest_layout`, which runs the replica search below for each layout
worth trying). With ``keep_layout`` the scenario is placed once per chip (tensor and pipeline
parallelism ``auto``: the fewest devices that hold the model and one longest request,
see :func:`~llmsim.catalog.placement.smallest_fitting`; one pipeline stage when speculating; the
scenario's own hardware keeps its own placement), and the smallest replica count whose simulation meets every SLO
percentile target (``slo.met``: P95 TTFT <= ttft and so on, see :class:`~llmsim.scenario.scenario.SLO`)
at the target rate is found:

1. the analytic fast path (:mod:`llmsim.analysis.fluid`) brackets it: below ``lower`` replicas
   the fluid model says the load is beyond capacity or the mean TTFT / TPOT / E2E
   already exceed the limits (a percentile is at least the mean for these right-skewed
   latencies), so those counts are taken to fail; ``upper`` is the first count at which
   it predicts ample room (utilisation <= 0.6 and means within half the limits);
2. simulation confirms: ``upper`` is simulated (doubled until it passes), then bisection
   over the replica count (several counts at once when workers allow, through
   :func:`llmsim.search.sweeps.run_points`, all on the same requests), and the count just below
   the answer is simulated too, so the answer is never taken on the analytic path's word.

Replicas share the load through the scenario's router. Cost and energy come from the
simulated run at the answer (:meth:`llmsim.analysis.summary.Economics.at_tdp`: price per device-hour and
TDP of every device, draft devices included).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np
import pandas as pd

from llmsim.analysis import names
from llmsim.analysis.fluid import FluidModel
from llmsim.config.progress import QUIET, Progress
from llmsim.config.words import counted
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import lookup_hardware
from llmsim.scenario.scenario import Scenario, load_scenario
from llmsim.scenario.variants import REPLICAS_KEY, RATE_KEY, at_rate, variant
from llmsim.search.window import Judged, Window, measurement_window, simulate_until_decided, typical_latency_s
from llmsim.workload.generate import generate_trace
from llmsim.workload.profiles import MMPP, Piecewise
from llmsim.workload.trace_transforms import has_time_scale

MAX_REPLICAS = 256           # the largest count a plan tries by default
SPLIT_KEY = "deployment.disaggregation"      # null in a plan's overrides: the deployment's aggregated layout
ROOMY_UTILISATION = 0.6      # analytic upper bracket: predicted utilisation at most this
ROOMY_LATENCY = 0.5          # and mean latencies within this share of their limits
FLUID_CAPACITY_ERROR = 0.10  # the fluid model's capacity error against the simulator (tests/analysis/test_analytic.py)
FIRST_COUNTS = 16            # analytic_bracket evaluates counts 1..16 before the rest
MAX_PROVEN = 2 ** 31         # proven_failing's answer where the fluid model gives one replica no capacity at all


def as_scenario(scenario: str | Path | Scenario) -> Scenario:
    if isinstance(scenario, Scenario):
        return scenario
    return load_scenario(scenario)


def aggregated(scenario: Scenario) -> Scenario:
    """A disaggregated scenario's aggregated layout (its deployment without the pools), which plans and layout
    searches size; any other scenario as it is (:mod:`llmsim.search.disaggregation` compares the two)."""
    return scenario if scenario.disaggregation is None else variant(scenario, {SPLIT_KEY: None})


def check_rate_driven(scenario: Scenario) -> None:
    """Plans and recommendations vary the arrival rate: classes with arrivals of their own or a
    profile without one ``rate`` (steps, ramp, MMPP) have none to vary. A replayed trace's rate is
    its time scale (``workload.arrival.rate`` rescales it), which needs two requests or more."""
    arrival = scenario.workload.arrival
    if arrival is None:
        raise ConfigError("each traffic class has arrivals of its own: there is no one rate to vary",
                          file=scenario.path, key="workload.classes", value=scenario.workload.class_names,
                          allowed="classes with a share of workload.arrival")
    if isinstance(arrival, (Piecewise, MMPP)):
        raise ConfigError("this arrival profile has no single rate to vary", file=scenario.path,
                          key="workload.arrival.process", value=arrival.process,
                          allowed="poisson, gamma, deterministic or diurnal (whose rate is its mean)")
    trace = scenario.workload.trace
    if trace is not None and not has_time_scale(trace):
        raise ConfigError("a replayed trace of one request, or of requests that all arrive at one time, has no "
                          "arrival rate to vary", file=scenario.path, key="workload.arrival.path",
                          value=f"{len(trace):,} requests",
                          allowed="a trace of two requests or more at different times")


def replay_description(scenario: Scenario, rate_per_s: float) -> str:
    """Which requests of which trace a plan at ``rate_per_s`` replays ('' without a trace)."""
    if scenario.workload.trace is None:
        return ""
    replayed = at_rate(scenario, rate_per_s)
    trace = generate_trace(replayed.workload, replayed.seed)
    return f"{trace.description}: {len(trace):,} requests"


def check_rate(rate_per_s: float, key: str = "target_rate_per_s") -> float:
    if not isinstance(rate_per_s, (int, float)) or not math.isfinite(rate_per_s) or rate_per_s <= 0:
        raise ConfigError("the target rate must be a positive number of requests per second", key=key,
                          value=rate_per_s, allowed="a rate such as 20 or '20/s'")
    return float(rate_per_s)


def candidates(scenario: Scenario, hardware: Sequence[str] | None) -> list[str]:
    """Hardware to plan for: given, else the scenario's ``plan.hardware`` list (looked up when the scenario
    was read), else its own."""
    if hardware:
        # A profile file named on the command line is found from the current folder (the
        # scenario's overrides would look for it next to the scenario).
        names = [str(Path(name).resolve()) if name.endswith((".yaml", ".yml")) and Path(name).exists() else name
                 for name in hardware]
        for name in names:
            lookup_hardware(name, None, "hardware")      # an unknown name is a ConfigError listing the profiles
        return names
    return list(scenario.plan.hardware) or [_own_hardware(scenario)]


def _own_hardware(scenario: Scenario) -> str:
    """The scenario's hardware as its YAML names it: a profile name, or a profile file's path
    (relative to the scenario), which the profile's own name would not find."""
    return scenario.hardware.named or scenario.hardware.name


def planned(scenario: str | Path | Scenario, target_rate_per_s: float) -> tuple[Scenario, float]:
    """The scenario and rate a capacity plan starts from, checked once for every chip: a rate-driven
    workload valid at that rate (not each chip's "does not fit"), and an SLO to plan for."""
    scenario = as_scenario(scenario)
    check_rate_driven(scenario)
    rate = check_rate(target_rate_per_s)
    at_rate(scenario, rate)
    if not scenario.slo.defined:
        raise ConfigError("the scenario sets no SLO to plan for", file=scenario.path, key="slo", has_value=False,
                          allowed="ttft, tpot and/or e2e limits")
    return scenario, rate


def plan_table(scenario: str | Path | Scenario, target_rate_per_s: float, hardware: Sequence[str] | None,
               row_of: Callable[[Scenario, str, float], dict], progress: Progress = QUIET) -> pd.DataFrame:
    """The scenario and rate checked, then one row per candidate chip, ``row_of(scenario, chip, rate)``
    (:func:`kept_layout_row`, or :func:`llmsim.search.layout.plan`'s layout search); see
    :func:`llmsim.search.layout.plan` for the columns. ``progress`` notes each chip."""
    scenario, rate = planned(scenario, target_rate_per_s)
    rows = []
    for name in candidates(scenario, hardware):
        progress.note(name)
        rows.append(row_of(scenario, name, rate))
    table = pd.DataFrame(rows)
    replayed = replay_description(scenario, rate)
    if replayed:                        # which traffic the answer covers: the trace, rescaled to the rate
        table["replayed"] = replayed
    return table


def _placement_overrides(scenario: Scenario, name: str) -> dict:
    """The scenario's own chip keeps its layout (no overrides: the Scenario as it is); another chip is placed
    afresh (a speculating scenario's auto placement keeps one pipeline stage: speculative decoding is not
    modelled with pipeline parallelism); an expert-parallel scenario keeps its layout (``llmsim place``
    searches expert-parallel layouts)."""
    if name.lower() in (scenario.hardware.name.lower(), _own_hardware(scenario).lower()):
        return {}
    if scenario.deployment.expert_parallel is not None:     # an expert-parallel layout is given, not searched
        return {"hardware": name}
    return {"hardware": name, "deployment.tensor_parallel": "auto", "deployment.pipeline_parallel": "auto"}


def kept_layout_row(scenario: Scenario, name: str, rate: float, seeds, workers, max_replicas: int,
                    progress: Progress) -> dict:
    """The plan row of chip ``name`` in the scenario's own layout (another chip: the fewest devices that
    hold the model): the fewest replicas meeting the targets."""
    base = {**_placement_overrides(scenario, name), RATE_KEY: rate}
    if scenario.disaggregation is not None:       # the aggregated layout (llmsim.search.disaggregation compares)
        base[SPLIT_KEY] = None
    row = {"hardware": name, "layout_search": False}
    try:
        one = variant(scenario, {**base, REPLICAS_KEY: 1})
    except ConfigError as error:
        return {**row, "replicas": math.nan, "note": f"does not fit: {error.message}"}
    dep = one.deployment
    row.update(devices_per_replica=one.devices_per_replica,
               placement=f"tp{dep.tensor_parallel} x pp{dep.pipeline_parallel}"
               + (f" x ep{dep.expert_parallel.degree}" if dep.expert_parallel is not None else ""))
    lower, upper = analytic_bracket(one, rate, max_replicas)
    bound = capacity_bound(one, rate)
    row.update(analytic_lower=lower, analytic_upper=upper, analytic_capacity_bound=bound)
    if bound / (1 + FLUID_CAPACITY_ERROR) > max_replicas:
        return {**row, "replicas": math.nan, "simulations": 0,
                "note": f"unreachable within {counted(max_replicas, 'replica')} (--max-replicas): the analytic "
                        f"capacity bound needs {counted(round(bound), 'replica')}"
                        f" (within its {FLUID_CAPACITY_ERROR:.0%} error)"}
    hi, outcomes = fewest_replicas(scenario, base, rate, lower, upper, max_replicas, seeds=seeds, workers=workers,
                                   progress=progress)
    if hi is None:
        return {**row, "replicas": math.nan, "simulations": len(outcomes),
                "note": f"SLO targets not met with {counted(max_replicas, 'replica')} (--max-replicas)"}
    undecided = sorted(n for n, judged in outcomes.items() if not judged.verdict.decided)
    return answer_row(row, one, rate, hi, outcomes[hi], len(outcomes), bound, undecided)


def answer_row(row: dict, one: Scenario, rate: float, hi: int, answer: Judged, simulations: int, bound: float,
                undecided: list[int]) -> dict:
    """A plan row for ``hi`` replicas of ``one``'s layout, from the judged runs at that count."""
    mean = answer.rows.select_dtypes("number").mean()
    margin, spread = answer.verdict.worst_margin
    notes = []
    if math.isnan(bound):
        notes.append("no analytic cross-check: the fluid model does not model "
                     + (", ".join(fluid_blind_spots(one)) or "this engine"))
    if hi < bound / (1 + FLUID_CAPACITY_ERROR):
        notes.append(f"disagrees with the analytic capacity bound ({bound:,.0f} replicas, "
                     f"{FLUID_CAPACITY_ERROR:.0%} error): the simulated window may be too short")
    if undecided:
        notes.append(f"undecided at the longest window for {', '.join(map(str, undecided))} replicas "
                     "(judged on the estimate)")
    row.update(replicas=hi, devices=hi * one.devices_per_replica, simulations=simulations,
               requests_per_simulation=answer.window.simulated_requests(rate),
               window_s=answer.window.length_s, warmup_s=answer.window.warmup_s,
               slo_margin=margin, slo_margin_ci95=spread,
               ttft_p95_s=mean[names.TTFT_P95], tpot_p95_s=mean[names.TPOT_P95],
               slo_attainment=mean[names.SLO_ATTAINMENT], output_tokens_per_s=mean[names.OUTPUT_TOKENS_PER_S],
               usd_per_hour=mean[names.USD_PER_HOUR],
               usd_per_million_output_tokens=mean[names.USD_PER_MILLION_OUTPUT_TOKENS],
               joules_per_output_token=mean[names.JOULES_PER_OUTPUT_TOKEN],
               kwh_per_million_output_tokens=mean[names.KWH_PER_MILLION_OUTPUT_TOKENS], note="; ".join(notes))
    return row


def fewest_replicas(scenario: Scenario, base: dict, rate: float, lower: int, start: int, cap: int, *,
                    seeds: Sequence[int] | None, workers: int | None, progress: Progress = QUIET,
                    window_per_count: bool = False, known_failing: int = 0) -> tuple[int | None, dict[int, Judged]]:
    """The fewest replicas in [1, cap] whose runs (``base`` overrides, total rate ``rate``) meet the
    targets, judged with their uncertainty (:func:`~llmsim.search.window.simulate_until_decided`).

    Counts below ``lower`` are taken to fail until the search confirms it: ``start`` is simulated
    first and doubled (up to ``cap``) until it passes, then the gap is bisected (several counts at
    once when workers allow) and the count just below the answer simulated too, going lower if it
    passes. By default every count runs over one window (common random numbers), measured in the
    latency of the busiest count the search can reach (``lower``); ``window_per_count``: each count
    over the window its own load asks for (as a point judged on its own, so that the runs are the
    same as other stages' of a report). ``known_failing``: counts up to it are known to fail (the
    fluid model's capacity bound proves them too few: :func:`proven_failing`) and are never simulated.
    Returns (the count, or None when ``cap`` fails; the judged runs per count simulated). ``progress``
    counts the simulations.
    """
    outcomes: dict[int, Judged] = {}

    def window_at(n: int) -> Window:
        return measurement_window(scenario, rate, typical_latency_s(variant(scenario, {**base, REPLICAS_KEY: n}), rate))

    search_window = None if window_per_count else window_at(max(1, min(lower, cap)))

    def simulate_counts(counts) -> None:
        todo = sorted({n for n in counts if n not in outcomes})
        if todo:
            windows = [search_window or window_at(n) for n in todo]
            judged = simulate_until_decided(scenario, [{**base, REPLICAS_KEY: n} for n in todo], windows,
                                            [rate] * len(todo), seeds=seeds, workers=workers, progress=progress)
            outcomes.update(zip(todo, judged))

    def passes(n: int) -> bool:
        simulate_counts([n])
        return outcomes[n].verdict.met

    if cap < 1 or cap <= known_failing:
        return None, outcomes
    hi = max(1, known_failing + 1, min(start, cap))
    lo = max(min(lower, hi) - 1, known_failing)
    while not passes(hi):
        lo = hi
        if hi >= cap:
            return None, outcomes
        hi = min(2 * hi, cap)
    while True:
        while hi - lo > 1:
            probes = _probes(lo, hi, workers)
            simulate_counts(probes)
            met = {n: outcomes[n].verdict.met for n in probes}
            hi = min([n for n in probes if met[n]], default=hi)
            lo = max([n for n in probes if not met[n] and n < hi], default=lo)
        # Confirm the count below the answer by simulation, not the analytic bracket's word (only the capacity
        # bound's proof, known_failing, spares it).
        if lo > known_failing and lo not in outcomes and passes(lo):
            hi, lo = lo, known_failing
            continue
        return hi, outcomes


def _probes(lo: int, hi: int, workers: int | None) -> list[int]:
    """Counts strictly between lo and hi to simulate at once: the midpoint, or evenly spread ones."""
    width = max(1, min(workers or os.cpu_count() or 1, hi - lo - 1))
    return sorted({int(round(lo + (hi - lo) * (i + 1) / (width + 1))) for i in range(width)} - {lo, hi})


def fluid_blind_spots(scenario: Scenario) -> list[str]:
    """What the scenario has that could make the fluid model's capacity an *under*statement, so that its
    bound would no longer bound: work it does not see saved (prefix caching), or replicas that change
    during the run (autoscaling). (Tree verification is modelled: tests/analysis/test_analytic.py.)"""
    spots = []
    if scenario.engine.prefix_caching:
        spots.append("prefix caching")
    if scenario.autoscaling is not None:
        spots.append("autoscaling")
    return spots


def replica_capacity(one_replica: Scenario) -> float:
    """One replica's capacity in the fluid model (requests/s; NaN where it does not model the engine, see
    :func:`fluid_blind_spots`)."""
    if fluid_blind_spots(one_replica):
        return math.nan
    try:
        return FluidModel(one_replica).capacity()
    except ConfigError:
        return math.nan


def capacity_bound(one_replica: Scenario, rate: float, capacity: float | None = None) -> float:
    """Replicas the fluid model's capacity asks for at this rate (rate / one replica's capacity,
    :func:`replica_capacity`, or ``capacity`` where the caller has it; NaN where it gives none). The fluid model
    overstates capacity (it averages away variability that only adds time), so this bounds the answer from below
    up to its measured error against the simulator (``FLUID_CAPACITY_ERROR``, tests/analysis/test_analytic.py)."""
    capacity = replica_capacity(one_replica) if capacity is None else capacity
    if math.isnan(capacity):
        return math.nan
    return rate / capacity if capacity > 0 else math.inf


def proven_failing(one_replica: Scenario, rate: float, capacity: float | None = None) -> int:
    """The most replicas that :func:`capacity_bound` proves too few at this rate: fewer than the bound less the
    fluid model's measured error (``FLUID_CAPACITY_ERROR``) cannot carry the load; 0 where it gives no bound.
    ``capacity``: one replica's (:func:`replica_capacity`) where the caller has it."""
    least = capacity_bound(one_replica, rate, capacity) / (1 + FLUID_CAPACITY_ERROR)
    if math.isnan(least):
        return 0
    return max(0, math.ceil(min(least, float(MAX_PROVEN))) - 1)


def analytic_bracket(one_replica: Scenario, rate: float, max_replicas: int) -> tuple[int, int]:
    """(lower, upper) replica counts from the fluid model of one replica at rate / n: the first count whose
    mean latencies are within the limits, and the first with ample room. The counts are evaluated in order,
    the first :data:`FIRST_COUNTS` of them alone before the rest (the usual answer lies among them)."""
    slo = one_replica.slo
    lower = upper = None
    try:
        model = FluidModel(one_replica)
        for first, last in ((1, min(FIRST_COUNTS, max_replicas)), (FIRST_COUNTS + 1, max_replicas)):
            if upper is not None or first > last:
                break
            counts = np.arange(first, last + 1)
            frame = model.evaluate(rate / counts)
            plausible = frame["stable"].to_numpy().copy()
            roomy = plausible & (frame["utilisation"].to_numpy() <= ROOMY_UTILISATION)
            for metric, (limit, _) in slo.targets().items():
                mean = frame[f"{metric}_mean_s"].to_numpy()
                plausible &= mean <= limit
                roomy &= mean <= ROOMY_LATENCY * limit
            if lower is None and plausible.any():
                lower = int(counts[plausible][0])
            if roomy.any():                 # ample room implies within the limits: lower is known too
                upper = int(counts[roomy][0])
    except ConfigError:                   # not modelled (static batching): simulate from one replica up
        return 1, 1
    lower = max_replicas if lower is None else lower
    upper = max_replicas if upper is None else upper
    return lower, max(upper, lower)
