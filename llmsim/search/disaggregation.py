"""Aggregated against disaggregated layouts: which serves a rate within the SLO for less, and why.

For a scenario with ``deployment.disaggregation``, :func:`compare_layouts` simulates at one rate,
on the same requests (common random numbers), the aggregated layout (the deployment's own chip and
parallelism) at 1 to ``max_replicas`` replicas and each prefill:decode ratio (``xPyD``: ``x``
prefill and ``y`` decode replicas of the pools' chips and parallelism). A layout meets the SLO when
every percentile target holds (``slo.met``), on every seed when several are given (each seed's requests
shared by every layout; the table holds the means over seeds and, for the latencies, attainment and cost
per output token, their 95% Student-t half-widths in ``<column>.ci95``). :func:`verdict` then names the
cheapest layout that meets it, per hour (each pool's devices at its chip's price), and the reason the
other kind lost: the SLO target its cheaper layouts miss, or its higher cost.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import pandas as pd

from llmsim.analysis.metrics import summarize
from llmsim.analysis.statistics import ci95_half_width
from llmsim.config.progress import QUIET, Progress
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import SLO_METRICS, Scenario
from llmsim.search.plan import SPLIT_KEY, as_scenario, check_rate
from llmsim.scenario.variants import RATE_KEY, variant
from llmsim.sim.simulate import simulate_whole
from llmsim.workload.generate import generate_trace

AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"
RATIO = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


def parse_ratios(text: str, key: str = "ratios") -> list[tuple[int, int]]:
    """``"1P1D,2P1D,3P1D"`` -> ``[(1, 1), (2, 1), (3, 1)]`` (a ConfigError naming ``key`` otherwise)."""
    ratios = []
    for part in text.split(","):
        match = RATIO.match(part)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise ConfigError("cannot read this as prefill:decode replica ratios", key=key, value=text,
                              allowed="xPyD entries separated by commas, x and y >= 1, e.g. 1P1D,2P1D,3P1D")
        ratios.append((int(match[1]), int(match[2])))
    return ratios


def default_ratios(scenario: Scenario) -> list[tuple[int, int]]:
    """1 to 3 prefill replicas per decode replica at the scenario's decode replicas, and the scenario's own."""
    split = scenario.disaggregation
    if split is None:
        return []
    decode = split.decode.replicas
    ratios = [(x * decode, decode) for x in (1, 2, 3)]
    own = (split.prefill.replicas, decode)
    return ratios if own in ratios else [*ratios, own]


@dataclass(frozen=True)
class Comparison:
    """One row per layout simulated (``table``) and the one-line verdict."""
    rate_per_s: float
    table: pd.DataFrame
    verdict: str


def compare_layouts(scenario: str | Path | Scenario, rate_per_s: float,
                    ratios: Sequence[tuple[int, int]] | None = None, max_replicas: int | None = None, *,
                    seeds: Sequence[int] | None = None, progress: Progress = QUIET) -> Comparison:
    """Simulate the aggregated layout (1 to ``max_replicas`` replicas; default: as many devices as the largest
    disaggregated layout) and every ``xPyD`` ratio at ``rate_per_s``, on the same
    requests, once per seed of ``seeds`` (default: the scenario's own); see the module docstring."""
    scenario = as_scenario(scenario)
    split = scenario.disaggregation
    if split is None:
        raise ConfigError("there is no disaggregated layout to compare: the scenario has no "
                          "deployment.disaggregation", file=scenario.path, key=SPLIT_KEY, has_value=False,
                          allowed="a deployment.disaggregation section (docs/guides/disaggregation.md)")
    rate = check_rate(rate_per_s)
    ratios = list(ratios or default_ratios(scenario))
    if max_replicas is None:
        most = max(x * split.prefill.devices_per_replica + y * split.decode.devices_per_replica for x, y in ratios)
        max_replicas = max(1, most // scenario.deployment.devices_per_replica)
    points = [(AGGREGATED, f"{n} x {scenario.hardware.name} TP{scenario.deployment.tensor_parallel}"
               + (f" PP{scenario.deployment.pipeline_parallel}" if scenario.deployment.pipeline_parallel > 1 else ""),
               {SPLIT_KEY: None, "deployment.replicas": n}) for n in range(1, max_replicas + 1)]
    points += [(DISAGGREGATED, f"{x}P{y}D", {f"{SPLIT_KEY}.prefill.replicas": x, f"{SPLIT_KEY}.decode.replicas": y})
               for x, y in ratios]
    seed_list = list(seeds) if seeds else [scenario.seed]
    progress.add(len(points) * len(seed_list))
    rows = []
    for seed in seed_list:
        trace = None
        for kind, label, overrides in points:
            progress.note(label)
            point = variant(scenario, {**overrides, RATE_KEY: rate}).with_seed(seed)
            if trace is None:
                trace = generate_trace(point.workload, point.seed)    # every layout sees the seed's requests
            summary = summarize(simulate_whole(point, trace)).to_dict()
            rows.append(_row(kind, label, summary))
            progress.advance()
    table = _over_seeds(pd.DataFrame(rows)).sort_values(["usd_per_hour", "kind"], kind="stable", ignore_index=True)
    return Comparison(rate, table, verdict(table, scenario))


INTERVALS = ("ttft_p95_s", "tpot_p95_s", "slo_attainment", "usd_per_million_output_tokens")


def _over_seeds(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per layout: the means of its seeds' figures, the half-widths of :data:`INTERVALS` (NaN with one
    seed: no interval), ``seeds`` and ``slo_met`` only where every seed met the SLO."""
    groups = runs.groupby(["kind", "layout"], sort=False)
    table = groups.mean(numeric_only=True).drop(columns="slo_met")
    for column in INTERVALS:
        table[f"{column}.ci95"] = groups[column].agg(lambda values: ci95_half_width(values.std(ddof=1), len(values)))
    table["slo_met"] = groups["slo_met"].all()
    table["seeds"] = groups.size()
    return table.reset_index()


def _row(kind: str, label: str, summary: dict) -> dict:
    latency, slo, economics = summary["latency"], summary["slo"], summary["economics"]
    row = {"kind": kind, "layout": label, "devices": summary["devices"], "usd_per_hour": economics["usd_per_hour"],
           "ttft_p95_s": latency["ttft_s"]["p95"], "tpot_p95_s": latency["tpot_s"]["p95"],
           "slo_attainment": slo["attainment"], "slo_met": slo["met"],
           "usd_per_million_output_tokens": economics["usd_per_million_output_tokens"],
           "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"]}
    for metric in SLO_METRICS:
        if f"{metric}_attainment" in slo:
            row[f"{metric}_attainment"] = slo[f"{metric}_attainment"]
            row[f"{metric}_percentile"] = slo[f"{metric}_percentile"]
    split = summary.get("disaggregation")
    if split is not None:
        row["transfer_mean_s"] = split["transfer_s"]["mean"]
        row["link_utilisation"] = split["link_utilisation"]
        for pool, figures in split["pools"].items():
            row[f"{pool}_busy"] = figures["busy_fraction"]
    return row


def missed(row: pd.Series, scenario: Scenario) -> str:
    """The SLO targets ``row``'s layout misses, as ``TPOT p95 within 40 ms for 81% of requests``."""
    parts = []
    for metric in SLO_METRICS:
        column = f"{metric}_attainment"
        limit = getattr(scenario.slo, f"{metric}_s")
        if column in row and limit is not None and row[column] < row[f"{metric}_percentile"] / 100:
            parts.append(f"{metric.upper()} within {limit * 1e3:,.0f} ms for {100 * row[column]:.0f}% of requests "
                         f"(target {row[f'{metric}_percentile']:g}%)")
    return "; ".join(parts) or "the SLO"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def verdict(table: pd.DataFrame, scenario: Scenario) -> str:
    """One line: the cheapest layout meeting the SLO, and why the other kind did not win."""
    meeting = table[table["slo_met"]]
    if meeting.empty:
        closest = table.sort_values("slo_attainment", ascending=False).iloc[0]
        return (f"no layout meets the SLO: the closest, {closest['layout']} ({closest['kind']}), misses "
                f"{missed(closest, scenario)}")
    best = meeting.iloc[0]
    other = AGGREGATED if best["kind"] == DISAGGREGATED else DISAGGREGATED
    rivals = table[table["kind"] == other]
    rival_best = rivals[rivals["slo_met"]]
    head = f"{best['kind']} wins: {best['layout']} meets the SLO for {best['usd_per_hour']:,.2f} USD/h"
    if rival_best.empty:
        largest = rivals.sort_values("usd_per_hour").iloc[-1] if len(rivals) else None
        reason = (f"no {other} layout tried meets it ({largest['layout']} misses {missed(largest, scenario)})"
                  if largest is not None else f"no {other} layout was tried")
        return f"{head}; {reason}"
    rival = rival_best.iloc[0]
    cheaper = rivals[rivals["usd_per_hour"] < rival["usd_per_hour"]]
    why = (f"; its cheaper layouts miss {missed(cheaper.iloc[-1], scenario)} ({cheaper.iloc[-1]['layout']})"
           if len(cheaper) else "")
    if math.isclose(rival["usd_per_hour"], best["usd_per_hour"]):
        return (f"a tie at {best['usd_per_hour']:,.2f} USD/h: {best['kind']} {best['layout']} and {other} "
                f"{rival['layout']} both meet the SLO; TPOT p95 {_ms(best['tpot_p95_s'])} vs "
                f"{_ms(rival['tpot_p95_s'])} ms, TTFT p95 {_ms(best['ttft_p95_s'])} vs {_ms(rival['ttft_p95_s'])} ms")
    return f"{head}, {other} needs {rival['layout']} for {rival['usd_per_hour']:,.2f} USD/h{why}"

