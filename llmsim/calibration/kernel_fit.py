"""Fitting a GPU's kernel terms to measured operator timings, and checking them on a held-out split.

Each term is fitted by ``scipy.optimize.least_squares`` on ``log(predicted / measured)`` (a 10%
miss weighs the same on a 5 us kernel as on a 5 ms one), with positive parameters fitted as logs:

- GEMMs: floor, bandwidth, achieved FLOP/s, sharpness and its growth with the output tiles, and the
  occupancy's half tiles (:func:`llmsim.cost.kernels.gemm_time_s`), jointly over every GEMM of every
  model, TP size and token count;
- streaming kernels: floor and bandwidth per kind;
- all-reduce: latency and bus bandwidth per group size;
- attention (where attention rows exist): the launch floor, decode's cost per sequence and KV read
  rate on the decode rows, then prefill's efficiency and half length on the prefill rows;
- FP8 GEMMs (where FP8 rows exist): the achieved FP8 rate alone, the other GEMM terms the 16-bit fit's.

The held-out check (:func:`held_out_layer_errors`) leaves out a model and a TP size together: the
rows of model m at TP size t are predicted by terms fitted to the other models at the other TP sizes,
so no held-out row comes from a model or a TP size its fit saw. All-reduces hold out every other
message size of each group; attention holds out each model in turn.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from llmsim.catalog.hardware import HardwareProfile
from llmsim.catalog.kernel_terms import ELEMENTWISE_KINDS, AllReduce, KernelTerms, PrefillAttention, StreamKernel
from llmsim.calibration.operators import (FP16_BYTES, Measurements, all_reduce_errors, attention_errors,
                                          elementwise_rows, fp8_errors, gemm_rows, layer_errors)
from llmsim.cost.kernels import all_reduce_time_s, gemm_time_s, stream_time_s

def fit_gemm(rows: pd.DataFrame) -> dict[str, float]:
    """The GEMM terms of :class:`KernelTerms` (floor, bandwidth, fp16 rate, sharpness, its growth with the
    output tiles, the occupancy's half tiles) fitted to GEMM rows (see operators.gemm_rows)."""
    tokens, n, k, measured = (rows[c].to_numpy() for c in ("tokens", "n", "k", "measured_s"))

    def unpack(q):
        v = np.exp(q)
        return dict(gemm_floor_s=v[0], gemm_bandwidth_bytes_per_s=v[1], gemm_flops_per_s={"fp16": v[2]},
                    gemm_sharpness=1.0 + v[3], gemm_sharpness_growth=v[4], gemm_occupancy_half_tiles=v[5])

    def residuals(q):
        terms = replace(_GEMM_ONLY, **unpack(q))
        return np.log(gemm_time_s(tokens, n, k, FP16_BYTES, FP16_BYTES, terms) / measured)

    # Started at a 5 us floor, 1 TB/s, 200 TFLOP/s, p = 1.1 at 128 tiles growing linearly, half rate at 40 tiles.
    start = np.log([5e-6, 1e12, 2e14, 0.1, 1.0, 40.0])
    fitted = unpack(least_squares(residuals, start, loss="soft_l1", f_scale=0.05).x)
    return {key: (float(value) if not isinstance(value, dict) else value["fp16"]) for key, value in fitted.items()}


# The GEMM formula reads only the gemm_* fields: the others are placeholders while fitting.
_GEMM_ONLY = KernelTerms(gemm_floor_s=0.0, gemm_bandwidth_bytes_per_s=1.0, gemm_flops_per_s={"fp16": 1.0},
                         gemm_sharpness=1.0, elementwise={}, all_reduce={}, decode_attention_per_sequence_s=0.0,
                         prefill_backend="none")


def fit_stream(rows: pd.DataFrame) -> StreamKernel:
    """Floor, bandwidth and one block's bandwidth of streaming-kernel rows (see operators.elementwise_rows)."""
    tokens, per_token, measured = (rows[c].to_numpy() for c in ("tokens", "bytes_per_token", "measured_s"))

    def residuals(q):
        return np.log(stream_time_s(tokens, per_token, StreamKernel(*np.exp(q))) / measured)
    # A term the rows do not need (a fused kernel without a row-serial part) drifts towards an infinite rate;
    # capped at 1 EB/s it adds nothing measurable and stays a number a profile can hold.
    fitted = np.exp(least_squares(residuals, np.log([2e-6, 1e12, 1e10])).x)
    return StreamKernel(*(float(v) for v in np.minimum(fitted, [1.0, 1e18, 1e18])))


def fit_all_reduce(size_bytes: np.ndarray, measured_s: np.ndarray, group: int) -> AllReduce:
    """Both protocols' latency and bus bandwidth, started apart (small: 20 us, 50 GB/s; large: 60 us, 300 GB/s)."""
    def residuals(q):
        return np.log(all_reduce_time_s(size_bytes, group, AllReduce(*np.exp(q))) / measured_s)
    # Latencies within 1 us - 1 ms, bandwidths within 1 GB/s - 10 TB/s: a protocol the data never picks
    # stays a plausible line instead of running off to zero bandwidth.
    low, high = np.log([1e-6, 1e9, 1e-6, 1e9]), np.log([1e-3, 1e13, 1e-3, 1e13])
    q = least_squares(residuals, np.log([2e-5, 5e10, 6e-5, 3e11]), bounds=(low, high)).x
    return AllReduce(*(float(v) for v in np.exp(q)))


def fit_all_reduces(reduce: pd.DataFrame) -> dict[int, AllReduce]:
    """Latency and bus bandwidth of each group size of all-reduce rows."""
    return {int(group): fit_all_reduce(part["size_bytes"].to_numpy(), part["time_s"].to_numpy(), int(group))
            for group, part in reduce.groupby("gpus")}


def fit_kernel_terms(measurements: Measurements, base: KernelTerms) -> KernelTerms:
    """Kernel terms fitted to ``measurements`` (one device); what they do not cover (attention, the step's
    per-sequence overhead, other dtypes' GEMM rates scaled by the fitted 16-bit rate) comes from ``base``."""
    gemm: dict[str, Any] = fit_gemm(gemm_rows(measurements.linear))
    flops = gemm.pop("gemm_flops_per_s")
    rows = elementwise_rows(measurements.linear)
    elementwise = {kind: fit_stream(rows[rows["kind"] == kind]) for kind in ELEMENTWISE_KINDS}
    all_reduce = fit_all_reduces(measurements.all_reduce) or base.all_reduce
    sixteen_bit = base.gemm_rate("fp16")
    rates = {dtype: flops * rate / sixteen_bit for dtype, rate in base.gemm_flops_per_s.items()}
    rates.update(fp16=flops, bf16=flops)
    return replace(base, **gemm, gemm_flops_per_s=rates, elementwise=elementwise, all_reduce=all_reduce)


def fit_attention(attention: pd.DataFrame, hardware: HardwareProfile) -> KernelTerms:
    """``hardware``'s kernel terms with the attention terms fitted to measured attention rows, in two stages:
    the decode rows fit the launch floor, decode's cost per sequence and its KV read rate; the prefill rows,
    with that floor, fit the efficiency and half length of the profile's prefill backend. Either phase may be
    missing (its terms stay ``hardware``'s), and the two may come from different kernels: an engine often runs
    a decode kernel and a prefill kernel of different libraries (the rows' ``attention_backend`` says which).
    :meth:`llmsim.cost.roofline.CostModel.attention_time_s` prices each row."""
    if hardware.kernels is None:
        raise ValueError(f"{hardware.name} has no kernel terms to refine with attention rows")
    kernels: KernelTerms = hardware.kernels
    decode, prefill = attention[~attention["is_prefill"]], attention[attention["is_prefill"]]
    if len(decode):
        def decode_terms(logs) -> KernelTerms:
            floor, per_sequence, bandwidth = np.exp(logs)
            return replace(kernels, attention_floor_s=floor, decode_attention_per_sequence_s=per_sequence,
                           decode_attention_bandwidth_bytes_per_s=bandwidth)
        start = np.log([max(kernels.attention_floor_s, 1e-6), max(kernels.decode_attention_per_sequence_s, 1e-7),
                        kernels.decode_attention_bandwidth_bytes_per_s or hardware.memory_bandwidth_bytes_per_s * 0.5])
        kernels = decode_terms(_fit_rows(decode, hardware, decode_terms, start,
                                         (np.log([1e-8, 1e-10, 1e9]), np.log([1e-3, 1e-4, 1e14]))))
    if len(prefill):
        name, backend = kernels.prefill_backend, kernels.prefill_attention

        decode_fitted = len(decode) > 0

        def prefill_terms(logs, floor_fitted=decode_fitted) -> KernelTerms:
            efficiency, half = np.exp(logs[:2])
            fitted = replace(kernels, prefill_backends={**kernels.prefill_backends,
                                                        name: PrefillAttention(min(efficiency, 1.0), half)})
            return fitted if floor_fitted else replace(fitted, attention_floor_s=float(np.exp(logs[2])))
        initial = [backend.efficiency, max(backend.half_length_tokens, 1.0)]
        lower, upper = [1e-3, 1.0], [1.0, 1e6]
        if not len(decode):
            initial, lower, upper = initial + [max(kernels.attention_floor_s, 1e-6)], lower + [1e-8], upper + [1e-3]
        kernels = prefill_terms(_fit_rows(prefill, hardware, prefill_terms, np.log(initial),
                                          (np.log(lower), np.log(upper))))
    return kernels


def _fit_rows(rows: pd.DataFrame, hardware: HardwareProfile, terms, start, bounds) -> np.ndarray:
    """The log-parameters of ``terms(logs)`` that best price attention ``rows`` (soft-L1 on log ratios)."""
    def residuals(logs):
        return np.log1p(attention_errors(rows, replace(hardware, kernels=terms(logs)))["error"].to_numpy())
    return least_squares(residuals, np.clip(start, *bounds), bounds=bounds, loss="soft_l1", f_scale=0.1).x


def fit_fp8_rate(fp8: pd.DataFrame, kernels: KernelTerms) -> float:
    """The achieved FP8 GEMM rate fitted to FP8 GEMM rows, every other GEMM term held at ``kernels``' (the
    floor, bandwidth and tile terms are the 16-bit fit's: the same GEMM machinery, half the weight bytes)."""
    def residuals(q):
        rated = replace(kernels, gemm_flops_per_s={**kernels.gemm_flops_per_s, "fp8": float(np.exp(q[0]))})
        return np.log1p(fp8_errors(fp8, rated)["error"].to_numpy())
    start = np.log([kernels.gemm_rate("fp8")])
    return float(np.exp(least_squares(residuals, start, loss="soft_l1", f_scale=0.05).x[0]))


def held_out_fp8_errors(fp8: pd.DataFrame, kernels: KernelTerms) -> pd.DataFrame:
    """FP8 GEMM errors of every model, each predicted by the rate fitted to the other models' rows."""
    frames = []
    for model in sorted(set(fp8["model"])):
        test = fp8["model"] == model
        rate = fit_fp8_rate(fp8[~test], kernels)
        frames.append(fp8_errors(fp8[test], replace(kernels, gemm_flops_per_s={**kernels.gemm_flops_per_s,
                                                                                 "fp8": rate})))
    return pd.concat(frames, ignore_index=True)


def held_out_attention_errors(attention: pd.DataFrame, hardware: HardwareProfile) -> pd.DataFrame:
    """Attention errors of every model, each predicted by terms fitted to the other models' rows."""
    frames = []
    for model in sorted(set(attention["model"])):
        test = attention["model"] == model
        fitted = fit_attention(attention[~test], hardware)
        frames.append(attention_errors(attention[test], replace(hardware, kernels=fitted)))
    return pd.concat(frames, ignore_index=True)


HOLD_OUT_SPLITS = ("model and tp", "model", "tp")


def held_out_layer_errors(measurements: Measurements, base: KernelTerms, split: str = "model and tp") -> pd.DataFrame:
    """Per-layer errors of every held-out cell (one device). ``split``: "model and tp" predicts each (model, TP
    size) cell by terms fitted without that model at any TP size and without that TP size on any model (the
    strictest); "model" predicts each model by the other models at every TP size; "tp" each TP size by the
    other TP sizes of every model."""
    if split not in HOLD_OUT_SPLITS:
        raise ValueError(f"split must be one of {HOLD_OUT_SPLITS}, not {split!r}")
    linear = measurements.linear
    cells = [(model, tp) for model in sorted(set(linear["model"])) for tp in sorted(set(linear["tp"]))]
    if split != "model and tp":
        cells = [(value, None) if split == "model" else (None, value) for value in sorted(set(linear[split]))]
    frames = []
    for model, tp in cells:
        held_model, held_tp = linear["model"] == model, linear["tp"] == tp     # all False for None
        train = ~held_model & ~held_tp
        test = (held_model | (model is None)) & (held_tp | (tp is None))
        if not train.any() or not test.any():
            continue
        fitted = fit_kernel_terms(Measurements(linear[train], measurements.all_reduce.iloc[:0], []), base)
        frames.append(layer_errors(linear[test], fitted))
    return pd.concat(frames, ignore_index=True)


def held_out_all_reduce_errors(measurements: Measurements, base: KernelTerms) -> pd.DataFrame:
    """All-reduce errors on every other message size of each group, fitted on the rest."""
    reduce = measurements.all_reduce.sort_values(["gpus", "size_bytes"]).reset_index(drop=True)
    size_rank = reduce.groupby("gpus")["size_bytes"].rank(method="dense").astype(int)
    train, test = reduce[size_rank % 2 == 1], reduce[size_rank % 2 == 0]
    return all_reduce_errors(test, replace(base, all_reduce=fit_all_reduces(train)))
