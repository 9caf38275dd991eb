"""The cheapest layout of each candidate chip: replicas x tensor parallel x pipeline parallel.

Keeping one layout (the scenario's, or the fewest devices that hold the model: tp x pp ``auto``)
and then taking the fewest replicas of that shape (``llmsim plan --keep-layout``) is not the
cheapest deployment: a 70B model on H100s fits on three devices as tp1 x pp3, but a replica of
tp4 decodes several times faster and fewer of them may serve the same rate, and the scenario's
tp8 may be more than the rate needs. Here every layout is a candidate, and :func:`plan`
(``llmsim plan``, ``llmsim.plan``) answers with each chip's cheapest by default:

- tensor parallel degrees that are powers of two dividing the attention heads, up to
  ``max_tensor_parallel`` (8: one node's NVLink domain), times 1..``max_pipeline_parallel``
  stages (one stage when speculating: speculative decoding is not modelled with pipelines);
  a layout whose model does not fit (placement) is dropped;
- a mixture-of-experts model also gets expert-parallel layouts (:mod:`llmsim.cost.experts`): at one pipeline
  stage, each tp with expert-parallel degrees ``tp x 2^i`` up to ``max_expert_parallel`` (64) that split the
  experts evenly, a replica then being a whole group of ``degree`` GPUs (``degree / tp`` attention
  data-parallel ranks); the scenario's own ``expert_parallel`` settings (routing, redundant experts,
  scale-out bandwidth) carry over, and a degree they do not allow (wider than a node without a scale-out
  bandwidth) is dropped like a layout that does not fit;
- each layout's cost per hour is replicas x devices per replica (a separate draft's devices
  included) x the chip's price per device-hour, so among a chip's layouts the cheapest is the
  one with the fewest devices in all.

The search visits the layouts cheapest-looking first, by the analytic fast path's bracket
(:func:`llmsim.search.plan.analytic_bracket`: below ``lower`` replicas the fluid model's mean
latencies already exceed the limits, at ``upper`` it predicts ample room). Once a layout is
known to meet the targets at some cost, another layout is only simulated at the replica
counts that would be strictly cheaper, and skipped when even its analytic lower bound is not. Counts
that the fluid model's capacity bound proves too few (:func:`llmsim.search.plan.proven_failing`: below
the bound less its measured error) are never simulated, and a layout whose every count worth trying
is one of them is skipped.
For one layout the fewest replicas are found by ``plan``'s own search
(:func:`llmsim.search.plan.fewest_replicas`): the cheaper end simulated upward (doubling) until
it passes, then bisection, and the count just below the answer simulated too (unless the capacity
bound proves it too few), so the answer never rests on the analytic bracket's word. Every count is
judged as ``plan`` judges it (:mod:`llmsim.search.window`), except that each count gets the
measurement window its own load asks for (``window_per_count``: the same runs as a report's other
stages judge, so they are simulated once), a verdict that must clear the targets by two standard
errors pooled over the seeds, measured longer while undecided; the seeds' requests are shared by
every count.
``tests/search/test_layout.py`` checks the answer against simulating every (replicas, tp, pp) of a
small grid.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Sequence

import pandas as pd

from llmsim.analysis import names
from llmsim.config.progress import QUIET, Progress
from llmsim.config.words import counted
from llmsim.errors import ConfigError
from llmsim.scenario.variants import REPLICAS_KEY, RATE_KEY, variant
from llmsim.scenario.scenario import Scenario
from llmsim.search.plan import (MAX_REPLICAS as PLAN_MAX_REPLICAS, analytic_bracket,
                                answer_row, as_scenario, candidates, capacity_bound, check_rate,
                                fewest_replicas, kept_layout_row, plan_table, planned, aggregated, proven_failing)
from llmsim.search.window import Judged

MAX_TENSOR_PARALLEL = 8
MAX_PIPELINE_PARALLEL = 4
MAX_EXPERT_PARALLEL = 64
EXPERT_PARALLEL_KEY = "deployment.expert_parallel"
MAX_REPLICAS = 256


@dataclass(frozen=True)
class Layout:
    """One replica's shape on one chip."""
    hardware: str
    tensor_parallel: int
    pipeline_parallel: int
    devices_per_replica: int          # tp x pp (x data-parallel ranks), plus a separately placed draft's devices
    usd_per_device_hour: float
    expert_parallel: int = 1          # the routed experts' degree (1: tensor parallel like the rest)
    clears_experts: bool = False      # degree 1 of a scenario that has expert_parallel: its section removed

    @property
    def label(self) -> str:
        label = f"tp{self.tensor_parallel} x pp{self.pipeline_parallel}"
        return label + (f" x ep{self.expert_parallel}" if self.expert_parallel > 1 else "")

    def overrides(self) -> dict:
        return {"hardware": self.hardware, "deployment.tensor_parallel": self.tensor_parallel,
                "deployment.pipeline_parallel": self.pipeline_parallel,
                **expert_overrides(self.expert_parallel, self.clears_experts)}

    def usd_per_hour(self, replicas: int) -> float:
        return replicas * self.devices_per_replica * self.usd_per_device_hour


@dataclass
class LayoutChoice:
    """The cheapest layout of one chip (``layout`` None when none meets the targets)."""
    hardware: str
    layout: Layout | None
    replicas: int | None
    metrics: dict                      # the answer's simulated figures, averaged over seeds
    tried: pd.DataFrame                # every layout: its bracket, fewest replicas found or why skipped
    simulations: int
    note: str = ""
    overrides: dict = field(default_factory=dict)   # the answer as scenario overrides (rate included)
    judged: Judged | None = None       # the answer's runs and verdict
    one_replica: Scenario | None = None    # the answer's layout with one replica
    bracket: tuple[int, int] | None = None     # the answer's layout's analytic bracket (lower, upper)

    @property
    def devices(self) -> int | None:
        if self.layout is None or self.replicas is None:
            return None
        return self.replicas * self.layout.devices_per_replica

    @property
    def usd_per_hour(self) -> float:
        if self.layout is None or self.replicas is None:
            return math.nan
        return self.layout.usd_per_hour(self.replicas)


def expert_overrides(degree: int, clears_experts: bool) -> dict:
    """Scenario overrides setting the routed experts' degree: above 1 the scenario's ``expert_parallel``
    settings with this degree; 1 removes the section (``clears_experts``: the scenario has one) or leaves none."""
    if degree > 1:
        return {f"{EXPERT_PARALLEL_KEY}.degree": degree}
    return {EXPERT_PARALLEL_KEY: None} if clears_experts else {}


def layouts(scenario: Scenario, hardware: str, *, max_tensor_parallel: int = MAX_TENSOR_PARALLEL,
            max_pipeline_parallel: int = MAX_PIPELINE_PARALLEL,
            max_expert_parallel: int = MAX_EXPERT_PARALLEL) -> list[tuple[Layout, Scenario]]:
    """Every layout of ``hardware`` that holds the scenario's model, with its one-replica scenario."""
    heads = scenario.model.num_heads
    tps = [2 ** p for p in range(int(math.log2(max_tensor_parallel)) + 1) if heads % 2 ** p == 0]
    pps = [1] if scenario.speculating else range(1, max_pipeline_parallel + 1)
    found = []
    for tp in tps:
        for pp in pps:
            for degree in [1, *(expert_degrees(scenario, tp, max_expert_parallel) if pp == 1 else ())]:
                shape = Layout(hardware, tp, pp, 0, 0.0, degree,
                               clears_experts=scenario.deployment.expert_parallel is not None)
                try:
                    one = variant(scenario, {**shape.overrides(), REPLICAS_KEY: 1})
                except ConfigError:        # does not fit, or an impossible split (more stages than layers)
                    continue
                found.append((replace(shape, devices_per_replica=one.devices_per_replica,
                                      usd_per_device_hour=one.hardware.price_per_hour_usd), one))
    return found


def expert_degrees(scenario: Scenario, tensor_parallel: int, max_expert_parallel: int) -> list[int]:
    """Expert-parallel degrees above 1 worth a layout at ``tensor_parallel``: tp x 2^i up to the cap, splitting the
    experts (and the scenario's redundant ones) evenly; none for a dense model."""
    model = scenario.model
    if model.num_experts == 1:
        return []
    own = scenario.deployment.expert_parallel
    slots = model.num_experts + (own.redundant_experts if own is not None else 0)
    degrees, degree = [], tensor_parallel
    while degree <= max_expert_parallel:
        if degree > 1 and slots % degree == 0:
            degrees.append(degree)
        degree *= 2
    return degrees


def cheapest_layout(scenario: str | Path | Scenario, hardware: str, target_rate_per_s: float, *,
                    seeds: Sequence[int] | None = None, workers: int | None = None,
                    max_replicas: int = MAX_REPLICAS, max_tensor_parallel: int = MAX_TENSOR_PARALLEL,
                    max_pipeline_parallel: int = MAX_PIPELINE_PARALLEL,
                    max_expert_parallel: int = MAX_EXPERT_PARALLEL, progress: Progress = QUIET) -> LayoutChoice:
    """The cheapest (replicas, tp, pp) of ``hardware`` meeting the SLO targets at the rate (see the module doc)."""
    scenario = aggregated(as_scenario(scenario))
    rate = check_rate(target_rate_per_s)
    options = layouts(scenario, hardware, max_tensor_parallel=max_tensor_parallel,
                      max_pipeline_parallel=max_pipeline_parallel, max_expert_parallel=max_expert_parallel)
    if not options:
        return LayoutChoice(hardware, None, None, {}, pd.DataFrame(), 0,
                            note=f"does not fit: no layout up to tp{max_tensor_parallel} x pp{max_pipeline_parallel} "
                                 "holds the model")
    ranked = []
    for layout, one in options:
        lower, upper = analytic_bracket(one, rate, max_replicas)
        ranked.append((layout.usd_per_hour(upper), layout.usd_per_hour(lower), layout, lower, upper))
    ranked.sort(key=lambda entry: (entry[0], entry[1], entry[2].devices_per_replica, entry[2].pipeline_parallel))
    best: tuple[Layout, int, Judged, Scenario, tuple[int, int]] | None = None
    rows, simulations = [], 0
    ones = dict(options)
    for _, lower_cost, layout, lower, upper in ranked:
        row = {"hardware": hardware, "layout": layout.label, "devices_per_replica": layout.devices_per_replica,
               "analytic_lower": lower, "analytic_upper": upper}
        cap = max_replicas
        if best is not None:
            best_cost = best[0].usd_per_hour(best[1])
            if lower_cost >= best_cost:
                rows.append({**row, "replicas": math.nan, "note": "skipped: its analytic lower bound costs as much"})
                continue
            # only counts strictly cheaper than the best so far are worth simulating
            cap = min(cap, math.ceil(best_cost / (layout.devices_per_replica * layout.usd_per_device_hour)) - 1)
        too_few = proven_failing(ones[layout], rate)
        if cap <= too_few:
            rows.append({**row, "replicas": math.nan, "note": "skipped: the fluid model's capacity bound rules out "
                                                               f"{counted(cap, 'replica')} or fewer"})
            continue
        base = {**layout.overrides(), RATE_KEY: rate}
        found, outcomes = fewest_replicas(scenario, base, rate, lower, upper, cap, seeds=seeds, workers=workers,
                                          progress=progress, window_per_count=True, known_failing=too_few)
        simulations += len(outcomes)
        if found is None:
            note = ("no cheaper count meets the targets" if best is not None and cap < max_replicas
                    else f"targets not met with {counted(cap, 'replica')}")
            rows.append({**row, "replicas": math.nan, "note": note})
            continue
        rows.append({**row, "replicas": found, "usd_per_hour": layout.usd_per_hour(found), "note": ""})
        best = (layout, found, outcomes[found], ones[layout], (lower, upper))
    tried = pd.DataFrame(rows)
    if best is None:
        return LayoutChoice(hardware, None, None, {}, tried, simulations,
                            note=f"SLO targets not met by any layout with up to {counted(max_replicas, 'replica')}")
    layout, replicas, judged, one, bracket = best
    return LayoutChoice(hardware, layout, replicas, _mean_metrics(judged.rows), tried, simulations,
                        overrides={**layout.overrides(), RATE_KEY: rate, REPLICAS_KEY: replicas}, judged=judged,
                        one_replica=one, bracket=bracket)


def cheapest_layouts(scenario: str | Path | Scenario, target_rate_per_s: float, hardware: Sequence[str] | None = None,
                     *, progress: Progress = QUIET, **options) -> list[LayoutChoice]:
    """:func:`cheapest_layout` of every candidate chip (``--hardware``, the scenario's
    ``plan.hardware`` list, else its own), cheapest first; chips without an answer last."""
    scenario, rate = planned(scenario, target_rate_per_s)
    names_ = candidates(scenario, hardware)
    choices = []
    for name in names_:
        progress.note(name)
        choices.append(cheapest_layout(scenario, name, rate, progress=progress, **options))
    return sorted(choices, key=lambda c: (c.layout is None, c.usd_per_hour if c.layout else 0.0))


def plan(scenario: str | Path | Scenario, target_rate_per_s: float, hardware: Sequence[str] | None = None, *,
         seeds: Sequence[int] | None = None, workers: int | None = None, max_replicas: int = PLAN_MAX_REPLICAS,
         keep_layout: bool = False, progress: Progress = QUIET, max_tensor_parallel: int = MAX_TENSOR_PARALLEL,
         max_pipeline_parallel: int = MAX_PIPELINE_PARALLEL) -> pd.DataFrame:
    """``llmsim plan``: one row per candidate hardware, the cheapest deployment meeting the SLO targets at the rate.

    By default each chip's layouts (tensor x pipeline parallel, up to ``max_tensor_parallel`` x
    ``max_pipeline_parallel``) are searched for the cheapest (:func:`cheapest_layout`), and the fewest
    replicas of that layout are the answer. ``keep_layout``: the scenario's own layout on its own
    hardware, the fewest devices that hold the model on other chips, and the fewest replicas of it
    (:func:`llmsim.search.plan.kept_layout_row`). ``layout_search`` says which of the two a row is.

    Columns: hardware, replicas, devices_per_replica, devices, placement (the layout), the analytic
    bracket (``analytic_lower``, ``analytic_upper``), ``simulations``, the simulated
    P95 TTFT and TPOT, SLO attainment and output tokens/s at the answer, and its cost
    per hour, cost per million output tokens and energy per output token (at TDP).
    ``replicas`` is NaN with a ``note`` when no count up to ``max_replicas`` meets the
    targets, or when the model does not fit the hardware. ``seeds``: every seed must meet
    the targets (default: the scenario's seed). A replayed trace is rescaled in time to the
    target rate and replayed whole; the column ``replayed`` says which requests that is.
    ``progress`` counts the simulations (the work), its total growing as each search asks for more.
    """
    def row_of(scenario: Scenario, name: str, rate: float) -> dict:
        if keep_layout:
            return kept_layout_row(scenario, name, rate, seeds, workers, max_replicas, progress)
        choice = cheapest_layout(scenario, name, rate, seeds=seeds, workers=workers, max_replicas=max_replicas,
                                 max_tensor_parallel=max_tensor_parallel,
                                 max_pipeline_parallel=max_pipeline_parallel, progress=progress)
        row = {"hardware": name, "layout_search": True}
        if (choice.layout is None or choice.replicas is None or choice.judged is None or choice.one_replica is None
                or choice.bracket is None):
            return {**row, "replicas": math.nan, "simulations": choice.simulations, "note": choice.note}
        bound = capacity_bound(choice.one_replica, rate)
        row.update(devices_per_replica=choice.layout.devices_per_replica, placement=choice.layout.label,
                   analytic_lower=choice.bracket[0], analytic_upper=choice.bracket[1], analytic_capacity_bound=bound)
        undecided = [] if choice.judged.verdict.decided else [choice.replicas]
        return answer_row(row, choice.one_replica, rate, choice.replicas, choice.judged, choice.simulations, bound,
                          undecided)

    return plan_table(scenario, target_rate_per_s, hardware, row_of, progress)


def _mean_metrics(rows: pd.DataFrame) -> dict:
    mean = rows.select_dtypes("number").mean()
    return {name: float(mean[name]) for name in names.SUMMARY_NAMES if name in mean and name != names.SLO_MET}
