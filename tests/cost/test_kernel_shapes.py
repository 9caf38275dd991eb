"""The measured-kernel path prices every GEMM of a layer by its type: MLA's projections, the router, shared
experts and the first-k dense layers (DeepSeek-V3, Qwen-MoE), checked against FLOPs and bytes per token
worked out by hand from DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3):

hidden_size 7168, num_hidden_layers 61, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512,
qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, intermediate_size 18432 (the first 3 layers,
first_k_dense_replace), moe_intermediate_size 2048, n_routed_experts 256, num_experts_per_tok 8,
n_shared_experts 1, vocab_size 129280.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from llmsim import CostModel, lookup_hardware, model_catalog
from llmsim.cost.kernels import layer_gemm_shapes
from llmsim.cost.work import LAYER_OPS, work_coefficients

V3 = model_catalog()["DeepSeek-V3"]
H, LAYERS, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 7168, 61, 128, 1536, 512, 128, 64, 128
DENSE_INTER, MOE_INTER, EXPERTS, TOP_K, DENSE_LAYERS, VOCAB = 18432, 2048, 256, 8, 3, 129280
MOE_LAYERS = LAYERS - DENSE_LAYERS

# Linear weights one token multiplies, per layer type (by hand, from the numbers above).
ATTENTION = (H * (Q_LORA + KV_LORA + ROPE)             # fused q_a + kv_a down-projections
             + Q_LORA * HEADS * (NOPE + ROPE)           # q_b
             + KV_LORA * HEADS * (NOPE + V_HEAD)        # kv_b: keys' no-RoPE part and values
             + HEADS * V_HEAD * H)                      # o_proj
DENSE_MLP = 3 * H * DENSE_INTER
MOE_MLP = TOP_K * 3 * H * MOE_INTER + 3 * H * MOE_INTER + H * EXPERTS     # routed top-8, 1 shared, router
PER_TOKEN = LAYERS * ATTENTION + DENSE_LAYERS * DENSE_MLP + MOE_LAYERS * MOE_MLP


def test_hand_counts_are_deepseek_v3s_published_active_size():
    """The hand count plus the embedding is the 37B activated parameters of the technical report."""
    assert pytest.approx(37.5, abs=0.1) == (PER_TOKEN + 2 * VOCAB * H) / 1e9


def test_deepseek_v3_gemm_shapes_multiply_the_hand_counted_weights_per_token():
    shapes = layer_gemm_shapes(V3, 1)
    names = [s.name for s in shapes]
    assert names == ["q_a", "q_b", "kv_b", "out_proj", "mlp_up", "mlp_down", "router", "shared_up", "shared_down",
                     "dense_up", "dense_down"]
    per_token = sum(s.n * s.k * s.layer_share * LAYERS * (TOP_K if s.routed else 1) for s in shapes)
    assert per_token == pytest.approx(PER_TOKEN, rel=1e-12)
    # Tensor parallelism splits heads and MLP widths; the down-projections and the router stay whole.
    by_name = {s.name: s for s in layer_gemm_shapes(V3, 8)}
    assert (by_name["q_a"].n, by_name["q_b"].n, by_name["kv_b"].n) == (Q_LORA + KV_LORA + ROPE,
                                                                      HEADS / 8 * (NOPE + ROPE), HEADS / 8 * 256)
    assert by_name["router"].n == EXPERTS and by_name["dense_up"].n == 2 * DENSE_INTER / 8


@pytest.mark.parametrize("tokens", [1, 4096])
def test_kernel_path_flops_and_weight_bytes_of_deepseek_v3(tokens):
    """The cost model's GEMM compute time, times the profile's FP8 rate, is 2 FLOPs per hand-counted weight
    per token; at one decoding token its weight traffic is the attention, the dense layers, the shared
    experts, the router and the 8 routed experts that token touches, at one byte (FP8), and the LM head
    at two (bf16). Priced by the profile's FP8 GEMM terms (an FP8 model's), without the kernel that quantizes
    the inputs (its bytes are no GEMM's FLOPs or weights; tests/calibration/test_kernel_terms.py prices it) and without
    vLLM's CUTLASS dispatch (which prices that kernel at its own rate)."""
    h100 = lookup_hardware("H100-SXM")
    fp8 = {dtype: replace(terms, quantize_bandwidth_bytes_per_s=0.0, dispatch=None)
           for dtype, terms in h100.kernels.gemm_by_dtype.items()}
    h100 = replace(h100, kernels=replace(h100.kernels, gemm_by_dtype=fp8))
    kernels = h100.kernels.for_dtype(V3.weight_dtype)
    cost = CostModel(V3, h100)
    x = cost.features([tokens], [0], []) if tokens > 1 else cost.features([], [], [100])
    table = cost.breakdown(x).set_index("operator")
    layer_compute_s = table.loc[["layer.qkv", "layer.out_proj", "layer.mlp"], "compute_s"].sum()
    assert layer_compute_s * kernels.gemm_rate("fp8") == pytest.approx(2 * PER_TOKEN * tokens, rel=1e-9)
    assert table.loc["lm_head", "compute_s"] * kernels.gemm_rate("fp8") == pytest.approx(2 * H * VOCAB, rel=1e-9)
    if tokens == 1:
        assert V3.expected_experts_touched(1) == pytest.approx(TOP_K)
        weights = PER_TOKEN                                             # fp8: a byte each
        activations = 0.0                                               # (n + k) per GEMM row, 16-bit
        for s in layer_gemm_shapes(V3, 1):
            activations += 2 * (s.n + s.k) * s.layer_share * LAYERS * (TOP_K if s.routed else 1)
        memory_s = table.loc[["layer.qkv", "layer.out_proj", "layer.mlp"], "memory_s"].sum()
        assert memory_s * kernels.gemm_bandwidth_bytes_per_s == pytest.approx(weights + activations, rel=1e-9)
        head = table.loc["lm_head", "memory_s"] * kernels.gemm_bandwidth_bytes_per_s
        assert head == pytest.approx(2 * H * VOCAB + 2 * (H + VOCAB), rel=1e-9)


def test_mla_reads_the_compressed_kv_cache():
    """Decode attention reads kv_lora_rank + qk_rope_head_dim cached elements per token per layer (the
    latent and the shared RoPE key, DeepSeek-V2 paper section 2.1), 16-bit: 61 x 576 x 2 bytes per token."""
    x = CostModel(V3, lookup_hardware("H100-SXM")).features([], [], [10_000])
    kv_bytes = work_coefficients(V3).layer_bytes["kv"]
    kv = LAYERS * (kv_bytes[LAYER_OPS.index("attention_decode")] + kv_bytes[LAYER_OPS.index("kv_write")]) @ x
    assert kv == pytest.approx(LAYERS * (KV_LORA + ROPE) * 2 * (10_001 + 1), rel=1e-12)    # read c + 1, write 1


def test_dense_models_keep_their_four_gemms():
    """A dense GQA model's shapes are the calibration's four columns, in their order, in every layer."""
    shapes = layer_gemm_shapes(model_catalog()["Llama-3.1-8B"], 2)
    assert [s.name for s in shapes] == ["qkv", "out_proj", "mlp_up", "mlp_down"]
    assert all(s.layer_share == 1.0 for s in shapes)
    # Qwen-MoE style: shared experts without dense layers; no dense_* GEMMs, shared ones in every layer.
    qwen_like = replace(model_catalog()["Qwen3-30B-A3B"], shared_expert_intermediate_size=4096)
    names = [s.name for s in layer_gemm_shapes(qwen_like, 1)]
    assert "shared_up" in names and "dense_up" not in names


def test_mla_without_a_query_latent_projects_the_query_whole():
    """DeepSeek-V2-Lite's shape (q_lora_rank 0): a full query projection split by heads, the KV latent's
    down-projection replicated; its weights are the model's own attention parameters, per rank."""
    lite = replace(V3, q_lora_rank=0)
    shapes = {s.name: s for s in layer_gemm_shapes(lite, 2)}
    assert set(shapes) >= {"q", "kv_a", "kv_b", "out_proj"} and "q_a" not in shapes
    assert shapes["q"].n == HEADS / 2 * (NOPE + ROPE) and shapes["kv_a"].n == KV_LORA + ROPE
    attention = sum(shapes[n].n * shapes[n].k for n in ("q", "kv_a", "kv_b", "out_proj"))
    replicated = H * (KV_LORA + ROPE)
    # qkv_params counts the latent's norm (kv_lora_rank weights) too, not a GEMM.
    assert attention == pytest.approx((lite.qkv_params - KV_LORA - replicated + lite.out_proj_params) / 2
                                      + replicated, rel=1e-12)
