"""Proposers (EAGLE / MTP heads, Medusa, n-gram with CPU cost), tree verification, speculation
with pipeline stages, and the eligibility report, against closed forms written out here.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml

from llmsim import simulate
from llmsim.analysis.metrics import summarize
from llmsim.cli.main import main
from llmsim.catalog.models import model_catalog
from llmsim.cost.features import F, batch_features
from llmsim.cost.roofline import CostModel
from llmsim.sim.speculative_kernels import tree_extras
from llmsim.speculation.config import Acceptance
from llmsim.speculation.proposers import NGRAM_CPU_S_PER_CONTEXT_TOKEN, NgramCost
from llmsim.workload.generate import generate_trace

from tests.helpers import make_scenario, roofline_only, tpot_mean_s


# -- tree verification -------------------------------------------------------------------------
@pytest.mark.parametrize("alpha, branching, depth", [(0.6, 1, 5), (0.6, 2, 4), (0.4, 3, 3), (0.8, 2, 6)])
def test_tree_accepted_length_matches_its_closed_form(alpha, branching, depth):
    """A full b-ary tree of depth d: every node has b children, the b candidates for the next
    token. The target follows one path: at most one child of a node is its token (greedy: its
    argmax; sampling: the one recursive rejection sampling keeps). With i.i.d. acceptance each
    candidate is that token with chance alpha independently, so a level is accepted when any of
    its b candidates is: beta = 1 - (1 - alpha)^b, and the levels are accepted in turn until the
    first miss. The accepted length a is then a chain of depth d at rate beta:

        P(a >= j) = beta^j,   E[a] = sum_{j=1..d} beta^j = beta (1 - beta^d) / (1 - beta),

    and the tokens a verify step emits, a + 1, have mean (1 - beta^(d+1)) / (1 - beta). For b = 1,
    beta = alpha: Leviathan's Eq. 1 for the chain. Checked on the simulator's draws within
    four standard errors of the mean (variance from the same distribution).
    """
    n = 40000
    ids = np.arange(n, dtype=np.int64)
    positions = (ids * 13) % 997
    accepted = Acceptance("bernoulli", alpha=alpha).draws(12345, branching)
    out = np.empty(n, dtype=np.int64)
    accepted(ids, positions, np.full(n, alpha), np.full(n, depth), out)
    beta = 1 - (1 - alpha) ** branching
    p_at_least = beta ** np.arange(1, depth + 1)
    mean = p_at_least.sum()
    second = ((2 * np.arange(1, depth + 1) - 1) * p_at_least).sum()      # E[a^2] = sum (2j - 1) P(a >= j)
    se = math.sqrt((second - mean ** 2) / n)
    assert abs(out.mean() - mean) < 4 * se
    if branching == 1:
        assert out.mean() + 1 == pytest.approx((1 - alpha ** (depth + 1)) / (1 - alpha), abs=4 * se)


def test_a_tree_accepts_at_least_what_the_chain_accepts_on_the_same_tokens():
    """Common random numbers: one uniform per output position decides chain and tree alike."""
    n = 5000
    ids = np.arange(n, dtype=np.int64)
    chain, tree = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    acceptance = Acceptance("bernoulli", alpha=0.5)
    acceptance.draws(7, 1)(ids, ids, np.full(n, 0.5), np.full(n, 4), chain)
    acceptance.draws(7, 3)(ids, ids, np.full(n, 0.5), np.full(n, 4), tree)
    assert (tree >= chain).all() and tree.mean() > chain.mean()


def test_the_verify_pass_prices_every_tree_node():
    """Enumerate the tree's nodes one by one: a node at depth j (1..k) attends to the sequence's
    visible context, the root, its j - 1 ancestors and itself; the chain has one node a level.
    The kernel's extras (tree minus chain) must equal that enumeration, and the draft's step j
    must gain b^j - 1 queries per drafting sequence."""
    branching, context, k = 3, np.array([100, 7, 50]), np.array([3, 0, 2])
    tokens = pairs = 0
    for c, depth in zip(context, k):
        for j in range(1, depth + 1):
            nodes = branching ** j
            tokens += nodes - 1
            pairs += (nodes - 1) * (c + j + 1)
    rows = np.zeros((3, len(F)))
    rows[:, F["decode_seqs"]] = [2, 2, 1]
    rows[:, F["decode_kv_read"]] = [152, 154, 103]
    got = tree_extras(3, k, context, 0, branching, rows, 3)
    assert got == (tokens, pairs)
    assert list(rows[:, F["tokens"]]) == [0, 2 * 2, 1 * 8]
    assert list(rows[:, F["prefill_pairs"]]) == [0, 2 * 154, 8 * 103]


# -- heads -------------------------------------------------------------------------------------------
def h100_8b(speculation: dict, **overrides):
    return make_scenario({"model": "Llama-3.1-8B", "speculation": speculation, **overrides})


def test_eagle_head_adds_one_layer_a_fusion_layer_and_one_layer_of_kv():
    """Llama-3.1-8B: hidden 4096, 32 heads of 128, 8 KV heads, FFN 14336. An EAGLE head is one
    decoder layer (q 4096x4096, k and v 4096x1024 each, o 4096x4096, gate/up/down 3x4096x14336,
    two norms) plus the fusion layer (2 x 4096 x 4096); embedding and LM head are the target's."""
    hidden, ffn = 4096, 14336
    layer = hidden * (hidden + 2 * 1024) + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    head_params = layer + 2 * hidden * hidden
    plain = make_scenario({"model": "Llama-3.1-8B"})
    eagle = h100_8b({"draft": "eagle"})
    assert eagle.speculation.draft.param_count == head_params
    added = eagle.memory.weights_per_device_bytes - plain.memory.weights_per_device_bytes
    assert added == pytest.approx(head_params * 2)                        # bf16
    per_token_kv = 2 * 1024 * 2                                          # one layer's K and V, bf16
    assert eagle.memory.kv_bytes_per_token_per_device == pytest.approx(
        plain.memory.kv_bytes_per_token_per_device + per_token_kv)


def test_a_draft_head_step_costs_one_layer_and_the_lm_head():
    """A head's draft step is the target's cost model with one layer instead of 32: the
    difference between the target's decode step and the head's is 31 layers' work."""
    target = make_scenario({"model": "Llama-3.1-8B"})
    head = h100_8b({"draft": "eagle"}).speculation.draft
    target_cost, head_cost = CostModel(target.model, target.hardware), CostModel(head, target.hardware)
    x = target_cost.features([], [], [500] * 8)
    per_layer = (target_cost.iteration(x)[1] - head_cost.iteration(x)[1]) / 31
    lm_head = 2 * 4096 * 128256 * 8
    assert head_cost.iteration(x)[1] == pytest.approx(per_layer + lm_head, rel=1e-9)


def test_medusa_heads_run_once_per_step_whatever_k():
    """Medusa's heads (h x h block + h x vocab LM head each) all run in one pass: its draft time
    at k = 1 and k = 4 is the same, a memory-bound read of the heads' weights at low batch."""
    scenario = h100_8b({"draft": "medusa", "heads": 4, "k": 4})
    from llmsim.scenario.deployment import ResolvedDeployment
    cost = ResolvedDeployment.of(scenario).draft_cost
    hw = scenario.hardware
    weights = 4 * (4096 * 4096 + 4096 * 128256) * 2
    _, _, memory_efficiency = hw.efficiencies_for("bf16")
    expected = weights / (hw.memory_bandwidth_bytes_per_s * memory_efficiency) + hw.per_step_overhead_s
    rows = np.zeros((4, len(F)))
    rows[:, F["decode_seqs"]] = 2
    assert cost.iteration(rows[:1])[0][0] == pytest.approx(expected)
    one = simulate(h100_8b({"draft": "medusa", "heads": 4, "k": 1, "acceptance": {"alpha": 0.0}},
                           workload={"num_requests": 30}))
    four = simulate(h100_8b({"draft": "medusa", "heads": 4, "k": 4, "acceptance": {"alpha": 0.0}},
                            workload={"num_requests": 30}))
    per_step = [r.iterations.query("spec_seqs == 1 and prefill_seqs == 0")["draft_s"] for r in (one, four)]
    assert per_step[0].min() == pytest.approx(per_step[1].min()) == pytest.approx(cost.iteration(
        np.eye(len(F))[F["decode_seqs"]])[0])


# -- n-gram with a CPU cost ----------------------------------------------------------------------------
NGRAM_BASE = {"model": "Llama-3.1-8B", "seed": 3, "engine": {"max_num_seqs": 256, "max_batch_tokens": 8192},
              "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 2.0},
                           "prompt_tokens": {"distribution": "fixed", "value": 256},
                           "output_tokens": {"distribution": "fixed", "value": 128}}}
CPU_S = 100e-6


def ngram_runs(rate: float):
    """Plain and n-gram runs on the roofline-priced profile, whose hard memory/compute corner the test's
    "once verify is compute-bound" reasoning is about (measured kernels bend it smoothly)."""
    base = {**NGRAM_BASE, "workload": {**NGRAM_BASE["workload"], "arrival": {"process": "poisson", "rate": rate}}}
    plain = roofline(make_scenario(base))
    trace = generate_trace(plain.workload, plain.seed)
    spec = {"draft": "ngram", "k": 4, "acceptance": {"alpha": 0.6}, "ngram_cpu_per_sequence": f"{CPU_S * 1e6:g} us",
            "ngram_cpu_per_context_token": "0 s"}
    return plain, simulate(plain, trace), simulate(roofline(make_scenario({**base, "speculation": spec})), trace)


def roofline(scenario):
    return dataclasses.replace(scenario, hardware=roofline_only(scenario.hardware))


def test_ngram_cpu_cost_slows_the_engine_once_verify_is_compute_bound():
    """Every step the lookup takes CPU_S per speculating sequence before the GPU step: the log's
    draft time is exactly that. At a low load (a few sequences, a memory-bound step) speculation
    still pays: TPOT falls. At a load where the verify pass of the run's speculating batch is
    compute-bound (its MLP's FLOPs take longer than its weight reads, by the cost model's own
    breakdown), the CPU time comes on top of a step that already grows with every token: the
    engine takes longer than plain decoding to emit the same tokens, and TPOT rises."""
    plain_scenario, plain_low, spec_low = ngram_runs(2.0)
    it = spec_low.iterations
    assert np.allclose(it["draft_s"], it["spec_seqs"] * CPU_S)
    assert tpot_mean_s(spec_low) < tpot_mean_s(plain_low)

    _, plain_high, spec_high = ngram_runs(150.0)
    it = spec_high.iterations
    assert np.allclose(it["draft_s"], it["spec_seqs"] * CPU_S)
    busy = it[it["spec_seqs"] > 0]
    batch = int(np.average(busy["spec_seqs"], weights=busy["duration_s"]))
    cost = CostModel(plain_scenario.model, plain_scenario.hardware)
    verify = cost.breakdown(cost.features([4 * batch], [400 * batch], [], prefill_logits=0) + 0)
    assert verify.set_index("operator").loc["layer.mlp", "bound"] == "compute"
    # The same requests (same tokens) all finish later than with plain decoding, and TPOT rises.
    assert spec_high.requests["finish_s"].max() > plain_high.requests["finish_s"].max()
    assert tpot_mean_s(spec_high) > tpot_mean_s(plain_high)


# -- pipeline parallelism -------------------------------------------------------------------------------
def test_speculation_runs_with_pipeline_stages():
    """Two pipeline stages, each micro-batch engine with its own speculative decode set: every
    token is accounted for, and the acceptance matches the configured rate (accepted / proposed
    within four standard errors of a binomial-like count over the proposed tokens' prefixes)."""
    scenario = make_scenario({"model": "Llama-3.1-8B", "deployment": {"tensor_parallel": 1, "pipeline_parallel": 2},
                              "workload": {"num_requests": 120},
                              "speculation": {"draft": "Llama-3.2-1B", "k": 1, "acceptance": {"alpha": 0.6}}})
    result = simulate(scenario)
    assert scenario.deployment.pipeline_parallel == 2
    assert set(result.iterations["micro_batch"]) == {0, 1}
    records = result.requests
    assert (records["status"] == "finished").all()
    it = result.iterations
    proposed, accepted = it["draft_tokens"].sum(), it["accepted_tokens"].sum()
    assert abs(accepted / proposed - 0.6) < 4 * math.sqrt(0.6 * 0.4 / proposed)     # k = 1: one Bernoulli each
    emitted = it["tokens_out"].sum()
    assert emitted == records["output_tokens"].sum()


# -- eligibility made visible ---------------------------------------------------------------------------
def single_stream(**eligibility):
    """One request at a time (each arrives after the previous is long done): the latency-sensitive
    single stream where speculation helps most."""
    return make_scenario({"model": "Llama-3.1-8B", "workload": {
        "num_requests": 20, "arrival": {"process": "deterministic", "rate": 0.5},
        "prompt_tokens": {"distribution": "fixed", "value": 200},
        "output_tokens": {"distribution": "fixed", "value": 100}},
        "speculation": {"draft": "Llama-3.2-1B", "k": 4, "eligibility": eligibility}})


def test_the_summary_says_which_rule_blocked_speculation_and_warns():
    """A single stream never has two requests running: the default min_concurrent_requests of 2
    blocks every sequence-step, and the summary says so and warns; with 1 every step speculates
    except each request's last token (remaining - 1 = 0: nothing left to draft)."""
    blocked = summarize(simulate(single_stream())).to_dict()["speculation"]
    assert blocked["blocked_share"]["min_concurrent_requests"] == 1.0
    assert blocked["speculating_fraction"] == 0.0
    assert "min_concurrent_requests" in blocked["warning"]
    free = summarize(simulate(single_stream(min_concurrent_requests=1))).to_dict()["speculation"]
    assert free["warning"] is None
    assert free["blocked_share"]["min_concurrent_requests"] == 0.0
    assert free["blocked_share"]["speculated"] > 0.9
    assert sum(free["blocked_share"].values()) == pytest.approx(1.0)


# -- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculation, model, words", [
    ({"draft": "Llama-3.1-70B"}, "Llama-3.1-8B", "not smaller than the target"),
    ({"draft": "Llama-2-7B"}, "Llama-3.1-8B", "vocabulary"),
    ({"draft": "eagle", "placement": "separate"}, "Llama-3.1-8B", "hidden states"),
    ({"draft": "medusa", "heads": 3, "k": 4}, "Llama-3.1-8B", "one token per head"),
    ({"draft": "ngram", "ngram_cpu_per_sequence": "fast"}, "Llama-3.1-8B", "ngram_cpu_per_sequence"),
    ({"draft": "mtp"}, "Llama-3.1-8B", "ships no multi-token-prediction module"),
])
def test_unverifiable_drafts_exit_2(tmp_path, capsys, speculation, model, words):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": model, "hardware": "H100-SXM", "speculation": speculation,
                                    "workload": {"arrival": {"rate": 1}, "num_requests": 10}}))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err


def test_a_larger_draft_or_another_vocabulary_can_be_allowed_explicitly():
    larger = make_scenario({"model": "Llama-3.2-1B", "engine": {"max_model_len": 8192},
                            "speculation": {"draft": "Llama-3.1-8B", "allow_larger_draft": True}})
    assert larger.speculation.draft.name == "Llama-3.1-8B"
    other = h100_8b({"draft": "Llama-2-7B", "allow_different_vocabulary": True, "allow_larger_draft": False})
    assert other.speculation.draft.vocab_size != other.model.vocab_size
    trained = h100_8b({"draft": "mtp", "allow_missing_mtp": True})
    assert trained.speculation.proposer.kind == "mtp" and trained.model.mtp_modules == 0


# -- chunked prefill of long prompts ---------------------------------------------------------------------
def test_the_draft_prefills_each_chunk_of_a_long_prompt_with_the_target():
    """A 6,000-token prompt under a 2,048-token budget is prefilled in chunks over three
    iterations; the draft model prefills each chunk in the same iteration (its first step), so an
    iteration that only prefills costs the target's chunk plus the draft's chunk at the same
    context: the first chunk (context 0, no logits) is priced by the draft's own cost model."""
    scenario = make_scenario({"model": "Llama-3.1-8B", "engine": {"max_batch_tokens": 2048, "max_num_seqs": 4},
                              "workload": {"num_requests": 1, "arrival": {"process": "deterministic", "rate": 1.0},
                                           "prompt_tokens": {"distribution": "fixed", "value": 6000},
                                           "output_tokens": {"distribution": "fixed", "value": 50}},
                              "speculation": {"draft": "Llama-3.2-1B", "k": 3,
                                              "eligibility": {"min_concurrent_requests": 1}}})
    result = simulate(scenario)
    chunks = result.iterations[result.iterations["prefill_seqs"] == 1]
    assert list(chunks["prefill_tokens"]) == [2048, 2048, 6000 - 4096]
    draft = CostModel(scenario.speculation.draft, scenario.hardware)
    first = draft.step_time(draft.features([2048], [0], [], prefill_logits=0))
    assert chunks["draft_s"].iloc[0] == pytest.approx(first)
    assert chunks["draft_s"].iloc[1] > first                     # the same chunk size over 2,048 cached tokens
    assert result.requests["status"].eq("finished").all()
    assert summarize(result).to_dict()["speculation"]["blocked_share"]["speculated"] > 0.8


def test_the_ngram_lookup_costs_a_scan_of_every_speculating_context():
    """vLLM's lookup scans each sequence's context once a step: CPU time = sequences x per-sequence cost +
    tokens scanned x per-token cost, linear in both (the default per-token figure is PR 56732's measured
    70.28 ms for 512 sequences of 129,536 tokens on one thread)."""
    model = model_catalog()["Llama-3.1-8B"]
    lookup = NgramCost(20e-6, NGRAM_CPU_S_PER_CONTEXT_TOKEN)
    contexts = np.array([100, 4_000, 30_000])
    row = batch_features([], [], contexts, 0, model)
    expected = 3 * 20e-6 + (contexts + 1).sum() * NGRAM_CPU_S_PER_CONTEXT_TOKEN     # each attends to itself too
    assert float(lookup.iteration(row)[0]) == pytest.approx(expected, rel=1e-12)
