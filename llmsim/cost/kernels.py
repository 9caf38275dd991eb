"""Kernel-level time formulas fitted to measured GPU timings (vectorised, numpy only).

Each formula works on scalars and arrays alike, so the calibration fits them to
thousands of measured rows at once. The cost model prices a GEMM in Python floats
(:func:`gemm_scalar_body_s`) and compiled (:func:`llmsim.cost.roofline._gemm_run_s`, for its
tables and for many rows at once), both with the C library's ``pow``: numpy's powers over
arrays run SIMD code that differs from ``pow`` in the last bit of a few percent of inputs
(on AVX-512 machines), so a batch priced in a grid would otherwise differ from it priced
alone, by machine.

GEMM ``[M x K] @ [K x N]`` (M tokens; N, K the weight's shape on one tensor-parallel shard)::

    time = floor + (memory^p + compute^p)^(1/p)
    memory  = (N K w + M (N + K) a) / bandwidth      (weights w, activations a bytes per element)
    compute = 2 M N K / (achieved FLOP/s x occupancy)
    tiles = ceil(M / 64) ceil(N / 128)                (output tiles of the kernel, one per thread block)
    occupancy = tiles / (tiles + half_tiles)          (1 when half_tiles is 0)
    p = 1 + (sharpness - 1) (tiles / 128)^growth      (sharpness when growth is 0)

The smooth maximum replaces the roofline's corner: measured GEMMs leave the bandwidth bound well
before the two bounds meet. How far depends on the shape through its output tiles: a GEMM of few
tiles leaves SMs idle, so its compute runs below the achieved rate (occupancy), and it has few waves
to overlap one tile's loads with another's math, so memory and compute add up (p near 1); one of
many waves overlaps them (p large: the hard maximum). A 7B layer sharded 8 ways at 256 tokens has
88 tiles per GEMM where a 70B layer at TP 1 has 1,800: fitted on Vidur's A100 and H100 timings this
took held-out decode MAPE of the H100 at TP 1 from 12.2% to under 10%
(``benchmarks/bench_fidelity.py``). The tile (64 x 128) is a common cuBLAS/CUTLASS 16-bit tile; a
jagged wave count (ceil(tiles / SMs)) fitted worse than the smooth occupancy, as cuBLAS splits K and
picks other tiles for small shapes. Without ``half_tiles`` and ``growth`` (0, 0) this is the shape-blind
form of earlier profiles.

Streaming kernels (norm, activation, rotary, residual add) take ``floor + bytes / bandwidth``
plus one row's bytes over the bandwidth of one thread block (vLLM's kernels run a block per token);
an all-reduce of ``S`` bytes over ``g`` GPUs ``latency + 2 (g - 1) / g x S / bus bandwidth``, the
lesser of a small-message (low latency) and a large-message (high bandwidth) line, as NCCL switches
protocols.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from llmsim.catalog.kernel_terms import AllReduce, CustomAllReduce, Fp8Dispatch, KernelTerms, StreamKernel
from llmsim.catalog.models import ModelSpec
from llmsim.catalog.cutlass_dispatch import DISPATCH, waves


TILE_ROWS, TILE_COLUMNS = 64, 128       # one thread block's output tile (tokens x output columns)
SHARPNESS_REFERENCE_TILES = 128.0        # the tile count at which p = sharpness


def gemm_output_tiles(tokens, n):
    """Output tiles of GEMMs of ``tokens`` rows and ``n`` output columns (at least one)."""
    return np.maximum(np.ceil(np.asarray(tokens, dtype=float) / TILE_ROWS), 1.0) * np.ceil(n / TILE_COLUMNS)


def gemm_body_s(memory_s, compute_s, tiles, kernels: KernelTerms):
    """The smooth maximum of a GEMM's memory and compute times (no floor), shaped by its output ``tiles``. Over
    arrays (0-d ones included) numpy's SIMD powers may differ in the last bit from :func:`gemm_scalar_body_s`'s."""
    occupancy = tiles / (tiles + kernels.gemm_occupancy_half_tiles)
    p = 1.0 + (kernels.gemm_sharpness - 1.0) * (tiles / SHARPNESS_REFERENCE_TILES) ** kernels.gemm_sharpness_growth
    return smooth_maximum(memory_s, compute_s / occupancy, p)


def smooth_maximum(memory_s, compute_s, p):
    """``(memory^p + compute^p)^(1/p)``: the larger of a kernel's memory and compute times, rounded off where
    they are close (``p`` its sharpness). Scaled by the larger term: p reaches the hundreds on large GEMMs, where
    a millisecond to the power p underflows to 0 and the unscaled form would price the GEMM at nothing. The larger
    term over itself is exactly 1, and so is 1 to any power: only the smaller's power is computed (the same bits as
    computing both powers, for times that are finite and not negative; zero times give 0)."""
    larger = np.maximum(memory_s, compute_s)
    safe = np.where(larger > 0, larger, 1.0)
    return larger * ((np.minimum(memory_s, compute_s) / safe) ** p + 1.0) ** (1.0 / p)


def gemm_scalar_body_s(memory_s: float, compute_s: float, tokens: float, n: float, kernels: KernelTerms) -> float:
    """:func:`gemm_body_s` of :func:`gemm_output_tiles` for one GEMM, in Python floats (the cost model's
    per-iteration path, where numpy's scalar overhead costs far more than the arithmetic). The same
    operations in the same order, the powers by the C library's ``pow`` as numpy's scalars take them:
    the same bits as :func:`gemm_body_s` of numpy scalars, not always of arrays (whose powers are SIMD code)."""
    tiles = max(float(math.ceil(tokens / TILE_ROWS)), 1.0) * float(math.ceil(n / TILE_COLUMNS))
    occupancy = tiles / (tiles + kernels.gemm_occupancy_half_tiles)
    p = 1.0 + (kernels.gemm_sharpness - 1.0) * (tiles / SHARPNESS_REFERENCE_TILES) ** kernels.gemm_sharpness_growth
    compute_s = compute_s / occupancy
    larger = compute_s if compute_s > memory_s else memory_s
    safe = larger if larger > 0 else 1.0
    return larger * ((memory_s / safe) ** p + (compute_s / safe) ** p) ** (1.0 / p)


def gemm_time_s(tokens, n, k, weight_bytes_per_element, activation_bytes_per_element, kernels: KernelTerms,
                dtype: str = "fp16", bandwidth_bytes_per_s: float | None = None):
    """Time of GEMMs of ``tokens`` rows against ``k x n`` weights (broadcasts over tokens, n and k), priced
    by ``kernels`` at its rate for ``dtype`` and its GEMM bandwidth (or ``bandwidth_bytes_per_s``)."""
    bandwidth = kernels.gemm_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None else bandwidth_bytes_per_s
    memory_s = (n * k * weight_bytes_per_element + tokens * (n + k) * activation_bytes_per_element) / bandwidth
    compute_s = 2.0 * tokens * n * k / kernels.gemm_rate(dtype)
    return kernels.gemm_floor_s + gemm_body_s(memory_s, compute_s, gemm_output_tiles(tokens, n), kernels)


def dispatch_gemm_body_s(m, n, k, weight_bytes_per_element: float, activation_bytes_per_element: float,
                         bandwidth_bytes_per_s: float, dispatch: Fp8Dispatch) -> np.ndarray:
    """FP8 GEMMs of ``m`` rows (whole rows) against ``k x n`` weights (arrays of one length, or numbers) as vLLM's
    CUTLASS dispatch runs them, without the launch floor and the input's quantization (linear terms the cost model
    prices apart): the smooth maximum of the weight and activation traffic and the chosen configuration's waves of
    tiles, ``waves x (2 tile_m tile_n k / (rate / SMs) + tile_overhead)`` (the form
    :func:`llmsim.calibration.database_fit.gemm_fp8_dispatch_form` fits)."""
    architecture = DISPATCH[dispatch.architecture]
    rows = np.atleast_1d(np.asarray(m, dtype=float))
    columns, depth = (np.broadcast_to(np.asarray(v, dtype=float), rows.shape) for v in (n, k))
    sms = np.full(rows.shape, float(dispatch.sms))
    chosen = architecture.choose(rows, columns, depth)
    compute_s = np.zeros(rows.shape)
    for name, figures in dispatch.configurations.items():
        at = chosen == name
        config = architecture.configs[name]
        tile_s = 2.0 * config.sm_tile_m * config.tile_n * depth[at] / (figures.flops_per_s / dispatch.sms)
        compute_s[at] = waves(config, rows[at], columns[at], sms[at]) * (tile_s + figures.tile_overhead_s)
    memory_s = ((columns * depth * weight_bytes_per_element + rows * (columns + depth) * activation_bytes_per_element)
                / bandwidth_bytes_per_s)
    return smooth_maximum(memory_s, compute_s, dispatch.sharpness)


def stream_time_s(tokens, bytes_per_token, kernel: StreamKernel):
    """A streaming kernel over ``tokens`` rows of ``bytes_per_token`` bytes each."""
    return (kernel.floor_s + tokens * bytes_per_token / kernel.bandwidth_bytes_per_s
            + bytes_per_token / kernel.row_bandwidth_bytes_per_s)


def all_reduce_time_s(message_bytes, group: int, reduce: AllReduce):
    """One all-reduce of ``message_bytes`` over ``group`` GPUs: the fastest of the protocols' alpha-beta
    lines (each moves ``2 (g - 1) / g`` of the message over the bus, as a ring does; the middle one only where the
    profile has it)."""
    traffic = 2.0 * (group - 1) / group * message_bytes
    return np.minimum(np.minimum(reduce.latency_s + traffic / reduce.bus_bandwidth_bytes_per_s,
                                 reduce.large_latency_s + traffic / reduce.large_bus_bandwidth_bytes_per_s),
                      reduce.medium_latency_s + traffic / reduce.medium_bus_bandwidth_bytes_per_s)


def custom_all_reduce_time_s(message_bytes, group: int, custom: CustomAllReduce):
    """One all-reduce of the engine's own kernel: its one-shot line below ``two_shot_from_bytes``, its two-shot
    line from there (each over the bus traffic of :func:`all_reduce_time_s`)."""
    traffic = 2.0 * (group - 1) / group * message_bytes
    reduce = custom.reduce
    return np.where(message_bytes < custom.two_shot_from_bytes,
                    reduce.latency_s + traffic / reduce.bus_bandwidth_bytes_per_s,
                    reduce.large_latency_s + traffic / reduce.large_bus_bandwidth_bytes_per_s)


class GemmShape(NamedTuple):
    """One linear operator of a layer on one shard: output width ``n``, input width ``k``; it runs in
    ``layer_share`` of the layers, and ``routed`` ones once per expert the tokens route to (the main MLP:
    one "expert" in a dense model)."""
    name: str
    n: float
    k: float
    layer_share: float = 1.0
    routed: bool = False


GEMM_OPERATORS = {"qkv": "layer.qkv", "q": "layer.qkv", "q_a": "layer.qkv", "q_b": "layer.qkv", "kv_a": "layer.qkv",
                  "kv_b": "layer.qkv", "out_proj": "layer.out_proj", "mlp_up": "layer.mlp", "mlp_down": "layer.mlp",
                  "router": "layer.mlp", "shared_up": "layer.mlp", "shared_down": "layer.mlp",
                  "dense_up": "layer.mlp", "dense_down": "layer.mlp", "lm_head": "lm_head"}   # the operator of each


def layer_gemm_shapes(model: ModelSpec, tensor_parallel: int) -> tuple[GemmShape, ...]:
    """The GEMMs of a decoder layer after the tensor-parallel split (Megatron: QKV and gate+up split
    their outputs, the output and down projections their inputs). A dense GQA model has four: qkv,
    out_proj, mlp_up, mlp_down (the calibration's measured columns, in that order).

    MoE: the routed experts are one expert's shape (``moe_intermediate_size`` wide, which is not the
    dense ``intermediate_size`` in Qwen3-MoE or DeepSeek) in the sparse layers, with the router
    (replicated: vLLM's gate is a ReplicatedLinear), the shared experts as one dense MLP of their total
    width, and the first-k dense layers' MLP (``intermediate_size``) in their share of the layers.

    MLA (DeepSeek-V2/V3, as vLLM runs it): the query's down-projection fused with the KV latent's
    (``q_a`` + ``kv_a``: ``hidden -> q_lora_rank + kv_lora_rank + qk_rope_head_dim``, replicated on
    every rank), the query's up-projection (``q_b``; without ``q_lora_rank`` a full ``q`` projection, split
    by heads, and the latent's ``kv_a`` alone)
    and the latent's up-projection to keys and values (``kv_b``), both split by heads; decode absorbs
    ``kv_b`` into the query and output, which multiplies the same weights per token."""
    m, tp = model, tensor_parallel
    inter = m.expert_intermediate_size / tp
    moe = m.num_experts > 1
    sparse = m.sparse_layers / m.num_layers if moe else 1.0
    if m.is_mla:
        heads = m.num_heads / tp
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        attention: tuple[GemmShape, ...] = ((GemmShape("q_a", m.q_lora_rank + latent, m.hidden_size),
                      GemmShape("q_b", heads * m.head_dim, m.q_lora_rank)) if m.q_lora_rank else
                     (GemmShape("q", heads * m.head_dim, m.hidden_size), GemmShape("kv_a", latent, m.hidden_size)))
        attention += (GemmShape("kv_b", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                      GemmShape("out_proj", m.hidden_size, heads * m.v_head_dim))
    else:
        kv_heads = max(m.num_kv_heads / tp, 1.0)     # replicated when tp > kv heads
        attention = (GemmShape("qkv", m.num_heads / tp * m.head_dim + 2 * kv_heads * m.head_dim, m.hidden_size),
                     GemmShape("out_proj", m.hidden_size, m.q_dim / tp))
    mlp: tuple[GemmShape, ...] = (GemmShape("mlp_up", 2 * inter, m.hidden_size, sparse, True),
           GemmShape("mlp_down", m.hidden_size, inter, sparse, True))
    if moe:
        mlp += (GemmShape("router", m.num_experts, m.hidden_size, sparse),)
    if m.shared_expert_intermediate_size:
        shared = m.shared_expert_intermediate_size / tp
        mlp += (GemmShape("shared_up", 2 * shared, m.hidden_size, sparse),
                GemmShape("shared_down", m.hidden_size, shared, sparse))
    if m.dense_layers:
        dense, share = m.intermediate_size / tp, m.dense_layers / m.num_layers
        mlp += (GemmShape("dense_up", 2 * dense, m.hidden_size, share),
                GemmShape("dense_down", m.hidden_size, dense, share))
    return attention + mlp


def elementwise_bytes_per_token(model: ModelSpec, tensor_parallel: int) -> dict[str, float]:
    """Bytes each streaming kernel of one layer moves per token (reads and writes), and how many run.

    Two RMSNorms and two residual adds see the whole hidden state (TP replicates it); SiLU-and-multiply
    and rotary embedding see the shard's intermediate and head columns. Returns {kind: bytes}; the counts
    are in :data:`ELEMENTWISE_COUNTS`."""
    m, tp, a = model, tensor_parallel, model.activation_bytes_per_element
    kv_heads = max(m.num_kv_heads / tp, 1.0)
    width: float = m.experts_per_token * m.expert_intermediate_size   # the MLP's gated width per token
    if m.shared_expert_intermediate_size or m.dense_layers:           # averaged over the layers, as the GEMMs
        width = (m.sparse_layers * (width + m.shared_expert_intermediate_size)
                 + m.dense_layers * m.intermediate_size) / m.num_layers
    # MLA rotates only the RoPE part: every head's query and the one shared key.
    rotated = (m.num_heads / tp + 1) * m.qk_rope_head_dim if m.is_mla else (m.num_heads / tp + kv_heads) * m.head_dim
    return {"norm": 2 * m.hidden_size * a,                       # read x, write y
            "residual": 3 * m.hidden_size * a,                   # read two, write one
            "activation": 3 * width / tp * a,                    # read gate and up, write one
            "rotary": 2 * rotated * a}                           # rotate q and k in place


ELEMENTWISE_COUNTS = {"norm": 2, "residual": 2, "activation": 1, "rotary": 1}   # per layer


def add_norm_bytes_per_token(model: ModelSpec) -> float:
    """Bytes an add-norm kernel (the residual add inside the RMSNorm) moves per token: x and the residual in, the sum
    and the normed output out."""
    return 4 * model.hidden_size * model.activation_bytes_per_element


def elementwise_layer_terms(model: ModelSpec, tensor_parallel: int, kernels: KernelTerms) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of one layer's streaming kernels (those the engine fuses into other
    kernels cost nothing of their own; an add-norm is one norm kernel moving both kernels' bytes but the sum's
    read back: x and the residual in, the sum and the normed output out)."""
    fusion = kernels.stream_fusion
    moved = {kind: size for kind, size in elementwise_bytes_per_token(model, tensor_parallel).items()
             if kind not in fusion.inside}
    if fusion.norm_in_all_reduce(model.hidden_size, tensor_parallel):
        del moved["norm"], moved["residual"]
    elif fusion.residual_into_norm:
        moved.pop("residual")
        moved["norm"] = add_norm_bytes_per_token(model)
    fixed = sum(ELEMENTWISE_COUNTS[kind] * (kernels.elementwise[kind].floor_s
                                            + moved[kind] / kernels.elementwise[kind].row_bandwidth_bytes_per_s)
                for kind in moved)
    per_token = sum(ELEMENTWISE_COUNTS[kind] * moved[kind] / kernels.elementwise[kind].bandwidth_bytes_per_s
                    for kind in moved)
    return fixed, per_token
