"""A profile's ``kernels:`` section from measured operator timings, and its transfer to other devices.

:func:`calibrate_from_measurements` fits the terms the measurements cover (GEMMs, streaming
kernels, all-reduces: ``measured``, naming the files and rows) and takes the rest from
:data:`PUBLISHED` (attention backends, FP8 GEMM rate, per-sequence step overhead: each figure
with its source, ``assumption`` or ``unverified`` where it is one). :func:`derive_kernel_terms`
carries a calibrated device's terms to another by the stated rule (:data:`DERIVATION_RULE`).
"""
from __future__ import annotations

import datetime
from dataclasses import replace
from typing import Any

import pandas as pd

from llmsim.calibration.kernel_fit import (fit_attention, fit_fp8_rate, fit_kernel_terms, held_out_all_reduce_errors,
                                           held_out_attention_errors, held_out_fp8_errors, held_out_layer_errors)
from llmsim.calibration.operators import (DEVICE_PROFILES, Measurements, all_reduce_errors, attention_errors,
                                          error_table, fp8_errors, layer_errors)
from llmsim.calibration.profile_yaml import bandwidth_text, duration_text, figure, flops_text
from llmsim.catalog.hardware import HardwareProfile, lookup_hardware
from llmsim.errors import ConfigError
from llmsim.catalog.kernel_terms import AllReduce, KernelTerms, PrefillAttention, StreamKernel

FA2_PAPER = "FlashAttention-2 (Dao, arXiv 2307.08691): forward pass reaches 50-73% of A100 peak"
FA3_PAPER = ("FlashAttention-3 (Shah et al., arXiv 2407.08608): FlashAttention-2 reaches 35% of H100 peak; "
             "FlashAttention-3 reaches up to 740 TFLOP/s FP16 (75%) and close to 1.2 PFLOP/s in FP8")
HALF_LENGTH = ("assumption: prefill attention runs at half its long-sequence efficiency when a query sees 256 "
               "tokens (the published curves rise from 512 to 16k tokens); not measured here")
DECODE_PER_SEQUENCE = ("assumption: about 1 us per sequence and layer, the fixed cost of paged decode attention at "
                       "short contexts (block-table walk, split and merge of the online softmax) estimated "
                       "from measured kernel timings; not measured here")
PER_SEQUENCE = ("assumption: 5 us per sampling sequence per iteration for sampling, detokenising and the scheduler's "
                "per-sequence bookkeeping in a Python engine (vLLM V0/V1 class); not measured here")
FP8_RATE = ("unverified: FP8 GEMMs as serving engines call them (torch._scaled_mm class kernels) reach about 1.5x "
            "the 16-bit rate on Hopper: a public cuBLASLt cross-check measured 8192^3 FP8 GEMMs at about 1,600 "
            "TFLOP/s with cuBLASLt and 1,170 TFLOP/s through torch._scaled_mm per H100, against about 780 TFLOP/s "
            "for a 16-bit 8192^3 GEMM on the same die (docs/reference/sources/hardware.md); so fp8 = 1.5 x the fitted "
            "16-bit rate")

# What the measurements do not cover, per device tag: attention backends, FP8 and the step's growth.
PUBLISHED: dict[str, dict[str, Any]] = {
    "a100": {"prefill_backend": "flash-attention-2",
             "prefill_backends": {"flash-attention-2": (0.6, 256.0, f"assumption: {FA2_PAPER}; 0.6 as paged "
                                                                    "serving kernels run below the paper's best")},
             "fp8": None},
    "h100": {"prefill_backend": "flash-attention-2",
             "prefill_backends": {"flash-attention-2": (0.35, 256.0, f"assumption: {FA3_PAPER}"),
                                  "flash-attention-3": (0.75, 256.0, f"assumption: {FA3_PAPER}")},
             "fp8": 1.5},
}
DERIVATION_RULE = ("derived from {source} by the rule: bandwidths (GEMM, streaming kernels) x the ratio of the "
                   "datasheet memory bandwidths, GEMM rates x the ratio of the datasheet peaks of the same dtype, "
                   "all-reduce bus bandwidths x the ratio of the datasheet interconnect bandwidths; floors, "
                   "latencies, sharpness, attention backends and step terms unchanged (the same software stack "
                   "assumed)")


def published_base(device: str, fitted_16bit_flops: float = 1.0) -> KernelTerms:
    """Placeholder terms holding the published figures of ``device`` (the fit replaces the rest)."""
    published = PUBLISHED[device]
    rates = {"fp16": fitted_16bit_flops}
    if published["fp8"]:
        rates["fp8"] = published["fp8"] * fitted_16bit_flops
    return KernelTerms(
        gemm_floor_s=0.0, gemm_bandwidth_bytes_per_s=1.0, gemm_flops_per_s=rates, gemm_sharpness=1.0,
        elementwise={}, all_reduce={2: AllReduce(0.0, 1.0, 0.0, 1.0)}, decode_attention_per_sequence_s=1e-6,
        prefill_backend=published["prefill_backend"],
        prefill_backends={name: PrefillAttention(e, h) for name, (e, h, _) in published["prefill_backends"].items()},
        step_overhead_per_sequence_s=5e-6)


def calibrate_from_measurements(measurements: Measurements, device: str,
                                base_profile: HardwareProfile | None = None) -> tuple[KernelTerms, dict]:
    """Kernel terms of ``device`` fitted to all its rows, and the record: files, rows, fit, held-out errors.

    Linear-operator rows are required. Without all-reduce rows (one GPU measured) the all-reduce terms are
    ``base_profile``'s, and so is everything else the rows do not cover on a device without published
    figures (:data:`PUBLISHED`); attention rows, where present, fit the attention terms."""
    rows = measurements.for_device(device)
    if rows.linear.empty:
        raise ConfigError(f"has no linear-operator rows for device {device}: a calibration needs them",
                          file=", ".join(measurements.files), has_value=False)
    if base_profile is None:
        base_profile = lookup_hardware(DEVICE_PROFILES[device])
    if device in PUBLISHED:
        base = published_base(device)
        if rows.all_reduce.empty:
            if base_profile.kernels is None:
                raise ConfigError(f"has no in-node all-reduce rows for device {device}, and the base profile "
                                  f"{base_profile.name} has no all-reduce terms to keep",
                                  file=", ".join(measurements.files), has_value=False)
            base = replace(base, all_reduce=base_profile.kernels.all_reduce)
    elif base_profile.kernels is not None:
        base = base_profile.kernels
    else:
        raise ConfigError(f"device {device} has no published attention and FP8 figures, and the base profile "
                          f"{base_profile.name} has no kernels: section to take them from",
                          file=", ".join(measurements.files), has_value=False)
    terms = fit_kernel_terms(rows, base)
    held_attention = held_fp8 = None
    if len(rows.fp8):
        terms = replace(terms, gemm_flops_per_s={**terms.gemm_flops_per_s, "fp8": fit_fp8_rate(rows.fp8, terms)})
        held_fp8 = held_out_fp8_errors(rows.fp8, terms) if rows.fp8["model"].nunique() > 1 else None
    if len(rows.attention):
        profile = replace(base_profile, kernels=terms)
        terms = fit_attention(rows.attention, profile)
        held_attention = held_out_attention_errors(rows.attention, profile)
    held_layers = held_out_layer_errors(rows, base) if rows.linear["model"].nunique() > 1 else None
    held_reduce = held_out_all_reduce_errors(rows, base) if len(rows.all_reduce) else None
    record = {
        "tool": "llmsim calibrate --from-measurements", "date": datetime.date.today().isoformat(),
        "device": device, "files": sorted(set().union(*(table.get("file", pd.Series(dtype=str))
                                                         for table in (rows.linear, rows.all_reduce, rows.attention,
                                                                       rows.fp8)))),
        "rows": {"linear": int(len(rows.linear)), "all_reduce_in_node": int(len(rows.all_reduce)),
                 "models": sorted(set(rows.linear["model"])),
                 "tp": sorted(int(t) for t in set(rows.linear["tp"])),
                 "num_tokens": [int(rows.linear["num_tokens"].min()), int(rows.linear["num_tokens"].max())]
                 if len(rows.linear) else [], "attention": int(len(rows.attention))},
        "fitted": {"all_reduce": bool(len(rows.all_reduce)), "attention": bool(len(rows.attention)),
                   "fp8": bool(len(rows.fp8))},
        "fit": "scipy.optimize.least_squares on log(predicted/measured) (soft-L1 for GEMMs); GEMM terms jointly "
               "over every GEMM, streaming kernels per kind, all-reduce per group size",
        "in_sample": _tables(layer_errors(rows.linear, terms) if len(rows.linear) else None,
                             all_reduce_errors(rows.all_reduce, terms) if len(rows.all_reduce) else None,
                             attention_errors(rows.attention, replace(base_profile, kernels=terms))
                             if len(rows.attention) else None, fp8_errors(rows.fp8, terms) if len(rows.fp8) else None),
        "held_out": {"split": "each (model, TP size) predicted by terms fitted to the other models at the other TP "
                              "sizes; all-reduce: every other message size of each group fitted, the rest predicted; "
                              "attention: each model predicted by terms fitted to the others",
                     **_tables(held_layers, held_reduce, held_attention, held_fp8)},
    }
    return terms, record


def _tables(layers: pd.DataFrame | None, reduce: pd.DataFrame | None, attention: pd.DataFrame | None = None,
            fp8: pd.DataFrame | None = None) -> dict:
    """Compact error tables for the record: per-layer by regime and TP, all-reduce by size class, attention
    by phase and TP."""
    tables = {}
    if layers is not None:
        per_layer = error_table(layers[layers["group"] == "layer"], ["regime", "tp"])
        tables["per_layer"] = [{"regime": r.regime, "tp": int(r.tp), "rows": int(r.rows), "mape": _sig(r.mape),
                                "median_error": _sig(r.median_error), "bias": _sig(r.bias)}
                               for r in per_layer.itertuples()]
    if reduce is not None:
        table = error_table(reduce, ["size_class"])
        tables["all_reduce"] = [{"size_class": r.size_class, "rows": int(r.rows), "mape": _sig(r.mape),
                                 "median_error": _sig(r.median_error)} for r in table.itertuples()]
    if attention is not None:
        table = error_table(attention, ["phase", "tp"])
        tables["attention"] = [{"phase": r.phase, "tp": int(r.tp), "rows": int(r.rows), "mape": _sig(r.mape),
                                "median_error": _sig(r.median_error), "bias": _sig(r.bias)} for r in table.itertuples()]
    if fp8 is not None:
        table = error_table(fp8, ["regime", "tp"])
        tables["fp8_gemm"] = [{"regime": r.regime, "tp": int(r.tp), "rows": int(r.rows), "mape": _sig(r.mape),
                               "median_error": _sig(r.median_error)} for r in table.itertuples()]
    return tables


def _sig(value: float) -> float:
    return float(f"{value:.3g}")


def kernels_section(terms: KernelTerms, device: str, measured_source: str, confidence: str = "measured",
                    fitted_terms: dict | None = None, base_section: dict | None = None) -> dict:
    """The ``kernels:`` YAML section of ``terms``: fitted figures cite ``measured_source``, the others PUBLISHED,
    or, for the groups ``fitted_terms`` marks unfitted (``all_reduce``, ``attention``), ``base_section``'s own."""
    fitted_terms = fitted_terms or {}
    published = PUBLISHED.get(device)
    fitted = lambda value: figure(value, measured_source, confidence)   # noqa: E731 (one line per figure below)
    rates = {}
    for dtype, rate in terms.gemm_flops_per_s.items():
        if dtype == "fp8" and fitted_terms.get("fp8"):
            rates[dtype] = fitted(flops_text(rate))
        elif dtype == "fp8" and published and published["fp8"]:
            rates[dtype] = figure(flops_text(rate), FP8_RATE, "unverified")
        else:
            rates[dtype] = fitted(flops_text(rate))
    backends = {}
    base_backends = (base_section or {}).get("attention", {}).get("prefill_backends", {})
    for name, backend in terms.prefill_backends.items():
        if not published and name in base_backends:     # a backend these rows did not time keeps its base figures
            backends[name] = base_backends[name]
            continue
        source = published["prefill_backends"][name][2] if published and name in published["prefill_backends"] \
            else measured_source
        backends[name] = {"efficiency": figure(_sig(backend.efficiency), source, "assumption"),
                          "half_length": figure(_sig(backend.half_length_tokens), HALF_LENGTH, "assumption")}
    attention = {"decode_per_sequence": figure(duration_text(terms.decode_attention_per_sequence_s),
                                               DECODE_PER_SEQUENCE, "assumption"),
                 "prefill_backend": terms.prefill_backend, "prefill_backends": backends}
    if fitted_terms.get("attention"):
        backends[terms.prefill_backend] = {
            "efficiency": fitted(_sig(terms.prefill_attention.efficiency)),
            "half_length": fitted(_sig(terms.prefill_attention.half_length_tokens))}
        attention.update(floor=fitted(duration_text(terms.attention_floor_s)),
                         decode_per_sequence=fitted(duration_text(terms.decode_attention_per_sequence_s)),
                         decode_bandwidth=fitted(bandwidth_text(terms.decode_attention_bandwidth_bytes_per_s)))
    elif base_section and "attention" in base_section:
        attention = base_section["attention"]
    section: dict[str, Any] = {
        "gemm": {"floor": fitted(duration_text(terms.gemm_floor_s)),
                 "bandwidth": fitted(bandwidth_text(terms.gemm_bandwidth_bytes_per_s)),
                 "achieved_flops": rates, "sharpness": fitted(_sig(terms.gemm_sharpness)),
                 "sharpness_growth": fitted(_sig(terms.gemm_sharpness_growth)),
                 "occupancy_half_tiles": fitted(_sig(terms.gemm_occupancy_half_tiles))},
        "elementwise": {kind: {"floor": fitted(duration_text(kernel.floor_s)),
                               "bandwidth": fitted(bandwidth_text(kernel.bandwidth_bytes_per_s)),
                               "row_bandwidth": fitted(bandwidth_text(kernel.row_bandwidth_bytes_per_s))}
                        for kind, kernel in terms.elementwise.items()},
        "all_reduce": {group: {"latency": fitted(duration_text(reduce.latency_s)),
                               "bus_bandwidth": fitted(bandwidth_text(reduce.bus_bandwidth_bytes_per_s)),
                               "large_latency": fitted(duration_text(reduce.large_latency_s)),
                               "large_bus_bandwidth": fitted(bandwidth_text(reduce.large_bus_bandwidth_bytes_per_s))}
                       for group, reduce in sorted(terms.all_reduce.items())},
        "attention": attention,
        "step": {"per_sequence": figure(duration_text(terms.step_overhead_per_sequence_s), PER_SEQUENCE,
                                        "assumption")},
    }
    if base_section:
        if not fitted_terms.get("all_reduce", True) and "all_reduce" in base_section:
            section["all_reduce"] = base_section["all_reduce"]
        for dtype, rate in base_section.get("gemm", {}).get("achieved_flops", {}).items():
            if dtype not in ("fp16", "bf16") and not (dtype == "fp8" and fitted_terms.get("fp8")):
                # other dtypes scale with the fitted 16-bit rate; they keep their source
                section["gemm"]["achieved_flops"][dtype] = figure(flops_text(terms.gemm_flops_per_s[dtype]),
                                                                  rate["source"], rate.get("confidence", "assumption"))
        if "step" in base_section:
            section["step"] = base_section["step"]
    return section


def derive_kernel_terms(terms: KernelTerms, source: HardwareProfile, target: HardwareProfile) -> KernelTerms:
    """``terms`` of ``source`` carried to ``target`` by :data:`DERIVATION_RULE`."""
    memory = target.memory_bandwidth_bytes_per_s / source.memory_bandwidth_bytes_per_s
    link = target.interconnect_bandwidth_bytes_per_s / source.interconnect_bandwidth_bytes_per_s
    rates = {dtype: rate * target.peak_for(dtype) / source.peak_for(dtype)
             for dtype, rate in terms.gemm_flops_per_s.items()}
    return replace(terms, gemm_bandwidth_bytes_per_s=terms.gemm_bandwidth_bytes_per_s * memory,
                   gemm_flops_per_s=rates,
                   elementwise={kind: StreamKernel(k.floor_s, k.bandwidth_bytes_per_s * memory,
                                                   k.row_bandwidth_bytes_per_s * memory)
                                for kind, k in terms.elementwise.items()},
                   all_reduce={group: AllReduce(r.latency_s, r.bus_bandwidth_bytes_per_s * link, r.large_latency_s,
                                                r.large_bus_bandwidth_bytes_per_s * link)
                               for group, r in terms.all_reduce.items()})


def measured_source(record: dict) -> str:
    """The source line of every fitted figure: the tool, the date, the files (rows and errors: the record)."""
    vidur = any("vidur" in name for name in record["files"])
    origin = ("Vidur profiler, MIT" if vidur
              else "timed by llmsim calibrate --operators; metadata in the *_operators.json beside them")
    return (f"measured: llmsim calibrate --from-measurements ({record['date']}) on {', '.join(record['files'])} "
            f"({origin}), device {record['device']}; rows used and held-out errors under calibration:")
