"""The ``llmsim`` command: thin wrappers over the Python API."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from llmsim.errors import ConfigError


def _cmd_run(args) -> int:
    from llmsim.cli.render import format_summary
    from llmsim.scenario.scenario import load_scenario
    from llmsim.sim.simulate import simulate

    scenario = load_scenario(args.scenario, seed=args.seed)
    result = simulate(scenario)
    summary = result.summary()
    if scenario.speculating and not args.no_baseline and not result.interrupted:
        from llmsim.sim.simulate import speedup_over_plain
        summary["speculation"]["speedup_over_plain"] = speedup_over_plain(result)
    print(format_summary(summary))
    out = Path(args.out) if args.out else Path("runs") / scenario.name
    out.mkdir(parents=True, exist_ok=True)
    result.requests.to_csv(out / "requests.csv", index=False)
    (out / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
    written = [out / "requests.csv", out / "summary.json"]
    if args.iterations:
        result.iterations.to_csv(out / "iterations.csv", index=False)
        written.append(out / "iterations.csv")
    if args.plot:
        from llmsim.analysis.plots import timeline
        written.append(timeline(result, out / "timeline.png"))
    print("\nwrote " + ", ".join(map(str, written)))
    return 130 if result.interrupted else 0


def _cmd_compare(args) -> int:
    from llmsim.search.compare import compare

    table = compare(args.comparison)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:,.3g}".format):
        print(table.to_string(index=False))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False)
        print(f"\nwrote {args.out}")
    return 0


SWEEP_COLUMNS = {"latency.ttft_s.p95": "ttft_p95_s", "latency.tpot_s.p95": "tpot_p95_s",
                 "latency.e2e_s.p95": "e2e_p95_s", "throughput.output_tokens_per_s_per_device": "tok_per_s_per_device",
                 "throughput.output_tokens_per_usd": "tok_per_usd", "slo.attainment": "slo_attainment"}


def _cmd_sweep(args) -> int:
    from llmsim.analysis.frontier import pareto_frontier, plot_frontier
    from llmsim.search.sweeps import mean_over_seeds, parameter_columns, sweep

    out = Path(args.out) if args.out else Path("runs") / f"sweep-{Path(args.scenario).stem}"
    try:
        rows = sweep(args.scenario, args.grid, out=out, workers=args.workers, engine=args.engine,
                     seeds=args.seeds, client=args.scheduler)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished points are kept in {out / 'results.csv'}; "
              "the same command resumes the sweep", file=sys.stderr)
        return 130
    keys = parameter_columns(rows)
    failed = rows[rows["error"] != ""]
    for _, row in failed.iterrows():
        print(f"failed: {', '.join(f'{k}={row[k]}' for k in keys)} seed {row['seed']}: {row['error']}")
    if len(failed) == len(rows):
        return 1
    for option, column in (("--latency", args.latency), ("--throughput", args.throughput)):
        if column not in rows.columns or not pd.api.types.is_numeric_dtype(rows[column]):
            numeric = [c for c in rows.select_dtypes("number").columns if c.startswith(("latency.", "throughput."))]
            raise ConfigError("not a numeric column of the sweep's results", key=option, value=column,
                              allowed=", ".join(numeric[:12]) + ", ...")
    points = mean_over_seeds(rows, [args.latency, args.throughput])
    frontier = pareto_frontier(points, args.latency, args.throughput)
    # Fixed settings add nothing; a null option (speculation: null) reads back as NaN, a value too.
    varied = [key for key in keys if points[key].astype(str).nunique(dropna=False) > 1]
    table = points[varied + ["seeds"] + [c for c in SWEEP_COLUMNS if c in points]].rename(columns=SWEEP_COLUMNS)
    table["frontier"] = ""
    table.loc[frontier.index, "frontier"] = frontier["knee"].map({True: "knee", False: "*"})
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:,.4g}".format):
        print(table.to_string(index=False))
    frontier.to_csv(out / "frontier.csv", index=False)
    written = [out / "results.csv", out / "frontier.csv"]
    if args.plot:
        written.append(plot_frontier(points, out / "frontier.png", args.latency, args.throughput,
                                     color_by=varied[0] if varied else None))
    print(f"\n{len(frontier)} of {len(points)} points on the frontier ({args.latency} vs {args.throughput})")
    print("wrote " + ", ".join(map(str, written)))
    return 1 if len(failed) else 0


def _cmd_place(args) -> int:
    from llmsim.catalog.hardware import lookup_hardware
    from llmsim.catalog.models import lookup_model, model_catalog
    from llmsim.catalog.placement import place, smallest_fitting

    model = lookup_model(args.model, model_catalog()).with_dtypes(args.weight_dtype, args.kv_dtype)
    hardware = lookup_hardware(args.hardware)
    reserve = args.runtime_reserve_gb * 1e9
    if args.tp and args.pp:
        placement = place(model, hardware, args.tp, args.pp, args.memory_utilization, 128,
                          args.max_batch_tokens, reserve)
    else:
        placement = smallest_fitting(model, hardware, args.memory_utilization, 128, args.max_batch_tokens,
                                     reserve, args.tp, args.pp, min_kv_tokens=args.room_for)
    if placement is None or not placement.fits:
        print(f"{model.name} ({model.weight_dtype}) does not fit on {hardware.name} with this parallelism")
        return 1
    p = placement
    print(f"{model.name} ({model.weight_dtype} weights, {model.kv_dtype} KV) on {hardware.name}:")
    print(f"  devices            {p.devices} (tensor parallel {p.tensor_parallel} x pipeline stages "
          f"{p.pipeline_parallel})")
    print(f"  weights            {p.weights_per_device_bytes / 1e9:,.2f} GB per device in {p.weight_tier.name}"
          + (" (streamed every iteration)" if p.weight_streaming else ""))
    print(f"  KV cache           {p.kv_per_device_bytes / 1e9:,.2f} GB per device in {p.kv_tier.name}"
          f" = {p.kv_capacity_tokens:,} tokens per replica")
    for context in args.context:
        print(f"  concurrency        {p.concurrent_sequences(context):,} sequences of {context:,} tokens")
    return 0


def _cmd_models(args) -> int:
    from llmsim.catalog.models import model_catalog
    rows = [{"model": m.name, "params_B": round(m.param_count / 1e9, 3),
             "active_B": round(m.active_param_count / 1e9, 3), "layers": m.num_layers,
             "hidden": m.hidden_size, "heads/kv": f"{m.num_heads}/{m.num_kv_heads}",
             "kv_KiB_per_token": round(m.kv_bytes_per_token / 1024, 1), "max_context": m.max_context}
            for m in model_catalog().values()]
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


def _cmd_hardware(args) -> int:
    from llmsim.catalog.hardware import hardware_catalog
    rows = [{"hardware": h.name, "bf16_TFLOPs": h.peak_for("bf16") / 1e12,
             "memory_GB": h.memory_capacity_bytes / 1e9, "bandwidth_TB/s": h.memory_bandwidth_bytes_per_s / 1e12,
             "link_GB/s": h.interconnect_bandwidth_bytes_per_s / 1e9, "TDP_W": h.tdp_w,
             "usd_per_hour": h.price_per_hour_usd, "file": Path(h.path).name if h.path else ""}
            for h in hardware_catalog().values()]
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


def _json_safe(value):
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmsim", description="Simulate and plan LLM inference serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one scenario and print its summary")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--out", help="output directory (default: runs/<scenario name>)")
    run.add_argument("--seed", type=int, help="override the scenario's seed")
    run.add_argument("--iterations", action="store_true", help="also write the per-iteration log")
    run.add_argument("--plot", action="store_true", help="also draw timeline.png (queue, batch, KV, latency)")
    run.add_argument("--no-baseline", action="store_true",
                     help="with speculation: skip the plain-decoding run on the same trace (no speedup figures)")
    run.set_defaults(func=_cmd_run)
    comp = sub.add_parser("compare", help="simulate the variants of a comparison file side by side")
    comp.add_argument("comparison", help="comparison YAML (base, variants, loads)")
    comp.add_argument("--out", help="also write the table as CSV here")
    comp.set_defaults(func=_cmd_compare)
    swept = sub.add_parser("sweep", help="simulate every combination of a grid of settings; frontier and plot")
    swept.add_argument("scenario", help="scenario YAML file")
    swept.add_argument("--grid", required=True, help="grid YAML: dotted scenario keys -> lists of values")
    swept.add_argument("--out", help="output folder (default: runs/sweep-<scenario file name>); "
                       "a rerun with the same folder skips finished points")
    swept.add_argument("--workers", type=int, help="parallel processes (default: every CPU)")
    swept.add_argument("--seeds", type=int, nargs="+", help="replicate every point over these seeds")
    swept.add_argument("--engine", choices=("processes", "dask", "serial"), default="processes")
    swept.add_argument("--scheduler", help="with --engine dask: a running scheduler's address "
                       "(default: a local cluster)")
    swept.add_argument("--latency", default="latency.tpot_s.p95", help="frontier latency column (minimised)")
    swept.add_argument("--throughput", default="throughput.output_tokens_per_s_per_device",
                       help="frontier throughput column (maximised), e.g. throughput.output_tokens_per_usd")
    swept.add_argument("--plot", action="store_true", help="also draw frontier.png")
    swept.set_defaults(func=_cmd_sweep)
    placed = sub.add_parser("place", help="how many devices a model needs and how much KV cache is left")
    placed.add_argument("model")
    placed.add_argument("hardware")
    placed.add_argument("--weight-dtype", default=None)
    placed.add_argument("--kv-dtype", default=None)
    placed.add_argument("--tp", type=int, help="fix tensor parallelism (default: search)")
    placed.add_argument("--pp", type=int, help="fix pipeline stages (default: search)")
    placed.add_argument("--memory-utilization", type=float, default=0.9)
    placed.add_argument("--max-batch-tokens", type=int, default=8192)
    placed.add_argument("--runtime-reserve-gb", type=float, default=2 ** 30 / 1e9)
    placed.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768],
                        help="context lengths to report concurrency for")
    placed.add_argument("--room-for", type=int, default=1,
                        help="when searching, require KV room for at least this many tokens")
    placed.set_defaults(func=_cmd_place)
    from llmsim.calibration.calibrate import add_subcommands   # torch itself is imported only when a calibration runs
    add_subcommands(sub)
    from llmsim.search.plan import add_subcommand as add_plan
    from llmsim.search.recommend import add_subcommand as add_recommend
    add_plan(sub)
    add_recommend(sub)
    sub.add_parser("models", help="list the model catalog").set_defaults(func=_cmd_models)
    sub.add_parser("hardware", help="list the hardware profiles").set_defaults(func=_cmd_hardware)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"llmsim: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # output piped into head or less, which closed early
        return 0


if __name__ == "__main__":
    sys.exit(main())
