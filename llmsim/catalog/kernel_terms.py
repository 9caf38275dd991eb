"""Measured kernel terms of a GPU profile (the ``kernels:`` section): what the roofline alone misses.

A profile without this section is priced by the plain roofline (peak x efficiency,
:mod:`llmsim.cost.roofline`). With it, the cost model prices each kernel by the form
that fits measured timings (:mod:`llmsim.cost.kernels` has the formulas):

- ``gemm``: a launch floor, the achieved streaming bandwidth of weights and activations,
  the achieved compute rate per dtype, the sharpness of the smooth maximum of the two, and how the
  shard's output tiles shape it (``occupancy_half_tiles``, ``sharpness_growth``; both optional, 0:
  shape-blind);
- ``elementwise``: RMSNorm, SiLU-and-multiply, rotary embedding and the residual add, each
  a floor plus bytes over its own achieved bandwidth;
- ``all_reduce``: latency and bus bandwidth per group size, for small and for large messages (alpha-beta), and
  optionally for medium ones (``medium_latency``, ``medium_bus_bandwidth``: NCCL's middle protocol);
- ``attention``: one launch floor per layer and iteration (optional), decode attention's fixed cost
  per sequence and layer and its KV read rate (optional; else the roofline's), and prefill
  attention's efficiency per backend, rising with the context a query sees;
- ``custom_all_reduce`` (optional): the engine's own all-reduce per group size, its one-shot line below the size
  at which it switches to its two-shot kernel (``two_shot_from``) and the two-shot line from there, and the
  message size up to which the engine uses it (``switch_over``); NCCL's ``all_reduce`` above it;
- ``gemm.by_dtype`` (optional): a dtype's own GEMM figures (floor, bandwidth, rate, sharpness, growth, half
  tiles, and the bandwidth of the kernel that quantizes an 8-bit GEMM's input) where its kernels differ
  (FP8); a model whose weights are in that dtype is priced by them; ``gemm.by_dtype.fp8.dispatch`` (optional, the
  section's own engine's: vLLM's; an overlay under ``engines`` does not inherit it): vLLM's CUTLASS FP8 dispatch
  (:class:`Fp8Dispatch`), which prices the GEMMs whose weights are 8-bit in place of the smooth form (not an MoE
  layer's routed experts: vLLM runs them in its fused MoE kernel);
- ``attention.decode_efficiency`` (optional): decode attention's FLOPs at this share of the 16-bit peak, in
  place of the roofline's attention efficiency; ``attention.decode_per_kv_head`` (optional): fixed work per
  decoding sequence and KV head on the GPU (a thread block each), on top of ``decode_per_sequence``;
- ``attention.by_kv_dtype`` (optional): a KV-cache dtype's own decode-attention figures (floor, per sequence, per
  KV head, bandwidth, efficiency) where its kernels differ (FP8); a model whose cache is in that dtype is priced by
  them;
- ``quantize`` (optional): the engine's FP8 quantization kernel (floor and bandwidth of a streaming kernel), priced
  where the engine runs it as a pass the GEMM rows do not time (TensorRT-LLM, after an all-reduce that fell back to
  NCCL; :class:`StreamFusion`);
- ``engines`` (optional): another engine's figures laid over this section (``engine.kernels`` in a scenario
  picks one; the section itself is the default engine's, vLLM's);
- ``step``: the growth of the engine's per-iteration overhead (``overhead.per_step``) with the
  sequences that sample (sampling, detokenising, scheduling bookkeeping per sequence).

Every figure is ``{value, source, confidence}``, read with the profile's own machinery.
"""
from __future__ import annotations

import math

import enum
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import TypeVar

from llmsim.config.reader import Node, deep_merge
from llmsim.catalog.cutlass_dispatch import DISPATCH

T = TypeVar("T")

ELEMENTWISE_KINDS = ("norm", "activation", "rotary", "residual")
MEDIUM_ALL_REDUCE_KEYS = ("medium_latency", "medium_bus_bandwidth")     # NCCL's middle protocol (optional)


class EngineKernels(enum.Enum):
    """Whose kernels price a step (a scenario's ``engine.kernels``): the engine the operator database timed them in."""
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


ENGINE_NAMES = tuple(engine.value for engine in EngineKernels)


@dataclass(frozen=True)
class StreamFusion:
    """Which of a layer's streaming kernels an engine runs inside other kernels, so that they make no pass over
    memory of their own: ``inside`` kinds never (the rotary embedding inside attention); the residual add inside
    the RMSNorm (``residual_into_norm``: one add-norm kernel per norm); and, with tensor parallelism on a model
    wider than ``norm_into_all_reduce_above_hidden``, that add-norm inside the all-reduce before it, for messages up
    to the engine's all-reduce workspace (``pair_workspace_bytes`` for two GPUs, ``workspace_bytes`` for more): a
    larger one falls back to NCCL, and the add-norm runs after it as a kernel of its own.

    With 8-bit weights, ``quantized_inputs`` names the GEMMs whose input the kernel before them writes in 8 bits
    already (no quantization pass of their own); the GEMMs an add-norm feeds get theirs from the add-norm inside the
    all-reduce (its FP8 variant), and after an all-reduce that fell back to NCCL a quantization pass of the normed
    hidden state follows the add-norm."""
    inside: tuple[str, ...] = ()
    residual_into_norm: bool = False
    norm_into_all_reduce_above_hidden: int | None = None
    pair_workspace_bytes: float = math.inf
    workspace_bytes: float = math.inf
    quantized_inputs: tuple[str, ...] = ()

    def all_reduce_workspace_bytes(self, group: int) -> float:
        """The largest all-reduce message of ``group`` GPUs whose kernel runs the add-norm."""
        return self.pair_workspace_bytes if group <= 2 else self.workspace_bytes

    def norm_in_all_reduce(self, hidden_size: int, tensor_parallel: int) -> bool:
        """Whether the add-norms of a model of ``hidden_size`` at ``tensor_parallel`` run in its all-reduces."""
        above = self.norm_into_all_reduce_above_hidden
        return above is not None and tensor_parallel > 1 and hidden_size > above


# TensorRT-LLM (PyTorch backend):
# - its attention op applies the rotary embedding to the fused QKV as it reads it when its backend supports that,
#   which its default (TRT-LLM) backend does: tensorrt_llm/_torch/modules/attention.py, ``rope_fusion`` ("If
#   rope_fusion is not specified, enable if the attention backend supports it");
# - Llama's decoder layer calls its RMSNorms with the residual (``self.post_attention_layernorm(hidden_states,
#   residual)``, ``self.next_layer_layernorm(hidden_states, residual)``: one fused add-norm kernel) and, with
#   tensor parallelism, runs both inside the all-reduces (``AllReduceFusionOp.RESIDUAL_RMS_NORM``, with the FP8
#   input quantization for FP8 checkpoints) unless the model is 4,096 wide or less ("Disable fusion for small models
#   due to accuracy issues": ``enable_fusion &= config.hidden_size > 4096``): tensorrt_llm/_torch/models/
#   modeling_llama.py, ``LlamaDecoderLayer``, NVIDIA/TensorRT-LLM commit 3a5901cd. The fusion is on by default in the
#   releases the perf overview measured: their release notes (1.0 on) give ``TRTLLM_LLAMA_EAGER_FUSION_DISABLED=1`` as
#   the workaround for "Llama 3.x ... pipeline parallelism when using FP8" (docs/source/release-notes.md). NVIDIA's
#   aiconfigurator prices the layer's streaming work the same way: two add-norms and one gated activation
#   (aiconfigurator-core 0.12.0, sdk/models/llama.py).
# - its all-reduce (strategy AUTO) falls back to NCCL for a message larger than its custom kernels' workspace,
#   "regardless of the fusion type" (cpp/tensorrt_llm/thop/allreduceOp.cpp, ``ifFallbackToNCCL``), and then runs the
#   fused ops after it (``fallbackRunSubsequentOps``); the workspace is 16 MB for two GPUs and 8 MB for more
#   (cpp/tensorrt_llm/common/customAllReduceUtils.h, ``getMaxRequiredWorkspaceSize``, as of the v1.0 releases);
#   after the NCCL all-reduce ``fallbackRunSubsequentOps`` runs ``residualRmsNorm`` and then, for
#   RESIDUAL_RMS_NORM_QUANT_FP8, ``symmetric_static_quantize_per_tensor`` of the norm's output: a quantization pass
#   of its own (cpp/tensorrt_llm/thop/allreduceOp.cpp);
# - with FP8 weights the output projection and the MLP's down projection take 8-bit input from the kernel before
#   them: the attention op writes its output in FP8 (``out_scale=self.o_proj.inv_input_scale``,
#   tensorrt_llm/_torch/modules/attention.py) and the SwiGLU kernel quantizes its output
#   (``swiglu(x, quant_scale=self.down_proj.input_scale, quant_type=torch.float8_e4m3fn)``,
#   tensorrt_llm/_torch/modules/gated_mlp.py); NVIDIA's aiconfigurator prices both GEMMs with
#   ``low_precision_input=True`` (aiconfigurator-core 0.12.0, sdk/models/llama.py).
STREAM_FUSION = {EngineKernels.TRTLLM.value: StreamFusion(("rotary",), residual_into_norm=True,
                                                          norm_into_all_reduce_above_hidden=4096,
                                                          pair_workspace_bytes=16e6, workspace_bytes=8e6,
                                                          quantized_inputs=("out_proj", "mlp_down"))}


@dataclass(frozen=True)
class StreamKernel:
    """A kernel that streams its operands once, a thread block per token row:
    ``floor_s + bytes / bandwidth_bytes_per_s + row bytes / row_bandwidth_bytes_per_s``. The last term is
    one block working through one row alone (one token: the whole kernel), so it grows with the width."""
    floor_s: float
    bandwidth_bytes_per_s: float
    row_bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class AllReduce:
    """One NCCL all-reduce over a group: ``latency + 2 (g - 1) / g x bytes / bus bandwidth`` for each of its
    protocols, small messages (low latency, low bandwidth) and large ones; NCCL picks the fastest (the min).
    NCCL has three (LL, LL128 and Simple: ``src/graph/tuning.cc`` predicts each one's latency and bandwidth and
    runs the fastest); a profile with the ``medium_*`` figures gives the middle one its own line, one without them
    prices two (``medium_latency_s`` infinite: that line never wins)."""
    latency_s: float
    bus_bandwidth_bytes_per_s: float
    large_latency_s: float
    large_bus_bandwidth_bytes_per_s: float
    medium_latency_s: float = math.inf
    medium_bus_bandwidth_bytes_per_s: float = math.inf


@dataclass(frozen=True)
class CustomAllReduce:
    """An engine's own all-reduce kernel (vLLM's, SGLang's, TensorRT-LLM's), used for messages up to
    ``switch_over_bytes`` (NCCL takes the larger ones): ``reduce``'s small-message line is its one-shot kernel,
    below ``two_shot_from_bytes``, and the large-message line its two-shot kernel, from there (the engine
    switches by size, not to the faster)."""
    reduce: AllReduce
    switch_over_bytes: float
    two_shot_from_bytes: float


@dataclass(frozen=True)
class GemmTerms:
    """The GEMM figures of one weight dtype that has its own kernels (``gemm.by_dtype``: FP8's)."""
    floor_s: float
    bandwidth_bytes_per_s: float
    flops_per_s: float
    sharpness: float
    sharpness_growth: float
    occupancy_half_tiles: float
    quantize_bandwidth_bytes_per_s: float = 0.0     # the input's quantization kernel (0: none)
    dispatch: Fp8Dispatch | None = None              # vLLM's CUTLASS dispatch (None: the smooth form alone)


@dataclass(frozen=True)
class DispatchConfiguration:
    """One CUTLASS configuration's fitted figures: its achieved FP8 rate over the whole GPU, and the fixed time each
    of its tiles takes per wave (pipeline fill and the output tile's epilogue)."""
    flops_per_s: float
    tile_overhead_s: float


@dataclass(frozen=True)
class Fp8Dispatch:
    """vLLM's CUTLASS FP8 GEMM (:func:`llmsim.cost.kernels.dispatch_gemm_body_s`): the configuration vLLM's dispatch
    picks for each shape on ``architecture`` (:data:`llmsim.catalog.cutlass_dispatch.DISPATCH`), its waves of tiles over
    the GPU's ``sms``, each configuration's rate and fixed time per tile, and the input's quantization at a rate per
    SM."""
    architecture: str
    sms: int
    floor_s: float
    bandwidth_bytes_per_s: float
    quantize_bytes_per_s_per_sm: float
    sharpness: float
    configurations: dict[str, DispatchConfiguration]

    @property
    def quantize_bandwidth_bytes_per_s(self) -> float:
        """The input quantization's rate over the whole GPU."""
        return self.sms * self.quantize_bytes_per_s_per_sm


@dataclass(frozen=True)
class DecodeAttention:
    """Decode attention's figures for one KV-cache dtype with kernels of its own (``attention.by_kv_dtype``: an FP8
    cache's, which TensorRT-LLM serves with other kernels than a 16-bit one): the launch floor, fixed work per
    sequence and per (sequence, KV head), the KV read rate and the share of the 16-bit peak its FLOPs run at."""
    floor_s: float
    per_sequence_s: float
    per_kv_head_s: float
    bandwidth_bytes_per_s: float
    efficiency: float


@dataclass(frozen=True)
class PrefillAttention:
    """One attention backend's prefill: efficiency ``e x L / (L + half_length)`` of the 16-bit peak at mean
    visible context ``L`` per query (short sequences leave the device part idle), and ``kv_half_length`` more
    keys per query per KV head on the GPU over query heads (each query tile loads its KV head's keys and values:
    a GQA group shares that work, MHA repeats it per head; 0: none).

    Measured backends also compute whole ``tile_tokens x tile_tokens`` tiles (the causal diagonal's padding:
    :func:`llmsim.cost.features.causal_tile_padding`; 0: exact pairs) and have a critical path: the longest
    thread block (one query tile against the most keys a query of the step sees) runs at
    ``1 / critical_path_blocks`` of the rate, and the step's prefill attention takes
    ``T + max(0, L - critical_path_overlap x T)`` for total work time ``T`` and that block's time ``L`` (few heads
    and sequences leave SMs idle behind the last tile; 0 blocks: no critical path). Each query tile of each head
    costs ``query_tile_pairs`` pairs' time more (its thread block's fixed work: the padding column's, 0: none)."""
    efficiency: float
    half_length_tokens: float
    kv_half_length_tokens: float = 0.0
    tile_tokens: int = 0
    critical_path_blocks: float = 0.0
    critical_path_overlap: float = 0.0
    query_tile_pairs: float = 0.0


@dataclass(frozen=True)
class KernelTerms:
    gemm_floor_s: float
    gemm_bandwidth_bytes_per_s: float
    gemm_flops_per_s: dict[str, float]            # achieved, by dtype of the weights
    gemm_sharpness: float                         # p of (memory^p + compute^p)^(1/p)
    elementwise: dict[str, StreamKernel]
    all_reduce: dict[int, AllReduce]              # by group size
    decode_attention_per_sequence_s: float
    prefill_backend: str
    prefill_backends: dict[str, PrefillAttention] = field(default_factory=dict)
    step_overhead_per_sequence_s: float = 0.0
    gemm_occupancy_half_tiles: float = 0.0          # output tiles at which compute runs at half the rate
    gemm_sharpness_growth: float = 0.0              # p grows as (tiles / 128)^growth
    attention_floor_s: float = 0.0                  # one attention launch per layer and iteration (0: none)
    decode_attention_bandwidth_bytes_per_s: float = 0.0   # KV read rate of decode attention (0: the roofline's)
    decode_attention_efficiency: float = 0.0      # decode FLOPs at this share of the 16-bit peak (0: the roofline's)
    decode_attention_per_kv_head_s: float = 0.0   # fixed work per decoding sequence, KV head (on the GPU) and layer
    custom_all_reduce: dict[int, CustomAllReduce] = field(default_factory=dict)   # by group size (none: NCCL only)
    gemm_by_dtype: dict[str, GemmTerms] = field(default_factory=dict)
    # 8-bit GEMMs quantize their 16-bit input in a kernel of their own (3 bytes per element) before they start.
    gemm_quantize_bandwidth_bytes_per_s: float = 0.0
    gemm_dispatch: Fp8Dispatch | None = None       # prices the 8-bit GEMMs of a dtype with a dispatch (for_dtype)
    decode_by_kv_dtype: dict[str, DecodeAttention] = field(default_factory=dict)
    stream_fusion: StreamFusion = StreamFusion()   # streaming kernels the engine runs inside other kernels
    quantize: StreamKernel | None = None           # the engine's FP8 quantizer (no row term), where it runs as a pass

    def for_dtype(self, dtype: str) -> KernelTerms:
        """These terms with the GEMM figures of ``dtype`` where it has its own (else unchanged)."""
        own = self.gemm_by_dtype.get(dtype)
        if own is None:
            return self
        # A dispatch quantizes the input of the GEMMs it prices at its own rate (its GEMM rows time that pass).
        quantize = own.dispatch.quantize_bandwidth_bytes_per_s if own.dispatch else own.quantize_bandwidth_bytes_per_s
        return replace(self, gemm_floor_s=own.floor_s, gemm_bandwidth_bytes_per_s=own.bandwidth_bytes_per_s,
                       gemm_flops_per_s={**self.gemm_flops_per_s, dtype: own.flops_per_s},
                       gemm_sharpness=own.sharpness, gemm_sharpness_growth=own.sharpness_growth,
                       gemm_occupancy_half_tiles=own.occupancy_half_tiles,
                       gemm_quantize_bandwidth_bytes_per_s=quantize, gemm_dispatch=own.dispatch)

    def for_kv_dtype(self, kv_dtype: str) -> KernelTerms:
        """These terms with the decode-attention figures of a ``kv_dtype`` cache where it has its own (else
        unchanged: a 16-bit cache's terms, its bytes those of the dtype)."""
        own = self.decode_by_kv_dtype.get(kv_dtype)
        if own is None:
            return self
        return replace(self, attention_floor_s=own.floor_s, decode_attention_per_sequence_s=own.per_sequence_s,
                       decode_attention_per_kv_head_s=own.per_kv_head_s,
                       decode_attention_bandwidth_bytes_per_s=own.bandwidth_bytes_per_s,
                       decode_attention_efficiency=own.efficiency)

    def custom_all_reduce_for(self, group: int) -> CustomAllReduce | None:
        """The engine's all-reduce for exactly ``group`` GPUs, or None (NCCL alone)."""
        return self.custom_all_reduce.get(group)

    def gemm_rate(self, dtype: str) -> float:
        """Achieved GEMM FLOP/s for weights in ``dtype``; weight-only formats compute in 16-bit."""
        for candidate in (dtype, "bf16", "fp16"):
            if candidate in self.gemm_flops_per_s:
                return self.gemm_flops_per_s[candidate]
        return max(self.gemm_flops_per_s.values())

    def all_reduce_for(self, group: int) -> AllReduce:
        """The measured group size closest to ``group`` from below (the smallest one if none is)."""
        sizes = sorted(self.all_reduce)
        below = [size for size in sizes if size <= group]
        return self.all_reduce[below[-1] if below else sizes[0]]

    @property
    def prefill_attention(self) -> PrefillAttention:
        return self.prefill_backends[self.prefill_backend]


def engine_kernel_terms(node: Node, figure: Callable[..., float], engine_figure: Callable[..., float],
                        engines: tuple[str, ...]) -> tuple[KernelTerms | None, dict[str, KernelTerms]]:
    """``kernels:`` of a profile (None without one), and each engine's of ``kernels.engines`` (its figures laid
    over the rest of the section, read by ``engine_figure``: the profile records only those the overlay holds);
    ``engines`` are the names allowed."""
    base = kernel_terms_from_node(node, figure)
    if base is None or not node.child("kernels").has("engines"):
        return base, {}
    kernels = node.child("kernels")
    overlays = kernels.child("engines")
    # vLLM's CUTLASS dispatch is the section's engine's kernel: another engine's overlay does not inherit it.
    section = {key: value for key, value in kernels.data.items() if key != "engines"}
    if isinstance(section.get("gemm"), dict) and isinstance(section["gemm"].get("by_dtype"), dict):
        by_dtype = {dtype: ({key: value for key, value in entry.items() if key != "dispatch"}
                            if isinstance(entry, dict) else entry)
                    for dtype, entry in section["gemm"]["by_dtype"].items()}
        section["gemm"] = {**section["gemm"], "by_dtype": by_dtype}
    out = {}
    for name in list(overlays.data):
        if name not in engines:
            raise overlays.key_error(str(name), "is not an engine with kernel terms", name, ", ".join(engines))
        if not isinstance(overlays.data[name], dict):
            raise overlays.key_error(str(name), "expected a mapping of kernels: figures", overlays.data[name],
                                     "gemm, attention, all_reduce, custom_all_reduce ...")
        merged = Node(deep_merge(section, overlays.data[name]), file=node.file, path=overlays.key_path(str(name)))
        out[str(name)] = replace(_terms_from_section(merged, engine_figure),
                                 stream_fusion=STREAM_FUSION.get(str(name), StreamFusion()))
    return base, out


def kernel_terms_from_node(node: Node, figure: Callable[..., float]) -> KernelTerms | None:
    """``kernels:`` of a profile, or None without one; ``figure(node, key, kind, **limits)`` reads a figure."""
    if not node.has("kernels"):
        return None
    return _terms_from_section(node.child("kernels"), figure)


def _terms_from_section(kernels: Node, figure: Callable[..., float]) -> KernelTerms:
    gemm = kernels.child("gemm")
    rates = gemm.child("achieved_flops")
    flops = {dtype: figure(rates, dtype, "flops") for dtype in list(rates.data)}
    if not flops:
        raise kernels.key_error("gemm.achieved_flops", "needs at least one dtype", {}, "fp16, bf16, fp8")
    rates.done()
    elementwise_node = kernels.child("elementwise")
    elementwise = {}
    for kind in ELEMENTWISE_KINDS:
        elementwise[kind] = _stream_kernel(elementwise_node.child(kind), figure)
    elementwise_node.done()
    reduce_node = kernels.child("all_reduce")
    all_reduce = {}
    for key in list(reduce_node.data):
        if not str(key).isdigit() or int(key) < 2:
            raise reduce_node.key_error(str(key), "expected a group size", key, "an integer >= 2 (GPUs in the group)")
        entry = reduce_node.child(key)
        all_reduce[int(key)] = _nccl_all_reduce(entry, figure)
        entry.done()
    if not all_reduce:
        raise kernels.key_error("all_reduce", "needs at least one group size", {}, "2, 4, 8")
    reduce_node.done()
    attention = kernels.child("attention")
    backends_node = attention.child("prefill_backends")
    backends = {}
    for name in list(backends_node.data):
        entry = backends_node.child(name)
        tile = _optional(entry, "tile_tokens", figure)
        if tile != int(tile):
            raise entry.key_error("tile_tokens", "expected a whole number of tokens", tile, "an integer >= 0")
        blocks = _optional(entry, "critical_path_blocks", figure)
        if blocks and not tile:
            raise entry.key_error("critical_path_blocks", "needs tile_tokens (the critical path is one query tile)",
                                  blocks, "0 without tile_tokens")
        query_tile_pairs = _optional(entry, "query_tile_pairs", figure)
        if query_tile_pairs and not tile:
            raise entry.key_error("query_tile_pairs", "needs tile_tokens (the cost is per query tile)",
                                  query_tile_pairs, "0 without tile_tokens")
        backends[str(name)] = PrefillAttention(
            figure(entry, "efficiency", None, minimum=0.0, maximum=1.0, exclusive_minimum=True),
            figure(entry, "half_length", None, minimum=0.0, exclusive_minimum=False),
            _optional(entry, "kv_half_length", figure), int(tile), blocks,
            figure(entry, "critical_path_overlap", None, minimum=0.0, maximum=1.0, exclusive_minimum=False)
            if entry.has("critical_path_overlap") else 0.0, query_tile_pairs)
        entry.done()
    backends_node.done()
    backend = attention.choice("prefill_backend", tuple(backends) or ("(none given)",))
    step = kernels.child("step")
    custom = {}
    if kernels.has("custom_all_reduce"):
        custom_node = kernels.child("custom_all_reduce")
        for key in list(custom_node.data):
            entry = custom_node.child(key)
            if not str(key).isdigit() or int(key) < 2:
                raise custom_node.key_error(str(key), "expected a group size", key,
                                            "an integer >= 2 (GPUs in the group)")
            custom[int(key)] = CustomAllReduce(_all_reduce(entry, figure), figure(entry, "switch_over", "bytes"),
                                               figure(entry, "two_shot_from", "bytes"))
            entry.done()
        custom_node.done()
    by_dtype = _entries(gemm, "by_dtype", lambda entry: GemmTerms(
        figure(entry, "floor", "duration", minimum=0.0, exclusive_minimum=False),
        figure(entry, "bandwidth", "bandwidth"), figure(entry, "achieved_flops", "flops"),
        figure(entry, "sharpness", None, minimum=1.0, exclusive_minimum=False),
        _optional(entry, "sharpness_growth", figure), _optional(entry, "occupancy_half_tiles", figure),
        _optional(entry, "quantize_bandwidth", figure, "bandwidth"),
        _dispatch(entry.child("dispatch"), figure) if entry.has("dispatch") else None))
    by_kv_dtype = _entries(attention, "by_kv_dtype", lambda entry: DecodeAttention(
        figure(entry, "floor", "duration", minimum=0.0, exclusive_minimum=False),
        figure(entry, "decode_per_sequence", "duration", minimum=0.0, exclusive_minimum=False),
        figure(entry, "decode_per_kv_head", "duration", minimum=0.0, exclusive_minimum=False),
        figure(entry, "decode_bandwidth", "bandwidth"),
        figure(entry, "decode_efficiency", None, minimum=0.0, maximum=1.0)))
    terms = KernelTerms(
        gemm_floor_s=figure(gemm, "floor", "duration", minimum=0.0, exclusive_minimum=False),
        gemm_bandwidth_bytes_per_s=figure(gemm, "bandwidth", "bandwidth"),
        gemm_flops_per_s=flops,
        gemm_sharpness=figure(gemm, "sharpness", None, minimum=1.0, exclusive_minimum=False),
        elementwise=elementwise, all_reduce=all_reduce,
        decode_attention_per_sequence_s=figure(attention, "decode_per_sequence", "duration", minimum=0.0,
                                               exclusive_minimum=False),
        prefill_backend=backend, prefill_backends=backends,
        step_overhead_per_sequence_s=figure(step, "per_sequence", "duration", minimum=0.0,
                                            exclusive_minimum=False),
        gemm_occupancy_half_tiles=_optional(gemm, "occupancy_half_tiles", figure),
        gemm_sharpness_growth=_optional(gemm, "sharpness_growth", figure),
        attention_floor_s=_optional(attention, "floor", figure, "duration"),
        decode_attention_bandwidth_bytes_per_s=_optional(attention, "decode_bandwidth", figure, "bandwidth"),
        decode_attention_efficiency=(figure(attention, "decode_efficiency", None, minimum=0.0, maximum=1.0)
                                     if attention.has("decode_efficiency") else 0.0),
        decode_attention_per_kv_head_s=_optional(attention, "decode_per_kv_head", figure, "duration"),
        custom_all_reduce=custom, gemm_by_dtype=by_dtype, decode_by_kv_dtype=by_kv_dtype,
        quantize=_quantizer(kernels.child("quantize"), figure) if kernels.has("quantize") else None)
    for done in (gemm, attention, step):
        done.done()
    kernels.done(extra_allowed=("note", "engines"))
    return terms


def _dispatch(entry: Node, figure: Callable[..., float]) -> Fp8Dispatch:
    """``gemm.by_dtype.<dtype>.dispatch``: vLLM's CUTLASS dispatch, one entry per configuration of its architecture."""
    architecture = entry.choice("architecture", tuple(DISPATCH))
    names = tuple(DISPATCH[architecture].configs)
    configurations_node = entry.child("configurations")
    given = [str(name) for name in configurations_node.data] if isinstance(configurations_node.data, dict) else []
    if sorted(given) != sorted(names):
        raise entry.key_error("configurations", f"expected one entry for each of {architecture}'s configurations",
                              configurations_node.data, ", ".join(names))
    configurations = {}
    for name in names:
        config = configurations_node.child(name)
        configurations[name] = DispatchConfiguration(
            figure(config, "achieved_flops", "flops"),
            figure(config, "tile_overhead", "duration", minimum=0.0, exclusive_minimum=False))
        config.done()
    configurations_node.done()
    dispatch = Fp8Dispatch(
        architecture, int(figure(entry, "sms", None, integer=True, minimum=1)),
        figure(entry, "floor", "duration", minimum=0.0, exclusive_minimum=False),
        figure(entry, "bandwidth", "bandwidth"), figure(entry, "quantize_bandwidth_per_sm", "bandwidth"),
        figure(entry, "sharpness", None, minimum=1.0, exclusive_minimum=False), configurations)
    entry.done()
    return dispatch


def _stream_kernel(entry: Node, figure: Callable[..., float]) -> StreamKernel:
    """A streaming kernel's floor, bandwidth and one block's row bandwidth (an elementwise kind's, the quantizer's)."""
    kernel = StreamKernel(figure(entry, "floor", "duration"), figure(entry, "bandwidth", "bandwidth"),
                          figure(entry, "row_bandwidth", "bandwidth"))
    entry.done()
    return kernel


def _quantizer(entry: Node, figure: Callable[..., float]) -> StreamKernel:
    """The engine's FP8 quantization kernel: its floor and bandwidth (fitted on tensors of hundreds of MB, where one
    block's row is no term of its own)."""
    kernel = StreamKernel(figure(entry, "floor", "duration"), figure(entry, "bandwidth", "bandwidth"), math.inf)
    entry.done()
    return kernel


def _all_reduce(entry: Node, figure: Callable[..., float]) -> AllReduce:
    """An all-reduce's two lines (small and large messages), as NCCL's and a custom kernel's entries give them."""
    return AllReduce(figure(entry, "latency", "duration"), figure(entry, "bus_bandwidth", "bandwidth"),
                     figure(entry, "large_latency", "duration"), figure(entry, "large_bus_bandwidth", "bandwidth"))


def _nccl_all_reduce(entry: Node, figure: Callable[..., float]) -> AllReduce:
    """NCCL's all-reduce: the two lines of :func:`_all_reduce` and, where the entry has both ``medium_*`` figures,
    the middle protocol's line (a profile written before it existed has neither)."""
    lines = _all_reduce(entry, figure)
    given = [key for key in MEDIUM_ALL_REDUCE_KEYS if entry.has(key)]
    if not given:
        return lines
    if len(given) < len(MEDIUM_ALL_REDUCE_KEYS):
        missing = next(key for key in MEDIUM_ALL_REDUCE_KEYS if key not in given)
        raise entry.error(f"is needed with {given[0]} (the middle protocol's line has both)",
                          key=entry.key_path(missing),
                          allowed="both medium_latency and medium_bus_bandwidth, or neither", has_value=False)
    return replace(lines, medium_latency_s=figure(entry, "medium_latency", "duration"),
                   medium_bus_bandwidth_bytes_per_s=figure(entry, "medium_bus_bandwidth", "bandwidth"))


def _entries(parent: Node, key: str, read: Callable[[Node], T]) -> dict[str, T]:
    """An optional mapping of named entries (``by_dtype``, ``by_kv_dtype``), each read by ``read``."""
    if not parent.has(key):
        return {}
    node, out = parent.child(key), {}
    for name in list(node.data):
        entry = node.child(name)
        out[str(name)] = read(entry)
        entry.done()
    node.done()
    return out


def _optional(node: Node, key: str, figure: Callable[..., float], kind: str | None = None) -> float:
    """A non-negative figure that profiles written before it existed leave out (0: its old form)."""
    return figure(node, key, kind, minimum=0.0, exclusive_minimum=False) if node.has(key) else 0.0
