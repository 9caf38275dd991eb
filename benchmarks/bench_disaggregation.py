"""Where disaggregated prefill/decode wins and where it loses, and how fast a disaggregated run simulates.

Each regime serves the same requests (one trace per regime and rate) with two H100s of Llama-3.1-8B, either
aggregated (two replicas, chunked prefill mixing prompts into the decode batches) or disaggregated (one
prefill and one decode replica, 1P1D, the KV over the regime's link), so both cost the same per hour. It
prints P95 TTFT and TPOT, SLO attainment and goodput (requests/s meeting the SLO), then the simulated
requests per wall-clock second of a disaggregated run against an aggregated run of the same requests
(the target is at least 0.5x). The reasoning, with sources, is in docs/guides/disaggregation.md.

Run ``python benchmarks/bench_disaggregation.py`` (about a minute on one core).
"""
from __future__ import annotations

import platform
import time

import pandas as pd

from llmsim.analysis.metrics import summarize
from llmsim.config.reader import Node
from llmsim.scenario.scenario import scenario_from_node
from llmsim.sim.simulate import simulate
from llmsim.workload.generate import generate_trace

BASE = {"name": "bench-disaggregation", "seed": 1, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
        "deployment": {"replicas": 2, "tensor_parallel": 1},
        "engine": {"max_num_seqs": 256, "max_batch_tokens": 8192, "chunked_prefill": True, "max_model_len": 16384},
        }
SPLIT = {"prefill": {"replicas": 1, "tensor_parallel": 1}, "decode": {"replicas": 1, "tensor_parallel": 1}}
REGIMES = {
    # Long prompts under a tight TPOT: an aggregated step that carries a prompt chunk stalls every decode in it.
    "long prompts, tight TPOT (wins)": dict(
        prompt={"distribution": "lognormal", "mean": 6000, "sigma": 0.4, "max": 12000}, output=200,
        slo={"ttft": "2 s", "tpot": "11 ms"}, link="nvlink4", rates=(2.0, 3.0)),
    # Short prompts under a loose TPOT: prefill is cheap, so a whole replica kept for it mostly idles.
    "short prompts, loose TPOT (loses)": dict(
        prompt={"distribution": "lognormal", "mean": 200, "sigma": 0.5, "max": 2000}, output=300,
        slo={"ttft": "1 s", "tpot": "100 ms"}, link="nvlink4", rates=(40.0, 70.0), requests=3000),
    # Long prompts over a 200 GbE RoCE port under a tight TTFT: the transfer adds to every first token.
    "long prompts, slow link, tight TTFT (loses)": dict(
        prompt={"distribution": "lognormal", "mean": 12000, "sigma": 0.2, "max": 15000}, output=100,
        slo={"ttft": "600 ms", "tpot": "60 ms"}, link="roce_200g", rates=(0.5, 1.0)),
}
REQUESTS = 300           # per run, unless a regime says otherwise; the first 10% of the arrivals are warm-up


def scenario(regime: dict, rate: float, disaggregated: bool):
    data = {**BASE, "slo": regime["slo"],
            "workload": {"arrival": {"process": "poisson", "rate": rate},
                         "num_requests": regime.get("requests", REQUESTS),
                         "prompt_tokens": regime["prompt"], "output_tokens": regime["output"]}}
    if disaggregated:
        data["deployment"] = {**BASE["deployment"], "disaggregation": {**SPLIT, "link": regime["link"]}}
    return scenario_from_node(Node(data, file="<bench>"))


def row(name: str, rate: float, kind: str, summary) -> dict:
    return {"regime": name, "rate": rate, "layout": kind, "USD/h": summary.economics.usd_per_hour,
            "TTFT p95 ms": 1e3 * summary.latency.ttft_s.p95, "TPOT p95 ms": 1e3 * summary.latency.tpot_s.p95,
            "attainment": summary.slo.attainment, "goodput req/s": summary.slo.goodput_requests_per_s,
            "transfer ms": 1e3 * summary.disaggregation.ttft_transfer_s.mean if summary.disaggregation else 0.0}


def main() -> None:
    rows, speed = [], []
    for name, regime in REGIMES.items():
        for rate in regime["rates"]:
            trace = None
            for kind, split in (("aggregated 2 x TP1", False), ("1P1D " + regime["link"], True)):
                built = scenario(regime, rate, split)
                trace = trace if trace is not None else generate_trace(built.workload, built.seed)
                started = time.perf_counter()
                result = simulate(built, trace)
                seconds = time.perf_counter() - started
                rows.append(row(name, rate, kind, summarize(result)))
                speed.append({"regime": name, "rate": rate, "layout": "disaggregated" if split else "aggregated",
                              "requests_per_s": len(trace) / seconds})
    pd.set_option("display.width", 160)
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:,.3g}"))
    frame = pd.DataFrame(speed).pivot_table(index=["regime", "rate"], columns="layout", values="requests_per_s")
    frame["ratio"] = frame["disaggregated"] / frame["aggregated"]
    print("\nsimulated requests per wall-clock second, same requests (target: disaggregated >= 0.5x aggregated)")
    print(frame.to_string(float_format=lambda v: f"{v:,.3g}"))
    print(f"\nworst ratio {frame['ratio'].min():.2f}x on {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}")


if __name__ == "__main__":
    main()
