"""The host tier's costs and limits: NVLink-C2C profiles, offload copies in time, swap-in of only
what left the GPU, LRU eviction and refused offloads on a full host tier.

Truths: the datasheets' link figures (900 GB/s bidirectional NVLink-C2C = 450 GB/s each way),
bytes / bandwidth of a KV block computed from the model's shape, and block counts worked out by
hand from what the LRU must evict.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import simpy

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.catalog.hardware import lookup_hardware
from llmsim.cli.render import format_summary
from llmsim.scenario.control import AutoscalingConfig
from llmsim.sim.autoscaling import ReplicaPool, ScalingLog, autoscaler
from llmsim.sim.invariants import InvariantError
from llmsim.sim.prefix_cache import HostTier, PrefixKeys, TieredKV
from llmsim.sim.request import Request
from llmsim.workload.trace import Trace

from tests.helpers import BASE, make_scenario, simulate_checked
from tests.helpers import block_transfer_s

# One direction of each profile's host link as a copy achieves it: the datasheet's link x its efficiency.
HOST_LINK_BYTES_PER_S = {
    "H100-SXM": 63e9 * 0.83,       # PCIe Gen5 x16, 52.8 of 63 GB/s measured
    "GH200": 450e9 * 0.77,         # NVLink-C2C 900 GB/s bidirectional, 346 of 450 GB/s measured
    "GB200": 225e9 * 0.77,         # the same link shared by the superchip's two GPUs
}


@pytest.mark.parametrize("name, host_gb, hbm_gb, hbm_tb_per_s", [("GH200", 480, 144, 4.9), ("GB200", 240, 186, 8.0)])
def test_grace_profiles_reach_host_memory_over_nvlink_c2c(name, host_gb, hbm_gb, hbm_tb_per_s):
    profile = lookup_hardware(name)
    assert profile.host_memory.link.startswith("NVLink-C2C")
    assert profile.host_memory.capacity_bytes == pytest.approx(host_gb * 1e9)
    assert profile.host_memory.link_bandwidth_bytes_per_s == pytest.approx(HOST_LINK_BYTES_PER_S[name])
    assert profile.memory_capacity_bytes == pytest.approx(hbm_gb * 1e9)
    assert profile.memory_bandwidth_bytes_per_s == pytest.approx(hbm_tb_per_s * 1e12)
    # Seven times a PCIe Gen5 x16 link each way (GH200), or half that per GPU (GB200).
    pcie = lookup_hardware("H100-SXM").host_memory.link_bandwidth_bytes_per_s
    assert profile.host_memory.link_bandwidth_bytes_per_s / pcie == pytest.approx(
        450 / 63 * 0.77 / 0.83 * (1 if name == "GH200" else 0.5))


def session(prompts, outputs, arrivals, sessions) -> Trace:
    n = len(prompts)
    return Trace(np.asarray(arrivals, float), np.asarray(prompts), np.asarray(outputs),
                 session_id=np.asarray(sessions), system_prompt_id=np.full(n, -1),
                 system_prompt_tokens=np.zeros(n, np.int64))


@pytest.mark.parametrize("hardware", list(HOST_LINK_BYTES_PER_S))
def test_a_reload_costs_its_bytes_over_each_profiles_link(hardware):
    """Two turns 100 s apart: the second reloads the first's blocks, bytes / link bandwidth before it computes."""
    trace = session([1000, 2200], [200, 200], [0.0, 100.0], [0, 0])
    gpu_only = make_scenario({"hardware": hardware, "engine": {"prefix_caching": True}})
    offload = make_scenario({"hardware": hardware, "engine": {"prefix_caching": True,
                                                              "cpu_offload": {"idle_timeout": "2 s"}}})
    cached, reloaded = simulate(gpu_only, trace), simulate(offload, trace)
    blocks = int(reloaded.requests["reloaded_tokens"][1]) // offload.engine.block_size
    assert blocks == int(cached.requests["cached_tokens"][1]) // offload.engine.block_size > 0
    m = offload.model
    block_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 * offload.engine.block_size
    assert reloaded.requests["ttft_s"][1] - cached.requests["ttft_s"][1] == pytest.approx(
        blocks * block_bytes / HOST_LINK_BYTES_PER_S[hardware], rel=1e-9)


# -- offloads cost their copies --------------------------------------------------------------------

def offload_during_a_decode(overlap: bool | None):
    """Session 0's one turn finishes early; session 1 decodes 2,000 tokens meanwhile. With an offload
    timeout of 1 s session 0's blocks move to host memory while session 1's iterations run."""
    trace = session([1000, 100], [10, 2000], [0.0, 0.0], [0, 1])
    engine = {"prefix_caching": True}
    if overlap is not None:
        engine["cpu_offload"] = {"idle_timeout": "1 s", "overlap": overlap}
    scenario = make_scenario({"engine": engine})
    return scenario, simulate(scenario, trace)


def test_offloads_cost_bytes_over_bandwidth_and_lengthen_iterations_unless_overlapped():
    scenario, gpu_only = offload_during_a_decode(None)
    _, serial = offload_during_a_decode(False)
    _, overlapped = offload_during_a_decode(True)
    size = scenario.engine.block_size
    blocks = (1000 + 10 - 1) // size                     # session 0's full blocks, released idle
    copy_s = block_transfer_s(scenario)
    for result, stall_s in ((serial, blocks * copy_s), (overlapped, 0.0)):
        tiers = result.kv_tiers
        assert tiers.offloaded_blocks == blocks
        assert tiers.offload_s == pytest.approx(blocks * copy_s, rel=1e-12)
        assert tiers.transfer_s == pytest.approx(blocks * copy_s, rel=1e-12)     # nothing else moved
        assert tiers.stall_s == pytest.approx(stall_s, abs=1e-12)
        # Session 1 finishes that much later; its iterations are the GPU-only ones but for one.
        assert result.requests["finish_s"][1] - gpu_only.requests["finish_s"][1] == pytest.approx(stall_s, abs=1e-9)
        longer = result.iterations["duration_s"].to_numpy() - gpu_only.iterations["duration_s"].to_numpy()
        assert np.count_nonzero(np.abs(longer) > 1e-12) == (1 if stall_s else 0)
        assert longer.sum() == pytest.approx(stall_s, abs=1e-9)
    assert blocks * copy_s < gpu_only.iterations["duration_s"].min()     # why overlapping hides it


# -- swap-in copies back only what left the GPU ------------------------------------------------------

@pytest.mark.parametrize("evicted", [0, 4, 11])
def test_swap_in_copies_the_swapped_blocks_no_longer_on_the_gpu(evicted):
    """A request with 179 tokens of KV (11 full blocks of 16 and a partial one) is swapped out; its
    full blocks stay cached on the GPU, idle, tail first in the LRU. Other work then evicts
    ``evicted`` of them. Swapping it back copies 12 - (11 - evicted) blocks and shares the rest."""
    size, blocks = 16, 30
    keys = PrefixKeys(size, np.array([160]), np.array([50]), session_id=np.array([0]))
    kv = TieredKV(blocks, size, keys, HostTier(100), swap=True, block_transfer_s=1e-3)
    request = Request(0, 0.0, 160, 50)
    kv.match(request, 0.0)
    assert kv.admit(request, 160, 0.0)
    request.first_scheduled_s = 0.0
    request.prefilled = 160
    kv.filled(request)
    kv.allocate(2)                                       # its first 19 decoded tokens' KV
    request.blocks += 2
    assert kv.preempt(request, 1.0, 179) == 179          # the engine's preempt: the KV kept, by swap
    assert kv.swapped_out_blocks == 12 and kv.host.swapped == 12
    request.prefill_target, request.prefilled, request.blocks = 180, 179, 0
    kv.allocate(blocks - 11 + evicted)                   # other requests' blocks evict the tail first
    kv.free(blocks - 11 + evicted)
    resident = 11 - evicted
    assert kv.evicted_blocks == evicted
    assert kv.charge(1.0, 0.01) == pytest.approx(0.01 + 12e-3)      # the swap-out's copies, device to host
    kv.match(request, 2.0)
    assert kv.admit(request, 1, 2.0)
    assert kv.swapped_in_blocks == 12 - resident and kv.swap_resident_blocks == resident
    assert kv.host.swapped == 0 and kv.host.allocated_total == kv.host.freed_total == 12
    assert request.blocks == 12 and request.cached_blocks == resident
    assert kv.charge(2.0, 0.01) == pytest.approx(0.01 + (12 - resident) * 1e-3)   # only those copied
    assert kv.allocated_total - kv.freed_total == kv.num_blocks - kv.empty_blocks == 12


# -- a full host tier ----------------------------------------------------------------------------------

def test_a_full_host_tier_evicts_least_recently_used_and_counts_what_it_refuses():
    host = HostTier(3)
    assert host.add([1, 2, 3], 0.0) == 3
    host.lru.move_to_end(1)                              # key 1 reloaded: most recent
    assert host.add([4], 1.0) == 1 and list(host.lru) == [3, 1, 4] and host.evicted == 1
    assert host.add([4], 1.5) == 0 and host.evicted == 1    # already there: no copy, nothing evicted
    assert host.swap_out(2, 2.0) and list(host.lru) == [4] and host.evicted == 3
    assert host.swap_out(1, 2.0) and not host.lru and host.evicted == 4
    assert host.add([5], 3.0) == 0 and host.failed == 1  # pinned swapped KV fills it: refused
    assert not host.swap_out(1, 3.0)
    assert host.allocated_total - host.freed_total == host.held == 3


def test_offloads_refused_by_a_host_tier_full_of_swapped_kv_are_counted_and_reported():
    """An idle block due for offload while host memory holds only swapped KV is dropped: GPU
    accounting stays exact, and the run's summary warns."""
    size = 16
    keys = PrefixKeys(size, np.array([64, 64]), np.array([1, 1]), session_id=np.array([0, 1]))
    kv = TieredKV(20, size, keys, HostTier(4), idle_timeout_s=1.0, swap=True, block_transfer_s=1e-3)
    first, second = Request(0, 0.0, 64, 1), Request(1, 0.0, 64, 1)
    for request in (first, second):
        kv.match(request, 0.0)
        assert kv.admit(request, 64, 0.0)
        request.first_scheduled_s = 0.0
        request.prefilled = 64
        kv.filled(request)
    kv.preempt(second, 0.0, 64)         # 4 blocks pinned: the host tier is full; its GPU blocks idle, due at 1 s
    kv.release(first, 0.5, 64)          # 4 more idle blocks, due at 1.5 s
    kv.advance(2.0)
    assert kv.host.failed == 8 and kv.offloaded_blocks == 0 and not kv.idle and not kv.cached
    assert kv.allocated_total - kv.freed_total == kv.num_blocks - kv.empty_blocks == 0
    assert kv.host.allocated_total - kv.host.freed_total == kv.host.swapped == 4


FULL_HOST_TIER = {"engine": {"prefix_caching": True, "preemption_mode": "swap", "memory_utilization": 0.23,
                              "max_model_len": 8192, "cpu_offload": {"idle_timeout": "10 ms", "capacity": "0.1 GB"}},
                   "workload": {"arrival": {"rate": 30.0}, "num_requests": 300}}


def test_the_summary_says_when_host_memory_refused_kv():
    result = simulate_checked(make_scenario(FULL_HOST_TIER))      # both tiers' accounting, every iteration
    kv = summarize(result).to_dict()["kv_cache"]
    # Five blocks of host memory: long sequences' swaps cannot fit, and offloads meet pinned swapped KV.
    assert kv["offload_failed_blocks"] > 0 and kv["swap_failed_preemptions"] > 0
    assert kv["host_evicted_gb"] == pytest.approx(kv["host_evicted_blocks"] * result.kv_tiers.block_bytes / 1e9)
    text = format_summary(summarize(result).to_dict())
    assert "WARNING: host memory full of swapped KV" in text
    assert (f"{kv['offload_failed_blocks']:,} offloaded blocks dropped, {kv['swap_failed_preemptions']:,} swap "
            "preemptions recomputed instead") in text


def test_the_invariant_checker_watches_the_host_tier():
    broken = []

    def leak_one_host_block(engine, iteration):       # a bug: a host block counted in and never held
        if not broken and engine.kv.host.lru:
            engine.kv.host.allocated_total += 1
            broken.append(iteration.start_s)

    with pytest.raises(InvariantError, match="host tier"):
        simulate_checked(make_scenario(FULL_HOST_TIER), observers=[leak_one_host_block])
    assert broken


# -- prefix-aware routing with a changing replica set ----------------------------------------------

def autoscaled_sessions(router: str):
    """Conversations at 5/s for 25 s, then 0.3/s: the pool of 1-3 replicas grows, then drains one."""
    base = copy.deepcopy(BASE)
    base["workload"].pop("num_requests")
    base["workload"].update(
        duration="60 s",
        arrival={"process": "steps", "rates": [{"at": 0, "rate": "5/s"}, {"at": "25 s", "rate": "0.3/s"}]},
        prompt_tokens={"distribution": "lognormal", "mean": 300, "sigma": 0.6, "max": 2000},
        output_tokens={"distribution": "lognormal", "mean": 100, "sigma": 0.6, "max": 800},
        sessions={"turns": {"distribution": "uniform", "low": 2, "high": 8}, "think_time": "5 s"})
    base["deployment"] = {"replicas": 1, "router": router}
    base["engine"] = {"prefix_caching": True}
    base["autoscaling"] = {"max_replicas": 3, "cold_start": "5 s", "target_outstanding": 8, "interval": "5 s",
                           "sustain": 2}
    return make_scenario(base=base)


def routable_at(log, cold_start_s: float, replicas: int, initial: int):
    """Per replica, the intervals it took new requests in, from the scaling log alone: from a start
    plus the cold start until a drain."""
    opened = dict.fromkeys(range(initial), 0.0)
    intervals = {i: [] for i in range(replicas)}
    for time_s, action in zip(log["time_s"], log["action"]):
        for step in filter(None, action.split("; ")):
            verb, index = step.split()
            index = int(index)
            if verb == "start":
                opened[index] = time_s + cold_start_s
            elif verb == "drain":
                intervals[index].append((opened.pop(index), time_s))
    for index, since in opened.items():
        intervals[index].append((since, np.inf))
    return intervals


@pytest.mark.slow
def test_prefix_aware_routing_follows_an_autoscaled_replica_set():
    results = {router: simulate(autoscaled_sessions(router)) for router in ("least_outstanding", "prefix_aware")}
    aware = results["prefix_aware"]
    actions = " ".join(aware.scaling["action"])
    assert "start" in actions and "drain" in actions and "off" in actions
    # Sessions follow their blocks among the serving replicas (least-outstanding scatters them): a
    # turn goes where the session's previous turn went, beyond sampling error, and finds more cached.
    stays = {}
    for router, result in results.items():
        records = result.requests.sort_values("arrival_s")
        previous = records.groupby("session_id")["replica"].shift()
        later = previous.notna()
        stays[router] = (records["replica"][later] == previous[later]).mean(), int(later.sum())
    (aware_share, n), (least_share, m) = stays["prefix_aware"], stays["least_outstanding"]
    error = math.sqrt(aware_share * (1 - aware_share) / n + least_share * (1 - least_share) / m)
    assert aware_share - least_share > 4 * error
    hits = {router: summarize(r).to_dict()["kv_cache"]["hit_rate_tokens"] for router, r in results.items()}
    assert hits["prefix_aware"] > hits["least_outstanding"]
    # Every request went to a replica taking requests when it arrived: none before its cold start
    # ended, none after its drain (a drained replica's sessions moved to the others).
    intervals = routable_at(aware.scaling, 5.0, 3, 1)
    records = aware.requests
    for replica, arrival_s in zip(records["replica"], records["arrival_s"]):
        assert any(start <= arrival_s <= stop for start, stop in intervals[replica]), (replica, arrival_s)


def test_a_replica_switched_off_forgets_its_kv_and_starts_again_empty():
    # The autoscaler switches a drained replica off at the first check that finds it empty.
    env, off = simpy.Environment(), []
    pool = ReplicaPool(2, 2, switch_off=lambda i, now: off.append((i, now)))
    outstanding = [20, 0]
    config = AutoscalingConfig(min_replicas=1, max_replicas=2, target_outstanding=100, interval_s=1.0, sustain=1,
                               cold_start_s=5.0)
    env.process(autoscaler(env, pool, outstanding, config, ScalingLog()))
    env.run(until=2.5)
    assert pool.routable == [0] and off == [(1, 2.0)]
    # What it forgets: cached GPU blocks (idle once no request holds them) and its host tier.
    size = 16
    keys = PrefixKeys(size, np.array([64, 64, 64]), np.array([1, 1, 1]), session_id=np.array([0, 0, 1]))
    kv = TieredKV(20, size, keys, HostTier(10), idle_timeout_s=1.0)
    first = Request(0, 0.0, 64, 1)
    kv.match(first, 0.0)
    assert kv.admit(first, 64, 0.0)
    first.prefilled = 64
    kv.filled(first)
    kv.release(first, 0.0, 64)
    kv.advance(5.0)                                      # its 4 blocks offloaded
    later = Request(1, 6.0, 64, 1)
    assert kv.cached_prefix(later, 64)[0] == 3           # (the last token is always computed)
    with pytest.raises(RuntimeError):                    # never while a request holds blocks
        busy = Request(2, 6.0, 64, 1)
        kv.match(busy, 6.0)
        kv.admit(busy, 64, 6.0)
        kv.clear(6.0)
    kv.release(busy, 6.0, 0)
    kv.clear(7.0)
    assert kv.cached_prefix(later, 64)[0] == 0 and not kv.cached and not kv.host.lru
    assert kv.allocated_total == kv.freed_total and kv.free_blocks == kv.empty_blocks == kv.num_blocks
    assert kv.host.allocated_total == kv.host.freed_total
