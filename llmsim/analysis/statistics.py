"""Error bars: for one long run's autocorrelated output, and across independent seeds."""
from __future__ import annotations

import math

import numpy as np
from scipy import special


BATCHES = 20                 # batches at the most: 10-30 is the usual range (Schmeiser 1982), 20 in the middle
MIN_BATCH = 30               # observations per batch at the least: shorter batches stay correlated
SPAN = 5                     # a batch spans this many correlation times at the least (see batch_size)
MIN_BATCHES = 4              # fewer batch means leave the t interval too wide to say anything
LAG1_LEVEL = 0.10            # the lag-1 test of batch means rejects independence at this level (see lag1_correlated)


def correlation_time(*series) -> float:
    """The integrated autocorrelation time ``tau = 1 + 2 sum_t rho_t`` of a stationary series: how many
    observations carry the information of one independent one (``n / tau`` is the effective sample
    size). Several series of one process (the two groups of a comparison) pool their autocovariances.

    Geyer's initial monotone sequence estimator: the sums of adjacent autocorrelations
    ``rho_2k + rho_2k+1`` are positive and falling for a stationary process, so the sum stops at the
    first that is not and each is capped by the one before (Geyer 1992, Statistical Science 7(4)).
    At least 1 (a negatively correlated series is treated as independent, which is conservative).
    """
    sums = []                                   # per series: sum over pairs of x_i x_{i+t}, for each lag t
    for values in series:
        x = np.asarray(values, dtype=float)
        x = x[~np.isnan(x)]
        if len(x) < 4:
            continue
        x = x - x.mean()
        size = 1 << (2 * len(x) - 1).bit_length()
        spectrum = np.fft.rfft(x, size)
        sums.append(np.fft.irfft(spectrum * np.conj(spectrum), size)[:len(x)])
    lags = min((len(s) for s in sums), default=0)
    pooled = np.sum([s[:lags] for s in sums], axis=0) if sums else None
    if pooled is None or pooled[0] <= 0:
        return 1.0
    rho = pooled / pooled[0]
    pairs = rho[:len(rho) // 2 * 2].reshape(-1, 2).sum(axis=1)
    stop = np.flatnonzero(pairs <= 0)
    pairs = np.minimum.accumulate(pairs[:stop[0] if len(stop) else len(pairs)])
    return max(1.0, float(-1.0 + 2.0 * pairs.sum()))


def batch_size(tau: float, minimum: int = MIN_BATCH) -> int:
    """Observations per batch for a series of correlation time ``tau``: ``SPAN`` times it, at least ``minimum``.

    Two adjacent batch means of ``m`` observations correlate by about ``tau / 4m`` (exactly
    ``(tau^2 - 1) / 4 m tau`` for an AR(1) series), and a correlation ``r`` between neighbours makes the
    batch-means variance short by a factor of about ``1 + 2r``. At ``m = 5 tau`` the correlation is
    about 0.05, so a 95% interval covers about 94%; a longer span costs degrees of freedom instead.
    Where the estimate of ``tau`` falls short (a slowly changing part hidden under request-to-request
    spread), :func:`lag1_correlated` on the batch means catches what it can. Neither sees all of a long,
    thin tail of correlation in a short run (TPOT of a loaded replica over 500 requests: batches of 7
    ``tau`` still give 77% of the variance), which only a longer run cures."""
    return max(minimum, math.ceil(SPAN * tau))


def lag1_correlated(means, level: float = LAG1_LEVEL) -> bool:
    """Whether consecutive batch means are positively correlated: von Neumann's ratio test, one-sided at ``level``.

    ``C = 1 - sum (x_i+1 - x_i)^2 / (2 sum (x_i - mean)^2)`` estimates the lag-1 correlation; for
    ``k`` independent normal means it is about normal with mean 0 and variance ``(k - 2) / (k^2 - 1)``
    (Young 1941). The test that Fishman's LBATCH rule runs on batch means to decide whether they are
    long enough (Fishman and Yarberry 1997; Law and Kelton, Simulation Modeling and Analysis, 9.5.3);
    it is run at 10% because failing to see a correlation costs more than a needlessly longer batch."""
    x = np.asarray(means, dtype=float)
    k = len(x)
    spread = float(np.sum((x - x.mean()) ** 2))
    if k < 3 or spread == 0:
        return False
    ratio = 1.0 - float(np.sum(np.diff(x) ** 2)) / (2.0 * spread)
    return bool(ratio / math.sqrt((k - 2) / (k * k - 1)) > special.ndtri(1.0 - level))    # the normal quantile


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

    The trend is the least-squares line through the batch means and its test the t test of its
    correlation coefficient on ``batches - 2`` degrees of freedom, with ``scipy.stats.linregress``'s
    arithmetic (:func:`_trend`); scipy.stats itself is not imported for it (about 0.4 CPU s a process,
    more than all of a search's calls).
    """
    if batches < 3:                      # a line through two means leaves its test no degree of freedom
        return math.nan, False
    try:
        means = batch_series(values, batches)
    except ValueError:
        return math.nan, False
    scale = float(means.mean()) if scale is None else scale
    if not scale > 0 or np.ptp(means) == 0:
        return 0.0, False
    slope, one_sided_p = _trend(means)
    rise = float(slope * (batches - 1) / scale)
    return rise, bool(one_sided_p < significance and rise > material_rise)


def _trend(means: np.ndarray) -> tuple[float, float]:
    """The least-squares slope of ``means`` against their index and its one-sided p-value against no rise
    (1 where the slope does not rise): ``linregress(arange(n), means)``'s slope and half its two-sided
    p-value, its correlation coefficient and t statistic (with its 1e-20 guard) worked out alike
    (``tests/analysis/test_statistics_special.py`` holds them to its bits); at least three means (two
    leave the test no degree of freedom)."""
    tiny = 1.0e-20
    df = len(means) - 2
    assert df > 0
    ssxm, ssxym, _, ssym = np.cov(np.arange(len(means)), means, bias=True).ravel().tolist()
    # linregress's correlation coefficient: NaN or 0 with no spread, else held inside [-1, 1]
    r = (math.nan if ssxym == 0 else 0.0) if ssym == 0.0 else min(max(ssxym / math.sqrt(ssxm * ssym), -1.0), 1.0)
    slope = ssxym / ssxm
    t = r * np.sqrt(df / ((1.0 - r + tiny) * (1.0 + r + tiny)))
    two_sided = 2 * special.stdtr(df, -np.abs(t))          # Student's t survival at |t|, both tails
    return slope, (two_sided / 2 if slope > 0 else 1.0)


def ci95_half_width(sd, n):
    """Half-width of a 95% Student-t confidence interval of a mean of ``n`` runs with sample
    standard deviation ``sd`` (NaN for one run); numbers or arrays. The quantile is the one
    ``scipy.stats.t.ppf`` returns (``stdtrit``; NaN without a degree of freedom)."""
    return special.stdtrit(np.asarray(n) - 1, 0.975) * sd / np.sqrt(n)
