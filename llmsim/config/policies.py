"""The names a scenario may give each policy, as enums: read once at the edge, compared as members.

A reader turns the YAML string into a member (``RouterPolicy(node.choice("router", RouterPolicy.names()))``);
from then on the simulator compares members (``policy is RouterPolicy.SHARED_QUEUE``) or looks up the
object that implements one, never the string. Each member is also its string (``str`` mixin), so
summaries, tables and files show the name the user wrote.
"""
from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A policy name: a ``str`` whose ``str()`` and ``format()`` are the name itself."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every name, in declaration order (what a reader allows)."""
        return tuple(member.value for member in cls)


class Batching(Choice):
    CONTINUOUS = "continuous"
    STATIC = "static"


class RouterPolicy(Choice):
    """How a request picks its replica (:class:`llmsim.sim.simulate.Router`)."""
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    SHARED_QUEUE = "shared_queue"
    PREFIX_AWARE = "prefix_aware"


class OnTimeout(Choice):
    """What a queue timeout does to a waiting request: force it in, into dedicated slots, or reject it."""
    DISPATCH = "dispatch"
    DEDICATED = "dedicated"
    REJECT = "reject"


class PreemptionMode(Choice):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class Admission(Choice):
    """What a request needs free in the KV cache to join the batch (``llmsim.sim.engine.ADMISSION_TESTS``)."""
    PREEMPT = "preempt"
    MAX_UTILIZATION = "max_utilization"
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"


class SchedulingPolicy(Choice):
    """Which traffic class's request joins next (:mod:`llmsim.sim.scheduling`)."""
    FCFS = "fcfs"
    PRIORITY = "priority"
    PREEMPTIVE_PRIORITY = "preemptive_priority"
    WEIGHTED_FAIR = "weighted_fair"
    EDF = "edf"
    VLLM_PRIORITY = "vllm_priority"


class KPolicyName(Choice):
    """How many tokens each sequence drafts per step (:mod:`llmsim.speculation.policies`)."""
    STATIC = "static"
    ADAPTIVE = "adaptive"
    GOODPUT = "goodput"


class ControlRule(Choice):
    """How the adaptive controller moves its knob (:mod:`llmsim.sim.controller`)."""
    PRACTICE = "practice"
    AIMD = "aimd"
    PID = "pid"


def members_of(instance: object, **kinds: type[Choice]) -> None:
    """Turn the named fields of a frozen dataclass ``instance`` into members of their ``kinds`` (a field
    given as its string, as code that builds a config may, becomes the member; None stays None)."""
    for name, kind in kinds.items():
        value = getattr(instance, name)
        if value is not None and not isinstance(value, kind):
            object.__setattr__(instance, name, kind(value))
