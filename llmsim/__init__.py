"""llmsim: a discrete-event simulator and capacity planner for LLM inference serving.

The Python API in four calls::

    import llmsim
    scenario = llmsim.load_scenario("scenarios/llama3-8b-h100-chat.yaml")
    result = llmsim.simulate(scenario)
    result.requests          # one row per request (pandas DataFrame)
    llmsim.summarize(result)  # latency percentiles, throughput, goodput, utilisation (to_dict(): nested)
"""
from __future__ import annotations

import importlib

# Each public name and the module that defines it. The names load on first use (PEP 562), so
# `import llmsim` and the command line do not pay for numpy, pandas, scipy and numba up front.
_PUBLIC = {
    "CostModel": "llmsim.cost.roofline",
    "Placement": "llmsim.catalog.placement",
    "place": "llmsim.catalog.placement",
    "smallest_fitting": "llmsim.catalog.placement",
    "ConfigError": "llmsim.errors",
    "HardwareProfile": "llmsim.catalog.hardware",
    "hardware_catalog": "llmsim.catalog.hardware",
    "load_profile": "llmsim.catalog.hardware",
    "lookup_hardware": "llmsim.catalog.hardware",
    "KVCache": "llmsim.sim.kvcache",
    "summarize": "llmsim.analysis.metrics",
    "batch_means": "llmsim.analysis.statistics",
    "RunSummary": "llmsim.analysis.summary",
    "flatten": "llmsim.analysis.summary",
    "ModelSpec": "llmsim.catalog.models",
    "model_catalog": "llmsim.catalog.models",
    "model_from_config_json": "llmsim.catalog.models",
    "plan": "llmsim.search.layout",
    "recommend": "llmsim.search.recommend",
    "Request": "llmsim.sim.request",
    "Scenario": "llmsim.scenario.scenario",
    "load_scenario": "llmsim.scenario.scenario",
    "SimulationResult": "llmsim.sim.result",
    "simulate": "llmsim.sim.simulate",
    "RolloutResult": "llmsim.search.rollout",
    "rollout_summary": "llmsim.search.rollout",
    "simulate_rollout": "llmsim.search.rollout",
    "simulate_replications": "llmsim.search.rollout",
    "run_points": "llmsim.search.sweeps",
    "sweep": "llmsim.search.sweeps",
    "Trace": "llmsim.workload.trace",
    "generate_trace": "llmsim.workload.generate",
    "load_trace": "llmsim.workload.trace_formats",
    "variant": "llmsim.scenario.variants",
    "to_mapping": "llmsim.scenario.writer",
    "FluidModel": "llmsim.analysis.fluid",
    "pareto_frontier": "llmsim.analysis.frontier",
    "cheapest_layouts": "llmsim.search.layout",
    "named_candidates": "llmsim.search.draft_sweep",
    "load_sweep": "llmsim.search.draft_sweep",
    "best_k": "llmsim.search.draft_sweep",
    "ReportBuilder": "llmsim.report.build",
    "traffic_from_trace": "llmsim.report.build",
    "to_html": "llmsim.report.render",
    "to_markdown": "llmsim.report.render",
}

__version__ = "0.1.0"

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'llmsim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
