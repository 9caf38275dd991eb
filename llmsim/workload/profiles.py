"""Arrivals whose rate changes with time: a diurnal profile, steps, ramps, and bursts (MMPP).

Each is a Poisson process of intensity ``rate(t)``, sampled by time rescaling: the arrivals
of a unit-rate Poisson process, ``E_1 < E_2 < ...``, mapped through the inverse of the
cumulative intensity ``Lambda(t) = integral of rate from 0 to t`` (Cinlar; Lewis and
Shedler). ``Lambda`` is piecewise linear between the knots each profile gives (exact for
steps and for the state path of an MMPP; a ramp and the diurnal cosine are integrated on a
fine grid), so the inversion is one ``np.interp``. Like the renewal processes, two
profiles that differ only in scale see the same unit-rate draws (common random numbers).

A Markov-modulated Poisson process (MMPP) switches between states, each with its own rate,
staying in a state for an exponential time of the state's mean and then moving to the next
state in the list (cyclically): given the state path it is a Poisson process with a
piecewise-constant rate, so it is sampled the same way after drawing the path.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from llmsim.config.reader import Node, Range

DIURNAL_STEPS_PER_PERIOD = 1440      # one knot a minute over a day: the cosine's integral to < 1e-5
RAMP_SUBKNOTS = 65                   # knots per segment of a ramp (its integral is quadratic between points)


@dataclass(frozen=True)
class RateProfile(ABC):
    """A Poisson process with a time-varying rate; ``rate_per_s`` is its long-run mean rate."""
    process: ClassVar[str]
    resolution_key: ClassVar[str]       # the key under ``arrival`` that sets how finely knots are spaced

    @property
    @abstractmethod
    def rate_per_s(self) -> float:
        """Long-run mean arrival rate (what a request count is divided by to get a window)."""

    @abstractmethod
    def knots(self, rng: np.random.Generator, until_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(times, cumulative intensity at them), increasing from (0, 0) and reaching at least ``until_s``."""

    @abstractmethod
    def knot_count(self, until_s: float) -> float:
        """About how many knots :meth:`knots` makes up to ``until_s`` (the resource guard's estimate)."""

    def times(self, rng: np.random.Generator, num_requests: int | None, duration_s: float | None) -> np.ndarray:
        """Arrival times of ``num_requests`` requests, or of all that arrive within ``duration_s``."""
        path_seed = int(rng.integers(2 ** 63))      # an MMPP's state path, a stream apart from the gaps
        if num_requests is not None:
            targets = np.cumsum(rng.standard_exponential(num_requests))
            until = targets[-1] / self.rate_per_s
            times, cumulative = self.knots(np.random.default_rng(path_seed), until)
            while cumulative[-1] < targets[-1]:
                until *= 2
                times, cumulative = self.knots(np.random.default_rng(path_seed), until)
        else:
            if duration_s is None:
                raise ValueError("arrival times need a request count or a duration")
            times, cumulative = self.knots(np.random.default_rng(path_seed), duration_s)
            total = float(np.interp(duration_s, times, cumulative))
            chunks, drawn = [], 0.0
            while drawn <= total:
                gaps = rng.standard_exponential(int(total * 1.2) + 100)
                chunks.append(gaps)
                drawn += gaps.sum()
            targets = np.cumsum(np.concatenate(chunks))
            targets = targets[targets <= total]
        # Flat stretches of Lambda (rate 0) map to their first time: np.interp needs increasing x.
        keep = np.concatenate(([True], np.diff(cumulative) > 0))
        arrivals = np.interp(targets, cumulative[keep], times[keep])
        return arrivals if duration_s is None else arrivals[arrivals <= duration_s]


@dataclass(frozen=True)
class Diurnal(RateProfile):
    """``rate x (1 + amplitude cos(2 pi (t - peak) / period))``: a daily cycle (any period)."""
    process: ClassVar[str] = "diurnal"
    resolution_key: ClassVar[str] = "period"
    mean_rate_per_s: float
    amplitude: float
    period_s: float
    peak_s: float
    # ``peak`` when the scenario gave it (else it follows the period).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def rate_per_s(self):
        return self.mean_rate_per_s

    def knot_count(self, until_s):
        return until_s / self.period_s * DIURNAL_STEPS_PER_PERIOD + 3

    def knots(self, rng, until_s):
        step = self.period_s / DIURNAL_STEPS_PER_PERIOD
        t = np.arange(0.0, until_s + 2 * step, step)
        # The exact integral of the cosine between knots.
        phase = 2 * np.pi * (t - self.peak_s) / self.period_s
        cumulative = self.mean_rate_per_s * (t + self.amplitude * self.period_s / (2 * np.pi)
                                             * (np.sin(phase) - np.sin(phase[0])))
        return t, cumulative


@dataclass(frozen=True)
class Piecewise(RateProfile):
    """Rates at given times: held until the next (``steps``) or interpolated linearly (``ramp``);
    the last rate holds after the last time."""
    process: ClassVar[str] = "steps"
    resolution_key: ClassVar[str] = "rates"
    at_s: tuple[float, ...]
    rates_per_s: tuple[float, ...]
    linear: bool = False

    @property
    def rate_per_s(self):
        return self.rates_per_s[-1]

    def knot_count(self, until_s):
        return len(self.at_s) * (RAMP_SUBKNOTS if self.linear else 1) + 2

    def knots(self, rng, until_s):
        at, rates = np.asarray(self.at_s), np.asarray(self.rates_per_s)
        if self.linear:
            # A ramp's integral is quadratic between points: 64 sub-knots per segment.
            fine = np.unique(np.concatenate([np.linspace(a, b, RAMP_SUBKNOTS) for a, b in zip(at[:-1], at[1:])]
                                            or [at]))
            rates, at = np.interp(fine, at, rates), fine
            slopes = (rates[:-1] + rates[1:]) / 2
        else:
            slopes = rates[:-1]
        end = max(until_s, at[-1]) + 1.0
        times = np.concatenate(([0.0], at, [end])) if at[0] > 0 else np.concatenate((at, [end]))
        slopes = np.concatenate(([rates[0]] if at[0] > 0 else [], slopes, [rates[-1]]))
        return times, np.concatenate(([0.0], np.cumsum(slopes * np.diff(times))))


@dataclass(frozen=True)
class MMPP(RateProfile):
    """Markov-modulated Poisson: state ``i`` has rate ``rates_per_s[i]`` and lasts an exponential
    time of mean ``mean_durations_s[i]``; the states follow each other in order, cyclically,
    starting in the first."""
    process: ClassVar[str] = "mmpp"
    resolution_key: ClassVar[str] = "states"
    rates_per_s: tuple[float, ...]
    mean_durations_s: tuple[float, ...]

    @property
    def rate_per_s(self):
        # Long-run share of time in each state is proportional to its mean duration.
        return float(np.dot(self.rates_per_s, self.mean_durations_s) / np.sum(self.mean_durations_s))

    def knot_count(self, until_s):
        return len(self.rates_per_s) * (until_s / sum(self.mean_durations_s) + 4) + 1

    def knots(self, rng, until_s):
        n_states = len(self.rates_per_s)
        mean = np.asarray(self.mean_durations_s)
        block = int(n_states * (until_s / mean.sum() + 4))
        # Drawn in blocks, so a longer path extends a shorter one from the same generator.
        draws = rng.standard_exponential(block)
        while (draws * mean[np.arange(len(draws)) % n_states]).sum() <= until_s:
            draws = np.concatenate((draws, rng.standard_exponential(block)))
        states = np.arange(len(draws)) % n_states
        durations = draws * mean[states]
        times = np.concatenate(([0.0], np.cumsum(durations)))
        return times, np.concatenate(([0.0], np.cumsum(np.asarray(self.rates_per_s)[states] * durations)))


PROFILES = ("diurnal", "steps", "ramp", "mmpp")


def profile_from_node(node: Node, process: str) -> RateProfile:
    """A time-varying arrival process from ``workload.arrival`` (or a class's ``arrival``)."""
    rate = Range(minimum=0.0, exclusive_minimum=False)
    if process == "diurnal":
        mean = node.quantity("rate", "rate")
        period = node.quantity("period", "duration")
        return Diurnal(mean, node.number("amplitude", 0.5, minimum=0.0, maximum=1.0), period,
                       node.quantity("peak", "duration", period / 2, **rate),
                       given=frozenset({"peak"}) if node.has("peak") else frozenset())
    if process in ("steps", "ramp"):
        points = _items(node, "rates")
        at = tuple(p.quantity("at", "duration", **rate) for p in points)
        rates = tuple(p.quantity("rate", "rate", **rate) for p in points)
        for p in points:
            p.done()
        if any(b <= a for a, b in zip(at, at[1:])):
            raise node.key_error("rates", "the times ('at') must increase", node.raw("rates"),
                                 "a list of {at: <time>, rate: <rate>} in increasing time")
        if rates[-1] <= 0:
            raise node.key_error("rates", "the last rate holds forever and must be positive", node.raw("rates"),
                                 "a last rate > 0")
        return Piecewise(at, rates, linear=process == "ramp")
    states = _items(node, "states")
    rates = tuple(s.quantity("rate", "rate", **rate) for s in states)
    durations = tuple(s.quantity("mean_duration", "duration") for s in states)
    for s in states:
        s.done()
    if len(states) < 2 or not any(r > 0 for r in rates):
        raise node.key_error("states", "an MMPP needs at least two states and one positive rate",
                             node.raw("states"), "a list of {rate: <rate>, mean_duration: <time>}, two or more")
    return MMPP(rates, durations)


def _items(node: Node, key: str) -> list[Node]:
    """The mappings of the list at ``key``, each a Node whose key path carries its index."""
    raw = node.raw(key)
    if not isinstance(raw, list) or not raw:
        raise node.key_error(key, "expected a non-empty list", raw, "a YAML list of mappings")
    return [Node(item, file=node.file, path=f"{node.key_path(key)}[{i}]", base_dir=node.base_dir)
            for i, item in enumerate(raw)]
