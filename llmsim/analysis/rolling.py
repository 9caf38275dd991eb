"""Latency targets over a sliding window of time, after a run: how long it spent over its SLO.

The adaptive controller reads the same figure while a run goes on (:mod:`llmsim.sim.sensor`);
here it is computed from a finished run's records, window by window.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from llmsim.scenario.scenario import SLO
from llmsim.sim.sensor import latencies, targets_of, worst_ratio


def rolling_worst_ratio(records: pd.DataFrame, slo: SLO, class_names: tuple[str, ...], window_s: float,
                        step_s: float, start_s: float, stop_s: float) -> pd.DataFrame:
    """The worst ratio of every window ``(t - window_s, t]``, for t every ``step_s`` in (start, stop]."""
    targets = targets_of(slo, class_names)
    finish = records["finish_s"].to_numpy(float)
    finished = (records["status"] == "finished").to_numpy()
    index = None
    if class_names:
        index = records["class"].map({name: i for i, name in enumerate(class_names)}).to_numpy()
    values = latencies(records["arrival_s"].to_numpy(float), records["first_token_s"].to_numpy(float), finish,
                       records["output_tokens"].to_numpy())
    times = np.arange(start_s + step_s, stop_s + 1e-9, step_s)
    return pd.DataFrame({"time_s": times, "worst_ratio": [worst_ratio(finish, finished, index, values, targets,
                                                                      t - window_s, t) for t in times]})


def time_over_slo(rolling: pd.DataFrame, step_s: float) -> float:
    """Seconds of the windows whose worst ratio exceeds 1 (each window stands for ``step_s``)."""
    return float((rolling["worst_ratio"] > 1).sum() * step_s)
