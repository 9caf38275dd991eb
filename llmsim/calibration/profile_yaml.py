"""Writing a calibration as a hardware profile, and transferring its efficiencies.

The document has exactly the schema of ``hardware_profiles/*.yaml``: every figure is
``{value, source, confidence}``. What the calibration measured or fitted is
``measured``, with a source naming ``llmsim calibrate``, the device, the date and the
torch version; what it cannot measure (links, power, price) is ``assumption`` with
the reason. A top-level ``calibration`` mapping keeps the record: device, settings,
the roofline, every measured shape, the layout study and the fit.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from llmsim.config.files import write_file
from llmsim.config.reader import Node
from llmsim.catalog.hardware import HardwareProfile, profile_from_node

# USD per core-hour of an on-demand general-purpose cloud VM (AWS m7a.large: 2 vCPUs, about 0.116 USD/h).
CLOUD_USD_PER_CORE_HOUR = 0.058
# Socket TDP per core of a server CPU (AMD EPYC 9654: 360 W over 96 cores).
SERVER_CPU_WATTS_PER_CORE = 3.75
# What a transferred profile cites of the calibration it took its efficiencies from.
TRANSFER_RECORD_KEYS = ("device", "device_name", "date", "torch_version")
TRANSFERRED = (("compute", "compute_efficiency"), ("attention", "attention_efficiency"),
               ("memory_bandwidth", "memory_efficiency"), ("kv_read_penalty", "kv_read_penalty"))


def figure(value: str | float, source: str, confidence: str) -> dict:
    return {"value": value, "source": source, "confidence": confidence}


def flops_text(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.4g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.4g} GFLOP/s"


def bandwidth_text(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.4g} GB/s"


def duration_text(seconds: float) -> str:
    return f"{seconds * 1e6:.4g} us"


def profile_document(name: str, record: dict, fitted: dict, roofline: dict, gemm_size: int,
                     stream_bytes: int, threads: int) -> dict:
    """The profile of the calibrated device; ``record`` is the calibration mapping (device, date, ...)."""
    tag = (f"llmsim calibrate on {record['device_name']} ({record['device']}), {record['date']}, "
           f"torch {record['torch_version']}")
    gemm = f"median of {record['rounds']} interleaved {gemm_size}^3 linear layers (x W^T, as in the decode step)"
    peaks = {dtype: figure(flops_text(rate), f"measured: {tag}: {gemm} in {dtype}", "measured")
             for dtype, rate in roofline["gemm_flops_per_s"].items()}
    bandwidth = roofline["stream_read_bytes_per_s"]
    cpu = record["device"] == "cpu"
    fit_note = (f"fitted to {record['fit']['shapes']} decode steps (least squares on log(predicted/measured), "
                f"in-sample MAPE {record['fit']['mape']:.1%})")
    memory_source = ("psutil / sysconf physical memory" if cpu else "torch.cuda.get_device_properties total_memory")
    return {
        "name": name,
        "description": (f"{record['device_name']}, {record['platform']}: calibrated by llmsim calibrate on "
                        f"{' and '.join(record['dtypes'])} decode steps"),
        "machine": record["device_name"],
        "peak_flops": peaks,
        "memory_capacity": figure(f"{record['memory_capacity_bytes'] / 1e9:.4g} GB",
                                  f"measured: {tag}: {memory_source}", "measured"),
        "memory_bandwidth": figure(bandwidth_text(bandwidth),
                                   f"measured: {tag}: median streaming read (sum) of {stream_bytes / 2 ** 20:.0f} MiB",
                                   "measured"),
        "interconnect_bandwidth": _interconnect_bandwidth(cpu, bandwidth),
        "interconnect_latency": figure("0 us" if cpu else "10 us", _no_link_source(cpu), "assumption"),
        "tdp": _tdp(cpu, threads, record["power_limit_w"]),
        "price_per_hour_usd": _price(cpu, threads),
        "efficiency": {
            **_efficiencies(fitted, record, tag, fit_note),
            "interconnect": figure(1.0, _no_link_source(cpu), "assumption"),
            "kv_read_penalty": figure(round(record["kv_layouts"]["kv_read_penalty"], 4),
                                      f"measured: {tag}: paged (block {record['kv_layouts']['block_size']}) over "
                                      f"contiguous decode attention time, median of the layout study", "measured"),
            "attention_half_context": figure(round(fitted["attention_half_context"], 1),
                                             f"measured: {tag}: {fit_note}; tokens of context at which decode "
                                             "attention reaches half its efficiency", "measured"),
            "by_dtype": {dtype: {key: figure(round(fitted[f"{key}/{dtype}"], 4), f"measured: {tag}: {fit_note}",
                                             "measured") for key in ("compute", "attention", "memory_bandwidth")}
                         for dtype in record["dtypes"]},
        },
        "overhead": {
            "per_step": figure(duration_text(fitted["per_step_overhead_s"]), f"measured: {tag}: {fit_note}",
                               "measured"),
            "per_layer": figure(duration_text(fitted["per_layer_overhead_s"]), f"measured: {tag}: {fit_note}",
                                "measured"),
        },
        "calibration": record,
    }


def _efficiencies(fitted: dict, record: dict, tag: str, fit_note: str) -> dict:
    """The profile's default efficiencies: those fitted for its primary dtype (bf16 where calibrated)."""
    from llmsim.calibration.fit import primary_dtype
    dtype = primary_dtype(record["dtypes"])
    note = f"{fit_note}; the {dtype} figure (by_dtype has every calibrated dtype's)"
    return {key: figure(round(fitted[f"{key}/{dtype}"], 4), f"measured: {tag}: {note}", "measured")
            for key in ("compute", "attention", "memory_bandwidth")}


def _no_link_source(cpu: bool) -> str:
    if cpu:
        return "assumption: no interconnect on a single CPU (tensor parallelism over CPUs is not modelled)"
    return "assumption: llmsim calibrate measures one device; replace with the link's datasheet or an NCCL test"


def _interconnect_bandwidth(cpu: bool, memory_bandwidth: float) -> dict:
    if cpu:
        return figure(bandwidth_text(memory_bandwidth),
                      "assumption: no interconnect on a single CPU; set to the measured memory bandwidth", "assumption")
    return figure(bandwidth_text(memory_bandwidth), _no_link_source(cpu) + "; set to the measured memory bandwidth",
                  "assumption")


def _tdp(cpu: bool, threads: int, power_limit_w: float | None) -> dict:
    if power_limit_w:
        return figure(f"{power_limit_w:.4g} W", "measured: nvidia-smi power.limit at calibration", "measured")
    if cpu:
        return figure(f"{SERVER_CPU_WATTS_PER_CORE * threads:.4g} W",
                      f"assumption: {SERVER_CPU_WATTS_PER_CORE} W per core (AMD EPYC 9654: 360 W / 96 cores) "
                      f"x {threads} core(s) used; no power reading is available", "assumption")
    return figure("700 W", "assumption: the TDP of an H100/H200 SXM GPU; nvidia-smi reported no power limit",
                  "assumption")


def _price(cpu: bool, threads: int) -> dict:
    if cpu:
        return figure(round(CLOUD_USD_PER_CORE_HOUR * threads, 4),
                      f"assumption: {CLOUD_USD_PER_CORE_HOUR} USD per core-hour (AWS m7a.large on demand, 2 vCPUs "
                      f"for about 0.116 USD/h) x {threads} core(s); edit for your own contract", "assumption")
    return figure(2.5, "assumption: a typical on-demand cloud price per GPU-hour; edit for your own contract",
                  "assumption")


def check_document(document: dict, path: str) -> HardwareProfile:
    """Load ``document`` exactly as load_profile would a file: any schema slip is a ConfigError."""
    return profile_from_node(Node(copy.deepcopy(document), file=path), path=path)


class _Row(dict):
    """A mapping written on one line: one measured shape, one layout-study row."""


class _Dumper(yaml.SafeDumper):
    """Block style, as the shipped profiles are written, except for _Row mappings."""


_Dumper.add_representer(_Row, lambda dumper, row: dumper.represent_mapping("tag:yaml.org,2002:map", row,
                                                                           flow_style=True))


def _rows_on_one_line(value):
    """Every mapping that is an item of a list becomes a _Row."""
    if isinstance(value, dict):
        return {key: _rows_on_one_line(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_Row(item) if isinstance(item, dict) else _rows_on_one_line(item) for item in value]
    return value


def write_document(document: dict, path: str | Path) -> HardwareProfile:
    """Check, then write ``document`` as YAML."""
    profile = check_document(document, str(path))
    header = "# Written by llmsim calibrate (the record is under calibration:); regenerate rather than edit.\n"
    text = yaml.dump(_rows_on_one_line(document), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=120, allow_unicode=True)
    write_file(Path(path), lambda partial: partial.write_text(header + text))
    return profile


def transfer_document(calibrated: dict, target: dict, calibrated_name: str) -> dict:
    """``target`` with the efficiency factors of ``calibrated``; peaks, links, overheads stay the target's.

    The transferred figures become ``assumption``s: they were measured on another
    device and hold here only as far as the two run kernels alike; they are the
    calibrated device's defaults (its primary dtype's, see fit.primary_dtype). Overheads
    and the attention half-context are not transferred: they are the launch and dispatch costs of the calibrated
    device's runtime, not properties of its kernels.
    """
    record = calibrated["calibration"]
    document = copy.deepcopy(target)
    origin = (f"assumption: transferred from the calibration of {record['device_name']} ({record['device']}) "
              f"on {record['date']} by llmsim calibrate (torch {record['torch_version']}, profile {calibrated_name})")
    for key, _ in TRANSFERRED:
        measured = calibrated["efficiency"][key]["value"]
        document["efficiency"][key] = figure(measured, f"{origin}; measured there: {measured}", "assumption")
    document["name"] = f"{target['name']}-{calibrated_name}-transfer"
    document["description"] = f"{target.get('description', target['name'])}, with efficiencies from {calibrated_name}"
    document["calibration"] = {"transferred_from": calibrated_name, "device": record["device"],
                               "device_name": record["device_name"], "date": record["date"],
                               "torch_version": record["torch_version"],
                               "efficiencies": {key: calibrated["efficiency"][key]["value"] for key, _ in TRANSFERRED}}
    return document
