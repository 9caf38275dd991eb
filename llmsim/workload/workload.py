"""A scenario's workload: how requests arrive and how long they are, read from its YAML."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.config.reader import Node
from llmsim.workload.arrivals import ARRIVAL_PROCESSES, RENEWAL_PROCESSES, Gamma, RenewalProcess, Replay
from llmsim.workload.lengths import LengthDistribution, length_from_node
from llmsim.workload.sessions import Sessions, sessions_from_node
from llmsim.workload.trace import Trace, read_trace_csv

# The longest arrival window simulated: simulated time is float64 seconds, which resolve about
# 0.1 microsecond at 1e9 s (32 years) but a whole second at 1e16 s, where every latency rounds to 0.
MAX_ARRIVAL_WINDOW_S = 1e9


@dataclass(frozen=True)
class Workload:
    """Arrivals and lengths, and how much traffic: ``num_requests`` and/or ``duration_s``.

    A replayed ``trace`` (arrivals :class:`Replay`) brings its own lengths (``prompt_tokens``
    and ``output_tokens`` are None). With ``sessions`` the arrivals start conversations and
    ``prompt_tokens`` is each turn's new input (see :mod:`llmsim.workload.sessions`).
    """
    arrival: RenewalProcess | Replay
    prompt_tokens: LengthDistribution | None
    output_tokens: LengthDistribution | None
    num_requests: int | None
    duration_s: float | None
    trace: Trace | None = None
    sessions: Sessions | None = None


def workload_from_node(node: Node, max_tokens: int) -> Workload:
    arrival_node = node.child("arrival")
    process = arrival_node.choice("process", ARRIVAL_PROCESSES, "poisson")
    trace = None
    if process == Replay.process:
        trace = read_trace_csv(arrival_node.path_value("path"), arrival_node, "path")
        arrival = Replay()
    else:
        rate = arrival_node.quantity("rate", "rate")
        kind = RENEWAL_PROCESSES[process]
        arrival = kind(rate, arrival_node.number("cv", 1.0, minimum=0.0)) if kind is Gamma else kind(rate)
    arrival_node.done()

    num_requests = node.number("num_requests", None, integer=True, minimum=1, exclusive_minimum=False)
    duration_s = node.quantity("duration", "duration", None)
    if trace is None and num_requests is None and duration_s is None:
        raise node.error("say how much traffic to simulate", key=node.key_path("num_requests"),
                         has_value=False, allowed="workload.num_requests (a count) or workload.duration (e.g. '600 s')")
    if trace is None:
        _check_window(node, arrival, num_requests, duration_s)
    if trace is not None:
        for key in ("prompt_tokens", "output_tokens", "sessions"):
            if node.has(key):
                raise node.key_error(key, "lengths and sessions come from the replayed trace", node.raw(key),
                                     "no prompt_tokens/output_tokens/sessions with arrival.process: trace")
        node.done()
        return Workload(arrival, None, None, num_requests, duration_s, trace)
    prompt = length_from_node(node, "prompt_tokens", max_tokens)
    output = length_from_node(node, "output_tokens", max_tokens)
    sessions = sessions_from_node(node.child("sessions"), max_tokens) if node.has("sessions") else None
    node.done()
    return Workload(arrival, prompt, output, num_requests, duration_s, sessions=sessions)


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
