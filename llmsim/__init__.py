"""llmsim: a discrete-event simulator and capacity planner for LLM inference serving.

The Python API in four calls::

    import llmsim
    scenario = llmsim.load_scenario("scenarios/llama3-8b-h100-chat.yaml")
    result = llmsim.simulate(scenario)
    result.requests          # one row per request (pandas DataFrame)
    llmsim.summarize(result)  # latency percentiles, throughput, goodput, utilisation (to_dict(): nested)
"""
from llmsim.analysis.metrics import summarize
from llmsim.cost.roofline import CostModel
from llmsim.catalog.placement import Placement, place, smallest_fitting
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import HardwareProfile, hardware_catalog, load_profile, lookup_hardware
from llmsim.sim.kvcache import KVCache
from llmsim.analysis.statistics import batch_means
from llmsim.analysis.summary import RunSummary, flatten
from llmsim.catalog.models import ModelSpec, model_catalog, model_from_config_json
from llmsim.search.plan import plan
from llmsim.search.recommend import recommend
from llmsim.sim.request import Request
from llmsim.scenario.scenario import Scenario, load_scenario
from llmsim.sim.result import SimulationResult
from llmsim.sim.simulate import simulate
from llmsim.search.rollout import RolloutResult, rollout_summary, simulate_rollout
from llmsim.search.sweeps import run_points, sweep
from llmsim.workload.trace import Trace
from llmsim.workload.generate import generate_trace

__version__ = "0.1.0"

__all__ = ["CostModel", "Placement", "place", "smallest_fitting", "ConfigError", "HardwareProfile", "hardware_catalog",
           "load_profile", "lookup_hardware", "KVCache", "batch_means", "flatten", "summarize", "RunSummary",
           "ModelSpec", "model_catalog", "model_from_config_json", "Request", "Scenario", "load_scenario",
           "SimulationResult", "simulate", "run_points", "sweep", "Trace", "generate_trace", "plan", "recommend",
           "RolloutResult", "rollout_summary", "simulate_rollout"]
