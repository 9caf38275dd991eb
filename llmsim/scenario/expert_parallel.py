"""``deployment.expert_parallel``: read and checked once (the cost is :mod:`llmsim.cost.experts`'s).

Refusals name the key: a model without routed experts, a degree that is not a multiple of
``tensor_parallel`` (attention runs data parallel over ``degree / tensor_parallel`` ranks) or whose
``num_experts + redundant_experts`` slots do not split evenly over it, redundant experts without balancing,
a group wider than a node without a scale-out bandwidth, a routing histogram that does not count every
expert, and a profile without a measured all-to-all.
"""
from __future__ import annotations

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.models import ModelSpec
from llmsim.config.reader import Node
from llmsim.config.tables import checked_numbers, read_csv_text
from llmsim.cost.experts import (ExpertParallel, HistogramRouting, Routing, UniformRouting, ZipfRouting,
                                 all_to_all_terms, layout_problem)

ROUTINGS = ("uniform", "zipf", "histogram")
HISTOGRAM_COLUMN = "tokens"
MAX_EXPERT_TOKENS = 1e15


def expert_parallel_from_node(node: Node, model: ModelSpec, tensor_parallel: int | None, pipeline_parallel: int | None,
                              hardware: HardwareProfile, engine: str) -> ExpertParallel:
    """``deployment.expert_parallel`` of a scenario whose deployment is ``node``'s parent."""
    degree = node.number("degree", integer=True, minimum=1)
    if tensor_parallel is None or pipeline_parallel is None:
        raise node.key_error("degree", "expert parallelism is placed on the parallelism given, not searched for "
                             "(llmsim report searches layouts)", degree,
                             "deployment.tensor_parallel and pipeline_parallel as integers")
    redundant = node.number("redundant_experts", ExpertParallel.redundant_experts, integer=True, minimum=0,
                            exclusive_minimum=False)
    problem = layout_problem(model, degree, tensor_parallel, redundant)
    if problem is not None:
        raise node.key_error("degree", problem[0], degree, problem[1])
    balance = node.boolean("balance", ExpertParallel.balance)
    if redundant and not balance:
        raise node.key_error("redundant_experts", "redundant experts replicate the hottest experts, which the "
                             "balancer (EPLB) chooses", redundant, "0, or balance: true")
    devices_per_node = node.number("devices_per_node", ExpertParallel.devices_per_node, integer=True, minimum=1)
    scale_out = node.quantity("scale_out_bandwidth", "bandwidth", ExpertParallel.scale_out_bandwidth_bytes_per_s)
    if degree > devices_per_node and not scale_out:
        raise node.key_error("scale_out_bandwidth", f"a group of {degree} GPUs spans nodes of {devices_per_node}: "
                             "the all-to-all crosses the scale-out network", None,
                             "its bandwidth per GPU, e.g. 50 GB/s (one 400 Gb/s InfiniBand NDR port per GPU)")
    routing = _routing(node.child("routing", {}), model)
    node.done()
    if degree > 1 and not all_to_all_terms(hardware, engine):
        raise node.key_error("degree", f"{hardware.name} has no measured all-to-all terms (the profile's "
                             "calibration.database record)", degree,
                             "1, or a profile fitted with llmsim calibrate --from-database")
    if hardware.kernels is None:
        raise node.key_error("degree", f"{hardware.name} has no measured kernel terms to price the experts with",
                             degree, "a profile with a kernels: section")
    return ExpertParallel(degree, redundant, balance, routing, devices_per_node, scale_out)


def _routing(node: Node, model: ModelSpec) -> Routing:
    kind = node.choice("distribution", ROUTINGS, "uniform")
    routing: Routing
    if kind == "zipf":
        routing = ZipfRouting(node.number("exponent", minimum=0.0))
    elif kind == "histogram":
        routing = _histogram(node, model)
    else:
        routing = UniformRouting()
    node.done()
    return routing


def _histogram(node: Node, model: ModelSpec) -> HistogramRouting:
    """A CSV of tokens routed to each expert: a ``tokens`` column, one row per expert in expert order."""
    path = node.path_value("path")

    def fail(message, value, allowed):
        return node.key_error("path", message, value, allowed)
    frame = read_csv_text(path, fail)
    if HISTOGRAM_COLUMN not in frame:
        raise fail(f"CSV {path} has no column {HISTOGRAM_COLUMN!r}", list(frame.columns),
                   f"a header with {HISTOGRAM_COLUMN} (tokens routed to each expert, one row per expert)")
    counts = checked_numbers(frame[HISTOGRAM_COLUMN], f"{path}, column {HISTOGRAM_COLUMN}", fail, minimum=0.0,
                             maximum=MAX_EXPERT_TOKENS)
    if len(counts) != model.num_experts:
        raise fail(f"CSV {path} counts {len(counts)} experts; {model.name} has {model.num_experts}", len(counts),
                   f"{model.num_experts} rows")
    if counts.sum() <= 0:
        raise fail(f"CSV {path} routes no tokens", 0, "at least one expert with tokens > 0")
    return HistogramRouting(tuple(float(c) for c in counts), str(path))
