"""``llmsim calibrate --from-database``: one GPU's and one engine's kernel terms fitted to the operator database.

:func:`operator_rows` gathers each operator group's rows (with the table each came from),
:func:`fit_engine` fits the forms of :mod:`llmsim.calibration.database_fit` to them (each group's
held-out check first: every other token count, KV length or message size fitted, the rest predicted;
then the fit to every row that the profile keeps), and :func:`kernels_overlay` writes what the cost model
prices with as ``kernels:`` figures, each naming its table (file, engine version, rows). The groups the cost
model does not price yet (all-gather, reduce-scatter, all-to-all, MoE grouped GEMM, MLA) are fitted and
recorded under ``calibration.database`` with their own tables and errors.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from llmsim.calibration import database as db
from llmsim.calibration.database_fit import (ALL_REDUCE, COLLECTIVE, CUSTOM_ALL_REDUCE, DECODE_ATTENTION,
                                             DECODE_ATTENTION_OCCUPIED, DEVICE_COLUMNS, DISPATCH_MIN_TOKENS,
                                             EXPONENTIALS_COLUMN, GEMM, MLA_DECODE, MLA_PREFILL, MOE,
                                             PREFILL_ATTENTION, PREFILL_TILE_TOKENS, QUANTIZE,
                                             QUANTIZE_MIN_INPUT_BYTES, SMALL_MESSAGE_BYTES, SMS_COLUMN, Form,
                                             device_columns, dispatch_terms, errors, exponentials_per_clock,
                                             gemm_fp8_dispatch_form, held_out_split, prefill_rate, summary,
                                             with_device)
from llmsim.calibration.kernel_profile import calibrate_from_measurements
from llmsim.calibration.operators import read_measurements
from llmsim.calibration.profile_yaml import bandwidth_text, duration_text, figure, flops_text
from llmsim.catalog.hardware import HardwareProfile, lookup_hardware
from llmsim.catalog.cutlass_dispatch import DISPATCH, SM_COUNT_SOURCES, SM_COUNTS
from llmsim.config.reader import deep_merge, load_yaml
from llmsim.cost.kernels import all_reduce_time_s, gemm_time_s
from llmsim.errors import ConfigError

VIDUR_DATA = Path(__file__).parent / "data" / "vidur"

ATTENTION_HEAD_DIM = 128       # the head size of the Llama, Qwen and Mistral families the fits serve
# The GEMM shapes a serving step runs (inputs of 1,024 columns and more, outputs of 128 and more, up to 16k
# tokens): the database also times shapes no decoder layer has, which a fit over them would trade layers for.
LAYER_SHAPES = {"min_k": 1024, "min_n": 128, "max_m": 16384}
# Query heads per KV head that the FP8-cache decode fit reads: grouped-query shapes, the decoder layers of the
# catalog's GQA models on one GPU. An FP8 cache runs other kernels for MHA (one query head per KV head) and for
# MQA-like groups of 32 and more (TensorRT-LLM: 15% slower and 70% faster than one line through the GQA rows), which
# pooled with them would pull the KV read rate of every GQA model off by a third.
FP8_KV_QUERIES_PER_KV_HEAD = (2, 16)
GEMM_SAMPLE = 3                # every third GEMM row (by shape order) is fitted: the surface is smooth and dense
PREFILL_TILE_SOURCE = ("assumption: FlashAttention's and FlashInfer's prefill kernels compute whole tiles of 64 (or "
                       "128) queries by 64 (or 128) keys; 64 x 64 for every GPU, the size the operator database held "
                       "out best with (benchmarks/fidelity_forms.py)")
PREFILL_EFFICIENCY_NOTE = ("the lesser of the tensor cores' fitted share of the 16-bit peak and the softmax "
                           "exponentials' bound at head size 128 (SMs x exponentials per clock per SM x the fitted "
                           "clock, one exponential per query-key pair of 4 x 128 FLOPs: CUDA C++ Programming Guide, "
                           "arithmetic instruction throughput; NVIDIA technical blog \"Making Softmax More Efficient "
                           "with NVIDIA Blackwell Ultra\" for B300's doubled rate)")
QUERY_TILE_NOTE = ("a query tile's fixed cost per head in query-key pairs' time (TensorRT-LLM's context kernels run "
                   "one thread block per query tile, head and sequence: fmhaKernels.h, computeNumCtas)")
FIT_NOTE = ("scipy.optimize.least_squares on log(predicted/measured) (llmsim.calibration.database_fit); held out: "
            "every other token count / KV length / message size fitted, the rest predicted")


@dataclass(frozen=True)
class Group:
    """An operator group: its form, the column its held-out split alternates, and whether it fits per GPU count."""
    name: str
    form: Form
    split: str
    per_group_size: bool = False
    priced: bool = True           # the cost model prices with it (else recorded only)


GROUPS = {g.name: g for g in (
    Group("gemm_bf16", GEMM, "n"), Group("gemm_fp8", GEMM, "n"), Group("gemm_fp8_block", GEMM, "n"),
    Group("decode_attention", DECODE_ATTENTION, "kv_tokens"),
    Group("decode_attention_fp8_kv", DECODE_ATTENTION_OCCUPIED, "kv_tokens"),
    Group("prefill_attention", PREFILL_ATTENTION, "tokens"),
    Group("all_reduce", ALL_REDUCE, "bytes", True), Group("custom_all_reduce", CUSTOM_ALL_REDUCE, "bytes", True),
    Group("all_gather", COLLECTIVE, "bytes", True, False), Group("reduce_scatter", COLLECTIVE, "bytes", True, False),
    Group("all_to_all", COLLECTIVE, "bytes", True, False), Group("quantize", QUANTIZE, "k"),
    Group("moe", MOE, "tokens", priced=False),
    Group("mla_decode", MLA_DECODE, "tokens", priced=False), Group("mla_prefill", MLA_PREFILL, "tokens", priced=False),
    *(Group(f"gemm_fp8_dispatch_{architecture}", gemm_fp8_dispatch_form(architecture), "n")
      for architecture in DISPATCH))}
NCCL_OPERATIONS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                   "all_to_all": "alltoall"}


def operator_rows(database: db.Database, gpu: str, engine: db.EngineKernels, profile: HardwareProfile,
                  versions: dict[tuple[str, str], str] | None = None,
                  operators: tuple[str, ...] | None = None) -> dict[str, pd.DataFrame]:
    """Each group's rows for ``gpu`` as ``engine`` runs it (NCCL's newest version for the collectives), with
    the device's datasheet columns; ``versions`` pins (operator, framework) to a version, ``operators`` reads only
    those folders (gemm, attention, comm, ...). Groups the database lacks for this GPU and engine are left out."""
    versions = versions or {}
    framework = engine.value

    def table(operator, frame, name):
        if operators is not None and operator not in operators:
            return None
        return database.table(gpu, operator, frame, name, versions.get((operator, frame)))
    rows = {}
    gemm = table("gemm", framework, "gemm_perf")
    if gemm is not None:
        frame = db.gemm_rows(gemm)
        frame = frame[(frame["k"] >= LAYER_SHAPES["min_k"]) & (frame["n"] >= LAYER_SHAPES["min_n"])
                      & (frame["m"] <= LAYER_SHAPES["max_m"])]
        frame = frame.sort_values(["dtype", "m", "n", "k"]).iloc[::GEMM_SAMPLE]
        for dtype in ("bf16", "fp8", "fp8_block"):
            rows[f"gemm_{dtype}"] = frame[frame["dtype"] == dtype]
        # vLLM's FP8 GEMMs run its CUTLASS dispatch (catalog.cutlass_dispatch), on the GPUs whose SMs are known.
        architecture = db.ARCHITECTURES.get(gpu)
        if engine is db.EngineKernels.VLLM and architecture in DISPATCH and gpu in SM_COUNTS:
            fp8 = rows["gemm_fp8"]
            rows[f"gemm_fp8_dispatch_{architecture}"] = fp8[fp8["m"] >= DISPATCH_MIN_TOKENS].assign(
                **{SMS_COLUMN: SM_COUNTS[gpu]})
    for name, reader, group in (("generation_attention_perf", db.decode_attention_rows, "decode_attention"),
                                ("context_attention_perf", db.prefill_attention_rows, "prefill_attention")):
        found = table("attention", framework, name)
        if found is not None:
            frame = reader(found)
            rows[group] = frame[frame["head_dim"] == ATTENTION_HEAD_DIM]
            if group == "prefill_attention":
                rows[group] = rows[group].assign(**{EXPONENTIALS_COLUMN: exponentials_per_clock(gpu)})
            if group == "decode_attention":
                fp8 = db.decode_attention_rows(found, "fp8")
                grouped = (fp8["heads"] / fp8["kv_heads"]).between(*FP8_KV_QUERIES_PER_KV_HEAD)
                rows["decode_attention_fp8_kv"] = fp8[(fp8["head_dim"] == ATTENTION_HEAD_DIM) & grouped]
    nccl = table("comm", "nccl", "nccl_perf")
    if nccl is not None:
        for group, operation in NCCL_OPERATIONS.items():
            rows[group] = db.collective_rows(nccl, operation)
    custom = table("comm", framework, "custom_allreduce_perf")
    if custom is not None:
        rows["custom_all_reduce"] = db.custom_all_reduce_rows(custom)
    # TensorRT-LLM runs its FP8 quantization as a pass the GEMM rows do not time after an all-reduce that fell back
    # to NCCL (its fused add-norm's quantization then runs apart: kernel_terms.STREAM_FUSION); the other engines'
    # quantization is the GEMM rows' own.
    quantize = table("quantize", framework, "scale_matrix_perf") if engine is db.EngineKernels.TRTLLM else None
    if quantize is not None:
        frame = db.quantize_rows(quantize)
        rows["quantize"] = frame[frame["m"] * frame["k"] * 2 >= QUANTIZE_MIN_INPUT_BYTES]
    moe = table("moe", framework, "moe_perf")
    if moe is not None:
        rows["moe"] = db.moe_rows(moe)
    for name, group in (("mla_generation_module_perf", "mla_decode"), ("mla_context_module_perf", "mla_prefill")):
        found = table("mla", framework, name)
        if found is not None:
            rows[group] = db.mla_rows(found)
    return {group: with_device(frame.reset_index(drop=True), profile) for group, frame in rows.items() if len(frame)}


def fit_group(group: Group, rows: pd.DataFrame, fixed: dict[str, float] | None = None) -> dict:
    """Fitted parameters (per GPU count for collectives: {count: parameters})."""
    if group.per_group_size:
        return {int(size): group.form.fit(part) for size, part in rows.groupby("group")}
    return group.form.fit(rows, fixed)


def predict(group: Group, values: dict, rows: pd.DataFrame) -> np.ndarray:
    """Signed relative errors of ``rows`` under ``values`` (as fit_group returns them)."""
    if not group.per_group_size:
        return errors(group.form, values, rows)
    out = np.full(len(rows), np.nan)
    for size, part in rows.groupby("group"):
        if int(size) in values:
            out[rows.index.get_indexer(part.index)] = errors(group.form, values[int(size)], part)
    return out


def size_classes(group: str, rows: pd.DataFrame) -> list[tuple[str, np.ndarray]]:
    """How a group's errors are reported: collectives below and from 64 KiB apart, the rest whole."""
    if GROUPS[group].per_group_size:
        small = (rows["bytes"] < SMALL_MESSAGE_BYTES).to_numpy()
        return [("< 64 KiB", small), (">= 64 KiB", ~small)]
    return [("all", np.ones(len(rows), dtype=bool))]


@dataclass
class EngineFit:
    """One GPU's and engine's fits: parameters and tables per group, and the validation table."""
    gpu: str
    engine: db.EngineKernels
    values: dict[str, dict] = field(default_factory=dict)
    tables: dict[str, list[str]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    validation: list[dict] = field(default_factory=list)
    switch_over_bytes: dict[int, float] = field(default_factory=dict)

    def citation(self, group: str) -> str:
        return (f"measured: llmsim calibrate --from-database ({db.DATABASE_RELEASE}, NVIDIA, Apache-2.0): "
                f"{', '.join(self.tables[group])} ({self.rows[group]} rows fitted; errors in calibration.database)")


def fit_engine(database: db.Database, gpu: str, engine: db.EngineKernels, profile: HardwareProfile) -> EngineFit:
    """Every group's held-out check and final fit for ``gpu`` as ``engine`` runs it."""
    result = EngineFit(gpu, engine)
    for name, rows in operator_rows(database, gpu, engine, profile).items():
        group = GROUPS[name]
        # Prefill attention shares decode's launch floor in the cost model (one attention kernel per layer).
        fixed = ({"floor_s": result.values["decode_attention"]["floor_s"]}
                 if name == "prefill_attention" and "decode_attention" in result.values else None)
        fixed = fixed or _fixed(name)
        fitted, held = held_out_split(rows, group.split)
        held_errors = predict(group, fit_group(group, fitted, fixed), held)
        values = fit_group(group, rows, fixed)
        in_sample = predict(group, values, rows)
        for split, part, signed in (("held_out", held, held_errors), ("in_sample", rows, in_sample)):
            for size, mask in size_classes(name, part):
                result.validation.append({"gpu": gpu, "engine": engine.value, "group": name, "size": size,
                                          "split": split, **summary(signed[mask][~np.isnan(signed[mask])])})
        result.values[name], result.rows[name] = values, len(rows)
        result.tables[name] = sorted(set(rows["table"]))
    if "custom_all_reduce" in result.values and "all_reduce" in result.values:
        result.switch_over_bytes = switch_over(result.values["custom_all_reduce"], result.values["all_reduce"],
                                               profile)
    return result


def switch_over(custom: dict, nccl: dict, profile: HardwareProfile) -> dict[int, float]:
    """Per GPU count, the message size (bytes) up to which the engine's custom all-reduce is the faster of the two
    fitted lines: the engine uses it below that size and NCCL above, as vLLM and SGLang choose by size; never past
    the size from which the engine hands the call to another implementation (the fitted hand-off line, which the
    cost model prices by NCCL's terms)."""
    sizes = 2.0 ** np.arange(7, 31)
    out = {}
    for count in sorted(set(custom) & set(nccl)):
        rows = with_device(pd.DataFrame({"group": count, "bytes": sizes}), profile)
        faster = ((CUSTOM_ALL_REDUCE(custom[count], rows) <= ALL_REDUCE(nccl[count], rows))
                  & (sizes < custom[count]["handoff_from_bytes"]))
        out[count] = float(sizes[np.argmin(faster)] / 2) if not faster.all() else float(sizes[-1])
    return out


def prefill_efficiency(values: dict[str, float], gpu: str, profile: HardwareProfile) -> float:
    """The share of the 16-bit peak prefill attention runs at on ``gpu`` at head size :data:`ATTENTION_HEAD_DIM`
    (:func:`~llmsim.calibration.database_fit.prefill_rate`): the one efficiency the cost model prices it with."""
    rows = pd.DataFrame({"head_dim": [float(ATTENTION_HEAD_DIM)], EXPONENTIALS_COLUMN: exponentials_per_clock(gpu),
                         **{k: [v] for k, v in device_columns(profile).items()}})
    return float(prefill_rate(rows, values["efficiency"], values["softmax_clock_hz"])[0] / profile.peak_for("bf16"))


def kernels_overlay(fit: EngineFit, profile: HardwareProfile) -> dict:
    """The ``kernels:`` figures ``fit`` replaces (GEMMs by dtype, attention, NCCL and custom all-reduce, the
    engine's FP8 quantization kernel)."""
    link, hbm = profile.interconnect_bandwidth_bytes_per_s, profile.memory_bandwidth_bytes_per_s
    out: dict = {}
    if "gemm_bf16" in fit.values:
        out["gemm"] = _gemm_figures(fit.values["gemm_bf16"], profile.peak_for("bf16"), hbm, fit.citation("gemm_bf16"))
        rate = out["gemm"].pop("achieved_flops")      # fp16 runs the same tensor-core path at the same peak
        out["gemm"]["achieved_flops"] = {"bf16": rate, "fp16": rate}
        by_dtype = {dtype: _gemm_figures(fit.values[f"gemm_{dtype}"], profile.peak_for("fp8"), hbm,
                                         fit.citation(f"gemm_{dtype}"), quantize=True)
                    for dtype in ("fp8", "fp8_block") if f"gemm_{dtype}" in fit.values}
        dispatched = [group for group in fit.values if group.startswith("gemm_fp8_dispatch_")]
        if dispatched and "fp8" in by_dtype:
            by_dtype["fp8"]["dispatch"] = _dispatch_figures(fit, dispatched[0], profile)
        if by_dtype:
            out["gemm"]["by_dtype"] = by_dtype
    if "decode_attention" in fit.values:
        v, source = fit.values["decode_attention"], fit.citation("decode_attention")
        attention: dict[str, Any] = _decode_figures(v, hbm, source)
        if "decode_attention_fp8_kv" in fit.values:
            v, source = fit.values["decode_attention_fp8_kv"], fit.citation("decode_attention_fp8_kv")
            attention["by_kv_dtype"] = {"fp8": _decode_figures(v, hbm, source)}
        if "prefill_attention" in fit.values:
            p, prefill_source = fit.values["prefill_attention"], fit.citation("prefill_attention")
            attention["prefill_backend"] = fit.engine.value
            attention["prefill_backends"] = {fit.engine.value: {
                "efficiency": figure(_sig(prefill_efficiency(p, fit.gpu, profile)),
                                     f"{prefill_source}; {PREFILL_EFFICIENCY_NOTE}", "measured"),
                "half_length": figure(_sig(p["half_length_tokens"]), prefill_source, "measured"),
                "kv_half_length": figure(_sig(p["kv_half_length_tokens"]), prefill_source, "measured"),
                "tile_tokens": figure(PREFILL_TILE_TOKENS, PREFILL_TILE_SOURCE, "assumption"),
                "critical_path_blocks": figure(_sig(p["critical_path_blocks"]), prefill_source, "measured"),
                "critical_path_overlap": figure(_sig(p["critical_path_overlap"]), prefill_source, "measured"),
                "query_tile_pairs": figure(_sig(p["query_tile_pairs"]), f"{prefill_source}; {QUERY_TILE_NOTE}",
                                           "measured")}}
        out["attention"] = attention
    if "quantize" in fit.values:
        v, source = fit.values["quantize"], fit.citation("quantize")
        out["quantize"] = {"floor": figure(duration_text(v["floor_s"]), source, "measured"),
                           "bandwidth": figure(bandwidth_text(v["bandwidth_share"] * hbm), source, "measured")}
    if "all_reduce" in fit.values:
        out["all_reduce"] = {count: _reduce_figures(v, link, fit.citation("all_reduce"))
                             for count, v in fit.values["all_reduce"].items()}
    if "custom_all_reduce" in fit.values:
        source = fit.citation("custom_all_reduce")
        out["custom_all_reduce"] = {
            count: {**_reduce_figures(v, link, source),
                    "two_shot_from": figure(f"{v['two_shot_from_bytes'] / 1024:.6g} KiB",
                                            f"{source}; the message size from which the engine runs its two-shot "
                                            "kernel (the large-message line), fitted between the measured sizes",
                                            "measured"),
                    "switch_over": figure(f"{fit.switch_over_bytes[count] / 1024:.6g} KiB",
                                          f"{source}; the largest message at which the fitted custom all-reduce is "
                                          "faster than the fitted NCCL all-reduce of the same GPU count", "measured")}
            for count, v in fit.values["custom_all_reduce"].items() if count in fit.switch_over_bytes}
    return out


def _decode_figures(v: dict, hbm: float, source: str) -> dict:
    return {"floor": figure(duration_text(v["floor_s"]), source, "measured"),
            "decode_per_sequence": figure(duration_text(v["per_sequence_s"]), source, "measured"),
            "decode_per_kv_head": figure(duration_text(v["per_kv_head_s"]), source, "measured"),
            "decode_bandwidth": figure(bandwidth_text(v["bandwidth_share"] * hbm), source, "measured"),
            "decode_efficiency": figure(_sig(v["rate_share"]), source, "measured")}


def _gemm_figures(v: dict, peak: float, hbm: float, source: str, quantize: bool = False) -> dict:
    extra = ({"quantize_bandwidth": figure(bandwidth_text(v["quantize_share"] * hbm), source, "measured")}
             if quantize else {})
    return {**extra, "floor": figure(duration_text(v["floor_s"]), source, "measured"),
            "bandwidth": figure(bandwidth_text(v["bandwidth_share"] * hbm), source, "measured"),
            "achieved_flops": figure(flops_text(v["rate_share"] * peak), source, "measured"),
            "sharpness": figure(_sig(1.0 + v["sharpness_excess"]), source, "measured"),
            "sharpness_growth": figure(_sig(v["sharpness_growth"]), source, "measured"),
            "occupancy_half_tiles": figure(_sig(v["occupancy_half_tiles"]), source, "measured")}


def _dispatch_figures(fit: EngineFit, group: str, profile: HardwareProfile) -> dict:
    """vLLM's CUTLASS FP8 dispatch (``gemm.by_dtype.fp8.dispatch``): the GPU's SMs (sourced) and the fitted figures
    of :func:`~llmsim.calibration.database_fit.gemm_fp8_dispatch_form`."""
    architecture = group.removeprefix("gemm_fp8_dispatch_")
    dispatch = dispatch_terms(architecture, fit.values[group], SM_COUNTS[fit.gpu], profile.peak_for("fp8"),
                              profile.memory_bandwidth_bytes_per_s)
    source = fit.citation(group)
    sms_source, sms_confidence = SM_COUNT_SOURCES[fit.gpu]
    return {"architecture": architecture,
            "sms": figure(dispatch.sms, sms_source, sms_confidence),
            "floor": figure(duration_text(dispatch.floor_s), source, "measured"),
            "bandwidth": figure(bandwidth_text(dispatch.bandwidth_bytes_per_s), source, "measured"),
            "quantize_bandwidth_per_sm": figure(bandwidth_text(dispatch.quantize_bytes_per_s_per_sm), source,
                                                "measured"),
            "sharpness": figure(_sig(dispatch.sharpness), source, "measured"),
            "configurations": {name: {
                "achieved_flops": figure(flops_text(config.flops_per_s), source, "measured"),
                "tile_overhead": figure(duration_text(config.tile_overhead_s), source, "measured")}
                for name, config in dispatch.configurations.items()}}


def _reduce_figures(v: dict, link: float, source: str) -> dict:
    """An all-reduce's lines as profile figures: small and large messages, and NCCL's middle protocol where the fit
    has it (the custom all-reduce's two kernels have none)."""
    out = {"latency": figure(duration_text(v["latency_s"]), source, "measured"),
           "bus_bandwidth": figure(bandwidth_text(v["bus_share"] * link), source, "measured"),
           "large_latency": figure(duration_text(v["large_latency_s"]), source, "measured"),
           "large_bus_bandwidth": figure(bandwidth_text(v["large_bus_share"] * link), source, "measured")}
    if "medium_latency_s" in v:
        out["medium_latency"] = figure(duration_text(v["medium_latency_s"]), source, "measured")
        out["medium_bus_bandwidth"] = figure(bandwidth_text(v["medium_bus_share"] * link), source, "measured")
    return out


def record(fits: list[EngineFit]) -> dict:
    """The profile's ``calibration.database`` record: the tool, every fit's tables, fitted values of the groups
    the cost model does not price yet, and the validation table."""
    return {"tool": "llmsim calibrate --from-database", "date": datetime.date.today().isoformat(),
            "database": db.DATABASE_RELEASE, "fit": FIT_NOTE,
            "engines": {fit.engine.value: {
                "tables": {group: {"files": tables, "rows": fit.rows[group]} for group, tables in fit.tables.items()},
                "recorded_only": {group: _plain(fit.values[group]) for group in fit.values
                                  if not GROUPS[group].priced},
                "validation": [{key: (_sig(value) if isinstance(value, float) else value)
                                for key, value in row.items() if key not in ("gpu", "engine")}
                               for row in fit.validation]} for fit in fits}}


def _plain(values: dict) -> dict:
    return {key: (_plain(value) if isinstance(value, dict) else _sig(value)) for key, value in values.items()}


def _sig(value: float) -> float:
    return float(f"{value:.4g}")


def database_document(database: db.Database, gpu: str, engines: list[db.EngineKernels]) -> tuple[dict, pd.DataFrame]:
    """The shipped profile of ``gpu`` with the database fits laid over its ``kernels:`` (the default engine's
    into the section, the others' under ``kernels.engines``), the record under ``calibration.database``, and
    the validation table (every group, size class and split)."""
    profile = lookup_hardware(gpu)
    assert profile.path is not None         # every profile lookup_hardware gives was read from a file
    document = load_yaml(profile.path)
    if "kernels" not in document:
        raise ConfigError("has no kernels: section (streaming-kernel and step terms) for the database fit to lay "
                          "its figures over", file=str(profile.path), has_value=False)
    fits = [fit_engine(database, gpu, engine, profile) for engine in engines]
    fits = [fit for fit in fits if fit.values]
    for fit in fits:
        overlay = kernels_overlay(fit, profile)
        if fit.engine is db.EngineKernels.VLLM:
            document["kernels"] = deep_merge(document["kernels"], overlay, replace_keys=("achieved_flops",))
        else:
            document["kernels"].setdefault("engines", {})[fit.engine.value] = overlay
    calibration = document.setdefault("calibration", {})
    calibration["database"] = record(fits)
    return document, pd.DataFrame([row for fit in fits for row in fit.validation])


VIDUR_DEVICES = {"A100-80GB": "a100", "H100-SXM": "h100"}


def compare_vidur(database: db.Database, vidur_folder: Path = VIDUR_DATA) -> pd.DataFrame:
    """Where the Vidur-fitted terms (A100, H100: ``llmsim calibrate --from-measurements`` on Vidur's profiler
    timings) and the database fit disagree: each source's prediction over the other's on the database's vLLM
    rows, by operator group (the groups Vidur timed: 16-bit GEMMs and NCCL all-reduce; decode attention, which
    the Vidur profiles priced by an assumption, through the profile's own terms)."""
    measurements = read_measurements(vidur_folder)
    rows_out = []
    for gpu, device in VIDUR_DEVICES.items():
        if gpu not in database.gpus():
            continue
        profile = lookup_hardware(gpu)
        vidur, _ = calibrate_from_measurements(measurements, device, profile)
        fit = fit_engine(database, gpu, db.EngineKernels.VLLM, profile)
        rows = operator_rows(database, gpu, db.EngineKernels.VLLM, profile)
        gemm = rows["gemm_bf16"]
        m, n, k = (gemm[c].to_numpy() for c in ("m", "n", "k"))
        vidur_gemm = gemm_time_s(m, n, k, 2.0, 2.0, vidur, "bf16")
        ratio = {"gemm_bf16": vidur_gemm / GEMM(fit.values["gemm_bf16"], gemm)}
        parts = list(rows["all_reduce"].groupby("group"))
        vidur_reduce = np.concatenate([all_reduce_time_s(part["bytes"].to_numpy(), int(size),
                                                         vidur.all_reduce_for(int(size))) for size, part in parts])
        fitted = np.concatenate([ALL_REDUCE(fit.values["all_reduce"][int(size)], part) for size, part in parts])
        small = np.concatenate([(part["bytes"] < SMALL_MESSAGE_BYTES).to_numpy() for _, part in parts])
        ratio["all_reduce < 64 KiB"] = (vidur_reduce / fitted)[small]
        ratio["all_reduce >= 64 KiB"] = (vidur_reduce / fitted)[~small]
        decode = rows["decode_attention"]
        hbm = profile.memory_bandwidth_bytes_per_s
        assumed = {"floor_s": vidur.attention_floor_s, "per_sequence_s": vidur.decode_attention_per_sequence_s,
                   "per_kv_head_s": 0.0,
                   "bandwidth_share": (vidur.decode_attention_bandwidth_bytes_per_s or hbm * profile.memory_efficiency)
                   / hbm,
                   "rate_share": profile.attention_efficiency}
        ratio["decode_attention"] = DECODE_ATTENTION(assumed, decode) / DECODE_ATTENTION(fit.values["decode_attention"],
                                                                                         decode)
        for group, values in ratio.items():
            rows_out.append({"gpu": gpu, "group": group, "rows": len(values),
                             "median_vidur_over_database": _sig(float(np.median(values))),
                             "p10": _sig(float(np.quantile(values, 0.1))),
                             "p90": _sig(float(np.quantile(values, 0.9)))})
    return pd.DataFrame(rows_out)


# The operator groups the held-out checks report: (name, group of GROUPS, size class or None for all rows).
ACCEPTANCE_GROUPS = (("GEMM bf16", "gemm_bf16", None), ("GEMM fp8", "gemm_fp8", None),
                     ("decode attention", "decode_attention", None), ("prefill attention", "prefill_attention", None),
                     ("all-reduce < 64 KiB", "all_reduce", "< 64 KiB"),
                     ("all-reduce >= 64 KiB", "all_reduce", ">= 64 KiB"),
                     ("custom all-reduce < 64 KiB", "custom_all_reduce", "< 64 KiB"),
                     ("custom all-reduce >= 64 KiB", "custom_all_reduce", ">= 64 KiB"),
                     ("all-to-all", "all_to_all", None))
ACCEPTANCE_MAPE, ACCEPTANCE_MEDIAN = 0.10, 0.05


def priced_group(group: str, gpu: str, rows: dict[str, pd.DataFrame]) -> str:
    """The group whose form the cost model prices ``group`` by on ``gpu``, given the GPU's ``rows``: vLLM's FP8 GEMMs by
    its CUTLASS dispatch where the rows hold it (:func:`operator_rows`), every other group by its own."""
    dispatch = f"gemm_fp8_dispatch_{db.ARCHITECTURES.get(gpu)}"
    return dispatch if group == "gemm_fp8" and dispatch in rows else group


def _class_mask(group: str, size: str | None, rows: pd.DataFrame) -> np.ndarray:
    if size is None:
        return np.ones(len(rows), dtype=bool)
    return dict(size_classes(group, rows))[size]


def same_point_errors(group: Group, values: dict, held: pd.DataFrame, donors: list[pd.DataFrame]) -> np.ndarray:
    """Signed errors of ``held`` predicted by the donors' own measurements of the same points (shape, KV length,
    message size), each carried to the target by the fitted form's ratio of its predictions on the two devices
    (the median over donors; NaN where no donor measured the point). Where this reference misses too, the
    devices (or versions) disagree at identical points by more than any form of their datasheet figures says:
    the miss is in the kernels measured, not in the form's shape."""
    device = [c for c in (*DEVICE_COLUMNS, SMS_COLUMN, EXPONENTIALS_COLUMN) if c in held.columns]
    keys = [c for c in held.columns if c not in (*device, "measured_s", "table")]
    target = {c: held[c].iloc[0] for c in device}
    carried = []
    for donor in donors:
        donor = donor.reset_index(drop=True)
        ratio = (predict(group, values, donor.assign(**target)) + 1.0) / (predict(group, values, donor) + 1.0)
        log_carried = np.log(donor["measured_s"].to_numpy() * ratio)
        carried.append(donor[keys].assign(log_s=log_carried).groupby(keys)["log_s"].mean())
    reference = np.exp(pd.concat(carried, axis=1).median(axis=1)).rename("carried_s")
    joined = held[keys].join(reference, on=keys)
    return joined["carried_s"].to_numpy() / held["measured_s"].to_numpy() - 1.0


def _with_reference(row: dict, reference: np.ndarray) -> dict:
    reference = reference[~np.isnan(reference)]
    found = summary(reference)
    return {**row, "reference_rows": found["rows"], "reference_mape": found["mape"],
            "reference_median": found["median_error"]}


def leave_one_gpu_out(database: db.Database, targets: tuple[str, ...], same_architecture: bool,
                      engine: db.EngineKernels = db.EngineKernels.VLLM) -> pd.DataFrame:
    """Each target GPU's rows predicted by the forms fitted to the other GPUs the database and llmsim both have
    (their fitted shares of each GPU's datasheet figures pooled), per acceptance group: every other GPU, or
    (``same_architecture``) those of the target's architecture alone (H100 from H200, B200 from B300 and GB200),
    and for the collectives of its NVLink fabric too (B200's from B300's: GB200's NVL72 rack is another fabric)."""
    rows = {gpu: operator_rows(database, gpu, engine, lookup_hardware(gpu)) for gpu in database.gpus()}
    out = []
    for target in targets:
        donors = [gpu for gpu in rows if gpu != target
                  and (not same_architecture or db.ARCHITECTURES[gpu] == db.ARCHITECTURES[target])]
        split = "leave one GPU out (" + ("same architecture; collectives: same fabric" if same_architecture
                                        else "every other GPU") + ")"
        for label, acceptance_group, size in ACCEPTANCE_GROUPS:
            group = priced_group(acceptance_group, target, rows.get(target, {}))
            if group not in rows.get(target, {}) or not any(group in rows[gpu] for gpu in donors):
                continue
            givers = [gpu for gpu in donors if group in rows[gpu]]
            if same_architecture and GROUPS[group].per_group_size:     # a fabric of one GPU: the architecture's
                givers = [gpu for gpu in givers if db.FABRICS[gpu] == db.FABRICS[target]] or givers
            pooled = pd.concat([rows[gpu][group] for gpu in givers], ignore_index=True)
            held = rows[target][group]
            values = fit_group(GROUPS[group], pooled, _fixed(group))
            signed = predict(GROUPS[group], values, held)
            mask = _class_mask(group, size, held) & ~np.isnan(signed)
            reference = same_point_errors(GROUPS[group], values, held, [rows[gpu][group] for gpu in givers])
            out.append(_with_reference({"split": split, "gpu": target, "group": label, **summary(signed[mask])},
                                       reference[_class_mask(group, size, held)]))
    return pd.DataFrame(out)


# Where each acceptance group's versions are: (operator folder, table); the NCCL table's versions are NCCL's own.
VERSION_SOURCES = {"gemm_bf16": ("gemm", "gemm_perf"), "gemm_fp8": ("gemm", "gemm_perf"),
                   "decode_attention": ("attention", "generation_attention_perf"),
                   "prefill_attention": ("attention", "context_attention_perf"),
                   "all_reduce": ("comm", "nccl_perf"), "all_to_all": ("comm", "nccl_perf"),
                   "custom_all_reduce": ("comm", "custom_allreduce_perf")}
Cell = tuple[str, str]          # (GPU, engine version)
# The call each engine's collector timed for a GEMM table's rows, by (gemm_dtype, kernel_source): NVIDIA's collectors
# (ai-dynamo/aiconfigurator collector/vllm, sglang and trtllm collect_gemm.py). The 16-bit rows of vLLM, SGLang
# 0.5.14 and TensorRT-LLM are torch.nn.functional.linear on bf16 tensors (TensorRT-LLM's unquantized Linear calls it:
# NVIDIA/TensorRT-LLM tensorrt_llm/_torch/modules/linear.py, UnquantizedLinearMethod.apply); SGLang's older collector
# (label "sglang", for 0.5.5.post2 to 0.5.8: aiconfigurator@2ec2c274 collector/sglang/collect_gemm.py) timed the
# same call on float16 tensors, which its table files as bfloat16: cuBLAS picks other kernels for them. Its FP8 rows
# and SGLang 0.5.14's call sgl-kernel's fp8_scaled_mm alike. Labels not here name no call another table shares.
GEMM_CALLS = {("bfloat16", "torch.nn.functional.linear"): "torch.nn.functional.linear, bf16",
              ("bfloat16", "sglang_torch_linear"): "torch.nn.functional.linear, bf16",
              ("bfloat16", "torch_flow"): "torch.nn.functional.linear, bf16",
              ("bfloat16", "sglang"): "torch.nn.functional.linear, fp16",
              ("fp8", "sglang"): "sgl_kernel.fp8_scaled_mm",
              ("fp8", "sglang_sgl_kernel_fp8_scaled_mm"): "sgl_kernel.fp8_scaled_mm"}
GEMM_CALL_DTYPES = {"gemm_bf16": "bfloat16", "gemm_fp8": "fp8"}


def kernel_call(database: db.Database, group: str, rows: pd.DataFrame) -> str | None:
    """The one call (:data:`GEMM_CALLS`) that timed a cell's ``rows`` of ``group``, read from their tables'
    ``kernel_source``; None for the other groups and where the labels name no call, or more than one."""
    dtype = GEMM_CALL_DTYPES.get(group)
    if dtype is None:
        return None
    calls = {GEMM_CALLS.get((dtype, label)) for path in set(rows["table"])
             for label in database.kernel_sources(path, "gemm_dtype", dtype)}
    return calls.pop() if len(calls) == 1 else None


def version_cells(database: db.Database, gpus: list[str], group: str) -> dict[str, dict[Cell, pd.DataFrame]]:
    """Per framework (every engine's, or NCCL for its collectives), each (GPU, version) cell's rows of ``group``."""
    operator, table = VERSION_SOURCES[group]
    out: dict[str, dict[Cell, pd.DataFrame]] = {}
    for framework in (("nccl",) if table == "nccl_perf" else db.ENGINE_NAMES):
        engine = db.EngineKernels.VLLM if framework == "nccl" else db.EngineKernels(framework)
        cells = {}
        for gpu in gpus:
            profile = lookup_hardware(gpu)
            for version in database.versions(gpu, operator, framework, table):
                found = operator_rows(database, gpu, engine, profile, {(operator, framework): version},
                                      (operator,)).get(group)
                if found is not None:
                    cells[(gpu, version)] = found
        out[framework] = cells
    return out


def leave_one_version_out(database: db.Database, targets: tuple[str, ...]) -> pd.DataFrame:
    """Each engine version's rows (every engine, and NCCL's versions for the collectives) predicted by the forms
    fitted to the same GPU's other versions of that engine, per acceptance group, pooled over the versions left
    out; a group with one version of each engine has nothing to leave out."""
    out = []
    for target in targets:
        for label, group, size in ACCEPTANCE_GROUPS:
            signed_all, reference_all = [], []
            for cells in version_cells(database, [target], group).values():
                per_version = {version: rows for (_, version), rows in cells.items()}
                for left, held in per_version.items():
                    others = [r for v, r in per_version.items() if v != left]
                    if not others:
                        continue
                    values = fit_group(GROUPS[group], pd.concat(others, ignore_index=True), _fixed(group))
                    signed = predict(GROUPS[group], values, held)
                    mask = _class_mask(group, size, held)
                    signed_all.append(signed[mask & ~np.isnan(signed)])
                    reference_all.append(same_point_errors(GROUPS[group], values, held, others)[mask])
            if signed_all:
                out.append(_with_reference({"split": "leave one engine version out", "gpu": target, "group": label,
                                            **summary(np.concatenate(signed_all))}, np.concatenate(reference_all)))
    return pd.DataFrame(out)


@dataclass(frozen=True)
class CellPrediction:
    """One held-out (GPU, version) cell's signed errors, the same-point reference's, the donor GPUs whose version
    factor it used (none: it fell back), and how many of the GPU's cells that ran its kernel call it fell back to
    (none: to the GPU's other versions alone)."""
    signed: np.ndarray
    reference: np.ndarray
    donors: tuple[str, ...]
    same_call_cells: int = 0


def _point_keys(rows: pd.DataFrame) -> list[str]:
    """The columns that name a measured point (shape, lengths, heads, message size, GPU count)."""
    return [c for c in rows.columns if c not in (*DEVICE_COLUMNS, SMS_COLUMN, "measured_s", "table")]


def repeat_floor(rows: pd.DataFrame) -> np.ndarray:
    """Per row, the least absolute relative error any one predicted time for its point can have against the
    table's repeated measurements of that point (zero where the point was timed once): a cell whose repeats disagree
    with themselves bounds every form's MAPE from below by this mean. The least sum of |p / x - 1| over a point's
    times x lies at one of them (the sum is convex and piecewise linear in p)."""
    keys = _point_keys(rows)
    out = np.zeros(len(rows))
    for index in rows.groupby(keys, sort=False).indices.values():
        times = rows["measured_s"].to_numpy()[index]
        if len(times) > 1:
            out[index] = np.min(np.abs(times[:, None] / times[None, :] - 1.0).sum(axis=1)) / len(times)
    return out


def _mean_log(frames: list[pd.DataFrame], keys: list[str]) -> pd.Series:
    """Per point, the mean log measured time over ``frames`` (versions); a point missing from one is dropped."""
    logs = [f.assign(log_s=np.log(f["measured_s"])).groupby(keys)["log_s"].mean() for f in frames]
    return pd.concat(logs, axis=1).dropna().mean(axis=1)


def predict_cell(group: str, target: str, version: str, training: dict[Cell, pd.DataFrame], held: pd.DataFrame,
                 peers: list[str], same_call: list[pd.DataFrame] | None = None) -> CellPrediction:
    """The held-out cell (``target``, ``version``) of one framework's ``group`` from ``training`` (every other cell;
    the held-out one is not in it), as a two-way model: the target's form fitted to its versions that a donor also
    measured, times the version's factor on that donor at each held-out point (the donor's form fitted to
    ``version`` over its form fitted to the same versions as the target's, both on the donor's datasheet figures: a
    version that moved a kernel switch moves it in the factor), the geometric mean over ``peers`` that measured
    ``version`` and one of the target's versions. Where none did, the target's form fitted to ``same_call``: its
    other cells, of any engine and version, whose rows ran the held-out cell's kernel call (:func:`kernel_call`; the
    call, not the version, sets a kernel's time); without them, to all its other versions alone. The reference is
    the same two-way model on measurements of the same point, no form: the target's other versions' time times the
    donor's ratio of ``version`` to those versions (median over donors); in a fallback, the same point's time in the
    cells fitted."""
    assert (target, version) not in training, "the held-out cell is in its own training set"
    assert not any(rows is held for rows in same_call or ()), "the held-out cell is among its own kernel's cells"
    own = {v: rows for (gpu, v), rows in training.items() if gpu == target}
    keys = _point_keys(held)
    predictions, references, donors = [], [], []
    for donor in peers:
        if donor == target or (donor, version) not in training:
            continue
        common = sorted(v for v in own if (donor, v) in training)
        if not common:
            continue
        values = fit_group(GROUPS[group], pd.concat([own[v] for v in common], ignore_index=True), _fixed(group))
        donor_values = fit_group(GROUPS[group], pd.concat([training[(donor, v)] for v in common], ignore_index=True),
                                 _fixed(group))
        measured = training[(donor, version)]
        version_values = fit_group(GROUPS[group], measured, _fixed(group))
        on_donor = held.assign(**{c: measured[c].iloc[0] for c in DEVICE_COLUMNS})
        factor = (np.log(predict(GROUPS[group], version_values, on_donor) + 1.0)
                  - np.log(predict(GROUPS[group], donor_values, on_donor) + 1.0))
        predictions.append(np.log(predict(GROUPS[group], values, held) + 1.0) + factor)
        carried = (_mean_log([own[v] for v in common], keys) + _mean_log([training[(donor, version)]], keys)
                   - _mean_log([training[(donor, v)] for v in common], keys))
        references.append(held[keys].join(carried.rename("log_s"), on=keys)["log_s"].to_numpy())
        donors.append(donor)
    if not donors:          # the version was measured on no other GPU beside one of the target's versions
        others = same_call or list(own.values())
        values = fit_group(GROUPS[group], pd.concat(others, ignore_index=True), _fixed(group))
        return CellPrediction(predict(GROUPS[group], values, held),
                              same_point_errors(GROUPS[group], values, held, others), (), len(same_call or ()))
    signed = np.exp(np.mean(predictions, axis=0)) - 1.0
    carried_log_s = pd.DataFrame(np.vstack(references)).median(axis=0).to_numpy()     # NaN where no donor has it
    reference = np.exp(carried_log_s - np.log(held["measured_s"].to_numpy())) - 1.0
    return CellPrediction(signed, reference, tuple(donors))


def _peers(target: str, gpus: list[str], group: str) -> list[str]:
    """The GPUs whose versions teach the target's: its architecture's, and for collectives its fabric's (the
    architecture's where the fabric has no other GPU), as :func:`leave_one_gpu_out` pools them."""
    same = [gpu for gpu in gpus if gpu != target and db.ARCHITECTURES[gpu] == db.ARCHITECTURES[target]]
    if GROUPS[group].per_group_size:
        same = [gpu for gpu in same if db.FABRICS[gpu] == db.FABRICS[target]] or same
    return same


def leave_one_cell_out(database: db.Database, targets: tuple[str, ...]) -> pd.DataFrame:
    """Each (GPU, engine version) cell of the targets held out and predicted from everything else
    (:func:`predict_cell`: the GPU's other versions and the held-out version on the other GPUs of its architecture,
    or fabric for collectives), per acceptance group pooled over the cells; ``fallback_cells`` counts the cells
    whose version no other GPU measured, ``same_call_cells`` those of them predicted by the GPU's cells of other
    engines or versions that ran the same kernel call (the rest by the GPU's other versions alone, as
    :func:`leave_one_version_out`); ``repeat_floor`` is the MAPE no prediction can beat where the held-out tables
    timed a point more than once (:func:`repeat_floor`)."""
    out = []
    gpus = database.gpus()
    for target in targets:
        architecture = [gpu for gpu in gpus if db.ARCHITECTURES[gpu] == db.ARCHITECTURES[target]]
        for label, group, size in ACCEPTANCE_GROUPS:
            signed_all, reference_all, floor_all, cells_held, fallback, same_call_cells = [], [], [], 0, 0, 0
            peers = _peers(target, architecture, group)
            frameworks = version_cells(database, [target, *peers], group)
            # The target's cells of every engine by the kernel call that timed them (None: no call known).
            calls = {(framework, cell): kernel_call(database, group, rows) for framework, cells in frameworks.items()
                     for cell, rows in cells.items() if cell[0] == target}
            for framework, cells in frameworks.items():
                for cell, held in cells.items():
                    if cell[0] != target or sum(gpu == target for gpu, _ in cells) < 2:
                        continue
                    training = {key: rows for key, rows in cells.items() if key != cell}
                    call = calls[(framework, cell)]
                    same_call = [frameworks[other][key] for other, key in calls if call is not None
                                 and calls[(other, key)] == call and (other, key) != (framework, cell)]
                    found = predict_cell(group, target, cell[1], training, held, peers, same_call)
                    mask = _class_mask(group, size, held)
                    signed_all.append(found.signed[mask & ~np.isnan(found.signed)])
                    reference_all.append(found.reference[mask])
                    floor_all.append(repeat_floor(held)[mask & ~np.isnan(found.signed)])
                    cells_held += 1
                    fallback += not found.donors
                    same_call_cells += found.same_call_cells > 0
            if signed_all:
                out.append(_with_reference({"split": "leave one (GPU, engine version) cell out", "gpu": target,
                                            "group": label, **summary(np.concatenate(signed_all)),
                                            "cells": cells_held, "fallback_cells": fallback,
                                            "same_call_cells": same_call_cells,
                                            "repeat_floor": float(np.mean(np.concatenate(floor_all)))},
                                           np.concatenate(reference_all)))
    return pd.DataFrame(out)


def _fixed(group: str) -> dict | None:
    """Parameters a group holds: 16-bit GEMMs quantize nothing (the term is zero; held at 1 so it stays put)."""
    return {"quantize_share": 1.0} if group == "gemm_bf16" else None
