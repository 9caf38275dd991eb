"""Where a model lives: which memory tier holds the weights and the KV cache, on how many devices.

A device has one or more memory tiers (on-chip SRAM, HBM, an outer store such as host
DDR or Cerebras MemoryX), innermost first. The weights are split over ``tp x pp``
devices and placed in the innermost tier that holds a device's share; activations
always use the primary (innermost) tier. What the primary tier has left becomes KV
cache, unless ``kv_spill`` puts the KV cache in the first outer tier instead. When the
weights only fit an outer tier they are streamed from it on every iteration (weight
streaming), and the cost model reads them at that tier's bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from llmsim.catalog.hardware import HardwareProfile, MemoryTier
from llmsim.catalog.models import ModelSpec


@dataclass(frozen=True)
class Placement:
    """How one replica's devices hold a model (all sizes per device unless named otherwise)."""
    tensor_parallel: int
    pipeline_parallel: int
    weight_tier: MemoryTier
    weight_tier_index: int
    kv_tier: MemoryTier
    kv_tier_index: int
    capacity_per_device_bytes: float          # of the primary tier
    usable_per_device_bytes: float
    weights_per_device_bytes: float
    activation_reserve_per_device_bytes: float
    kv_per_device_bytes: float
    kv_bytes_per_token_per_device: float
    block_size: int
    num_blocks: int

    @property
    def devices(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    @property
    def weight_streaming(self) -> bool:
        return self.weight_tier_index > 0

    def concurrent_sequences(self, context_tokens: int) -> int:
        """How many sequences of ``context_tokens`` tokens the KV cache holds at once."""
        return self.num_blocks // math.ceil(context_tokens / self.block_size)


def place(model: ModelSpec, hardware: HardwareProfile, tensor_parallel: int, pipeline_parallel: int,
          memory_utilization: float, block_size: int, max_batch_tokens: int,
          runtime_reserve_bytes: float, kv_spill: bool = False, draft: ModelSpec | None = None,
          draft_tensor_parallel: int = 1, weights_per_device_bytes: float | None = None) -> Placement:
    """Place weights, activations and KV cache on ``tp x pp`` devices of ``hardware``.

    The activation reserve is the peak working set of one iteration of
    ``max_batch_tokens`` tokens (hidden states, QKV, MLP intermediates) plus a fixed
    runtime reserve (CUDA context, communication buffers), the way vLLM profiles
    memory before sizing its KV cache.

    A speculative ``draft`` model colocated on the same devices (sharded over
    ``draft_tensor_parallel`` of them) adds its weights, and its own KV cache for every
    token the target holds: a KV block then stands for the same tokens in both models.
    The device holding the first draft shard is the fullest, so its room sizes the cache.
    ``weights_per_device_bytes`` replaces the even split of the weights where the layout is not even
    (expert parallelism: :func:`llmsim.cost.experts.weight_bytes_per_device`).
    """
    devices = tensor_parallel * pipeline_parallel
    tiers = hardware.tiers
    usable = [tier.capacity_bytes * memory_utilization for tier in tiers]
    weights = model.weight_bytes / devices if weights_per_device_bytes is None else weights_per_device_bytes
    if draft is not None:
        weights += draft.weight_bytes / draft_tensor_parallel
    ab = model.activation_bytes_per_element
    per_token_activations = (4 * model.hidden_size + (model.q_dim + 2 * model.kv_dim) / tensor_parallel
                             + 3 * model.intermediate_size / tensor_parallel) * ab
    activations = max_batch_tokens * per_token_activations + runtime_reserve_bytes
    free = list(usable)
    free[0] -= activations
    weight_index = next((i for i, room in enumerate(free) if weights <= room), 0)
    free[weight_index] -= weights
    kv_index = 1 if kv_spill and len(tiers) > 1 else 0
    kv_bytes = max(free[kv_index], 0.0)
    layers_per_stage = math.ceil(model.num_layers / pipeline_parallel)
    kv_per_token = (layers_per_stage * model.kv_elements_per_token_per_layer(tensor_parallel)
                    * model.kv_bytes_per_element)
    if draft is not None:
        kv_per_token += (draft.num_layers * draft.kv_elements_per_token_per_layer(draft_tensor_parallel)
                         * draft.kv_bytes_per_element)
    fits = weights <= usable[weight_index] - (activations if weight_index == 0 else 0.0)
    num_blocks = int(kv_bytes // (kv_per_token * block_size)) if fits else 0
    return Placement(tensor_parallel, pipeline_parallel, tiers[weight_index], weight_index, tiers[kv_index],
                     kv_index, tiers[0].capacity_bytes, usable[0], weights, activations, kv_bytes, kv_per_token,
                     block_size, num_blocks)


def smallest_fitting(model: ModelSpec, hardware: HardwareProfile, memory_utilization: float, block_size: int,
                     max_batch_tokens: int, runtime_reserve_bytes: float, tensor_parallel: int | None = None,
                     pipeline_parallel: int | None = None, kv_spill: bool = False,
                     min_kv_tokens: int = 1, draft: ModelSpec | None = None,
                     draft_tensor_parallel: int | None = None) -> Placement | None:
    """The fewest devices (fixing tp or pp where given) whose primary tier holds the weights
    and a KV cache of at least ``min_kv_tokens`` tokens (one longest request, say).

    Tensor parallelism must divide the attention heads and pipeline stages cannot
    outnumber the layers; among equal device counts the smaller tp is preferred
    (fewer all-reduces). A colocated ``draft`` counts too (sharded like the target, or over
    ``draft_tensor_parallel`` devices where given and not more than tp). None when nothing fits.
    """
    tps = [tensor_parallel] if tensor_parallel else [t for t in range(1, model.num_heads + 1)
                                                      if model.num_heads % t == 0]
    pps = [pipeline_parallel] if pipeline_parallel else range(1, model.num_layers + 1)
    options = sorted((tp * pp, tp, pp) for tp in tps for pp in pps)
    for _, tp, pp in options:
        draft_tp = 1
        if draft is not None:
            draft_tp = min(draft_tensor_parallel or tp, tp)
            if draft.num_heads % draft_tp:
                continue
        candidate = place(model, hardware, tp, pp, memory_utilization, block_size, max_batch_tokens,
                          runtime_reserve_bytes, kv_spill, draft, draft_tp)
        if candidate.fits and not candidate.weight_streaming and candidate.kv_capacity_tokens >= min_kv_tokens:
            return candidate
    return None
