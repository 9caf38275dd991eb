"""When requests arrive: renewal processes at a rate, or the times of a replayed trace.

A renewal process draws its gaps at unit rate and scales them by ``1 / rate``, so two
rates see the same requests in the same order, the faster one compressed in time
(common random numbers across a sweep over the rate).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np


@dataclass(frozen=True)
class RenewalProcess(ABC):
    """Independent, identically distributed gaps between arrivals, ``rate_per_s`` on average."""
    process: ClassVar[str]          # the YAML ``arrival.process``
    rate_per_s: float

    @abstractmethod
    def unit_rate_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` gaps with mean 1."""

    def times(self, rng: np.random.Generator, num_requests: int | None, duration_s: float | None) -> np.ndarray:
        """Arrival times of ``num_requests`` requests, or of all that arrive within ``duration_s``."""
        if num_requests is not None:
            return np.cumsum(self.unit_rate_gaps(rng, num_requests)) / self.rate_per_s
        if duration_s is None:
            raise ValueError("arrival times need a request count or a duration")
        # Draw in blocks until the duration is covered; the prefix does not depend on the block size.
        expected = duration_s * self.rate_per_s
        chunks, total = [], 0.0
        block = int(expected * 1.2) + 100
        while total <= duration_s:
            gaps = self.unit_rate_gaps(rng, block) / self.rate_per_s
            chunks.append(gaps)
            total += gaps.sum()
        times = np.cumsum(np.concatenate(chunks))
        return times[times <= duration_s]


@dataclass(frozen=True)
class Poisson(RenewalProcess):
    """Exponential gaps: independent arrivals from many users."""
    process: ClassVar[str] = "poisson"

    def unit_rate_gaps(self, rng, n):
        return rng.standard_exponential(n)


@dataclass(frozen=True)
class Gamma(RenewalProcess):
    """Gamma gaps with coefficient of variation ``cv``: bursty above 1, smoother than Poisson below."""
    process: ClassVar[str] = "gamma"
    cv: float = 1.0

    def unit_rate_gaps(self, rng, n):
        shape = 1.0 / self.cv ** 2
        return rng.standard_gamma(shape, n) / shape


@dataclass(frozen=True)
class Deterministic(RenewalProcess):
    """Evenly spaced arrivals."""
    process: ClassVar[str] = "deterministic"

    def unit_rate_gaps(self, rng, n):
        return np.ones(n)


@dataclass(frozen=True)
class Replay:
    """Arrivals (and lengths) replayed from a recorded trace, the workload's ``trace``.

    ``rate_per_s`` is the mean rate of what is replayed (after sampling and rescaling): the
    trace sets the times, and plans vary this rate by rescaling the trace's time."""
    process: ClassVar[str] = "trace"
    rate_per_s: float = 0.0


RENEWAL_PROCESSES = {cls.process: cls for cls in (Poisson, Gamma, Deterministic)}
ARRIVAL_PROCESSES = (*RENEWAL_PROCESSES, Replay.process)
