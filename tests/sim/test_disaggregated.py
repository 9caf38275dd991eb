"""Disaggregated prefill/decode against independent truth: the link's closed forms (one transfer, equal
transfers sharing it, work conservation), the two pools run as scenarios of their own, conservation of
requests and KV blocks across both pools, and streaming's closed form."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
import simpy

from llmsim.analysis.metrics import summarize
from llmsim.catalog.links import LINKS, Link
from llmsim.sim.disaggregated import SharedLink
from llmsim.sim.simulate import simulate
from llmsim.workload.generate import generate_trace
from llmsim.workload.trace import Trace
from tests.helpers import make_scenario, simulate_checked

FREE_LINK = Link("free", "an infinitely fast link", math.inf, 1.0, 0.0, {})


def disaggregated(overrides: dict | None = None, **split) -> dict:
    """A small Llama-3.1-8B deployment: one H100 prefill replica, one H100 decode replica over InfiniBand NDR."""
    config = {"prefill": {"replicas": 1, "tensor_parallel": 1}, "decode": {"replicas": 1, "tensor_parallel": 1},
              "link": "infiniband_ndr", **split}
    base = {"deployment": {"disaggregation": config},
            "workload": {"num_requests": 120, "arrival": {"process": "poisson", "rate": 4.0}}}
    return make_scenario(_deep(base, overrides or {}))


def _deep(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _deep(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def with_link(scenario, link: Link):
    return dataclasses.replace(scenario, disaggregation=dataclasses.replace(scenario.disaggregation, link=link))


# -- the link ------------------------------------------------------------------------------------------

def test_one_transfer_takes_bytes_over_bandwidth_times_efficiency_plus_latency():
    link = LINKS["infiniband_ndr"]
    nbytes, lanes = 3.2e9, 4
    expected = nbytes / (50e9 * 0.94 * lanes) + 10e-6             # the table's datasheet rate, measured share
    assert link.transfer_s(nbytes, lanes) == pytest.approx(expected, rel=1e-12)
    env = simpy.Environment()
    shared = SharedLink(env, link.effective_bytes_per_s * lanes, link.latency_s)
    done = []
    shared.send(nbytes, done.append)
    env.run()
    assert done == [pytest.approx(expected, rel=1e-12)]


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_n_equal_concurrent_transfers_each_take_n_times_as_long(n):
    rate, latency, nbytes = 10e9, 20e-6, 1e9
    env = simpy.Environment()
    link = SharedLink(env, rate, latency)
    done = []
    for _ in range(n):
        link.send(nbytes, done.append)
    env.run()
    assert done == [pytest.approx(n * nbytes / rate + latency, rel=1e-12)] * n
    assert link.busy_s == pytest.approx(n * nbytes / rate, rel=1e-12)


def test_staggered_transfers_share_the_link_and_conserve_its_work():
    """A second transfer joining half-way: the first gets the whole link, then half of it (closed form), and
    the link, never idle, finishes the last byte at total bytes / rate."""
    rate, nbytes, join_s = 1e9, 1e9, 0.4
    env = simpy.Environment()
    link = SharedLink(env, rate, 0.0)
    done: dict[str, float] = {}
    link.send(nbytes, lambda t: done.setdefault("first", t))
    env.timeout(join_s).callbacks.append(lambda _: link.send(nbytes, lambda t: done.setdefault("second", t)))
    env.run()
    first = join_s + 2 * (nbytes - rate * join_s) / rate
    assert done["first"] == pytest.approx(first, rel=1e-12)
    assert done["second"] == pytest.approx(2 * nbytes / rate, rel=1e-12)


# -- the pools against scenarios of their own ---------------------------------------------------------------

def test_with_an_infinitely_fast_link_the_prefill_pool_runs_as_its_own_scenario():
    """Each prompt ends on the prefill pool when the prefill pool run alone (every request one output token,
    so it leaves when its prompt is computed) gives it its first token."""
    scenario = with_link(disaggregated(), FREE_LINK)
    trace = generate_trace(scenario.workload, scenario.seed)
    split = simulate(scenario, trace).requests
    alone_trace = dataclasses.replace(trace, output_tokens=np.ones(len(trace), np.int64))
    alone = simulate(scenario.pool("prefill"), alone_trace).requests
    assert (split["status"] == "finished").all() and (alone["status"] == "finished").all()
    np.testing.assert_allclose(split["prefill_end_s"], alone["first_token_s"], rtol=1e-12)
    np.testing.assert_allclose(split["first_scheduled_s"], alone["first_scheduled_s"], rtol=1e-12)
    np.testing.assert_allclose(split["transfer_end_s"], split["prefill_end_s"], rtol=1e-12)


def test_with_an_infinitely_fast_link_the_decode_pool_decodes_as_its_own_scenario():
    """Requests far apart: after its first decode step (which computes the last prompt token) a request
    decodes on the decode pool exactly as the decode pool run alone decodes it after its prompt."""
    scenario = with_link(disaggregated({"workload": {"num_requests": 12,
                                                     "arrival": {"process": "deterministic", "rate": 0.05}}}),
                         FREE_LINK)
    trace = generate_trace(scenario.workload, scenario.seed)
    split = simulate(scenario, trace).requests
    alone = simulate(scenario.pool("decode"), trace).requests
    decoding_split = split["finish_s"] - split["first_token_s"]
    decoding_alone = alone["finish_s"] - alone["first_token_s"]
    np.testing.assert_allclose(decoding_split, decoding_alone, rtol=1e-9)
    # The first decode step is one token over the prompt's context: about one decode step of the run alone.
    several = alone["output_tokens"] > 2
    np.testing.assert_allclose(split["ttft_first_decode_s"][several], alone["tpot_s"][several], rtol=0.1)


# -- conservation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reservation", ["before_transfer", "after_transfer"])
@pytest.mark.parametrize("horizon", [None, "6 s"])
def test_every_arrival_finishes_or_is_reported_unfinished_across_both_pools(reservation, horizon):
    """A decode pool whose KV cache holds few requests (it fills), a slow link, short prompts run aggregated;
    every request that arrived is finished, rejected or unfinished, and a drained run frees every KV block."""
    overrides = {"engine": {"memory_utilization": 0.3, "max_model_len": 8192},
                 "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 20.0}}}
    if horizon:
        overrides["simulation"] = {"horizon": horizon}
    scenario = disaggregated(overrides, reservation=reservation, link="pcie_gen4", aggregated_below_tokens=200)
    result = simulate_checked(scenario)      # KV blocks, tokens and requests balance at every iteration too
    records = result.requests
    counts = records["status"].value_counts().to_dict()
    assert records["id"].tolist() == list(range(len(records)))          # the first arrivals of the trace
    assert set(counts) <= {"finished", "rejected", "unfinished"}
    if horizon is not None:
        assert counts.get("unfinished", 0) > 0
    finished = records[records["status"] == "finished"]
    assert (finished["generated_tokens"] == finished["output_tokens"]).all()
    assert records["aggregated"].any() and (~records["aggregated"]).any()
    parts = finished[["ttft_queue_s", "ttft_prefill_s", "ttft_transfer_s", "ttft_first_decode_s"]]
    np.testing.assert_allclose(parts.sum(axis=1), finished["ttft_s"], rtol=1e-9, atol=1e-12)
    assert (parts >= -1e-12).all().all()
    if horizon is None:
        assert counts == {"finished": len(records)}
        assert result.kv_allocated_blocks == result.kv_freed_blocks
        moved = finished[~finished["aggregated"]]
        assert result.disaggregation.transfers == len(moved)
        assert result.disaggregation.transfer_bytes == pytest.approx(
            float(moved["prompt_tokens"].sum()) * scenario.model.kv_bytes_per_token)


def test_a_full_decode_pool_holds_prefill_kv_when_reserving_before_the_transfer():
    """With the decode KV reserved before the transfer a burst waits for decode blocks (transfers start after
    the prefill ended); reserved after, transfers start when the prefill ends and the wait is in the decode queue."""
    overrides = {"engine": {"memory_utilization": 0.25, "max_model_len": 8192},
                 "workload": {"num_requests": 40, "arrival": {"process": "poisson", "rate": 40.0},
                              "prompt_tokens": 3000, "output_tokens": 400},
                 "simulation": {"horizon": "1 h"}}
    before = simulate(disaggregated(overrides, reservation="before_transfer")).requests
    after = simulate(disaggregated(overrides, reservation="after_transfer")).requests
    wait_before = before["transfer_start_s"] - before["prefill_end_s"]
    wait_after = after["transfer_start_s"] - after["prefill_end_s"]
    assert wait_before.max() > 0.1
    assert wait_after.abs().max() < 1e-9
    assert (before["status"] == "finished").all() and (after["status"] == "finished").all()


# -- streaming -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("link", ["pcie_gen4", "nvlink4"])
def test_streaming_leaves_the_last_layer_or_what_the_link_could_not_carry(link):
    """One request at a time: the transfer left after the prefill takes max(bytes / layers, bytes - rate x
    prefill time) / rate + latency, whichever the link's speed makes larger."""
    scenario = disaggregated({"workload": {"num_requests": 5, "arrival": {"process": "deterministic", "rate": 0.2},
                                           "prompt_tokens": 4000, "output_tokens": 4}}, link=link, streaming=True)
    records = simulate(scenario).requests
    figures = LINKS[link]
    rate, layers = figures.effective_bytes_per_s, scenario.model.num_layers
    nbytes = records["prompt_tokens"] * scenario.model.kv_bytes_per_token
    prefill_s = records["prefill_end_s"] - records["first_scheduled_s"]
    expected = np.maximum(nbytes / layers, nbytes - rate * prefill_s) / rate + figures.latency_s
    np.testing.assert_allclose(records["transfer_end_s"] - records["prefill_end_s"], expected, rtol=1e-9)


def test_prompts_below_the_threshold_run_aggregated_on_the_decode_pool():
    trace = Trace(np.array([0.0, 1.0, 2.0]), np.array([100, 5000, 300]), np.array([10, 10, 10]))
    scenario = disaggregated(aggregated_below_tokens=400)
    records = simulate(scenario, trace).requests
    assert records["aggregated"].tolist() == [True, False, True]
    assert records["prefill_replica"].tolist() == [-1, 0, -1]
    assert records["transfer_bytes"].isna().tolist() == [True, False, True]


def test_prefix_aware_placement_sends_a_session_back_to_the_prefill_replica_holding_it():
    """Multi-turn sessions over two prefill replicas: placed by cached prefix, a session's later turns return
    to the replica holding its history (placed in turn, about half do, by chance), and more of their prompt
    tokens are found cached."""
    found = {}
    for router in ("prefix_aware", "round_robin"):
        overrides = {"engine": {"prefix_caching": True}, "deployment": {"router": router},
                     "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 2.0},
                                  "prompt_tokens": 300, "output_tokens": 20,
                                  "sessions": {"turns": {"distribution": "uniform", "low": 3, "high": 6},
                                               "think_time": "2 s"}}}
        records = simulate_checked(disaggregated(overrides, prefill={"replicas": 2, "tensor_parallel": 1})).requests
        assert (records["status"] == "finished").all()
        later = records[records.duplicated("session_id")]          # every turn after a session's first
        firsts = records.drop_duplicates("session_id").set_index("session_id")["prefill_replica"]
        found[router] = ((later["prefill_replica"].to_numpy() == firsts[later["session_id"]].to_numpy()).mean(),
                         later["cached_tokens"].sum() / later["prompt_tokens"].sum())
    assert found["prefix_aware"][0] > 0.9 and found["round_robin"][0] < 0.7
    assert found["prefix_aware"][1] > 1.2 * found["round_robin"][1]


# -- pools with their own expert parallelism and engine settings --------------------------------------------

QWEN_MOE = {"model": "Qwen3-30B-A3B", "hardware": "H200"}


def moe_disaggregated(overrides: dict | None = None, **split):
    """Qwen3-30B-A3B on H200: a prefill pool of one expert-parallel group of 2 and a decode pool of one group of 8
    (8 attention data-parallel ranks), the DeepSeek/Dynamo layout in small."""
    pools = {"prefill": {"replicas": 1, "tensor_parallel": 1, "expert_parallel": {"degree": 2}},
             "decode": {"replicas": 1, "tensor_parallel": 1,
                        "expert_parallel": {"degree": 8, "routing": {"distribution": "zipf", "exponent": 1.0}}}}
    return disaggregated(_deep({**QWEN_MOE, "deployment": {"disaggregation": pools}}, overrides or {}), **split)


def test_with_an_infinitely_fast_link_an_expert_parallel_decode_pool_decodes_as_its_own_ep_scenario():
    """Requests far apart, a wide-EP decode pool: each request decodes on its data-parallel rank exactly as the
    decode pool run alone as an expert-parallel scenario of its own decodes it (same busiest-rank table, same
    all-to-all terms); and the prefill pool, EP 2, computes each prompt as it does alone."""
    scenario = with_link(moe_disaggregated({"workload": {"num_requests": 12,
                                                         "arrival": {"process": "deterministic", "rate": 0.05}}}),
                         FREE_LINK)
    decode = scenario.pool("decode")
    assert decode.deployment.expert_parallel.degree == 8 and decode.deployment.data_parallel == 8
    trace = generate_trace(scenario.workload, scenario.seed)
    split = simulate(scenario, trace).requests
    alone = simulate(decode, trace).requests
    np.testing.assert_allclose(split["finish_s"] - split["first_token_s"], alone["finish_s"] - alone["first_token_s"],
                               rtol=1e-9)
    prefill_alone = simulate(scenario.pool("prefill"),
                             dataclasses.replace(trace, output_tokens=np.ones(len(trace), np.int64))).requests
    np.testing.assert_allclose(split["prefill_end_s"], prefill_alone["first_token_s"], rtol=1e-12)


def test_the_decode_pools_expert_parallel_degree_is_what_its_steps_cost():
    """The same requests, far apart, decode faster per token on the decode pool of EP 8 than on one of EP 2
    only through the cost model the pool's degree selects: each run's decoding matches that pool alone."""
    narrow = with_link(moe_disaggregated({"workload": {"num_requests": 6,
                                                       "arrival": {"process": "deterministic", "rate": 0.05}},
                                          "deployment": {"disaggregation": {"decode": {
                                              "expert_parallel": {"degree": 2}}}}}), FREE_LINK)
    trace = generate_trace(narrow.workload, narrow.seed)
    split = simulate(narrow, trace).requests
    alone = simulate(narrow.pool("decode"), trace).requests
    np.testing.assert_allclose(split["finish_s"] - split["first_token_s"], alone["finish_s"] - alone["first_token_s"],
                               rtol=1e-9)


@pytest.mark.parametrize("reservation", ["before_transfer", "after_transfer"])
def test_expert_parallel_pools_conserve_requests_tokens_and_kv_blocks(reservation):
    """Both pools expert parallel under load: every request finishes with all its tokens, every KV block
    allocated is freed, every transferred prompt crossed once with its bytes, and each pool's devices are its
    group's (EP degree x pool replicas) at its chip's price."""
    scenario = moe_disaggregated({"workload": {"num_requests": 150, "arrival": {"process": "poisson", "rate": 15.0}}},
                                 reservation=reservation)
    result = simulate_checked(scenario)
    records = result.requests
    assert (records["status"] == "finished").all()
    assert (records["generated_tokens"] == records["output_tokens"]).all()
    assert result.kv_allocated_blocks == result.kv_freed_blocks
    assert result.disaggregation.transfers == len(records)
    assert result.disaggregation.transfer_bytes == pytest.approx(
        float(records["prompt_tokens"].sum()) * scenario.model.kv_bytes_per_token)
    assert set(records["decode_replica"]) == set(range(8))      # the eight data-parallel ranks each decoded
    pools = {pool.pool: pool for pool in result.disaggregation.pools}
    price = scenario.hardware.price_per_hour_usd
    assert (pools["prefill"].expert_parallel, pools["decode"].expert_parallel) == (2, 8)
    assert pools["prefill"].usd_per_hour == pytest.approx(2 * price)
    assert pools["decode"].usd_per_hour == pytest.approx(8 * price)
    assert (pools["prefill"].devices, pools["decode"].devices) == (2, 8)
    assert summarize(result).devices == 2 + 8                   # both pools' groups are paid for
    assert 0 < pools["decode"].busy_fraction <= 1


def test_each_pool_runs_with_its_own_engine_settings():
    """A decode pool limited to 3 sequences and a prefill pool to 1,024 batch tokens: no decode iteration runs
    more than 3 sequences, no prefill iteration more than 1,024 prompt tokens, while the scenario's shared
    engine block (256 sequences, 8,192 tokens) is what the pools run without settings of their own."""
    overrides = {"workload": {"num_requests": 80, "arrival": {"process": "poisson", "rate": 20.0}}}
    own = disaggregated(_deep(overrides, {"deployment": {"disaggregation": {
        "prefill": {"engine": {"max_batch_tokens": 1024}},
        "decode": {"engine": {"max_num_seqs": 3, "max_batch_tokens": 4096}}}}}))
    iterations = simulate_checked(own).iterations
    prefill, decode = iterations[iterations["pool"] == "prefill"], iterations[iterations["pool"] == "decode"]
    assert prefill["prefill_tokens"].max() <= 1024 and decode["running"].max() <= 3
    assert decode["running"].max() == 3                          # the decode pool did fill to its limit
    shared = simulate_checked(disaggregated(overrides)).iterations
    assert shared[shared["pool"] == "decode"]["running"].max() > 3
    assert shared[shared["pool"] == "prefill"]["prefill_tokens"].max() > 1024


@contextlib.contextmanager
def counted_decode_hook():
    """Within the block the router's decode hook records the index of every engine it runs for; yields the
    monkeypatch (to patch more) and that list."""
    from llmsim.sim import disaggregated as split_module

    hooked: list[int] = []
    original = split_module.DisaggregatedRouter.observe_decode

    def counting(router, engine):
        hooked.append(engine.index)
        original(router, engine)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(split_module.DisaggregatedRouter, "observe_decode", counting)
        yield patch, hooked


def test_observers_see_every_iteration_of_both_pools_and_the_decode_hook_runs_after_each():
    """The decode engines run the router's hook (KV freed: requests waiting to join or reserve) after every
    iteration without building an Iteration for it; observers passed in still see every iteration of both
    pools, as the result's iteration table records them, and the hook runs once per decode iteration."""
    from llmsim.sim.iterations import LOG_COLUMNS

    scenario = disaggregated({"workload": {"num_requests": 150, "arrival": {"rate": 12.0}}})
    seen: list = []
    with counted_decode_hook() as (_, hooked):
        result = simulate(scenario, observers=[lambda engine, iteration: seen.append((engine.index, iteration))])
    table = result.iterations
    assert len(seen) == len(table) > 150
    for index in (0, 1):                     # each engine's iterations, in its own order
        mine = [iteration for engine, iteration in seen if engine == index]
        rows = table[table["replica"] == index]
        for name in LOG_COLUMNS:
            assert np.array_equal(np.array([getattr(iteration, name) for iteration in mine]), rows[name].to_numpy())
    decode_iterations = sum(1 for index, _ in seen if index >= 1)        # the decode replica's engine: index 1
    assert len(hooked) == decode_iterations > 0 and set(hooked) == {1}


@pytest.mark.parametrize("seed", [3, 11])
def test_after_the_transfer_the_decode_engines_run_no_hook_and_the_run_is_the_hooked_one(seed):
    """After the transfer a request waits in its decode engine's own queue, so the router's reservation and ready
    queues stay empty and its hook has nothing to do: the decode engines run without it (it would cost every
    iteration), and the run, a loaded one with a pipelined decode pool sharing one queue and KV cache, is
    identical, record for record and iteration for iteration, to the run with the hook forced on every engine."""
    from llmsim.sim import disaggregated as split_module

    scenario = dataclasses.replace(disaggregated(
        {"workload": {"num_requests": 200, "arrival": {"rate": 14.0}},
         "engine": {"max_num_seqs": 8}}, reservation="after_transfer",
        decode={"replicas": 1, "tensor_parallel": 1, "pipeline_parallel": 2}), seed=seed)
    plain = simulate(scenario)
    with counted_decode_hook() as (patch, hooked):
        patch.setattr(split_module.DisaggregatedRouter, "decode_hooks", lambda router: [router.observe_decode])
        forced = simulate(scenario)
    assert len(hooked) == (forced.iterations["pool"] == "decode").sum() > 0
    decode = plain.iterations[plain.iterations["pool"] == "decode"]
    assert (decode["queued"] > 0).any() and decode["micro_batch"].nunique() == 2     # a queue, two micro-batches
    assert plain.requests.equals(forced.requests) and plain.iterations.equals(forced.iterations)
