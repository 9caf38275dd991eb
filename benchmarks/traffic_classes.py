"""The figures of the traffic-classes guide (docs/guides/classes.md): the shipped three-class scenario under each
scheduling policy (per-class table), and the adaptive controller against static settings on one
diurnal trace (time over the SLO, and a plot).

Usage: ``python benchmarks/traffic_classes.py [--plot docs/images/controller_diurnal.png]``. Every run is
the same trace (common random numbers): only the policy or the controller differs.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

from llmsim import load_scenario, simulate
from llmsim.analysis.metrics import summarize
from llmsim.analysis.plots import controller_timeline
from llmsim.analysis.rolling import rolling_worst_ratio, time_over_slo
from llmsim.cli.render import class_table
from llmsim.config.reader import Node, deep_merge
from llmsim.scenario.scenario import scenario_from_node
from llmsim.scenario.variants import POLICY_KEY, variant

REPO = Path(__file__).resolve().parent.parent
THREE_CLASSES = REPO / "scenarios" / "llama3-8b-h100-three-classes.yaml"
POLICIES = ("fcfs", "priority", "preemptive_priority", "weighted_fair", "edf")

# Long prompts make prefill chunks the cause of slow decode steps, so max_batch_tokens matters.
DIURNAL = {
    "name": "controller-diurnal", "seed": 3, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
    "engine": {"max_model_len": 16384, "max_batch_tokens": 8192},
    "workload": {"arrival": {"process": "diurnal", "rate": "3.4/s", "amplitude": 0.5, "period": "300 s",
                             "peak": "150 s"},
                 "duration": "900 s",
                 "prompt_tokens": {"distribution": "lognormal", "mean": 4000, "sigma": 0.5, "max": 12000},
                 "output_tokens": {"distribution": "lognormal", "mean": 200, "sigma": 0.5, "max": 1024}},
    "slo": {"ttft": "2 s", "tpot": "50 ms"},
    "simulation": {"warmup": "0 s"},
}
CONTROL = {"interval": "5 s", "window": "10 s", "hysteresis": 0.5, "bounds": [1024, 8192]}
WINDOW_S, STEP_S = 10.0, 5.0


def with_changes(source: dict, changes: dict, base_dir: Path):
    return scenario_from_node(Node(deep_merge(copy.deepcopy(source), changes), file="<benchmark>", base_dir=base_dir))


def policy_tables() -> None:
    base = load_scenario(THREE_CLASSES)
    for policy in POLICIES:
        result = simulate(variant(base, {POLICY_KEY: policy}))
        summary = summarize(result).to_dict()
        print(f"\n{policy}: {summary['throughput']['requests_per_s']:.2f} req/s served, "
              f"preemptions {summary['requests']['preemptions']}, every class's SLO met: {summary['slo']['met']}")
        print(class_table(summary["classes"]))


def controller_runs(plot: Path | None) -> None:
    runs = {}
    for label, changes in [("static 8192", {}), ("static 2048", {"engine": {"max_batch_tokens": 2048}}),
                           ("static 1024", {"engine": {"max_batch_tokens": 1024}}),
                           ("practice", {"controller": {"rule": "practice", **CONTROL}}),
                           ("aimd", {"controller": {"rule": "aimd", **CONTROL}}),
                           ("pid", {"controller": {"rule": "pid", "kp": 4.0, "ki": 0.3, **CONTROL}})]:
        result = simulate(with_changes(DIURNAL, changes, REPO / "scenarios"))
        runs[label] = result
        summary = summarize(result).to_dict()
        rolling = rolling_worst_ratio(result.requests, result.scenario.slo, (), WINDOW_S, STEP_S, 0.0,
                                      result.arrival_window_s)
        changes_made = 0 if result.control is None else int(result.control["changed"].sum())
        print(f"{label:<12} over SLO {time_over_slo(rolling, STEP_S):>5.0f} s   attainment "
              f"{100 * summary['slo']['attainment']:5.1f}%   "
              f"TTFT p95 {1e3 * summary['latency']['ttft_s']['p95']:6.0f} ms"
              f"   TPOT p95 {1e3 * summary['latency']['tpot_s']['p95']:5.1f} ms   knob changes {changes_made}")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        shown = {k: runs[k] for k in ("static 8192", "static 1024", "practice", "pid")}
        print("wrote", controller_timeline(shown, plot, WINDOW_S, STEP_S))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=None, help="write the controller plot here")
    args = parser.parse_args()
    policy_tables()
    print()
    controller_runs(args.plot)


if __name__ == "__main__":
    main()
