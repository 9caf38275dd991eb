"""How long a search simulates each point, and how sure its verdict on the SLO targets is.

A search (``plan``, ``recommend``, ``max_sustainable_rate``) asks of each point one question:
do the requests arriving in the steady state meet the percentile targets? Two things make a
short run answer it wrongly. A run shorter than its warm-up has no steady state at all (4,000
requests at 1,000 req/s arrive in 4 s, inside a 30 s warm-up), and a load slightly beyond
capacity builds its queue slowly, so a short window passes what a long one fails. So:

**The window follows the question, not the scenario's request count.** At a total rate
``lambda`` the warm-up lasts at least the scenario's own (the transient is a property of the
system, measured in seconds, not requests) and ``WARMUP_LATENCIES`` mean end-to-end
latencies; the measurement lasts at least ``MEASURED_LATENCIES`` of them (so each of the 20
batches of the batch means spans about one request lifetime and the batches are nearly
independent) and ``MEASURED_REQUESTS`` requests (enough for 20 batches; a verdict that needs more
precision gets it by escalation, below). The scenario's own request count is kept as a floor where the
question is the scenario's own (``plan``, a report); a bisection's probes (``recommend``) start from the
rule's window alone (``own_floor=False``), since the scenario's count sizes the question it asks at its own
rate, not a probe at another: each probe's verdict carries its standard error and an undecided one is
measured longer, so the window it rests on is as long as its verdict needs. The mean
latency comes from the fluid model (:mod:`llmsim.analysis.fluid`; a disaggregated deployment's pools and link:
:mod:`llmsim.analysis.fluid_disaggregated`) at the point's per-replica rate, or, where it
has none (static batching, overload), from the SLO limits themselves (the end-to-end time of a
request that just meets them). The request count is then ``lambda`` times the window. Under a diurnal
arrival the measurement is rounded up to whole cycles, so that it sees the mean rate the point stands for
rather than the busy or quiet phase that follows the warm-up; ``recommend`` refuses, before simulating, a cycle
longer than one run may simulate at the scenario's rate (:func:`check_cycle_fits`).

**Sessions start stationary.** Multi-turn sessions arriving at a constant rate start with conversations
already in progress (``workload.sessions.start: stationary``, the M/G/inf equilibrium), so the turn rate is
steady from the first second; the warm-up then also covers the time until at most 5% of the turns arriving
find their history uncached (:meth:`~llmsim.workload.sessions.Sessions.cold_time_s`). A session rate that
changes with time starts empty, and the warm-up covers the turn rate's fill instead
(:meth:`~llmsim.workload.sessions.Sessions.fill_time_s`).

**A verdict carries its uncertainty.** Every run's summary has, per SLO limit, the share of
the window's requests within it and that share's batch-means standard error, and whether its
TTFT still rises across the window (``queue.steady``). A point *passes* when, for every limit,
the attainment minus ``Z`` standard errors (pooled over seeds) reaches the target and the
queue is steady; it *fails* when for some limit the attainment plus ``Z`` standard errors
stays below the target; otherwise it is undecided, and the point is measured again with a
measurement twice as long, up to ``ESCALATIONS`` times (and ``MAX_REQUESTS`` requests). A
point still undecided then is judged on its estimate, and says so (``Verdict.decided``).

**A longer measurement continues the run.** Where one run is the point's whole verdict (one seed, as a
bisection's probes are), that run carries the arrivals of the longest measurement the point may need and is
judged at the end of each shorter one inside it, by the same rule, once the requests that arrived by then
have all left (:mod:`llmsim.sim.checkpoints`); it stops at the first that settles the verdict. A point
decided on ``2^j W`` costs one run of that window, not ``W + 2W + ... + 2^j W`` from scratch. A window's
requests are those a run of that window simulates (a trace's first requests do not depend on its length),
but they are not drained with the arrivals stopped: the last of them share the engine with the next
arrivals, as in a steady state, where a run ending there would serve them faster (a window that a run
ending there passes can so fail here, on requests closer to the long run's). A verdict pooled over seeds
simulated apart is judged on whole runs, each round twice as long as the last.

**A run sure to fail stops.** Inside :func:`stopping_decided_runs` (a report uses it) a run stops once the
requests of its window already sure to miss a limit leave its attainment below :func:`decided_fail_below` the
target (:class:`DecidedFailStop`, :mod:`llmsim.sim.missed`): the share ``a`` at which ``a`` plus ``Z`` times the
largest standard error batch means of a share ``a`` can have (``sqrt(a (1 - a) / (batches - 1))``) reaches the
target, so the whole run's verdict would have been a decided fail whatever its requests still to be served
show. Its rows cover only what was simulated (``stopped_by``: ``missed``) and name the limits the run stopped on
(``stopped_on``: ``ttft``, ``e2e``, ``ttft,e2e``, with classes ``<class>.ttft``): a stopped seed is known to be
below the bound on those only, and may have met any other limit entirely. A point with stopped seeds misses the
target on its estimate, and is a decided fail where, for some limit, its pooled figure fails with each seed stopped
on that limit at its bound, each seed stopped only on others at its best (every request within it) and the other
seeds at their own figures (:func:`_fails_whole`): so always where every seed stopped on the same limit (its
pooled standard error is at most the seeds' mean), never on its own where they stopped on different limits.

**A run that can only fail stops sooner.** A search that takes an undecided fail as failed
(``escalate_failing=False``, ``recommend``'s bisections) asks of a point judged on one run only whether
that run passes: a decided and an undecided fail give the same answer. Inside such a block its runs stop
once their window's sure misses already leave a limit's share below its target at all
(:data:`FAILING_MARGIN` instead of :class:`DecidedFailStop`): the whole run's estimate would have missed the
target, so its verdict would have been a fail. Such a stop is judged an undecided fail, which is what it
shows; a verdict pooled over seeds keeps :class:`DecidedFailStop` (one seed's shortfall can be another's surplus).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from llmsim.analysis import names
from llmsim.analysis.fluid import FluidModel
from llmsim.analysis.fluid_disaggregated import DisaggregatedFluid, fluid_model
from llmsim.analysis.metrics import class_summaries, slo_summary
from llmsim.analysis.statistics import BATCHES, rising_trend
from llmsim.analysis.summary import flatten
from llmsim.config.policies import ExecutorKind
from llmsim.config.progress import QUIET, Progress
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import SLO_METRICS, Scenario
from llmsim.scenario.variants import SESSION_START_KEY
from llmsim.search.sweeps import judging_at_checkpoints, missed_stop, run_points, stopping_missed_runs
from llmsim.sim.checkpoints import Checkpoints
from llmsim.sim.missed import MissedStop, ShortfallStop
from llmsim.sim.result import StopReason
from llmsim.sim.sensor import targets_of
from llmsim.workload.arrivals import RenewalProcess
from llmsim.workload.generate import generate_trace
from llmsim.workload.profiles import Diurnal

WARMUP_LATENCIES = 5          # warm-up: at least this many mean end-to-end latencies
MEASURED_LATENCIES = 20       # measurement: at least this many (one per batch of the batch means)
MEASURED_REQUESTS = 500       # and at least this many requests (more when the verdict is undecided)
ESCALATIONS = 3               # an undecided point is measured 2x, 4x, 8x longer
MAX_REQUESTS = 2_000_000      # requests per simulation, whatever the window asks
Z = 2.0                       # standard errors between an attainment and its target for a verdict
WIDEST_STDERR = 0.5 / math.sqrt(BATCHES - 1)    # the widest batch-means standard error a share can have
FAILING_MARGIN = 1e-9         # a stop that shows only a fail on the estimate: floating point's slack, no more


@dataclass(frozen=True)
class Window:
    """Warm-up and measurement, in simulated seconds, of one point's run.

    ``trace_requests`` > 0: the run replays its scenario's whole (rescaled) trace, of that many
    requests, which sets the measurement; it cannot be made longer. ``requests_per_arrival``: the
    requests one arrival brings (a session's mean turns; 1 otherwise), since the rate counts
    arrivals and the scenario's request count counts requests."""
    warmup_s: float
    measure_s: float
    trace_requests: int = 0
    requests_per_arrival: float = 1.0
    stationary_sessions: bool = False

    @property
    def whole_trace(self) -> bool:
        return self.trace_requests > 0

    def simulated_requests(self, rate_per_s: float) -> int:
        """The requests a run of this window simulates."""
        return self.trace_requests or min(self.requests(rate_per_s), MAX_REQUESTS)

    @property
    def length_s(self) -> float:
        return self.warmup_s + self.measure_s

    def requests(self, rate_per_s: float) -> int:
        return max(1, math.ceil(rate_per_s * self.requests_per_arrival * self.length_s))

    def longer(self, times: int = 1) -> Window:
        """The window measured ``2^times`` times as long."""
        return replace(self, measure_s=2 ** times * self.measure_s)

    def lengthens(self, rate_per_s: float) -> bool:
        """Whether a run at this rate can be measured twice as long: not a whole trace (it cannot), and
        within :data:`MAX_REQUESTS`."""
        longer = self.longer()
        return not longer.whole_trace and longer.requests(rate_per_s) <= MAX_REQUESTS

    def overrides(self, rate_per_s: float) -> dict:
        """Scenario overrides that make a run at this rate cover the window."""
        if self.whole_trace:
            return {"simulation.warmup": f"{float(self.warmup_s)!r} s"}
        return {"workload.num_requests": self.simulated_requests(rate_per_s), "workload.duration": None,
                "simulation.warmup": f"{float(self.warmup_s)!r} s",
                **({SESSION_START_KEY: "stationary"} if self.stationary_sessions else {})}


def typical_latency_s(scenario: Scenario, rate_per_s: float,
                      fluid: FluidModel | DisaggregatedFluid | None = None) -> float:
    """The mean end-to-end latency a search's window is measured in: the fluid model's at this
    total rate, else (not modelled, or beyond its capacity) that of a request just within the
    strictest SLO limits (:func:`binding_targets`: TTFT limit + TPOT limit x mean output), else the E2E limit.

    ``fluid``: the scenario's fluid model where already built (None: built here). A model reads neither the
    arrival rate nor, where the workload has length laws of its own
    (:func:`~llmsim.analysis.fluid.has_length_law`), the seed, so one built for a setting serves every rate
    and seed a search probes it at, figure for figure."""
    try:
        predicted = (fluid_model(scenario) if fluid is None else fluid).evaluate(rate_per_s)
        e2e = float(predicted["e2e_mean_s"].iloc[0])
        if math.isfinite(e2e) and e2e > 0:
            return e2e
    except ConfigError:
        pass
    limits = {metric: limit for metric, (limit, _) in binding_targets(scenario).items()}
    if "ttft" in limits and "tpot" in limits:
        return limits["ttft"] + limits["tpot"] * mean_output_tokens(scenario)
    rest = [limits[metric] for metric in ("e2e", "ttft") if metric in limits]
    return max(rest) if rest else 1.0


def binding_targets(scenario: Scenario) -> dict[str, tuple[float, float]]:
    """SLO metric -> (limit in seconds, percentile): the strictest limit on it that any traffic class (or,
    without classes, the top-level SLO) sets, with that limit's percentile (of equal limits, the highest):
    what the fluid model's figures are held to.

    The strictest binds because the classes share one engine: every running request waits for the same
    iterations, so all classes decode at one TPOT, and the fluid model, which has no scheduling order, gives
    every class the same TTFT and the mix's mean end-to-end latency. A rate whose figure exceeds one class's
    limit fails that class, and a deployment must meet every class's targets. At the rate where the
    strictest limits just hold, a request of the mix decodes at the strictest TPOT after the strictest TTFT,
    which is the request :func:`typical_latency_s` sizes a window on beyond the fluid model's capacity."""
    limits: dict[str, tuple[float, float]] = {}
    for target in targets_of(scenario.slo, scenario.workload.class_names):
        held = limits.get(target.metric)
        if held is None or (target.limit_s, -target.percentile) < (held[0], -held[1]):
            limits[target.metric] = (target.limit_s, target.percentile)
    return limits


def mean_output_tokens(scenario: Scenario) -> float:
    workload = scenario.workload
    if workload.trace is not None:
        return float(np.mean(workload.trace.output_tokens))
    if workload.output_tokens is None:       # traffic classes with lengths of their own: their mix
        return float(np.mean(generate_trace(workload, scenario.seed).output_tokens))
    return float(workload.output_tokens.mean())


def replayed_requests(workload) -> int:
    """How many requests a replay of the workload's trace simulates (sampled, cut to its count)."""
    transforms = workload.transforms
    count = len(workload.trace) * (transforms.sample_fraction or 1.0 if transforms else 1.0)
    return max(1, int(round(min(count, workload.num_requests or count))))


def measurement_window(scenario: Scenario, rate_per_s: float, latency_s: float, *, own_floor: bool = True) -> Window:
    """The window for a point at ``rate_per_s`` (total) whose requests take ``latency_s`` on average;
    ``own_floor=False``: without the scenario's own arrival window as a floor on the measurement (module
    docstring).

    A replayed trace is replayed whole at every rate (its window, filters and sampling say which
    traffic the question is about; its first requests alone could be its quietest hour): the
    warm-up follows the rule above within the trace's span at this rate."""
    workload = scenario.workload
    own_rate = workload.rate_per_s
    if workload.trace is not None:
        requests = replayed_requests(workload)
        span_s = requests / rate_per_s
        own_warmup_s = scenario.simulation.warmup_s
        warmup_s = max(0.1 * span_s if own_warmup_s is None else own_warmup_s, WARMUP_LATENCIES * latency_s)
        return Window(warmup_s, max(span_s - warmup_s, 0.0), trace_requests=requests)
    # Sessions: the rate counts conversations, the request counts turns. At a constant session rate the
    # run starts with sessions in progress (stationary: the turn rate is steady from the start) and the
    # warm-up covers the turns whose history the KV cache has not seen; otherwise the turn rate only
    # reaches its steady state once the sessions started early have sent their later turns.
    sessions = workload.sessions
    turns = workload.requests_per_arrival
    stationary = sessions is not None and isinstance(workload.arrival, RenewalProcess)
    fill_s = 0.0 if sessions is None else sessions.cold_time_s() if stationary else sessions.fill_time_s()
    if workload.num_requests is not None:
        own_requests: float = workload.num_requests
    else:
        assert workload.duration_s is not None      # the reader asks for one of the two
        own_requests = workload.duration_s * own_rate * turns
    own_warmup_s = scenario.simulation.warmup_s
    if own_warmup_s is None:                 # the scenario's default: 10% of its own arrival window
        own_warmup_s = 0.1 * own_requests / (own_rate * turns)
    warmup_s = max(own_warmup_s, WARMUP_LATENCIES * latency_s, fill_s)
    request_rate = rate_per_s * turns
    measure_s = max(MEASURED_REQUESTS / request_rate, MEASURED_LATENCIES * latency_s,
                    own_requests / request_rate - warmup_s if own_floor else 0.0)
    arrival = workload.arrival
    if isinstance(arrival, Diurnal):
        # Whole cycles: part of one would measure its busy or its quiet phase (whichever follows the warm-up),
        # not the mean rate the point stands for.
        measure_s = max(1, math.ceil(measure_s / arrival.period_s - 1e-9)) * arrival.period_s
    return Window(warmup_s, measure_s, requests_per_arrival=turns, stationary_sessions=stationary)


def check_cycle_fits(scenario: Scenario) -> None:
    """A search measures whole cycles of a diurnal arrival (:func:`measurement_window`): refuse, before any
    simulation, one whose cycle at the scenario's own rate holds more requests than a run may simulate
    (:data:`MAX_REQUESTS`)."""
    workload = scenario.workload
    arrival = workload.arrival
    if not isinstance(arrival, Diurnal) or workload.trace is not None:
        return
    turns = workload.requests_per_arrival
    cycle_requests = arrival.mean_rate_per_s * turns * arrival.period_s
    if cycle_requests > MAX_REQUESTS:
        longest_s = MAX_REQUESTS / (arrival.mean_rate_per_s * turns)
        peak = arrival.mean_rate_per_s * (1 + arrival.amplitude)
        raise ConfigError(f"a search measures whole cycles of a diurnal arrival, and one cycle at "
                          f"{arrival.mean_rate_per_s:g}/s is {cycle_requests:,.0f} requests (a run simulates at "
                          f"most {MAX_REQUESTS:,})", file=scenario.path, key="workload.arrival.period",
                          value=f"{arrival.period_s:g} s",
                          allowed=f"a period of at most {longest_s:,.0f} s at this rate; or, to size for the "
                                  f"busiest hour, a steady arrival at the peak rate "
                                  f"(process: poisson, rate: {peak:g}/s)")


@dataclass(frozen=True)
class Verdict:
    """Whether a point meets the SLO targets, and how sure the simulation is of it.

    ``margins``: per limit (or ``"attainment"`` for a joint target), the attainment minus its
    target and ``Z`` pooled standard errors. ``decided``: the intervals settle it (or a target is
    missed beyond doubt); False when the longest window still left it open and ``met`` is the
    point estimate.
    """
    met: bool
    decided: bool
    steady: bool
    margins: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def worst_margin(self) -> tuple[float, float]:
        return min(self.margins.values(), default=(math.nan, math.nan))


def decided_fail_below(share: float, z: float = Z, batches: int = BATCHES) -> float:
    """The attainment below which a run's verdict on a limit whose percentile target is ``share`` is a decided
    fail whatever its standard error: the smaller root ``a`` of ``a + z sqrt(a (1 - a) / (batches - 1)) =
    share``. Batch means of a 0/1 series with mean ``a`` lie in [0, 1], so their sample variance is at most
    ``a (1 - a) batches / (batches - 1)`` (``x^2 <= x`` on [0, 1]) and their standard error at most
    ``sqrt(a (1 - a) / (batches - 1))``; ``a`` plus ``z`` times that rises with ``a`` up to past any target
    below 1, so every attainment below the root fails by more than ``z`` standard errors."""
    c = z * z / (batches - 1)
    return (2 * share + c - math.sqrt(c * c + 4 * c * share * (1 - share))) / (2 * (1 + c))


@dataclass(frozen=True)
class DecidedFailStop(MissedStop):
    """Stop once the share within a limit is sure to stay below :func:`decided_fail_below` its target: the
    whole run's verdict would then be a decided fail on its own figures (module docstring).

    The summary's share is over the window's ``counted`` requests, its standard error over the batches of the
    first ``usable = counted - counted % batches`` of them, whose share lies within ``delta = (counted %
    batches) / usable`` of it; so the stop holds the share below ``decided_fail_below(target - delta) - delta``,
    where the batches' share is below ``decided_fail_below(target - delta)`` and the share plus ``z`` of their
    standard errors below ``target - delta + delta``."""
    z: float = Z
    batches: int = BATCHES

    def allowed(self, share: float, counted: int) -> int:
        odd = counted % self.batches
        delta = odd / (counted - odd) if counted > odd else 1.0
        # the 1e-9: a product that is whole may round below it; allowing more only stops later
        return math.floor((1 - decided_fail_below(share - delta, self.z, self.batches) + delta) * counted + 1e-9)

    def highest(self, share: float) -> float:
        return decided_fail_below(share, self.z, self.batches)


DECIDED_FAIL = DecidedFailStop(2 * BATCHES)       # stop rule of stopping_decided_runs (and judge's default)


def judge(rows: pd.DataFrame, target: float | None = None, stop: MissedStop = DECIDED_FAIL) -> Verdict:
    """The verdict from one point's runs (one row per seed, flattened summaries).

    ``target`` None: every limit's percentile target; else the joint attainment (the share of
    requests within every limit at once) must reach ``target``. ``stop``: the stop rule
    (:class:`~llmsim.sim.missed.MissedStop`) the runs stopped as missed ran under: a run it stopped on a
    limit was below its ``highest`` share there.
    """
    errors = rows["error"].fillna("").to_numpy()
    failed = errors != ""
    if failed.any():
        raise RuntimeError(f"a simulation failed: {errors[failed][0]}")
    checks = _checks(rows, target)
    if not checks:
        raise ConfigError("the scenario sets no SLO to meet", key="slo", has_value=False,
                          allowed="ttft, tpot and/or e2e limits")
    steady = bool(rows[names.STEADY].to_numpy(dtype=bool).all())
    margins, passes, fails = {}, [], []
    for name, (column, stderr_column, wanted) in checks.items():
        attainment = float(rows[column].mean())
        stderr = float(np.sqrt((rows[stderr_column].to_numpy(dtype=float) ** 2).sum()) / len(rows))
        margin, spread = attainment - wanted, Z * stderr
        margins[name] = (margin, spread)
        passes.append(margin >= 0 and margin - spread >= 0)       # NaN spreads compare False: undecided
        fails.append(margin < 0 and margin + spread < 0)
    met = all(margin >= 0 for margin, _ in margins.values()) and steady
    decided = any(fails) or (all(passes) and steady)
    stopped_on = _stopped_on(rows)
    if stopped_on is not None:       # sure to miss on the stopped seeds (module docstring)
        if target is not None:
            raise ValueError("a run stopped on its percentile targets cannot be judged on a joint attainment target")
        decided = any(_fails_whole(rows, check, stopped_on, stop, name) for name, check in checks.items())
        return Verdict(met=False, decided=decided, steady=steady, margins=margins)
    return Verdict(met=met and not any(fails), decided=decided, steady=steady, margins=margins)


def _stopped_on(rows: pd.DataFrame) -> list[set[str] | None] | None:
    """Per seed, the limits its run was stopped on as missed (``stopped_on``: empty where its row does not say),
    None for a run not so stopped; None where no run was."""
    if names.STOPPED_BY not in rows or not (rows[names.STOPPED_BY].to_numpy() == StopReason.MISSED.value).any():
        return None
    said = rows[names.STOPPED_ON] if names.STOPPED_ON in rows else pd.Series([None] * len(rows))
    return [(set(on.split(",")) if isinstance(on, str) and on else set()) if by == StopReason.MISSED.value else None
            for by, on in zip(rows[names.STOPPED_BY], said)]


def _fails_whole(rows: pd.DataFrame, check: tuple[str, str, float], stopped_on: list[set[str] | None],
                 stop: MissedStop, name: str) -> bool:
    """Whether the whole runs of a point some of whose seeds stopped as missed would have failed the limit
    ``name`` (its ``check``) beyond doubt, whatever the stopped runs' requests still to be served show.

    A seed stopped on this limit (``stopped_on``) was below ``stop``'s highest share ``h`` there, with a
    standard error at most :data:`WIDEST_STDERR`, and where ``h`` is at most :func:`decided_fail_below` the
    target its own verdict was a decided fail (share + ``Z`` standard errors below the target): its standard
    error was then at most ``(target - h) / Z`` too. The pooled figure (mean share + ``Z`` times the pooled
    standard error) rises with each share and each standard error, and along a seed's edge ``share + Z
    stderr = target`` it rises with the share (the pooled error grows by less than the seed's own), so it is
    highest with every such seed at ``h`` and the largest standard error both bounds allow. A seed stopped
    only on other limits (or on limits its row does not name) may have met this one entirely (share 1, no
    spread), and the other seeds count with their own figures. The limit fails beyond doubt where even that
    figure is at most the target (the stopped seeds' shares are below ``h``, so the whole runs' figure is
    below it), or, with no seed stopped on it (a bound that may be reached), below it. All seeds stopped on
    this limit by a rule whose stop leaves a decided fail: at most ``h`` plus ``Z`` times their mean error, the target
    (the pooled error is at most the seeds' mean), so always. A NaN figure shows nothing: not decided."""
    column, stderr_column, wanted = check
    on = np.array([limits is not None and name in limits for limits in stopped_on])
    other = np.array([limits is not None for limits in stopped_on]) & ~on
    highest = stop.highest(wanted)
    widest = min(WIDEST_STDERR, (wanted - highest) / Z) if highest <= decided_fail_below(wanted) else WIDEST_STDERR
    attainment = np.where(on, highest, np.where(other, 1.0, rows[column].to_numpy(dtype=float)))
    stderr = np.where(on, widest, np.where(other, 0.0, rows[stderr_column].to_numpy(dtype=float)))
    # n times (figure - target), summed against the target first, so that a lone seed stopped on this limit at
    # (h, (target - h) / Z) gives exactly 0
    excess = float((attainment - wanted).sum()) + Z * float(np.sqrt((stderr ** 2).sum()))
    return excess < 0 or (excess == 0 and bool(on.any()))          # NaN compares False: not shown


def best_case(rows: pd.DataFrame, runs: int) -> pd.DataFrame:
    """``rows``, the first seeds' runs of a point judged on ``runs`` seeds, with the best runs the others could
    be: every request within every limit (attainment 1, no spread) where any seed measured the limit, steady,
    not stopped. :func:`judge` on them gives, limit by limit, at least the margin the point's whole runs can
    give (each attainment is a mean over seeds, at most 1, and a limit no seed measures here is left out, as
    it is left out of the whole runs' verdict when none of them measures it), and it meets the targets
    wherever the whole runs can (a stopped or unsteady seed among ``rows`` fails both)."""
    rest = runs - len(rows)
    if rest <= 0:
        return rows
    best = rows.iloc[[0] * rest].copy()
    for column, stderr_column, _ in _checks(rows, None).values():
        best[column], best[stderr_column] = 1.0, 0.0
    best[names.STEADY] = True
    if names.STOPPED_BY in best:
        best[names.STOPPED_BY] = StopReason.COMPLETED.value
    return pd.concat([rows, best], ignore_index=True)


def stopping_decided_runs():
    """A block within which every run of a point stops once its verdict is a decided fail (module docstring)."""
    return stopping_missed_runs(DECIDED_FAIL)


def _checks(rows: pd.DataFrame, target: float | None) -> dict[str, tuple[str, str, float]]:
    """name -> (attainment column, its standard error's column, the share wanted) for every target
    a point must meet. With traffic classes every class's own targets (its section of the summary,
    ``classes.<name>.slo...``) replace the overall ones: each class must meet its SLO."""
    classes = _class_names(tuple(rows.columns))
    if classes:
        return {f"{name}.{check}": spec for name in classes
                for check, spec in _section_checks(rows, target, f"{names.CLASSES}.{name}.").items()}
    return _section_checks(rows, target, "")


def limit_checks(rows: pd.DataFrame) -> dict[str, tuple[str, str, float]]:
    """name -> (attainment column, its standard error's column, the share wanted) for every limit :func:`judge`
    holds a point's rows to without a joint target (the names its verdict's margins and a stopped run's
    ``stopped_on`` give them)."""
    return _checks(rows, None)


@lru_cache(maxsize=64)
def _class_names(columns: tuple[str, ...]) -> tuple[str, ...]:
    """The traffic classes whose sections a point's rows hold (their columns: every point of a search has the
    same, so this is worked out once)."""
    return tuple(c[len(names.CLASSES) + 1:-len(names.SLO_ATTAINMENT) - 1] for c in columns
                 if c.startswith(names.CLASSES + ".") and c.endswith("." + names.SLO_ATTAINMENT))


def _section_checks(rows: pd.DataFrame, target: float | None, prefix: str) -> dict[str, tuple[str, str, float]]:
    """:func:`_checks` of one section of the summary (``prefix``: a class's, or "" for the whole run's)."""
    if target is not None:
        return {"attainment": (prefix + names.SLO_ATTAINMENT, prefix + names.SLO_ATTAINMENT_STDERR, target)}
    return {metric: (prefix + names.slo_attainment(metric), prefix + names.slo_attainment_stderr(metric),
                     float(rows[prefix + names.slo_percentile(metric)].iat[0]) / 100)
            for metric in SLO_METRICS if prefix + names.slo_attainment(metric) in rows
            and not np.isnan(rows[prefix + names.slo_attainment(metric)].to_numpy(dtype=float)).all()}


@dataclass(frozen=True)
class Judged:
    """One point's verdict, the rows (one per seed) it rests on and the window they covered."""
    verdict: Verdict
    rows: pd.DataFrame
    window: Window

    @property
    def stopped(self) -> bool:
        """Whether a run of the point stopped once sure to miss the targets (its figures cover only part)."""
        return names.STOPPED_BY in self.rows and bool((self.rows[names.STOPPED_BY] == StopReason.MISSED.value).any())


def simulate_until_decided(scenario: str | Path | Scenario | Mapping, points: Sequence[Mapping],
                           windows: Sequence[Window], rates: Sequence[float], *, seeds: Sequence[int] | None = None,
                           workers: int | None = None, engine: ExecutorKind = ExecutorKind.PROCESSES,
                           target: float | None = None, progress: Progress = QUIET,
                           escalations: int = ESCALATIONS, escalate_failing: bool = True) -> list[Judged]:
    """Simulate each point of ``scenario`` (as :func:`~llmsim.search.sweeps.run_points` takes it) over its
    window and judge it; measure the undecided ones again twice as long, up to ``escalations`` times.

    Where one run is a point's whole verdict (one seed), that run carries the longest window the point may
    be measured over and is judged at each shorter one inside it, stopping at the first that settles the
    verdict (:mod:`llmsim.sim.checkpoints`): the window ``2^j W`` is judged on the requests a run of that
    window would have simulated, and the run goes on from there where it would have been started again. A
    verdict pooled over seeds run apart is judged on whole runs, all of a round at once, each round twice as
    long as the last.

    ``rates``: each point's total arrival rate (its window's request count follows from it).
    ``progress`` counts the simulations. ``escalations=0``: one window each, verdicts on their estimates
    (a screen that only ranks points, as ``recommend``'s class search does). ``escalate_failing=False``:
    an undecided point whose estimate fails is judged failed on the window it ran, only undecided passes
    are measured longer (a search whose answer is the highest rate shown to pass: a fail taken on its
    estimate can only keep that answer lower, never make it rest on a rate not shown to pass).
    """
    judged: list[Judged | None] = [None] * len(points)
    per_point = len(seeds) if seeds is not None and not any("seed" in p for p in points) else 1
    # Inside a stop rule, one run per point and an undecided fail taken as failed: a run stops once it cannot pass
    stop = missed_stop()
    if stop is not None and per_point == 1 and not escalate_failing and target is None:
        stop = ShortfallStop(stop.min_requests, FAILING_MARGIN)
    used = [0] * len(points)              # each point's escalations so far
    current = list(windows)
    todo = list(range(len(points)))
    while todo:
        # A point judged on one run is run over the longest window left to it, judged at the shorter ones.
        stages = {i: _stages_left(current[i], rates[i], escalations - used[i]) if per_point == 1 else 0 for i in todo}
        again = []
        for count in sorted(set(stages.values())):
            group = [i for i in todo if stages[i] == count]
            runs = [current[i].longer(count) for i in group]
            with judging_at_checkpoints(Checkpoints(count, Settled(target, escalate_failing))) if count \
                    else nullcontext(), stopping_missed_runs(stop) if stop is not None else nullcontext():
                rows_of = _simulate(scenario, [points[i] for i in group], runs, [rates[i] for i in group], seeds,
                                    per_point, workers, engine, progress)
            for i, rows in zip(group, rows_of):
                reached = _stage_reached(rows, current[i], count)
                window = current[i].longer(reached)
                used[i] += reached
                verdict = judge(rows, target, DECIDED_FAIL if stop is None else stop)
                judged[i] = Judged(verdict, rows, window)
                if asks_longer(verdict, escalate_failing) and used[i] < escalations \
                        and window.lengthens(rates[i]):
                    current[i] = window.longer()
                    used[i] += 1
                    again.append(i)
        todo = again
    return cast("list[Judged]", judged)       # every point is judged in the first round


def _simulate(scenario: str | Path | Scenario | Mapping, points: Sequence[Mapping], windows: Sequence[Window],
              rates: Sequence[float], seeds: Sequence[int] | None, per_point: int, workers: int | None,
              engine: ExecutorKind, progress: Progress) -> list[pd.DataFrame]:
    """Each point's rows (one per seed) over its window; a point repeated runs once (run_points runs a repeated
    job once: each distinct job is simulated once and its rows shared)."""
    jobs: dict[str, list[int]] = {}
    for i, (point, window, rate) in enumerate(zip(points, windows, rates)):
        jobs.setdefault(json.dumps({**point, **window.overrides(rate)}, sort_keys=True, default=str), []).append(i)
    frame = run_points(scenario, [json.loads(job) for job in jobs], seeds=seeds, workers=workers, engine=engine,
                       progress=progress)
    position_of = {i: position for position, same in enumerate(jobs.values()) for i in same}
    return [frame.iloc[position_of[i] * per_point:(position_of[i] + 1) * per_point].reset_index(drop=True)
            for i in range(len(points))]


def _stages_left(window: Window, rate_per_s: float, escalations: int) -> int:
    """How many times a point may still be measured twice as long: ``escalations``, within what a run may
    simulate (:meth:`Window.lengthens`)."""
    count = 0
    while count < escalations and window.longer(count).lengthens(rate_per_s):
        count += 1
    return count


def _stage_reached(rows: pd.DataFrame, window: Window, stages: int) -> int:
    """The window ``window.longer(j)`` a run over ``window.longer(stages)`` judged at the shorter ones covers:
    its summary's measurement, the run's own measurement halved ``stages - j`` times (one run: one row)."""
    if not stages:
        return 0
    start_s, stop_s = rows[names.WINDOW].iloc[0]
    halvings = round(math.log2(window.longer(stages).measure_s / max(stop_s - start_s, 1e-12)))
    return min(max(stages - halvings, 0), stages)


def asks_longer(verdict: Verdict, escalate_failing: bool) -> bool:
    """Whether a verdict asks for a longer measurement: undecided, and passing on its estimate unless
    ``escalate_failing`` (an undecided fail is otherwise taken as failed)."""
    return not verdict.decided and (verdict.met or escalate_failing)


@dataclass(frozen=True)
class Settled:
    """A run's checkpoint rule (:class:`~llmsim.sim.checkpoints.Checkpoints`' ``decide``): whether the verdict
    on a shorter window's requests asks for no longer measurement: decided, or (``escalate_failing`` False) an
    undecided fail, which :func:`simulate_until_decided` takes as failed."""
    target: float | None
    escalate_failing: bool

    def __call__(self, scenario: Scenario, records: pd.DataFrame, start_s: float, stop_s: float) -> bool:
        verdict = judge(window_rows(scenario, records, start_s, stop_s), self.target)
        return not asks_longer(verdict, self.escalate_failing)


def window_rows(scenario: Scenario, records: pd.DataFrame, start_s: float, stop_s: float) -> pd.DataFrame:
    """The row :func:`judge` reads, from the per-request records of a run's requests that arrived by
    ``stop_s``: its SLO figures, its classes' and whether its TTFT is steady, over ``[start_s, stop_s]``, as a
    run's summary measured over that window gives them (:func:`llmsim.analysis.metrics.summarize`)."""
    steady = records[(records["arrival_s"] >= start_s) & (records["arrival_s"] <= stop_s)]
    summary: dict = {"slo": slo_summary(steady, scenario.slo, stop_s - start_s).to_dict(),
                     "queue": {"steady": not rising_trend(steady["ttft_s"], scale=scenario.slo.ttft_s)[1]}}
    if scenario.workload.classes:
        summary["classes"] = {name: one.to_dict() for name, one in class_summaries(
            records, scenario.slo, scenario.workload.class_names, start_s, stop_s).items()}
    return pd.DataFrame([{**flatten(summary), "error": ""}])
