"""``llmsim calibrate`` and ``llmsim validate``: the cost model against a real torch decode step.

``calibrate`` times a small Llama-style decode step in torch on the local device
over a grid of batch sizes, context lengths, widths, depths and dtypes, together
with the device's roofline (achieved GEMM FLOP/s, streaming bandwidth, dispatch
time) and a KV-cache layout and paging study; fits the cost model's efficiencies
and overheads to the steps; and writes a hardware profile. ``validate`` times a
held-out grid that shares no batch, context, width or depth with the fit, and
compares the profile's predictions, and those of the bare roofline of the same
peaks, with the measurements.

torch is imported only when one of these commands runs (``pip install -e
".[calibrate]"``); the simulator never needs it. Register the commands on the
``llmsim`` parser with :func:`add_subcommands`.
"""
from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

import numpy as np

from llmsim.config.reader import load_yaml
from llmsim.errors import ConfigError
from llmsim.catalog.hardware import HardwareProfile, load_profile

# One torch thread by default on CPU: on a shared machine, an OpenMP team that spans
# cores stalls at every barrier while another process holds one of them (measured here:
# 2 threads next to a test run spread a decode step's samples 45x, 1 thread 1.5x).
DEFAULT_CPU_THREADS = 1
# validate re-measures every ANCHOR_STRIDE-th fitted step, to tell the machine's drift from the model's error.
ANCHOR_STRIDE = 4


def add_subcommands(subparsers) -> None:
    """Register ``calibrate`` and ``validate`` on the CLI's subparsers."""
    cal = subparsers.add_parser("calibrate", help="fit the cost model to a torch decode step on this device")
    cal.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    cal.add_argument("--out", help="profile to write (default: <device>-calibrated.yaml)")
    cal.add_argument("--quick", action="store_true", help="few small shapes and repeats (under 2 minutes on a CPU)")
    cal.add_argument("--threads", type=int, help=f"torch threads (default {DEFAULT_CPU_THREADS} on CPU)")
    cal.add_argument("--dtypes", help="comma-separated subset of the device's dtypes (cpu: fp32,bf16; cuda: bf16,fp16)")
    cal.add_argument("--transfer-to", metavar="PROFILE",
                     help="write PROFILE with this calibration's efficiencies to --out instead")
    cal.add_argument("--from", dest="from_profile", metavar="CALIBRATED",
                     help="with --transfer-to: take the efficiencies of this calibrated profile, measure nothing")
    cal.add_argument("--seed", type=int, default=0, help="order of the interleaved rounds, random block tables")
    cal.set_defaults(func=_cmd_calibrate)
    val = subparsers.add_parser("validate", help="compare a calibrated profile with held-out torch decode steps")
    val.add_argument("profile", help="a profile written by llmsim calibrate")
    val.add_argument("--device", choices=("cpu", "cuda"), help="default: the device the profile was calibrated on")
    val.add_argument("--quick", action="store_true", help="the small held-out grid")
    val.add_argument("--threads", type=int, help="torch threads (default: as in the calibration)")
    val.add_argument("--plot", help="write a predicted-vs-measured scatter plot (PNG) here")
    val.add_argument("--seed", type=int, default=1)
    val.set_defaults(func=_cmd_validate)


# -- calibrate --------------------------------------------------------------------------------

def _cmd_calibrate(args) -> int:
    if args.from_profile and not args.transfer_to:
        raise ConfigError("--from only goes with --transfer-to", key="--from", value=args.from_profile,
                          allowed="--transfer-to PROFILE --from CALIBRATED --out OUT")
    if args.transfer_to:
        return _cmd_transfer(args)
    device = _device_kind(args.device)
    out = Path(args.out or f"{device}-calibrated.yaml")
    document = calibrate(device, out.stem, quick=args.quick, threads=_threads(args.threads, device),
                         dtypes=_dtypes(args.dtypes, device), seed=args.seed)
    _write(document, out)
    print(calibration_summary(document))
    print(f"\nwrote {out}")
    return 0


def _cmd_transfer(args) -> int:
    from llmsim.calibration.profile_yaml import transfer_document, write_document
    if not args.out:
        raise ConfigError("--transfer-to needs --out", key="--out", value=None, allowed="a path for the new profile")
    target = _profile_yaml(args.transfer_to)
    if args.from_profile:
        calibrated, name = _profile_yaml(args.from_profile), Path(args.from_profile).stem
        if "calibration" not in calibrated:
            raise ConfigError("has no calibration record; transfer from a profile written by llmsim calibrate",
                              file=args.from_profile, has_value=False)
    else:
        device = _device_kind(args.device)
        calibrated = calibrate(device, f"{device}-calibrated", quick=args.quick,
                               threads=_threads(args.threads, device), dtypes=_dtypes(args.dtypes, device),
                               seed=args.seed)
        name = calibrated["name"]
        print(calibration_summary(calibrated) + "\n")
    write_document(transfer_document(calibrated, target, name), args.out)
    print(f"wrote {args.out}: {target['name']} peaks with the efficiencies of {name}")
    return 0


def calibrate(device_kind: str, name: str, quick: bool = False, threads: int = DEFAULT_CPU_THREADS,
              dtypes: tuple[str, ...] | None = None, seed: int = 0, plan=None) -> dict:
    """Measure, fit and return the profile document (see profile_yaml.profile_document).

    ``plan`` overrides the device's quick or full plan (a custom grid).
    """
    _require_torch()
    from llmsim.calibration import bench, fit, measure
    from llmsim.calibration.plan import DEVICE_DTYPES, plan_for
    from llmsim.calibration.profile_yaml import profile_document

    plan = plan or plan_for(device_kind, quick)
    dtypes = dtypes or DEVICE_DTYPES[device_kind]
    device = bench.open_device(device_kind, threads)
    shapes, held_out = plan.fit.shapes(dtypes), plan.holdout.shapes(dtypes)
    session = measure.measure(plan, device, dtypes, shapes + held_out, layouts=True, seed=seed)
    roofline = _roofline_profile(name, device, session.roofline)
    measured_s = np.array([session.steps[shape][0] for shape in shapes])
    dispatch_s = session.roofline["dispatch_s"]
    result = fit.fit_parameters(shapes, measured_s, roofline, session.kv_read_penalty,
                                initial_overheads_s=(dispatch_s, dispatch_s))
    record = _record(plan, device, dtypes, session, shapes, held_out, result)
    return profile_document(name, record, result.values, session.roofline, plan.gemm_size,
                            plan.stream_bytes, threads)


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


def _record(plan, device, dtypes, session, shapes, held_out, result) -> dict:
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
        "plan": plan.name, "dtypes": list(dtypes), "rounds": plan.rounds, "warmup": plan.warmup,
        "protocol": "every job warmed up, then timed once per round in a fresh random order, cold last-level "
                    "cache, device synchronised; figures are medians over rounds",
        "kv_layout": f"paged, block {bench.STEP_BLOCK_SIZE} tokens, pool [kv_heads, blocks, block, head_dim], "
                     "gathered into a preallocated contiguous workspace",
        "roofline": {"gemm_size": plan.gemm_size, "stream_bytes": plan.stream_bytes,
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


def calibration_summary(document: dict) -> str:
    """A few lines for the terminal: the roofline, the layout study, the fit."""
    record = document["calibration"]
    roof, fit, layouts = record["roofline"], record["fit"], record["kv_layouts"]
    held = record["held_out_same_session"]
    lines = [f"{document['name']}: {record['device_name']} ({record['device']}, {record['threads']} thread(s)), "
             f"torch {record['torch_version']}, {record['plan']} plan, {fit['shapes']} decode steps",
             "roofline   GEMM " + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in roof["gemm_flops_per_s"].items())
             + f"; streaming read {roof['stream_read_bytes_per_s'] / 1e9:.1f} GB/s, copy "
             f"{roof['copy_bytes_per_s'] / 1e9:.1f} GB/s; tiny-op dispatch {roof['dispatch_s'] * 1e6:.1f} us",
             "KV layouts (median ms of one layer's decode attention):"]
    for row in layouts["rows"]:
        times = "  ".join(f"{name} {t * 1e3:.2f}" for name, t in row["median_s"].items())
        lines.append(f"  {row['dtype']} batch {row['batch']} context {row['context']}: {times}")
    params = fit["parameters"]
    lines += [f"KV read penalty (paged {layouts['block_size']} / contiguous) {layouts['kv_read_penalty']:.3f}"]
    lines += [f"fit {dtype:>6} compute {params[f'compute/{dtype}']:.3f}  attention {params[f'attention/{dtype}']:.4f}"
              f"  memory {params[f'memory_bandwidth/{dtype}']:.3f}" for dtype in record["dtypes"]]
    lines += [f"fit        attention half-efficiency context {params['attention_half_context']:.0f} tokens"
              f"  per step {params['per_step_overhead_s'] * 1e6:.0f} us"
              f"  per layer {params['per_layer_overhead_s'] * 1e6:.0f} us",
              f"in-sample  MAPE {fit['mape']:.1%} (" + ", ".join(f"{d} {v:.1%}" for d, v in fit["mape_by_dtype"].items())
              + f"), worst {fit['worst_error']:.1%}; measurement noise (median IQR/median) "
              f"{record['noise']['median_relative_iqr']:.1%}",
              f"held out   MAPE {held['mape']:.1%} (" + ", ".join(f"{d} {v:.1%}" for d, v in held["mape_by_dtype"].items())
              + f"), worst {held['worst_error']:.1%}: {held['shapes']} steps measured in the same session, not fitted"]
    if fit.get("at_ceiling"):
        lines.append(f"WARNING    {', '.join(fit['at_ceiling'])} fitted at the ceiling 1: the steps ran faster than the "
                     "measured peaks allow, so the roofline benchmark did not reach the kernels' speed")
    return "\n".join(lines)


# -- validate ---------------------------------------------------------------------------------

def _cmd_validate(args) -> int:
    profile = load_profile(args.profile)
    record = profile.calibration
    if "measurements" not in record:
        raise ConfigError("has no calibration record; validate a profile written by llmsim calibrate",
                          file=args.profile, has_value=False)
    device = args.device or record["device"]
    if device != record["device"]:
        raise ConfigError(f"was calibrated on {record['device']}, not {device}", file=args.profile,
                          key="--device", value=device, allowed=record["device"])
    report = validate(profile, quick=args.quick, threads=args.threads or record["threads"], seed=args.seed)
    print(validation_summary(report))
    if args.plot:
        from llmsim.calibration.plot import scatter
        scatter(report, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def validate(profile: HardwareProfile, quick: bool = False, threads: int | None = None, seed: int = 1,
             plan=None) -> dict:
    """Measure the held-out grid and compare it with ``profile`` and with the bare roofline of its peaks."""
    _require_torch()
    from llmsim.calibration import bench, fit, measure
    from llmsim.calibration.plan import Shape, plan_for

    record = profile.calibration
    plan = plan or plan_for(record["device"], quick)
    shapes = plan.holdout.shapes(record["dtypes"])
    fitted = {Shape(**{k: m[k] for k in ("hidden", "layers", "dtype", "batch", "context")}): m["median_s"]
              for m in record["measurements"]}
    _check_held_out(shapes, list(fitted))
    anchors = list(fitted)[::ANCHOR_STRIDE]
    device = bench.open_device(record["device"], threads or record["threads"])
    session = measure.measure(plan, device, record["dtypes"], shapes + anchors, layouts=False, seed=seed)
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


def validation_summary(report: dict) -> str:
    measured, calibrated, roofline = report["measured_s"], report["calibrated_s"], report["roofline_s"]
    cal_err, roof_err = calibrated / measured - 1, roofline / measured - 1
    lines = [f"validate {report['profile']} on {report['device']} ({report['threads']} thread(s)): "
             f"{len(report['shapes'])} held-out decode steps, none sharing a batch, context, width or depth "
             f"with the fit", "",
             f"{'hidden':>6} {'layers':>6} {'dtype':>5} {'batch':>5} {'context':>7} {'measured ms':>11} "
             f"{'calibrated ms':>13} {'error':>7} {'roofline ms':>11} {'error':>7}"]
    for shape, m, c, ce, r, re in zip(report["shapes"], measured, calibrated, cal_err, roofline, roof_err):
        lines.append(f"{shape.hidden:>6} {shape.layers:>6} {shape.dtype:>5} {shape.batch:>5} {shape.context:>7} "
                     f"{m * 1e3:>11.3f} {c * 1e3:>13.3f} {ce:>+7.1%} {r * 1e3:>11.3f} {re:>+7.1%}")
    worst, roof_worst = int(np.argmax(np.abs(cal_err))), int(np.argmax(np.abs(roof_err)))
    lines += ["",
              f"calibrated profile   MAPE {np.mean(np.abs(cal_err)):.1%}, worst {cal_err[worst]:+.1%} "
              f"({_shape_text(report['shapes'][worst])})",
              f"uncalibrated roofline MAPE {np.mean(np.abs(roof_err)):.1%}, worst {roof_err[roof_worst]:+.1%} "
              f"({_shape_text(report['shapes'][roof_worst])}); same peaks, efficiencies 1, no overheads",
              "by dtype: " + ", ".join(_dtype_mapes(report)),
              f"measurement noise (median IQR/median over rounds) {report['noise']:.1%}; machine now vs calibration: "
              + ", ".join(f"{k} x{v:.2f}" for k, v in report["drift"].items()),
              f"drift: {report['anchors']} fitted steps re-measured now take x{report['step_drift']:.2f} their "
              f"calibration time (median); with that factor divided out the calibrated MAPE would be "
              f"{report['drift_adjusted_mape']:.1%}"]
    return "\n".join(lines)


def _dtype_mapes(report: dict) -> list[str]:
    """Calibrated and roofline MAPE of each dtype's held-out steps."""
    texts = []
    for dtype in dict.fromkeys(shape.dtype for shape in report["shapes"]):
        mask = np.array([shape.dtype == dtype for shape in report["shapes"]])
        measured = report["measured_s"][mask]
        texts.append(f"{dtype} calibrated {np.mean(np.abs(report['calibrated_s'][mask] / measured - 1)):.1%} / "
                     f"roofline {np.mean(np.abs(report['roofline_s'][mask] / measured - 1)):.1%}")
    return texts


def _shape_text(shape) -> str:
    return f"hidden {shape.hidden}, {shape.layers} layers, {shape.dtype}, batch {shape.batch}, context {shape.context}"


# -- helpers ----------------------------------------------------------------------------------

def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise ConfigError("llmsim calibrate needs torch: pip install -e \".[calibrate]\"", has_value=False)


def _device_kind(requested: str | None) -> str:
    _require_torch()
    import torch
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise ConfigError("no CUDA device is visible to torch", key="--device", value="cuda", allowed="cpu")
    return requested or ("cuda" if available else "cpu")


def _threads(threads: int | None, device: str) -> int:
    if threads is None:
        return DEFAULT_CPU_THREADS if device == "cpu" else 1
    if threads < 1:
        raise ConfigError("must be at least 1", key="--threads", value=threads, allowed="1, 2, ...")
    return threads


def _dtypes(text: str | None, device: str) -> tuple[str, ...]:
    from llmsim.calibration.plan import DEVICE_DTYPES
    if text is None:
        return DEVICE_DTYPES[device]
    dtypes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [d for d in dtypes if d not in DEVICE_DTYPES[device]]
    if unknown or not dtypes:
        raise ConfigError(f"not a {device} dtype of llmsim calibrate", key="--dtypes", value=text,
                          allowed=", ".join(DEVICE_DTYPES[device]))
    return dtypes


def _profile_yaml(path: str) -> dict:
    """A profile's raw document, after checking that it loads."""
    load_profile(path)
    return load_yaml(path)


def _write(document: dict, out: Path) -> None:
    from llmsim.calibration.profile_yaml import write_document
    write_document(document, out)


def _sig(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits, for a readable record."""
    return float(f"{value:.{digits}g}")
