"""A synthetic workload fitted to a trace, so a plan can extrapolate ("this traffic, times 2").

:func:`fit_workload` summarises a trace by what the synthetic workload can express:

- arrivals: the mean rate (one over the mean gap) and the burstiness, the coefficient of
  variation of the gaps between arrivals (1 for Poisson, above 1 bursty), fitted as a
  Gamma renewal process of that CV;
- the time-of-day profile: the rate in consecutive bins (an hour by default) over the
  trace's span, which a ``steps`` arrival profile replays (Poisson within each bin);
- lengths: a lognormal per column fitted by maximum likelihood (``sigma`` the standard
  deviation of log length, ``mean`` the mean it implies), clipped to the longest seen.

:meth:`WorkloadFit.to_workload` writes it as a scenario's ``workload`` mapping, its rates
multiplied by ``scale``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmsim.workload.trace import Trace
from llmsim.workload.trace_transforms import mean_rate_per_s
from llmsim.workload.workload import MIN_GAMMA_CV

PROFILE_BIN_S = 3600.0
# Bins of a time-of-day profile: a year of hours is 8,760. Each is a step of the ``steps`` profile
# ``--profile`` writes, which a scenario must still read (5 YAML values a step, 200,000 at most).
MAX_PROFILE_BINS = 10_000


def profile_bins(span_s: float, profile_bin_s: float) -> int:
    """How many bins of ``profile_bin_s`` cover ``span_s`` (at least one); computed in floats, so a
    tiny bin gives a huge count to refuse rather than an allocation."""
    return max(1, math.ceil(span_s / profile_bin_s)) if span_s > 0 else 1


@dataclass(frozen=True)
class LengthFit:
    """A lognormal fitted to token counts: ``mean``, ``sigma`` of log length, the largest seen."""
    mean: float
    sigma: float
    maximum: int
    observed_mean: float

    @classmethod
    def of(cls, tokens: np.ndarray) -> LengthFit:
        logs = np.log(np.asarray(tokens, float))
        sigma = float(logs.std())
        return cls(float(math.exp(logs.mean() + sigma ** 2 / 2)), sigma, int(np.max(tokens)), float(np.mean(tokens)))

    def to_node(self) -> dict:
        return {"distribution": "lognormal", "mean": round(self.mean, 1), "sigma": round(self.sigma, 4),
                "max": self.maximum}


@dataclass(frozen=True)
class WorkloadFit:
    requests: int
    span_s: float
    rate_per_s: float
    gap_cv: float
    profile_bin_s: float
    profile_rates_per_s: tuple[float, ...]
    prompt: LengthFit
    output: LengthFit

    def to_workload(self, scale: float = 1.0, profile: bool = False, num_requests: int | None = None) -> dict:
        """The ``workload`` mapping: Gamma arrivals at ``scale`` times the rate with the trace's gap CV,
        or (``profile``) the binned time-of-day rates times ``scale`` as a ``steps`` profile."""
        if profile:
            rates = [{"at": f"{i * self.profile_bin_s:g} s", "rate": f"{scale * r:.6g}/s"}
                     for i, r in enumerate(self.profile_rates_per_s)]
            arrival: dict[str, Any] = {"process": "steps", "rates": rates}
            amount: dict[str, Any] = {"duration": f"{self.span_s:.6g} s"}
        else:
            cv = round(self.gap_cv, 4)
            arrival = {"process": "gamma", "rate": f"{scale * self.rate_per_s:.6g}/s", "cv": cv}
            if cv < MIN_GAMMA_CV:          # evenly spaced, as gamma gaps cannot be
                arrival = {"process": "deterministic", "rate": arrival["rate"]}
            amount = {"num_requests": num_requests or self.requests}
        return {"arrival": arrival, **amount, "prompt_tokens": self.prompt.to_node(),
                "output_tokens": self.output.to_node()}


def fit_workload(trace: Trace, profile_bin_s: float = PROFILE_BIN_S) -> WorkloadFit:
    """Fit rate, burstiness, time-of-day profile and lengths to ``trace`` (two requests or more)."""
    times = trace.arrival_s
    gaps = np.diff(times)
    span_s = float(times[-1] - times[0])
    bins = profile_bins(span_s, profile_bin_s)
    if bins > MAX_PROFILE_BINS:
        raise ValueError(f"{bins:,} bins of {profile_bin_s:g} s over {span_s:g} s: more than {MAX_PROFILE_BINS:,}")
    counts = np.bincount(np.minimum(((times - times[0]) // profile_bin_s).astype(np.int64), bins - 1),
                         minlength=bins)
    # The last bin may be partial: its rate is over the part of it the trace covers.
    widths = np.full(bins, profile_bin_s)
    widths[-1] = max(span_s - (bins - 1) * profile_bin_s, 1e-9)
    return WorkloadFit(
        requests=len(trace), span_s=span_s, rate_per_s=mean_rate_per_s(times),
        gap_cv=float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0,
        profile_bin_s=profile_bin_s, profile_rates_per_s=tuple(float(r) for r in counts / widths),
        prompt=LengthFit.of(trace.prompt_tokens), output=LengthFit.of(trace.output_tokens))
