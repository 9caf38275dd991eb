"""llmsim: a discrete-event simulator and capacity planner for LLM inference serving.

The Python API in four calls::

    import llmsim
    scenario = llmsim.load_scenario("scenarios/llama3-8b-h100-chat.yaml")
    result = llmsim.simulate(scenario)
    result.requests          # one row per request (pandas DataFrame)
    result.summary()         # latency percentiles, throughput, goodput, utilisation
"""
from .costmodel import CostModel
from .placement import Placement, place, smallest_fitting
from .errors import ConfigError
from .hardware import HardwareProfile, hardware_catalog, load_profile, lookup_hardware
from .kvcache import KVCache
from .metrics import batch_means, flatten, summarize
from .models import ModelSpec, model_catalog, model_from_config_json
from .planning import plan
from .recommendation import recommend
from .request import Request
from .scenario import Scenario, load_scenario
from .simulation import SimulationResult, simulate
from .sweeps import run_points, sweep
from .workload import Trace, generate_trace

__version__ = "0.1.0"

__all__ = ["CostModel", "Placement", "place", "smallest_fitting", "ConfigError", "HardwareProfile", "hardware_catalog",
           "load_profile", "lookup_hardware", "KVCache", "batch_means", "flatten", "summarize", "ModelSpec",
           "model_catalog", "model_from_config_json", "Request", "Scenario", "load_scenario",
           "SimulationResult", "simulate", "run_points", "sweep", "Trace", "generate_trace", "plan", "recommend"]
