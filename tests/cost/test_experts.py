"""Expert parallelism's cost (llmsim.cost.experts) against independent truth: the all-to-all bytes of a token,
the fitted all-to-all lines read straight from the profile's YAML, the exact expected maximum of a
multinomial, the plain MoE cost at degree 1, and DeepSeek-V3's weights per GPU counted by hand."""
from __future__ import annotations


from dataclasses import replace

import numpy as np
import pytest
import yaml
from scipy.stats import poisson

from llmsim.catalog.hardware import lookup_hardware
from llmsim.catalog.models import model_catalog
from llmsim.cost.experts import (BusiestRank, ExpertParallel, ExpertParallelCostModel, UniformRouting, ZipfRouting,
                                 all_to_all_bytes_per_token_per_layer, all_to_all_terms, rank_shares,
                                 weight_bytes_per_device)
from llmsim.cost.features import F
from llmsim.cost.roofline import CostModel

from tests.helpers import REPO, random_sums

MODELS = model_catalog()
DEEPSEEK = MODELS["DeepSeek-V3"]
QWEN_MOE = MODELS["Qwen3-30B-A3B"]


def expert_cost(model, hardware, layout, tp=1, seed=0):
    busiest = BusiestRank(rank_shares(model, layout, seed), seed)
    return ExpertParallelCostModel(model, hardware, tp, 1, None, layout, busiest, all_to_all_terms(hardware, "vllm"))


def test_all_to_all_bytes_per_token_per_layer_are_hidden_times_top_k_times_bytes_off_the_gpu():
    # DeepSeek-V3: hidden 7168, top-8, bf16 activations; 31 of 32 ranks are elsewhere.
    assert all_to_all_bytes_per_token_per_layer(DEEPSEEK, 32) == pytest.approx(7168 * 8 * 2 * 31 / 32, rel=1e-12)
    assert all_to_all_bytes_per_token_per_layer(DEEPSEEK, 1) == 0.0


def _profile_all_to_all(path: str, group: int) -> dict:
    """The fitted all-to-all line of ``group`` GPUs, read from the profile file itself."""
    document = yaml.safe_load((REPO / "hardware_profiles" / path).read_text())
    return document["calibration"]["database"]["engines"]["vllm"]["recorded_only"]["all_to_all"][group]


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_dispatch_and_combine_follow_the_fitted_all_to_all_of_the_profile(degree):
    """Within a node: two all-to-alls per MoE layer, each the lesser of the fitted small- and large-message lines
    over the bytes that leave the GPU, with the bus shares applied to the datasheet NVLink bandwidth."""
    hardware = lookup_hardware("H200")
    line = _profile_all_to_all("h200.yaml", degree)
    link = 450e9                                     # h200.yaml interconnect_bandwidth
    cost = expert_cost(QWEN_MOE, hardware, ExpertParallel(degree))
    for tokens in (1, 64, 4096):
        leaving = tokens * QWEN_MOE.hidden_size * QWEN_MOE.experts_per_token * 2 * (degree - 1) / degree
        once = min(line["latency_s"] + leaving / (line["bus_share"] * link),
                   line["large_latency_s"] + leaving / (line["large_bus_share"] * link))
        assert float(cost.all_to_all_time_per_layer_s(tokens)) == pytest.approx(2 * once, rel=1e-9)


def test_across_nodes_the_off_node_share_crosses_the_scale_out_link():
    hardware = lookup_hardware("H200")
    layout = ExpertParallel(32, devices_per_node=8, scale_out_bandwidth_bytes_per_s=50e9)
    cost = expert_cost(QWEN_MOE, hardware, layout)
    line = _profile_all_to_all("h200.yaml", 8)
    tokens = 8192                                     # large: the scale-out link binds
    buffer = tokens * QWEN_MOE.hidden_size * QWEN_MOE.experts_per_token * 2
    off_node = buffer * 24 / 32
    assert float(cost.all_to_all_time_per_layer_s(tokens)) == pytest.approx(
        2 * (line["large_latency_s"] + off_node / 50e9), rel=1e-9)


# -- the busiest rank --------------------------------------------------------------------------------------------
def exact_expected_maximum(assignments: int, shares) -> float:
    """E[max_r L_r] for L ~ Multinomial(assignments, shares), exactly, by Poissonization: with independent
    N_r ~ Poisson(p_r A), P(max_r L_r <= m) = P(all N_r <= m, sum N_r = A) / P(sum N_r = A), the numerator the
    A-th coefficient of the product of the N_r's pmfs truncated at m; and E[max] = sum_m P(max > m)."""
    a = assignments
    p = np.asarray(shares, dtype=float) / sum(shares)
    counts = np.arange(a + 1)
    pmfs = [poisson.pmf(counts, q * a) for q in p]
    total = poisson.pmf(a, a)                             # P(sum N_r = A): the sum is Poisson(A)
    expected = 0.0
    for m in range(a):
        if m * len(p) < a:                                # the ranks cannot hold them all: max > m surely
            expected += 1.0
            continue
        product = np.ones(1)
        for pmf in pmfs:
            product = np.convolve(product, pmf[:m + 1])[:a + 1]
        below = product[a] / total if len(product) > a else 0.0
        expected += 1.0 - below
        if 1.0 - below < 1e-13:
            break
    return expected


@pytest.mark.parametrize("shares", [[0.25] * 4, [0.4, 0.3, 0.2, 0.1], [1 / 3] * 3 + [0.0]],
                         ids=["uniform", "skewed", "one-idle"])
@pytest.mark.parametrize("assignments", [2, 8, 32])
def test_the_busiest_rank_expects_the_exact_multinomial_maximum(shares, assignments):
    busiest = BusiestRank(np.array(shares), seed=3)
    at = int(np.flatnonzero(busiest.assignments == assignments)[0])
    exact = exact_expected_maximum(assignments, shares)
    assert float(busiest.load(assignments)) == pytest.approx(exact, abs=4 * busiest.standard_error[at] + 1e-12)


@pytest.mark.parametrize("ranks", [8, 32])
@pytest.mark.parametrize("assignments", [3, 45, 100, 181, 700])
def test_between_tabulated_counts_the_interpolation_stays_within_the_monte_carlo_error(ranks, assignments):
    """Counts the table does not hold (the simulator asks for any): within four standard errors of the
    neighbouring points of the exact expected maximum."""
    busiest = BusiestRank(np.full(ranks, 1.0 / ranks), seed=9)
    above = int(np.searchsorted(busiest.assignments, assignments))
    error = max(busiest.standard_error[above - 1], busiest.standard_error[above])
    exact = exact_expected_maximum(assignments, [1.0 / ranks] * ranks)
    assert float(busiest.load(assignments)) == pytest.approx(exact, abs=4 * error)


def test_one_rank_takes_every_assignment():
    busiest = BusiestRank(np.array([1.0]), seed=0)
    assert np.allclose(busiest.load([0.0, 1.0, 3.0, 1e9]), [0.0, 1.0, 3.0, 1e9])


def test_balancing_with_redundant_experts_lowers_the_busiest_share_under_skew():
    skew = ZipfRouting(1.2)
    static = rank_shares(DEEPSEEK, ExpertParallel(32, routing=skew), seed=5)
    balanced = rank_shares(DEEPSEEK, ExpertParallel(32, 32, True, skew), seed=5)
    assert static.sum() == pytest.approx(1.0) and balanced.sum() == pytest.approx(1.0)
    assert balanced.max() < static.max()
    # The hottest expert alone outweighs a fair share: replicas split it (1 / H_256,1.2 ~ 0.25 of the tokens).
    hottest = skew.popularity(256)[0]
    assert static.max() >= hottest > 1 / 32
    assert balanced.max() < hottest


def test_the_step_waits_for_the_busiest_rank():
    """Skewed routing without balancing costs more than uniform routing at the same batch."""
    hardware = lookup_hardware("H200")
    uniform = expert_cost(QWEN_MOE, hardware, ExpertParallel(8))
    skewed = expert_cost(QWEN_MOE, hardware, ExpertParallel(8, routing=ZipfRouting(1.0)))
    x = uniform.features([], [], [1024] * 128)
    assert skewed.expert_time_s(x) > uniform.expert_time_s(x)
    assert skewed.busiest_assignments(128) > uniform.busiest_assignments(128) >= 128 * 8 * 8 / 8


# -- degree 1 is the plain MoE cost ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [QWEN_MOE, DEEPSEEK], ids=["qwen3-30b-a3b", "deepseek-v3-fp8"])
def test_degree_one_is_the_plain_moe_cost(model):
    hardware = lookup_hardware("H100-SXM")
    plain = CostModel(model, hardware, 1, 1)
    ep = expert_cost(model, hardware, ExpertParallel(1, routing=UniformRouting()))
    batches = [([], [], [512] * 1), ([], [], [2048] * 96), ([3000], [0], []), ([700], [100], [900] * 30)]
    rows = np.array([plain.features(*b) for b in batches])
    for row in rows:
        assert ep.iteration(row)[0] == pytest.approx(plain.iteration(row)[0], rel=1e-9)
    assert np.allclose(ep.iteration(rows)[0], plain.iteration(rows)[0], rtol=1e-9)
    assert np.allclose(ep.iteration(rows)[1], plain.iteration(rows)[1], rtol=1e-9)   # FLOPs too


# -- memory ------------------------------------------------------------------------------------------------------
def test_deepseek_v3_weights_per_gpu_by_hand():
    """DeepSeek-V3 (config.json) at EP 32 with 32 redundant experts, tp 1: 9 whole fp8 experts of each of the
    58 MoE layers, plus everything else (fp8 linear layers, bf16 embedding and LM head, norms) whole."""
    h, layers, moe_layers = 7168, 61, 58
    expert = 3 * h * 2048
    mla = (h * 1536 + 1536 + 1536 * 128 * 192          # q_a (+ its norm), q_b
           + h * (512 + 64) + 512 + 512 * 128 * (128 + 128)   # kv_a (+ norm), kv_b
           + 128 * 128 * h + 2 * h)                      # o_proj, two layer norms
    dense_mlp = 3 * h * 18432
    shared_and_router = 3 * h * 2048 + h * 256
    fp8_params = layers * mla + 3 * dense_mlp + moe_layers * shared_and_router + h      # + the final norm
    embedding_bytes = 2 * 129280 * h * 2                 # untied embedding and LM head, bf16
    expected = fp8_params + embedding_bytes + 9 * expert * moe_layers
    layout = ExpertParallel(32, 32, True)
    assert weight_bytes_per_device(DEEPSEEK, 1, 1, layout) == pytest.approx(expected, rel=1e-12)
    # Two pipeline stages halve both parts; tp 2 halves the rest but not the experts.
    assert weight_bytes_per_device(DEEPSEEK, 1, 2, layout) == pytest.approx(expected / 2, rel=1e-12)
    assert weight_bytes_per_device(DEEPSEEK, 2, 1, layout) == pytest.approx(
        (fp8_params + embedding_bytes) / 2 + 9 * expert * moe_layers, rel=1e-12)


def test_a_malformed_all_to_all_record_counts_as_none():
    hardware = lookup_hardware("H200")
    good = hardware.calibration["database"]
    broken = {"engines": {"vllm": {"recorded_only": {"all_to_all": {8: {"latency_s": 1e-5, "bus_share": -1.0,
                                                                       "large_latency_s": 1e-5,
                                                                       "large_bus_share": 0.6}}}}}}
    assert all_to_all_terms(replace(hardware, calibration={"database": broken}), "vllm") == {}
    assert all_to_all_terms(replace(hardware, calibration={"database": {"engines": "x"}}), "vllm") == {}
    assert set(all_to_all_terms(replace(hardware, calibration={"database": good}), "sglang")) == {2, 4, 8}


def test_the_simulators_step_path_prices_what_iteration_prices():
    """The engine calls step() each iteration; it must add the MoE layers' time as iteration() does."""
    hardware = lookup_hardware("H200")
    cost = expert_cost(QWEN_MOE, hardware, ExpertParallel(8, routing=ZipfRouting(1.0)))
    for prefill, context, decode in (([], [], [512] * 64), ([2048], [0], []), ([700], [100], [900] * 30)):
        x = cost.features(prefill, context, decode)
        prefill_terms = x[F["prefill_tile_padding"]], x[F["prefill_longest_keys"]]
        stepped = cost.step(x[F["prefill_tokens"]], x[F["prefill_pairs"]], x[F["prefill_kv_read"]],
                            x[F["logit_tokens"]] - x[F["decode_seqs"]], x[F["decode_seqs"]], x[F["decode_kv_read"]],
                            *prefill_terms)
        assert stepped == pytest.approx(tuple(float(v) for v in cost.iteration(x)), rel=1e-12)
        assert stepped[0] > CostModel.step(cost, *(x[F[name]] for name in (
            "prefill_tokens", "prefill_pairs", "prefill_kv_read")), x[F["logit_tokens"]] - x[F["decode_seqs"]],
            x[F["decode_seqs"]], x[F["decode_kv_read"]], *prefill_terms)[0]


@pytest.mark.parametrize("model, layout, tp", [
    (DEEPSEEK, ExpertParallel(32, redundant_experts=32, balance=True, devices_per_node=8,
                              scale_out_bandwidth_bytes_per_s=50e9, routing=ZipfRouting(0.6)), 1),
    (QWEN_MOE, ExpertParallel(8, routing=ZipfRouting(1.0)), 2)])
def test_step_prices_an_iteration_to_the_last_bit(model, layout, tp):
    """step() (scalars, the simulator's path) and iteration() (numpy rows) give the same time, FLOPs and bytes
    bit for bit, memo miss and hit alike: records are compared bit for bit across speed changes."""
    cost = expert_cost(model, lookup_hardware("H200"), layout, tp)
    sums = random_sums(np.random.default_rng(35), 300)
    for _ in range(2):
        for prefill, pairs, prefill_kv, logits, decode, decode_kv in sums:
            tokens = prefill + decode
            padding, longest = (float(prefill % 4096), prefill_kv) if prefill else (0.0, 0.0)
            row = np.array([1.0, tokens, prefill, pairs, prefill_kv, decode, decode_kv,
                            model.expected_experts_touched(tokens), decode + logits, padding, longest])
            stepped = cost.step(prefill, pairs, prefill_kv, logits, decode, decode_kv, padding, longest)
            assert stepped == tuple(float(v) for v in cost.iteration(row))


def test_a_decode_only_step_prices_as_the_general_step_does():
    """decode_step, with the MoE layers' terms remembered by the batch size, is step() to the last bit."""
    layout = ExpertParallel(32, redundant_experts=32, balance=True, devices_per_node=8,
                            scale_out_bandwidth_bytes_per_s=50e9, routing=ZipfRouting(0.6))
    cost = expert_cost(DEEPSEEK, lookup_hardware("H200"), layout, 1)
    reference = expert_cost(DEEPSEEK, lookup_hardware("H200"), layout, 1)
    rng = np.random.default_rng(9)
    for seqs in [*rng.integers(1, 128, 100), 5, 5]:
        kv_read = int(rng.integers(seqs, seqs * 9000))
        assert cost.decode_step(int(seqs), kv_read) == reference.step(0.0, 0.0, 0.0, 0, int(seqs), kv_read)


def test_cost_models_pricing_alike_share_one_memo_and_no_other():
    """A search builds a cost model per run: those with the same MoE terms share the memo of the busiest rank's
    time, a different seed's routing table (another busiest-rank load) or degree does not; prices are the same."""
    hardware = lookup_hardware("H200")
    layout = ExpertParallel(8, routing=ZipfRouting(1.0))
    first = expert_cost(QWEN_MOE, hardware, layout, seed=3)
    priced = first.step(0.0, 0.0, 0.0, 0, 64, 64 * 1500)
    again = expert_cost(QWEN_MOE, hardware, layout, seed=3)
    assert again._memo is first._memo
    assert again.step(0.0, 0.0, 0.0, 0, 64, 64 * 1500) == priced
    other_seed = expert_cost(QWEN_MOE, hardware, layout, seed=4)
    other_degree = expert_cost(QWEN_MOE, hardware, ExpertParallel(4, routing=ZipfRouting(1.0)), seed=3)
    assert other_seed._memo is not first._memo and other_degree._memo is not first._memo
    assert other_seed.step(0.0, 0.0, 0.0, 0, 64, 64 * 1500)[0] != priced[0]
