"""Which per-request records meet an SLO: the ``meets_slo`` column of every run's records.

A finished request meets the SLO when every limit it is held to (its class's, with traffic
classes) holds. Analysis reads the same limits for per-metric attainment. ``records`` is a table,
or (as the simulator computes the column, before it builds the table) its columns as numpy arrays:
the same operations serve both.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import pandas as pd

from llmsim.scenario.scenario import SLO, SLO_METRICS


Records: TypeAlias = "pd.DataFrame | Mapping[str, np.ndarray]"


def within_limit(records: Records, metric: str, limit_s) -> Any:
    """Requests whose ``metric`` is within its limit (a 1-token output has no TPOT, and meets it);
    ``limit_s`` is one limit or one per row (inf: none). A Series for a table, an array for arrays."""
    values = records[f"{metric}_s"]
    return (values <= limit_s) | np.isnan(values) if metric == "tpot" else values <= limit_s


def slo_limits(records: Records, slo: SLO) -> dict:
    """metric -> its limit for every metric some request is held to: one number, or with traffic
    classes each row's class limit (inf where its class sets none)."""
    if not slo.classes or "class" not in records:
        return {metric: limit for metric, (limit, _) in slo.targets().items()}
    out = {}
    of_class: dict[str, np.ndarray] = {}          # class -> its rows, found once for every metric
    for metric in SLO_METRICS:
        per_class = {name: getattr(own, f"{metric}_s") for name, own in slo.classes}
        if any(v is not None for v in per_class.values()):
            if not of_class:
                column = np.asarray(records["class"])       # compared on numpy (pandas compares Arrow strings slowly)
                of_class = {name: column == name for name in per_class}
            # a row of a class the SLO does not name is held to nothing it can meet (NaN)
            limits = np.full(len(column), np.nan)
            for name, v in per_class.items():
                limits[of_class[name]] = math.inf if v is None else v
            out[metric] = limits
    return out


def meets_slo(records: Records, slo: SLO) -> Any:
    """True for finished requests within every limit the SLO (their class's, with classes) sets."""
    ok = records["status"] == "finished"
    for metric, limit in slo_limits(records, slo).items():
        ok &= within_limit(records, metric, limit)
    return ok
