"""A scenario's workload: how requests arrive and how long they are, read from its YAML.

Requests come from one of three sources:

- synthetic: an arrival process at a rate, and a length distribution per column;
- a replayed trace (``arrival: {process: trace, path: ..., format: ...}``, optionally windowed,
  filtered, sampled and rescaled: :mod:`llmsim.workload.trace_transforms`), which brings its
  arrival times and lengths;
- a dataset (``dataset: {path: sharegpt.json, chars_per_token: 4}``) whose requests' lengths are
  replayed, shuffled from the seed as ``vllm bench serve`` does, at the times of an arrival process.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.config.limits import MAX_CHARS_PER_TOKEN, MAX_QUANTITY, MIN_CHARS_PER_TOKEN
from llmsim.config.policies import FailedRequests
from llmsim.config.reader import Node
from llmsim.workload.arrivals import ARRIVAL_PROCESSES, RENEWAL_PROCESSES, Gamma, RenewalProcess, Replay
from llmsim.workload.classes import TrafficClass, class_entries, classes_from_node, classify
from llmsim.workload.lengths import LengthDistribution, length_from_node
from llmsim.workload.profiles import PROFILES, RateProfile, profile_from_node
from llmsim.workload.sessions import Sessions, sessions_from_node
from llmsim.workload.trace import Trace
from llmsim.workload.trace_formats import FORMATS, TIMED_FORMATS, detect_format, read_trace
from llmsim.workload.trace_transforms import TraceTransforms, check_selection, transforms_from_node

# The longest arrival window simulated: the longest duration any key takes (simulated time is
# float64 seconds, which resolve about 0.1 microsecond at 1e9 s but a whole second at 1e16 s).
MAX_ARRIVAL_WINDOW_S = MAX_QUANTITY["duration"]
MAX_GAMMA_CV = 100.0                # gamma gaps' coefficient of variation (shape 1e-4 at the limit)
# Below this the gaps are within 0.1% of even spacing (process: deterministic says so exactly); the shape
# 1 / cv^2 stays finite (a cv under about 1e-154 squares to 0).
MIN_GAMMA_CV = 1e-3


@dataclass(frozen=True)
class TraceFile:
    """Where a replayed trace or a dataset was read from and how (what writing the scenario out names)."""
    path: str
    format: str = "auto"
    failed: FailedRequests = FailedRequests.DROP        # a replayed trace's failed requests
    tokenizer: str | None = None                        # a dataset's
    chars_per_token: float | None = None                # a dataset's


@dataclass(frozen=True)
class Workload:
    """Arrivals and lengths, and how much traffic: ``num_requests`` and/or ``duration_s``.

    A replayed ``trace`` (arrivals :class:`Replay`, already windowed and filtered) brings its own
    lengths (``prompt_tokens`` and ``output_tokens`` are None); ``transforms`` sample and rescale
    it from the seed. A ``dataset`` gives the lengths of requests arriving by ``arrival``.
    ``classes`` (empty: one class of traffic) are the traffic classes of
    :mod:`llmsim.workload.classes`; when each has its own arrivals, ``arrival`` is None. With
    ``sessions`` the arrivals start conversations and ``prompt_tokens`` is each turn's new input
    (see :mod:`llmsim.workload.sessions`).
    """
    arrival: RenewalProcess | RateProfile | Replay | None
    prompt_tokens: LengthDistribution | None
    output_tokens: LengthDistribution | None
    num_requests: int | None
    duration_s: float | None
    trace: Trace | None = None
    transforms: TraceTransforms | None = None
    dataset: Trace | None = None
    sessions: Sessions | None = None
    hash_block_tokens: int = 512         # tokens per hash_ids entry of a replayed trace (Mooncake's blocks)
    classes: tuple[TrafficClass, ...] = ()
    trace_file: TraceFile | None = None      # the replayed ``trace``'s file
    dataset_file: TraceFile | None = None    # the ``dataset``'s file

    @property
    def rate_per_s(self) -> float:
        """The mean arrival rate: the arrival process's (a replayed trace's, after its transforms), or the
        sum of the classes' own processes when each class has one."""
        if self.arrival is not None:
            return self.arrival.rate_per_s
        return sum(c.arrival.rate_per_s for c in self.classes if c.arrival is not None)

    @property
    def requests_per_arrival(self) -> float:
        """Requests each arrival brings: a conversation's mean turns with sessions, else one."""
        return self.sessions.mean_turns() if self.sessions is not None else 1.0

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)


def arrival_from_node(arrival_node: Node) -> RenewalProcess | RateProfile:
    """A synthetic arrival process: a renewal process at a rate, or a time-varying profile."""
    process = arrival_node.choice("process", (*RENEWAL_PROCESSES, *PROFILES), "poisson")
    arrival: RenewalProcess | RateProfile
    if process in PROFILES:
        arrival = profile_from_node(arrival_node, process)
    else:
        rate = arrival_node.quantity("rate", "rate")
        kind = RENEWAL_PROCESSES[process]
        if kind is Gamma:
            arrival = kind(rate, arrival_node.number("cv", 1.0, minimum=MIN_GAMMA_CV, maximum=MAX_GAMMA_CV))
        else:
            arrival = kind(rate)
    arrival_node.done()
    return arrival


def workload_from_node(node: Node, max_tokens: int) -> Workload:
    if node.has("classes"):        # not a mapping, or empty: said of the classes, not of the arrival they decide
        class_entries(node)
    own_arrivals = isinstance(node.raw("classes", None), dict) and all(
        isinstance(c, dict) and "arrival" in c for c in node.raw("classes").values())
    if own_arrivals and node.has("arrival"):
        raise node.key_error("arrival", "every class has an arrival of its own", node.raw("arrival"),
                             "no workload.arrival when each class has one")
    arrival_node = node.child("arrival")
    trace = transforms = None
    trace_file: TraceFile | None = None
    arrival: RenewalProcess | RateProfile | Replay | None = None
    process = None if own_arrivals else arrival_node.choice("process", (*ARRIVAL_PROCESSES, *PROFILES), "poisson")
    if process is not None and process != Replay.process:
        arrival = arrival_from_node(arrival_node)
    elif process == Replay.process:
        path = arrival_node.path_value("path")
        fmt = arrival_node.choice("format", ("auto", *TIMED_FORMATS), "auto")
        if fmt == "auto" and detect_format(path, arrival_node, "path") not in TIMED_FORMATS:
            raise arrival_node.key_error("path", "a ShareGPT dataset has no arrival times", str(path),
                                         "a timed trace (formats " + ", ".join(TIMED_FORMATS) + "), or the "
                                         "dataset as workload.dataset with an arrival process and rate")
        failed = FailedRequests(arrival_node.choice("failed", FailedRequests.names(), FailedRequests.DROP))
        trace = read_trace(path, arrival_node, "path", fmt, failed=failed)
        transforms = transforms_from_node(arrival_node)
        trace = check_selection(trace, transforms, arrival_node, "path")
        hash_block_tokens = arrival_node.number("hash_block_tokens", Workload.hash_block_tokens, integer=True,
                                                minimum=1)
        arrival = Replay(transforms.replayed_rate_per_s(trace))
        trace_file = TraceFile(str(path), fmt, failed)
        arrival_node.done()

    num_requests, duration_s = traffic_amount(node, trace is not None)
    if trace is None and arrival is not None:
        check_window(node, arrival, num_requests, duration_s)
    if node.has("classes") and node.has("dataset"):
        raise node.key_error("classes", "traffic classes draw their own lengths: a dataset brings its own requests",
                             node.raw("classes"), "no workload.classes with workload.dataset")
    classes: tuple[TrafficClass, ...] = ()
    if node.has("classes") and trace is not None:      # each request's class from the trace's class column
        classes = classes_from_node(node, arrival_from_node, max_tokens, has_lengths=True, replayed=True)
        trace = classify(trace, classes, arrival_node.path_value("path"))
    if node.has("classes") and node.has("sessions"):
        raise node.key_error("sessions", "sessions are not combined with traffic classes", node.raw("sessions"),
                             "workload.sessions or workload.classes, not both")
    if trace is not None or node.has("dataset"):
        source = "the replayed trace" if trace is not None else "the dataset"
        for key in ("prompt_tokens", "output_tokens", "sessions") + (("dataset",) if trace is not None else ()):
            if node.has(key):
                raise node.key_error(key, f"lengths and sessions come from {source}", node.raw(key),
                                     "either arrival.process: trace, workload.dataset, or prompt_tokens and "
                                     "output_tokens")
        dataset, dataset_file = (None, None) if trace is not None else dataset_from_node(node.child("dataset"))
        node.done()
        return Workload(arrival, None, None, num_requests, duration_s, trace, transforms, dataset,
                        hash_block_tokens=hash_block_tokens if trace is not None else Workload.hash_block_tokens,
                        classes=classes, trace_file=trace_file,
                        dataset_file=dataset_file)
    if node.has("classes"):
        has_lengths = node.has("prompt_tokens") and node.has("output_tokens")
        classes = classes_from_node(node, lambda sub: arrival_from_node(sub), max_tokens, has_lengths)
        if not has_lengths:           # every class has its own lengths (classes_from_node checks)
            node.done()
            return Workload(arrival, None, None, num_requests, duration_s, classes=classes)
    prompt = length_from_node(node, "prompt_tokens", max_tokens)
    output = length_from_node(node, "output_tokens", max_tokens)
    sessions = sessions_from_node(node.child("sessions"), max_tokens) if node.has("sessions") else None
    if sessions is not None:
        check_session_start(node.child("sessions"), sessions, arrival)
    node.done()
    return Workload(arrival, prompt, output, num_requests, duration_s, classes=classes, sessions=sessions)


def check_session_start(node: Node, sessions: Sessions, arrival) -> None:
    """``workload.sessions.start: stationary`` needs a steady session rate: a renewal process (a rate profile's
    steady state changes with time)."""
    if sessions.stationary and not isinstance(arrival, RenewalProcess):
        raise node.key_error("start", f"a stationary start needs sessions arriving at a constant rate, not a "
                             f"{arrival.process} profile", "stationary",
                             "empty, or stationary with a poisson, gamma or deterministic arrival")


def dataset_from_node(node: Node) -> tuple[Trace, TraceFile]:
    """``workload.dataset``: the requests of a dataset or trace file, for their lengths, and that file."""
    tokenizer = node.path_value("tokenizer", None)
    chars_per_token = node.number("chars_per_token", None, minimum=MIN_CHARS_PER_TOKEN, maximum=MAX_CHARS_PER_TOKEN)
    fmt = node.choice("format", ("auto", *FORMATS), "auto")
    path = node.path_value("path")
    dataset = read_trace(path, node, "path", fmt, tokenizer=tokenizer, chars_per_token=chars_per_token)
    node.done()
    return dataset, TraceFile(str(path), fmt, tokenizer=None if tokenizer is None else str(tokenizer),
                              chars_per_token=chars_per_token)


def traffic_amount(node: Node, replayed: bool, defaults: tuple[int | None, float | None] = (None, None)
                   ) -> tuple[int | None, float | None]:
    """``workload.num_requests`` and ``workload.duration`` (``defaults`` where absent); a workload that is
    not a replayed trace needs one of the two."""
    num_requests = node.number("num_requests", defaults[0], integer=True, minimum=1, exclusive_minimum=False)
    duration_s = node.quantity("duration", "duration", defaults[1])
    if not replayed and num_requests is None and duration_s is None:
        raise node.error("say how much traffic to simulate", key=node.key_path("num_requests"),
                         has_value=False, allowed="workload.num_requests (a count) or workload.duration (e.g. '600 s')")
    return num_requests, duration_s


def check_window(node: Node, arrival: RenewalProcess | RateProfile | Replay, num_requests: int | None,
                  duration_s: float | None) -> None:
    """Refuse traffic that takes longer than :data:`MAX_ARRIVAL_WINDOW_S` to arrive (a rate of
    1e-300/s would report every latency as 0 and every SLO met); a longer ``duration`` is refused
    by its key's own maximum."""
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
