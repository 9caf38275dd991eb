"""Error bars: for one long run's autocorrelated output, and across independent seeds."""
from __future__ import annotations

import math

import numpy as np


BATCHES = 20


def batch_series(values, batches: int = BATCHES) -> np.ndarray:
    """The means of ``batches`` consecutive groups of the (non-NaN) observations, in order."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    usable = len(values) // batches * batches
    if usable < batches * 2:
        raise ValueError(f"need at least {batches * 2} observations for {batches} batch means")
    return values[:usable].reshape(batches, -1).mean(axis=1)


def batch_means(values, batches: int = BATCHES) -> tuple[float, float]:
    """Mean and its standard error by the method of batch means (for autocorrelated output).

    Consecutive observations are split into ``batches`` groups; the spread of the
    group means estimates the standard error without assuming independence.
    """
    means = batch_series(values, batches)
    return float(means.mean()), float(means.std(ddof=1) / math.sqrt(batches))


def rising_trend(values, batches: int = BATCHES, *, scale: float | None = None, significance: float = 0.01,
                 material_rise: float = 0.1) -> tuple[float, bool]:
    """Whether a series that should be stationary keeps rising: its batch means' least-squares
    trend from the first batch to the last, as a share of ``scale`` (default: their mean), and
    True when that rise is both significant (one-sided p < ``significance``) and material (over
    ``material_rise``).

    In a queue beyond its capacity waits grow without bound, so a window whose latencies still
    climb from its first batch to its last measures a transient, not a steady state; measured
    against a latency limit (``scale``), a drift too small to threaten it is not material. NaN and
    False when there are too few observations to tell.
    """
    from scipy import stats

    try:
        means = batch_series(values, batches)
    except ValueError:
        return math.nan, False
    scale = float(means.mean()) if scale is None else scale
    if not scale > 0 or np.ptp(means) == 0:
        return 0.0, False
    fit = stats.linregress(np.arange(batches), means)
    rise = float(fit.slope * (batches - 1) / scale)
    one_sided_p = fit.pvalue / 2 if fit.slope > 0 else 1.0
    return rise, bool(one_sided_p < significance and rise > material_rise)


def ci95_half_width(sd, n):
    """Half-width of a 95% Student-t confidence interval of a mean of ``n`` runs with sample
    standard deviation ``sd`` (NaN for one run); numbers or arrays."""
    from scipy import stats

    return stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)
