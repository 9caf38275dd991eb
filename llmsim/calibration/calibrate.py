"""Calibration and validation: the cost model against a real torch decode step.

``calibrate`` times a small Llama-style decode step in torch on the local device
over a grid of batch sizes, context lengths, widths, depths and dtypes, together
with the device's roofline (achieved GEMM FLOP/s, streaming bandwidth, dispatch
time) and a KV-cache layout and paging study; fits the cost model's efficiencies
and overheads to the steps; and writes a hardware profile. ``validate`` times a
held-out grid that shares no batch, context, width or depth with the fit, and
compares the profile's predictions, and those of the bare roofline of the same
peaks, with the measurements.

torch is imported only when one of these runs (``pip install -e ".[calibrate]"``);
the simulator never needs it. The commands and their printed reports are in
:mod:`llmsim.cli.calibrate`.
"""
from __future__ import annotations

import datetime
import importlib.util

import numpy as np

from llmsim.config.progress import QUIET, Progress
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import HardwareProfile

# One torch thread by default on CPU: on a shared machine, an OpenMP team that spans
# cores stalls at every barrier while another process holds one of them (measured here:
# 2 threads next to a test run spread a decode step's samples 45x, 1 thread 1.5x).
DEFAULT_CPU_THREADS = 1
# validate re-measures every ANCHOR_STRIDE-th fitted step, to tell the machine's drift from the model's error.
ANCHOR_STRIDE = 4


# -- calibrate --------------------------------------------------------------------------------

def calibrate(device_kind: str, name: str, quick: bool = False, threads: int = DEFAULT_CPU_THREADS,
              dtypes: tuple[str, ...] | None = None, seed: int = 0, design=None, progress: Progress = QUIET) -> dict:
    """Measure, fit and return the profile document (see profile_yaml.profile_document).

    ``design`` overrides the device's quick or full design (a custom grid); ``progress`` counts the
    timed calls.
    """
    require_torch()
    from llmsim.calibration import bench, fit, measure
    from llmsim.calibration.design import DEVICE_DTYPES, design_for
    from llmsim.calibration.profile_yaml import profile_document

    design = design or design_for(device_kind, quick)
    dtypes = dtypes or DEVICE_DTYPES[device_kind]
    shapes, held_out = design.fit.shapes(dtypes), design.holdout.shapes(dtypes)
    with bench.open_device(device_kind, threads) as device:
        session = measure.measure(design, device, dtypes, shapes + held_out, layouts=True, seed=seed,
                                  progress=progress)
    roofline = _roofline_profile(name, device, session.roofline)
    measured_s = np.array([session.steps[shape][0] for shape in shapes])
    dispatch_s = session.roofline["dispatch_s"]
    result = fit.fit_parameters(shapes, measured_s, roofline, session.kv_read_penalty,
                                initial_overheads_s=(dispatch_s, dispatch_s))
    record = _record(design, device, dtypes, session, shapes, held_out, result)
    return profile_document(name, record, result.values, session.roofline, design.gemm_size,
                            design.stream_bytes, threads)


def _roofline_profile(name: str, device, roofline: dict) -> HardwareProfile:
    """The bare roofline of the measured peaks (efficiencies 1, no overheads): the fit's base.

    TDP and price do not enter a step's time; the written profile takes them from profile_yaml."""
    return HardwareProfile(
        name=name, description=device.name, peak_flops_per_s=dict(roofline["gemm_flops_per_s"]),
        memory_capacity_bytes=device.memory_capacity_bytes,
        memory_bandwidth_bytes_per_s=roofline["stream_read_bytes_per_s"],
        interconnect_bandwidth_bytes_per_s=roofline["stream_read_bytes_per_s"], interconnect_latency_s=0.0,
        tdp_w=1.0, price_per_hour_usd=0.0, compute_efficiency=1.0, attention_efficiency=1.0,
        memory_efficiency=1.0, interconnect_efficiency=1.0, per_step_overhead_s=0.0, per_layer_overhead_s=0.0)


def _record(design, device, dtypes, session, shapes, held_out, result) -> dict:
    """The ``calibration`` mapping: how, where and when, what was measured, what was fitted.

    ``held_out`` shapes were measured in the same session but not fitted: their error
    is the model's out-of-sample error free of any drift of the machine between sessions.
    """
    from llmsim.calibration import bench

    fit_errors = _errors(shapes, session, result.hardware)
    held_out_errors = _errors(held_out, session, result.hardware)
    return {
        "tool": "llmsim calibrate",
        "date": datetime.date.today().isoformat(),
        "device": device.kind, "device_name": device.name, "platform": device.platform,
        "torch_version": device.torch_version, "threads": device.threads,
        "memory_capacity_bytes": device.memory_capacity_bytes, "power_limit_w": device.power_limit_w,
        "design": design.name, "dtypes": list(dtypes), "rounds": design.rounds, "warmup": design.warmup,
        "protocol": "every job warmed up, then timed once per round in a fresh random order, cold last-level "
                    "cache, device synchronised; figures are medians over rounds",
        "kv_layout": f"paged, block {bench.STEP_BLOCK_SIZE} tokens, pool [kv_heads, blocks, block, head_dim], "
                     "gathered into a preallocated contiguous workspace",
        "roofline": {"gemm_size": design.gemm_size, "stream_bytes": design.stream_bytes,
                     "gemm_flops_per_s": {k: _sig(v) for k, v in session.roofline["gemm_flops_per_s"].items()},
                     "stream_read_bytes_per_s": _sig(session.roofline["stream_read_bytes_per_s"]),
                     "copy_bytes_per_s": _sig(session.roofline["copy_bytes_per_s"]),
                     "dispatch_s": _sig(session.roofline["dispatch_s"])},
        "kv_layouts": {"block_size": bench.STEP_BLOCK_SIZE, "kv_read_penalty": _sig(session.kv_read_penalty),
                       "rows": session.layouts},
        "fit": {"shapes": len(shapes), "method": "scipy.optimize.least_squares on log(predicted/measured)",
                "starts": result.starts, "kv_read_penalty_held_fixed": _sig(session.kv_read_penalty),
                "parameters": {k: _sig(v) for k, v in result.values.items()},
                "mape": _sig(result.mape), "worst_error": _sig(result.worst_error),
                "mape_by_dtype": _mape_by_dtype(shapes, fit_errors), "at_ceiling": list(result.at_ceiling)},
        "held_out_same_session": {
            "shapes": len(held_out), "mape": _sig(float(np.mean(np.abs(held_out_errors)))),
            "worst_error": _sig(float(np.max(np.abs(held_out_errors)))),
            "mape_by_dtype": _mape_by_dtype(held_out, held_out_errors),
            "measurements": _measurement_rows(held_out, session, held_out_errors)},
        "noise": {"median_relative_iqr": _sig(session.median_relative_iqr)},
        "measurements": _measurement_rows(shapes, session, fit_errors),
    }


def _errors(shapes, session, hardware) -> np.ndarray:
    from llmsim.calibration import fit
    measured_s = np.array([session.steps[shape][0] for shape in shapes])
    return fit.relative_errors(fit.predict_s(shapes, hardware), measured_s)


def _mape_by_dtype(shapes, errors) -> dict:
    return {dtype: _sig(float(np.mean(np.abs(errors[[s.dtype == dtype for s in shapes]]))))
            for dtype in dict.fromkeys(s.dtype for s in shapes)}


def _measurement_rows(shapes, session, errors) -> list[dict]:
    """One row per shape: the shape, its median time, the spread of its samples, the fitted model's error."""
    return [dict(shape.as_dict(), median_s=_sig(session.steps[shape][0]), relative_iqr=_sig(session.steps[shape][1]),
                 error=_sig(float(error))) for shape, error in zip(shapes, errors)]


# -- validate ---------------------------------------------------------------------------------

def validate(profile: HardwareProfile, quick: bool = False, threads: int | None = None, seed: int = 1,
             design=None, progress: Progress = QUIET) -> dict:
    """Measure the held-out grid and compare it with ``profile`` and with the bare roofline of its peaks
    (``progress`` counts the timed calls)."""
    require_torch()
    from llmsim.calibration import bench, fit, measure
    from llmsim.calibration.design import Shape, design_for

    record = profile.calibration
    design = design or design_for(record["device"], quick)
    shapes = design.holdout.shapes(record["dtypes"])
    fitted = {Shape(**{k: m[k] for k in ("hidden", "layers", "dtype", "batch", "context")}): m["median_s"]
              for m in record["measurements"]}
    _check_held_out(shapes, list(fitted))
    anchors = list(fitted)[::ANCHOR_STRIDE]
    with bench.open_device(record["device"], threads or record["threads"]) as device:
        session = measure.measure(design, device, record["dtypes"], shapes + anchors, layouts=False, seed=seed,
                                  progress=progress)
    measured_s = np.array([session.steps[shape][0] for shape in shapes])
    calibrated_s = fit.predict_s(shapes, profile)
    step_drift = float(np.median([session.steps[shape][0] / fitted[shape] for shape in anchors]))
    return {"profile": profile.name, "device": record["device"], "threads": device.threads, "shapes": shapes,
            "measured_s": measured_s, "calibrated_s": calibrated_s,
            "roofline_s": fit.predict_s(shapes, fit.uncalibrated(profile)),
            "noise": session.median_relative_iqr, "anchors": len(anchors), "step_drift": step_drift,
            "drift_adjusted_mape": float(np.mean(np.abs(calibrated_s * step_drift / measured_s - 1))),
            "drift": _roofline_drift(profile, session.roofline)}


def _roofline_drift(profile: HardwareProfile, now: dict) -> dict:
    """The device's achieved peaks now, as multiples of those in the profile."""
    then = profile.calibration["roofline"]
    drift = {f"gemm {d}": rate / profile.peak_flops_per_s[d] for d, rate in now["gemm_flops_per_s"].items()}
    drift["streaming read"] = now["stream_read_bytes_per_s"] / profile.memory_bandwidth_bytes_per_s
    drift["dispatch time"] = now["dispatch_s"] / then["dispatch_s"]
    return drift


def _check_held_out(shapes, fitted) -> None:
    """Every held-out shape differs from every fitted one in batch, context, width and depth."""
    for axis in ("batch", "context", "hidden", "layers"):
        shared = {getattr(s, axis) for s in shapes} & {getattr(s, axis) for s in fitted}
        if shared:
            raise ConfigError(f"the held-out grid shares {axis} {sorted(shared)} with the shapes this profile was "
                              f"fitted to", has_value=False)


# -- helpers ----------------------------------------------------------------------------------

def require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("llmsim calibrate needs torch: pip install -e \".[calibrate]\"", has_value=False)


def _sig(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits, for a readable record."""
    return float(f"{value:.{digits}g}")
