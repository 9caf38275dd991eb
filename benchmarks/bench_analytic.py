"""The analytic fast path against the simulator: its error, and how fast it evaluates.

For each case (a scenario and loads given as fractions of the capacity the simulator
measures), prints the analytic and simulated mean TTFT and mean TPOT with the relative
error, and the error in the time-averaged requests in the system, the predicted capacity against the
simulated one (throughput of a saturated run, in requests/s), and then evaluations per second (one rate at a
time, and a vector of 1,000 rates at once). Run ``python benchmarks/bench_analytic.py``.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

import llmsim
from llmsim.analysis.fluid import FluidModel
from llmsim.analysis.metrics import summarize
from llmsim.workload.generate import generate_trace

REPO = Path(__file__).resolve().parent.parent
SPEC = {"draft": "Llama-3.2-1B", "policy": "static", "k": 3, "acceptance": {"process": "bernoulli", "alpha": 0.8}}
CASES = {
    "8B H100 chat (plain)": ("scenarios/llama3-8b-h100-chat.yaml", {}),
    "70B 4xH100, budget 2048": ("scenarios/llama3-8b-h100-chat.yaml",
                                {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4},
                                 "engine": {"max_batch_tokens": 2048}}),
    "8B H100 static k=3, alpha 0.8": ("scenarios/llama3-8b-h100-chat.yaml", {"speculation": SPEC}),
    "70B 4xH100 adaptive 80/50, Beta": ("scenarios/llama3-70b-h100-speculative.yaml", {}),
}
FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.85)


def scenario_for(path: str, overrides: dict, rate: float | None = None, requests: int | None = None):
    from llmsim.search.compare import REPLACED_WHOLE
    from llmsim.config.reader import Node, deep_merge, load_yaml
    from llmsim.scenario.scenario import scenario_from_node
    data = deep_merge(load_yaml(REPO / path), overrides, REPLACED_WHOLE)
    if rate is not None:
        data = deep_merge(data, {"workload": {"arrival": {"process": "poisson", "rate": rate}}})
    if requests is not None:
        data = deep_merge(data, {"workload": {"num_requests": requests}})
    return scenario_from_node(Node(data, file=str(REPO / path)))


def like_for_like(scenario) -> FluidModel:
    """The fluid model of the requests the simulator runs (their lengths, not the laws they are drawn from)."""
    return FluidModel(scenario, generate_trace(scenario.workload, scenario.seed))


def simulated_capacity(scenario) -> float:
    """Requests/s a saturated run serves: output tokens/s at 1.5x the predicted capacity over the mean output."""
    model = like_for_like(scenario)
    loaded = replace(scenario, workload=replace(scenario.workload, arrival=replace(
        scenario.workload.arrival, rate_per_s=1.5 * model.capacity())))
    summary = summarize(llmsim.simulate(loaded)).to_dict()
    return summary["throughput"]["output_tokens_per_s"] / model.mean_output


def compare(scenario, fractions=FRACTIONS) -> pd.DataFrame:
    """Analytic vs simulated means at fractions of the simulated capacity."""
    model = like_for_like(scenario)
    capacity = simulated_capacity(scenario)
    rows = []
    for fraction in fractions:
        rate = fraction * capacity
        loaded = replace(scenario, workload=replace(scenario.workload, arrival=replace(
            scenario.workload.arrival, rate_per_s=rate)))
        sim = summarize(llmsim.simulate(loaded)).to_dict()
        pred = model.evaluate(rate).iloc[0]
        row = {"load": fraction, "rate_per_s": rate}
        for name, predicted, simulated in (
                ("ttft_s", pred.ttft_mean_s, sim["latency"]["ttft_s"]["mean"]),
                ("tpot_s", pred.tpot_mean_s, sim["latency"]["tpot_s"]["mean"]),
                ("in_system", pred.in_system, sim["queue"]["mean_in_system"])):
            row[f"{name}_analytic"], row[f"{name}_sim"] = predicted, simulated
            row[f"{name}_error"] = predicted / simulated - 1.0
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame.attrs["capacity_sim"], frame.attrs["capacity_analytic"] = capacity, model.capacity()
    return frame


def speed(scenario) -> tuple[float, float]:
    model = FluidModel(scenario)
    rate = 0.5 * model.capacity()
    model.evaluate(rate)
    start, n = time.perf_counter(), 200
    for _ in range(n):
        model.evaluate(rate)
    single = n / (time.perf_counter() - start)
    rates = np.linspace(0.05, 0.95, 1000) * model.capacity()
    start = time.perf_counter()
    model.evaluate(rates)
    return single, len(rates) / (time.perf_counter() - start)


def main() -> None:
    pd.set_option("display.width", 200)
    for name, (path, overrides) in CASES.items():
        scenario = scenario_for(path, overrides)
        frame = compare(scenario)
        print(f"\n{name}: capacity analytic {frame.attrs['capacity_analytic']:.2f} req/s, "
              f"simulated {frame.attrs['capacity_sim']:.2f} req/s "
              f"({frame.attrs['capacity_analytic'] / frame.attrs['capacity_sim'] - 1:+.1%})")
        shown = frame[["load", "rate_per_s", "ttft_s_analytic", "ttft_s_sim", "ttft_s_error", "tpot_s_analytic",
                       "tpot_s_sim", "tpot_s_error", "in_system_error"]]
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    single, vector = speed(scenario_for(*CASES["8B H100 chat (plain)"]))
    print(f"\nevaluations per second (8B chat): {single:,.0f} one rate at a time, {vector:,.0f} in a vector of 1,000 "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
