"""A scenario's requests drawn from its workload and seed: :func:`generate_trace`.

The top of the workload package: it reads a :class:`~llmsim.workload.workload.Workload` and
returns a :class:`~llmsim.workload.trace.Trace` (see that module on common random numbers).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from llmsim.workload.arrivals import RenewalProcess, Replay
from llmsim.workload.classes import TrafficClass
from llmsim.workload.profiles import RateProfile
from llmsim.workload.trace import Trace
from llmsim.workload.workload import Workload


def generate_trace(workload: Workload, seed: int) -> Trace:
    """Sample the scenario's requests from ``seed`` (the same seed gives the same trace)."""
    if workload.trace is not None:
        trace = workload.trace if workload.transforms is None else workload.transforms.apply(workload.trace, seed)
        return trace.cut(workload.num_requests, workload.duration_s)
    if workload.classes:
        return _class_trace(workload, seed)
    # Synthetic arrivals: the reader gives every such workload an arrival process, and both lengths
    # unless a dataset brings them.
    arrival, prompt, output = workload.arrival, workload.prompt_tokens, workload.output_tokens
    assert arrival is not None and not isinstance(arrival, Replay)
    if workload.sessions is not None:
        assert prompt is not None and output is not None
        return workload.sessions.trace(arrival, workload.num_requests, workload.duration_s, prompt, output, seed)
    arrivals_rng, prompt_rng, output_rng = (np.random.default_rng(s)
                                            for s in np.random.SeedSequence(seed).spawn(3))
    times = arrival.times(arrivals_rng, workload.num_requests, workload.duration_s)
    n = len(times)
    if workload.dataset is not None:
        return replace(workload.dataset.take(dataset_order(len(workload.dataset), n, prompt_rng)), arrival_s=times)
    assert prompt is not None and output is not None
    return Trace(times, prompt.sample(prompt_rng, n), output.sample(output_rng, n))


def _class_trace(workload: Workload, seed: int) -> Trace:
    """Requests of several traffic classes: shares of one arrival stream, or a stream per class.

    The streams beyond the three of a one-class trace (class draws, each class's arrivals and
    lengths) are further children of the same seed, so adding classes leaves the first three as
    they are.
    """
    classes = workload.classes
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4 + 3 * len(classes))]
    if workload.arrival is not None:
        assert not isinstance(workload.arrival, Replay)     # replayed classes come from the trace's class column
        times = workload.arrival.times(streams[0], workload.num_requests, workload.duration_s)
        # Each arrival's class: an independent draw with the classes' shares.
        index = np.searchsorted(np.cumsum([c.share for c in classes]), streams[3].random(len(times)), side="right")
        index = index.clip(0, len(classes) - 1)
    else:
        parts = [_own_arrival(c).times(streams[4 + 3 * i], workload.num_requests, workload.duration_s)
                 for i, c in enumerate(classes)]
        times = np.concatenate(parts)
        index = np.concatenate([np.full(len(p), i) for i, p in enumerate(parts)])
        order = np.argsort(times, kind="stable")[:workload.num_requests]
        times, index = times[order], index[order]
    prompt, output = np.zeros(len(times), np.int64), np.zeros(len(times), np.int64)
    for i, c in enumerate(classes):
        mine = index == i
        prompt_length = c.prompt_tokens or workload.prompt_tokens
        output_length = c.output_tokens or workload.output_tokens
        assert prompt_length is not None and output_length is not None     # classes_from_node checks
        prompt[mine] = prompt_length.sample(streams[5 + 3 * i], int(mine.sum()))
        output[mine] = output_length.sample(streams[6 + 3 * i], int(mine.sum()))
    return Trace(times, prompt, output, class_index=index.astype(np.int64))


def dataset_order(size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Which of a dataset's ``size`` requests the ``n`` arrivals carry: the dataset shuffled (as
    ``vllm bench serve`` shuffles it), taken in that order and reshuffled each time it runs out."""
    rounds = -(-n // size)
    return np.concatenate([rng.permutation(size) for _ in range(rounds)])[:n]


def _own_arrival(traffic_class: TrafficClass) -> RenewalProcess | RateProfile:
    """A class's own arrival process (classes_from_node gives every class one, or none of them)."""
    assert traffic_class.arrival is not None
    return traffic_class.arrival
