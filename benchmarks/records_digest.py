"""A sha256 digest of the per-request records (and iteration log, controller log, summary) of every
shipped scenario and a set of policy variants, each capped to a few hundred requests.

Run it before and after a refactoring that must not change what the simulator computes, and
compare the two outputs line by line (``diff``): one line per run, ``name  records  other``.

    python benchmarks/records_digest.py > before.txt
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from llmsim.analysis.metrics import summarize
from llmsim.config.limits import MAX_RUN_EVENTS
from llmsim.config.reader import Node
from llmsim.scenario.scenario import scenario_from_node
from llmsim.search.rollout import rollout_summary, simulate_rollout
from llmsim.search.speedup import speedup_over_plain
from llmsim.sim.resources import estimate_run
from llmsim.sim.simulate import simulate

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"

# A KV cache small enough at this load that admission and preemption decide what runs.
TIGHT_KV = {"workload.arrival.rate": 60, "engine.memory_utilization": 0.25, "engine.max_model_len": 8192}

# Variants of shipped scenarios that reach each policy: (name, scenario file, dotted overrides).
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    *[(f"router-{router}", "trace-replay.yaml", {"deployment.router": router})
      for router in ("round_robin", "least_outstanding", "shared_queue")],
    ("router-prefix_aware", "llama3-8b-h100-multiturn-chat.yaml", {"deployment.router": "prefix_aware",
                                                                    "deployment.replicas": 2}),
    *[(f"admission-{mode}", "llama3-8b-h100-chat.yaml", {"engine.admission": mode, **TIGHT_KV})
      for mode in ("preempt", "max_utilization", "guaranteed_no_evict")],
    ("preemption-swap", "llama3-8b-h100-chat.yaml", {"engine.preemption_mode": "swap", **TIGHT_KV}),
    *[(f"classes-{policy}", "llama3-8b-h100-three-classes.yaml", {"engine.scheduling_policy": policy,
                                                                  "workload.arrival.rate": 30})
      for policy in ("fcfs", "priority", "preemptive_priority", "weighted_fair", "edf", "vllm_priority")],
    *[(f"controller-{rule}", "llama3-8b-h100-chat.yaml",
       {"controller": {"rule": rule, "interval": "2 s", "window": "4 s"}, "slo.tpot": "5 ms"})
      for rule in ("practice", "aimd", "pid")],
    ("controller-speculation_k", "llama3-70b-h100-speculative.yaml",
     {"controller": {"knob": "speculation_k", "interval": "2 s", "window": "4 s", "bounds": [0, 4]},
      "speculation.policy": "static", "slo.tpot": "5 ms"}),
    *[(f"k-{policy}", "llama3-70b-h100-speculative.yaml", {"speculation.policy": policy})
      for policy in ("static", "adaptive", "goodput")],
]


def _set(data: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        data = data.setdefault(part, {})
    data[parts[-1]] = value


def _load(file: str, overrides: dict[str, Any], cap: int):
    path = SCENARIOS / file
    data = yaml.safe_load(path.read_text())
    data = copy.deepcopy(data)
    for key, value in overrides.items():
        _set(data, key, value)
    workload = data.setdefault("workload", {})
    if "num_requests" in workload:
        workload["num_requests"] = min(int(workload["num_requests"]), cap)
    scenario = scenario_from_node(Node(data, file=str(path), base_dir=path.parent))
    if estimate_run(scenario).events <= MAX_RUN_EVENTS:
        return scenario
    workload["num_requests"] = cap          # too large to run unasked (a day of traffic): its first requests
    return scenario_from_node(Node(data, file=str(path), base_dir=path.parent))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def digest(file: str, overrides: dict[str, Any], cap: int) -> tuple[str, str]:
    """The records' digest, and one of the iteration log, controller log and summary together."""
    scenario = _load(file, overrides, cap)
    if scenario.rollout is not None:
        rollout = simulate_rollout(scenario, force=True)
        records = rollout.user.requests.to_csv(index=False)
        other = json.dumps(rollout_summary(rollout), sort_keys=True, default=str)
        other += "".join(group.requests.to_csv(index=False) for group in rollout.groups.values())
        return _sha(records), _sha(other)
    result = simulate(scenario, force=True)
    summary = summarize(result).to_dict()
    if scenario.speculating and scenario.controller is None:
        summary["speedup_over_plain"] = speedup_over_plain(result, summary)
    other = result.iterations.to_csv(index=False) + json.dumps(summary, sort_keys=True, default=str)
    if result.control is not None:
        other += result.control.to_csv(index=False)
    return _sha(result.requests.to_csv(index=False)), _sha(other)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=int, default=400, help="at most this many requests per run (default 400)")
    args = parser.parse_args()
    runs = [(path.stem, path.name, {}) for path in sorted(SCENARIOS.glob("*.yaml"))] + VARIANTS
    for name, file, overrides in runs:
        records, other = digest(file, overrides, args.cap)
        print(f"{name:40s} {records} {other}", flush=True)


if __name__ == "__main__":
    main()
