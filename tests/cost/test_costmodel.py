"""The roofline cost model against first principles: bandwidth-bound decode, compute-bound prefill."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim import CostModel, lookup_hardware, model_catalog, place
from llmsim.cost.features import FEATURES
from llmsim.cost.work import decode_layer_work, prefill_layer_work

from tests.helpers import roofline_only


@pytest.fixture(scope="module")
def h100():
    """The H100 profile priced by the plain roofline: these tests check its first-principles laws (the
    measured kernel terms the shipped profile adds are checked in tests/calibration/test_kernel_terms.py)."""
    return roofline_only(lookup_hardware("H100-SXM"))


@pytest.fixture(scope="module")
def llama8b():
    return model_catalog()["Llama-3.1-8B"]


def effective_bandwidth(hw):
    return hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency


def effective_flops(hw, dtype="bf16"):
    return hw.peak_for(dtype) * hw.compute_efficiency


@pytest.mark.parametrize("model_name", ["Llama-3.1-8B", "Qwen2.5-7B", "Llama-2-13B"])
def test_batch_one_decode_is_bandwidth_bound(h100, model_name):
    """One token needs every weight once: time ~ weight bytes / bandwidth (+ fixed overheads)."""
    model = model_catalog()[model_name]
    cost = CostModel(model, h100)
    overhead = h100.per_step_overhead_s + model.num_layers * h100.per_layer_overhead_s
    # Every weight is read once, except the embedding table: a lookup gathers one row per token.
    read_bytes = model.weight_bytes - model.embedding_params * model.weight_bytes_per_param * \
        (0 if model.tie_word_embeddings else 1)
    weights_time = read_bytes / effective_bandwidth(h100)
    compute_part = cost.decode_time(1, 128) - overhead
    # Weights dominate; the KV cache of 128 tokens and the activations add well under 1%.
    assert compute_part == pytest.approx(weights_time, rel=0.01)
    bounds = cost.breakdown(cost.features([], [], [128]))
    assert set(bounds.loc[bounds["operator"].str.startswith("layer."), "bound"]) == {"memory", "none"}


def test_large_prefill_is_compute_bound(h100, llama8b):
    """A long prompt does 2 FLOPs per parameter per token: time ~ 2 P T / FLOP/s, plus attention."""
    cost = CostModel(llama8b, h100)
    tokens = 4096
    measured = cost.prefill_time(tokens)
    # The textbook estimate, with all 8.03B parameters:
    naive = 2 * llama8b.param_count * tokens / effective_flops(h100)
    assert measured == pytest.approx(naive, rel=0.15)
    # Precisely: embeddings are a lookup and only the last prompt token needs logits, so the
    # GEMMs cover the non-embedding parameters (Kaplan et al.'s N) for every token.
    non_embedding = llama8b.param_count - llama8b.embedding_params - llama8b.lm_head_params
    gemm_time = 2 * non_embedding * tokens / effective_flops(h100)
    # Causal attention over 4k tokens adds 4 * q_dim * T(T+1)/2 FLOPs per layer at attention efficiency.
    attention_time = (4 * llama8b.q_dim * tokens * (tokens + 1) / 2 * llama8b.num_layers
                      / (h100.peak_for("bf16") * h100.attention_efficiency))
    overhead = h100.per_step_overhead_s + llama8b.num_layers * h100.per_layer_overhead_s
    # Memory-bound leftovers: norms and residual adds stream the hidden state (8 accesses per
    # token per layer), and the LM head reads its whole weight matrix for the one last token.
    streams = (8 * tokens * llama8b.hidden_size * 2 * llama8b.num_layers
               + llama8b.vocab_size * llama8b.hidden_size * 2) / effective_bandwidth(h100)
    assert measured == pytest.approx(gemm_time + attention_time + streams + overhead, rel=0.01)
    assert gemm_time / measured > 0.85
    bounds = cost.breakdown(cost.features([tokens], [0], []))
    gemms = bounds[bounds["operator"].isin(["layer.qkv", "layer.out_proj", "layer.mlp"])]
    assert (gemms["bound"] == "compute").all()


def test_time_is_monotone_in_batch_and_context(h100, llama8b):
    cost = CostModel(llama8b, h100)
    batches = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    contexts = np.array([128, 512, 2048, 8192, 32768])
    grid = np.array([[cost.features([], [], [c] * b) for c in contexts] for b in batches])
    times, flops, moved = cost.iteration(grid.reshape(-1, len(FEATURES)))
    times = times.reshape(len(batches), len(contexts))
    assert (np.diff(times, axis=0) > 0).all()     # more sequences, more time
    assert (np.diff(times, axis=1) > 0).all()     # longer contexts, more time
    prefill = np.array([cost.prefill_time(t, c) for t in (256, 1024, 4096) for c in (0, 4096)]).reshape(3, 2)
    assert (np.diff(prefill, axis=0) > 0).all() and (np.diff(prefill, axis=1) > 0).all()


def test_decode_turns_compute_bound_at_large_batch(h100, llama8b):
    """The ridge point: past about peak/bandwidth tokens per weight byte, GEMMs become compute-bound."""
    cost = CostModel(llama8b, h100)
    ridge = effective_flops(h100) / effective_bandwidth(h100) * llama8b.weight_bytes_per_param / 2
    below = cost.breakdown(cost.features([], [], [64] * int(ridge / 2)))
    above = cost.breakdown(cost.features([], [], [64] * int(ridge * 2)))
    assert below.set_index("operator").loc["layer.mlp", "bound"] == "memory"
    assert above.set_index("operator").loc["layer.mlp", "bound"] == "compute"


def test_vectorised_matches_one_at_a_time(h100, llama8b):
    cost = CostModel(llama8b, h100, tensor_parallel=2)
    shapes = [cost.features([512], [0], [100] * 7), cost.features([], [], [4000] * 64),
              cost.features([2048, 100], [1000, 0], [])]
    together = cost.iteration(np.array(shapes))
    for i, x in enumerate(shapes):
        alone = cost.iteration(x)
        assert [float(part[i]) for part in together] == pytest.approx(list(alone), rel=1e-12)


def test_tensor_parallel_splits_weights_and_adds_all_reduces(h100):
    model = model_catalog()["Llama-2-70B"]
    single = CostModel(model, h100).decode_time(1, 512)
    tp8 = CostModel(model, h100, tensor_parallel=8)
    sharded = tp8.decode_time(1, 512)
    # Each device reads 1/8 of the weights, but two all-reduces per layer cost latency.
    assert single / 8 < sharded < single / 4
    all_reduce = 2 * model.num_layers * h100.interconnect_latency_s
    assert tp8.fixed_vector[0] >= all_reduce
    # The matmuls are split, not repeated: total FLOPs grow only by the norms and residual
    # adds, which every rank repeats on the full hidden state (10 FLOPs per element per layer).
    x = tp8.features([1024], [0], [])
    replicated = 10 * 1024 * model.hidden_size * model.num_layers
    assert tp8.iteration(x)[1] == pytest.approx(CostModel(model, h100).iteration(x)[1] + 7 * replicated, rel=1e-12)


def test_pipeline_parallel_adds_hops_not_work(h100):
    model = model_catalog()["Llama-3.1-70B"]
    x = CostModel(model, h100).features([], [], [1000] * 32)
    flat = CostModel(model, h100, tensor_parallel=4).iteration(x)
    piped = CostModel(model, h100, tensor_parallel=4, pipeline_parallel=2).iteration(x)
    assert piped[1] == pytest.approx(flat[1])       # same FLOPs
    assert piped[0] > flat[0]                        # plus activation hops between stages


def test_moe_decode_reads_only_touched_experts(h100):
    mixtral = model_catalog()["Mixtral-8x7B"]
    assert mixtral.expected_experts_touched(1) == pytest.approx(2.0)
    assert mixtral.expected_experts_touched(64) == pytest.approx(8.0, rel=1e-3)
    cost = CostModel(mixtral, h100, tensor_parallel=2)
    one = cost.decode_time(1, 128)
    # Batch 1 reads ~ the active parameters (top-2 experts), not all 46.7B.
    active_bytes = mixtral.active_param_count * mixtral.weight_bytes_per_param / 2
    total_bytes = mixtral.weight_bytes / 2
    assert one < total_bytes / effective_bandwidth(h100)
    assert one > active_bytes / effective_bandwidth(h100)


def test_memory_plan_leaves_the_rest_for_kv(h100):
    llama70 = model_catalog()["Llama-2-70B"]
    assert not place(llama70, h100, 1, 1, 0.9, 128, 8192, 2 ** 30).fits
    plan = place(llama70, h100, 8, 1, 0.9, 128, 8192, 2 ** 30)
    assert plan.fits
    assert plan.weights_per_device_bytes == pytest.approx(llama70.weight_bytes / 8)
    # 8 KV heads over 8 devices: one head per device, 80 layers, K and V, bf16.
    assert plan.kv_bytes_per_token_per_device == 80 * 2 * 1 * 128 * 2
    assert plan.num_blocks == int(plan.kv_per_device_bytes // (plan.kv_bytes_per_token_per_device * 128))


def test_layer_work_prefill_and_decode():
    model = model_catalog()["Llama-3.1-8B"]
    decode = decode_layer_work(model, batch=1, context=1000)
    prefill = prefill_layer_work(model, tokens=1000)
    # Decode reads every weight for one token; prefill does the same reads for 1000x the FLOPs.
    assert decode["mlp"][1] == pytest.approx(model.expert_params * 2, rel=1e-3)
    assert prefill["mlp"][0] == pytest.approx(1000 * decode["mlp"][0])
    # Decode attention reads the 1001-token KV of one layer.
    assert decode["attention_decode"][1] >= 1001 * model.kv_bytes_per_token_per_layer
