"""A run in the JSON of ``vllm bench serve``, and per-metric errors between two such files.

:func:`vllm_bench_result` reports a simulation the way vLLM's serving benchmark reports a
measured run (``vllm bench serve --save-result``), with the same field names, so a
team can set its own benchmark beside the simulator's prediction (:func:`diff_metrics`,
``llmsim diff``). As in vLLM's ``calculate_metrics``:

- every request the run finished counts (vLLM's benchmark has no warm-up window), and
  ``duration`` runs from the first arrival to the last finish;
- TPOT of a request is ``(e2e - ttft) / (output tokens - 1)``, for outputs of 2 tokens or more;
- ITL is every gap between consecutive tokens of a request (here per decode step, weighted
  by the sequences that stepped);
- ``request_goodput`` counts the finished requests within every SLO limit, per second
  (None when the scenario sets no SLO, as vLLM leaves it without ``--goodput``);
- ``std_*`` is the population standard deviation (numpy's default), percentiles numpy's
  linear interpolation.

Latencies are in milliseconds (``mean_ttft_ms``, ``median_tpot_ms``, ``p99_itl_ms``, ...).
``input_lens``, ``output_lens`` and ``ttfts`` (seconds) list the finished requests in arrival
order. Given every request's inter-token gaps (``llmsim run --bench-detailed``, recorded by
:class:`llmsim.sim.token_times.TokenTimes`), the file also has vLLM's ``--save-detailed`` lists
``itls`` (seconds, one list per request) and ``errors`` (empty: every listed request finished);
``generated_texts`` is left out, since a simulation generates no text, and ``llmsim_notes`` says so.
"""
from __future__ import annotations

import math
from typing import TypeGuard
from pathlib import Path

import numpy as np
import pandas as pd

from llmsim.config.limits import MAX_NUMBER, MAX_TABLE_FILE_BYTES
from llmsim.config.reader import parse_json, read_text
from llmsim.errors import ConfigError

BENCH_METRICS = ("ttft", "tpot", "itl", "e2el")
BENCH_PERCENTILES = (90, 95, 99)
MS_PER_S = 1000.0
# The fields llmsim diff compares (where both files have them), in this order.
DIFF_FIELDS = ("completed", "duration", "request_throughput", "request_goodput", "output_throughput",
               "total_token_throughput", *(f"{stat}_{metric}_ms" for metric in BENCH_METRICS
                                          for stat in ("mean", "median", *(f"p{p}" for p in BENCH_PERCENTILES))))


def _statistics(values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """mean, median, std and the percentiles of ``values`` (seconds) in ms; weighted if given."""
    if len(values) == 0 or (weights is not None and weights.sum() == 0):
        return {"mean": math.nan, "median": math.nan, "std": math.nan, **{f"p{p}": math.nan for p in BENCH_PERCENTILES}}
    ms = values * MS_PER_S
    if weights is None:
        quantiles = np.percentile(ms, [50, *BENCH_PERCENTILES])
        mean, std = float(ms.mean()), float(ms.std())
    else:
        order = np.argsort(ms, kind="stable")
        ms, weights = ms[order], weights[order]
        cumulative = np.cumsum(weights)
        quantiles = np.array([ms[min(int(np.searchsorted(cumulative, q / 100 * cumulative[-1])), len(ms) - 1)]
                              for q in (50, *BENCH_PERCENTILES)])
        mean = float(np.average(ms, weights=weights))
        std = float(math.sqrt(np.average((ms - mean) ** 2, weights=weights)))
    return {"mean": mean, "median": float(quantiles[0]), "std": std,
            **{f"p{p}": float(q) for p, q in zip(BENCH_PERCENTILES, quantiles[1:])}}


def vllm_bench_result(result, itls: list[list[float]] | None = None) -> dict:
    """The ``vllm bench serve`` result JSON of a simulation result (see the module docstring);
    ``itls``: every request's inter-token gaps in seconds, in the order of ``result.requests``."""
    scenario, records = result.scenario, result.requests
    done = records[records["status"] == "finished"]
    duration_s = float(done["finish_s"].max() - records["arrival_s"].min()) if len(done) else math.nan
    output = done["generated_tokens"].to_numpy(float)
    ttft, e2e = done["ttft_s"].to_numpy(float), done["e2e_s"].to_numpy(float)
    several = output > 1
    tpot = (e2e[several] - ttft[several]) / (output[several] - 1)
    gaps, weights = result.inter_token_gaps.in_window(-math.inf, math.inf)
    span_s = float(records["arrival_s"].max() - records["arrival_s"].min()) if len(records) > 1 else 0.0
    bench = {
        "backend": "llmsim", "model_id": scenario.model.name, "num_prompts": int(len(records)),
        "request_rate": (len(records) - 1) / span_s if span_s > 0 else "inf",
        "duration": duration_s,
        "completed": int(len(done)),
        "total_input_tokens": int(done["prompt_tokens"].sum()),
        "total_output_tokens": int(output.sum()),
        "request_throughput": len(done) / duration_s,
        "request_goodput": (float(records["meets_slo"].sum()) / duration_s) if scenario.slo.defined else None,
        "output_throughput": float(output.sum()) / duration_s,
        "total_token_throughput": float(output.sum() + done["prompt_tokens"].sum()) / duration_s,
    }
    for metric, values, weight in (("ttft", ttft, None), ("tpot", tpot, None), ("itl", gaps, weights),
                                   ("e2el", e2e, None)):
        for stat, value in _statistics(values, weight).items():
            bench[f"{stat}_{metric}_ms"] = value
    bench.update(input_lens=done["prompt_tokens"].astype(int).tolist(), output_lens=output.astype(int).tolist(),
                 ttfts=ttft.tolist())
    if itls is not None:
        finished = (records["status"] == "finished").to_numpy()
        bench["itls"] = [gaps for gaps, keep in zip(itls, finished) if keep]
        bench["errors"] = [""] * len(done)
        bench["llmsim_notes"] = ["generated_texts is left out: a simulation generates no text"]
    return bench


def read_bench_json(path: str | Path) -> dict:
    """A ``vllm bench serve`` result JSON, its :data:`DIFF_FIELDS` checked: each absent, null or a
    number >= 0 (NaN and infinity are kept: vLLM writes NaN for a metric with no sample, and the
    diff leaves such a metric out) of at most :data:`~llmsim.config.limits.MAX_NUMBER`. Read
    through the front door with the size cap of a table (``--save-detailed`` lists every token
    gap) and :func:`~llmsim.config.reader.parse_json` (nesting bounded); a string, a boolean or a
    400-digit integer is a ConfigError naming the file and field."""
    name = str(path)
    data = parse_json(read_text(path, MAX_TABLE_FILE_BYTES), name)
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object of benchmark fields", file=name, has_value=False,
                          allowed=", ".join(DIFF_FIELDS))
    for field in DIFF_FIELDS:
        value = data.get(field)
        if value is None:
            continue
        # Compared before any float conversion: a JSON integer of 400 digits would overflow it.
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        in_range = number and (0 <= value <= MAX_NUMBER or isinstance(value, float)
                               and (math.isnan(value) or value == math.inf))
        if not in_range:
            raise ConfigError("not a valid value", file=name, key=field, value=value,
                              allowed=f"null or a number >= 0 and <= {MAX_NUMBER:.5g}")
    return data


def _finite_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def diff_metrics(measured: dict, simulated: dict) -> pd.DataFrame:
    """Per metric both have as a number: measured, simulated, their difference and the relative
    error ``(simulated - measured) / measured`` in percent."""
    rows = []
    for field in DIFF_FIELDS:
        a, b = measured.get(field), simulated.get(field)
        if not (_finite_number(a) and _finite_number(b)):
            continue
        rows.append({"metric": field, "measured": float(a), "simulated": float(b), "difference": float(b - a),
                     "error_pct": 100.0 * (b - a) / a if a else math.nan})
    return pd.DataFrame(rows, columns=["metric", "measured", "simulated", "difference", "error_pct"])
