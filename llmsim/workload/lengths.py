"""Token counts of prompts and outputs: one class per length distribution.

Every distribution draws real-valued lengths, rounds them to whole tokens and clips
them to ``[minimum, maximum]``. It knows the law of what it samples exactly, rounding
and clipping included: :meth:`LengthDistribution.probabilities` gives the probability
of every length, from which come the moments (:meth:`~LengthDistribution.mean`,
:meth:`~LengthDistribution.variance`, :meth:`~LengthDistribution.second_moment`).
Each class gives its cumulative distribution at whole lengths; the base class does
the rest.

In YAML a length is a number (``prompt_tokens: 512``, fixed) or a mapping with
``distribution`` and that distribution's parameters, read by :func:`length_from_node`.
A length whose rounding and clipping move its mean more than :data:`MEAN_TOLERANCE` from
the mean its parameters state (a lognormal with ``sigma: 50`` puts nearly every draw on the
minimum) is refused: the workload would not be the one written.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import ClassVar

import numpy as np
import pandas as pd
from scipy import special

from llmsim.config.reader import Node, NumberRange
from llmsim.config.limits import MAX_TRACE_TOKENS
from llmsim.config.tables import checked_numbers
from llmsim.workload.trace import key_errors, read_csv

LAWS_REMEMBERED = 256           # length laws whose probabilities and moments are kept

_COUNT = NumberRange(integer=True, minimum=1, exclusive_minimum=False)
MEAN_TOLERANCE = 0.10    # largest relative change of the mean that rounding and clipping may make


@dataclass(frozen=True, kw_only=True)
class LengthDistribution(ABC):
    """Token counts, rounded and clipped to ``[minimum, maximum]``."""
    name: ClassVar[str]             # the YAML ``distribution``
    minimum: int = 1
    maximum: int
    # ``max`` when the scenario gave it (else it follows the longest request accepted).
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths (int64) from ``rng``."""
        return np.clip(np.rint(self._draw(rng, n)).astype(np.int64), self.minimum, self.maximum)

    @abstractmethod
    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Lengths before rounding and clipping."""

    @property
    @abstractmethod
    def stated_mean(self) -> float:
        """The mean the parameters state, before rounding and clipping."""

    @abstractmethod
    def _cdf(self, lengths: np.ndarray) -> np.ndarray:
        """P(rounded draw <= length), at whole ``lengths``."""

    @classmethod
    @abstractmethod
    def _params(cls, node: Node) -> dict:
        """The distribution's own parameters, read from its YAML mapping."""

    def scaled(self, factor: float) -> LengthDistribution | None:
        """The same law with its stated mean times ``factor``, the bounds kept (None: no parameter to scale);
        a count stays a whole number of at least one token."""
        return None

    # -- the law of what is sampled -------------------------------------------------------------
    # The law and its moments are remembered by the distribution's value (:func:`_law_of`, :func:`_moments`), not
    # per object: a search builds a scenario, and so its lengths, for every run it makes, and each asks for them.
    def probabilities(self) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, probabilities): every length in ``[minimum, maximum]`` and its probability."""
        return _law_of(self)

    def mean(self) -> float:
        return _moments(self)[0]

    def second_moment(self) -> float:
        lengths, p = _law_of(self)
        return float(p @ lengths.astype(float) ** 2)

    def variance(self) -> float:
        return _moments(self)[1]


@lru_cache(maxsize=LAWS_REMEMBERED)
def _law_of(length: LengthDistribution) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`LengthDistribution.probabilities` (shared: not to be written to)."""
    lengths = np.arange(length.minimum, length.maximum + 1)
    cdf = length._cdf(lengths).astype(float)
    cdf[-1] = 1.0                               # clipping: everything above lands on maximum
    return lengths, np.diff(cdf, prepend=0.0)   # and everything below on minimum


@lru_cache(maxsize=LAWS_REMEMBERED)
def _moments(length: LengthDistribution) -> tuple[float, float]:
    """(mean, variance) of the law: dot products over every length, which a multithreaded BLAS takes milliseconds of
    CPU for where the law is long (tens of thousands of lengths)."""
    lengths, p = _law_of(length)
    mean = float(p @ lengths)
    return mean, float(p @ (lengths - mean) ** 2)


@dataclass(frozen=True, kw_only=True)
class Fixed(LengthDistribution):
    """Always ``value`` tokens."""
    name: ClassVar[str] = "fixed"
    value: float

    @property
    def stated_mean(self):
        return float(self.value)

    def _draw(self, rng, n):
        return np.full(n, self.value)

    def _cdf(self, lengths):
        return lengths >= np.rint(self.value)

    @classmethod
    def _params(cls, node):
        return {"value": node.number("value", **_COUNT)}

    def scaled(self, factor):
        return replace(self, value=_scaled_count(self.value, factor))


@dataclass(frozen=True, kw_only=True)
class Uniform(LengthDistribution):
    """Every whole length from ``low`` to ``high`` (inclusive) equally likely."""
    name: ClassVar[str] = "uniform"
    low: int
    high: int

    @property
    def stated_mean(self):
        return (self.low + self.high) / 2

    def _draw(self, rng, n):
        return rng.integers(self.low, self.high + 1, size=n)

    def _cdf(self, lengths):
        return np.clip((lengths - self.low + 1) / (self.high - self.low + 1), 0.0, 1.0)

    @classmethod
    def _params(cls, node):
        low, high = node.number("low", **_COUNT), node.number("high", **_COUNT)
        if high < low:
            raise node.key_error("high", f"must be at least low ({low})", high, f"an integer >= {low}")
        return {"low": low, "high": high}

    def scaled(self, factor):
        return replace(self, low=_scaled_count(self.low, factor), high=_scaled_count(self.high, factor))


@dataclass(frozen=True, kw_only=True)
class Lognormal(LengthDistribution):
    """``exp(mu + sigma Z)`` with ``mu`` set so that the mean before rounding and clipping is
    ``unclipped_mean`` (YAML ``mean``); ``sigma`` is the standard deviation of log(length)."""
    name: ClassVar[str] = "lognormal"
    unclipped_mean: float
    sigma: float

    @property
    def stated_mean(self):
        return self.unclipped_mean

    @property
    def mu(self) -> float:
        return np.log(self.unclipped_mean) - self.sigma ** 2 / 2

    def _draw(self, rng, n):
        return np.exp(self.mu + self.sigma * rng.standard_normal(n))

    def _cdf(self, lengths):
        if self.sigma == 0:
            return lengths >= np.rint(np.exp(self.mu))
        # A draw rounds to at most k when it is below k + 1/2.
        return special.ndtr((np.log(lengths + 0.5) - self.mu) / self.sigma)

    @classmethod
    def _params(cls, node):
        return {"unclipped_mean": node.number("mean", minimum=1, exclusive_minimum=False),
                "sigma": node.number("sigma", minimum=0, exclusive_minimum=False)}

    def scaled(self, factor):
        return replace(self, unclipped_mean=self.unclipped_mean * factor)


@dataclass(frozen=True, kw_only=True)
class Exponential(LengthDistribution):
    """The discrete memoryless length: geometric on 1, 2, ... with mean ``unclipped_mean`` (YAML
    ``mean``), the ceiling of an exponential."""
    name: ClassVar[str] = "exponential"
    unclipped_mean: float

    @property
    def stated_mean(self):
        return self.unclipped_mean

    def _draw(self, rng, n):
        p = 1.0 / self.unclipped_mean
        return rng.geometric(p, size=n) if p < 1 else np.ones(n)

    def _cdf(self, lengths):
        p = 1.0 / self.unclipped_mean
        return np.where(lengths >= 1, 1.0 - (1.0 - min(p, 1.0)) ** np.maximum(lengths, 0), 0.0)

    @classmethod
    def _params(cls, node):
        return {"unclipped_mean": node.number("mean", minimum=1, exclusive_minimum=False)}

    def scaled(self, factor):
        return replace(self, unclipped_mean=self.unclipped_mean * factor)


@dataclass(frozen=True, kw_only=True)
class Empirical(LengthDistribution):
    """Lengths drawn uniformly, with replacement, from observed ``samples`` (a CSV column)."""
    name: ClassVar[str] = "empirical"
    samples: tuple[int, ...]
    path: str | None = None             # the CSV they were read from, and its column
    column: str | None = None

    @property
    def stated_mean(self):
        return float(np.mean(self.samples))

    def _draw(self, rng, n):
        return np.asarray(self.samples)[rng.integers(0, len(self.samples), size=n)]

    def _cdf(self, lengths):
        return np.searchsorted(np.sort(self.samples), lengths, side="right") / len(self.samples)

    @classmethod
    def _params(cls, node):
        path = node.path_value("path")
        column = node.string("column", node.path.rsplit(".", 1)[-1])   # default: the length's own key
        frame = read_csv(path, node, "path")
        if column not in frame.columns:
            raise node.key_error("column", f"no such column in {path}", column, ", ".join(map(str, frame.columns)))
        values = pd.to_numeric(frame[column], errors="coerce").dropna()
        values = values[values >= 1]
        if values.empty:
            raise node.key_error("column", f"column has no token counts >= 1 in {path}", column)
        values = checked_numbers(values, f"{path}, column {column}",
                                 key_errors(node, "path"),
                                 minimum=1, maximum=MAX_TRACE_TOKENS)
        return {"samples": tuple(int(v) for v in np.rint(values)), "path": str(path), "column": column}


def _scaled_count(count: float, factor: float) -> int:
    return max(1, int(round(count * factor)))


LENGTH_DISTRIBUTIONS = {cls.name: cls for cls in (Fixed, Uniform, Lognormal, Exponential, Empirical)}


def length_from_node(node: Node, key: str, max_tokens: int) -> LengthDistribution:
    """``key: 512`` (fixed) or ``key: {distribution: lognormal, mean: 600, sigma: 0.8, max: 4096}``."""
    raw = node.raw(key)
    length: LengthDistribution
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        length = Fixed(value=node.number(key, **_COUNT), minimum=1, maximum=max_tokens)
    else:
        sub = node.child(key)
        kind = LENGTH_DISTRIBUTIONS[sub.choice("distribution", list(LENGTH_DISTRIBUTIONS))]
        minimum = sub.number("min", 1, **_COUNT)
        maximum = sub.number("max", max_tokens, **_COUNT)
        if minimum > maximum:
            raise sub.key_error("min", f"must not exceed max ({maximum})", minimum, f"1..{maximum}")
        params = kind._params(sub)
        sub.done()
        length = kind(minimum=minimum, maximum=maximum, given=frozenset({"max"} & set(sub.data)), **params)
    check_mean_kept(length, node, key, raw)
    return length


def check_mean_kept(length: LengthDistribution, node: Node, key: str, raw) -> None:
    """Refuse a length whose rounding and clipping to [min, max] move its mean beyond the tolerance."""
    stated, sampled = length.stated_mean, length.mean()
    change = sampled / stated - 1.0
    if abs(change) <= MEAN_TOLERANCE:
        return
    raise node.key_error(
        key, f"rounded to whole tokens and clipped to [{length.minimum}, {length.maximum}], its mean of "
             f"{_tokens(stated)} tokens becomes {_tokens(sampled)} ({100 * change:+.0f}%, more than the "
             f"{100 * MEAN_TOLERANCE:g}% allowed)", raw,
        f"a length whose mean after clipping is within {100 * MEAN_TOLERANCE:g}% of its stated mean: "
        "a smaller sigma, a mean further inside [min, max], or a wider max (engine.max_model_len bounds it)")


def _tokens(count: float) -> str:
    return f"{count:,.0f}" if count >= 100 else f"{count:.3g}"
