"""The analytic fast path against closed forms and against the simulator.

Error bounds. The fluid model replaces every iteration by the mean one, given the
Poisson number of prompts it carries; what it leaves out (the spread of the decoders'
contexts and of the draft lengths inside a batch, the speculative eligibility rules,
the burstiness of admission behind the token budget) changes a step's cost by a few
percent, and the fixed point tau = g(tau) amplifies a relative error e in g by
1 / (1 - g'(tau)), which grows with the load. At half the capacity g' is about 0.5 in
these cases, so a step error of 5% becomes at most ~10% in TPOT and in the requests in the system
(N = lambda T). TTFT adds queueing terms whose approximations (M/G/1 for the token
budget, Allen-Cunneen M/G/c for batch slots) carry no error guarantee for these
systems, and it underestimates: its 30% bound is not derived but a regression guard
set from the worst error measured at half load (26%, the 70B case whose small token
budget makes prompts queue; benchmarks/bench_analytic.py prints the full table,
quoted in the README). Simulation noise on top: a 1,500-request run estimates mean TPOT to ~1% and
mean TTFT to ~3% (standard error from batch means), inside the margins.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import llmsim
from llmsim.analysis.fluid import FluidModel, _law_lengths
from llmsim.analysis.fluid_k import accepted_pmf, adaptive_mix, static_mix, tokens_table
from llmsim.analysis.metrics import summarize
from llmsim.cost.features import chunk_pairs, windowed_context_sum
from llmsim.errors import ConfigError
from llmsim.scenario.variants import variant
from llmsim.search.plan import as_scenario
from llmsim.speculation.config import Acceptance, expected_tokens_per_step
from llmsim.workload.generate import generate_trace

from tests.helpers import REPO, make_scenario, roofline_only

SPEC = {"draft": "Llama-3.2-1B", "policy": "static", "k": 3, "acceptance": {"process": "bernoulli", "alpha": 0.8}}
CASES = {
    "8B plain": {},
    "70B tp4, budget 2048": {"model": "Llama-3.1-70B", "deployment": {"tensor_parallel": 4},
                             "engine": {"max_batch_tokens": 2048}},
    "8B static k=3": {"speculation": SPEC},
    # MoE: the first tokens of a batch touch whole experts, so the step's growth is steepest at an empty batch.
    "30B-A3B MoE": {"model": "Qwen3-30B-A3B", "hardware": "H200"},
}
EXPERT_PARALLEL = {"model": "Qwen3-30B-A3B", "hardware": "H200",
                   "deployment": {"tensor_parallel": 1, "pipeline_parallel": 1,
                                  "expert_parallel": {"degree": 8, "routing": {"distribution": "zipf",
                                                                               "exponent": 1.0}}}}


def at_rate(scenario, rate):
    return replace(scenario, workload=replace(scenario.workload, arrival=replace(scenario.workload.arrival,
                                                                                 rate_per_s=rate)))


def like_for_like(scenario):
    """The fluid model of the requests the simulator runs (their lengths, not the laws they are drawn from),
    so that the comparison carries no sampling error of the lengths."""
    return FluidModel(scenario, generate_trace(scenario.workload, scenario.seed))


def relative_error(predicted, simulated):
    return abs(predicted / simulated - 1.0)


def test_fixed_point_matches_the_closed_form_of_a_linear_step():
    """One-token prompts, fixed outputs: memory-bound decode t(B) = a + b B, so Little's law
    B = lambda tau D gives tau = a / (1 - lambda D b) exactly."""
    scenario = make_scenario({"workload": {"prompt_tokens": 1, "output_tokens": 101}})
    scenario = replace(scenario, hardware=roofline_only(scenario.hardware))   # the roofline's linear decode step
    model = FluidModel(scenario)
    cost = model.cost
    context = 1 + 100 / 2                      # mean context over the decode steps (P + j + 1)
    a = cost.decode_time(1, context) - (cost.decode_time(2, context) - cost.decode_time(1, context))
    b = cost.decode_time(2, context) - cost.decode_time(1, context)
    rate = 20.0
    expected = a / (1 - rate * 100 * b)
    predicted = model.evaluate(rate).iloc[0]
    # The one-token prompts add a prefill token per request: a 1e-3 relative effect here.
    assert predicted.step_time_s == pytest.approx(expected, rel=5e-3)
    # Sequences per iteration: B = lambda tau D decoding, plus lambda tau prompts.
    assert predicted.batch_size == pytest.approx(rate * 101 * predicted.step_time_s, rel=1e-9)


def test_tokens_per_step_follow_leviathan():
    acceptance = Acceptance("bernoulli", alpha=0.7)
    for k in range(8):
        pmf = accepted_pmf(acceptance, 0.7, k)
        assert pmf.sum() == pytest.approx(1.0)
        assert pmf @ np.arange(k + 1) + 1 == pytest.approx(float(expected_tokens_per_step(0.7, k)))
    mix = static_mix(acceptance, 4, 8)
    assert mix.class_tokens_per_step[0] == pytest.approx(float(expected_tokens_per_step(0.7, 4)))


def test_adaptive_rule_climbs_with_high_acceptance_and_falls_back_with_low():
    high = make_scenario({"speculation": {"draft": "Llama-3.2-1B", "policy": "adaptive", "k": 4, "k_max": 8,
                                          "acceptance": {"alpha": 0.97}}}).speculation
    low = replace(high, acceptance=Acceptance("bernoulli", alpha=0.2))
    climbing = adaptive_mix(high, mean_decode_tokens=5000).step_weights()
    falling = adaptive_mix(low, mean_decode_tokens=5000).step_weights()
    assert climbing[-1] > 0.5                          # mostly at k_max
    assert falling[:2].sum() > 0.9                     # off, or probing at k = 1


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_means_agree_with_the_simulator_at_half_load(name):
    scenario = make_scenario({"workload": {"num_requests": 1500}, **CASES[name]})
    model = like_for_like(scenario)
    rate = 0.5 * model.capacity()
    predicted = model.evaluate(rate).iloc[0]
    summary = summarize(llmsim.simulate(at_rate(scenario, rate))).to_dict()
    assert relative_error(predicted.tpot_mean_s, summary["latency"]["tpot_s"]["mean"]) < 0.10
    # Requests in the system, time-averaged (Little's law on both sides).
    assert relative_error(predicted.in_system, summary["queue"]["mean_in_system"]) < 0.10
    assert relative_error(predicted.ttft_mean_s, summary["latency"]["ttft_s"]["mean"]) < 0.30


@pytest.mark.slow
def test_expert_parallel_tpot_agrees_with_the_simulator_at_half_load():
    """The fluid model prices an expert-parallel rank by the same cost model (its busiest-rank expert GEMMs and
    all-to-alls): its mean TPOT agrees as the dense cases' does."""
    scenario = make_scenario({"workload": {"num_requests": 1500}, **EXPERT_PARALLEL})
    model = like_for_like(scenario)
    rate = 0.5 * model.capacity()
    predicted = model.evaluate(rate).iloc[0]
    summary = summarize(llmsim.simulate(at_rate(scenario, rate))).to_dict()
    assert relative_error(predicted.tpot_mean_s, summary["latency"]["tpot_s"]["mean"]) < 0.10


@pytest.mark.parametrize("name", ["8B plain", "8B static k=3", "30B-A3B MoE"])
def test_capacity_is_where_the_simulated_queue_blows_up(name):
    """Below the predicted capacity the queue stays short; above it, it grows all run long; and
    the throughput of an overloaded run (the simulated capacity) is within 10% of the prediction."""
    scenario = make_scenario({"workload": {"num_requests": 3000}, **CASES[name]})
    model = like_for_like(scenario)
    capacity = model.capacity()
    below = summarize(llmsim.simulate(at_rate(scenario, 0.85 * capacity))).to_dict()
    above = summarize(llmsim.simulate(at_rate(scenario, 1.25 * capacity))).to_dict()
    saturated = summarize(llmsim.simulate(at_rate(scenario, 1.5 * capacity))).to_dict()
    assert below["latency"]["ttft_s"]["p99"] < 2.0
    assert above["latency"]["ttft_s"]["mean"] > 10 * below["latency"]["ttft_s"]["mean"]
    served = saturated["throughput"]["output_tokens_per_s"] / model.mean_output
    assert relative_error(capacity, served) < 0.10
    assert bool(model.evaluate(0.85 * capacity)["stable"].iloc[0])
    assert not bool(model.evaluate(1.05 * capacity)["stable"].iloc[0])


@pytest.mark.parametrize("window, local_layers", [(None, None), (128, None), (128, 16), (40, 8)])
@pytest.mark.parametrize("limit", [10_000, 250])
def test_length_statistics_from_the_laws_equal_their_sums_over_every_request_length(window, local_layers, limit):
    """The fluid model reads the length laws exactly: every statistic equals its definition summed over the
    whole (prompt, output) grid with the product of the two laws' probabilities, cut to prompt + output <=
    limit (250 drops the long pairs), without a window, one on every layer and one on half of them (the
    grid's 300 x 150 pairs in float64: agreement to 1e-12), at two KV block sizes."""
    scenario = make_scenario({"workload": {
        "prompt_tokens": {"distribution": "lognormal", "mean": 80, "sigma": 0.9, "max": 300},
        "output_tokens": {"distribution": "uniform", "low": 1, "high": 150}}})
    scenario = replace(scenario, model=replace(scenario.model, sliding_window=window,
                                               sliding_window_layers=local_layers))
    model, workload = scenario.model, scenario.workload
    (x, p), (y, q) = workload.prompt_tokens.probabilities(), workload.output_tokens.probabilities()
    prompt, output = np.meshgrid(x.astype(float), y.astype(float), indexing="ij")
    weight = np.outer(p, q) * (prompt + output <= limit)
    weight /= weight.sum()
    decode = output - 1

    def mean(values):
        return float((weight * values).sum())
    law = _law_lengths(scenario, limit)
    pairs = chunk_pairs(prompt, 0.0, model.sliding_window, model.local_attention_share)
    assert law.mean_prompt == pytest.approx(mean(prompt), rel=1e-12)
    assert law.mean_output == pytest.approx(mean(output), rel=1e-12)
    assert law.prompt_second_moment == pytest.approx(mean(prompt ** 2), rel=1e-12)
    assert law.pairs_per_token == pytest.approx(mean(pairs) / mean(prompt), rel=1e-12)
    assert law.decode_cv2 == pytest.approx(mean((decode - mean(decode)) ** 2) / mean(decode) ** 2, rel=1e-12)
    assert law.mean_decode_kv == pytest.approx(mean(windowed_context_sum(
        prompt + 1, prompt + decode, model.sliding_window, model.local_attention_share)), rel=1e-12)
    # The statistics are remembered by what they read: another block size (the same laws) is its own.
    for engine in (scenario.engine, replace(scenario.engine, block_size=4 * scenario.engine.block_size)):
        held = _law_lengths(replace(scenario, engine=engine), limit).mean_kv_held
        block = engine.block_size
        assert held == pytest.approx(mean(decode * (prompt + (decode + 1) / 2 + block / 2)), rel=1e-12)
    # The grid: the prompt length at each midpoint quantile of the prompts that fit.
    share_below = (weight.sum(axis=1)[None, :] * (x[None, :] < law.step_grid[0][:, None])).sum(axis=1)
    share_at_most = (weight.sum(axis=1)[None, :] * (x[None, :] <= law.step_grid[0][:, None])).sum(axis=1)
    midpoints = (np.arange(len(share_below)) + 0.5) / len(share_below)
    assert np.all(share_below <= midpoints) and np.all(midpoints < share_at_most)
    # Means over requests of a function of the decode length use its law too.
    assert law.mean_over_requests(law.decode[None, :] ** 2) == pytest.approx(mean(decode ** 2), rel=1e-12)


def test_the_fluid_model_does_not_depend_on_the_request_count_or_seed():
    """Its lengths come from the laws (above), not from the requests drawn: 500 or 50,000 requests, any seed,
    the same prediction to the last bit."""
    frames = [FluidModel(make_scenario({"seed": seed, "workload": {"num_requests": n}})).evaluate([2.0, 8.0])
              for seed, n in ((11, 500), (12, 50_000))]
    assert frames[0].equals(frames[1])


def test_static_batching_is_refused_with_a_clear_error():
    with pytest.raises(ConfigError, match="continuous batching only"):
        FluidModel(make_scenario({"engine": {"batching": "static"}}))


# -- tree verification --------------------------------------------------------------------------------
TREE = {"model": "Llama-3.1-8B", "workload": {"prompt_tokens": {"distribution": "fixed", "value": 200},
                                              "output_tokens": {"distribution": "fixed", "value": 201}},
        "speculation": {"draft": "eagle", "tree_branching": 2, "k": 3, "acceptance": {"alpha": 0.6},
                        "eligibility": {"min_sequence_tokens": 0, "min_concurrent_requests": 1}}}


def tree_tokens_per_step(alpha: float, branching: int, depth: int) -> float:
    """E[tokens one verify step of a full b-ary tree of depth d emits], i.i.d. acceptance.

    Each node has b children, the b candidates for the next token; the target follows one path,
    and each candidate is its token with chance alpha independently, so a level is accepted when
    any of its b candidates is: q = 1 - (1 - alpha)^b. Levels are accepted in turn until the first
    miss, so the accepted length a has P(a >= j) = q^j for j = 1..d, and

        E[a + 1] = sum_{j=0..d} q^j = (1 - q^(d+1)) / (1 - q),

    Leviathan's Eq. 1 at rate q (at b = 1, q = alpha: the chain).
    """
    q = 1 - (1 - alpha) ** branching
    return (1 - q ** (depth + 1)) / (1 - q)


@pytest.mark.parametrize("alpha, branching, depth", [(0.6, 2, 3), (0.4, 3, 4), (0.8, 1, 5), (0.5, 4, 2)])
def test_tree_tokens_per_step_follow_the_closed_form(alpha, branching, depth):
    """The fluid model's per-k table, and its tokens per step for a scenario verifying such a tree
    with outputs so long (10,001 tokens) that the last steps' cap (never drafting past the last token,
    which shortens at most the final few of ~3,000 steps) moves the mean by under 0.2%."""
    table = tokens_table(Acceptance("bernoulli", alpha=alpha), 8, branching)
    assert table[0, depth] == pytest.approx(tree_tokens_per_step(alpha, branching, depth), rel=1e-12)
    assert table[0, 0] == 1.0
    scenario = make_scenario({**TREE, "workload": {**TREE["workload"], "output_tokens": 10001},
                              "speculation": {**TREE["speculation"], "tree_branching": branching, "k": depth,
                                              "acceptance": {"alpha": alpha}}})
    predicted = like_for_like(scenario).evaluate(1.0).iloc[0]
    assert predicted.tokens_per_step == pytest.approx(tree_tokens_per_step(alpha, branching, depth), rel=2e-3)


def test_a_tree_agrees_with_the_simulator_at_low_load():
    """EAGLE head, binary tree 3 levels deep, alpha 0.6 (q = 0.84, 3.14 tokens a step before the
    last steps' cap), every sequence eligible (the fluid model has no eligibility rules), at about
    a tenth of the capacity. Tokens per decode step: the simulator's ratio of sums against the fluid
    model's, within four standard errors (requests are independent: each request's steps are
    (O - 1) - its accepted tokens; the delta method carries their spread to the ratio). TPOT and the
    requests in the system: within the fluid model's 10% bound (module docstring)."""
    scenario = at_rate(make_scenario({**TREE, "workload": {**TREE["workload"], "num_requests": 200}}), 2.5)
    predicted = like_for_like(scenario).evaluate(2.5).iloc[0]
    result = llmsim.simulate(scenario)
    records = result.requests
    decode = records["output_tokens"] - 1
    steps = decode - records["accepted_tokens"]
    assert steps.sum() == result.iterations["decode_seqs"].sum()            # one decode step a token but the accepted
    simulated = decode.sum() / steps.sum()
    se = simulated * steps.std(ddof=1) / np.sqrt(len(steps)) / steps.mean()
    assert abs(predicted.tokens_per_step - simulated) < 4 * se
    summary = summarize(result).to_dict()
    assert relative_error(predicted.tpot_mean_s, summary["latency"]["tpot_s"]["mean"]) < 0.10
    assert relative_error(predicted.in_system, summary["queue"]["mean_in_system"]) < 0.10


def test_medusa_is_stable_at_light_load_and_agrees_with_the_simulator():
    """Medusa's heads run once a step whatever the batch: a weight read that a step carrying any
    speculating sequence pays in full. Priced at the fluid model's fractional batch it jumped from
    nothing at zero load to all of it, and the step-time solve called every load unstable (so
    recommend scored every Medusa setting 0). At ~10% of capacity: stable, and TPOT within the
    fluid model's 10%."""
    scenario = make_scenario({"model": "Llama-3.1-8B", "workload": {"num_requests": 200},
                              "speculation": {"draft": "medusa", "heads": 3, "k": 3, "acceptance": {"alpha": 0.6},
                                              "eligibility": {"min_sequence_tokens": 0,
                                                              "min_concurrent_requests": 1}}})
    predicted = like_for_like(scenario).evaluate(4.5).iloc[0]
    assert predicted.stable
    summary = summarize(llmsim.simulate(at_rate(scenario, 4.5))).to_dict()
    assert relative_error(predicted.tpot_mean_s, summary["latency"]["tpot_s"]["mean"]) < 0.10


@pytest.mark.parametrize("speculation", [SPEC, {"draft": "medusa", "heads": 3, "k": 3, "acceptance": {"alpha": 0.6}}],
                         ids=["draft model", "medusa"])
def test_a_grid_of_steps_is_priced_as_each_step_alone(speculation):
    """The draft's steps are priced once per distinct load of a grid and spread back over it: every
    grid point's iteration time (loads repeated and not, with prefill that differs point by point)
    equals that point's priced on its own."""
    model = FluidModel(make_scenario({"speculation": speculation}))
    work = model.works[0]
    rng = np.random.default_rng(7)
    load = rng.choice([0.0, 0.5, 3.0, 17.0, 40.0], size=(3, 4, 5)) + (np.arange(5) == 4) * rng.uniform(0, 9, 5)
    tokens = rng.uniform(0.0, 600.0, size=load.shape)
    prefill = model._prefill_rows(tokens, tokens * 100.0, np.minimum(tokens, 2.0), tokens)
    grid = model._iteration_time(load, prefill, work)
    alone = np.array([model._iteration_time(load[i][None], prefill[i][None], work)[0]
                      for i in np.ndindex(load.shape)]).reshape(load.shape)
    np.testing.assert_allclose(grid, alone, rtol=1e-12, atol=0.0)
    assert len(np.unique(grid)) > len(np.unique(load))      # the prefill, different at every point, is priced


def test_the_fluid_prefill_padding_is_the_tiles_closed_form_on_whole_tiles():
    """A prompt of whole tiles (B200's measured kernels: 64-token tiles, a query-tile cost): the fluid model's padding
    per fresh token, ``(t - 1) / 2 + q / t``, summed over the prompt equals the causal tiles' count (features'
    :func:`causal_tile_padding`, tile by tile) with ``q`` pairs per query tile."""
    from llmsim.cost.features import F, causal_tile_padding
    model = FluidModel(make_scenario({"hardware": "B200"}))
    tile, q = model.cost.prefill_tile_tokens, model.cost.prefill_query_tile_pairs
    assert tile > 0 and q > 0
    tokens = np.array([tile, 8.0 * tile, 100.0 * tile])
    rows = model._prefill_rows(tokens, tokens * (tokens + 1) / 2, np.ones(3), tokens)
    np.testing.assert_allclose(rows[:, F["prefill_tile_padding"]], causal_tile_padding(tokens, 0.0, tile, q),
                               rtol=1e-12)


@pytest.mark.parametrize("batch_tokens, rate", [(512, 16.0), (8192, 22.0)])
@pytest.mark.slow
def test_wide_expert_parallel_ttft_percentile_agrees_with_the_simulator(batch_tokens, rate):
    """DeepSeek-V3's wide expert parallelism (the shipped layout: 32 data-parallel ranks) near where its P95
    TTFT target binds: a prompt's prefill sets most of its TTFT, so the fluid TTFT at the 95th percentile of
    the prompt lengths, its budget queue's wait included, is within 10% of the simulated P95 (4,000 measured
    requests: its standard error is a few percent). A prefill step there is several decode steps long, so
    the budget's queue, priced at the mean step, would wait a fraction of what it does (16% short with a 512
    token budget); and the mean TTFT, which the fluid scan held to the limit before, is less than half the
    P95."""
    scenario = variant(as_scenario(REPO / "scenarios" / "deepseek-v3-h200-wide-ep.yaml"),
                       {"engine.max_batch_tokens": batch_tokens, "workload.num_requests": 5000,
                        "workload.arrival.rate": f"{rate}/s", "simulation.warmup": "60 s"})
    predicted = like_for_like(scenario).evaluate(rate, ttft_percentile=95).iloc[0]
    simulated = summarize(llmsim.simulate(scenario)).to_dict()["latency"]["ttft_s"]
    assert relative_error(predicted.ttft_percentile_s, simulated["p95"]) < 0.10
    assert simulated["mean"] < 0.5 * simulated["p95"]


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_the_remembered_tokens_table_is_leviathans_and_cannot_be_written(alpha):
    # Shared by every fluid model on one acceptance process: its values are the closed form, E[tokens per step]
    # = (1 - alpha^(k+1)) / (1 - alpha), on every call, and a caller cannot change them for the others.
    acceptance = Acceptance("bernoulli", alpha=alpha)
    k = np.arange(9)
    for _ in range(2):
        table = tokens_table(acceptance, 8)
        np.testing.assert_allclose(table[0], (1 - alpha ** (k + 1)) / (1 - alpha), rtol=1e-12)
        with pytest.raises(ValueError):
            table[0, 1] = 0.0
