"""The adaptive controller's sensor: latency targets over a sliding window of time.

A window's figure for one target (a class's TTFT, TPOT or end-to-end limit and its percentile)
is that percentile of the latency over the requests that finished inside the window, divided by
the limit: above 1 the target is violated there. The worst ratio over all targets says whether
anything is violated. Rejected and unfinished requests do not enter (they have no latency); a
window in which nothing finished has no figure (NaN). :mod:`llmsim.analysis.rolling` applies
the same figure to a finished run's records.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmsim.scenario.scenario import SLO


@dataclass(frozen=True)
class Target:
    """One latency limit: of traffic class ``class_index`` (None: every request), metric, limit, percentile."""
    class_index: int | None
    metric: str
    limit_s: float
    percentile: float


def targets_of(slo: SLO, class_names: tuple[str, ...]) -> list[Target]:
    """Every limit the SLO sets: per class with traffic classes, else the top-level ones."""
    if not class_names:
        return [Target(None, m, limit, p) for m, (limit, p) in slo.targets().items()]
    return [Target(i, m, limit, p) for i, name in enumerate(class_names)
            for m, (limit, p) in slo.for_class(name).targets().items()]


def latencies(arrival_s, first_token_s, finish_s, output_tokens) -> dict[str, np.ndarray]:
    """TTFT, TPOT and end-to-end latency per request from its times (NaN where not defined)."""
    decode = np.asarray(output_tokens, float) - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decode > 0, (finish_s - first_token_s) / np.maximum(decode, 1), np.nan)
    return {"ttft": first_token_s - arrival_s, "tpot": tpot, "e2e": finish_s - arrival_s}


def worst_ratio(finish_s: np.ndarray, finished: np.ndarray, class_index: np.ndarray | None,
                values: dict[str, np.ndarray], targets: list[Target], start_s: float, stop_s: float) -> float:
    """The largest (window percentile / limit) over ``targets``, for requests finished in (start, stop]."""
    inside = finished & (finish_s > start_s) & (finish_s <= stop_s)
    worst = np.nan
    for target in targets:
        mine = inside if target.class_index is None else inside & (class_index == target.class_index)
        sample = values[target.metric][mine]
        sample = sample[~np.isnan(sample)]
        if len(sample):
            ratio = float(np.percentile(sample, target.percentile)) / target.limit_s
            worst = ratio if np.isnan(worst) else max(worst, ratio)
    return worst
