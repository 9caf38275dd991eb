"""A capacity-planning report, stage by stage: from one scenario to a :class:`~llmsim.report.document.Report`.

Stages (one progress-bar step each):

1. **workload**: the requests at the target rate (or the given trace, scaled by its growth);
2. **candidates**: each candidate chip's cheapest layout meeting the SLO targets
   (:func:`llmsim.search.layout.cheapest_layouts`); the cheapest chip is recommended;
3. **settings**: engine settings for that deployment (:func:`llmsim.search.recommend.recommend`:
   k, max batch tokens, queue timeout, with CIs across seeds and the gain over the rules of
   thumb), then the fewest replicas again with those settings;
4. **load**: SLO attainment from half to twice the target rate (a rate the fluid model's capacity bound proves
   the replicas too few for is shown so, not simulated, as the replica searches leave out the counts it rules
   out), the breaking point
   (bisection, :func:`llmsim.search.sustainable_rate.max_sustainable_rate`), headroom, and
   one replica down simulated (N+1);
5. **peak**: a diurnal profile (the trace's, or an assumed sinusoid peaking at the target)
   and the replicas its mean needs against its peak;
6. **sensitivity**: replicas needed with load, prompt and output lengths +-20% and the draft's
   acceptance +-0.1;
7. **monitoring**: one run at the recommendation, binned over time as a dashboard shows it;
8. **assumptions**: the cost model's measured error and what reproduces the report; an appendix
   lists every hardware figure used, with its confidence and a numbered source.

Every point is judged as ``llmsim plan`` judges it (:mod:`llmsim.search.window`): simulated over
a window that follows its rate, with ``requests`` (default: the scenario's count, at most
2,000) as the floor of its request count, on every seed, and its verdict must clear the
targets by two pooled standard errors (measured longer while undecided); every figure is a
mean over ``seeds``.
"""
from __future__ import annotations

import math
import sys
from contextlib import nullcontext
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import pandas as pd

from llmsim.analysis import names
from llmsim.analysis.frontier import pareto_frontier
from llmsim.analysis.metrics import summarize
from llmsim.catalog.hardware import lookup_hardware, profile_data
from llmsim.config.policies import AcceptanceProcess
from llmsim.config.progress import QUIET, Progress
from llmsim.config.reader import Node, load_yaml
from llmsim.config.words import counted
from llmsim.errors import ConfigError
from llmsim.report import figures
from llmsim.report.document import Fact, Figure, Report, Section, Table, ms, num, percent, plus_minus, usd
from llmsim.report.standing import chip_standing
from llmsim.analysis.fluid import has_length_law
from llmsim.scenario.variants import REPLICAS_KEY, RATE_KEY, at_rate, variant
from llmsim.scenario.scenario import Scenario
from llmsim.search.disaggregation import AGGREGATED, compare_layouts
from llmsim.search.layout import Layout, cheapest_layouts
from llmsim.search.plan import (FLUID_CAPACITY_ERROR, SPLIT_KEY, analytic_bracket, as_scenario, check_rate,
                                check_rate_driven, fewest_replicas, proven_failing, replica_capacity)
from llmsim.search.recommend import OFF, recommend
from llmsim.search.sustainable_rate import max_sustainable_rate
from llmsim.search.sweeps import reusing_runs, run_key
from llmsim.search.window import (MAX_REQUESTS, Judged, measurement_window, simulate_until_decided,
                                  stopping_decided_runs, typical_latency_s)
from llmsim.sim.simulate import simulate_whole
from llmsim.workload.generate import generate_trace
from llmsim.workload.lengths import check_mean_kept
from llmsim.workload.trace import Trace

# The expert-parallel layouts the search adds for an MoE model (llmsim.search.layout).
EXPERT_LAYOUTS = ("; and at one stage, routed experts spread over tp x 2, 4 ... up to 64 GPUs (ep) with attention "
                  "data parallel, a replica being the whole group")

STAGES = ("workload", "candidates", "disaggregation", "settings", "load", "peak", "sensitivity", "monitoring",
          "assumptions")
# The stages that ask of a failing point only its verdict, or show a stopped run's figures as such: their runs
# stop once sure to fail (llmsim.search.window.stopping_decided_runs). The disaggregation stage shows every
# layout's percentiles.
DECIDING_STAGES = ("candidates", "settings", "load", "peak", "sensitivity")
LOAD_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
SENSITIVITY = 0.2                 # +-20% load and lengths
ACCEPTANCE_STEP = 0.1
DEFAULT_REQUESTS = 2000
MAX_GROWTH = 1000.0               # a trace's traffic scaled at most a thousandfold
MIN_REQUESTS = 50                 # fewer cannot measure a P99
DEFAULT_PEAK_TO_MEAN = 1.5        # the assumed diurnal profile's peak over its mean, without a trace
HOURS_PER_MONTH = 730.0
MONITOR_BINS = 40
BREAKING_TOLERANCE = 0.1        # the breaking point's bisection steps to 10% of the target rate ...
BREAKING_FINEST = 0.0125        # ... and on, while the step is not below the headroom, to 1.25% at most
RECOMMEND_TOLERANCE = 0.1       # bisection on the rate stops at 10% (the CLI's recommend: 4%)
STOPPED = "stopped"             # a figure of a run stopped once sure to miss the targets
STOPPED_NOTE = (f"{STOPPED}: the runs stopped once more of the measured requests had missed a limit than its "
                "percentile target allows, by so many that the target is missed by more than two standard errors "
                "whatever the rest of the run would show; its latencies, attainment and throughput are not measured")
OVER = "over capacity"          # a load point the fluid model's capacity bound proves too much: not simulated
OVER_NOTE = (f"{OVER}: the fluid model's capacity bound, less its measured error ({FLUID_CAPACITY_ERROR:.0%}), "
             "proves the replicas too few for this rate, so it was not simulated; the targets are not met")


@dataclass(frozen=True)
class Traffic:
    """The traffic to plan for: the rate to size at, and the day it comes from."""
    target_rate_per_s: float
    mean_rate_per_s: float
    hours: np.ndarray               # the diurnal profile: hour of day ...
    rate_per_s: np.ndarray          # ... and the arrival rate then
    source: str                     # how the profile was obtained
    trace: Trace | None = None      # a recorded trace, scaled by the growth
    growth: float = 1.0


def traffic_from_rate(rate_per_s: float, peak_to_mean: float = DEFAULT_PEAK_TO_MEAN) -> Traffic:
    """An assumed diurnal profile: a sinusoid over 24 h peaking at ``rate_per_s`` at 15:00."""
    if not math.isfinite(peak_to_mean) or not 1.0 <= peak_to_mean < 2.0:
        raise ConfigError("a sinusoidal day's peak must be 1 to 2 times its mean", key="peak_to_mean",
                          value=peak_to_mean, allowed="a number in [1, 2)")
    hours = np.arange(24) + 0.5
    mean = rate_per_s / peak_to_mean
    profile = mean * (1 + (peak_to_mean - 1) * np.cos(2 * np.pi * (hours - 15) / 24))
    return Traffic(rate_per_s, mean, hours, profile,
                   f"assumption: a sinusoidal day with peak {peak_to_mean:g} x its mean, peaking at the target "
                   "rate (give --trace to use a recorded profile)")


def traffic_from_trace(trace: Trace, growth: float, path: str) -> Traffic:
    """The trace's arrival rate in 24 equal windows of its duration (read as one day), times
    ``growth``; the target is its busiest window."""
    if not math.isfinite(growth) or growth <= 0:
        raise ConfigError("the growth factor must be positive", key="growth", value=growth,
                          allowed="a factor such as 2x, 1.5 or 150%")
    if len(trace) < 48:
        raise ConfigError(f"a trace of {len(trace)} requests is too short for a profile", key="trace", value=path,
                          allowed="a trace of at least 48 requests")
    duration = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if duration <= 0:
        raise ConfigError("every request of the trace arrives at the same time", key="trace", value=path,
                          allowed="a trace whose arrivals span some time")
    counts, edges = np.histogram(trace.arrival_s, bins=24, range=(trace.arrival_s[0], trace.arrival_s[-1]))
    rate = growth * counts / np.diff(edges)
    scaled = Trace(trace.arrival_s / growth, trace.prompt_tokens, trace.output_tokens)
    return Traffic(float(rate.max()), growth * len(trace) / duration, np.arange(24) + 0.5, rate,
                   f"the trace {Path(path).name} ({len(trace):,} requests over {duration:,.0f} s) in 24 equal "
                   f"windows read as the hours of a day, times a growth of {growth:g}", scaled, growth)


def parse_growth(text: str) -> float:
    """'2x', '2', '150%' -> 2.0, 2.0, 1.5; anything else, <= 0 or above MAX_GROWTH is a ConfigError."""
    raw = str(text).strip().lower()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw.rstrip("x"))
    except ValueError:
        raise ConfigError("cannot read this as a growth factor", key="growth", value=text,
                          allowed="a factor such as 2x, 1.5 or 150%") from None
    if not math.isfinite(value) or not 0 < value <= MAX_GROWTH:
        raise ConfigError("the growth factor is out of range", key="growth", value=text,
                          allowed=f"a factor such as 2x, 1.5 or 150%, > 0 and <= {MAX_GROWTH:g}")
    return value


@dataclass(frozen=True)
class Chosen:
    """The recommended chip's answer: a layout and replica count that meet the targets (never None,
    unlike a :class:`~llmsim.search.layout.LayoutChoice` of a chip that meets none)."""
    hardware: str
    layout: Layout
    replicas: int
    overrides: dict


class ReportBuilder:
    """Runs the stages in order; each adds a section (see the module docstring)."""

    def __init__(self, scenario: str | Path | Scenario, traffic: Traffic, *, hardware: Sequence[str] | None = None,
                 seeds: Sequence[int] | None = None, requests: int | None = None, workers: int | None = None,
                 command: str = "", progress: Progress = QUIET):
        scenario = as_scenario(scenario)
        check_rate_driven(scenario)
        self.rate = check_rate(traffic.target_rate_per_s)
        if not scenario.slo.defined:
            raise ConfigError("the scenario sets no SLO to plan for", file=scenario.path, key="slo",
                              has_value=False, allowed="ttft, tpot and/or e2e limits")
        self.traffic, self.hardware, self.workers, self.progress = traffic, hardware, workers, progress
        self.seeds = list(seeds) if seeds else [scenario.seed, scenario.seed + 1]
        if len(self.seeds) < 2:
            raise ConfigError("confidence intervals need at least 2 seeds", key="seeds", value=seeds,
                              allowed="a count >= 2, or 2 or more seeds")
        count = min(scenario.workload.num_requests or DEFAULT_REQUESTS, DEFAULT_REQUESTS) if requests is None \
            else requests
        if isinstance(count, bool) or not isinstance(count, int) or not MIN_REQUESTS <= count <= MAX_REQUESTS:
            raise ConfigError("the fewest requests per run must be enough to measure percentiles, and within the "
                              "simulations' cap", key="requests", value=count,
                              allowed=f"an integer >= {MIN_REQUESTS} and <= {MAX_REQUESTS:,}")
        self.requests = count
        # the runs' request count is a floor: each point's window follows its rate (llmsim.search.window)
        self.base = {"workload.num_requests": count, "workload.duration": None, **self._trace_lengths(scenario)}
        if scenario.disaggregation is not None:     # every stage but one plans the deployment's aggregated layout
            self.base[SPLIT_KEY] = None
        self.original = scenario
        self.scenario = variant(scenario, {**self.base, RATE_KEY: self.rate})    # validates the rate and lengths
        self.command = command or "llmsim report " + " ".join(sys.argv[1:])
        self.sections: list[Section] = []
        self.summary: list[Fact] = []
        self.stage_seconds: dict[str, float] = {}     # wall time of each stage, for benchmarks
        self._capacities: dict[bytes, float] = {}     # one replica's setting (run_key) -> its fluid capacity

    def _trace_lengths(self, scenario: Scenario) -> dict:
        """With a trace: prompt and output lengths as lognormals fitted to it (mean and log-sd), so
        that the simulations draw requests like the trace's at any rate, and lengths can be scaled."""
        trace = self.traffic.trace
        if trace is None:
            return {}
        fitted = {}
        for key, values in (("prompt_tokens", trace.prompt_tokens), ("output_tokens", trace.output_tokens)):
            values = np.asarray(values, dtype=float)
            fitted[f"workload.{key}"] = {"distribution": "lognormal", "mean": float(values.mean()),
                                         "sigma": float(max(np.log(values).std(), 1e-3))}
        return fitted

    # -- the stages ------------------------------------------------------------------------

    def build(self) -> Report:
        # a deployment judged in several stages is simulated once (one source for its figures)
        self.progress.add(len(STAGES))
        with reusing_runs():
            for stage in STAGES:
                self.progress.note(stage)
                started = time.perf_counter()
                with stopping_decided_runs() if stage in DECIDING_STAGES else nullcontext():
                    getattr(self, f"_{stage}")()
                self.stage_seconds[stage] = time.perf_counter() - started
                self.progress.advance()
        s = self.original
        return Report(title=f"Capacity plan: {s.model.name} for {s.name}",
                      subtitle=f"target {num(self.rate)} requests/s; SLO targets {self._targets_text()}",
                      summary=self.summary, sections=self.sections)

    def _workload(self) -> None:
        traffic = self.traffic
        trace = traffic.trace if traffic.trace is not None else generate_trace(self.scenario.workload,
                                                                               self.scenario.seed)
        window = float(trace.arrival_s[-1] - trace.arrival_s[0]) or 1.0
        bins = max(10, min(60, len(trace) // 40))
        counts, edges = np.histogram(trace.arrival_s, bins=bins)
        rate = counts / np.diff(edges)
        rows = [["target rate (sizing)", f"{num(self.rate)} req/s"],
                ["mean rate of the day", f"{num(traffic.mean_rate_per_s)} req/s"],
                ["arrivals", self._arrival_text()],
                ["requests per simulated run", f"{self.requests:,}"]]
        for label, values in (("prompt tokens", trace.prompt_tokens), ("output tokens", trace.output_tokens)):
            values = np.asarray(values)
            rows.append([label, f"mean {num(values.mean())}, P50 {num(np.percentile(values, 50))}, "
                                f"P95 {num(np.percentile(values, 95))}, max {num(values.max())}"])
        rows.append(["SLO targets", self._targets_text()])
        classes = getattr(self.original.workload, "classes", None)
        shown = ("the trace, scaled by its growth" if traffic.trace is not None
                 else "one sample of the scenario workload at the target rate")
        paragraphs = [f"Requests shown: {shown} ({len(trace):,} requests over {window:,.0f} s)."]
        if traffic.trace is not None:
            paragraphs.append("The simulations draw prompt and output lengths from lognormal distributions fitted "
                              "to the trace (its mean and the standard deviation of its log lengths), with "
                              "Poisson arrivals at each rate.")
        tables = [Table("workload", "Workload", ["quantity", "value"], rows)]
        if classes:
            tables.append(Table("classes", "Traffic classes", ["class", "share", "priority", "weight",
                                                               "reserved sequences", "queue timeout", "on timeout",
                                                               "mean prompt", "mean output"],
                                [_class_row(c, self.scenario.workload) for c in classes]))
        self.sections.append(Section(
            "workload", "Workload", paragraphs, tables,
            [Figure("workload-figure", "Arrival rate and lengths",
                    figures.workload(edges[:-1], rate, np.asarray(trace.prompt_tokens), np.asarray(trace.output_tokens),
                                     "workload-figure"))]))

    def _candidates(self) -> None:
        self.choices = cheapest_layouts(self.scenario, self.rate, self.hardware, seeds=self.seeds,
                                        workers=self.workers)
        usable = [Chosen(c.hardware, c.layout, c.replicas, c.overrides)
                  for c in self.choices if c.layout is not None and c.replicas is not None]
        if not usable:
            why = "; ".join(f"{c.hardware}: {c.note}" for c in self.choices)
            raise ConfigError(f"no candidate meets the SLO targets at {self.rate:g} requests/s ({why})",
                              key="target_rate_per_s", value=self.rate,
                              allowed="a lower rate, other --hardware, or looser SLOs")
        self.best: Chosen = usable[0]
        self.standings = {c.hardware: chip_standing(c.hardware, self.original) for c in self.choices}
        columns = ["chip", "layout", "replicas", "devices", "USD/hour", "USD/M out", "kWh/M out", "P95 TTFT",
                   "P95 TPOT", "SLO attainment", "layouts tried", "figures rest on", "held-out error"]
        rows: list[list[str]] = []
        notes = [f"recommended: {self.best.hardware}, the cheapest per hour",
                 "USD/M out and kWh/M out: per million output tokens"]
        for choice in self.choices:
            m = choice.metrics
            tried = len(choice.tried)
            standing = self.standings[choice.hardware]
            known = [standing.text, standing.held_out]
            if choice.layout is None:
                rows.append([choice.hardware, "-", "-", "-", "-", "-", "-", "-", "-", "-", str(tried), *known])
                notes.append(f"{choice.hardware}: {choice.note}")
                continue
            rows.append([choice.hardware, choice.layout.label, str(choice.replicas), str(choice.devices),
                         usd(choice.usd_per_hour), usd(m.get(names.USD_PER_MILLION_OUTPUT_TOKENS)),
                         num(m.get(names.KWH_PER_MILLION_OUTPUT_TOKENS)), ms(m.get(names.TTFT_P95)),
                         ms(m.get(names.TPOT_P95)), percent(m.get(names.SLO_ATTAINMENT)), str(tried), *known])
        layouts = pd.concat([c.tried for c in self.choices if len(c.tried)], ignore_index=True)
        layout_rows = [[f"{r.hardware} {r.layout}", str(int(r.devices_per_replica)), str(int(r.analytic_lower)),
                        str(int(r.analytic_upper)), "-" if pd.isna(r.replicas) else str(int(r.replicas)),
                        r.note or ""] for r in layouts.itertuples()]
        self.sections.append(Section(
            "candidates", "Candidates: the cheapest layout of each chip",
            [f"For each chip every layout (tensor parallel 1-8 in powers of two dividing the heads, times 1-4 "
             f"pipeline stages{EXPERT_LAYOUTS if self.scenario.model.num_experts > 1 else ''}, when it holds the "
             f"model) gets the fewest replicas meeting the SLO targets at "
             f"{num(self.rate)} requests/s on {counted(len(self.seeds), 'seed')}; the cheapest per hour is kept. "
             "Costs are the profiles' prices per device-hour (assumptions), energy every device at its TDP.",
             "Figures rest on: step times measured (kernel terms fitted to this chip's timings; the assumed "
             "ones are named in the assumptions section), derived (carried over from another chip's "
             "measured terms by a rule stated in their sources: not measured on this chip) or assumption "
             "(peaks times assumed efficiencies); and the price's confidence. Held-out error: the mean absolute "
             "error of the chip's kernel terms on timings held out of their fit, from the profile's calibration "
             "record (GEMM, decode and prefill attention, where a dense model's steps go)."],
            [Table("candidates", "Cheapest layout per chip (scenario's engine settings)", columns, rows,
                   note="; ".join(notes)),
             Table("layouts", "Every layout considered", ["chip and layout", "devices per replica",
                                                          "analytic lower", "analytic upper",
                                                          "fewest replicas", "note"], layout_rows)],
            [Figure("candidates-figure", "Cost per hour of each chip's cheapest layout",
                    figures.candidates([c.hardware for c in self.choices], [c.usd_per_hour for c in self.choices],
                                       [c.layout is not None for c in self.choices], "candidates-figure"))]))

    def _disaggregation(self) -> None:
        """With deployment.disaggregation: the aggregated layout against each prefill:decode ratio at the target
        rate, on the same requests (:func:`llmsim.search.disaggregation.compare_layouts`), and the verdict."""
        if self.original.disaggregation is None:
            return
        own = {key: value for key, value in self.base.items() if key != SPLIT_KEY}
        comparison = compare_layouts(variant(self.original, own), self.rate, seeds=self.seeds)
        table, slo = comparison.table, self.original.slo
        rows = [[r["kind"], r["layout"], str(int(r["devices"])), usd(r["usd_per_hour"]),
                 plus_minus(r["ttft_p95_s"], r["ttft_p95_s.ci95"], ms),
                 plus_minus(r["tpot_p95_s"], r["tpot_p95_s.ci95"], ms),
                 plus_minus(r["slo_attainment"], r["slo_attainment.ci95"], percent), "yes" if r["slo_met"] else "no"]
                for r in table.to_dict("records")]
        limits = {metric: getattr(slo, f"{metric}_s") for metric in ("ttft", "tpot")}
        self.sections.append(Section(
            "disaggregation", "Aggregated or disaggregated",
            [f"The deployment's aggregated layout at 1 to {int((table['kind'] == AGGREGATED).sum())} replicas and "
             "each prefill:decode ratio (xPyD) of the scenario's pools, simulated at "
             f"{num(self.rate)} requests/s on {counted(len(self.seeds), 'seed')} (within a seed every layout "
             "sees the same requests); a layout meets the SLO when every percentile target holds on every seed. "
             "Costs count both pools' devices.", f"Verdict: {comparison.verdict}."],
            [Table("disaggregation-layouts", "Layouts compared, cheapest first",
                   ["kind", "layout", "devices", "USD/hour", "P95 TTFT", "P95 TPOT", "SLO attainment", "SLO met"],
                   rows, note=f"means over {counted(len(self.seeds), 'seed')}; ± : 95% Student-t confidence "
                              "interval across seeds"),
             Table("disaggregation-verdict", "Verdict", ["question", "value"],
                   [["aggregated or disaggregated", comparison.verdict]])],
            [Figure("disaggregation-figure", "Aggregated and disaggregated layouts: P95 latency against cost",
                    figures.disaggregation(table["kind"], table["layout"], table["usd_per_hour"],
                                           {"ttft": table["ttft_p95_s"], "tpot": table["tpot_p95_s"]}, limits,
                                           "disaggregation-figure"))]))
        self.summary.append(Fact("aggregated or disaggregated", "disaggregation-verdict",
                                 "aggregated or disaggregated", "value"))

    def _settings(self) -> None:
        best = self.best
        deployed = variant(self.scenario, best.overrides)
        paragraphs = []
        try:
            rec = recommend(deployed, seeds=self.seeds, top=1, workers=self.workers, tolerance=RECOMMEND_TOLERANCE)
        except ConfigError as error:      # nothing searched beats the scenario's own settings at this rate
            rec = None
            paragraphs.append(f"The search found no better setting ({error.message}); the scenario's own "
                              "settings are kept.")
        settings = rec.best.overrides(deployed) if rec is not None else {}
        self.layout_overrides = {k: v for k, v in best.overrides.items() if k != REPLICAS_KEY}
        self.config = {**self.layout_overrides, **settings}
        # the recommended settings may need fewer replicas than the scenario's own
        replicas, outcomes = fewest_replicas(self.scenario, self.config, self.rate, max(1, best.replicas - 1),
                                             best.replicas, best.replicas,
                                             seeds=self.seeds, workers=self.workers, window_per_count=True)
        if replicas is None:              # the settings do worse here than the scenario's own: keep those
            self.config, replicas = dict(self.layout_overrides), best.replicas
            paragraphs.append("With the recommended settings the deployment missed the targets at the "
                              "target rate, so the scenario's own settings are kept.")
            settings = {}
            outcomes = {replicas: self._judge([{**self.config, REPLICAS_KEY: replicas}], [self.rate])[0]}
        self.replicas = replicas
        self.at_target = outcomes[replicas].rows
        margin, spread = outcomes[replicas].verdict.worst_margin
        self.final = variant(self.scenario, {**self.config, REPLICAS_KEY: replicas})
        rows = self._settings_rows(rec, deployed)
        table = Table("settings", "Recommended engine settings", ["setting", "recommended", "rule of thumb"], rows,
                      note="± : 95% Student-t confidence interval across seeds, and at least the bisection's "
                           "resolution (seeds that stop in the same bracket agree only to its width); goodput is the "
                           "highest rate meeting the SLO targets (bisection on the rate per seed)")
        mean = self.at_target.select_dtypes("number").mean()
        ttft_limit, tpot_limit = self.final.slo.ttft_s, self.final.slo.tpot_s
        usd_hour = float(mean[names.USD_PER_HOUR])
        # one column of values, a row per quantity: the table fits a page however many quantities it has
        deploy = Table("deployment", "The recommended deployment at the target rate", ["quantity", "recommended"], [
            ["chip", best.hardware], ["layout", best.layout.label], ["replicas", str(replicas)],
            ["devices", str(replicas * best.layout.devices_per_replica)], ["USD/hour", usd(usd_hour)],
            ["USD/month", usd(usd_hour * HOURS_PER_MONTH)],
            ["USD per M output tokens", usd(mean[names.USD_PER_MILLION_OUTPUT_TOKENS])],
            ["kWh per M output tokens", num(mean[names.KWH_PER_MILLION_OUTPUT_TOKENS])],
            ["P95 TTFT", ms(mean[names.TTFT_P95])], ["TTFT margin", _margin(mean[names.TTFT_P95], ttft_limit)],
            ["P95 TPOT", ms(mean[names.TPOT_P95])], ["TPOT margin", _margin(mean[names.TPOT_P95], tpot_limit)],
            ["SLO attainment", percent(mean[names.SLO_ATTAINMENT])],
            ["attainment over target (worst limit)", plus_minus(margin, spread, percent)]],
            note=f"means over {counted(len(self.seeds), 'seed')} at {num(self.rate)} requests/s; "
                 "margin: how far the P95 "
                 f"is below its limit; attainment over target: the share within the limit minus the percentile "
                 f"target, ± 2 standard errors pooled over seeds; a month is {HOURS_PER_MONTH:g} hours")
        if rec is not None:
            paragraphs.insert(0, f"Searched on {best.hardware} {best.layout.label} x {best.replicas} with "
                              f"`llmsim recommend` ({len(rec.analytic)} settings scored analytically, "
                              f"{len(rec.table)} simulated on {counted(len(self.seeds), 'seed')}). "
                              "With them the deployment "
                              f"needs {counted(replicas, 'replica')} (the scenario's settings: {best.replicas}).")
        self.sections.append(Section("settings", "Recommended deployment and engine settings", paragraphs,
                                     [deploy, table]))
        def deployed_fact(label: str, row: str) -> Fact:
            return Fact(label, "deployment", row, "recommended")

        def setting_fact(label: str, row: str) -> Fact:
            return Fact(label, "settings", row, "recommended")

        chip = best.hardware
        self.summary += [deployed_fact("chip", "chip"),
                         Fact("what its figures rest on", "candidates", chip, "figures rest on"),
                         Fact("its cost model's held-out error", "candidates", chip, "held-out error"),
                         setting_fact("gain of the settings over the rule of thumb", "gain over the rule of thumb"),
                         deployed_fact("layout (tensor x pipeline parallel)", "layout"),
                         deployed_fact("replicas", "replicas"), deployed_fact("devices", "devices"),
                         setting_fact("speculation (k)", "speculation k"),
                         setting_fact("max batch tokens", "max batch tokens"),
                         setting_fact("queue timeout", "queue timeout"),
                         deployed_fact("cost per month", "USD/month"),
                         deployed_fact("cost per million output tokens", "USD per M output tokens"),
                         deployed_fact("energy per million output tokens (kWh, at TDP)", "kWh per M output tokens"),
                         deployed_fact("P95 TTFT", "P95 TTFT"), deployed_fact("TTFT margin", "TTFT margin"),
                         deployed_fact("P95 TPOT", "P95 TPOT"), deployed_fact("TPOT margin", "TPOT margin")]

    def _settings_rows(self, rec, deployed: Scenario) -> list[list[str]]:
        eng = deployed.engine
        own_k = str(OFF) if deployed.speculation is None else deployed.speculation.policy.label
        if rec is None:
            own_timeout = "none" if eng.queue_timeout_s is None else ms(eng.queue_timeout_s)
            return [["speculation k", own_k, "-"], ["max batch tokens", str(eng.max_batch_tokens), "-"],
                    ["queue timeout", own_timeout, "-"], ["goodput (req/s)", "-", "-"],
                    ["gain over the rule of thumb", "-", "-"]]
        top, default = rec.table.iloc[0], rec.defaults.iloc[0]
        def timeout(t: float | None) -> str:
            return "none" if t is None or (isinstance(t, float) and math.isnan(t)) else ms(t)

        return [["speculation k", str(rec.best.k), str(default["config"].k)],
                ["max batch tokens", str(rec.best.max_batch_tokens), str(default["config"].max_batch_tokens)],
                ["queue timeout", timeout(rec.best.queue_timeout_s), timeout(default["config"].queue_timeout_s)],
                ["goodput (req/s)", plus_minus(top["max_rate_per_s"], top["max_rate_per_s.ci95"]),
                 plus_minus(default["max_rate_per_s"], default["max_rate_per_s.ci95"])],
                ["USD per M output tokens at that rate", usd(top["usd_per_million_output_tokens"]),
                 usd(default["usd_per_million_output_tokens"])],
                ["gain over the rule of thumb", f"{plus_minus(rec.improvement, rec.improvement_ci95, percent)}: "
                                                f"{rec.gain_verdict}", "-"]]

    def _load(self) -> None:
        rates = [self.rate * f for f in LOAD_FACTORS]
        points = [{**self.config, REPLICAS_KEY: self.replicas, RATE_KEY: r} for r in rates]
        table_rows, met_by_rate, frame = [], {}, []
        tabled = ((names.TTFT_P95, ms), (names.TPOT_P95, ms), (names.SLO_ATTAINMENT, percent),
                  (names.OUTPUT_TOKENS_PER_S_PER_DEVICE, num))        # the table's figures, each formatted
        shown = [name for name, _ in tabled] + [names.slo_attainment(m) for m in self.final.slo.targets()]
        # a rate the capacity bound proves too much for the replicas is not simulated (as in _replicas_at)
        over = {r: self._too_few(variant(self.scenario, {**self.config, RATE_KEY: r, REPLICAS_KEY: 1}), r)
                >= self.replicas for r in rates}
        simulated = [r for r in rates if not over[r]]
        judged_at = dict(zip(simulated, self._judge([p for p, r in zip(points, rates) if not over[r]], simulated)))
        for rate in rates:
            judged = judged_at.get(rate)
            if judged is None:
                mean = pd.Series(math.nan, index=shown)
                met = False
                table_rows.append([f"{num(rate)} req/s", f"{rate / self.rate:.2f}", *[OVER] * len(tabled), "no"])
            else:
                # a stopped run's figures cover only its start: shown as stopped, left out of the figures
                mean = judged.rows.select_dtypes("number").mean()
                if judged.stopped:
                    mean[shown] = math.nan
                met = judged.verdict.met
                figures_of = [show(mean[name]) for name, show in tabled]
                table_rows.append([f"{num(rate)} req/s", f"{rate / self.rate:.2f}",
                                   *([STOPPED] * len(figures_of) if judged.stopped else figures_of),
                                   ("yes" if met else "no") + ("" if judged.verdict.decided else " (undecided)")])
            met_by_rate[rate] = met
            frame.append({"rate": rate, names.TTFT_P95: mean[names.TTFT_P95], names.TPOT_P95: mean[names.TPOT_P95],
                          names.OUTPUT_TOKENS_PER_S_PER_DEVICE: mean[names.OUTPUT_TOKENS_PER_S_PER_DEVICE],
                          **{m: mean[names.slo_attainment(m)] for m in self.final.slo.targets()}})
        frame = pd.DataFrame(frame)
        passing = [r for r in rates if met_by_rate[r]]
        failing = [r for r in rates if not met_by_rate[r]]
        breaking_failing = math.nan
        if not failing:
            breaking, breaking_text = math.nan, f"above {num(rates[-1])} req/s"
        else:
            hi = failing[0]
            lo = max([r for r in passing if r < hi], default=None)
            if lo is None:
                breaking = math.nan
                breaking_text = f"below {num(hi)} req/s"
            else:
                found = max_sustainable_rate(self.final, lo=lo, hi=hi, tol=BREAKING_TOLERANCE * self.rate,
                                             above=self.rate, finest=BREAKING_FINEST * self.rate, seeds=self.seeds,
                                             workers=self.workers)
                breaking, breaking_failing = found.rate_per_s, found.failing_rate_per_s
                breaking_text = f"{num(breaking)} req/s (fails at {num(breaking_failing)} req/s)"
        headroom = breaking / self.rate - 1 if math.isfinite(breaking) else math.nan
        headroom_text = headroom_words(breaking, breaking_failing, self.rate) if math.isfinite(headroom) else (
            f"more than {percent(rates[-1] / self.rate - 1, 0)}" if not failing else "-")
        # N+1: the deployment with one replica down, simulated at the target rate
        if self.replicas > 1:
            down = self._judge([{**self.config, REPLICAS_KEY: self.replicas - 1}], [self.rate])[0]
            down_met = down.verdict.met
            shown_down = ("its runs stopped once sure to miss them" if down.stopped
                          else f"attainment {percent(down.rows[names.SLO_ATTAINMENT].mean())}")
            down_text = f"{'meets' if down_met else 'misses'} the targets ({shown_down})"
        else:
            down_met, down_text = False, "no replica left"
        n_plus_one = self.replicas if down_met else self.replicas + 1
        self.n_plus_one = n_plus_one
        capacity = Table("capacity", "Breaking point, headroom and N+1", ["quantity", "value"], [
            ["breaking point", breaking_text],
            ["headroom above the target", headroom_text],
            [f"one replica down ({self.replicas - 1} of {self.replicas})", down_text],
            ["replicas for N+1", f"{n_plus_one} ("
             + ("the recommendation already survives one down" if down_met else f"{self.replicas} + 1 spare") + ")"]],
            note=f"breaking point: highest rate meeting the SLO targets, bisected to {BREAKING_TOLERANCE:.0%} of the "
                 f"target and on until the step is below the headroom (to {BREAKING_FINEST:.2%} at most); a headroom "
                 "the step cannot resolve is given as the range it lies in")
        latency = {"ttft": frame[names.TTFT_P95], "tpot": frame[names.TPOT_P95]}
        on_frontier = {metric: frame.index.isin(pareto_frontier(
            frame, latency=column.name, throughput=names.OUTPUT_TOKENS_PER_S_PER_DEVICE).index)
            for metric, column in latency.items()}
        limits = {"ttft": self.final.slo.ttft_s, "tpot": self.final.slo.tpot_s}
        targets = {m: p for m, (_, p) in self.final.slo.targets().items()}
        self.sections.append(Section(
            "load", "Load: frontier, SLO attainment, breaking point, headroom and N+1",
            [f"The recommended deployment ({counted(self.replicas, 'replica')}) from {LOAD_FACTORS[0]:g} to "
             f"{LOAD_FACTORS[-1]:g} times the target rate, on the same requests per seed."],
            [Table("load-points", "SLO attainment against load", ["rate", "x target", "P95 TTFT", "P95 TPOT",
                                                                  "SLO attainment", "output tok/s per device",
                                                                  "targets met"], table_rows,
                   note="; ".join(note for label, note in ((STOPPED, STOPPED_NOTE), (OVER, OVER_NOTE))
                                  if any(row[2] == label for row in table_rows))), capacity],
            [Figure("attainment-figure", "SLO attainment against load (dotted: the percentile targets)",
                    figures.load_curve(frame["rate"], {m: frame[m] for m in targets}, targets, self.rate, breaking,
                                       "attainment-figure")),
             Figure("frontier-figure", "Latency/throughput frontier of the load points: P95 TTFT and P95 TPOT "
                                       "(dashed: the SLO limit)",
                    figures.frontier(frame[names.OUTPUT_TOKENS_PER_S_PER_DEVICE], latency, on_frontier,
                                     LOAD_FACTORS, limits, "frontier-figure"))]))
        self.summary += [Fact("breaking point", "capacity", "breaking point", "value"),
                         Fact("headroom above the target", "capacity", "headroom above the target", "value"),
                         Fact("replicas for N+1", "capacity", "replicas for N+1", "value")]

    def _changed(self, overrides: dict, configured: Scenario | None) -> tuple[Scenario, dict]:
        """The scenario and point a change is simulated on: ``overrides`` on the recommended settings, or on
        ``configured`` (a scenario with the recommended settings and a change of its own)."""
        return (self.scenario, {**self.config, **overrides}) if configured is None else (configured, overrides)

    def _replicas_at(self, overrides: dict, configured: Scenario | None = None,
                     around: int | None = None) -> tuple[int | None, Judged | None]:
        """Fewest replicas with ``overrides`` on the recommended settings, searched near ``around`` (default:
        the recommended count), and the runs with the recommended count where the search simulated it (it
        always does at ``around`` unless the capacity bound rules it out); ``configured``: a scenario with the
        recommended settings and a change of its own (then only ``overrides`` are set on it)."""
        around = self.replicas if around is None else around
        rate = overrides.get(RATE_KEY, self.rate)
        scenario, point = self._changed(overrides, configured)
        one = variant(scenario, {**point, RATE_KEY: rate, REPLICAS_KEY: 1})
        cap = max(2 * around + 2, 4)
        # counts the fluid model's capacity bound proves too few are never simulated
        too_few = self._too_few(one, rate)

        def search(lower: int, start: int, top: int, known_failing: int) -> tuple[int | None, dict[int, Judged]]:
            return fewest_replicas(scenario, point, rate, lower, start, top, seeds=self.seeds,
                                   workers=self.workers, window_per_count=True, known_failing=known_failing)

        # ``around`` and the count below it (the usual answer), bisecting further only if both pass
        found, outcomes = (None, {}) if around <= too_few else search(max(1, around - 1), around, around, too_few)
        if found is None and around < cap:      # more are needed: from the fluid model's roomy count up
            _, upper = analytic_bracket(one, rate, cap)
            found, more = search(around + 1, max(around + 1, upper), cap, max(too_few, around))
            outcomes.update(more)
        return found, outcomes.get(self.replicas)

    def _too_few(self, one: Scenario, rate: float) -> int:
        """:func:`~llmsim.search.plan.proven_failing` for ``one`` (a scenario of one replica) at ``rate``, its
        capacity worked out once per setting: where the workload has length laws of its own the fluid model reads
        neither the rate nor the seed (:func:`~llmsim.analysis.fluid.has_length_law`), so the setting is the
        scenario at any one rate; else the scenario itself."""
        key = run_key(at_rate(one, 1.0) if has_length_law(one.workload) else one)
        if key not in self._capacities:
            self._capacities[key] = replica_capacity(one)
        return proven_failing(one, rate, self._capacities[key])

    def _judge(self, points: list[dict], rates: list[float], scenario: Scenario | None = None) -> list[Judged]:
        """Points judged as the searches judge them: windows that follow each point's rate (on ``scenario``,
        default the report's)."""
        scenario = self.scenario if scenario is None else scenario
        windows = []
        for point, rate in zip(points, rates):
            at_point = variant(scenario, {**point, RATE_KEY: rate})
            windows.append(measurement_window(scenario, rate, typical_latency_s(at_point, rate)))
        return simulate_until_decided(scenario, [{**p, RATE_KEY: r} for p, r in zip(points, rates)], windows,
                                      rates, seeds=self.seeds, workers=self.workers)

    def _peak(self) -> None:
        traffic = self.traffic
        mean_rate = traffic.mean_rate_per_s
        at_mean, _ = self._replicas_at({RATE_KEY: mean_rate},
                                       around=max(1, round(self.replicas * mean_rate / self.rate)))
        usd_replica = float(self.at_target[names.USD_PER_HOUR].mean()) / self.replicas
        rows = [["mean", f"{num(mean_rate)} req/s", str(at_mean) if at_mean else "-",
                 usd(at_mean * usd_replica * HOURS_PER_MONTH) if at_mean else "-"],
                ["peak (the target)", f"{num(self.rate)} req/s", str(self.replicas),
                 usd(self.replicas * usd_replica * HOURS_PER_MONTH)]]
        ratio = self.rate / mean_rate
        self.sections.append(Section(
            "peak", "Peak sizing: the day's peak against its mean",
            [f"Profile: {traffic.source}. The peak is {ratio:.2f} times the mean; sized for the peak, the "
             f"deployment runs at {percent(1 / ratio, 0)} of its sizing rate on average over the day."],
            [Table("peak", "Replicas for the mean and for the peak", ["sized for", "rate", "replicas",
                                                                      "USD/month"], rows)],
            [Figure("peak-figure", "Diurnal profile",
                    figures.diurnal(traffic.hours, traffic.rate_per_s, mean_rate, self.rate, "peak-figure"))]))

    def _sensitivity(self) -> None:
        """Each change is made on the typed scenario with the recommended settings: the load as a point's rate,
        the lengths and the acceptance on its workload and speculation (a change that returns None: not
        applicable)."""
        configured = variant(self.scenario, self.config)
        changes: list[tuple[str, dict, Callable[[], Scenario | None] | None]] = [
            (f"load {sign}{SENSITIVITY:.0%}", {RATE_KEY: self.rate * (1 + s * SENSITIVITY)}, None)
            for sign, s in (("-", -1), ("+", 1))]
        changes += [(f"{key.replace('_', ' ')} {sign}{SENSITIVITY:.0%}", {},
                     partial(scaled_lengths, configured, key, 1 + s * SENSITIVITY))
                    for key in ("prompt_tokens", "output_tokens") for sign, s in (("-", -1), ("+", 1))]
        if configured.speculating:
            changes += [(f"acceptance {sign}{ACCEPTANCE_STEP:g}", {},
                         partial(shifted_acceptance, configured, s * ACCEPTANCE_STEP))
                        for sign, s in (("-", -1), ("+", 1))]
        rows, labels, needed = [], [], []
        for label, overrides, change in changes:
            try:
                changed = None if change is None else change()
                if change is not None and changed is None:
                    rows.append([label, "-", "-", "-", "not applicable to this workload"])
                    continue
                found, at_current = self._replicas_at(overrides, changed)
                if at_current is None:      # the capacity bound ruled the count out: its runs are still shown
                    scenario, point = self._changed(overrides, changed)
                    at_current = self._judge([{**point, REPLICAS_KEY: self.replicas}],
                                             [overrides.get(RATE_KEY, self.rate)], scenario)[0]
            except ConfigError as error:
                rows.append([label, "-", "-", "-", f"not valid: {error.message}"])
                continue
            met = "-" if at_current is None else ("yes" if at_current.verdict.met else "no")
            attainment = "-" if at_current is None else (
                STOPPED if at_current.stopped else percent(at_current.rows[names.SLO_ATTAINMENT].mean()))
            rows.append([label, str(found) if found else "-", _change(found, self.replicas), attainment, met])
            labels.append(label)
            needed.append(found if found else math.nan)
        columns = ["change", "replicas needed", "vs recommended",
                   f"SLO attainment with {counted(self.replicas, 'replica')}", "targets met with them"]
        self.sections.append(Section(
            "sensitivity", "Sensitivity: how the answer moves",
            ["Each change is simulated on the recommended chip, layout and settings; the fewest replicas that "
             "then meet the SLO targets on every seed are searched again."],
            [Table("sensitivity", "Replicas needed under changed assumptions", columns, rows,
                   note=STOPPED_NOTE if any(row[3] == STOPPED for row in rows) else "")],
            [Figure("sensitivity-figure", "Replicas needed under each change",
                    figures.sensitivity(labels, needed, self.replicas, "sensitivity-figure"))] if labels else []))

    def _monitoring(self) -> None:
        window = measurement_window(self.scenario, self.rate, typical_latency_s(self.final, self.rate))
        result = simulate_whole(variant(self.final, window.overrides(self.rate)))
        series = monitoring_series(result, MONITOR_BINS)
        summary = summarize(result).to_dict()
        lat, util, queue = summary["latency"], summary["utilisation"], summary["queue"]
        thr = summary["throughput"]
        rows = [["QPS (completions)", num(thr["requests_per_s"])],
                ["output tokens/s", num(thr["output_tokens_per_s"])]]
        for metric in ("ttft_s", "tpot_s"):
            rows.append([f"{metric[:4].upper()} P50 / P95 / P99",
                         " / ".join(ms(lat[metric][p]) for p in ("p50", "p95", "p99"))])
        rows += [["queue length mean / max", f"{num(queue['mean_length'])} / {queue['max_length']}"],
                 ["KV cache used mean / max",
                  f"{percent(util['kv_occupancy_mean'])} / {percent(util['kv_occupancy_max'])}"],
                 ["busy (utilisation)", percent(util["busy_fraction"])], ["MFU", percent(util["mfu"])],
                 ["memory bandwidth utilisation", percent(util["bandwidth_utilisation"])]]
        self.sections.append(Section(
            "monitoring", "Monitoring view of one run at the recommendation",
            [f"One simulated run (seed {self.final.seed}, {len(result.requests):,} requests at "
             f"{num(self.rate)} requests/s) in {MONITOR_BINS} time bins, as a serving dashboard shows it; "
             f"latency percentiles by completion time, utilisation and KV cache averaged over replicas. "
             "The table covers the measurement window "
             f"({num(summary['window_s'][0])}-{num(summary['window_s'][1])} s)."],
            [Table("monitoring", "The run's measurement window", ["metric", "value"], rows)],
            [Figure("monitoring-figure",
                    "Dashboard: QPS, tokens/s, TTFT/TPOT percentiles, queue, KV cache, utilisation",
                    figures.monitoring(series, {"ttft": self.final.slo.ttft_s, "tpot": self.final.slo.tpot_s},
                                       "monitoring-figure"))]))

    def _assumptions(self) -> None:
        rows, sources = hardware_appendix([choice.hardware for choice in self.choices], self.original)
        error = load_yaml(Path(str(resources.files("llmsim.report").joinpath("data/cost_model_error.yaml"))))
        engine = self.original.engine.kernels.value
        # per candidate chip, what its profile records, so this table and the appendix's confidences agree
        error_rows = [[f"{chip}: step times ({standing.confidence}; {engine} kernel terms)", standing.held_out,
                       "; ".join(filter(None, [standing.basis, standing.held_out_source,
                                               "assumed: " + ", ".join(standing.assumed) if standing.assumed else ""]))]
                      for chip, standing in self.standings.items()]
        error_rows += [[e["what"], e["error"], e["source"]] for e in error["figures"]]
        import llmsim
        reproduce = [["command", self.command], ["llmsim version", llmsim.__version__],
                     ["seeds", ", ".join(map(str, self.seeds))], ["requests per run", f"{self.requests:,}"],
                     ["measurement", "each point over a window that follows its rate (warm-up at least the "
                                     "scenario's and 5 mean latencies, measurement at least 20 mean latencies and "
                                     "500 requests), judged with 2 standard errors, up to 8x longer while undecided"]]
        self.sections.append(Section(
            "assumptions", "Assumptions and reproducibility",
            ["Every hardware figure the candidates use is listed, with its confidence and source, in the appendix. "
             "Prices and efficiencies marked `assumption` move every cost and latency above: replace them with "
             "your own contract and a calibration."],
            [Table("cost-model-error", "The cost model's measured error", ["what", "error", "source"], error_rows),
             Table("reproduce", "Reproduce this report", ["item", "value"], reproduce)]))
        self.sections.append(Section(
            "hardware", "Appendix: hardware figures",
            ["Each figure of each candidate chip's profile once, with its confidence (`datasheet`, `measured`, "
             "`unverified` or `assumption`) and the number of its source in the list below."],
            [Table("hardware-figures", "Hardware figures", ["chip", "figure", "value", "confidence", "source"], rows,
                   cites="source")],
            sources=sources))

    # -- text helpers --------------------------------------------------------------------

    def _targets_text(self) -> str:
        return ", ".join(f"P{p:g} {m.upper()} <= {ms(limit)}" for m, (limit, p) in self.original.slo.targets().items())

    def _arrival_text(self) -> str:
        arrival = self.scenario.workload.arrival
        if arrival is None:         # a report plans rate-driven workloads (check_rate_driven)
            raise AssertionError("a report's scenario has an arrival process")
        cv = getattr(arrival, "cv", None)
        return f"{arrival.process}" + (f" (CV {num(cv)})" if cv else "")


def headroom_words(passing: float, failing: float, rate: float) -> str:
    """The headroom above ``rate`` of a breaking point bracketed by [passing, failing]: one figure when
    the bracket is narrower than it (to whole percents, or one decimal below 10%), else the range."""
    low, high = passing / rate - 1, failing / rate - 1
    if not math.isfinite(high) or high - low < low:
        return percent(low, 0 if low >= 0.1 else 1)
    return f"{percent(low, 1)} to {percent(high, 1)} (the bisection's step)"


def monitoring_series(result, bins: int) -> dict[str, np.ndarray]:
    """A run binned over [0, end of arrivals]: rates per bin, latency percentiles of the requests
    finishing in it, time-averaged queue length, and KV use, busy fraction and MFU averaged over replicas."""
    stop = max(result.arrival_window_s, 1e-9)
    edges = np.linspace(0.0, stop, bins + 1)
    width = edges[1] - edges[0]
    centre = (edges[:-1] + edges[1:]) / 2
    records, it = result.requests, result.iterations
    finished = records[records["status"] == "finished"]
    which = np.clip(np.digitize(finished["finish_s"], edges) - 1, 0, bins - 1)
    series = {"time_s": centre,
              "arrivals_per_s": np.histogram(records["arrival_s"], edges)[0] / width,
              "completions_per_s": np.histogram(finished["finish_s"], edges)[0] / width,
              "output_tokens_per_s": np.histogram(it["end_s"], edges, weights=it["tokens_out"])[0] / width,
              "prefill_tokens_per_s": np.histogram(it["end_s"], edges, weights=it["prefill_tokens"])[0] / width}
    for metric in ("ttft", "tpot"):
        values = finished[f"{metric}_s"].to_numpy()
        for p in (50, 95, 99):
            series[f"{metric}_p{p}_s"] = np.array([np.nanpercentile(values[which == b], p) if np.any(which == b)
                                                   and np.isfinite(values[which == b]).any() else np.nan
                                                   for b in range(bins)])
    replicas = result.scenario.deployment.replicas
    pp = result.scenario.deployment.pipeline_parallel
    busy = np.histogram(it["end_s"], edges, weights=it["duration_s"])[0] / (width * replicas * pp)
    series["busy"] = np.minimum(busy, 1.0)
    weights = it["duration_s"] * it["mfu"]
    series["mfu"] = np.histogram(it["end_s"], edges, weights=weights)[0] / (width * replicas * pp)
    kv = np.histogram(it["end_s"], edges, weights=it["kv_used_blocks"] * it["duration_s"])[0]
    kv_time = np.histogram(it["end_s"], edges, weights=it["duration_s"])[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        series["kv_used"] = np.where(kv_time > 0, kv / kv_time / result.kv_blocks_per_replica, 0.0)
    series["queue_length"] = _time_average_queue(result.queue_length, edges)
    return series


def _time_average_queue(queue: pd.DataFrame, edges: np.ndarray) -> np.ndarray:
    """Total waiting requests (all queues), time-averaged over each bin."""
    changes = queue.sort_values("time_s", kind="stable")
    current: dict[int, int] = {}
    change_times, change_totals = [0.0], [0]
    for q, t, length in zip(changes["queue"], changes["time_s"], changes["length"]):
        current[q] = length
        change_times.append(t)
        change_totals.append(sum(current.values()))
    times, totals = np.asarray(change_times), np.asarray(change_totals, dtype=float)
    out = np.zeros(len(edges) - 1)
    for b in range(len(edges) - 1):
        grid = np.unique(np.concatenate([[edges[b], edges[b + 1]], times[(times > edges[b]) & (times < edges[b + 1])]]))
        level = totals[np.searchsorted(times, grid[:-1], side="right") - 1]
        out[b] = float((level * np.diff(grid)).sum() / (edges[b + 1] - edges[b]))
    return out


def hardware_appendix(chips: Sequence[str], scenario: Scenario) -> tuple[list[list[str]], list[str]]:
    """Rows ``[chip, figure, value, confidence, source number]`` for the figures of each chip (a chip
    named twice, by two of its names, once), and the distinct sources they cite, numbered from 1 in the
    order first cited. A source's line breaks and runs of spaces are one space, so the same text
    wrapped differently is one source."""
    rows: list[list[str]] = []
    numbers: dict[str, int] = {}
    seen: set[str] = set()
    for chip in chips:
        figures = hardware_figures(chip, scenario)
        if not figures or figures[0][0] in seen:
            continue
        seen.add(figures[0][0])
        for name, figure, value, source, confidence in figures:
            number = numbers.setdefault(" ".join(source.split()), len(numbers) + 1)
            rows.append([name, figure, value, confidence, str(number)])
    return rows, list(numbers)


def hardware_figures(name: str, scenario: Scenario) -> list[list[str]]:
    """Every ``{value, source, confidence}`` figure of a chip's profile that the scenario's engine
    prices with, as rows ``[chip, figure, value, source, confidence]``: of ``kernels.engines`` (other
    engines' kernel terms) only the one its ``engine.kernels`` picks. A profile's
    path is relative to the scenario, as in its ``hardware`` and ``plan.hardware`` keys (a path given
    by ``--hardware`` is already absolute)."""
    where = Node(None, file=scenario.path, base_dir=Path(scenario.source_dir or "."))
    profile = lookup_hardware(name, where, "hardware")
    data = profile_data(profile.path) if profile.path else {}
    engine = scenario.engine.kernels.value
    rows = []

    def walk(node, path):
        if isinstance(node, dict) and "source" in node and "value" in node:
            rows.append([profile.name, path, str(node["value"]), str(node["source"]), str(node.get("confidence", ""))])
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "calibration" or (path == "kernels.engines" and key != engine):
                    continue
                walk(value, f"{path}.{key}" if path else str(key))

    walk(data, "")
    return rows


def _class_row(traffic_class, workload) -> list[str]:
    """One traffic class's settings as a row (lengths: its own, else the workload's)."""
    c = traffic_class
    prompt = c.prompt_tokens or workload.prompt_tokens
    output = c.output_tokens or workload.output_tokens
    return [c.name, "own arrivals" if c.share is None else percent(c.share, 0), str(c.priority), num(c.weight),
            str(c.reserved_seqs), "engine's" if c.queue_timeout_s is None else ms(c.queue_timeout_s),
            c.on_timeout or "engine's", num(prompt.mean()) if prompt else "-", num(output.mean()) if output else "-"]


def _margin(value, limit) -> str:
    if limit is None or not math.isfinite(value):
        return "-"
    return percent(1 - value / limit, 0)


def _change(found, base: int) -> str:
    if not found:
        return "more than searched"
    return "same" if found == base else f"{found - base:+d}"


def scaled_lengths(scenario: Scenario, key: str, factor: float) -> Scenario | None:
    """``scenario`` with its workload's ``key`` lengths (``prompt_tokens``, ``output_tokens``) at ``factor`` times
    their mean (:meth:`~llmsim.workload.lengths.LengthDistribution.scaled`), checked as the reader checks a length
    (None: no such length, or none with a parameter to scale)."""
    workload = scenario.workload
    length = getattr(workload, key)
    scaled = None if length is None else length.scaled(factor)
    if scaled is None:
        return None
    check_mean_kept(scaled, Node({}, file=scenario.path, path="workload"), key, scaled.stated_mean)
    return replace(scenario, workload=replace(workload, **{key: scaled}))


def shifted_acceptance(scenario: Scenario, step: float) -> Scenario | None:
    """``scenario`` with its speculation's per-token acceptance rate moved by ``step`` (clipped to [0.01, 0.99]):
    bernoulli and positional by their alpha, beta by its mean at the same concentration (a + b); None for a
    predicted or replayed acceptance. The moved acceptance is stated, as a scenario's own would be."""
    spec = scenario.speculation
    assert spec is not None                 # asked only of a speculating scenario
    acceptance = spec.acceptance

    def clip(v: float) -> float:
        return float(min(max(v, 0.01), 0.99))

    if acceptance.process in (AcceptanceProcess.BERNOULLI, AcceptanceProcess.POSITIONAL):
        moved = replace(acceptance, alpha=clip(acceptance.alpha + step), measured=True)
    elif acceptance.process is AcceptanceProcess.BETA:
        total = acceptance.beta_a + acceptance.beta_b
        mean = clip(acceptance.beta_a / total + step)
        moved = replace(acceptance, beta_a=mean * total, beta_b=(1 - mean) * total, measured=True)
    else:
        return None
    return replace(scenario, speculation=replace(spec, acceptance=moved))

