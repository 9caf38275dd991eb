"""A scenario's workload: how requests arrive and how long they are, read from its YAML."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.config.reader import Node
from llmsim.workload.arrivals import ARRIVAL_PROCESSES, RENEWAL_PROCESSES, Gamma, RenewalProcess, Replay
from llmsim.workload.classes import TrafficClass, classes_from_node
from llmsim.workload.lengths import LengthDistribution, length_from_node
from llmsim.workload.profiles import PROFILES, RateProfile, profile_from_node
from llmsim.workload.trace import Trace, read_trace_csv

# The longest arrival window simulated: simulated time is float64 seconds, which resolve about
# 0.1 microsecond at 1e9 s (32 years) but a whole second at 1e16 s, where every latency rounds to 0.
MAX_ARRIVAL_WINDOW_S = 1e9


@dataclass(frozen=True)
class Workload:
    """Arrivals and lengths, and how much traffic: ``num_requests`` and/or ``duration_s``.

    A replayed ``trace`` (arrivals :class:`Replay`) brings its own lengths (``prompt_tokens``
    and ``output_tokens`` are None). ``classes`` (empty: one class of traffic) are the traffic
    classes of :mod:`llmsim.workload.classes`; when each has its own arrivals, ``arrival`` is
    None.
    """
    arrival: RenewalProcess | RateProfile | Replay | None
    prompt_tokens: LengthDistribution | None
    output_tokens: LengthDistribution | None
    num_requests: int | None
    duration_s: float | None
    trace: Trace | None = None
    classes: tuple[TrafficClass, ...] = ()

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)


def arrival_from_node(arrival_node: Node, replay: bool = True) -> RenewalProcess | RateProfile | Replay:
    """An arrival process: a renewal process at a rate, a time-varying profile, or (``replay``) a trace."""
    processes = (*ARRIVAL_PROCESSES, *PROFILES) if replay else (*RENEWAL_PROCESSES, *PROFILES)
    process = arrival_node.choice("process", processes, "poisson")
    if process == Replay.process:
        arrival = Replay()
        arrival_node.path_value("path")
    elif process in PROFILES:
        arrival = profile_from_node(arrival_node, process)
    else:
        rate = arrival_node.quantity("rate", "rate")
        kind = RENEWAL_PROCESSES[process]
        arrival = kind(rate, arrival_node.number("cv", 1.0, minimum=0.0)) if kind is Gamma else kind(rate)
    arrival_node.done()
    return arrival


def workload_from_node(node: Node, max_tokens: int) -> Workload:
    own_arrivals = isinstance(node.raw("classes", None), dict) and all(
        isinstance(c, dict) and "arrival" in c for c in node.raw("classes").values())
    arrival_node = node.child("arrival")
    trace, arrival = None, None
    if own_arrivals and node.has("arrival"):
        raise node.key_error("arrival", "every class has an arrival of its own", node.raw("arrival"),
                             "no workload.arrival when each class has one")
    if not own_arrivals:
        arrival = arrival_from_node(arrival_node)
        if isinstance(arrival, Replay):
            trace = read_trace_csv(arrival_node.path_value("path"), arrival_node, "path")

    num_requests = node.number("num_requests", None, integer=True, minimum=1, exclusive_minimum=False)
    duration_s = node.quantity("duration", "duration", None)
    if trace is None and num_requests is None and duration_s is None:
        raise node.error("say how much traffic to simulate", key=node.key_path("num_requests"),
                         has_value=False, allowed="workload.num_requests (a count) or workload.duration (e.g. '600 s')")
    if trace is None and arrival is not None:
        _check_window(node, arrival, num_requests, duration_s)
    if trace is not None:
        if node.has("classes"):
            raise node.key_error("classes", "a replayed trace brings its own requests", node.raw("classes"),
                                 "no workload.classes with arrival.process: trace")
        for key in ("prompt_tokens", "output_tokens"):
            if node.has(key):
                raise node.key_error(key, "lengths come from the replayed trace", node.raw(key),
                                     "no prompt_tokens/output_tokens with arrival.process: trace")
        node.done()
        return Workload(arrival, None, None, num_requests, duration_s, trace)
    classes = ()
    if node.has("classes"):
        has_lengths = node.has("prompt_tokens") and node.has("output_tokens")
        classes = classes_from_node(node, lambda sub: arrival_from_node(sub, replay=False), max_tokens, has_lengths)
        if all(c.prompt_tokens is not None and c.output_tokens is not None for c in classes) and not has_lengths:
            node.done()
            return Workload(arrival, None, None, num_requests, duration_s, classes=classes)
    prompt = length_from_node(node, "prompt_tokens", max_tokens)
    output = length_from_node(node, "output_tokens", max_tokens)
    node.done()
    return Workload(arrival, prompt, output, num_requests, duration_s, classes=classes)


def _check_window(node: Node, arrival: RenewalProcess, num_requests: int | None, duration_s: float | None) -> None:
    """Refuse traffic that takes longer than :data:`MAX_ARRIVAL_WINDOW_S` to arrive (a rate of
    1e-300/s would report every latency as 0 and every SLO met)."""
    if duration_s is not None and duration_s > MAX_ARRIVAL_WINDOW_S:
        raise node.key_error("duration", f"longer than the {MAX_ARRIVAL_WINDOW_S:g} s simulated time resolves "
                             "latencies in", node.raw("duration"), f"at most {MAX_ARRIVAL_WINDOW_S:g} s")
    if num_requests is None:
        return
    window_s = num_requests / arrival.rate_per_s
    if window_s > MAX_ARRIVAL_WINDOW_S:
        arrival_node = node.child("arrival")
        raise arrival_node.key_error(
            "rate", f"{num_requests:,} requests at this rate take about {window_s:.3g} s to arrive; beyond "
                    f"{MAX_ARRIVAL_WINDOW_S:g} s simulated time (float64 seconds) is too coarse for latencies "
                    f"(it resolves {np.spacing(window_s):.3g} s there)", arrival_node.raw("rate"),
            f"a rate of at least {num_requests / MAX_ARRIVAL_WINDOW_S:.3g}/s, or fewer workload.num_requests")
