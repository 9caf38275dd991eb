"""Fitting physical kernel forms to the measured operator database (:mod:`llmsim.calibration.database`).

Every form is a launch floor plus the larger of a memory time (bytes over an achieved bandwidth) and a
compute time (FLOPs over an achieved rate), the forms the cost model prices a step with; the achieved
figures are fractions of the GPU's datasheet figures (``peak_bf16``, ``peak_fp8``, ``hbm``, ``link``
columns of each row), so one fit can pool GPUs and predict one it never saw (:func:`leave_one_out`):

- GEMM, per dtype: :func:`llmsim.cost.kernels.gemm_time_s` (floor, bandwidth, rate, the smooth maximum's
  sharpness and its growth with output tiles, the occupancy's half tiles);
- decode attention: ``floor + max(b (per_sequence + h_kv x per_kv_head) + FLOPs / rate, bytes / bandwidth)``
  with ``b`` sequences of ``s`` cached tokens, ``4 h d b s`` FLOPs and ``b (s + 1) 2 h_kv d e + b 2 h d 2``
  bytes (KV read and written at ``e`` bytes per element, query in and output out), as the cost model's
  decode-attention row; fitted per KV-cache dtype (an FP8 cache runs other kernels). The FP8 cache's fit
  (:data:`DECODE_ATTENTION_OCCUPIED`) reads the cache at ``blocks / (blocks + half_blocks)`` of its rate, ``blocks``
  the kernel's thread blocks (``b h_kv``): the few blocks of a short batch leave SMs idle, and one line through
  them and a serving batch's thousands read the cache too slowly for the latter; the cost model prices the full rate
  (its features sum a batch; a serving step runs hundreds of blocks, where the factor is within 1% of 1);
- prefill attention: ``floor + 4 d b (h P + (half h + kv_half h_kv) s) / rate`` plus a critical path, with ``P``
  the causal pairs in whole 64 x 64 tiles and ``query_tile_pairs`` more per query tile (each tile's thread block's
  fixed work), ``half`` more keys per query head standing for short sequences' idle units, and ``kv_half`` more per
  KV head (loading a KV head's keys and values per query tile: MHA pays it per query head, GQA once per group);
  ``rate`` the lesser of the tensor cores' (``peak x efficiency``) and the softmax exponentials' (:func:`prefill_rate`).
  Only the prompt lengths a prefill kernel timed are fitted: the one-token prompts some tables time with a decode
  kernel are decode attention's work (:func:`llmsim.calibration.database.prefill_attention_rows`);
- collectives (all-reduce, all-gather, reduce-scatter, all-to-all): per group size the least of alpha-beta
  lines over the bus traffic (``2 (g-1)/g`` of the message for an all-reduce, ``(g-1)/g`` for the others), as
  NCCL picks the fastest protocol: three lines for the all-reduce (NCCL's LL, LL128 and Simple protocols; two leave
  its 8-GPU rows 20% off at 256 MiB and up, where the Simple protocol's bandwidth is still rising), two for the
  others (recorded only); the engine's custom all-reduce: its one-shot line below a fitted message size, its
  two-shot line from there, and the line of whatever the engine hands larger messages to from a third size
  (:data:`CUSTOM_ALL_REDUCE`), as the engine switches kernels by size;
- the engine's FP8 quantization kernel: ``floor + 3 m k / bandwidth`` over an ``m x k`` tensor (read in 16 bits,
  written in 8), on tensors too large for the GPU's L2 cache (:data:`QUANTIZE_MIN_INPUT_BYTES`);
- MoE grouped GEMM: ``floor + max(weight bytes of the experts touched / bandwidth, FLOPs / rate)``;
- MLA (DeepSeek-V3's attention module): decode as above over the latent cache, prefill as above.

Each fit is ``scipy.optimize.least_squares`` on ``log(predicted / measured)`` (a relative error: a 10% miss
weighs the same on a 5 us kernel as on a 5 ms one), positive parameters fitted as logs.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from llmsim.catalog.cutlass_dispatch import DISPATCH, SM_COUNTS
from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.kernel_terms import DispatchConfiguration, Fp8Dispatch
from llmsim.cost.features import causal_tile_padding
from llmsim.cost.kernels import dispatch_gemm_body_s, gemm_body_s, gemm_output_tiles

BF16 = 2.0
DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp8_block": 1.0}
MLA_LATENT, MLA_ROPE, MLA_NOPE, MLA_V = 512.0, 64.0, 128.0, 128.0   # DeepSeek-V3's MLA dimensions
SMALL_MESSAGE_BYTES = 64 * 1024
# The quantizer rows the fit reads: 16-bit inputs of 256 MiB and more. The database times the kernel over and over on
# one tensor, and smaller ones stay in the L2 cache (50 MB on an H100, NVIDIA H100 whitepaper; 96 MB on an L40S, NVIDIA
# Ada whitepaper: its rows of 10-100 MB read 4.7 TB/s on a 0.86 TB/s memory), which a serving step's activations
# written by another kernel in between do not.
QUANTIZE_MIN_INPUT_BYTES = 256 * 2 ** 20


DEVICE_COLUMNS = ("peak_bf16", "peak_fp8", "hbm", "link")
SMS_COLUMN = "sms"       # the GPU's SM count, on rows a dispatch form prices (not a datasheet figure of the profile)
# The FP8 GEMM rows the dispatch form is fitted to: two tokens and more. Every Blackwell table (B200, B300, GB200) times
# m = 1 a median 13.5-16.4 us above m = 2 at the same n, k (1.8-2.3x; the Hopper tables do not: -0.2 and -0.4 us), a
# path of its own that no source names; the cost model needs a GEMM time that never falls as tokens grow, so it
# prices one token as CUTLASS's dispatch runs it and the form is not pulled towards that path.
DISPATCH_MIN_TOKENS = 2


def device_columns(profile: HardwareProfile) -> dict[str, float]:
    """The datasheet figures a row's fitted fractions multiply (the columns of DEVICE_COLUMNS)."""
    return {"peak_bf16": profile.peak_for("bf16"), "peak_fp8": profile.peak_for("fp8"),
            "hbm": profile.memory_bandwidth_bytes_per_s, "link": profile.interconnect_bandwidth_bytes_per_s}


@dataclass(frozen=True)
class Form:
    """A kernel form: parameter names, a start, and ``predict(values, rows) -> seconds``."""
    name: str
    parameters: tuple[str, ...]
    start: tuple[float, ...]
    predict: Callable[[np.ndarray, pd.DataFrame], np.ndarray]
    upper: tuple[float, ...] | None = None
    # Least squares on the log errors when None; else a robust loss (soft L1) that weighs a log error beyond this
    # scale linearly, not squared, so a few rows far off every form (single sizes timed at twice their neighbours)
    # do not move the fit.
    robust_scale: float | None = None
    lower: tuple[float, ...] | None = None      # none: down to 0 (the parameters are fitted as logs)

    def fit(self, rows: pd.DataFrame, fixed: dict[str, float] | None = None) -> dict[str, float]:
        """The parameters fitted to ``rows``, those in ``fixed`` held at their values."""
        fixed = fixed or {}
        free = [i for i, name in enumerate(self.parameters) if name not in fixed]
        measured = rows["measured_s"].to_numpy()
        values = np.array([fixed.get(name, 0.0) for name in self.parameters])

        def residuals(q):
            values[free] = np.exp(q)
            return np.log(self.predict(values, rows) / measured)
        upper = np.log(np.array(self.upper)[free]) if self.upper else np.inf
        lower = np.log(np.array(self.lower)[free]) if self.lower else -np.inf
        loss = {"loss": "soft_l1", "f_scale": self.robust_scale} if self.robust_scale else {}
        fitted = least_squares(residuals, np.log(np.array(self.start)[free]), bounds=(lower, upper), x_scale="jac",
                               **loss).x
        values[free] = np.exp(fitted)
        return dict(zip(self.parameters, (float(v) for v in values)))

    def __call__(self, values: dict[str, float], rows: pd.DataFrame) -> np.ndarray:
        return self.predict(np.array([values[p] for p in self.parameters]), rows)


@dataclass(frozen=True)
class _GemmShapeTerms:
    """What :func:`gemm_body_s` reads of a KernelTerms."""
    gemm_sharpness: float
    gemm_sharpness_growth: float
    gemm_occupancy_half_tiles: float


def _gemm(v, rows):
    floor, bandwidth_share, rate_share, sharpness_excess, growth, half_tiles, quantize_share = v
    m, n, k = (rows[c].to_numpy() for c in ("m", "n", "k"))
    element = rows["dtype"].map(DTYPE_BYTES).to_numpy()
    peak = np.where(rows["dtype"].to_numpy() == "bf16", rows["peak_bf16"].to_numpy(), rows["peak_fp8"].to_numpy())
    hbm = rows["hbm"].to_numpy()
    memory = (n * k * element + m * (n + k) * element) / (hbm * bandwidth_share)
    compute = 2.0 * m * n * k / (peak * rate_share)
    shape = _GemmShapeTerms(1.0 + sharpness_excess, growth, half_tiles)
    # 8-bit GEMMs first quantize their 16-bit input, a kernel of its own: it reads m x k 16-bit values and writes
    # them in 8 bits (3 bytes each) before the GEMM starts.
    quantize = np.where(element < BF16, m * k * 3.0 / (hbm * quantize_share), 0.0)
    return floor + quantize + gemm_body_s(memory, compute, gemm_output_tiles(m, n), shape)


GEMM = Form("gemm", ("floor_s", "bandwidth_share", "rate_share", "sharpness_excess", "sharpness_growth",
                     "occupancy_half_tiles", "quantize_share"), (5e-6, 0.8, 0.7, 0.5, 0.5, 40.0, 0.3), _gemm,
            (1e-3, 1.0, 1.0, 1e3, 10.0, 1e5, 1.0))



def gemm_fp8_dispatch_form(architecture: str) -> Form:
    """vLLM's FP8 GEMM as its CUTLASS dispatch runs it (:mod:`llmsim.catalog.cutlass_dispatch`): the input's
    quantization, then the smooth maximum (sharpness ``p``) of the weight and activation traffic and the
    configuration's compute, ``waves x (2 tile_m tile_n k / (peak_fp8 / SMs x rate) + tile_overhead)`` (``tile_m`` the
    rows one SM computes; :func:`llmsim.cost.kernels.dispatch_gemm_body_s`, as the cost model prices it): each
    configuration its own share of the FP8 peak and its own fixed time per tile (pipeline fill and output tile: the
    tile and cluster shapes differ), shared by the GPUs of ``architecture``.

    The quantization pass (3 bytes an element of the ``m x k`` input) runs at a rate per SM, not a share of the HBM:
    fitted as a share, each Hopper takes the same 1.1-1.2 TB/s on its own rows (H100 SXM 0.36 of 3.35 TB/s, H200 0.23
    of 4.8; both 132 SMs at the same clocks), so the kernel is bound by its SMs. Its rows are those of
    :data:`DISPATCH_MIN_TOKENS` tokens and more. Rows carry an ``sms`` column
    (:data:`~llmsim.catalog.cutlass_dispatch.SM_COUNTS`)."""
    names = list(DISPATCH[architecture].configs)
    parameters = ("floor_s", "bandwidth_share", "quantize_bytes_per_s_per_sm", "sharpness",
                  *(f"rate_{name}" for name in names), *(f"tile_overhead_s_{name}" for name in names))

    def predict(v, rows):
        values = dict(zip(parameters, v))
        out = np.empty(len(rows))
        # The rows of one GPU at a time: its SMs, FP8 peak and HBM bandwidth make one dispatch of the fitted figures.
        for (sms, peak, hbm), at in rows.groupby([SMS_COLUMN, "peak_fp8", "hbm"], sort=False).indices.items():
            dispatch = dispatch_terms(architecture, values, int(sms), peak, hbm)
            m, n, k = (rows[c].to_numpy()[at].astype(float) for c in ("m", "n", "k"))
            out[at] = (dispatch.floor_s + m * k * 3.0 / dispatch.quantize_bandwidth_bytes_per_s
                       + dispatch_gemm_body_s(m, n, k, 1.0, BF16, dispatch.bandwidth_bytes_per_s, dispatch))
        return out

    return Form(f"gemm_fp8_dispatch_{architecture}", parameters,
                (8e-6, 0.8, 1e10, 2.0, *(0.6,) * len(names), *(1e-6,) * len(names)), predict,
                (1e-3, 1.0, 1e12, 100.0, *(2.0,) * len(names), *(1e-4,) * len(names)))


def dispatch_terms(architecture: str, values: dict[str, float], sms: int, peak_fp8_flops_per_s: float,
                   hbm_bytes_per_s: float) -> Fp8Dispatch:
    """The :class:`~llmsim.catalog.kernel_terms.Fp8Dispatch` of :func:`gemm_fp8_dispatch_form`'s fitted ``values``
    on a GPU of ``sms`` SMs and these datasheet figures (the shares made rates)."""
    return Fp8Dispatch(
        architecture, sms, values["floor_s"], values["bandwidth_share"] * hbm_bytes_per_s,
        values["quantize_bytes_per_s_per_sm"], values["sharpness"],
        {name: DispatchConfiguration(values[f"rate_{name}"] * peak_fp8_flops_per_s, values[f"tile_overhead_s_{name}"])
         for name in DISPATCH[architecture].configs})


def decode_bytes(batch, kv_tokens, heads, kv_heads, head_dim, kv_bytes=BF16):
    """Bytes a decode-attention kernel moves: KV read (and the new token's written) at ``kv_bytes`` per element,
    query in and output out in 16 bits."""
    return batch * (kv_tokens + 1) * 2 * kv_heads * head_dim * kv_bytes + batch * 2 * heads * head_dim * BF16


def _decode(v, rows):
    floor, per_sequence, per_kv_head, bandwidth_share, rate_share = v
    b, s, h, hk, d = (rows[c].to_numpy() for c in ("batch", "kv_tokens", "heads", "kv_heads", "head_dim"))
    # Fixed work per sequence and per (sequence, KV head): decode kernels run a thread block per KV head of each
    # sequence (its query heads packed together), whose set-up and softmax merge do not shrink with the context.
    compute = b * (per_sequence + per_kv_head * hk) + 4 * h * d * b * s / (rows["peak_bf16"].to_numpy() * rate_share)
    kv_bytes = rows["kv_bytes"].to_numpy() if "kv_bytes" in rows else BF16
    memory = decode_bytes(b, s, h, hk, d, kv_bytes) / (rows["hbm"].to_numpy() * bandwidth_share)
    return floor + np.maximum(compute, memory)


DECODE_ATTENTION = Form("decode_attention", ("floor_s", "per_sequence_s", "per_kv_head_s", "bandwidth_share",
                                             "rate_share"), (1e-5, 2e-8, 2e-8, 0.8, 0.3), _decode,
                        (1e-3, 1e-4, 1e-4, 1.0, 1.0))


def _decode_occupied(v, rows):
    *line, half_blocks = v
    # A decode kernel runs one thread block per (sequence, KV head): with few of them the GPU's SMs stand idle and the
    # cache streams at blocks / (blocks + half_blocks) of the full read rate (TensorRT-LLM's XQA kernels reach it from
    # tens of blocks, what any serving batch has).
    blocks = rows["batch"].to_numpy() * rows["kv_heads"].to_numpy()
    floor, per_sequence, per_kv_head, bandwidth_share, rate_share = line
    occupied = rows["hbm"] * bandwidth_share * blocks / (blocks + half_blocks)
    return _decode(np.array([floor, per_sequence, per_kv_head, 1.0, rate_share]), rows.assign(hbm=occupied))


DECODE_ATTENTION_OCCUPIED = Form("decode_attention_occupied", (*DECODE_ATTENTION.parameters, "half_blocks"),
                                 (*DECODE_ATTENTION.start, 4.0), _decode_occupied,
                                 (*(DECODE_ATTENTION.upper or ()), 1e4))


def _prefill(v, rows):
    floor, efficiency, half, kv_half, blocks, overlap, query_tile_pairs, softmax_clock_hz = v
    b, s, h, hk, d = (rows[c].to_numpy() for c in ("batch", "tokens", "heads", "kv_heads", "head_dim"))
    # Causal pairs in whole tiles and a fixed cost per query tile of each head (``query_tile_pairs`` pairs' time:
    # TensorRT-LLM's context kernels run one thread block per query tile, head and sequence, fmhaKernels.h
    # computeNumCtas), ``half`` more keys per query head (idle units on short sequences) and ``kv_half`` more per KV
    # head: every query tile loads its KV head's keys and values, work a GQA group shares and MHA repeats per head.
    pairs = s * (s + 1) / 2 + causal_tile_padding(s, 0.0, PREFILL_TILE_TOKENS, query_tile_pairs)
    rate = prefill_rate(rows, efficiency, softmax_clock_hz)
    total = 4 * d * b * (h * pairs + (half * h + kv_half * hk) * s) / rate
    # The critical path: the longest thread block (one query tile against every key) at 1/blocks of the rate; few
    # heads and sequences leave SMs idle behind it, work that ``overlap`` of the total hides.
    longest = 4 * d * PREFILL_TILE_TOKENS * s * blocks / rate
    return floor + total + np.maximum(longest - overlap * total, 0.0)


def prefill_rate(rows: pd.DataFrame, efficiency: float, softmax_clock_hz: float) -> np.ndarray:
    """Prefill attention's FLOP rate per row: the lesser of the tensor cores' (``efficiency`` of the 16-bit peak) and
    the softmax exponentials' (one per query-key pair, ``4 d`` FLOPs, at :data:`EXPONENTIALS_COLUMN` per clock and
    ``softmax_clock_hz``): a kernel's time is the larger of its matrix products' and its exponentials'."""
    return np.minimum(rows["peak_bf16"].to_numpy() * efficiency,
                      4 * rows["head_dim"].to_numpy() * rows[EXPONENTIALS_COLUMN].to_numpy() * softmax_clock_hz)


# vLLM's FlashAttention and FlashInfer prefill kernels tile queries and keys by 64 on Hopper; one tile size for all
# GPUs (128 x 128 held out worse on Blackwell too: benchmarks/fidelity_forms.py).
PREFILL_TILE_TOKENS = 64
PREFILL_ATTENTION = Form("prefill_attention", ("floor_s", "efficiency", "half_length_tokens", "kv_half_length_tokens",
                                               "critical_path_blocks", "critical_path_overlap", "query_tile_pairs",
                                               "softmax_clock_hz"),
                         (1e-5, 0.5, 256.0, 256.0, 300.0, 0.3, 64.0, 1e9), _prefill,
                         (1e-3, 1.0, 1e6, 1e6, 1e5, 1.0, 1e6, 1e10))
# Softmax exponentials (MUFU.EX2) per clock per SM: 16 on Ampere, Ada, Hopper and Blackwell (CUDA C++ Programming
# Guide, arithmetic instruction throughput: 32-bit base-2 exponential), twice that on Blackwell Ultra (NVIDIA technical
# blog "Making Softmax More Efficient with NVIDIA Blackwell Ultra"). The fitted clock is an assumption that one clock
# holds across an architecture's GPUs.
EXPONENTIALS_PER_CLOCK_PER_SM = {"B300": 32.0}
EXPONENTIALS_PER_CLOCK = 16.0
# SMs per GPU: the dispatch table's (cutlass_dispatch.SM_COUNTS), A100 108 (NVIDIA A100 Tensor Core GPU Architecture
# whitepaper), L40S 142 (NVIDIA L40S datasheet: 18,176 CUDA cores at 128 per SM).
STREAMING_MULTIPROCESSORS = {**SM_COUNTS, "A100-80GB": 108, "L40S": 142}
EXPONENTIALS_COLUMN = "exponentials_per_clock"    # the GPU's softmax exponentials per clock, on prefill rows


def exponentials_per_clock(gpu: str) -> float:
    """The GPU's softmax exponentials per clock over all its SMs."""
    return STREAMING_MULTIPROCESSORS[gpu] * EXPONENTIALS_PER_CLOCK_PER_SM.get(gpu, EXPONENTIALS_PER_CLOCK)


def _collective(traffic_share: float):
    def predict(v, rows):
        g = rows["group"].to_numpy()
        traffic = traffic_share * (g - 1) / g * rows["bytes"].to_numpy()
        link = rows["link"].to_numpy()
        # One (latency, share of the link) pair per protocol; NCCL runs the fastest.
        return np.min([latency + traffic / (link * share) for latency, share in zip(v[0::2], v[1::2])], axis=0)
    return predict


COLLECTIVE_PARAMETERS = ("latency_s", "bus_share", "large_latency_s", "large_bus_share")
# NCCL's three protocols for the all-reduce, in the order the profile's lines name them: small, large and the middle
# one (``kernel_terms.AllReduce``); the start puts each line where its protocol wins (LL128 between LL and Simple).
# Where the smallest messages cost a flat latency (8 GPUs), the small line's bandwidth is free to fall towards 0:
# each line keeps at least 1% of the link, which leaves every measured row's prediction as it is.
ALL_REDUCE_PARAMETERS = (*COLLECTIVE_PARAMETERS, "medium_latency_s", "medium_bus_share")
ALL_REDUCE = Form("all_reduce", ALL_REDUCE_PARAMETERS, (1e-5, 0.05, 6e-5, 0.8, 2e-5, 0.3), _collective(2.0),
                  (1e-3, 10, 1e-3, 10, 1e-3, 10), lower=(1e-9, 0.01, 1e-9, 0.01, 1e-9, 0.01))
# nccl-tests means of single message sizes jump to about twice their neighbours' (H100 all-to-all, 4 GPUs: 17.7 us at
# 1 KiB between 6.5 and 7.0 us), a level no alpha-beta line follows: the all-gather, reduce-scatter and all-to-all
# lines are fitted with a robust loss. The all-reduce's keep least squares (held out within 10% either way).
NCCL_ROBUST_SCALE = 0.2
COLLECTIVE = Form("collective", COLLECTIVE_PARAMETERS, (1e-5, 0.05, 3e-5, 0.8), _collective(1.0), (1e-3, 10, 1e-3, 10),
                  NCCL_ROBUST_SCALE)


def _reduce_traffic(rows: pd.DataFrame) -> np.ndarray:
    """An all-reduce's bus traffic over the datasheet link rate: ``2 (g-1)/g`` of the message per link second."""
    g = rows["group"].to_numpy()
    return 2.0 * (g - 1) / g * rows["bytes"].to_numpy() / rows["link"].to_numpy()


def _switched_all_reduce(v, rows):
    (one_shot_latency, one_shot_share, two_shot_latency, two_shot_share, two_shot_from,
     handoff_latency, handoff_share, handoff_from) = v
    message, traffic = rows["bytes"].to_numpy(), _reduce_traffic(rows)
    return np.where(message < two_shot_from, one_shot_latency + traffic / one_shot_share,
                    np.where(message < handoff_from, two_shot_latency + traffic / two_shot_share,
                             handoff_latency + traffic / handoff_share))


def _line(v, rows):
    latency, share = v
    return latency + _reduce_traffic(rows) / share


REDUCE_LINE = Form("all_reduce_line", ("latency_s", "bus_share"), (1e-5, 0.3), _line, (1e-3, 10))
MIN_LINE_SIZES = 4              # message sizes a line of a switched form stands on, at least


@dataclass(frozen=True)
class SwitchedForm(Form):
    """Lines (a latency and a share of the link rate each) that follow one another at message sizes: parameters
    ``(latency, share) x lines`` with the size at which each line after the first starts after its pair, in order.
    Each line is fitted to its own sizes (least squares on the log, separable once the sizes are fixed), and the
    sizes are the best of the points between measured sizes, each line on at least MIN_LINE_SIZES of them; a line
    the best fit does not need starts past the largest size and repeats the one before it."""

    def fit(self, rows: pd.DataFrame, fixed: dict[str, float] | None = None) -> dict[str, float]:
        sizes = np.sort(rows["bytes"].unique())
        lines = (len(self.parameters) + 1) // 3
        fitted: dict[tuple[int, int], tuple[float, dict[str, float]]] = {}

        def segment(lo: int, hi: int) -> tuple[float, dict[str, float]]:
            """The line through sizes[lo:hi] and its cost (sum of squared log errors)."""
            if (lo, hi) not in fitted:
                part = rows[rows["bytes"].between(sizes[lo], sizes[hi - 1])]
                values = REDUCE_LINE.fit(part)
                fitted[(lo, hi)] = (float(np.sum(np.log(REDUCE_LINE(values, part) / part["measured_s"]) ** 2)), values)
            return fitted[(lo, hi)]

        def best(lo: int, left: int) -> tuple[float, list[int]]:
            """The cheapest cut of sizes[lo:] into at most ``left`` lines: (cost, the starts of the lines after the
            first)."""
            whole: tuple[float, list[int]] = (segment(lo, len(sizes))[0], [])
            if left == 1:
                return whole
            options = [whole]
            for cut in range(lo + MIN_LINE_SIZES, len(sizes) - MIN_LINE_SIZES + 1):
                cost, starts = best(cut, left - 1)
                options.append((segment(lo, cut)[0] + cost, [cut, *starts]))
            return min(options, key=lambda option: option[0])

        assert len(sizes) >= MIN_LINE_SIZES, "a switched all-reduce table of fewer sizes than a line stands on"
        _, starts = best(0, lines)
        bounds = [0, *starts, len(sizes)]
        out: dict[str, float] = {}
        for line in range(lines):
            used = min(line, len(bounds) - 2)           # a line the fit does not need repeats the last one
            names = self.parameters[3 * line - 1:3 * line + 2] if line else self.parameters[:2]
            out.update(zip(names[:2], segment(bounds[used], bounds[used + 1])[1].values()))
            if line:
                out[names[2]] = (float(np.sqrt(sizes[bounds[line] - 1] * sizes[bounds[line]]))
                                 if line < len(bounds) - 1 else float(2.0 * sizes[-1]))
        return {name: out[name] for name in self.parameters}


# The engines' all-reduce as their tables time it is three kernels by message size. vLLM's CustomAllreduce::allreduce
# (csrc/custom_all_reduce.cuh) runs the one-shot kernel (every GPU reads every peer's whole message) on 2 GPUs always,
# and on 4 below 512 KiB and 8 below 256 KiB, the two-shot one (reduce-scatter, then all-gather) above; and past the
# largest message its own kernel takes (vllm/distributed/device_communicators/all_reduce_utils.py,
# CUSTOM_ALL_REDUCE_MAX_SIZES: on Hopper 64 MiB on 2 GPUs, 32 MiB on 4, 256 KiB on 8) the engine hands the call to
# another implementation (PyTorch's symmetric-memory all-reduce, then NCCL), whose line the third one is. Thresholds,
# not the fastest of the lines: the one-shot line is cheaper right up to the switch. The hand-off line is fitted so
# that the others stand on their own kernels' sizes; the cost model prices the first two (NCCL's own terms above).
CUSTOM_ALL_REDUCE = SwitchedForm("custom_all_reduce", ("latency_s", "bus_share", "large_latency_s", "large_bus_share",
                                                       "two_shot_from_bytes", "handoff_latency_s", "handoff_bus_share",
                                                       "handoff_from_bytes"),
                                 (1e-5, 0.05, 3e-5, 0.8, 1.0, 3e-5, 0.8, 1.0), _switched_all_reduce,
                                 (1e-3, 10, 1e-3, 10, 1e15, 1e-3, 10, 1e15))


def _quantize(v, rows):
    floor, bandwidth_share = v
    # A streaming kernel: 3 bytes an element (2 read, 1 written) over the achieved bandwidth.
    return floor + 3.0 * rows["m"].to_numpy() * rows["k"].to_numpy() / (rows["hbm"].to_numpy() * bandwidth_share)


QUANTIZE = Form("quantize", ("floor_s", "bandwidth_share"), (2e-6, 0.8), _quantize, (1e-3, 1.0))


def _moe(v, rows):
    floor, bandwidth_share, rate_share = v
    tokens, hidden, inter, topk, experts, all_experts = (
        rows[c].to_numpy() for c in ("tokens", "hidden", "inter", "topk", "experts", "all_experts"))
    element = rows["dtype"].map(DTYPE_BYTES).to_numpy()
    peak = np.where(rows["dtype"].to_numpy() == "bf16", rows["peak_bf16"].to_numpy(), rows["peak_fp8"].to_numpy())
    # Balanced routing: the local experts a token's top-k lands on, expected over tokens drawn independently.
    local_assignments = tokens * topk * experts / all_experts
    touched = experts * (1 - (1 - 1 / experts) ** local_assignments)
    weights = touched * 3 * hidden * inter * element           # gate, up and down projections
    activations = local_assignments * (hidden * 2 + 3 * inter) * BF16
    memory = (weights + activations) / (rows["hbm"].to_numpy() * bandwidth_share)
    compute = 2 * local_assignments * 3 * hidden * inter / (peak * rate_share)
    return floor + np.maximum(memory, compute)


MOE = Form("moe", ("floor_s", "bandwidth_share", "rate_share"), (3e-5, 0.6, 0.5), _moe, (1e-2, 1.0, 1.0))


def _mla_decode(v, rows):
    floor, per_sequence, bandwidth_share, rate_share = v
    b, s, h = (rows[c].to_numpy() for c in ("batch", "tokens", "heads"))
    flops = 2 * h * (2 * MLA_LATENT + MLA_ROPE) * b * s
    compute = b * per_sequence + flops / (rows["peak_bf16"].to_numpy() * rate_share)
    memory = b * (s + 1) * (MLA_LATENT + MLA_ROPE) * BF16 / (rows["hbm"].to_numpy() * bandwidth_share)
    return floor + np.maximum(compute, memory)


MLA_DECODE = Form("mla_decode", ("floor_s", "per_sequence_s", "bandwidth_share", "rate_share"),
                  (1e-4, 1e-6, 0.5, 0.3), _mla_decode, (1e-2, 1e-3, 1.0, 1.0))


def _mla_prefill(v, rows):
    floor, efficiency, half = v
    b, s, h = (rows[c].to_numpy() for c in ("batch", "tokens", "heads"))
    flops = 2 * h * (MLA_NOPE + MLA_ROPE + MLA_V) * b * (s * (s + 1) / 2 + half * s)
    return floor + flops / (rows["peak_bf16"].to_numpy() * efficiency)


MLA_PREFILL = Form("mla_prefill", ("floor_s", "efficiency", "half_length_tokens"), (1e-4, 0.3, 256.0), _mla_prefill,
                   (1e-2, 1.0, 1e7))


def with_device(rows: pd.DataFrame, profile: HardwareProfile) -> pd.DataFrame:
    return rows.assign(**device_columns(profile))


def errors(form: Form, values: dict[str, float], rows: pd.DataFrame) -> np.ndarray:
    """Signed relative errors ``predicted / measured - 1`` of ``rows``."""
    return form(values, rows) / rows["measured_s"].to_numpy() - 1.0


def summary(signed: np.ndarray) -> dict[str, float]:
    """rows, MAPE, median signed error, bias (mean signed error)."""
    signed = np.asarray(signed, dtype=float)
    if not len(signed):
        return {"rows": 0, "mape": float("nan"), "median_error": float("nan"), "bias": float("nan")}
    return {"rows": int(len(signed)), "mape": float(np.mean(np.abs(signed))),
            "median_error": float(np.median(signed)), "bias": float(np.mean(signed))}


def held_out_split(rows: pd.DataFrame, key: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fitted, held out): every other distinct value of ``key`` (by size) held out, so no held-out row shares
    that coordinate with a fitted one (KV lengths, message sizes, output widths ...)."""
    values = np.sort(rows[key].unique())
    held = set(values[1::2])
    mask = rows[key].isin(held).to_numpy()
    return rows[~mask], rows[mask]
