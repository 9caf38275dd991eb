"""Percentiles of more values than a run keeps: a mergeable quantile sketch (DDSketch).

A run streamed to disk (:mod:`llmsim.analysis.streaming`) never holds all its latencies at once;
their percentiles come from a DDSketch (Masson, Rim and Lee, VLDB 2019; the ``ddsketch`` package):
values fall into buckets whose bounds grow geometrically by ``gamma = (1 + a) / (1 - a)``, and a
percentile is the middle of its bucket. For every percentile ``p`` the sketch's answer ``v``
satisfies ``|v - x| <= a * x``, where ``x`` is the exact value at rank ``p / 100 * (n - 1)`` rounded
down (numpy's ``percentile(..., method="lower")``; the default, interpolated, percentile lies between
that value and the next). ``a`` is :data:`RELATIVE_ACCURACY`. Sketches of the same accuracy merge
exactly: the merged sketch is the one of all the values.

Values are added as whole arrays: numpy finds each value's bucket and the sketch is given one
representative per bucket with its count, so adding costs a few numpy passes and one call per
distinct bucket, not one per value.
"""
from __future__ import annotations

import math

import numpy as np
from ddsketch import DDSketch
from ddsketch.mapping import LogarithmicMapping

RELATIVE_ACCURACY = 0.005      # the sketch's bound: every percentile within 0.5% of the exact value


class QuantileSketch:
    """A DDSketch of non-negative values (latencies), filled an array at a time, optionally
    weighted (a gap shared by several tokens); exact count, sum and so mean on the side."""

    def __init__(self, relative_accuracy: float = RELATIVE_ACCURACY):
        self.relative_accuracy = relative_accuracy
        self._sketch = DDSketch(relative_accuracy)
        self._mapping = LogarithmicMapping(relative_accuracy)      # the sketch's own bucket bounds
        self._log_gamma = math.log(self._mapping.gamma)
        self.count = 0.0
        self.total = 0.0

    def add(self, values, weights=None) -> None:
        """Add ``values`` (NaN ones are skipped), each counted ``weights`` times (default once)."""
        values = np.asarray(values, dtype=float)
        weights = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=float)
        keep = ~np.isnan(values) & (weights > 0)
        values, weights = values[keep], weights[keep]
        if not len(values):
            return
        if (values < 0).any():
            raise ValueError("the quantile sketch holds non-negative values (latencies)")
        self.count += float(weights.sum())
        self.total += float(values @ weights)
        positive = values > self._mapping.min_possible
        zeros = float(weights[~positive].sum())
        if zeros:
            self._sketch.add(0.0, zeros)
        # A value's bucket is ceil(log_gamma(value)); a value on a bound may land in either bucket
        # (rounding), where the middle of each is still within the relative accuracy of it.
        keys = np.ceil(np.log(values[positive]) / self._log_gamma).astype(np.int64)
        if not len(keys):
            return
        # Counted by key from the lowest (a few thousand buckets span latencies from ns to hours).
        lowest = int(keys.min())
        counts = np.bincount(keys - lowest, weights=weights[positive])
        present = np.flatnonzero(counts)
        for key, count in zip((present + lowest).tolist(), counts[present].tolist()):
            self._sketch.add(self._mapping.value(key), count)

    def merge(self, other: QuantileSketch) -> None:
        self._sketch.merge(other._sketch)
        self.count += other.count
        self.total += other.total

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def percentile(self, p: float) -> float:
        """The value at percentile ``p`` (0-100) within the relative accuracy (NaN when empty)."""
        value = self._sketch.get_quantile_value(p / 100)
        return math.nan if value is None else float(value)
