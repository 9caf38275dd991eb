"""Speculative decoding against plain decoding: the same scenario without a draft, on the same trace."""
from __future__ import annotations

from llmsim.analysis.metrics import summarize
from llmsim.sim.result import SimulationResult
from llmsim.sim.simulate import simulate_whole
from llmsim.workload.generate import generate_trace


def speedup_over_plain(result: SimulationResult, summary: dict | None = None) -> dict:
    """Speculative decoding's gain: the same scenario without it, on the same arrival trace.

    Ratios are plain / speculative for latencies (above 1 = faster) and speculative /
    plain for throughputs. ``summary`` is ``summarize(result).to_dict()`` when the caller has it
    already (summarising a large run takes seconds).
    """
    scenario = result.scenario
    # The size of the run itself, already checked; Ctrl-C during the baseline: no ratios from half a run.
    plain = summarize(simulate_whole(scenario.plain_decoding(), generate_trace(scenario.workload, scenario.seed),
                                     force=True)).to_dict()
    spec = summarize(result).to_dict() if summary is None else summary
    return {
        "tpot_mean": _ratio(plain["latency"]["tpot_s"]["mean"], spec["latency"]["tpot_s"]["mean"]),
        "e2e_p50": _ratio(plain["latency"]["e2e_s"]["p50"], spec["latency"]["e2e_s"]["p50"]),
        "e2e_p95": _ratio(plain["latency"]["e2e_s"]["p95"], spec["latency"]["e2e_s"]["p95"]),
        "ttft_p50": _ratio(plain["latency"]["ttft_s"]["p50"], spec["latency"]["ttft_s"]["p50"]),
        "output_tokens_per_s": _ratio(spec["throughput"]["output_tokens_per_s"],
                                     plain["throughput"]["output_tokens_per_s"]),
        "goodput_requests_per_s": _ratio(spec["slo"]["goodput_requests_per_s"], plain["slo"]["goodput_requests_per_s"]),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
