"""Measured kernel terms of a GPU profile (the ``kernels:`` section): what the roofline alone misses.

A profile without this section is priced by the plain roofline (peak x efficiency,
:mod:`llmsim.cost.roofline`). With it, the cost model prices each kernel by the form
that fits measured timings (:mod:`llmsim.cost.kernels` has the formulas):

- ``gemm``: a launch floor, the achieved streaming bandwidth of weights and activations,
  the achieved compute rate per dtype, the sharpness of the smooth maximum of the two, and how the
  shard's output tiles shape it (``occupancy_half_tiles``, ``sharpness_growth``; both optional, 0:
  shape-blind);
- ``elementwise``: RMSNorm, SiLU-and-multiply, rotary embedding and the residual add, each
  a floor plus bytes over its own achieved bandwidth;
- ``all_reduce``: latency and bus bandwidth per group size, for small and for large messages (alpha-beta);
- ``attention``: one launch floor per layer and iteration (optional), decode attention's fixed cost
  per sequence and layer and its KV read rate (optional; else the roofline's), and prefill
  attention's efficiency per backend, rising with the context a query sees;
- ``step``: the growth of the engine's per-iteration overhead (``overhead.per_step``) with the
  sequences that sample (sampling, detokenising, scheduling bookkeeping per sequence).

Every figure is ``{value, source, confidence}``, read with the profile's own machinery.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llmsim.config.reader import Node

ELEMENTWISE_KINDS = ("norm", "activation", "rotary", "residual")


@dataclass(frozen=True)
class StreamKernel:
    """A kernel that streams its operands once, a thread block per token row:
    ``floor_s + bytes / bandwidth_bytes_per_s + row bytes / row_bandwidth_bytes_per_s``. The last term is
    one block working through one row alone (one token: the whole kernel), so it grows with the width."""
    floor_s: float
    bandwidth_bytes_per_s: float
    row_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class AllReduce:
    """One NCCL all-reduce over a group: ``latency + 2 (g - 1) / g x bytes / bus bandwidth`` for each of two
    protocols, small messages (low latency, low bandwidth) and large ones; NCCL picks the faster (the min)."""
    latency_s: float
    bus_bandwidth_bytes_per_s: float
    large_latency_s: float
    large_bus_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class PrefillAttention:
    """One attention backend's prefill: efficiency ``e x L / (L + half_length)`` of the 16-bit peak at mean
    visible context ``L`` per query (short sequences leave the device part idle)."""
    efficiency: float
    half_length_tokens: float


@dataclass(frozen=True)
class KernelTerms:
    gemm_floor_s: float
    gemm_bandwidth_bytes_per_s: float
    gemm_flops_per_s: dict[str, float]            # achieved, by dtype of the weights
    gemm_sharpness: float                         # p of (memory^p + compute^p)^(1/p)
    elementwise: dict[str, StreamKernel]
    all_reduce: dict[int, AllReduce]              # by group size
    decode_attention_per_sequence_s: float
    prefill_backend: str
    prefill_backends: dict[str, PrefillAttention] = field(default_factory=dict)
    step_overhead_per_sequence_s: float = 0.0
    gemm_occupancy_half_tiles: float = 0.0          # output tiles at which compute runs at half the rate
    gemm_sharpness_growth: float = 0.0              # p grows as (tiles / 128)^growth
    attention_floor_s: float = 0.0                  # one attention launch per layer and iteration (0: none)
    decode_attention_bandwidth_bytes_per_s: float = 0.0   # KV read rate of decode attention (0: the roofline's)

    def gemm_rate(self, dtype: str) -> float:
        """Achieved GEMM FLOP/s for weights in ``dtype``; weight-only formats compute in 16-bit."""
        for candidate in (dtype, "bf16", "fp16"):
            if candidate in self.gemm_flops_per_s:
                return self.gemm_flops_per_s[candidate]
        return max(self.gemm_flops_per_s.values())

    def all_reduce_for(self, group: int) -> AllReduce:
        """The measured group size closest to ``group`` from below (the smallest one if none is)."""
        sizes = sorted(self.all_reduce)
        below = [size for size in sizes if size <= group]
        return self.all_reduce[below[-1] if below else sizes[0]]

    @property
    def prefill_attention(self) -> PrefillAttention:
        return self.prefill_backends[self.prefill_backend]


def kernel_terms_from_node(node: Node, figure: Callable[..., float]) -> KernelTerms | None:
    """``kernels:`` of a profile, or None without one; ``figure(node, key, kind, **limits)`` reads a figure."""
    if not node.has("kernels"):
        return None
    kernels = node.child("kernels")
    gemm = kernels.child("gemm")
    rates = gemm.child("achieved_flops")
    flops = {dtype: figure(rates, dtype, "flops") for dtype in list(rates.data)}
    if not flops:
        raise kernels.key_error("gemm.achieved_flops", "needs at least one dtype", {}, "fp16, bf16, fp8")
    rates.done()
    elementwise_node = kernels.child("elementwise")
    elementwise = {}
    for kind in ELEMENTWISE_KINDS:
        entry = elementwise_node.child(kind)
        elementwise[kind] = StreamKernel(figure(entry, "floor", "duration"), figure(entry, "bandwidth", "bandwidth"),
                                         figure(entry, "row_bandwidth", "bandwidth"))
        entry.done()
    elementwise_node.done()
    reduce_node = kernels.child("all_reduce")
    all_reduce = {}
    for key in list(reduce_node.data):
        if not str(key).isdigit() or int(key) < 2:
            raise reduce_node.key_error(str(key), "expected a group size", key, "an integer >= 2 (GPUs in the group)")
        entry = reduce_node.child(key)
        all_reduce[int(key)] = AllReduce(figure(entry, "latency", "duration"), figure(entry, "bus_bandwidth", "bandwidth"),
                                         figure(entry, "large_latency", "duration"),
                                         figure(entry, "large_bus_bandwidth", "bandwidth"))
        entry.done()
    if not all_reduce:
        raise kernels.key_error("all_reduce", "needs at least one group size", {}, "2, 4, 8")
    reduce_node.done()
    attention = kernels.child("attention")
    backends_node = attention.child("prefill_backends")
    backends = {}
    for name in list(backends_node.data):
        entry = backends_node.child(name)
        backends[str(name)] = PrefillAttention(
            figure(entry, "efficiency", None, minimum=0.0, maximum=1.0, exclusive_minimum=True),
            figure(entry, "half_length", None, minimum=0.0, exclusive_minimum=False))
        entry.done()
    backends_node.done()
    backend = attention.choice("prefill_backend", tuple(backends) or ("(none given)",))
    step = kernels.child("step")
    terms = KernelTerms(
        gemm_floor_s=figure(gemm, "floor", "duration", minimum=0.0, exclusive_minimum=False),
        gemm_bandwidth_bytes_per_s=figure(gemm, "bandwidth", "bandwidth"),
        gemm_flops_per_s=flops,
        gemm_sharpness=figure(gemm, "sharpness", None, minimum=1.0, exclusive_minimum=False),
        elementwise=elementwise, all_reduce=all_reduce,
        decode_attention_per_sequence_s=figure(attention, "decode_per_sequence", "duration", minimum=0.0,
                                               exclusive_minimum=False),
        prefill_backend=backend, prefill_backends=backends,
        step_overhead_per_sequence_s=figure(step, "per_sequence", "duration", minimum=0.0,
                                            exclusive_minimum=False),
        gemm_occupancy_half_tiles=_optional(gemm, "occupancy_half_tiles", figure),
        gemm_sharpness_growth=_optional(gemm, "sharpness_growth", figure),
        attention_floor_s=_optional(attention, "floor", figure, "duration"),
        decode_attention_bandwidth_bytes_per_s=_optional(attention, "decode_bandwidth", figure, "bandwidth"))
    for done in (gemm, attention, step):
        done.done()
    kernels.done(extra_allowed=("note",))
    return terms


def _optional(node: Node, key: str, figure: Callable[..., float], kind: str | None = None) -> float:
    """A non-negative figure that profiles written before it existed leave out (0: its old form)."""
    return figure(node, key, kind, minimum=0.0, exclusive_minimum=False) if node.has(key) else 0.0
