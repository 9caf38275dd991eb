"""Online (latency-constrained) against offline throughput of the same engine, as MLPerf measures them.

MLPerf Inference's Llama-2-70B benchmark runs each system twice: Offline (every request at once) and
Server (Poisson arrivals, P99 TTFT <= 2 s and P99 TPOT <= 200 ms). Here the simulator does the same for
Llama-2-70B on 8 H100s (one TP 8 replica, fp16; MLPerf's 294-token mean output, prompts capped at 1,024
tokens as MLPerf's are): the offline rate of the saturated engine (:func:`offline_rate`), the highest
Poisson rate meeting both P99 limits (:func:`max_sustainable_rate`, 1% bisection tolerance), their ratio,
for an engine whose batch limit keeps the offline TPOT under 200 ms and one whose does not.

    .venv/bin/python benchmarks/bench_online_offline.py       (about 1 minute on 2 cores)
"""
from __future__ import annotations

import time

from llmsim.search.sustainable_rate import max_sustainable_rate, offline_rate

MLPERF_LIMITS = {"ttft": "2 s", "tpot": "200 ms", "percentile": 99}


def mlperf_like(max_num_seqs: int, slo: dict = MLPERF_LIMITS) -> dict:
    """Llama-2-70B on one TP 8 replica of H100s, MLPerf-like lengths, ``max_num_seqs`` sequences."""
    return {"name": f"mlperf-like-{max_num_seqs}", "seed": 11, "model": "Llama-2-70B", "hardware": "H100-SXM",
            "deployment": {"replicas": 1, "tensor_parallel": 8},
            "engine": {"max_num_seqs": max_num_seqs, "max_batch_tokens": 8192, "chunked_prefill": True},
            "workload": {"arrival": {"process": "poisson", "rate": 10}, "num_requests": 6000,
                         "prompt_tokens": {"distribution": "lognormal", "mean": 300, "sigma": 0.8, "max": 1024},
                         "output_tokens": {"distribution": "lognormal", "mean": 294, "sigma": 0.8, "max": 1024}},
            "slo": dict(slo)}


def online_offline(scenario: dict) -> tuple:
    """(offline, sustainable online rate) of ``scenario``."""
    offline = offline_rate(scenario, num_requests=20 * scenario["engine"]["max_num_seqs"])
    online = max_sustainable_rate(scenario, lo=0.5 * offline.rate_per_s, hi=1.3 * offline.rate_per_s,
                                  tol=0.01 * offline.rate_per_s, workers=1)
    return offline, online


def main() -> None:
    started = time.perf_counter()
    print(f"{'max_num_seqs':>12} {'offline req/s':>13} {'batch':>6} {'offline TPOT':>12} {'online req/s':>12} "
          f"{'online/offline':>14}  at the online rate: P99 TTFT, P99 TPOT")
    for seqs in (256, 2048):
        offline, online = online_offline(mlperf_like(seqs))
        row = online.evaluations[online.evaluations["workload.arrival.rate"] == online.rate_per_s].iloc[0]
        print(f"{seqs:>12} {offline.rate_per_s:>13.2f} {offline.mean_batch:>6.0f} {offline.step_s * 1e3:>9.0f} ms "
              f"{online.rate_per_s:>12.2f} {online.rate_per_s / offline.rate_per_s:>14.3f}  "
              f"{row['latency.ttft_s.p99']:.2f} s, {row['latency.tpot_s.p99'] * 1e3:.0f} ms")
    print(f"\n{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
