"""Request traffic: arrival times and prompt/output lengths, drawn once per scenario seed.

A :class:`Trace` is the whole arrival sequence, sampled up front with numpy from
independent streams (arrivals, prompt lengths, output lengths) spawned from the
scenario seed. Arrival gaps are drawn at unit rate and scaled by 1/rate, so two
configurations that differ in anything but the workload, and even two rates,
see the same requests in the same order: common random numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.config.reader import Node

ARRIVAL_PROCESSES = ("poisson", "gamma", "deterministic", "trace")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "exponential", "empirical")


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts of prompts or outputs; samples are rounded and clipped to [minimum, maximum]."""
    distribution: str
    value: float = 0.0          # fixed
    low: int = 1                # uniform (inclusive)
    high: int = 1
    mean: float = 0.0           # lognormal, exponential
    sigma: float = 0.0          # lognormal: standard deviation of log(length)
    samples: tuple[int, ...] = ()  # empirical
    minimum: int = 1
    maximum: int | None = None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        kind = self.distribution
        if kind == "fixed":
            values = np.full(n, self.value)
        elif kind == "uniform":
            values = rng.integers(self.low, self.high + 1, size=n)
        elif kind == "lognormal":
            mu = np.log(self.mean) - self.sigma ** 2 / 2   # so that E[length] = mean before rounding
            values = np.exp(mu + self.sigma * rng.standard_normal(n))
        elif kind == "exponential":
            # ceil of an exponential is geometric on 1, 2, ...: the discrete memoryless length.
            p = 1.0 / self.mean
            values = rng.geometric(p, size=n) if p < 1 else np.ones(n)
        else:
            values = np.asarray(self.samples)[rng.integers(0, len(self.samples), size=n)]
        values = np.rint(values).astype(np.int64)
        return np.clip(values, self.minimum, self.maximum if self.maximum is not None else None)


@dataclass(frozen=True)
class ArrivalProcess:
    process: str
    rate_per_s: float = 0.0
    cv: float = 1.0              # gamma: coefficient of variation of the gaps


@dataclass(frozen=True)
class Workload:
    arrival: ArrivalProcess
    prompt_tokens: LengthDistribution | None
    output_tokens: LengthDistribution | None
    num_requests: int | None
    duration_s: float | None
    trace: "Trace | None" = None    # replayed trace, when arrival.process == "trace"


@dataclass(frozen=True)
class Trace:
    """What arrives: sorted arrival times and the token counts of each request."""
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                             "output_tokens": self.output_tokens})


def generate_trace(workload: Workload, seed: int) -> Trace:
    """Sample the scenario's requests from ``seed`` (the same seed gives the same trace)."""
    if workload.trace is not None:
        return _cut(workload.trace, workload.num_requests, workload.duration_s)
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng(s)
                                            for s in np.random.SeedSequence(seed).spawn(3))
    arrival = workload.arrival
    if workload.num_requests is not None:
        n = workload.num_requests
        times = np.cumsum(_unit_rate_gaps(arrival, arrivals_rng, n)) / arrival.rate_per_s
    else:
        # Draw in blocks until the duration is covered; the prefix does not depend on the block size.
        expected = workload.duration_s * arrival.rate_per_s
        chunks, total = [], 0.0
        block = int(expected * 1.2) + 100
        while total <= workload.duration_s:
            gaps = _unit_rate_gaps(arrival, arrivals_rng, block) / arrival.rate_per_s
            chunks.append(gaps)
            total += gaps.sum()
        times = np.cumsum(np.concatenate(chunks))
        times = times[times <= workload.duration_s]
        n = len(times)
    return Trace(times, workload.prompt_tokens.sample(prompt_rng, n), workload.output_tokens.sample(output_rng, n))


def _unit_rate_gaps(arrival: ArrivalProcess, rng: np.random.Generator, n: int) -> np.ndarray:
    if arrival.process == "poisson":
        return rng.standard_exponential(n)
    if arrival.process == "gamma":
        shape = 1.0 / arrival.cv ** 2
        return rng.standard_gamma(shape, n) / shape
    return np.ones(n)


def _cut(trace: Trace, num_requests, duration_s) -> Trace:
    keep = np.ones(len(trace), dtype=bool)
    if duration_s is not None:
        keep &= trace.arrival_s <= duration_s
    idx = np.flatnonzero(keep)[:num_requests]
    return Trace(trace.arrival_s[idx], trace.prompt_tokens[idx], trace.output_tokens[idx])


# -- reading ------------------------------------------------------------------------------

def read_trace_csv(path: Path, node: Node, key: str) -> Trace:
    """A trace CSV with columns arrival_s, prompt_tokens, output_tokens (extra columns ignored)."""
    required = ("arrival_s", "prompt_tokens", "output_tokens")
    frame = _read_csv(path, node, key)
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise node.key_error(key, f"trace {path} lacks column(s) {', '.join(missing)}", str(path),
                             "a CSV with columns " + ", ".join(required))
    for column in required:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() | (values < (0 if column == "arrival_s" else 1))
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise node.key_error(key, f"trace {path}, column {column}, data row {row + 1}: "
                                      f"not a valid value", frame[column].iloc[row],
                                 "arrival_s >= 0 seconds; token counts >= 1")
        frame[column] = values
    frame = frame.sort_values("arrival_s", kind="stable")
    return Trace(frame["arrival_s"].to_numpy(float), frame["prompt_tokens"].to_numpy(np.int64),
                 frame["output_tokens"].to_numpy(np.int64))


def _read_csv(path: Path, node: Node, key: str) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise node.key_error(key, f"cannot read CSV {path}: {exc}", str(path), "a CSV file with a header row") from None
    if frame.empty:
        raise node.key_error(key, f"CSV {path} has no rows", str(path), "a CSV file with at least one data row")
    return frame


def length_from_node(node: Node, key: str, max_tokens: int) -> LengthDistribution:
    """``key: 512`` (fixed) or ``key: {distribution: lognormal, mean: 600, sigma: 0.8, max: 4096}``."""
    raw = node.raw(key)
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = node.number(key, integer=True, minimum=1, exclusive_minimum=False)
        return LengthDistribution("fixed", value=value, minimum=1, maximum=max_tokens)
    sub = node.child(key)
    kind = sub.choice("distribution", LENGTH_DISTRIBUTIONS)
    count = dict(integer=True, minimum=1, exclusive_minimum=False)
    minimum = sub.number("min", 1, **count)
    maximum = sub.number("max", max_tokens, **count)
    if minimum > maximum:
        raise sub.key_error("min", f"must not exceed max ({maximum})", minimum, f"1..{maximum}")
    params: dict = {}
    if kind == "fixed":
        params["value"] = sub.number("value", **count)
    elif kind == "uniform":
        params["low"] = sub.number("low", **count)
        params["high"] = sub.number("high", **count)
        if params["high"] < params["low"]:
            raise sub.key_error("high", f"must be at least low ({params['low']})", params["high"],
                                f"an integer >= {params['low']}")
    elif kind == "lognormal":
        params["mean"] = sub.number("mean", minimum=1, exclusive_minimum=False)
        params["sigma"] = sub.number("sigma", minimum=0, exclusive_minimum=False)
    elif kind == "exponential":
        params["mean"] = sub.number("mean", minimum=1, exclusive_minimum=False)
    else:
        path = sub.path_value("path")
        column = sub.string("column", key)
        frame = _read_csv(path, sub, "path")
        if column not in frame.columns:
            raise sub.key_error("column", f"no such column in {path}", column, ", ".join(map(str, frame.columns)))
        values = pd.to_numeric(frame[column], errors="coerce").dropna()
        values = values[values >= 1]
        if values.empty:
            raise sub.key_error("column", f"column has no token counts >= 1 in {path}", column)
        params["samples"] = tuple(int(v) for v in np.rint(values.to_numpy()))
    sub.done()
    return LengthDistribution(kind, minimum=minimum, maximum=maximum, **params)


def workload_from_node(node: Node, max_tokens: int) -> Workload:
    arrival_node = node.child("arrival")
    process = arrival_node.choice("process", ARRIVAL_PROCESSES, "poisson")
    trace = None
    if process == "trace":
        trace = read_trace_csv(arrival_node.path_value("path"), arrival_node, "path")
        arrival = ArrivalProcess("trace")
    else:
        rate = arrival_node.quantity("rate", "rate")
        cv = arrival_node.number("cv", 1.0, minimum=0.0) if process == "gamma" else 1.0
        arrival = ArrivalProcess(process, rate, cv)
    arrival_node.done()

    num_requests = node.number("num_requests", None, integer=True, minimum=1, exclusive_minimum=False)
    duration_s = node.quantity("duration", "duration", None)
    if trace is None and num_requests is None and duration_s is None:
        raise node.error("say how much traffic to simulate", key=node.key_path("num_requests"),
                         has_value=False, allowed="workload.num_requests (a count) or workload.duration (e.g. '600 s')")
    if trace is not None:
        for key in ("prompt_tokens", "output_tokens"):
            if node.has(key):
                raise node.key_error(key, "lengths come from the replayed trace", node.raw(key),
                                     "no prompt_tokens/output_tokens with arrival.process: trace")
        node.done()
        return Workload(arrival, None, None, num_requests, duration_s, trace)
    prompt = length_from_node(node, "prompt_tokens", max_tokens)
    output = length_from_node(node, "output_tokens", max_tokens)
    node.done()
    return Workload(arrival, prompt, output, num_requests, duration_s)

