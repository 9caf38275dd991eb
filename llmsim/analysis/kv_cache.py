"""The KV-cache hierarchy's figures: prefix hits, what they saved, host transfers, fragmentation.

From the per-request records (``cached_tokens``, ``reloaded_tokens``: what each request found
cached at its first admission) over the measurement window, and the run's tier totals
(``SimulationResult.kv_tiers``). A *hit* is a request with at least one cached block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from llmsim.analysis.summary import Distribution, Section
from llmsim.sim.result import KVTierTotals


@dataclass(frozen=True)
class KVCacheSummary(Section):
    """Prefix caching, host-tier traffic and block waste of one run (see the module docstring).

    ``hit_rate_tokens``: cached prompt tokens over prompt tokens of the window's admitted requests;
    ``hit_rate_requests``: the share of them with a hit; ``prefill_tokens_saved``: cached tokens, of
    which ``reloaded_tokens`` came back from host memory. ``internal_fragmentation``: the share of
    the KV slots finished requests held at their end that held no token (the unfilled tail of the
    last block). Offload, reload and swap traffic is in GB over the whole run (all devices);
    ``transfer_s`` the host link's busy time over both directions (``offload_s`` of it offloads),
    ``transfer_stall_s`` the iteration time the copies added (0 where they overlapped compute or
    ran while the engine was idle). ``swap_resident_gb``: swapped-out KV still on the GPU at
    swap-in, shared rather than copied back. Host occupancy is per replica, a share of its host
    tier, averaged over time and at its peak; ``host_evicted_blocks``: cached host blocks dropped
    (least recently used first) to make room; ``offload_failed_blocks``: offloads that found no
    room even so (host memory full of swapped KV: the block was dropped);
    ``swap_failed_preemptions``: swap preemptions host memory could not hold (recomputed).
    ``replica_load_max_over_mean``: the busiest replica's requests over the mean (1 = perfectly
    balanced).
    """
    block_size: int
    hit_rate_tokens: float
    hit_rate_requests: float
    prefill_tokens_saved: int
    reloaded_tokens: int
    ttft_hit_s: Distribution
    ttft_miss_s: Distribution
    internal_fragmentation: float
    evicted_blocks: int
    offloaded_gb: float
    reloaded_gb: float
    swapped_out_gb: float
    swapped_in_gb: float
    swap_resident_gb: float
    transfer_s: float
    offload_s: float
    transfer_stall_s: float
    host_occupancy_mean: float
    host_occupancy_max: float
    host_evicted_blocks: int
    host_evicted_gb: float
    offload_failed_blocks: int
    swap_failed_preemptions: int
    replica_load_max_over_mean: float


def kv_cache_summary(tiers: KVTierTotals, steady: pd.DataFrame, finished: pd.DataFrame, records: pd.DataFrame,
                     replicas: int) -> KVCacheSummary:
    """The figures of a run with a tiered KV cache (``tiers``: ``SimulationResult.kv_tiers``)."""
    size = tiers.block_size
    admitted = steady[steady["first_scheduled_s"].notna()]
    prompt = float(admitted["prompt_tokens"].sum())
    cached = admitted["cached_tokens"]
    hit = finished["cached_tokens"] > 0
    kv_tokens = (finished["prompt_tokens"] + finished["output_tokens"] - 1).to_numpy()
    slots = -(-kv_tokens // size) * size
    gb = tiers.block_bytes / 1e9
    host_blocks = tiers.host_blocks
    served = np.bincount(records["replica"][records["replica"] >= 0].to_numpy(), minlength=replicas)
    return KVCacheSummary(
        block_size=size,
        hit_rate_tokens=float(cached.sum()) / prompt if prompt else math.nan,
        hit_rate_requests=float((cached > 0).mean()) if len(admitted) else math.nan,
        prefill_tokens_saved=int(cached.sum()),
        reloaded_tokens=int(admitted["reloaded_tokens"].sum()),
        ttft_hit_s=Distribution.of(finished.loc[hit, "ttft_s"]),
        ttft_miss_s=Distribution.of(finished.loc[~hit, "ttft_s"]),
        internal_fragmentation=float(1 - kv_tokens.sum() / slots.sum()) if slots.sum() else math.nan,
        evicted_blocks=int(tiers.evicted_blocks),
        offloaded_gb=tiers.offloaded_blocks * gb,
        reloaded_gb=tiers.reloaded_blocks * gb,
        swapped_out_gb=tiers.swapped_out_blocks * gb,
        swapped_in_gb=tiers.swapped_in_blocks * gb,
        swap_resident_gb=tiers.swap_resident_blocks * gb,
        transfer_s=float(tiers.transfer_s),
        offload_s=float(tiers.offload_s),
        transfer_stall_s=float(tiers.stall_s),
        host_occupancy_mean=tiers.host_mean_blocks / host_blocks if host_blocks else math.nan,
        host_occupancy_max=tiers.host_max_blocks / host_blocks if host_blocks else math.nan,
        host_evicted_blocks=int(tiers.host_evicted_blocks),
        host_evicted_gb=tiers.host_evicted_blocks * gb,
        offload_failed_blocks=int(tiers.offload_failed_blocks),
        swap_failed_preemptions=int(tiers.swap_failed_preemptions),
        replica_load_max_over_mean=float(served.max() / served.mean()) if served.sum() else math.nan,
    )
