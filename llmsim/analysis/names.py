"""The dotted names of summary metrics, as :func:`llmsim.flatten` writes them.

A run's summary (:class:`~llmsim.analysis.summary.RunSummary`) flattens to one row with a
column per figure: ``latency.tpot_s.p95``, ``slo.attainment``... These constants are the
names searches, tables and the command line read those columns by; a test checks that
each is a column of a real run's flattened summary, so a renamed field cannot leave a
stale name behind.
"""
from __future__ import annotations

from llmsim.scenario.scenario import SLO_METRICS

LATENCY = "latency"
THROUGHPUT = "throughput"
SLO = "slo"
ECONOMICS = "economics"
REQUESTS = "requests"


def latency(metric_s: str, statistic: str) -> str:
    """``latency.<metric_s>.<statistic>``, e.g. ``latency("tpot_s", "p95")``."""
    return f"{LATENCY}.{metric_s}.{statistic}"


def slo_limit(metric: str) -> str:
    """The column of an SLO limit in seconds (``slo.ttft_s``; empty when the limit is not set)."""
    return f"{SLO}.{metric}_s"


def slo_attainment(metric: str) -> str:
    """The share of requests within one limit (``slo.ttft_attainment``; only for limits set)."""
    return f"{SLO}.{metric}_attainment"


def slo_attainment_stderr(metric: str) -> str:
    """The batch-means standard error of one limit's attainment (``slo.ttft_attainment_stderr``)."""
    return f"{SLO}.{metric}_attainment_stderr"


def slo_percentile(metric: str) -> str:
    """The percentile target of one limit (``slo.ttft_percentile``; only for limits set)."""
    return f"{SLO}.{metric}_percentile"


TTFT_P95 = latency("ttft_s", "p95")
TTFT_P99 = latency("ttft_s", "p99")
TPOT_MEAN = latency("tpot_s", "mean")
TPOT_P95 = latency("tpot_s", "p95")
TPOT_P99 = latency("tpot_s", "p99")
E2E_P95 = latency("e2e_s", "p95")

OUTPUT_TOKENS_PER_S = f"{THROUGHPUT}.output_tokens_per_s"
OUTPUT_TOKENS_PER_S_PER_DEVICE = f"{THROUGHPUT}.output_tokens_per_s_per_device"
# Not in a run's summary: a sweep adds it to each row (output tokens per dollar of device time).
OUTPUT_TOKENS_PER_USD = f"{THROUGHPUT}.output_tokens_per_usd"

SLO_ATTAINMENT = f"{SLO}.attainment"
SLO_ATTAINMENT_STDERR = f"{SLO}.attainment_stderr"
SLO_MET = f"{SLO}.met"
CLASSES = "classes"              # per traffic class: classes.<name>.<the class summary's keys>
SLO_LIMITS = tuple(slo_limit(metric) for metric in SLO_METRICS)

USD_PER_HOUR = f"{ECONOMICS}.usd_per_hour"
USD_PER_MILLION_OUTPUT_TOKENS = f"{ECONOMICS}.usd_per_million_output_tokens"
JOULES_PER_OUTPUT_TOKEN = f"{ECONOMICS}.joules_per_output_token_at_tdp"
KWH_PER_MILLION_OUTPUT_TOKENS = f"{ECONOMICS}.kwh_per_million_output_tokens_at_tdp"

FINISHED = f"{REQUESTS}.finished"
STEADY = "queue.steady"
STOPPED_BY = "stopped_by"         # a StopReason's value (llmsim.sim.result)
STOPPED_ON = "stopped_on"         # stopped as missed: the limits it stopped on, comma-separated (llmsim.sim.missed)
WINDOW = "window_s"               # the measurement window, (start, stop) in simulated seconds

SUMMARY_NAMES = (TTFT_P95, TTFT_P99, TPOT_MEAN, TPOT_P95, TPOT_P99, E2E_P95, OUTPUT_TOKENS_PER_S,
                 OUTPUT_TOKENS_PER_S_PER_DEVICE, SLO_ATTAINMENT, SLO_ATTAINMENT_STDERR, SLO_MET, *SLO_LIMITS,
                 USD_PER_HOUR, USD_PER_MILLION_OUTPUT_TOKENS, JOULES_PER_OUTPUT_TOKEN, KWH_PER_MILLION_OUTPUT_TOKENS,
                 FINISHED, STEADY, STOPPED_BY)
