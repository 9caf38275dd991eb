"""Expert parallelism: routed experts spread over ranks, attention data parallel, and the busiest rank.

The layout is DeepSeek's and SGLang's/vLLM's wide-EP one: an expert-parallel group of ``degree`` GPUs holds
every routed expert once (``experts_per_rank = (num_experts + redundant_experts) / degree``), while attention,
the dense layers, the shared experts, the router, the embedding and the LM head run tensor parallel over
``tensor_parallel`` GPUs, ``degree / tensor_parallel`` data-parallel ranks of them side by side, each with
its own requests, queue and KV cache. Every MoE layer then costs, on each rank:

- dispatch and combine: two all-to-alls, each sending the rank's tokens' ``top-k`` copies of the hidden
  state (``hidden x top-k x activation bytes`` per token; the share ``(degree - 1) / degree`` leaves the GPU),
  priced by the all-to-all terms fitted to NVIDIA's operator database (nccl-tests timings, the profile's
  ``calibration.database`` record: latency and bus share per group size, the lesser of a small-message and a
  large-message line). Beyond one node (``devices_per_node``) the share of the traffic bound for other nodes
  crosses the scale-out link (``scale_out_bandwidth`` per GPU) while the rest stays on NVLink, concurrently;
- the routed experts' grouped GEMM on the busiest rank, since every rank waits for it before the combine:
  the step's ``A = tokens x top-k`` expert assignments (the rank's tokens times the data-parallel ranks: the
  other ranks are taken to run batches like this one) fall on ranks by a multinomial draw over the ranks'
  shares of the expert popularity, and the busiest rank receives ``E[max_r L_r]`` of them
  (:class:`BusiestRank`, Monte Carlo from the scenario's seed). Its GEMMs are priced as the cost model
  prices routed experts (:mod:`llmsim.cost.kernels`), on whole experts (no tensor split).

Popularity is uniform, Zipf (expert ``i`` of the popularity order drawn with weight ``1 / i^s``) or a
measured histogram of tokens per expert. Without balancing, popularity is independent of where an expert
sits (the experts' order is shuffled with the seed); with ``balance`` (EPLB, DeepSeek's expert-parallel load
balancer) the ``redundant_experts`` extra slots replicate the hottest experts (each replica taking an equal
part of its expert's tokens) and the replicas are packed so that the ranks' shares are as even as a
greedy longest-first packing makes them.

With ``degree`` 1 on one GPU this is the plain MoE cost (``tests/cost/test_experts.py`` checks it).
"""
from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.kernel_terms import AllReduce, KernelTerms
from llmsim.catalog.models import ModelSpec
from llmsim.catalog.placement import Placement
from llmsim.cost.features import F
from llmsim.cost.kernels import gemm_body_s, gemm_output_tiles
from llmsim.cost.roofline import CostModel, DecodeTerms, shared_memo, summed_iteration

LOAD_DRAWS = 1000            # multinomial draws per assignment count of the busiest-rank table
LOAD_GRID_DOUBLINGS = 24     # the table covers 1 .. 2^24 assignments per step (larger: the last ratio)
LOAD_GRID_EXACT = 32         # every count up to this one, then four per doubling (the ratio bends most at few)
ROUTING_STREAM = 31          # the seed's stream for routing draws (apart from the workload's)


# -- popularity of the experts -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class UniformRouting:
    """Every expert equally popular."""
    label = "uniform"

    def popularity(self, num_experts: int) -> np.ndarray:
        return np.full(num_experts, 1.0 / num_experts)


@dataclass(frozen=True)
class ZipfRouting:
    """The ``i``-th most popular expert drawn with weight ``1 / i^exponent``."""
    exponent: float

    @property
    def label(self) -> str:
        return f"zipf {self.exponent:g}"

    def popularity(self, num_experts: int) -> np.ndarray:
        weights = 1.0 / np.arange(1, num_experts + 1, dtype=float) ** self.exponent
        return weights / weights.sum()


@dataclass(frozen=True)
class HistogramRouting:
    """Measured tokens per expert (one count per expert, in expert order)."""
    counts: tuple[float, ...]
    path: str = ""

    @property
    def label(self) -> str:
        return f"histogram {self.path}"

    def popularity(self, num_experts: int) -> np.ndarray:
        counts = np.asarray(self.counts, dtype=float)
        return counts / counts.sum()


Routing = UniformRouting | ZipfRouting | HistogramRouting


@dataclass(frozen=True)
class ExpertParallel:
    """A deployment's expert parallelism (``deployment.expert_parallel``)."""
    degree: int
    redundant_experts: int = 0
    balance: bool = False                     # EPLB: replicate the hottest experts and pack ranks evenly
    routing: Routing = field(default_factory=UniformRouting)
    devices_per_node: int = 8                 # GPUs one NVLink domain holds
    scale_out_bandwidth_bytes_per_s: float = 0.0   # per GPU, between nodes (0: the group fits one node)

    def experts_per_rank(self, model: ModelSpec) -> int:
        return (model.num_experts + self.redundant_experts) // self.degree

    def data_parallel(self, tensor_parallel: int) -> int:
        """Attention data-parallel ranks of one expert-parallel group."""
        return self.degree // tensor_parallel


def layout_problem(model: ModelSpec, degree: int, tensor_parallel: int,
                   redundant_experts: int) -> tuple[str, str] | None:
    """Why ``degree`` GPUs cannot hold ``model``'s experts at ``tensor_parallel`` (message, what is allowed),
    or None."""
    if model.num_experts == 1:
        return (f"{model.name} has no routed experts to spread",
                "a mixture-of-experts model (num_experts > 1), or no expert parallelism")
    if degree % tensor_parallel:
        return (f"must be a multiple of tensor_parallel ({tensor_parallel}): attention runs on degree / "
                "tensor_parallel data-parallel ranks", f"a multiple of {tensor_parallel}")
    slots = model.num_experts + redundant_experts
    if slots % degree:
        fits = [d for d in range(tensor_parallel, slots + 1, tensor_parallel) if slots % d == 0]
        return (f"the {model.name} experts ({model.num_experts}"
                + (f" and {redundant_experts} redundant" if redundant_experts else "")
                + ") do not split evenly over the ranks", ", ".join(map(str, fits)) + " (or other redundant experts)")
    return None


# -- bytes -------------------------------------------------------------------------------------------------------
def all_to_all_bytes_per_token_per_layer(model: ModelSpec, degree: int) -> float:
    """Bytes one token's dispatch sends off its GPU in one MoE layer: its hidden state to each of its top-k
    experts, of which ``(degree - 1) / degree`` live on other ranks (the combine brings as many back)."""
    return model.hidden_size * model.experts_per_token * model.activation_bytes_per_element * (degree - 1) / degree


def weight_bytes_per_device(model: ModelSpec, tensor_parallel: int, pipeline_parallel: int,
                            expert_parallel: ExpertParallel) -> float:
    """Weights on one GPU: everything but the routed experts split over ``tp x pp`` GPUs (attention, dense
    layers, shared experts, router, embedding and LM head, norms), plus the rank's whole experts (redundant
    copies included) of its pipeline stage's share of the MoE layers."""
    routed = model.routed_expert_params * model.expert_bytes_per_param
    others = (model.weight_bytes - routed) / (tensor_parallel * pipeline_parallel)
    experts = (expert_parallel.experts_per_rank(model) * model.expert_params * model.expert_bytes_per_param
               * model.sparse_layers / pipeline_parallel)
    return others + experts


# -- load imbalance ----------------------------------------------------------------------------------------------
def rank_shares(model: ModelSpec, layout: ExpertParallel, seed: int) -> np.ndarray:
    """Each rank's expected share of the expert assignments (summing to 1), as the module docstring places
    the experts."""
    popularity = layout.routing.popularity(model.num_experts)
    per_rank, ranks = layout.experts_per_rank(model), layout.degree
    rng = np.random.default_rng([seed, ROUTING_STREAM])
    if not layout.balance:
        return rng.permutation(popularity).reshape(ranks, per_rank).sum(axis=1)
    replicas = np.ones(model.num_experts)
    for _ in range(layout.redundant_experts):
        hottest = int(np.argmax(popularity / replicas))
        replicas[hottest] += 1
    items = np.repeat(popularity / replicas, replicas.astype(int))
    loads, room = np.zeros(ranks), np.full(ranks, per_rank)
    for item in np.sort(items)[::-1]:
        open_ranks = np.flatnonzero(room > 0)
        rank = open_ranks[np.argmin(loads[open_ranks])]
        loads[rank] += item
        room[rank] -= 1
    return loads


class BusiestRank:
    """``E[max_r L_r]``: the expected assignments of the busiest rank when ``A`` assignments fall on the ranks
    by a multinomial draw over ``shares``, tabulated by Monte Carlo (``LOAD_DRAWS`` draws at every count up to
    ``LOAD_GRID_EXACT``, then at four counts per doubling up to ``2^LOAD_GRID_DOUBLINGS``) and interpolated
    in ``log A``; ``standard_error`` is each point's."""

    def __init__(self, shares: np.ndarray, seed: int):
        self.shares = np.asarray(shares, dtype=float)
        self.assignments, self.mean, self.standard_error = _busiest_table(tuple(self.shares.tolist()), seed)
        self._ratio = self.mean / self.assignments
        self._log_assignments = np.log(self.assignments)

    def load(self, assignments):
        """The busiest rank's expected assignments for ``assignments`` per step (scalar or array)."""
        a = np.asarray(assignments, dtype=float)
        ratio = np.interp(np.log(np.maximum(a, 1.0)), self._log_assignments, self._ratio)
        return a * ratio


@lru_cache(maxsize=64)
def _busiest_table(shares: tuple[float, ...], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, ROUTING_STREAM, 1])
    probabilities = np.asarray(shares) / sum(shares)
    start = math.log2(LOAD_GRID_EXACT)
    assignments = np.unique(np.concatenate([np.arange(1.0, LOAD_GRID_EXACT + 1),
                                            np.round(2.0 ** np.arange(start, LOAD_GRID_DOUBLINGS + 0.125, 0.25))]))
    means, errors = [], []
    for a in assignments:
        busiest = rng.multinomial(int(a), probabilities, size=LOAD_DRAWS).max(axis=1)
        means.append(busiest.mean())
        errors.append(busiest.std(ddof=1) / math.sqrt(LOAD_DRAWS))
    return assignments, np.array(means), np.array(errors)


# -- communication -----------------------------------------------------------------------------------------------
def all_to_all_terms(hardware: HardwareProfile, engine: str) -> dict[int, AllReduce]:
    """The fitted all-to-all lines of ``hardware`` by group size (bus bandwidths in bytes/s), from its
    ``calibration.database`` record for ``engine`` (or any engine's: nccl-tests do not depend on it); empty
    when the profile has none, or a record without the four figures of each group size."""
    record = hardware.calibration.get("database")
    engines = record.get("engines") if isinstance(record, dict) else None
    if not isinstance(engines, dict):
        return {}
    link = hardware.interconnect_bandwidth_bytes_per_s
    for name in (engine, *engines):
        try:
            terms = engines[name]["recorded_only"]["all_to_all"]
            lines = {int(size): AllReduce(float(t["latency_s"]), float(t["bus_share"]) * link,
                                          float(t["large_latency_s"]), float(t["large_bus_share"]) * link)
                     for size, t in terms.items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if lines and all(size >= 2 and all(math.isfinite(v) and v > 0 for v in (
                line.latency_s, line.bus_bandwidth_bytes_per_s, line.large_latency_s,
                line.large_bus_bandwidth_bytes_per_s)) for size, line in lines.items()):
            return lines
    return {}


def all_to_all_time_s(message_bytes, degree: int, terms: dict[int, AllReduce], devices_per_node: int,
                      scale_out_bandwidth_bytes_per_s: float):
    """One all-to-all in which every rank sends ``message_bytes`` (its whole buffer; ``1 / degree`` of it stays
    home). Within a node: the fitted line of the largest measured group not above the node's share of the
    group. Across nodes: the off-node share over the scale-out link, concurrently with the on-node share."""
    message = np.asarray(message_bytes, dtype=float)
    node = min(degree, devices_per_node)
    sizes = sorted(terms)
    line = terms[max([s for s in sizes if s <= node] or sizes[:1])]
    on_node = (node - 1) / degree * message
    intra = np.minimum(line.latency_s + on_node / line.bus_bandwidth_bytes_per_s,
                       line.large_latency_s + on_node / line.large_bus_bandwidth_bytes_per_s)
    if degree <= devices_per_node:
        return intra
    off_node = (degree - node) / degree * message
    return np.maximum(intra, line.large_latency_s + off_node / scale_out_bandwidth_bytes_per_s)


_shared_memos: OrderedDict[bytes, dict[tuple[float, float], float]] = OrderedDict()   # ExpertParallelCostModel's


# -- the cost of a step ------------------------------------------------------------------------------------------
class ExpertParallelCostModel(CostModel):
    """One attention data-parallel rank of an expert-parallel group: the plain cost model of its ``tp x pp``
    GPUs without the routed experts, plus per MoE layer the dispatch and combine all-to-alls and the busiest
    rank's expert GEMMs (the module docstring). Needs measured kernel terms (GEMMs and the all-to-all)."""

    def __init__(self, model: ModelSpec, hardware: HardwareProfile, tensor_parallel: int, pipeline_parallel: int,
                 placement: Placement | None, layout: ExpertParallel, busiest: BusiestRank,
                 all_to_all: dict[int, AllReduce]):
        super().__init__(model, hardware, tensor_parallel, pipeline_parallel, placement, routed_experts=False)
        self.layout, self.busiest, self.all_to_all = layout, busiest, all_to_all
        self.data_parallel = layout.data_parallel(tensor_parallel)
        kernels = self.kernels
        if kernels is None:          # the scenario reader refuses such a profile first, naming the key
            raise ValueError(f"{hardware.name} has no measured kernel terms to price expert parallelism with")
        paced_layers = pipeline_parallel * -(-model.num_layers // pipeline_parallel)
        self._moe_layers = paced_layers * model.sparse_layers / model.num_layers
        inter, hidden = model.expert_intermediate_size, model.hidden_size
        self._shapes = ((2.0 * inter, float(hidden)), (float(hidden), float(inter)))     # gate+up, down
        wb, ab = model.expert_bytes_per_param, model.activation_bytes_per_element
        bandwidth = kernels.gemm_bandwidth_bytes_per_s * (placement.weight_tier.bandwidth_bytes_per_s
                                                          / hardware.tiers[0].bandwidth_bytes_per_s
                                                          if placement else 1.0)
        rate = kernels.gemm_rate(model.weight_dtype)
        self._gemm = [(n * k * wb / bandwidth, (n + k) * ab / bandwidth, 2.0 * n * k / rate, n, k)
                      for n, k in self._shapes]
        quantize = kernels.gemm_quantize_bandwidth_bytes_per_s if wb < 2 else 0.0
        self._quantize_s_per_assignment = sum(k * 3.0 / quantize for _, k in self._shapes) if quantize else 0.0
        self._local_experts = layout.experts_per_rank(model)
        # The factors of _expert_work, read once: the simulator asks for them every iteration.
        self._experts_per_token, self._expert_params = model.experts_per_token, model.expert_params
        self._sparse_layers = model.sparse_layers
        self._expert_bytes_per_iteration = (self._local_experts * model.expert_params * model.expert_bytes_per_param
                                            * model.sparse_layers)
        self._kernels: KernelTerms = kernels
        # Every cost model pricing the MoE layers alike shares one memo (as the plain model's memos are shared).
        key = pickle.dumps((self._gemm, kernels, self._quantize_s_per_assignment, self._local_experts,
                            self._moe_layers, self.data_parallel, tensor_parallel, model, layout, all_to_all,
                            busiest.assignments.tobytes(), busiest.mean.tobytes()))
        self._memo: dict[tuple[float, float], float] = shared_memo(_shared_memos, key, dict)
        self._step_extras: dict[float, tuple[float, float, float]] = {}     # step()'s, by the step's tokens

    def busiest_assignments(self, tokens_per_step):
        """The busiest rank's expert assignments in a step where each data-parallel rank runs
        ``tokens_per_step`` tokens."""
        return self.busiest.load(np.asarray(tokens_per_step, dtype=float) * self.data_parallel
                                 * self.model.experts_per_token)

    def expert_time_s(self, x):
        """Seconds the MoE layers add to iterations ``x`` (the rank's features; one row or many): all-to-alls
        and the busiest rank's expert GEMMs."""
        x = np.asarray(x, dtype=float)
        if x.ndim == 1:
            return self._remembered_s(float(x[F["one"]]), float(x[F["tokens"]]))
        return self._expert_time_s(x[..., F["one"]], x[..., F["tokens"]])

    def _remembered_s(self, iterations: float, tokens: float) -> float:
        """:meth:`_expert_time_s` of one row, remembered (the simulator's batches repeat their token counts)."""
        key = (iterations, tokens)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = float(self._expert_time_s(iterations, tokens))
        return found

    def _expert_time_s(self, iterations, tokens):
        model, kernels = self.model, self._kernels
        iterations, tokens = np.asarray(iterations, dtype=float), np.asarray(tokens, dtype=float)
        per_step = np.divide(tokens, iterations, out=np.zeros(tokens.shape), where=iterations > 0)
        load = self.busiest_assignments(per_step)
        # Experts touched on the busiest rank: as if its load came from uniform routing of load x degree / k
        # tokens over all experts (exactly the plain model's count at degree 1).
        group_tokens = load * self.layout.degree / model.experts_per_token
        touched = np.minimum(self._local_experts * (1.0 - (1.0 - model.experts_per_token / model.num_experts)
                                                    ** group_tokens), self._local_experts)
        rows = np.divide(load, touched, out=np.zeros(load.shape), where=touched > 0)
        gemm_s = np.zeros(load.shape)
        for fixed_s, per_row_s, compute_per_row_s, n, _ in self._gemm:
            body = gemm_body_s(fixed_s + rows * per_row_s, rows * compute_per_row_s, gemm_output_tiles(rows, n),
                               kernels)
            gemm_s = gemm_s + np.where(touched > 0, kernels.gemm_floor_s + touched * body, 0.0)
        gemm_s = gemm_s + load * self._quantize_s_per_assignment
        return iterations * self._moe_layers * (gemm_s + self.all_to_all_time_per_layer_s(per_step))

    def all_to_all_time_per_layer_s(self, tokens_per_step):
        """Dispatch and combine of one MoE layer when the rank runs ``tokens_per_step`` tokens: each of its tp
        GPUs sends its share of the tokens, top-k copies each (a whole buffer, of which
        :func:`all_to_all_bytes_per_token_per_layer` per token leaves the GPU)."""
        degree = self.layout.degree
        tokens = np.asarray(tokens_per_step, dtype=float)
        if degree == 1:
            return np.zeros(tokens.shape)
        leaving = tokens / self.tp * all_to_all_bytes_per_token_per_layer(self.model, degree)
        once = all_to_all_time_s(leaving * degree / (degree - 1), degree, self.all_to_all,
                                 self.layout.devices_per_node, self.layout.scale_out_bandwidth_bytes_per_s)
        return np.where(tokens > 0, 2.0 * once, 0.0)

    def _expert_work(self, tokens, iterations):
        """(FLOPs, bytes) of the rank's own ``tokens`` in ``iterations`` (arrays, or floats on the simulator's
        path) through its routed experts, for the totals iteration() and step() report."""
        flops = tokens * self._experts_per_token * 2.0 * self._expert_params * self._sparse_layers
        return flops, self._expert_bytes_per_iteration * iterations

    def iteration(self, x):
        time_s, flops, moved = super().iteration(x)
        rows = np.asarray(x, dtype=float)
        extra_flops, extra_bytes = self._expert_work(rows[..., F["tokens"]], rows[..., F["one"]])
        return time_s + self.expert_time_s(x), flops + extra_flops, moved + extra_bytes * self.tp

    def step(self, prefill_tokens, prefill_pairs, prefill_kv_read, prefill_logits, decode_seqs,
             decode_kv_read, prefill_padding=0.0, prefill_longest=0.0) -> tuple[float, float, float]:
        """The simulator's per-iteration path (:meth:`CostModel.step`) with the MoE layers' time and work added,
        remembered by the step's tokens (:meth:`_step_extra`): every iteration asks."""
        time_s, flops, moved = CostModel.step(self, prefill_tokens, prefill_pairs, prefill_kv_read, prefill_logits,
                                              decode_seqs, decode_kv_read, prefill_padding, prefill_longest)
        extra = self._remembered_extra(prefill_tokens + decode_seqs)
        return time_s + extra[0], flops + extra[1], moved + extra[2]

    def step_terms(self, tokens: float, logits: int) -> tuple[float, float, float, float, float] | None:
        """The plain model's terms with the MoE layers' time and work as :meth:`step` adds them."""
        terms = super().step_terms(tokens, logits)
        return None if terms is None else (*terms[:2], *self._remembered_extra(tokens))

    def _decode_terms(self, seqs: int, kv_read: float) -> DecodeTerms:
        """The plain model's terms with the MoE layers' time and work as :meth:`step` adds them."""
        row, nonlinear_s, _, _, _ = super()._decode_terms(seqs, kv_read)
        return (row, nonlinear_s, *self._remembered_extra(0.0 + seqs))

    def _remembered_extra(self, tokens: float) -> tuple[float, float, float]:
        """:meth:`_step_extra`, remembered by the step's ``tokens``."""
        extra = self._step_extras.get(tokens)
        if extra is None:
            extra = self._step_extras[tokens] = self._step_extra(float(tokens))
        return extra

    def _step_extra(self, tokens: float) -> tuple[float, float, float]:
        """(seconds, FLOPs, bytes) the MoE layers add to one iteration of ``tokens`` tokens."""
        extra_flops, extra_bytes = self._expert_work(tokens, 1.0)
        return self._remembered_s(1.0, tokens), extra_flops, extra_bytes * self.tp

    def rows_total(self, rows: np.ndarray) -> tuple[float, float, float]:
        """A few iterations together (a speculative step's rows), through :meth:`iteration`."""
        return summed_iteration(self, rows)
