"""The highest arrival rate that a scenario serves within its SLO, by bisection on the rate, and the
throughput of the same engine run offline (every request waiting at once), to compare the two."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence

import pandas as pd

from llmsim.config.policies import ExecutorKind
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario
from llmsim.scenario.variants import RATE_KEY
from llmsim.search.sweeps import scenario_at
from llmsim.search.window import measurement_window, simulate_until_decided, typical_latency_s
from llmsim.sim.request import RequestStatus
from llmsim.sim.simulate import simulate_whole

MAX_BISECTIONS = 64          # halvings of [lo, hi] at most, whatever ``tol`` asks


@dataclass(frozen=True)
class SustainableRate:
    """The outcome of :func:`max_sustainable_rate`.

    ``rate_per_s`` is the highest rate seen to meet the SLO (NaN when even ``lo`` does not);
    ``failing_rate_per_s`` the lowest seen to miss it (NaN when even ``hi`` meets it): the
    answer lies between them, which are at most ``tol`` apart when both exist.
    """
    rate_per_s: float
    failing_rate_per_s: float
    target: float | None             # the attainment asked for; None: the scenario's percentile targets
    evaluations: pd.DataFrame        # one row per rate and seed tried, in the order tried


def max_sustainable_rate(scenario: str | Path | Scenario | Mapping, *, lo: float, hi: float, tol: float,
                         target: float | None = None, slo: Mapping | None = None, seeds: Sequence[int] | None = None,
                         workers: int | None = None, engine: ExecutorKind = ExecutorKind.PROCESSES,
                         above: float | None = None, finest: float | None = None) -> SustainableRate:
    """The highest arrival rate (requests/s) that meets the SLO, by bisection.

    Criterion, by default (``target`` None): the scenario's percentile targets, as
    ``llmsim plan`` and ``llmsim recommend`` judge them (``slo.percentile``, default 95: for
    each limit, the share of the requests arriving in the measurement window that finish
    within it, averaged over ``seeds``, is at least that percentile). With a ``target``
    (e.g. 0.95): ``slo.attainment``, the share within every limit at once, averaged over
    ``seeds``, is at least ``target``. Unfinished and rejected requests miss. Each rate is
    simulated over a window that follows the rate, and again longer while its confidence
    interval straddles the target (:mod:`llmsim.search.window`). ``slo``
    (e.g. ``{"ttft": "500 ms", "tpot": "50 ms"}``) is laid over the scenario's own.
    Every rate runs on the same requests per seed (common random numbers: arrival gaps
    are drawn at unit rate and scaled), so attainment falls with the rate up to noise in
    the simulated engine only, and bisection on ``[lo, hi]`` stops when the bracket is at
    most ``tol`` wide. With ``above`` (a rate, e.g. the target whose headroom is reported), it goes
    on halving until the bracket is also narrower than the answer's distance above that rate, so
    the headroom it gives is larger than its own resolution, down to a bracket of ``finest``
    (default ``tol / 8``); past that the headroom is known only as a bound.
    """
    if not 0 < lo < hi or tol <= 0:
        raise ValueError(f"need 0 < lo < hi and tol > 0 (got lo={lo}, hi={hi}, tol={tol})")
    extra = {"slo": dict(slo)} if slo else {}
    tried = []

    def meets(rate: float) -> bool:
        point = {RATE_KEY: rate, **extra}
        at_rate = scenario_at(scenario, point)
        if not at_rate.slo.defined:
            raise ConfigError("the scenario sets no SLO to meet", key="slo", has_value=False,
                              allowed="ttft, tpot and/or e2e limits, in the scenario or as slo=")
        window = measurement_window(at_rate, rate, typical_latency_s(at_rate, rate))
        judged, = simulate_until_decided(scenario, [point], [window], [rate], seeds=seeds, workers=workers,
                                         engine=engine, target=target)
        tried.append(judged.rows)
        return judged.verdict.met

    passing, failing = bisect(meets, lo, hi, tol, above, finest)
    return SustainableRate(passing, failing, target, pd.concat(tried, ignore_index=True))


def bisect(meets: Callable[[float], bool], lo: float, hi: float, tol: float, above: float | None = None,
           finest: float | None = None) -> tuple[float, float]:
    """(highest rate seen to pass, lowest seen to fail) of a criterion that passes below some rate and
    fails above it: NaN for the first when ``lo`` fails, for the second when ``hi`` passes. Halves
    ``[lo, hi]`` until it is at most ``tol`` wide and, with ``above``, narrower than ``lo - above``
    (the bracket under the distance it brackets), but never below ``finest`` (default ``tol / 8``)."""
    finest = tol / 8 if finest is None else finest
    if not meets(lo):
        return math.nan, lo
    if meets(hi):
        return hi, math.nan
    for _ in range(MAX_BISECTIONS):
        middle = (lo + hi) / 2
        resolved = hi - lo <= tol and (above is None or hi - lo < lo - above or hi - lo <= finest)
        if resolved or not lo < middle < hi:      # done, or a tolerance finer than the floats
            break
        if meets(middle):
            lo = middle
        else:
            hi = middle
    return lo, hi


@dataclass(frozen=True)
class OfflineRate:
    """The outcome of :func:`offline_rate`: the saturated engine's steady throughput."""
    rate_per_s: float                # requests per second (output tokens/s over the mean output length)
    output_tokens_per_s: float
    mean_batch: float                # decoding sequences per iteration in the measured window
    step_s: float                    # mean iteration time of that window (a decoding sequence's TPOT)


def all_at_once(scenario: str | Path | Scenario | Mapping, num_requests: int) -> Scenario:
    """``scenario`` with ``num_requests`` of its requests all waiting at time 0 and run to the last one's finish."""
    return scenario_at(scenario, {RATE_KEY: 1e9, "workload.num_requests": num_requests, "simulation.warmup": 0,
                                  "simulation.horizon": 1e8})


def offline_rate(scenario: str | Path | Scenario | Mapping, num_requests: int) -> OfflineRate:
    """The throughput of ``scenario``'s engine run offline: ``num_requests`` of its requests all waiting at
    time 0 (MLPerf's Offline scenario, ``vllm bench throughput``), measured while the queue is not empty
    after the first ``2 x`` slots' worth of requests has finished (the ramp-up's prefill-only iterations
    and the tail's draining batch left out). ``num_requests`` must be well above twice the sequence slots
    (``max_num_seqs`` x replicas x pipeline stages), or no window is left to measure."""
    at_once = all_at_once(scenario, num_requests)
    slots = at_once.engine.max_num_seqs * at_once.deployment.replicas * at_once.deployment.pipeline_parallel
    if num_requests <= 4 * slots:
        raise ValueError(f"num_requests {num_requests} leaves no steady window: need more than 4 x {slots} slots")
    result = simulate_whole(at_once, force=True)
    finished = result.requests["finish_s"].dropna().sort_values().to_numpy()
    iterations = result.iterations
    window = iterations[(iterations["queued"] > 0) & (iterations["start_s"] >= finished[2 * slots])]
    seconds = float(window["end_s"].max() - window["start_s"].min())
    tokens_per_s = float(window["tokens_out"].sum()) / seconds
    return OfflineRate(tokens_per_s / float(result.requests["output_tokens"].mean()), tokens_per_s,
                       float(window["decode_seqs"].mean()), float(window["duration_s"].mean()))


def whole_run_output_rate(scenario: str | Path | Scenario | Mapping, num_requests: int) -> float:
    """Output tokens per second of ``scenario``'s engine over a whole offline run of ``num_requests`` requests all
    waiting at time 0: every output token over the span from the first arrival to the last finish, the ramp-up and
    the draining tail included, where :func:`offline_rate` measures the saturated engine between them. This is the
    figure a benchmark that times the whole run reports: trtllm-bench's output throughput is the total output tokens
    over ``end_time - start_time``, the first request's start to the last one's end
    (``tensorrt_llm/bench/dataclasses/reporting.py``, ``generate_statistics_summary``; ``statistics.py``,
    ``output_throughput_tok_ns``). How much of a run its ramp and tail take depends on the requests per batch
    slot: a last wave that fills a fraction of the slots runs a whole output length at that fraction's batch."""
    requests = simulate_whole(all_at_once(scenario, num_requests), force=True).requests
    if (requests["status"] != str(RequestStatus.FINISHED)).any():
        raise ValueError("a request of the whole run did not finish (rejected or cut off): no whole-run rate")
    span_s = float(requests["finish_s"].max() - requests["arrival_s"].min())
    return float(requests["generated_tokens"].sum()) / span_s
