"""Error bars: for one long run's autocorrelated output, and across independent seeds."""
from __future__ import annotations

import math

import numpy as np


def batch_means(values, batches: int = 20) -> tuple[float, float]:
    """Mean and its standard error by the method of batch means (for autocorrelated output).

    Consecutive observations are split into ``batches`` groups; the spread of the
    group means estimates the standard error without assuming independence.
    """
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    usable = len(values) // batches * batches
    if usable < batches * 2:
        raise ValueError(f"need at least {batches * 2} observations for {batches} batch means")
    means = values[:usable].reshape(batches, -1).mean(axis=1)
    return float(means.mean()), float(means.std(ddof=1) / math.sqrt(batches))


def ci95_half_width(sd, n):
    """Half-width of a 95% Student-t confidence interval of a mean of ``n`` runs with sample
    standard deviation ``sd`` (NaN for one run); numbers or arrays."""
    from scipy import stats

    return stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)
