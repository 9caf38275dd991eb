"""A run summarised and written as it goes, for runs too long to keep whole (a day of traffic).

``llmsim run`` streams a run of more than :data:`STREAM_ABOVE_REQUESTS` requests: the simulation
hands its per-request records over in chunks of consecutive requests as they complete, its
iteration log and queue lengths as they fill (:func:`llmsim.sim.simulate.simulate`'s ``stream``),
and :class:`StreamedRun` writes each records chunk to disk (:class:`RecordsWriter`: the same rows,
CSV or Parquet, as a run kept whole writes) and adds it to the summary's sums before dropping it.

The summary is the one :func:`llmsim.analysis.metrics.summarize` gives, built from sums:

- counts, means, rates, shares, utilisations and speculation's figures are the same sums (the
  floating-point ones added chunk by chunk, so they may differ in the last digits);
- percentiles come from a quantile sketch (:mod:`llmsim.analysis.sketch`): each is within
  :data:`~llmsim.analysis.sketch.RELATIVE_ACCURACY` (0.5%) of the exact value at its rank; the
  inter-token gaps reach it as the engines hand them over (:meth:`StreamedRun.gaps`), not at the end;
- the SLO's standard errors and the steady-state test keep one byte per request and target (met or
  not) and the window's TTFTs (8 bytes a request), so they are exact.

It also bins the run as it goes (:class:`TimeSeries`, ``timeseries.csv``): per :data:`BIN_S` of
simulated time, arrivals, finishes, mean TTFT and TPOT, output tokens and the longest queue.

Not streamed (kept whole, as before, whatever their size): runs with a controller (it reads every
record as it decides), a tiered KV cache (prefix caching, a host tier, swap) or a rollout.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from llmsim.analysis.metrics import (LATENCY_COLUMNS, SPECULATION_SUMS, Overlap, autoscaling_summary, iteration_overlap,
                                     mean_replicas_between, measurement_window, run_summary, slo_from_hits, slo_hits,
                                     throughput_of, utilisation_from)
from llmsim.analysis.sketch import QuantileSketch
from llmsim.analysis.statistics import rising_trend
from llmsim.analysis.summary import (PERCENTILES, ClassSummary, Distribution, Latency, QueueSummary, RequestCounts,
                                     RunSummary)
from llmsim.scenario.scenario import SLO, Scenario
from llmsim.sim.iterations import LOG_COLUMNS
from llmsim.sim.request import InterTokenGaps
from llmsim.sim.result import SimulationResult

STREAM_ABOVE_REQUESTS = 200_000      # llmsim run streams a run of more requests than this
BIN_S = 60.0                         # the time series' bin
CHUNK_ROWS = 1 << 16                 # requests per records chunk (about 10 MB of records as a DataFrame)
_COLUMN = {name: i for i, name in enumerate(LOG_COLUMNS)}
_CLASS_LATENCIES = ("queue_wait_s", "ttft_s", "tpot_s", "e2e_s")


def streamable(scenario: Scenario) -> bool:
    """Whether a run of ``scenario`` can be streamed (see the module docstring)."""
    return scenario.controller is None and not scenario.engine.tiered_kv and scenario.rollout is None


def sketched(sketch: QuantileSketch) -> Distribution:
    """The mean (exact) and percentiles (within the sketch's relative accuracy) of a sketch's values."""
    return Distribution(sketch.mean, *(sketch.percentile(p) for p in PERCENTILES))


class _Requests:
    """Sums over one set of requests (all, or one traffic class) in one part of the run: requests
    that arrived in ``[start, stop]`` (``[start, stop)`` for the part before the warm-up ends), and
    those that finished in ``(start, stop]``."""

    def __init__(self, slo: SLO, start: float, stop: float, closed: bool, latencies: tuple[str, ...], trend: bool):
        self.slo, self.start, self.stop, self.closed = slo, start, stop, closed
        self.sketches = {name: QuantileSketch() for name in latencies}
        self.offered = self.done = self.good = 0
        self.done_tokens = self.good_tokens = 0.0
        self.attained: list[np.ndarray] = []
        self.targets: dict[str, list[np.ndarray]] = {}
        self.ttft: list[np.ndarray] | None = [] if trend else None

    def add(self, records: pd.DataFrame) -> None:
        arrival = records["arrival_s"]
        steady = records[(arrival >= self.start) & ((arrival <= self.stop) if self.closed else (arrival < self.stop))]
        finished = steady[steady["status"] == "finished"]
        for name, sketch in self.sketches.items():
            sketch.add(finished[name].to_numpy())
        done = records[(records["finish_s"] > self.start) & (records["finish_s"] <= self.stop)
                       & (records["status"] == "finished")]
        self.offered += len(steady)
        self.done += len(done)
        self.done_tokens += float(done["output_tokens"].sum())
        # Copies: a column's values may be a view of the chunk's whole block of columns, kept alive with it.
        attained, targets, good, good_tokens = slo_hits(steady, self.slo)
        self.attained.append(np.array(attained, bool))
        for metric, hits in targets.items():
            self.targets.setdefault(metric, []).append(np.array(hits, bool))
        self.good += good
        self.good_tokens += good_tokens
        if self.ttft is not None:
            self.ttft.append(steady["ttft_s"].to_numpy(copy=True))

    def merge(self, later: _Requests) -> None:
        """Add the sums of the part of the run after this one (its requests arrived later)."""
        for name, sketch in self.sketches.items():
            sketch.merge(later.sketches[name])
        self.offered += later.offered
        self.done += later.done
        self.done_tokens += later.done_tokens
        self.good += later.good
        self.good_tokens += later.good_tokens
        self.attained += later.attained
        for metric, hits in later.targets.items():
            self.targets.setdefault(metric, []).extend(hits)
        if self.ttft is not None and later.ttft is not None:
            self.ttft += later.ttft

    def slo_summary(self, window: float):
        return slo_from_hits(self.slo, _series(self.attained),
                             {metric: _series(hits) for metric, hits in self.targets.items()},
                             self.good, self.good_tokens, window)

    def distribution(self, name: str) -> Distribution:
        return sketched(self.sketches[name])


def _series(parts: list[np.ndarray]) -> pd.Series:
    """Per-request flags kept chunk by chunk, as one series in arrival order."""
    return pd.Series(np.concatenate(parts) if parts else np.zeros(0, bool))


class _Iterations:
    """Sums over the iterations in one part of the run: their time inside ``[start, stop]`` and what
    it weighs (:func:`~llmsim.analysis.metrics.iteration_overlap`), and the tokens and speculation
    counts of those that ended in ``(start, stop]``."""

    SUMMED = ("tokens_out", "prefill_tokens", *SPECULATION_SUMS)

    def __init__(self, start: float, stop: float):
        self.start, self.stop = start, stop
        self.overlap: Overlap = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.sums = dict.fromkeys(self.SUMMED, 0.0)

    def add(self, rows: np.ndarray, end: np.ndarray) -> None:
        c = _COLUMN
        starts = rows[:, c["start_s"]]
        # Rows all before the part, or all after it (none ending at its end): nothing to add.
        if not len(end) or end.max() <= self.start or (starts.min() >= self.stop and end.min() > self.stop):
            return
        part = iteration_overlap(starts, end, rows[:, c["duration_s"]], rows[:, c["flops"]],
                                 rows[:, c["bytes"]], rows[:, c["kv_used_blocks"]],
                                 rows[:, c["decode_seqs"]] + rows[:, c["prefill_seqs"]], self.start, self.stop)
        self.overlap = _combined(self.overlap, part)
        ended = rows[(end > self.start) & (end <= self.stop)]
        for name in self.SUMMED:
            self.sums[name] += float(ended[:, c[name]].sum())

    def merge(self, later: _Iterations) -> None:
        self.overlap = _combined(self.overlap, later.overlap)
        for name in self.SUMMED:
            self.sums[name] += later.sums[name]


def _combined(overlap: Overlap, more: Overlap) -> Overlap:
    """Two sets of :func:`~llmsim.analysis.metrics.iteration_overlap` figures as one: sums, but the
    most KV blocks (the fifth) is the larger."""
    return (overlap[0] + more[0], overlap[1] + more[1], overlap[2] + more[2], overlap[3] + more[3],
            max(overlap[4], more[4]), overlap[5] + more[5])


class TimeSeries:
    """The run binned by :data:`BIN_S` of simulated time as it goes: requests by arrival (arrived,
    and the TTFT and TPOT of those that finished), finishes, output tokens by the iteration's end,
    the longest queue (all queues summed when they are one shared queue, else the longest one)."""

    COLUMNS = ("arrived", "finished", "ttft_sum_s", "ttft_count", "tpot_sum_s", "tpot_count", "output_tokens",
               "max_queue_length")

    def __init__(self, bin_s: float = BIN_S):
        self.bin_s = bin_s
        self.columns = {name: np.zeros(0) for name in self.COLUMNS}

    def _add(self, name: str, times: np.ndarray, weights=None, most: bool = False) -> None:
        keep = ~np.isnan(times)
        bins = (times[keep] // self.bin_s).astype(np.int64)
        if not len(bins):
            return
        column = self.columns[name]
        size = max(len(column), int(bins.max()) + 1)
        if size > len(column):
            for key in self.COLUMNS:
                self.columns[key] = np.concatenate([self.columns[key], np.zeros(size - len(self.columns[key]))])
            column = self.columns[name]
        if most:
            np.maximum.at(column, bins, weights[keep])
        else:
            column += np.bincount(bins, weights=None if weights is None else weights[keep], minlength=size)

    def records(self, records: pd.DataFrame) -> None:
        arrival = records["arrival_s"].to_numpy()
        self._add("arrived", arrival)
        finished = (records["status"] == "finished").to_numpy()
        self._add("finished", np.where(finished, records["finish_s"].to_numpy(), np.nan))
        for name in ("ttft", "tpot"):
            values = records[f"{name}_s"].to_numpy()
            counted = finished & ~np.isnan(values)
            self._add(f"{name}_sum_s", np.where(counted, arrival, np.nan), values)
            self._add(f"{name}_count", np.where(counted, arrival, np.nan))

    def iterations(self, rows: np.ndarray, end: np.ndarray) -> None:
        self._add("output_tokens", end, rows[:, _COLUMN["tokens_out"]])

    def queue(self, times: np.ndarray, lengths: np.ndarray) -> None:
        self._add("max_queue_length", times, lengths.astype(float), most=True)

    def frame(self) -> pd.DataFrame:
        c = self.columns
        with np.errstate(invalid="ignore", divide="ignore"):
            return pd.DataFrame({
                "start_s": np.arange(len(c["arrived"])) * self.bin_s,
                "arrived": c["arrived"].astype(np.int64), "finished": c["finished"].astype(np.int64),
                "mean_ttft_s": c["ttft_sum_s"] / c["ttft_count"], "mean_tpot_s": c["tpot_sum_s"] / c["tpot_count"],
                "output_tokens_per_s": c["output_tokens"] / self.bin_s,
                "max_queue_length": c["max_queue_length"].astype(np.int64)})


_QUOTED = re.compile(r'[,"\r\n]')      # a field with one of these is quoted by pandas (csv.QUOTE_MINIMAL)


def _csv_fields(values: np.ndarray) -> list[str] | None:
    """A column's fields as ``DataFrame.to_csv`` writes them (floats in Python's shortest repr, which
    is numpy's; missing values empty), or None where it would quote one or the values are not
    numbers, booleans or strings."""
    kind = values.dtype.kind
    if kind == "f":
        fields = list(map(repr, values.tolist()))
        for i in np.flatnonzero(np.isnan(values)).tolist():
            fields[i] = ""
        return fields
    if kind in "iub":
        return list(map(str, values.tolist()))
    if kind != "O":
        return None
    fields = ["" if value is None or value is pd.NA or (type(value) is float and value != value) else value
              for value in values.tolist()]
    if not all(type(field) is str for field in fields) or _QUOTED.search("".join(fields)):
        return None
    return fields


def csv_text(frame: pd.DataFrame, header: bool) -> str:
    """``frame.to_csv(index=False, header=header)``'s text, formatted column by column where pandas'
    writer would only repeat the same conversions row by row (its float formatting is the costly part)."""
    columns = [_csv_fields(frame[name].to_numpy()) for name in frame.columns]
    names = [str(name) for name in frame.columns]
    if any(fields is None for fields in columns) or _QUOTED.search("".join(names)) or not len(frame.columns):
        return frame.to_csv(index=False, header=header, lineterminator=os.linesep)
    lines = [",".join(names)] if header else []
    lines.extend(map(",".join, zip(*columns)))
    return os.linesep.join(lines) + os.linesep if lines else ""


class RecordsWriter:
    """Per-request records written chunk by chunk: CSV (one header, the rows as one ``to_csv`` of the
    whole table writes them) or Parquet (one row group per chunk; needs pyarrow)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # Open for the whole run, closed by close(): chunks are written as the simulation makes them.
        self._file = (None if self.path.suffix == ".parquet"
                      else open(self.path, "w", newline=""))  # noqa: SIM115
        self._writer: Any = None       # a pyarrow ParquetWriter, made with the first chunk's schema

    def write(self, frame: pd.DataFrame) -> None:
        if self._file is not None:
            self._file.write(csv_text(frame, header=self._file.tell() == 0))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pandas(frame, preserve_index=False)
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, table.schema)
            self._writer.write_table(table.cast(self._writer.schema))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


class StreamedRun:
    """A run's summary, records and time series made as the simulation goes (the ``stream`` of
    :func:`llmsim.sim.simulate.simulate`; see the module docstring). ``writers``: where the records
    chunks go (:class:`RecordsWriter`), in order, each of ``chunk_rows`` requests."""

    def __init__(self, writers: Sequence[RecordsWriter] = (), bin_s: float = BIN_S, chunk_rows: int = CHUNK_ROWS):
        self.writers = list(writers)
        self.chunk_rows = chunk_rows
        self.series = TimeSeries(bin_s)
        self._pending: list[np.ndarray] = []        # iteration rows that may end after the run
        self.arrived = 0
        self.counts = dict.fromkeys(("finished", "rejected_timeout", "rejected_too_long", "unfinished_queued",
                                     "unfinished_running"), 0)
        self.generated_tokens = 0.0
        self.class_counts: dict[str, dict[str, int]] = {}
        self.max_queue_length = 0
        self._pending_gaps = InterTokenGaps()      # inter-token gaps that may end after the run
        self.end_s = math.nan

    def begin(self, scenario: Scenario, window_s: float, warmup_s: float) -> None:
        """Before the run: the parts of it whose sums are kept apart (before the warm-up ends, the
        window), so the summary can measure the whole run if it stops before the warm-up ends."""
        self.scenario = scenario
        cuts = [(0.0, warmup_s, False), (warmup_s, window_s, True)] if window_s - warmup_s > 0 else [
            (0.0, math.inf, True)]
        names = scenario.workload.class_names if scenario.workload.classes else ()
        self.parts = [({None: _Requests(scenario.slo, start, stop, closed, LATENCY_COLUMNS, True),
                        **{name: _Requests(scenario.slo.for_class(name), start, stop, closed, _CLASS_LATENCIES,
                                           False) for name in names}},
                       _Iterations(start, stop)) for start, stop, closed in cuts]
        self.class_counts = {name: dict.fromkeys(("arrived", "finished", "rejected", "unfinished"), 0)
                             for name in names}
        # The inter-token gaps by when the token appeared: before the warm-up ends, in the window
        # (its ends included), after it; a summary measuring the whole run merges them.
        self._gap_cuts = [warmup_s, window_s] if window_s - warmup_s > 0 else []
        self._gap_sketches = [QuantileSketch() for _ in range(len(self._gap_cuts) + 1)]

    def records(self, frame: pd.DataFrame) -> None:
        for writer in self.writers:
            writer.write(frame)
        self.series.records(frame)
        status, reason = frame["status"], frame["reason"]
        scheduled = frame["first_scheduled_s"].notna()
        self.arrived += len(frame)
        self.counts["finished"] += int((status == "finished").sum())
        self.counts["rejected_timeout"] += int(((status == "rejected") & (reason == "timeout")).sum())
        self.counts["rejected_too_long"] += int(((status == "rejected") & (reason == "too_long")).sum())
        self.counts["unfinished_queued"] += int(((status == "unfinished") & ~scheduled).sum())
        self.counts["unfinished_running"] += int(((status == "unfinished") & scheduled).sum())
        self.generated_tokens += float(frame["generated_tokens"].sum())
        for name, counts in self.class_counts.items():
            mine = status[frame["class"] == name]
            counts["arrived"] += len(mine)
            for outcome in ("finished", "rejected", "unfinished"):
                counts[outcome] += int((mine == outcome).sum())
        for groups, _ in self.parts:
            for name, group in groups.items():
                group.add(frame if name is None else frame[frame["class"] == name])

    def iterations(self, rows: np.ndarray, settled_s: float) -> None:
        """Iteration-log rows; those ending after ``settled_s`` are held until the run's end is known."""
        end = rows[:, _COLUMN["start_s"]] + rows[:, _COLUMN["duration_s"]]
        later = end > settled_s
        if later.any():
            self._pending.append(rows[later].copy())
            rows, end = rows[~later], end[~later]
        self._add_iterations(rows, end)

    def _add_iterations(self, rows: np.ndarray, end: np.ndarray) -> None:
        self.series.iterations(rows, end)
        for _, iterations in self.parts:
            iterations.add(rows, end)

    def queue(self, times_s: np.ndarray, lengths: np.ndarray) -> None:
        if len(lengths):
            self.max_queue_length = max(self.max_queue_length, int(lengths.max()))
        self.series.queue(times_s, lengths)

    def gaps(self, gaps: InterTokenGaps, settled_s: float) -> None:
        """Inter-token gaps (:class:`~llmsim.sim.request.InterTokenGaps`); those of tokens that appeared
        after ``settled_s`` are held for the summary, which knows where its window ends."""
        for end, gap, weight in gaps.chunks():
            later = end > settled_s
            if later.any():
                self._pending_gaps.add(end[later], gap[later], weight[later])
                end, gap, weight = end[~later], gap[~later], weight[~later]
            # The part each token falls in: 0 before the warm-up ends, 1 up to the window's end, 2 after.
            part = np.zeros(len(end), np.int64)
            if self._gap_cuts:
                warmup_s, window_s = self._gap_cuts
                part += end >= warmup_s
                part += end > window_s
            for index, sketch in enumerate(self._gap_sketches):
                mine = part == index
                sketch.add(gap[mine], weight[mine])

    def close(self, end_s: float) -> None:
        """The run ended at ``end_s``: iterations that ended after it are dropped (as a run kept whole
        drops them)."""
        for rows in self._pending:
            end = rows[:, _COLUMN["start_s"]] + rows[:, _COLUMN["duration_s"]]
            self._add_iterations(rows[end <= end_s], end[end <= end_s])
        self._pending = []
        for writer in self.writers:
            writer.close()
        self.end_s = end_s

    @staticmethod
    def _class_summary(group: _Requests, counts: dict[str, int], window: float) -> ClassSummary:
        return ClassSummary(
            arrived=counts["arrived"], finished=counts["finished"], rejected=counts["rejected"],
            unfinished=counts["unfinished"], queue_wait_s=group.distribution("queue_wait_s"),
            ttft_s=group.distribution("ttft_s"), tpot_s=group.distribution("tpot_s"),
            e2e_s=group.distribution("e2e_s"), requests_per_s=group.done / window,
            output_tokens_per_s=group.done_tokens / window, offered_requests_per_s=group.offered / window,
            slo=group.slo_summary(window))

    def summary(self, result: SimulationResult) -> RunSummary:
        """The run's summary (``result``: the simulation's, its tables empty)."""
        scenario = result.scenario
        start, stop = measurement_window(result)
        whole = stop - start <= 0 or len(self.parts) == 1
        if whole:                                            # a degenerate window: measure the whole run
            start, stop = 0.0, max(result.end_s, 1e-12)
            groups, iterations = self.parts[0]
            for later_groups, later_iterations in self.parts[1:]:
                for name, group in groups.items():
                    group.merge(later_groups[name])
                iterations.merge(later_iterations)
        else:
            groups, iterations = self.parts[1]
        window = stop - start
        overall = groups[None]
        counts = RequestCounts(arrived=self.arrived, not_arrived=int(result.planned_requests - self.arrived),
                               **self.counts, preemptions=int(result.preemptions))
        if math.isnan(self.end_s):
            raise RuntimeError("a streamed run's summary is made after the run (close)")
        itl = QuantileSketch()
        for part in self._gap_sketches if whole else self._gap_sketches[1:2]:
            itl.merge(part)
        for end, gap, weight in self._pending_gaps.chunks():
            inside = (end >= start) & (end <= stop)
            itl.add(gap[inside], weight[inside])
        latency = Latency(**{name: overall.distribution(name) for name in LATENCY_COLUMNS}, itl_s=sketched(itl))
        sums = iterations.sums
        classes = None
        if self.class_counts:
            classes = {name: self._class_summary(groups[name], counts, window)
                       for name, counts in self.class_counts.items()}
        provisioned = result.provisioned
        replicas = (mean_replicas_between(provisioned, start, stop) if provisioned is not None
                    else scenario.deployment.replicas)
        ttft = np.concatenate(overall.ttft) if overall.ttft else np.zeros(0)
        ttft_rise, rising = rising_trend(ttft, scale=scenario.slo.ttft_s)
        return run_summary(
            result, (start, stop), replicas, counts, latency,
            throughput_of(overall.done, sums["tokens_out"], sums["prefill_tokens"], overall.offered, window,
                          replicas * scenario.devices_per_replica),
            overall.slo_summary(window),
            utilisation_from(iterations.overlap, window, scenario, result.kv_blocks_per_replica, replicas),
            QueueSummary(mean_length=result.mean_queue_length, max_length=self.max_queue_length,
                         mean_in_system=result.mean_in_system, ttft_rise=ttft_rise, steady=not rising),
            {name: sums[name] for name in SPECULATION_SUMS} if scenario.speculating else None,
            classes,
            autoscaling_summary(result, replicas, self.generated_tokens) if result.scaling is not None else None,
            None)
