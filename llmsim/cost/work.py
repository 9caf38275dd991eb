"""The work of every operator of a model, as linear maps of the batch features.

For a batch with feature vector ``x`` (see :mod:`llmsim.cost.features`), operator ``op``
of one decoder layer on one tensor-parallel shard computes ``layer_flops[op] @ x``
FLOPs and moves ``layer_bytes[kind][op] @ x`` bytes of each kind (weights, KV cache,
activations: kinds because they may live in different memory tiers). The embedding
and the LM head run once per iteration (``model_*`` maps). The roofline
(:class:`~llmsim.cost.roofline.CostModel`) turns these into time.

Formulas assume a pre-norm decoder with grouped-query or multi-head latent attention and
a gated (SwiGLU) MLP, dense or mixture-of-experts, the shapes of the catalog's models
(:class:`~llmsim.catalog.models.ModelSpec` gives their parameter and byte counts).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llmsim.catalog.models import ModelSpec
from llmsim.cost.features import FEATURES, F, batch_features

LAYER_OPS = ("qkv", "attention_prefill", "attention_decode", "out_proj", "mlp", "elementwise", "kv_write")
ATTENTION_OPS = ("attention_prefill", "attention_decode")
MODEL_OPS = ("embedding", "lm_head", "sampling")
# Sampling reads and writes the fp32 logits of every sampled row over the whole vocabulary (each rank samples
# the gathered row): temperature (read, write), softmax (read, write) and one top-k/top-p draw (read), five
# passes of 4 bytes. An assumption from the shape of vLLM's sampler (FlashInfer or PyTorch top-k/top-p), not
# a measurement; memory-bound, it costs bytes / bandwidth.
SAMPLING_BYTES_PER_VOCAB_ENTRY = 5 * 4
BYTE_KINDS = ("weights", "kv", "activations")   # what is read, and so from which memory tier


class WorkCoefficients(NamedTuple):
    """FLOPs and bytes of each operator per unit of each batch feature (see the module docstring)."""
    layer_flops: np.ndarray             # (len(LAYER_OPS), len(FEATURES))
    layer_bytes: dict[str, np.ndarray]  # kind -> (len(LAYER_OPS), len(FEATURES))
    model_flops: np.ndarray             # (len(MODEL_OPS), len(FEATURES))
    model_bytes: dict[str, np.ndarray]


def work_coefficients(model: ModelSpec, tensor_parallel: int = 1, routed_experts: bool = True) -> WorkCoefficients:
    """The FLOPs and bytes of every operator of ``model``, per unit of each batch feature.

    ``routed_experts`` False leaves the routed experts out of the MLP (router and shared experts stay): expert
    parallelism prices them on the busiest rank instead (:mod:`llmsim.cost.experts`).

    Attention computes 4 FLOPs per (query, key) pair per head dimension (QK^T and
    PV, a multiply-add each) and reads each sequence's KV once (FlashAttention);
    linear layers do 2 FLOPs per parameter per token and read their weights once
    per iteration; MoE layers read only the experts the batch routes to.
    """
    m, tp = model, tensor_parallel
    wb, ab = m.weight_bytes_per_param, m.activation_bytes_per_element
    kv_token_bytes = m.kv_elements_per_token_per_layer(tp) * m.kv_bytes_per_element
    q_dim, qkv_out = m.q_dim / tp, (m.q_dim + 2 * m.kv_dim) / tp
    hidden, inter = m.hidden_size, m.expert_intermediate_size / tp
    k = m.experts_per_token if routed_experts else 0
    # FLOPs per (query, key) pair: QK^T and PV, 2 each per head dimension; MLA's own (see ModelSpec).
    prefill_pair_flops, decode_pair_flops = ((m.mla_attention_flops_per_pair(False) / tp,
                                              m.mla_attention_flops_per_pair(True) / tp) if m.is_mla
                                             else (4 * q_dim, 4 * q_dim))
    # MoE layers route to experts; dense_layers of them have a plain MLP (averaged over the layers).
    sparse, dense = m.sparse_layers / m.num_layers, m.dense_layers / m.num_layers

    lf = np.zeros((len(LAYER_OPS), len(FEATURES)))
    lw, lk, la = (np.zeros_like(lf) for _ in BYTE_KINDS)
    qkv, ap, ad, out, mlp, elem, kv_write = range(len(LAYER_OPS))
    qkv_params = m.qkv_params / tp
    if m.is_mla and tp > 1:
        # MLA's down-projections (the latent's, and the query's with q_lora_rank) are replicated on every rank.
        down = m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)
        qkv_params += down * (1 - 1 / tp)
    lf[qkv, F["tokens"]] = 2 * qkv_params
    lw[qkv, F["one"]] = qkv_params * wb
    la[qkv, F["tokens"]] = (hidden + qkv_out) * ab
    lf[ap, F["prefill_pairs"]] = prefill_pair_flops
    lk[ap, F["prefill_kv_read"]] = kv_token_bytes
    la[ap, F["prefill_tokens"]] = 2 * q_dim * ab          # Q in, O out
    lf[ad, F["decode_kv_read"]] = decode_pair_flops
    lk[ad, F["decode_kv_read"]] = kv_token_bytes
    la[ad, F["decode_seqs"]] = 2 * q_dim * ab
    lf[out, F["tokens"]] = 2 * m.out_proj_params / tp
    lw[out, F["one"]] = m.out_proj_params / tp * wb
    la[out, F["tokens"]] = (q_dim + hidden) * ab
    always_on = m.shared_expert_params / tp       # shared experts see every token
    lf[mlp, F["tokens"]] = (2 * (k * m.expert_params / tp + m.router_params) + 2 * always_on) * sparse \
        + 2 * m.dense_mlp_params / tp * dense
    lw[mlp, F["one"]] = (m.router_params + always_on) * wb * sparse + m.dense_mlp_params / tp * wb * dense
    lw[mlp, F["experts_touched"]] = m.expert_params / tp * m.expert_bytes_per_param * sparse * routed_experts
    la[mlp, F["tokens"]] = k * (2 * hidden + 3 * inter) * ab
    # Every computed position writes its K and V into the paged cache (vLLM's reshape_and_cache, a kernel of its
    # own before attention): bytes / bandwidth on top of attention, not hidden inside its max.
    lk[kv_write, F["tokens"]] = kv_token_bytes
    # Two RMSNorms and two residual adds, each reading and writing the hidden state.
    lf[elem, F["tokens"]] = 10 * hidden
    la[elem, F["tokens"]] = 8 * hidden * ab

    mf = np.zeros((len(MODEL_OPS), len(FEATURES)))
    mw, mk, ma = (np.zeros_like(mf) for _ in BYTE_KINDS)
    embedding, lm_head, sampling = range(len(MODEL_OPS))
    ma[embedding, F["tokens"]] = 2 * hidden * ab
    mf[lm_head, F["logit_tokens"]] = 2 * hidden * m.vocab_size / tp
    mw[lm_head, F["one"]] = hidden * m.vocab_size / tp * m.embedding_bytes_per_param
    ma[lm_head, F["logit_tokens"]] = (hidden * ab + 4 * m.vocab_size / tp)  # fp32 logits out
    ma[sampling, F["logit_tokens"]] = SAMPLING_BYTES_PER_VOCAB_ENTRY * m.vocab_size
    return WorkCoefficients(lf, dict(zip(BYTE_KINDS, (lw, lk, la))), mf, dict(zip(BYTE_KINDS, (mw, mk, ma))))


def layer_work(model: ModelSpec, features, tensor_parallel: int = 1) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of each operator of one layer on one shard, for a feature vector."""
    coeffs = work_coefficients(model, tensor_parallel)
    x = np.asarray(features, dtype=float)
    total_bytes = np.sum(list(coeffs.layer_bytes.values()), axis=0)
    return {op: (float(coeffs.layer_flops[i] @ x), float(total_bytes[i] @ x))
            for i, op in enumerate(LAYER_OPS)}


def prefill_layer_work(model: ModelSpec, tokens: int, context: int = 0, tensor_parallel: int = 1):
    """One sequence prefilling ``tokens`` tokens after ``context`` cached ones: (FLOPs, bytes) per operator."""
    x = batch_features(prefill_new=[tokens], prefill_context=[context], decode_context=[], prefill_logits=1,
                       model=model)
    return layer_work(model, x, tensor_parallel)


def decode_layer_work(model: ModelSpec, batch: int, context: int, tensor_parallel: int = 1):
    """``batch`` sequences each decoding one token over ``context`` cached tokens."""
    x = batch_features(prefill_new=[], prefill_context=[], decode_context=[context] * batch, prefill_logits=0,
                       model=model)
    return layer_work(model, x, tensor_parallel)
