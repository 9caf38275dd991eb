"""``llmsim calibrate`` and ``llmsim validate``: arguments, and the reports they print.

torch is imported only when a calibration or validation runs, never to build the parser.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from llmsim.calibration.calibrate import DEFAULT_CPU_THREADS, calibrate, require_torch, validate
from llmsim.calibration import operator_bench
from llmsim.calibration.bench import machine_name
from llmsim.calibration.design import DEVICE_DTYPES
from llmsim.calibration.database import GPU_FOLDERS, INSTALLED, Database, installed_root
from llmsim.calibration.database_profile import compare_vidur, database_document
from llmsim.calibration.kernel_profile import calibrate_from_measurements, kernels_section, measured_source
from llmsim.calibration.operators import (DEVICE_PROFILES, all_reduce_errors, attention_errors, error_table,
                                          layer_errors, read_measurements)
from llmsim.calibration.plot import measured_scatter, scatter
from llmsim.calibration.profile_yaml import TRANSFER_RECORD_KEYS, transfer_document, write_document
from llmsim.catalog.hardware import load_profile, lookup_hardware
from llmsim.catalog.kernel_terms import ENGINE_NAMES, EngineKernels
from llmsim.cli.options import SEED, WORKERS
from llmsim.cli.outputs import OVERWRITE_HELP, refuse_to_replace, write_file
from llmsim.cli.progress import Bar
from llmsim.config.reader import load_yaml
from llmsim.errors import ConfigError


def configure_calibrate(cal) -> None:
    cal.add_argument("--device", choices=tuple(DEVICE_DTYPES), help="default: cuda if available, else cpu")
    cal.add_argument("--out", help="profile to write (default: <device>-calibrated.yaml)")
    cal.add_argument("--quick", action="store_true", help="few small shapes and repeats (under 2 minutes on a CPU)")
    cal.add_argument("--threads", type=WORKERS, help=f"torch threads (default {DEFAULT_CPU_THREADS} on CPU)")
    per_device = "; ".join(f"{device}: {','.join(dtypes)}" for device, dtypes in DEVICE_DTYPES.items())
    cal.add_argument("--dtypes", help=f"comma-separated subset of the device's dtypes ({per_device})")
    cal.add_argument("--transfer-to", metavar="PROFILE",
                     help="write PROFILE with this calibration's efficiencies to --out instead")
    cal.add_argument("--from", dest="from_profile", metavar="CALIBRATED",
                     help="with --transfer-to: take the efficiencies of this calibrated profile, measure nothing")
    cal.add_argument("--from-measurements", metavar="DIR",
                     help="fit a GPU's kernel terms to operator timing CSVs in the Vidur profiler's format instead "
                          "of timing torch here (no torch needed)")
    cal.add_argument("--operators", metavar="DIR",
                     help="time one layer's operators and attention kernels on this device at several models' shapes "
                          "and TP sizes, and write them to DIR as Vidur-format CSVs (fit them with "
                          "--from-measurements)")
    cal.add_argument("--models", help="with --operators: comma-separated catalog models (default: "
                                      f"{','.join(operator_bench.DEFAULT_MODELS)})")
    cal.add_argument("--attention-backend", choices=("flash", "default"), default="flash",
                     help="with --operators: force SDPA's FlashAttention-2 kernel (default) or let SDPA pick "
                          "(cuDNN's on Hopper)")
    cal.add_argument("--tag", help="with --operators: the device tag written in the rows and file names "
                                   "(default: h200/h100/a100 from the GPU's name, else the device kind)")
    cal.add_argument("--from-database", nargs="?", const=INSTALLED, metavar="DIR",
                     help="fit every GPU's (or --gpu's) kernel terms per engine to NVIDIA's measured operator database "
                          "(pip install 'llmsim[measured]'), or to a folder of its layout, and write the profiles to "
                          "--out (a folder, default database-profiles/) with a validation table")
    cal.add_argument("--engine", choices=ENGINE_NAMES,
                     help="with --from-database: fit this engine's kernels only (default: every engine the database "
                          "has; vLLM's become the profile's kernels, the others its kernels.engines)")
    cal.add_argument("--compare-vidur", action="store_true",
                     help="with --from-database: print where the database fit and the Vidur-fitted terms of the "
                          "A100 and H100 disagree, by operator group")
    cal.add_argument("--gpu",
                     help="with --from-measurements: the device whose rows to fit (default: the only one found: "
                          f"{', '.join(DEVICE_PROFILES)}); with --from-database: a profile's name or alias "
                          f"({', '.join(GPU_FOLDERS)})")
    cal.add_argument("--base", metavar="PROFILE",
                     help="with --from-measurements: the profile to add the kernel terms to (default: the shipped "
                          "profile of --gpu)")
    cal.add_argument("--seed", type=SEED, default=0, help="order of the interleaved rounds, random block tables")
    cal.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    cal.set_defaults(func=_cmd_calibrate)


def configure_validate(val) -> None:
    val.add_argument("profile",
                     help="a profile written by llmsim calibrate: its name (e.g. cpu-calibrated) or its file")
    val.add_argument("--device", choices=tuple(DEVICE_DTYPES),
                     help="default: the device the profile was calibrated on")
    val.add_argument("--quick", action="store_true", help="the small held-out grid")
    val.add_argument("--threads", type=WORKERS, help="torch threads (default: as in the calibration)")
    val.add_argument("--plot", help="write a predicted-vs-measured scatter plot (PNG) here")
    val.add_argument("--gpu", choices=tuple(DEVICE_PROFILES),
                     help="with --measurements: whose rows to compare (default: the profile's device)")
    val.add_argument("--measurements", metavar="DIR",
                     help="compare the profile's kernel terms with operator timing CSVs (Vidur format) instead of "
                          "timing torch here: MAPE, median error and bias by operator group, regime and TP")
    val.add_argument("--seed", type=SEED, default=1,
                     help="order of the interleaved rounds and the random block tables of the held-out steps")
    val.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    val.set_defaults(func=_cmd_validate)


def _cmd_calibrate(args) -> int:
    if args.from_database:
        return _cmd_from_database(args)
    if args.from_measurements:
        return _cmd_from_measurements(args)
    if args.operators:
        return _cmd_operators(args)
    if args.from_profile and not args.transfer_to:
        raise ConfigError("--from only goes with --transfer-to", key="--from", value=args.from_profile,
                          allowed="--transfer-to PROFILE --from CALIBRATED --out OUT")
    if args.transfer_to:
        return _cmd_transfer(args)
    device = _device_kind(args.device)
    out = Path(args.out or f"{device}-calibrated.yaml")
    refuse_to_replace([out], args.overwrite)
    with Bar("measuring", "call") as bar:
        document = calibrate(device, out.stem, quick=args.quick, threads=_threads(args.threads, device),
                             dtypes=_dtypes(args.dtypes, device), seed=args.seed, progress=bar)
    write_document(document, out)
    print(calibration_summary(document))
    print(f"\nwrote {out}")
    return 0


def _cmd_operators(args) -> int:
    require_torch()
    device = _device_kind(args.device)
    grid = operator_bench.QUICK_GRID if args.quick else operator_bench.Grid()
    if args.models:
        grid = replace(grid, models=tuple(name.strip() for name in args.models.split(",") if name.strip()))
    tag = args.tag or operator_bench.device_tag(device)
    with _progress_bar("operators") as progress:
        meta = operator_bench.profile_operators(args.operators, tag, device, grid, progress, args.attention_backend)
    if device == "cuda" and not args.quick:      # the checks the per-operator rows cannot give alone
        with _progress_bar("fp8 GEMMs") as progress:
            operator_bench.profile_fp8_gemms(args.operators, tag, progress=progress)
        with _progress_bar("whole steps") as progress:
            operator_bench.profile_steps(args.operators, tag, device, progress=progress)
    print(f"{meta['device_name']} (torch {meta['torch']}, {meta['dtype']}): {meta['protocol']}; streaming kernels "
          f"{meta['streaming_kernels']}" + (f"; empty kernel {meta['empty_kernel_s'] * 1e6:.2f} us"
                                              if meta["empty_kernel_s"] else ""))
    print(f"wrote {args.operators}/: " + ", ".join(
        name.format(tag=tag) for name in (operator_bench.LINEAR_FILE, operator_bench.ATTENTION_FILE,
                                          operator_bench.META_FILE, operator_bench.FP8_FILE, operator_bench.STEP_FILE)
        if (Path(args.operators) / name.format(tag=tag)).exists()))
    return 0


@contextmanager
def _progress_bar(desc: str):
    """A bar fed by the operator bench's ``progress(done, total)`` callback (the total known only as it runs)."""
    with tqdm(total=1, desc=desc, unit="shape", mininterval=1.0) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        yield progress


def _cmd_transfer(args) -> int:
    if not args.out:
        raise ConfigError("--transfer-to needs --out", key="--out", value=None, allowed="a path for the new profile")
    refuse_to_replace([Path(args.out)], args.overwrite)
    target = _profile_yaml(_profile_path(args.transfer_to, "--transfer-to"))
    if args.from_profile:
        from_path = _profile_path(args.from_profile, "--from")
        calibrated, name = _profile_yaml(from_path), Path(from_path).stem
        record = calibrated.get("calibration")
        if not isinstance(record, dict) or record.get("tool") != "llmsim calibrate":
            raise ConfigError("has no record of llmsim calibrate's efficiency measurement (a profile fitted with "
                              "--from-measurements holds kernel terms, which are not transferred)",
                              file=from_path, key="calibration.tool",
                              value=record.get("tool") if isinstance(record, dict) else record,
                              allowed="a profile written by llmsim calibrate (tool: llmsim calibrate)")
        missing = [key for key in TRANSFER_RECORD_KEYS if key not in record]
        if missing:
            raise ConfigError("the calibration record lacks what the transferred profile cites", file=from_path,
                              key=f"calibration.{missing[0]}", has_value=False,
                              allowed=f"a record with {', '.join(TRANSFER_RECORD_KEYS)} "
                                      "(regenerate it with llmsim calibrate)")
    else:
        device = _device_kind(args.device)
        with Bar("measuring", "call") as bar:
            calibrated = calibrate(device, f"{device}-calibrated", quick=args.quick,
                                   threads=_threads(args.threads, device), dtypes=_dtypes(args.dtypes, device),
                                   seed=args.seed, progress=bar)
        name = calibrated["name"]
        print(calibration_summary(calibrated) + "\n")
    write_document(transfer_document(calibrated, target, name), args.out)
    print(f"wrote {args.out}: {target['name']} peaks with the efficiencies of {name}")
    return 0


def calibration_summary(document: dict) -> str:
    """A few lines for the terminal: the roofline, the layout study, the fit."""
    record = document["calibration"]
    roof, fit, layouts = record["roofline"], record["fit"], record["kv_layouts"]
    held = record["held_out_same_session"]
    lines = [f"{document['name']}: {record['device_name']} ({record['device']}, {record['threads']} thread(s)), "
             f"torch {record['torch_version']}, {record['design']} design, {fit['shapes']} decode steps",
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
              f"in-sample  MAPE {fit['mape']:.1%} ("
              + ", ".join(f"{d} {v:.1%}" for d, v in fit["mape_by_dtype"].items())
              + f"), worst {fit['worst_error']:.1%}; measurement noise (median IQR/median) "
              f"{record['noise']['median_relative_iqr']:.1%}",
              f"held out   MAPE {held['mape']:.1%} ("
              + ", ".join(f"{d} {v:.1%}" for d, v in held["mape_by_dtype"].items())
              + f"), worst {held['worst_error']:.1%}: {held['shapes']} steps measured in the same session, not fitted"]
    if fit.get("at_ceiling"):
        lines.append(f"WARNING    {', '.join(fit['at_ceiling'])} fitted at the ceiling 1: the steps ran faster "
                     "than the "
                     "measured peaks allow, so the roofline benchmark did not reach the kernels' speed")
    return "\n".join(lines)


def _cmd_from_measurements(args) -> int:
    measurements = read_measurements(args.from_measurements, key="from_measurements")
    if args.gpu is not None and args.gpu not in DEVICE_PROFILES:
        raise ConfigError("is not a device the measurements name", key="--gpu", value=args.gpu,
                          allowed=", ".join(DEVICE_PROFILES))
    device = args.gpu or _only_device(measurements, args.from_measurements)
    out = Path(args.out or f"{device}-kernels.yaml")
    refuse_to_replace([out], args.overwrite)
    base_path = _profile_path(args.base or DEVICE_PROFILES[device], "--base")
    base_profile = load_profile(base_path)
    terms, record = calibrate_from_measurements(measurements, device, base_profile)
    document = load_yaml(base_path)
    document["kernels"] = kernels_section(terms, device, measured_source(record), fitted_terms=record["fitted"],
                                          base_section=document.get("kernels"))
    document["calibration"] = record
    write_document(document, out)
    print(kernel_calibration_summary(record))
    print(f"\nwrote {out}")
    return 0


def _database_gpu(name: str, gpus: list[str]) -> str:
    """``--gpu`` as the operator database names it: one of its GPUs, or the name or an alias of the hardware
    profile of one (``H100``: ``H100-SXM``)."""
    if name in gpus:
        return name
    try:
        profile_name = lookup_hardware(name).name
    except ConfigError:
        profile_name = None
    if profile_name not in gpus:
        raise ConfigError("is not a GPU the operator database has tables for", key="--gpu", value=name,
                          allowed=", ".join(gpus))
    return profile_name


def _cmd_from_database(args) -> int:
    database = Database(installed_root() if args.from_database == INSTALLED else args.from_database)
    gpus = database.gpus()
    engines = [EngineKernels(args.engine)] if args.engine else list(EngineKernels)
    out = Path(args.out or "database-profiles")
    targets = [_database_gpu(args.gpu, gpus)] if args.gpu else gpus
    paths = {gpu: out / Path(lookup_hardware(gpu).path or f"{gpu}.yaml").name for gpu in targets}
    refuse_to_replace([*paths.values(), *(path.with_name(path.stem + "-validation.csv") for path in paths.values())],
                      args.overwrite)
    for gpu in targets:
        document, validation = database_document(database, gpu, engines)
        write_document(document, paths[gpu])
        validation_path = paths[gpu].with_name(paths[gpu].stem + "-validation.csv")
        validation.to_csv(validation_path, index=False)
        held = validation[validation["split"] == "held_out"]
        print(f"{gpu}: held-out errors (every other size fitted, the rest predicted)")
        print(format_table(held.drop(columns=["gpu", "split"])))
        print(f"wrote {paths[gpu]}, {validation_path}\n")
    if args.compare_vidur:
        print("The Vidur-fitted terms over the database fit, on the database's vLLM rows (1: they agree):")
        print(compare_vidur(database).to_string(index=False))
    return 0


def _only_device(measurements, folder) -> str:
    devices = measurements.devices()
    if len(devices) != 1:
        raise ConfigError(f"holds measurements of {', '.join(devices)}: name one with --gpu", file=str(folder),
                          has_value=False)
    return devices[0]


def kernel_calibration_summary(record: dict) -> str:
    rows = record["rows"]
    lines = [f"{record['device']}: {rows['linear']} layer rows ({', '.join(rows['models'])}; TP "
             f"{', '.join(map(str, rows['tp']))}), {rows['all_reduce_in_node']} in-node all-reduce rows, "
             f"{rows.get('attention', 0)} attention rows"]
    def cells(rows, group):
        return "; ".join(f"{r[group]} TP{r['tp']} MAPE {r['mape']:.1%} median {r['median_error']:+.1%}" for r in rows)
    for title, tables in (("in-sample", record["in_sample"]), ("held out", record["held_out"])):
        lines.append(f"{title} per-layer: " + cells(tables.get("per_layer", []), "regime"))
        lines.append(f"{title} all-reduce: " + "; ".join(
            f"{r['size_class']} MAPE {r['mape']:.1%}" for r in tables.get("all_reduce", [])))
        if tables.get("fp8_gemm"):
            lines.append(f"{title} FP8 GEMMs: " + cells(tables["fp8_gemm"], "regime"))
        if tables.get("attention"):
            lines.append(f"{title} attention: " + cells(tables["attention"], "phase"))
    return "\n".join(lines)


def _cmd_validate_measurements(args) -> int:
    path = _profile_path(args.profile, "profile")
    profile = load_profile(path)
    if profile.kernels is None:
        raise ConfigError("has no kernels: section to validate; add one with llmsim calibrate --from-measurements",
                          file=path, has_value=False)
    if args.plot:
        refuse_to_replace([Path(args.plot)], args.overwrite)
    measurements = read_measurements(args.measurements)
    device = args.gpu or _device_of(profile, measurements, args.measurements)
    rows = measurements.for_device(device)
    layers = layer_errors(rows.linear, profile.kernels) if len(rows.linear) else None
    reduce = all_reduce_errors(rows.all_reduce, profile.kernels) if len(rows.all_reduce) else None
    attention = attention_errors(rows.attention, profile) if len(rows.attention) else None
    print(f"validate {profile.name} against {device} measurements in {args.measurements} "
          f"(errors: predicted / measured - 1; bias: mean error)")
    if layers is not None:
        print("\n" + format_table(error_table(layers, ["group", "regime", "tp"])))
    if reduce is not None:
        print("\n" + format_table(error_table(reduce, ["gpus", "size_class"])))
    if attention is not None:
        print("\nattention kernels (one layer, one GPU):\n" + format_table(error_table(attention, ["phase", "tp"])))
    if args.plot:
        write_file(Path(args.plot), lambda path: measured_scatter(layers, reduce, path,
                                                                  f"{profile.name} vs {device} measurements"))
        print(f"\nwrote {args.plot}")
    return 0


def _device_of(profile, measurements, folder) -> str:
    """The measured device whose shipped profile this one is (or was calibrated from)."""
    recorded = profile.calibration.get("device") if isinstance(profile.calibration, dict) else None
    for device in measurements.devices():
        if device == recorded or DEVICE_PROFILES[device] == profile.name:
            return device
    raise ConfigError(f"holds no measurements of the device of profile {profile.name}; name one with --gpu",
                      file=str(folder), has_value=False, allowed=", ".join(measurements.devices()))


def format_table(table) -> str:
    """An error table as aligned text, fractions as percentages."""
    shown = table.copy()
    for column in ("mape", "median_error", "bias"):
        shown[column] = [f"{value:+.1%}" if column != "mape" else f"{value:.1%}" for value in shown[column]]
    return shown.to_string(index=False)


def _cmd_validate(args) -> int:
    if args.measurements:
        return _cmd_validate_measurements(args)
    path = _profile_path(args.profile, "profile")
    profile = load_profile(path)
    record = profile.calibration
    if "measurements" not in record:
        raise ConfigError("has no calibration record; validate a profile written by llmsim calibrate",
                          file=path, has_value=False)
    if args.plot:
        refuse_to_replace([Path(args.plot)], args.overwrite)
    device = args.device or record["device"]
    if device != record["device"]:
        raise ConfigError(f"was calibrated on {record['device']}, not {device}", file=path,
                          key="--device", value=device, allowed=record["device"])
    require_torch()
    warning = other_machine_warning(profile, machine_name(device))
    if warning:
        print(f"llmsim: warning: {warning}", file=sys.stderr)
    with Bar("measuring", "call") as bar:
        report = validate(profile, quick=args.quick, threads=args.threads or record["threads"], seed=args.seed,
                          progress=bar)
    print(validation_summary(report))
    if args.plot:
        write_file(Path(args.plot), lambda path: scatter(report, path))
        print(f"\nwrote {args.plot}")
    return 0


def other_machine_warning(profile, here: str) -> str | None:
    """What to say when a machine-specific profile is validated on another machine (None: same machine,
    or a chip's profile)."""
    if profile.machine is None or profile.machine == here:
        return None
    return (f"{profile.name} is machine-specific: it was measured on {profile.machine}, and this machine is {here}. "
            f"Its figures describe that machine, so expect large errors here; llmsim calibrate measures this one")


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


def _device_kind(requested: str | None) -> str:
    require_torch()
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
    if text is None:
        return DEVICE_DTYPES[device]
    dtypes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [d for d in dtypes if d not in DEVICE_DTYPES[device]]
    if unknown or not dtypes:
        raise ConfigError(f"not a {device} dtype of llmsim calibrate", key="--dtypes", value=text,
                          allowed=", ".join(DEVICE_DTYPES[device]))
    return dtypes


def _profile_path(name: str, flag: str) -> str:
    """The file of a profile named on the command line by its name (H100, cpu-calibrated) or its path."""
    return str(lookup_hardware(name, None, flag).path)


def _profile_yaml(path: str) -> dict:
    """A profile's raw document, after checking that it loads."""
    load_profile(path)
    return load_yaml(path)
