"""How fast the simulator runs: simulated requests and engine iterations per wall second.

A fixed scenario: Llama-3.1-8B on one H100, chat-like lengths (lognormal prompts of
mean 1024 and outputs of mean 256 tokens), Poisson arrivals at 80% of the replica's
capacity, 100,000 requests. Capacity is measured first, by the same simulator, as the
throughput of a saturated run. Run it with ``python benchmarks/bench_simulator.py``
(``--requests N`` for a shorter run, ``--profile`` to print the top of a cProfile,
``--speculative`` to decode with a colocated Llama-3.2-1B draft, static k = 4, alpha 0.7).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import platform
import pstats
import time

import llmsim
from llmsim.scenario.scenario import Deployment, EngineConfig, SLO, Scenario, SimulationConfig
from llmsim.speculation.config import Acceptance, KPolicy, SpeculationConfig
from llmsim.workload.generate import ArrivalProcess, LengthDistribution, Workload


def scenario(rate_per_s: float, requests: int, speculative: bool = False) -> Scenario:
    workload = Workload(ArrivalProcess("poisson", rate_per_s),
                        LengthDistribution("lognormal", mean=1024, sigma=1.0, maximum=8192),
                        LengthDistribution("lognormal", mean=256, sigma=0.8, maximum=2048),
                        num_requests=requests, duration_s=None)
    catalog = llmsim.model_catalog()
    speculation = SpeculationConfig(catalog["Llama-3.2-1B"], draft_tensor_parallel=1, policy=KPolicy("static", 4),
                                    acceptance=Acceptance("bernoulli", alpha=0.7)) if speculative else None
    return Scenario("bench", 2026, catalog["Llama-3.1-8B"], llmsim.lookup_hardware("H100-SXM"),
                    Deployment(), EngineConfig(max_model_len=16384), workload, SLO(), SimulationConfig(),
                    speculation=speculation)


def capacity_requests_per_s(speculative: bool) -> float:
    """Throughput of a saturated replica: arrivals at 4x what it can serve, steady-state window."""
    saturated = dataclasses.replace(scenario(100.0, 6000, speculative), simulation=SimulationConfig(warmup_s=10.0))
    return llmsim.simulate(saturated).summary()["throughput"]["requests_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity (default 0.8)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--speculative", action="store_true", help="with a draft model (static k = 4)")
    args = parser.parse_args()

    capacity = capacity_requests_per_s(args.speculative)
    bench = scenario(args.load * capacity, args.requests, args.speculative)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    result = llmsim.simulate(bench)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    summary = result.summary()
    iterations = len(result.iterations)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print(f"capacity {capacity:.2f} req/s; offered {bench.workload.arrival.rate_per_s:.2f} req/s "
          f"({args.load:.0%}); mean batch {summary['utilisation']['mean_batch_size']:.0f}")
    print(f"{args.requests:,} requests, {iterations:,} iterations, {result.end_s:,.0f} simulated s "
          f"in {wall:.2f} wall s")
    print(f"simulated requests per wall second: {args.requests / wall:,.0f}")
    print(f"iterations per wall second:         {iterations / wall:,.0f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
