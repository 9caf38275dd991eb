"""From per-request records to the figures a serving team reads.

Steady-state figures use the measurement window ``[warmup, end of arrivals]``:
latencies over the requests that arrived in it, throughput over the iterations
that ended in it. A run stopped before its end (horizon, Ctrl-C, fault) is measured
up to where it stopped, ``[warmup, min(end of arrivals, simulated end)]``, so its
rates are over the simulated time, not the planned arrival window. Utilisations
count the part of each iteration inside the window (an iteration straddling an edge
counts only its share, with the same share of its FLOPs and bytes), so none can
exceed 1. Counts (arrived, finished, rejected, unfinished) cover the whole run, so
conservation can be checked on them; requests the run never reached are not arrived.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from llmsim.analysis.kv_cache import kv_cache_summary
from llmsim.analysis.summary import (PERCENTILES, AutoscalingSummary, ClassSummary, DisaggregationSummary,
                                    Distribution, Economics, PoolSummary,
                                     Latency,
                                     Memory, QueueSummary, RequestCounts, RunSummary, SLOSummary, SLOTarget,
                                     SpeculationSummary, Throughput, Utilisation)
from llmsim.analysis.statistics import batch_means, rising_trend
from llmsim.config.policies import DraftPlacement
from llmsim.scenario.scenario import SLO, Scenario
from llmsim.sim.result import SimulationResult, SpeculationSteps, StopReason
from llmsim.sim.slo import Records, slo_limits, within_limit

LATENCY_COLUMNS = ("queue_wait_s", "ttft_s", "tpot_s", "e2e_s", "max_itl_s")
# A disaggregated run's TTFT, in four parts that add up to it (llmsim.sim.disaggregated.transfer_columns).
TTFT_PARTS = ("ttft_queue_s", "ttft_prefill_s", "ttft_transfer_s", "ttft_first_decode_s")


def share_with_stderr(hits: pd.Series | np.ndarray) -> tuple[float, float]:
    """The share of True in ``hits`` (requests in arrival order) and its standard error by batch
    means: consecutive requests share queue states, so they are not independent draws (NaN when
    there are too few requests to batch)."""
    if not len(hits):
        return math.nan, math.nan
    values = np.asarray(hits, dtype=float)
    try:
        return float(values.mean()), batch_means(values)[1]
    except ValueError:
        return float(values.mean()), math.nan


def slo_hits(steady: Records, slo: SLO) -> tuple[np.ndarray, dict[str, np.ndarray], int, float]:
    """Per request of ``steady`` (in arrival order; a table, or its columns as numpy arrays): whether it
    attained the SLO (met every limit, or finished when none is set) and, for every limit set, whether it met
    that one (unfinished or rejected requests miss); and the goodput's requests and output tokens (from
    ``meets_slo``). Worked out on the columns' numpy arrays (pandas' per-operation cost, string comparisons
    above all, was most of a short run's summary)."""
    finished = np.asarray(steady["status"]) == "finished"
    limits = slo_limits(steady, slo)
    targets = {metric: finished & within_limit({f"{metric}_s": np.asarray(steady[f"{metric}_s"])}, metric,
                                               limits[metric])
               for metric in _percentiles(slo) if metric in limits}
    attained = np.asarray(steady["meets_slo"], dtype=bool) if slo.defined else finished
    return attained, targets, int(attained.sum()), float(np.asarray(steady["output_tokens"])[attained].sum())


def _percentiles(slo: SLO) -> dict:
    """metric -> (limit, percentile) of the top-level SLO, and of metrics only classes limit."""
    out = dict(slo.targets())
    for _, own in slo.classes:
        for metric, target in own.targets().items():
            out.setdefault(metric, target)
    return out


def slo_summary(steady: Records, slo: SLO, window_s: float) -> SLOSummary:
    """Attainment, goodput (from the records' ``meets_slo``) and per-limit targets over ``steady``."""
    return slo_from_hits(slo, *slo_hits(steady, slo), window_s)


def slo_from_hits(slo: SLO, attained: pd.Series | np.ndarray, targets: dict[str, pd.Series] | dict[str, np.ndarray],
                  good: int, good_tokens: float, window_s: float) -> SLOSummary:
    """The SLO summary from :func:`slo_hits` (of all the window's requests, in arrival order)."""
    percentiles = _percentiles(slo)
    targets = {metric: SLOTarget(*share_with_stderr(hits), percentiles[metric][1]) for metric, hits in targets.items()}
    attainment, attainment_stderr = share_with_stderr(attained)
    return SLOSummary(
        ttft_s=slo.ttft_s, tpot_s=slo.tpot_s, e2e_s=slo.e2e_s,
        attainment=attainment, attainment_stderr=attainment_stderr,
        goodput_requests_per_s=good / window_s,
        goodput_output_tokens_per_s=good_tokens / window_s,
        targets=targets,
        met=all(t.attainment >= t.percentile / 100 for t in targets.values()),
    )


@dataclass(frozen=True)
class WindowMasks:
    """Per request of a run's records (numpy, in their order): whether it finished, and whether it arrived in the
    measurement window ``[start, stop]``, and whether it finished inside ``(start, stop]``."""
    finished: np.ndarray
    arrived_in_window: np.ndarray
    done_in_window: np.ndarray

    @classmethod
    def of(cls, records: pd.DataFrame, start: float, stop: float) -> WindowMasks:
        arrival, finish = records["arrival_s"].to_numpy(dtype=float), records["finish_s"].to_numpy(dtype=float)
        finished = records["status"].to_numpy() == "finished"      # (compared on numpy, as in slo_hits)
        return cls(finished, (arrival >= start) & (arrival <= stop), (finish > start) & (finish <= stop) & finished)


# What :func:`class_summaries` reads of the records: the class, the counts, the latencies (the SLO's metrics among
# them) and what :func:`slo_hits` reads besides.
_CLASS_LATENCIES = ("queue_wait_s", "ttft_s", "tpot_s", "e2e_s")
_CLASS_COLUMNS = ("class", "status", "output_tokens", "meets_slo", *_CLASS_LATENCIES)


def class_summaries(records: pd.DataFrame, slo: SLO, names: tuple[str, ...], start: float, stop: float,
                    masks: WindowMasks | None = None) -> dict[str, ClassSummary]:
    """Every traffic class's figures (see :class:`~llmsim.analysis.summary.ClassSummary`). ``masks``: the
    records' (:class:`WindowMasks`) where the caller has them already (:func:`summarize`). Each class takes
    one frame from the records, its window's requests (its latencies: those of them finished)."""
    window = stop - start
    if masks is None:
        masks = WindowMasks.of(records, start, stop)
    # The columns a class's figures read, as numpy arrays once: each class takes its rows of them, not a frame of
    # the records (a frame's row selection and column reads were most of the classes' summaries).
    columns = {column: records[column].to_numpy() for column in _CLASS_COLUMNS}
    of_class, status = columns["class"], columns["status"]
    finished, arrived_in_window, done_in_window = masks.finished, masks.arrived_in_window, masks.done_in_window
    output_tokens = columns["output_tokens"]
    out = {}
    for name in names:
        mine = of_class == name
        in_window = mine & arrived_in_window
        rows = np.flatnonzero(in_window)
        steady = {column: values[rows] for column, values in columns.items()}
        done = mine & done_in_window
        finished_steady = finished[rows]
        out[name] = ClassSummary(
            arrived=int(mine.sum()), finished=int((mine & finished).sum()),
            rejected=int((mine & (status == "rejected")).sum()),
            unfinished=int((mine & (status == "unfinished")).sum()),
            **{column: Distribution.of(steady[column][finished_steady])
               for column in _CLASS_LATENCIES},
            requests_per_s=int(done.sum()) / window,
            output_tokens_per_s=float(output_tokens[done].sum()) / window,
            offered_requests_per_s=len(rows) / window,
            slo=slo_summary(steady, slo.for_class(name), window))
    return out


def measurement_window(result: SimulationResult) -> tuple[float, float]:
    """``[warmup, end of arrivals]``, ended where a stopped run stopped; empty when the warm-up is as
    long as the arrivals (:func:`summarize` then measures the whole run)."""
    stop = result.arrival_window_s
    if result.stopped_by != StopReason.COMPLETED:         # nothing after the stop was simulated: measure up to it
        stop = min(stop, result.end_s)
    return result.warmup_s, stop


def warmup_warning(result: SimulationResult) -> str | None:
    """What to tell the user when the warm-up leaves no measurement window (None when it does not)."""
    start, stop = measurement_window(result)
    if stop - start > 0 or result.scenario.simulation.warmup_s is None:
        return None
    return (f"simulation.warmup ({result.scenario.simulation.warmup_s:g} s) is not shorter than the "
            f"{result.arrival_window_s:.3g} s in which the requests arrive (workload.num_requests, "
            "workload.arrival.rate): every figure covers the whole run, warm-up included; shorten "
            "simulation.warmup or send more requests")


def _expert_memory(scenario: Scenario) -> dict[str, int]:
    experts = scenario.deployment.expert_parallel
    if experts is None:
        return {}
    return {"expert_parallel": experts.degree, "experts_per_device": experts.experts_per_rank(scenario.model)}


def summarize(result: SimulationResult) -> RunSummary:
    """The summary of one run, typed (``to_dict()``: what ``llmsim run`` prints and writes as JSON)."""
    scenario = result.scenario
    records, iterations = result.requests, result.iterations
    start, stop = measurement_window(result)
    if stop - start <= 0:                      # a degenerate window: measure the whole run
        start, stop = 0.0, max(result.end_s, 1e-12)
    window = stop - start
    # Masks and sums on numpy columns, tables filtered only where a section reads one: on a short run
    # (a search's probe) pandas' per-call overhead, not the rows, was most of the summary's cost.
    masks = WindowMasks.of(records, start, stop)
    is_finished, steady_rows = masks.finished, masks.arrived_in_window
    steady = records[steady_rows]
    finished_steady = is_finished[steady_rows]
    end_s = iterations["end_s"].to_numpy()
    iterations_in_window = (end_s > start) & (end_s <= stop)
    # With autoscaling the devices are those paid for in the window (replica-seconds / window), so
    # per-device throughput, cost and energy follow the replicas the run held, not the ones it started with.
    split = result.disaggregation
    measured = scenario if split is None else scenario.pool("decode")   # whose utilisation and memory are shown
    provisioned = result.provisioned
    replicas = (mean_replicas_between(provisioned, start, stop) if provisioned is not None
                else measured.deployment.replicas)
    status, reason = records["status"].to_numpy(), records["reason"].to_numpy()     # (compared on numpy)
    rejected = status == "rejected"
    unfinished = status == "unfinished"
    scheduled = ~np.isnan(records["first_scheduled_s"].to_numpy())
    counts = RequestCounts(
        arrived=int(len(records)),
        not_arrived=int(result.planned_requests - len(records)),
        finished=int(is_finished.sum()),
        rejected_timeout=int((rejected & (reason == "timeout")).sum()),
        rejected_too_long=int((rejected & (reason == "too_long")).sum()),
        unfinished_queued=int((unfinished & ~scheduled).sum()),
        unfinished_running=int((unfinished & scheduled).sum()),
        preemptions=int(result.preemptions),
    )
    latency = Latency(**{name: Distribution.of(steady[name].to_numpy()[finished_steady]) for name in LATENCY_COLUMNS},
                      itl_s=Distribution(**result.inter_token_gaps.summary(start, stop, PERCENTILES)))

    finished_in_window = int(masks.done_in_window.sum())
    output_tokens = float(iterations["tokens_out"].to_numpy()[iterations_in_window].sum())
    slo = slo_summary(steady, scenario.slo, window)
    classes = (class_summaries(records, scenario.slo, scenario.workload.class_names, start, stop, masks)
               if scenario.workload.classes else None)
    # Each pool's iterations weighed once: the decode pool's sums are the run's utilisation and its pool's busy time.
    overlaps = {name: overlap_in(iterations, start, stop, rows) for name, rows in pool_rows(result).items()}
    utilisation = utilisation_from(overlaps["decode"] if split is not None else overlap_in(iterations, start, stop),
                                   window, measured, result.kv_blocks_per_replica, replicas)
    ttft_rise, rising = rising_trend(steady["ttft_s"], scale=scenario.slo.ttft_s)
    return run_summary(
        result, (start, stop), replicas, counts, latency,
        throughput_of(finished_in_window, output_tokens,
                      float(iterations["prefill_tokens"].to_numpy()[iterations_in_window].sum()), len(steady),
                      window, paid_devices(result, replicas)),
        slo, utilisation,
        QueueSummary(mean_length=result.mean_queue_length, max_length=int(result.queue_length["length"].max()),
                     mean_in_system=result.mean_in_system, ttft_rise=ttft_rise, steady=not rising),
        speculation_sums(iterations[iterations_in_window]) if scenario.speculating else None, classes,
        autoscaling_summary(result, replicas, float(records["generated_tokens"].sum()))
        if result.scaling is not None else None,
        kv_cache_summary(result.kv_tiers, steady, steady[finished_steady], records,
                         scenario.deployment.replicas * scenario.deployment.data_parallel)
        if result.kv_tiers else None,
        disaggregation_summary(result, steady[finished_steady], window, overlaps)
        if split is not None else None)


def paid_devices(result: SimulationResult, replicas: float) -> float:
    """The devices paid for: ``replicas`` (on average in the window) of the scenario's, or both pools of a
    disaggregated run."""
    split = result.disaggregation
    if split is not None:
        return sum(pool.devices for pool in split.pools)
    return replicas * result.scenario.devices_per_replica


def throughput_of(finished_in_window: int, output_tokens: float, prefill_tokens: float, offered: int, window: float,
                  devices_paid: float) -> Throughput:
    """Rates over the window: requests finished in it, the tokens of the iterations that ended in it
    (output, and output plus prefill; per device paid for in the window) and the requests that arrived
    in it (offered)."""
    return Throughput(
        requests_per_s=finished_in_window / window,
        output_tokens_per_s=output_tokens / window,
        total_tokens_per_s=(output_tokens + prefill_tokens) / window,
        output_tokens_per_s_per_device=output_tokens / window / devices_paid,
        offered_requests_per_s=offered / window,
    )


def run_summary(result: SimulationResult, window_s: tuple[float, float], replicas: float, counts: RequestCounts,
                latency: Latency,
                throughput: Throughput, slo: SLOSummary, utilisation: Utilisation, queue: QueueSummary,
                speculation: dict[str, float] | None, classes: dict[str, ClassSummary] | None,
                autoscaling: AutoscalingSummary | None, kv_cache,
                disaggregation: DisaggregationSummary | None = None) -> RunSummary:
    """The summary from its measured sections (by :func:`summarize`, or by a streamed run as it went),
    with what the scenario gives: placement, cost (of the ``replicas`` paid for in the window, on average),
    speculation's figures from ``speculation`` (:func:`speculation_sums` over the window's iterations)."""
    scenario, split = result.scenario, result.disaggregation
    hw = scenario.hardware
    devices_paid = paid_devices(result, replicas)
    if split is None:
        devices = scenario.deployment.replicas * scenario.devices_per_replica
        usd_per_hour, power_w = devices_paid * hw.price_per_hour_usd, devices_paid * hw.tdp_w
    else:                                    # both pools are paid for; utilisation and memory are the decode pool's
        devices = int(devices_paid)
        usd_per_hour = sum(pool.usd_per_hour for pool in split.pools)
        power_w = sum(pool.power_w for pool in split.pools)
    measured = scenario if split is None else scenario.pool("decode")
    if classes is not None:
        # Overall, the SLO is met when every class meets its own targets.
        slo = replace(slo, met=all(c.slo.met for c in classes.values()))
    placement = measured.memory
    memory = Memory(
        tensor_parallel=placement.tensor_parallel,
        pipeline_parallel=placement.pipeline_parallel,
        weights_in=placement.weight_tier.name + (" (streamed)" if placement.weight_streaming else ""),
        kv_cache_in=placement.kv_tier.name,
        weights_per_device_gb=placement.weights_per_device_bytes / 1e9,
        kv_cache_per_device_gb=placement.kv_per_device_bytes / 1e9,
        # With expert parallelism a replica is a group of data-parallel ranks, each with its own KV cache.
        kv_capacity_tokens_per_replica=placement.kv_capacity_tokens * scenario.deployment.data_parallel,
        draft_devices_per_replica=(scenario.speculation.extra_devices
                                   if scenario.speculating and scenario.speculation is not None else 0),
        **_expert_memory(scenario),
    )
    return RunSummary(
        scenario=scenario.name, seed=scenario.seed, model=scenario.model.name, hardware=hw.name,
        devices=devices, window_s=window_s, simulated_s=result.end_s,
        requests=counts, latency=latency, throughput=throughput, slo=slo, utilisation=utilisation,
        memory=memory,
        economics=Economics.at_tdp(usd_per_hour, power_w, throughput.output_tokens_per_s),
        queue=queue,
        speculation=(speculation_summary(scenario, speculation, result.speculation_blocked)
                     if speculation is not None else None),
        interrupted=result.interrupted,
        stopped_by=result.stopped_by.value,
        stopped_on=",".join(result.stopped_on) or None,
        fault=result.fault,
        classes=classes,
        autoscaling=autoscaling,
        kv_cache=kv_cache,
        disaggregation=disaggregation,
    )


def pool_rows(result: SimulationResult) -> dict[str, np.ndarray]:
    """A disaggregated run's pools by name, each with the mask of its rows in the iteration log (none
    for an aggregated run)."""
    if result.disaggregation is None:
        return {}
    pool = result.iterations["pool"]
    return {totals.pool: (pool == totals.pool).to_numpy(dtype=bool) for totals in result.disaggregation.pools}


def disaggregation_summary(result: SimulationResult, finished: pd.DataFrame, window: float,
                           overlaps: dict[str, Overlap]) -> DisaggregationSummary:
    """The disaggregated run's link, TTFT split and pools (:class:`~llmsim.analysis.summary.DisaggregationSummary`;
    ``overlaps``: each pool's :func:`overlap_in` over the measurement window, ``window`` seconds long)."""
    split, records = result.disaggregation, result.requests
    assert split is not None                               # summarized only for a disaggregated run
    pools = {}
    for pool in split.pools:
        busy = utilisation_from(overlaps[pool.pool], window, result.scenario.pool(pool.pool), 1).busy_fraction
        pools[pool.pool] = PoolSummary(pool.hardware, pool.replicas, pool.tensor_parallel, pool.pipeline_parallel,
                                       pool.usd_per_hour, busy, pool.expert_parallel)
    moved = finished[~finished["aggregated"]]
    return DisaggregationSummary(
        layout=split.layout, link=split.link, lanes=split.lanes, streaming=split.streaming,
        reservation=split.reservation, aggregated_requests=int(records["aggregated"].sum()),
        transfers=split.transfers, transfer_gb=split.transfer_bytes / 1e9,
        transfer_s=Distribution.of(moved["transfer_end_s"] - moved["transfer_start_s"]),
        link_utilisation=split.link_utilisation,
        **{name: Distribution.of(finished[name]) for name in TTFT_PARTS}, pools=pools)


def autoscaling_summary(result: SimulationResult, replicas_in_window: float, tokens: float) -> AutoscalingSummary:
    """The replica pool's cost over the whole run (see :class:`~llmsim.analysis.summary.AutoscalingSummary`);
    ``replicas_in_window``: the mean replicas paid for in the measurement window; ``tokens``: the output
    tokens every request generated."""
    scenario, log = result.scenario, result.scaling
    # An autoscaled run logs its scaling and its replica-seconds (summarized only for one).
    assert log is not None and result.replica_seconds is not None and scenario.autoscaling is not None
    usd = result.replica_seconds * scenario.devices_per_replica * scenario.hardware.price_per_hour_usd / 3600
    return AutoscalingSummary(
        min_replicas=scenario.autoscaling.min_replicas, max_replicas=scenario.autoscaling.max_replicas,
        devices_per_replica=scenario.devices_per_replica,
        replica_seconds=result.replica_seconds,
        mean_replicas=result.replica_seconds / result.end_s if result.end_s > 0 else math.nan,
        mean_replicas_in_window=replicas_in_window,
        max_replicas_serving=int(max(log["serving"].max(), scenario.deployment.replicas)) if len(log)
        else scenario.deployment.replicas,
        scale_ups=int(log["action"].str.count("start").sum()),
        scale_downs=int(log["action"].str.count("drain").sum()),
        usd=usd, usd_per_million_output_tokens=usd / tokens * 1e6 if tokens else math.nan)


def mean_replicas_between(provisioned: pd.DataFrame, start_s: float, stop_s: float) -> float:
    """The time-average of a piecewise-constant replica count (``time_s``, ``replicas`` after each
    change, from time 0) over ``[start_s, stop_s]``."""
    times = provisioned["time_s"].to_numpy()
    counts = provisioned["replicas"].to_numpy()
    edges = np.clip(np.append(times, np.inf), start_s, stop_s)
    return float(np.dot(np.diff(edges), counts) / (stop_s - start_s))


Overlap = tuple[float, float, float, float, float, float]     # iteration_overlap's figures


def overlap_in(iterations: pd.DataFrame, start: float, stop: float, rows: np.ndarray | None = None) -> Overlap:
    """:func:`iteration_overlap` of the iteration log's rows that ``rows`` (a boolean mask) selects (all where
    None), column by column."""
    def column(name: str) -> np.ndarray:
        values = iterations[name].to_numpy()
        return values if rows is None else values[rows]

    return iteration_overlap(column("start_s"), column("end_s"), column("duration_s"), column("flops"),
                             column("bytes"), column("kv_used_blocks"), column("decode_seqs") + column("prefill_seqs"),
                             start, stop)


def iteration_overlap(start_s, end_s, duration_s, flops, bytes_, kv_used_blocks, sequences, start: float, stop: float
                      ) -> Overlap:
    """The iterations' time inside ``[start, stop]`` and, weighted by it, their FLOPs and bytes (the
    share inside), KV blocks used and sequences: (busy seconds, FLOPs, bytes, KV block-seconds,
    most KV blocks, sequence-seconds). Sums: those of several sets of iterations add up.

    Every sum is numpy's own (pairwise), none a BLAS dot product: OpenBLAS splits a dot of more than 10,000
    elements over its threads, whose partial sums made the figures' last digits depend on the machine's cores,
    and whose waiting threads spun through a search's CPU time (a fifth of a prefill-on-CS-3 search's)."""
    overlap = np.minimum(end_s, stop) - np.maximum(start_s, start)
    inside = overlap > 0
    weights = overlap[inside]
    duration = duration_s[inside]
    share = np.divide(weights, duration, out=np.ones_like(weights), where=duration > 0)
    kv_used = kv_used_blocks[inside]
    return (float(weights.sum()), float(np.multiply(share, flops[inside]).sum()),
            float(np.multiply(share, bytes_[inside]).sum()),
            float(np.multiply(kv_used, weights, dtype=float).sum()), float(kv_used.max()) if len(kv_used) else 0.0,
            float(np.multiply(sequences[inside], weights, dtype=float).sum()))


def utilisation_from(overlap: Overlap, window: float, scenario,
                     kv_blocks: int, replicas: float | None = None) -> Utilisation:
    """How busy the devices were in a ``window`` seconds long, from :func:`iteration_overlap`'s sums over it: the
    time each iteration spent inside it.

    ``replicas`` is how many replicas there were on average in the window (default the
    deployment's): with autoscaling, the replicas paid for, starting and draining ones included.

    A replica runs one engine per pipeline micro-batch, each one iteration after another, and
    an iteration occupies each of the ``pp`` stages for ``1/pp`` of its duration: the busy
    fraction is the engines' iteration time in the window over ``pp x window`` per replica,
    and MFU and bandwidth utilisation take the window's share of each iteration's FLOPs and
    bytes, so all are within [0, 1] whatever straddles the window's edges.
    """
    busy_s, flops, bytes_, kv_seconds, kv_max, sequence_seconds = overlap
    dep = scenario.deployment
    hw = scenario.hardware
    replicas = dep.replicas if replicas is None else replicas
    devices = replicas * scenario.devices_per_replica
    # Each engine's iterations follow one another, so the sum is at most the window; rounding in
    # the sum of clipped durations can add an ulp or two.
    busy_fraction = min(busy_s / (window * replicas * dep.pipeline_parallel * dep.data_parallel), 1.0)
    mfu = flops / (window * hw.peak_for(scenario.model.weight_dtype) * devices)
    return Utilisation(
        busy_fraction=busy_fraction,
        mfu=mfu,
        mfu_while_busy=mfu / busy_fraction if busy_s else 0.0,
        bandwidth_utilisation=bytes_ / (window * hw.memory_bandwidth_bytes_per_s * devices),
        kv_occupancy_mean=kv_seconds / busy_s / kv_blocks if busy_s else 0.0,
        kv_occupancy_max=kv_max / kv_blocks,
        mean_batch_size=sequence_seconds / busy_s if busy_s else 0.0,
    )


RARELY_SPECULATING = 0.2     # below this share of sequence-steps speculating, the summary warns


SPECULATION_SUMS = ("spec_seqs", "draft_tokens", "accepted_tokens", "decode_seqs", "duration_s", "draft_s")


def speculation_sums(iterations: pd.DataFrame) -> dict[str, float]:
    """The iteration log's columns :func:`speculation_summary` reads, summed (over the window's iterations)."""
    return {name: float(iterations[name].sum()) for name in SPECULATION_SUMS}


def speculation_summary(scenario, sums: dict[str, float], blocked: SpeculationSteps | None = None
                        ) -> SpeculationSummary:
    """Acceptance, draft length and where the time went, from the window's iterations
    (``sums``: :func:`speculation_sums`).

    A verify step is one sequence's speculative step (it emits accepted + 1 tokens); the
    draft's share is of iteration time (on separate devices the draft overlaps the
    target, so its share is how busy the draft devices were). ``blocked`` counts the run's
    decoding sequence-steps and why they did not speculate
    (:class:`~llmsim.sim.result.SpeculationSteps`, summed over engines).
    """
    spec = scenario.speculation
    steps, proposed, accepted = sums["spec_seqs"], sums["draft_tokens"], sums["accepted_tokens"]
    decode_steps, busy = sums["decode_seqs"], sums["duration_s"]
    draft_share = sums["draft_s"] / busy if busy else math.nan
    return SpeculationSummary(
        draft=spec.draft.name if spec.draft is not None else "ngram",
        placement=spec.placement,
        policy=spec.policy.policy,
        acceptance_rate=_ratio(accepted, proposed),
        mean_accepted_tokens=_ratio(accepted, steps),
        tokens_per_verify_step=_ratio(accepted + steps, steps),
        mean_k=_ratio(proposed, steps),
        speculating_fraction=_ratio(steps, decode_steps),
        draft_time_share=draft_share,
        verify_time_share=1.0 - draft_share if spec.placement is DraftPlacement.COLOCATED else math.nan,
        blocked_share=blocked.shares() if blocked is not None else {},
        warning=_rarely_speculating(spec, blocked),
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _rarely_speculating(spec, blocked: SpeculationSteps | None) -> str | None:
    """A warning when speculation is configured but ran in under RARELY_SPECULATING of the
    sequence-steps, naming the rule that blocked most and the setting that loosens it."""
    share = blocked.shares() if blocked is not None else {}
    if not share or share["speculated"] >= RARELY_SPECULATING:
        return None
    rule = max((name for name in share if name != "speculated"), key=lambda name: share[name])
    fix = {"min_concurrent_requests": f"speculation.eligibility.min_concurrent_requests "
                                      f"({spec.eligibility.min_concurrent_requests}; 1 speculates for a single stream)",
           "min_sequence_tokens": f"speculation.eligibility.min_sequence_tokens "
                                  f"({spec.eligibility.min_sequence_tokens})",
           "kv_cache": "more KV room (the cache could not hold the draft positions)",
           "policy": "the k policy (it chose k = 0), or a better draft"}[rule]
    return (f"speculation configured but used in only {100 * share['speculated']:.0f}% of decoding sequence-steps; "
            f"{rule} blocked {100 * share[rule]:.0f}%: see {fix}")
