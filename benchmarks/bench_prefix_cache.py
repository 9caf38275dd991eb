"""What the KV-cache hierarchy costs in simulator speed: sessions with a prefix cache against the plain engine.

The workload is the shipped multi-turn chat (scenarios/llama3-8b-h100-multiturn-chat.yaml: Llama-3.1-8B on
one H100, conversations of 1-10 turns behind shared system prompts), ``--requests`` turns (default
100,000). Two engines run it: the plain engine (no prefix caching: the KV cache only counts blocks) and
the prefix cache (GPU only; with ``--offload`` also with CPU offload after 2 s idle). As in
bench_simulator.py each engine runs at ``--load`` (80%) of its own capacity, found first by the same
simulator as the steady turn throughput of a saturated run, so both run comparable batches; at one
common rate the cached engine, which does far less prefill, would run many more, shorter iterations
per request, and the ratio would measure the load rather than the simulator. Printed per engine:
wall and CPU seconds, iterations, microseconds per iteration, simulated requests (turns) per wall
second and per CPU second, and the ratio to the plain engine (the issue's target: >= 0.5 per wall
second). A short run first pays for what happens once per process (imports, compiled kernels).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import llmsim
from llmsim.analysis.metrics import summarize
from llmsim.scenario.scenario import CPUOffload
from llmsim.workload.arrivals import Poisson
from llmsim.workload.generate import generate_trace

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "llama3-8b-h100-multiturn-chat.yaml"
SATURATING_SESSIONS_PER_S = 12.0     # several times what one replica serves: the queue never empties
SATURATED_TURNS = 6000
WARMUP_S = 30.0


def engines(scenario, offload: bool) -> dict:
    engine = scenario.engine
    out = {"plain engine": replace(scenario, engine=replace(engine, prefix_caching=False, cpu_offload=None)),
           "prefix cache": replace(scenario, engine=replace(engine, cpu_offload=None))}
    if offload:
        out["prefix cache + CPU offload 2 s"] = replace(scenario, engine=replace(engine, cpu_offload=CPUOffload(2.0)))
    return out


def at(scenario, sessions_per_s: float, turns: int):
    return replace(scenario, workload=replace(scenario.workload, arrival=Poisson(sessions_per_s), num_requests=turns))


def capacity_sessions_per_s(scenario) -> float:
    """Sessions per second one replica sustains: its steady turn throughput under saturation (turns
    finished between the warm-up and the time 90% had finished) over the trace's turns per session."""
    saturated = at(scenario, SATURATING_SESSIONS_PER_S, SATURATED_TURNS)
    trace = generate_trace(saturated.workload, saturated.seed)
    finish_s = llmsim.simulate(saturated, trace).requests.query("status == 'finished'")["finish_s"].sort_values()
    until_s = float(finish_s.quantile(0.9))
    turns_per_s = float(((finish_s >= WARMUP_S) & (finish_s <= until_s)).sum()) / (until_s - WARMUP_S)
    return turns_per_s / (len(trace) / (int(trace.session_id.max()) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000, help="turns (default 100,000)")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of each engine's capacity (default 0.8)")
    parser.add_argument("--offload", action="store_true", help="also the prefix cache with CPU offload")
    args = parser.parse_args()
    base = llmsim.load_scenario(SCENARIO)
    for scenario in engines(base, args.offload).values():
        llmsim.simulate(at(scenario, 1.0, 300))
    print(f"{args.requests:,} turns per engine at {args.load:.0%} of its capacity; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'':<32}{'sessions/s':>11}{'wall s':>8}{'CPU s':>8}{'iterations':>11}{'us/iter':>8}{'req/wall s':>11}"
          f"{'req/CPU s':>10}{'vs plain':>9}{'hit rate':>9}")
    plain = None
    for name, scenario in engines(base, args.offload).items():
        rate = args.load * capacity_sessions_per_s(scenario)
        run = at(scenario, rate, args.requests)
        trace = generate_trace(run.workload, run.seed)
        start, start_cpu = time.perf_counter(), time.process_time()
        result = llmsim.simulate(run, trace)
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
        per_wall = len(trace) / wall_s
        plain = plain or per_wall
        summary = summarize(result).to_dict()
        hit = summary["kv_cache"]["hit_rate_tokens"] if "kv_cache" in summary else 0.0
        print(f"{name:<32}{rate:>11.2f}{wall_s:>8.1f}{cpu_s:>8.1f}{len(result.iterations):>11,}"
              f"{cpu_s / len(result.iterations) * 1e6:>8.1f}{per_wall:>11,.0f}{len(trace) / cpu_s:>10,.0f}"
              f"{per_wall / plain:>9.2f}{hit:>9.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.2f} (other processes share the cores: compare ratios)")


if __name__ == "__main__":
    main()
