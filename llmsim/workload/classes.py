"""Traffic classes: kinds of requests sharing one fleet, each with its own lengths and promises.

``workload.classes`` maps a class name to its settings. A class either takes a ``share`` of
the workload's arrivals (every class a share, summing to 1: each arrival is assigned a class
by an independent categorical draw) or has an ``arrival`` process of its own (every class
one: the streams are merged). Each class may set its own ``prompt_tokens`` and
``output_tokens`` (default: the workload's), and how the scheduler treats it: ``priority``
(0 is the most urgent), ``weight`` (its share of the token budget under weighted fair
sharing), ``reserved_seqs`` (sequence slots no other class may take: isolation),
``queue_timeout`` and ``on_timeout``: ``dispatch`` (forced into the next iteration past the
token budget), ``dedicated`` (forced in, past the budget and past ``max_num_seqs`` too, into at
most ``dedicated_seqs`` extra slots: a small batch of its own) or ``reject``.

Defaults follow common serving practice (multi-level priority queues with differentiated
queue timeouts; ``confidence: assumption``, not a measured figure): a class named
``interactive`` has priority 0 and a 50 ms timeout, ``standard`` priority 1 and 200 ms,
``batch`` priority 2 and 1000 ms, all with ``on_timeout: dispatch``. Any other name has
priority 0 and the engine's ``queue_timeout`` / ``on_timeout``. A class's SLO is set under
``slo.classes.<name>`` (read with the scenario).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from llmsim.config.policies import OnTimeout, members_of
from llmsim.config.reader import Node
from llmsim.errors import ConfigError
from llmsim.workload.arrivals import RenewalProcess
from llmsim.workload.lengths import LengthDistribution, length_from_node
from llmsim.workload.profiles import RateProfile
from llmsim.workload.trace_formats import row_error

# name -> (priority, queue timeout in seconds): the tiers of common practice.
PRACTICE_TIERS = {"interactive": (0, 0.050), "standard": (1, 0.200), "batch": (2, 1.000)}
DEDICATED_SEQS = 4
SHARE_TOLERANCE = 1e-6
# The heaviest class weight over the lightest, at most. Weighted fair scheduling credits the lightest
# class weight / heaviest x 1,024 tokens a round (llmsim.sim.scheduling): at this ratio about 0.001,
# still a distinct step in a float64 credit of the largest request's tokens (1e7 x 1e-16 = 1e-9).
# A larger ratio is strict precedence in practice, which engine.scheduling_policy: priority says.
MAX_WEIGHT_RATIO = 1e6


@dataclass(frozen=True)
class TrafficClass:
    """One class of traffic (see the module docstring). ``queue_timeout_s`` None: the engine's."""
    name: str
    share: float | None
    arrival: RenewalProcess | RateProfile | None    # its own arrival process (renewal or rate profile), or None
    prompt_tokens: LengthDistribution | None
    output_tokens: LengthDistribution | None
    priority: int = 0
    weight: float = 1.0
    reserved_seqs: int = 0
    queue_timeout_s: float | None = None
    on_timeout: OnTimeout | None = None
    dedicated_seqs: int = DEDICATED_SEQS

    def __post_init__(self):
        members_of(self, on_timeout=OnTimeout)


def class_entries(node: Node) -> tuple[Node, list]:
    """``workload.classes`` (``node`` is the workload) as a non-empty mapping: its node and the class names."""
    return node.named_entries("classes", "class names to their settings",
                              "e.g. {interactive: {share: 0.3}, batch: {share: 0.7}}")


def classes_from_node(node: Node, read_arrival, max_tokens: int, has_lengths: bool,
                      replayed: bool = False) -> tuple[TrafficClass, ...]:
    """``workload.classes`` (``node`` is the workload); ``read_arrival(node)`` reads an arrival mapping.
    ``replayed``: a trace with a class column brings each request's arrival, lengths and class, so a
    class sets neither share, arrival nor lengths, only how it is treated and its SLO."""
    holder, names = class_entries(node)
    classes = []
    for name in names:
        each = holder.child(str(name))
        priority, timeout = PRACTICE_TIERS.get(str(name), (0, None))
        if replayed:
            for key in ("share", "arrival", "prompt_tokens", "output_tokens"):
                if each.has(key):
                    raise each.key_error(key, "the replayed trace brings each request's arrival, lengths and "
                                              "class (its class column)", each.raw(key),
                                         "priority, weight, reserved_seqs, queue_timeout, on_timeout, dedicated_seqs")
        share = each.number("share", None, minimum=0.0, maximum=1.0, exclusive_minimum=True)
        arrival = read_arrival(each.child("arrival")) if each.has("arrival") else None
        if (share is None) == (arrival is None) and not replayed:
            raise each.error("a class needs exactly one of share (of the workload's arrivals) or arrival "
                             "(its own process)", key=each.path, value=each.data,
                             allowed="share: 0.3, or arrival: {process: poisson, rate: 5/s}")
        lengths: dict[str, LengthDistribution | None] = {}
        for key in ("prompt_tokens", "output_tokens"):
            if each.has(key):
                lengths[key] = length_from_node(each, key, max_tokens)
            elif not has_lengths and not replayed:
                raise each.error(f"this class needs {key} (the workload sets none)", key=each.key_path(key),
                                 has_value=False, allowed="a length, as workload.prompt_tokens")
            else:
                lengths[key] = None
        classes.append(TrafficClass(
            name=str(name), share=share, arrival=arrival, **lengths,
            priority=each.number("priority", priority, integer=True, minimum=0),
            weight=each.number("weight", 1.0, minimum=0.0, exclusive_minimum=True),
            reserved_seqs=each.number("reserved_seqs", 0, integer=True, minimum=0),
            queue_timeout_s=each.quantity("queue_timeout", "duration", timeout),
            on_timeout=_on_timeout(each, timeout),
            dedicated_seqs=each.number("dedicated_seqs", DEDICATED_SEQS, integer=True, minimum=1)))
        each.done()
    _check_weights(node, classes)
    shares = [c.share for c in classes]
    if replayed:
        return tuple(classes)
    if any(s is None for s in shares) and any(s is not None for s in shares):
        raise node.key_error("classes", "either every class has a share of the workload's arrivals or every "
                             "class has an arrival of its own", {c.name: c.share for c in classes},
                             "share on every class, or arrival on every class")
    total = sum(s for s in shares if s is not None)
    if shares[0] is not None and abs(total - 1.0) > SHARE_TOLERANCE:
        raise node.key_error("classes", f"the shares sum to {total:g}, not 1",
                             {c.name: c.share for c in classes}, "shares (0, 1] summing to 1")
    return tuple(classes)


def _check_weights(node: Node, classes: list[TrafficClass]) -> None:
    """Weights within :data:`MAX_WEIGHT_RATIO` of each other (only their ratios matter)."""
    heaviest, lightest = max(classes, key=lambda c: c.weight), min(classes, key=lambda c: c.weight)
    if heaviest.weight > MAX_WEIGHT_RATIO * lightest.weight:
        raise node.child("classes").child(lightest.name).key_error(
            "weight", f"{heaviest.weight / lightest.weight:.3g} times lighter than class '{heaviest.name}' "
                      f"({heaviest.weight:g}); weights count only relative to each other", lightest.weight,
            f"weights within {MAX_WEIGHT_RATIO:g}x of each other (for strict precedence, "
            "engine.scheduling_policy: priority)")


def classify(trace, classes: tuple[TrafficClass, ...], path, column: str = "class"):
    """``trace`` (as read, rows in file order) with each request's class index from its class column;
    a label that names no class is a ConfigError naming the file, line and value."""
    names = [c.name for c in classes]
    if trace.class_label is None:
        raise ConfigError(f"the trace has no '{column}' column to say each request's class", file=str(path),
                          key="line 1", value=column, allowed="an llmsim CSV trace with a class column, "
                                                              "or no workload.classes")
    index = np.array([names.index(label) if label in names else -1 for label in trace.class_label.tolist()],
                     dtype=np.int64)
    unknown = np.flatnonzero(index < 0)
    if len(unknown):
        row = int(unknown[0])
        raise row_error(path, row + 2, column, trace.class_label[row], ", ".join(names) + " (workload.classes)",
                        "a request of a class the scenario does not define")
    return replace(trace, class_index=index)


def _on_timeout(node: Node, timeout_s: float | None) -> OnTimeout | None:
    """A class's ``on_timeout`` (``dispatch`` when it has a timeout and names no action; None without one)."""
    name = node.choice("on_timeout", OnTimeout.names(), OnTimeout.DISPATCH if timeout_s is not None else None)
    return None if name is None else OnTimeout(name)
