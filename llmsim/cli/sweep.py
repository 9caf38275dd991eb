"""``llmsim sweep``: every combination of a grid of settings, the frontier and its table."""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from llmsim.analysis import names
from llmsim.analysis.frontier import LATENCY, THROUGHPUT, pareto_frontier, plot_frontier
from llmsim.cli.outputs import RUNS, check_writable_folder, folder_name, write_file
from llmsim.cli.options import FORCE_HELP, WORKERS, add_seeds_argument, parse_seeds
from llmsim.cli.progress import Bar
from llmsim.errors import ConfigError
from llmsim.config.policies import ExecutorKind
from llmsim.search.sweeps import mean_over_seeds, parameter_columns, slo_met, sweep


def configure_sweep(swept) -> None:
    swept.add_argument("scenario", help="scenario YAML file")
    swept.add_argument("--grid", required=True, help="grid YAML: dotted scenario keys -> lists of values")
    swept.add_argument("--out", help="output folder (default: runs/sweep-<scenario file name>); a rerun with the "
                       "same folder skips the points in its results.csv (lines that fail their checksum are "
                       "simulated again) and replaces frontier.csv/png; a second sweep on a folder in use "
                       "stops with exit 2, naming the running one's pid")
    swept.add_argument("--workers", type=WORKERS,
                       help="parallel processes (default: the idle CPUs, or this process alone when a pool "
                            "would not be faster: the progress bar says so)")
    add_seeds_argument(swept)
    swept.add_argument("--engine", choices=ExecutorKind.names(), default=ExecutorKind.PROCESSES,
                       help="where the grid's points run: a pool of local processes (default), a Dask cluster "
                            "(needs llmsim[distributed]), or one after another in this process")
    swept.add_argument("--scheduler", help="with --engine dask: a running scheduler's address "
                       "(default: a local cluster)")
    swept.add_argument("--latency", default=LATENCY, help="frontier latency column (minimised)")
    swept.add_argument("--throughput", default=THROUGHPUT,
                       help=f"frontier throughput column (maximised), e.g. {names.OUTPUT_TOKENS_PER_USD}")
    swept.add_argument("--plot", action="store_true", help="also draw frontier.png")
    swept.add_argument("--force", action="store_true", help=FORCE_HELP)
    swept.set_defaults(func=_cmd_sweep)


SEEDS_MEETING_SLO = "seeds_meeting_slo"     # per point: the share of its seeds whose run met the SLO

# The table's columns: a metric's dotted name -> a short heading.
SWEEP_COLUMNS = {names.TTFT_P95: "ttft_p95_s", names.TPOT_P95: "tpot_p95_s", names.E2E_P95: "e2e_p95_s",
                 names.OUTPUT_TOKENS_PER_S_PER_DEVICE: "tok_per_s_per_device",
                 names.OUTPUT_TOKENS_PER_USD: "tok_per_usd", names.SLO_ATTAINMENT: "slo_attainment"}


def _cmd_sweep(args) -> int:
    out = Path(args.out) if args.out else RUNS / f"sweep-{folder_name(Path(args.scenario).stem, 'scenario')}"
    check_writable_folder(out)
    try:
        with Bar("sweep", "point") as progress:
            rows = sweep(args.scenario, args.grid, out=out, workers=args.workers, engine=args.engine,
                         seeds=parse_seeds(args.seeds, args.scenario), client=args.scheduler, force=args.force,
                         progress=progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished points are kept in {out / 'results.csv'}; "
              "the same command resumes the sweep", file=sys.stderr)
        return 130
    except OSError as error:            # the disk filled, the folder vanished: what was written stays
        print(f"llmsim: the sweep stopped: cannot write {error.filename or out} ({error.strerror or error}); "
              f"the points finished before are kept in {out / 'results.csv'}, and the same command resumes "
              "the sweep once the cause is fixed", file=sys.stderr)
        return 1
    keys = parameter_columns(rows)
    failed = rows[rows["error"] != ""]
    for _, row in failed.iterrows():
        print(f"failed: {', '.join(f'{k}={row[k]}' for k in keys)} seed {row['seed']}: {row['error']}")
    if len(failed) == len(rows):
        return 1
    for option, column in (("--latency", args.latency), ("--throughput", args.throughput)):
        if column not in rows.columns or not pd.api.types.is_numeric_dtype(rows[column]):
            numeric = [c for c in rows.select_dtypes("number").columns
                       if c.startswith((f"{names.LATENCY}.", f"{names.THROUGHPUT}."))]
            raise ConfigError("not a numeric column of the sweep's results", key=option, value=column,
                              allowed=", ".join(numeric[:12]) + ", ...")
    # A point joins the frontier only if it meets the SLO on every seed (every point does without one).
    points = mean_over_seeds(rows.assign(**{SEEDS_MEETING_SLO: slo_met(rows).astype(float)}),
                             [args.latency, args.throughput])
    meets = points[SEEDS_MEETING_SLO] == 1.0
    frontier = pareto_frontier(points[meets], args.latency, args.throughput)
    # Fixed settings add nothing; a null option (speculation: null) reads back as NaN, a value too.
    varied = [key for key in keys if points[key].astype(str).nunique(dropna=False) > 1]
    table = points[varied + ["seeds"] + [c for c in SWEEP_COLUMNS if c in points]].rename(columns=SWEEP_COLUMNS)
    table["slo"] = meets.map({True: "met", False: "MISSED"})
    table["frontier"] = ""
    table.loc[frontier.index, "frontier"] = frontier["knee"].map({True: "knee", False: "*"})
    # The frontier is a view of results.csv, the whole of it: a rerun replaces it, and says so.
    # Written before printing, which can fail (a closed pipe).
    # Without --plot an earlier frontier.png would no longer match frontier.csv: it is removed.
    replaced = [path.name for path in (out / "frontier.csv", out / "frontier.png") if path.exists()]
    written = [out / "results.csv", write_file(out / "frontier.csv", lambda path: frontier.to_csv(path, index=False))]
    if args.plot:
        written.append(write_file(out / "frontier.png", lambda path: plot_frontier(
            points, path, args.latency, args.throughput, color_by=varied[0] if varied else None, eligible=meets)))
    else:
        (out / "frontier.png").unlink(missing_ok=True)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:,.4g}".format):
        print(table.to_string(index=False))
    missed = int((~meets).sum())
    print(f"\n{len(frontier)} of {len(points)} points on the frontier ({args.latency} vs {args.throughput})"
          + (f"; {missed} missing the SLO on some seed left out of it" if missed else ""))
    print("wrote " + ", ".join(map(str, written))
          + (f" (replacing the earlier {', '.join(replaced)})" if replaced else ""))
    if "frontier.png" in replaced and not args.plot:
        print(f"removed the earlier {out / 'frontier.png'}: it drew the earlier results (--plot draws it again)")
    return 1 if len(failed) else 0
