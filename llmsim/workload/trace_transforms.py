"""What is done to a replayed trace before it is simulated: window, filter, sample, rescale in time.

In a scenario, under ``workload.arrival`` with ``process: trace``::

    window: {start: 10 min, end: 20 min}   # the requests arriving in [start, end), times from start
    filter: {model: ChatGPT, log_type: Conversation log}   # a label, or a list of them (BurstGPT)
    sample: 0.25                           # keep this fraction of requests, drawn from the scenario seed
    speed: 2                               # time runs twice as fast: every gap between arrivals halves
    rate: 5/s                              # or: time stretched so the mean rate is 5/s

Window and filter select requests when the scenario is read (so an empty selection is a
configuration error there); sampling and the time scale apply when the trace is generated
from the scenario seed, sampling first, so ``rate`` is the rate of what is simulated.

The mean rate of a trace of ``n`` requests is ``(n - 1) / (last arrival - first arrival)``:
one over the mean gap between arrivals. Rescaling multiplies every arrival time by one
factor, so the shape of the traffic (bursts, daily cycle) is kept, compressed or stretched.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from llmsim.config.reader import Node
from llmsim.workload.trace import Trace

LABELS = ("model", "log_type")        # the per-request labels a filter may name
SAMPLE_STREAM = 3                     # the seed's 4th child stream (generate_trace uses the first 3)


def mean_rate_per_s(arrival_s: np.ndarray) -> float:
    """Requests per second: one over the mean gap between consecutive arrivals."""
    if len(arrival_s) < 2 or arrival_s[-1] <= arrival_s[0]:
        return float("inf")
    return (len(arrival_s) - 1) / float(arrival_s[-1] - arrival_s[0])


def has_time_scale(trace: Trace) -> bool:
    """Whether the trace's requests arrive at more than one time, so that it has a finite mean rate
    to rescale (all at one instant, they stay a burst at any rate)."""
    return len(trace) >= 2 and trace.arrival_s[-1] > trace.arrival_s[0]


def window(trace: Trace, start_s: float, end_s: float | None) -> Trace:
    """The requests arriving in ``[start_s, end_s)``, their times counted from ``start_s``."""
    keep = (trace.arrival_s >= start_s) & (trace.arrival_s < (np.inf if end_s is None else end_s))
    end = "end" if end_s is None else f"{end_s:g} s"
    selected = trace.take(np.flatnonzero(keep), f"{trace.description}, window {start_s:g} s to {end}")
    return replace(selected, arrival_s=selected.arrival_s - start_s)


def filter_labels(trace: Trace, label: str, allowed: tuple[str, ...]) -> Trace:
    """The requests whose ``label`` (model, log_type) is one of ``allowed``."""
    values = getattr(trace, label)
    keep = np.isin(values, np.asarray(allowed, dtype=object))
    return trace.take(np.flatnonzero(keep), f"{trace.description}, {label} in {', '.join(allowed)}")


def sample(trace: Trace, fraction: float, rng: np.random.Generator) -> Trace:
    """``round(fraction * len(trace))`` requests drawn without replacement, kept in arrival order."""
    count = int(round(fraction * len(trace)))
    index = np.sort(rng.choice(len(trace), size=count, replace=False))
    return trace.take(index, f"{trace.description}, {fraction:g} sampled")


def speed_up(trace: Trace, factor: float) -> Trace:
    """Time runs ``factor`` times faster: every arrival time (and so every gap) divided by it."""
    return replace(trace, arrival_s=trace.arrival_s / factor, description=f"{trace.description}, x{factor:g} speed")


def rescale_to_rate(trace: Trace, rate_per_s: float) -> Trace:
    """Times stretched by one factor so the mean rate (:func:`mean_rate_per_s`) is ``rate_per_s``."""
    factor = rate_per_s / mean_rate_per_s(trace.arrival_s)
    return replace(trace, arrival_s=trace.arrival_s / factor,
                   description=f"{trace.description}, rescaled to {rate_per_s:g}/s (x{factor:.3g} speed)")


@dataclass(frozen=True)
class TraceTransforms:
    """The transforms of a scenario's replayed trace (see the module docstring)."""
    window_start_s: float = 0.0
    window_end_s: float | None = None
    labels: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sample_fraction: float | None = None
    speed: float | None = None
    rate_per_s: float | None = None

    def select(self, trace: Trace) -> Trace:
        """Window, then filter (when the scenario is read)."""
        if self.window_start_s > 0 or self.window_end_s is not None:
            trace = window(trace, self.window_start_s, self.window_end_s)
        for label, allowed in self.labels:
            trace = filter_labels(trace, label, allowed)
        return trace

    def replayed_rate_per_s(self, selected: Trace) -> float:
        """The mean rate of the replay of ``selected`` (windowed and filtered): the target ``rate``,
        else the trace's own, thinned by sampling and sped up."""
        if self.rate_per_s is not None:
            return self.rate_per_s
        return mean_rate_per_s(selected.arrival_s) * (self.sample_fraction or 1.0) * (self.speed or 1.0)

    def apply(self, trace: Trace, seed: int) -> Trace:
        """Sample from ``seed``, then speed up or rescale (when the trace is generated)."""
        if self.sample_fraction is not None:
            rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(SAMPLE_STREAM + 1)[SAMPLE_STREAM])
            trace = sample(trace, self.sample_fraction, rng)
        if self.speed is not None:
            trace = speed_up(trace, self.speed)
        if self.rate_per_s is not None and has_time_scale(trace):
            trace = rescale_to_rate(trace, self.rate_per_s)
        return trace


def transforms_from_node(node: Node) -> TraceTransforms:
    """The transform keys of ``workload.arrival`` (all optional)."""
    start_s, end_s = 0.0, None
    if node.has("window"):
        win = node.child("window")
        start_s = win.quantity("start", "duration", 0.0, minimum=0.0, exclusive_minimum=False)
        end_s = win.quantity("end", "duration", None)
        if end_s is not None and end_s <= start_s:
            raise win.key_error("end", f"must be after start ({start_s:g} s)", win.raw("end"),
                                f"a duration > {start_s:g} s")
        win.done()
    labels = []
    if node.has("filter"):
        filt = node.child("filter")
        for label in LABELS:
            if filt.has(label):
                raw = filt.raw(label)
                values = raw if isinstance(raw, list) else [raw]
                if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
                    raise filt.key_error(label, "expected a label or a list of labels", raw,
                                         f"the trace's {label} values, e.g. ChatGPT")
                labels.append((label, tuple(str(v) for v in values)))
        filt.done()
    sample_fraction = node.number("sample", None, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    speed = node.number("speed", None, minimum=0.0, exclusive_minimum=True)
    rate = node.quantity("rate", "rate", None)
    if speed is not None and rate is not None:
        raise node.key_error("rate", "give either speed or rate, not both (each sets the time scale)", node.raw("rate"),
                             "speed: FACTOR, or rate: REQUESTS PER SECOND")
    return TraceTransforms(start_s, end_s, tuple(labels), sample_fraction, speed, rate)


def check_selection(trace: Trace, transforms: TraceTransforms, node: Node, key: str) -> Trace:
    """The selected trace; a ConfigError if a label filter names a label the trace lacks or nothing is left."""
    for label, _ in transforms.labels:
        if getattr(trace, label) is None:
            raise node.child("filter").key_error(label, f"this trace has no {label} column to filter on",
                                                 dict(transforms.labels)[label], "a BurstGPT trace (Model, Log Type)")
    selected = transforms.select(trace)
    if len(selected) == 0:
        present = {label: sorted(set(map(str, getattr(trace, label))))[:10] for label, _ in transforms.labels}
        raise node.key_error(key, "no request of the trace is left after the window and filter"
                             + (f" (the trace's labels: {present})" if present else ""), node.raw(key),
                             "a window inside the trace's time span and labels the trace has")
    fraction = transforms.sample_fraction
    if fraction is not None and round(fraction * len(selected)) < 1:
        raise node.key_error("sample", f"keeps no request of the {len(selected):,} selected", node.raw("sample"),
                             f"a fraction > {0.5 / len(selected):.6g} (to keep one request or more) and <= 1")
    if transforms.rate_per_s is not None and not has_time_scale(selected):
        raise node.key_error("rate", f"the {len(selected):,} selected requests all arrive at one time: there is no "
                                     "time scale to rescale", node.raw("rate"),
                             "no rate (replay the burst as it is), or a trace whose arrival times differ")
    return selected
