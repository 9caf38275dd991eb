"""The names a scenario may give each policy, as enums: read once at the edge, compared as members.

A reader turns the YAML string into a member (``RouterPolicy(node.choice("router", RouterPolicy.names()))``);
from then on the simulator compares members (``policy is RouterPolicy.SHARED_QUEUE``) or looks up the
object that implements one, never the string. Each member is also its string (``str`` mixin), so
summaries, tables and files show the name the user wrote.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

from llmsim.errors import ConfigError

C = TypeVar("C", bound="Choice")


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

    @classmethod
    def of(cls: type[C], value: Any, key: str) -> C:
        """The member named ``value`` (a member passes through), for a function's argument: a
        :class:`~llmsim.errors.ConfigError` naming ``key`` and the allowed names otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in cls.names():
            return cls(value)
        raise ConfigError(f"unknown {key.replace('_', ' ')}", key=key, value=value, allowed=", ".join(cls.names()))


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


class KVReservation(Choice):
    """When a disaggregated decode replica takes the KV blocks of a request whose prompt another replica
    computed (:mod:`llmsim.sim.disaggregated`): before the transfer starts, the prefill replica holding its
    copy until then, or once the KV has arrived in a staging buffer beside the decode replica."""
    BEFORE_TRANSFER = "before_transfer"
    AFTER_TRANSFER = "after_transfer"


class ProposerKind(Choice):
    """What proposes the draft tokens (:mod:`llmsim.speculation.proposers`)."""
    MODEL = "model"
    NGRAM = "ngram"
    EAGLE = "eagle"
    MTP = "mtp"
    MEDUSA = "medusa"


class Objective(Choice):
    """What a recommendation maximises: goodput (the highest rate meeting the SLO), or cost per token there."""
    GOODPUT = "goodput"
    COST = "cost"


class SearchScope(Choice):
    """What a recommendation searches: every setting, or only the class policy and class timeouts."""
    ALL = "all"
    CLASSES = "classes"


class ExecutorKind(Choice):
    """Where a sweep's points run (:mod:`llmsim.search.executors`)."""
    PROCESSES = "processes"
    DASK = "dask"
    SERIAL = "serial"


class OnInvalid(Choice):
    """What a sweep does with a point that fails validation: stop with its error, or record it and go on."""
    RAISE = "raise"
    RECORD = "record"


class RolloutRole(Choice):
    """A rollout group's part: the control (the scenario's own deployment), a canary serving its share
    of the requests, or a shadow receiving a copy of them."""
    CONTROL = "control"
    CANARY = "canary"
    SHADOW = "shadow"


class EstimateMethod(Choice):
    """How a draft sweep estimates TPOT: the fluid model, or simulation."""
    FLUID = "fluid"
    SIMULATE = "simulate"


class ControllerKnob(Choice):
    """The setting the adaptive controller moves: an engine limit, or a static k policy's draft length."""
    MAX_BATCH_TOKENS = "max_batch_tokens"
    MAX_NUM_SEQS = "max_num_seqs"
    SPECULATION_K = "speculation_k"


class DraftPlacement(Choice):
    """Where a draft model runs: on the target's devices, or on devices of its own."""
    COLOCATED = "colocated"
    SEPARATE = "separate"


class Scorer(Choice):
    """How the target scores a chain of draft tokens (:mod:`llmsim.sim.speculative_decode`): one multi-query
    chunk of ``k + 1`` positions per sequence, or vLLM V0's batch expansion into ``k + 1`` one-token decode
    sequences, each reading the sequence's whole KV cache."""
    MQA = "mqa"
    BATCH_EXPANSION = "batch_expansion"


class AcceptanceProcess(Choice):
    """How the target accepts the draft's tokens (:class:`llmsim.speculation.config.Acceptance`)."""
    BERNOULLI = "bernoulli"
    BETA = "beta"
    POSITIONAL = "positional"
    REPLAY = "replay"
    PREDICTED = "predicted"


class KScope(Choice):
    """Whether a k policy chooses k for each request or one k for the whole batch."""
    PER_REQUEST = "per_request"
    PER_BATCH = "per_batch"


class FailedRequests(Choice):
    """What a replayed production trace does with its failed requests (0 output tokens): drop them, or
    replay each as its prompt and one output token."""
    DROP = "drop"
    REPLAY = "replay"
