"""The KV-cache hierarchy: prefix caching, host tier, swap, against independent truths.

Block accounting per tier is checked after every iteration by an observer; hit rates
against the workload's own repeats (token content rebuilt from the trace), the textbook
LRU results (cyclic access, stack distances), and TTFTs against the cost model's prefill
and the host link's bytes / bandwidth.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import yaml

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.sim.prefix_cache import PrefixKeys, TieredKV
from llmsim.sim.request import Request
from llmsim.workload.trace import Trace
from llmsim.workload.generate import generate_trace

from tests.helpers import BASE, make_scenario, merge, block_transfer_s

SESSIONS = {"workload": {
    "arrival": {"process": "poisson", "rate": 1.0}, "num_requests": 300,
    "prompt_tokens": {"distribution": "lognormal", "mean": 150, "sigma": 0.6, "max": 1500},
    "output_tokens": {"distribution": "lognormal", "mean": 100, "sigma": 0.6, "max": 800},
    "sessions": {"turns": {"distribution": "uniform", "low": 1, "high": 8}, "think_time": "15 s",
                 "system_prompt": {"tokens": 700, "share": 0.6, "variants": 3}}}}


def tiers_observer(engine, iteration) -> None:
    """Exact block accounting of both tiers (pp = 1: one engine per cache)."""
    kv = engine.kv
    running = list(engine.running.values())
    private = sum(engine.decode.blocks(r) - r.cached_blocks for r in running)
    assert kv.allocated_total - kv.freed_total == kv.num_blocks - kv.empty_blocks == private + len(kv.cached)
    assert sum(kv.cached.values()) == sum(r.cached_blocks for r in running)
    for r in running:
        assert all(kv.cached[key] > 0 for key in r.prefix_keys[:r.cached_blocks])
    assert set(kv.idle) == {key for key, refs in kv.cached.items() if refs == 0}
    assert kv.free_blocks == kv.empty_blocks + len(kv.idle)
    host = kv.host
    if host is not None:
        swapped = sum(-(-r.swapped_tokens // kv.block_size) for r in engine.queue)
        assert host.swapped == swapped
        assert host.allocated_total - host.freed_total == len(host.lru) + swapped <= host.capacity_blocks


# Memory pressure: eviction, offload, reload, swap out and in and sharing all happen.
PRESSED = {**SESSIONS, "engine": {
    "prefix_caching": True, "preemption_mode": "swap", "memory_utilization": 0.25,
    "max_model_len": 8192, "cpu_offload": {"idle_timeout": "100 ms", "capacity": "1 GB"}},
    "workload": {**SESSIONS["workload"], "arrival": {"process": "poisson", "rate": 10.0}, "num_requests": 600,
                 "sessions": {**SESSIONS["workload"]["sessions"], "think_time": "4 s"}}}


def test_block_accounting_exact_across_tiers_and_transitions():
    """Memory pressure: eviction, offload, reload, swap out and in and sharing all happen."""
    scenario = make_scenario(PRESSED)
    result = simulate(scenario, observers=[tiers_observer])
    tiers = result.kv_tiers
    for moved in ("hit_blocks", "evicted_blocks", "offloaded_blocks", "reloaded_blocks", "swapped_out_blocks",
                  "host_evicted_blocks"):
        assert getattr(tiers, moved) > 0, moved
    # All finished, so all came back: copied, or found still on the GPU and shared.
    assert tiers.swapped_in_blocks + tiers.swap_resident_blocks == tiers.swapped_out_blocks
    assert result.kv_allocated_blocks == result.kv_freed_blocks + result.kv_held_blocks
    assert result.kv_held_blocks == tiers.cached_blocks                # only idle cached blocks remain
    assert tiers.host_allocated_blocks == tiers.host_freed_blocks + tiers.host_held_blocks
    occupancy = tiers.host_occupancy["blocks"]          # over time: ends where the tier ends, never above it
    assert occupancy.iloc[-1] == tiers.host_held_blocks and occupancy.max() == tiers.host_max_blocks \
        <= tiers.host_blocks
    records = result.requests
    assert (records["status"] == "finished").all()
    assert (records["generated_tokens"] == records["output_tokens"]).all()
    assert int(result.iterations["tokens_out"].sum()) == int(records["generated_tokens"].sum())


class ScanningKV(TieredKV):
    """The reference: ``advance`` scans the idle blocks at every iteration, not only from ``offload_due_s`` on,
    and checks that the bound it skips before holds: where it would have skipped, nothing was due."""
    skipped = 0

    def advance(self, now: float) -> None:
        would_skip = now < self.offload_due_s
        self.offload_due_s = -math.inf
        idle = list(self.idle.items())
        super().advance(now)
        if would_skip:
            assert list(self.idle.items()) == idle
            ScanningKV.skipped += 1


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_offloads_looked_for_only_from_the_earliest_due_time_are_those_a_scan_at_every_iteration_finds(
        monkeypatch, micro_batches):
    """``advance`` returns at once before ``offload_due_s``: the run is the one whose every iteration scans the idle
    blocks (records, iteration log, every tier total and the host tier's occupancy over time), under pressure; also
    with two pipeline micro-batches' engines sharing each cache."""
    scenario = make_scenario(merge(PRESSED, {"deployment": {"pipeline_parallel": micro_batches}}))
    bounded = simulate(scenario)
    monkeypatch.setattr("llmsim.sim.simulate.TieredKV", ScanningKV)
    monkeypatch.setattr(ScanningKV, "skipped", 0)
    scanned = simulate(scenario)
    assert ScanningKV.skipped > len(scanned.iterations) / 2          # the bound skips most iterations' scans
    pd.testing.assert_frame_equal(bounded.requests, scanned.requests)
    pd.testing.assert_frame_equal(bounded.iterations, scanned.iterations)
    for name, value in vars(bounded.kv_tiers).items():
        other = getattr(scanned.kv_tiers, name)
        if isinstance(value, pd.DataFrame):
            pd.testing.assert_frame_equal(value, other)
        else:
            assert value == other, name
    assert bounded.kv_tiers.offloaded_blocks > 0


def _streams(trace: Trace) -> list[list]:
    """Each request's token stream, rebuilt from the trace as the workload defines it: its session's
    system prompt, then each turn's new input and output (tokens named by where they come from)."""
    streams, history = [], {}
    for i in range(len(trace)):
        session, prompt, output = int(trace.session_id[i]), int(trace.prompt_tokens[i]), int(trace.output_tokens[i])
        if session not in history:
            template, system = int(trace.system_prompt_id[i]), int(trace.system_prompt_tokens[i])
            history[session] = [("system", template, p) for p in range(system)]
        tokens = history[session]
        new = prompt - len(tokens)
        assert new >= 1
        tokens = tokens + [("input", i, p) for p in range(new)] + [("output", i, p) for p in range(output)]
        history[session] = tokens
        streams.append(tokens)
    return streams


def repeat_tokens(trace: Trace, block_size: int) -> np.ndarray:
    """Per request, the prompt tokens in leading full blocks whose whole prefix (block content and
    everything before it, hashed as a chain over the blocks' tokens) some earlier request held in KV
    (its prompt and output but the last token), never the prompt's last token, which must be computed."""
    seen, repeats = set(), []
    for i, tokens in enumerate(_streams(trace)):
        prompt, held = int(trace.prompt_tokens[i]), int(trace.prompt_tokens[i]) + int(trace.output_tokens[i]) - 1
        chain, prefix = [], None
        for j in range(held // block_size):
            prefix = hash((prefix, tuple(tokens[j * block_size:(j + 1) * block_size])))
            chain.append(prefix)
        hits = 0
        while hits < (prompt - 1) // block_size and chain[hits] in seen:
            hits += 1
        repeats.append(hits * block_size)
        seen.update(chain)
    return np.array(repeats)


@pytest.mark.parametrize("block_size", [16, 128])
def test_unbounded_cache_hit_rate_is_the_workloads_repeat_share(block_size):
    """Requests one after another (no overlap) on a cache that never evicts: every repeat hits."""
    scenario = make_scenario({**SESSIONS, "engine": {"prefix_caching": True, "block_size": block_size}})
    trace = generate_trace(scenario.workload, scenario.seed)
    trace = replace(trace, arrival_s=np.arange(len(trace)) * 30.0)
    result = simulate(scenario, trace)
    assert result.kv_tiers.evicted_blocks == 0
    expected = repeat_tokens(trace, block_size)
    assert expected.sum() > 0.3 * trace.prompt_tokens.sum()             # the workload does repeat itself
    assert (result.requests["cached_tokens"].to_numpy() == expected).all()
    assert summarize(result).to_dict()["kv_cache"]["hit_rate_tokens"] == pytest.approx(
        expected[result.requests["arrival_s"] >= result.warmup_s].sum()
        / trace.prompt_tokens[result.requests["arrival_s"] >= result.warmup_s].sum())


# -- the cache alone, driven as the engine drives it ---------------------------------------------------

def serve(kv: TieredKV, request: Request, now: float) -> int:
    """Admit ``request`` whole, compute its prompt, finish it after one token; its hit blocks."""
    kv.advance(now)
    kv.match(request, now)
    assert kv.admit(request, request.prefill_target - request.prefilled, now)
    request.first_scheduled_s = now
    hits = request.cached_blocks
    request.prefilled = request.prefill_target
    kv.filled(request)
    kv.release(request, now, request.prompt_tokens + request.output_tokens - 1)
    return hits


def documents_cache(capacity: int, documents: np.ndarray, block_size: int = 16) -> TieredKV:
    """A GPU cache that keeps ``capacity`` one-block documents (one more block for the computed
    token), serving requests whose prompt is document ``documents[i]`` plus one token."""
    n = len(documents)
    keys = PrefixKeys(block_size, np.full(n, block_size + 1), np.ones(n, np.int64), session_id=documents)
    return TieredKV(capacity + 1, block_size, keys)


def run_documents(capacity: int, documents: np.ndarray) -> np.ndarray:
    kv = documents_cache(capacity, documents)
    return np.array([serve(kv, Request(i, float(i), 17, 1), float(i)) for i in range(len(documents))])


@pytest.mark.parametrize("capacity", [1, 4, 32])
def test_cyclic_access_over_more_blocks_than_lru_holds_always_misses(capacity):
    cycle = np.arange(10 * (capacity + 1)) % (capacity + 1)
    assert run_documents(capacity, cycle).sum() == 0
    # The same cycle over exactly the capacity misses only on the first pass.
    fitting = np.arange(10 * capacity) % capacity
    assert run_documents(capacity, fitting).sum() == len(fitting) - capacity


def stack_distance_references(rng: np.random.Generator, n: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """References drawn by LRU stack depth: depth ``d`` >= 1 with probability p (1-p)^(d-1); a depth
    below the stack reaches a new document. Returns (documents, stack distances; 0 for new)."""
    stack, documents, distances = [], [], []
    for depth in rng.geometric(p, n):
        if depth <= len(stack):
            document = stack.pop(depth - 1)
        else:
            document, depth = len(documents) + 10**6, 0
        stack.insert(0, document)
        documents.append(document)
        distances.append(depth)
    return np.array(documents), np.array(distances)


@pytest.mark.parametrize("capacity", [2, 8, 24])
def test_stack_distance_workload_follows_the_lru_curve(capacity):
    p = 0.1
    documents, distances = stack_distance_references(np.random.default_rng(5), 3000, p)
    hits = run_documents(capacity, documents)
    # LRU hits a reference exactly when its stack distance is within the capacity ...
    assert ((hits == 1) == ((distances >= 1) & (distances <= capacity))).all()
    # ... so its hit rate follows the stack-distance curve P(d <= C) = 1 - (1 - p)^C, within sampling error
    # (new documents, drawn once the stack is shorter than the depth, only at the start).
    expected = 1 - (1 - p) ** capacity
    rate = hits[500:].mean()
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / len(hits[500:]))


# -- what a hit and a reload cost -------------------------------------------------------------------

def two_turns(engine: dict):
    """Two turns of one session, 100 s apart: 1000 new tokens and 200 out each."""
    scenario = make_scenario({"engine": engine})
    none = np.array([-1, -1])
    trace = Trace(np.array([0.0, 100.0]), np.array([1000, 2200]), np.array([200, 200]), session_id=np.array([0, 0]),
                  system_prompt_id=none, system_prompt_tokens=np.zeros(2, np.int64))
    return scenario, trace, simulate(scenario, trace).requests


def test_a_hits_ttft_drops_by_the_prefill_time_of_its_reused_tokens():
    _, trace, plain = two_turns({})
    scenario, _, cached = two_turns({"prefix_caching": True})
    size = scenario.engine.block_size
    prompt = int(trace.prompt_tokens[1])
    reused = min((prompt - 1) // size, (int(trace.prompt_tokens[0]) + int(trace.output_tokens[0]) - 1) // size) * size
    assert cached["cached_tokens"].tolist() == [0, reused]
    from llmsim.scenario.deployment import ResolvedDeployment
    model = ResolvedDeployment.of(scenario).cost
    drop = model.prefill_time(prompt) - model.prefill_time(prompt - reused, reused)
    assert plain["ttft_s"][0] == pytest.approx(cached["ttft_s"][0], rel=1e-12)
    assert plain["ttft_s"][1] - cached["ttft_s"][1] == pytest.approx(drop, rel=1e-9)
    assert drop > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_reload_costs_its_bytes_over_the_link_bandwidth(overlap):
    scenario, trace, gpu_only = two_turns({"prefix_caching": True})
    _, _, offloaded = two_turns({"prefix_caching": True, "cpu_offload": {"idle_timeout": "2 s", "overlap": overlap}})
    reused = int(gpu_only["cached_tokens"][1])
    assert offloaded["reloaded_tokens"].tolist() == [0, reused]
    from llmsim.scenario.deployment import ResolvedDeployment
    model = ResolvedDeployment.of(scenario).cost
    compute_s = model.prefill_time(int(trace.prompt_tokens[1]) - reused, reused)
    reload_s = reused // scenario.engine.block_size * block_transfer_s(scenario)
    assert gpu_only["ttft_s"][1] == pytest.approx(compute_s, rel=1e-9)
    assert offloaded["ttft_s"][1] == pytest.approx(max(compute_s, reload_s) if overlap else compute_s + reload_s,
                                                   rel=1e-9)


# -- preemption modes -----------------------------------------------------------------------------------

PRESSURE = {"engine": {"memory_utilization": 0.25, "max_model_len": 8192},
            "workload": {"arrival": {"rate": 30.0}, "num_requests": 400}}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swap_and_recompute_conserve_tokens_and_pay_their_own_cost(mode):
    scenario = make_scenario({**PRESSURE, "engine": {**PRESSURE["engine"], "preemption_mode": mode}})
    result = simulate(scenario)
    records = result.requests
    assert result.preemptions > 20
    assert (records["status"] == "finished").all()
    assert (records["generated_tokens"] == records["output_tokens"]).all()
    assert int(result.iterations["tokens_out"].sum()) == int(records["generated_tokens"].sum())
    assert result.kv_allocated_blocks == result.kv_freed_blocks and result.kv_held_blocks == 0
    extra_prefill = int(result.iterations["prefill_tokens"].sum()) - int(records["prompt_tokens"].sum())
    if mode == "recompute":
        # Every preemption computes its KV again: at least a prompt's worth, no transfer.
        assert extra_prefill >= result.preemptions * records["prompt_tokens"].min()
        assert result.kv_tiers is None
        return
    tiers = result.kv_tiers
    # Swapping computes at most the one token a decoding sequence resumes with, and pays the copies.
    assert 0 <= extra_prefill <= result.preemptions
    assert tiers.swapped_out_blocks == tiers.swapped_in_blocks > 0
    assert tiers.transfer_s == pytest.approx(2 * tiers.swapped_out_blocks * block_transfer_s(scenario))


# -- routing ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_prefix_aware_routing_finds_more_hits_within_its_load_bound():
    rates = {}
    for router in ("least_outstanding", "prefix_aware"):
        scenario = make_scenario({**SESSIONS, "deployment": {"replicas": 4, "router": router},
                                  "engine": {"prefix_caching": True}})
        summary = summarize(simulate(scenario)).to_dict()["kv_cache"]
        rates[router] = summary["hit_rate_tokens"], summary["replica_load_max_over_mean"]
    assert rates["prefix_aware"][0] > rates["least_outstanding"][0] + 0.1
    assert rates["prefix_aware"][1] < 1.6


# -- traces that carry prefix identity, and bad input ------------------------------------------------

def mooncake(tmp_path, rows) -> str:
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def replay(path: str, engine: dict) -> dict:
    """The test scenario replaying the trace at ``path``, with prefix caching and ``engine``."""
    data = {key: value for key, value in BASE.items() if key != "workload"}
    return merge(data, {"engine": {"prefix_caching": True, **engine},
                        "workload": {"arrival": {"process": "trace", "path": path}}})


def test_mooncake_hash_ids_are_the_prefix_caches_block_identities(tmp_path):
    """Two requests sharing their first two 512-token hash blocks: at block size 128 the second finds
    those 8 blocks cached (hash ids name a block and everything before it)."""
    path = mooncake(tmp_path, [{"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
                               {"timestamp": 50000, "input_length": 1400, "output_length": 10, "hash_ids": [1, 2, 9]}])
    records = simulate(make_scenario(base=replay(path, {"block_size": 128}))).requests
    assert records["cached_tokens"].tolist() == [0, 2 * 512]


def test_csv_session_ids_share_each_sessions_history(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,session_id\n0,600,100,7\n1,300,100,8\n60,1000,50,7\n")
    records = simulate(make_scenario(base=replay(str(path), {"block_size": 64}))).requests
    assert records["session_id"].tolist() == [0, 1, 0]
    assert records["cached_tokens"].tolist() == [0, 0, (600 + 100 - 1) // 64 * 64]


BAD_KV = {
    "block size not dividing the hash block": ("hash", {"block_size": 384}, ["engine.block_size", "384", "512"]),
    "hash_ids not one per block": ("short", {}, ["workload.arrival.path", "request 1", "one hash id per 512"]),
    "malformed hash_ids": ("malformed", {}, ["hash_ids", "'x'", "a list of integers"]),
    "host tier smaller than one block": ("none", {"cpu_offload": {"capacity": "1 MB"}},
                                         ["engine.cpu_offload.capacity", "1 MB", "less than one KV block"]),
    "offload without prefix caching": ("none", {"prefix_caching": False, "cpu_offload": True},
                                       ["engine.cpu_offload", "prefix_caching: true"]),
    "host tier on a profile without host memory": ("none", {"preemption_mode": "swap"},
                                                   ["engine.preemption_mode", "no host_memory"]),
}


@pytest.mark.parametrize("case", list(BAD_KV))
def test_bad_kv_settings_exit_2_naming_file_key_value_and_what_is_allowed(tmp_path, case, capsys):
    trace, engine, expected = BAD_KV[case]
    hashes = {"hash": [1, 2], "short": [1], "malformed": [1, "x"]}.get(trace)
    if hashes is None:
        data = merge(BASE, {"engine": {"prefix_caching": True, **engine}})
        if case.endswith("without host memory"):
            data["hardware"] = "cpu-calibrated"
            data["model"] = "Llama-3.2-1B"
    else:
        path = mooncake(tmp_path, [{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": hashes}])
        data = replay(path, engine)
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(data))
    assert main(["run", str(scenario), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, (fragment, err)


# -- recommend searches the block size and the idle timeout ------------------------------------------

@pytest.mark.parametrize("offload", [True, {"idle_timeout": "2 s", "overlap": True}])
def test_recommend_neighbours_vary_block_size_and_idle_timeout(offload):
    from llmsim.scenario.variants import variant
    from llmsim.search.recommend import IDLE_TIMEOUTS_S, OFF, Config, _neighbours
    scenario = make_scenario({**SESSIONS, "engine": {"prefix_caching": True, "cpu_offload": offload}})
    near = _neighbours(Config(OFF, 8192, None), scenario)
    assert {c.block_size for c in near} >= {64, 256}
    assert {c.idle_timeout_s for c in near} >= set(IDLE_TIMEOUTS_S)
    for config in near:
        if config.block_size is None and config.idle_timeout_s is None:
            continue
        built = variant(scenario, config.overrides(scenario))
        assert built.engine.block_size == (config.block_size or 128)
        if config.idle_timeout_s is not None:
            assert built.engine.cpu_offload.idle_timeout_s == config.idle_timeout_s
            assert built.engine.cpu_offload.overlap == (offload is not True)
