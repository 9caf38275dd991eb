"""``llmsim report``: a capacity-planning report (HTML and Markdown) for one scenario.

Each simulation is kept in ``runs.csv`` in the output folder as it finishes, until the report
is written: Ctrl-C (exit 130), a full disk (exit 1) or a crash loses no finished simulation,
and the same command resumes where it stopped (a simulation is deterministic in its scenario
and seed, so the report is the one an uninterrupted run writes).
"""
from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

from llmsim.cli.options import WORKERS, add_seeds_argument, checked_flag, integer_flag, number_flag, parse_seeds
from llmsim.cli.outputs import OVERWRITE_HELP, RUNS, folder_name, keeping_runs, refuse_to_replace, write_file
from llmsim.cli.plan import parse_rate
from llmsim.cli.progress import Bar
from llmsim.errors import ConfigError
from llmsim.report.build import (DEFAULT_PEAK_TO_MEAN, MIN_REQUESTS, ReportBuilder, parse_growth,
                                 traffic_from_rate, traffic_from_trace)
from llmsim.report.render import FIGURES_FOLDER, figure_files, to_html, to_markdown
from llmsim.search.plan import as_scenario, candidates
from llmsim.search.window import MAX_REQUESTS
from llmsim.workload.trace_formats import load_trace

FILES = ("report.html", "report.md", FIGURES_FOLDER)     # the Markdown's figures: SVG files in FIGURES_FOLDER
RUNS_JOURNAL = "runs.csv"         # the simulations finished, kept until the report is written


def configure_report(parser) -> None:
    parser.add_argument("scenario", help="scenario YAML file (its slo: section sets the targets)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--target-rate", type=checked_flag(parse_rate),
                      help="requests per second to size for (default: the scenario's rate)")
    rate.add_argument("--trace", help="a request trace in a format llmsim reads, detected from the file (llmsim CSV, "
                                      "Azure, BurstGPT, Mooncake JSON lines): size for its busiest hour-window, with "
                                      "lengths fitted to it")
    parser.add_argument("--growth", type=checked_flag(parse_growth),
                        help="with --trace: traffic growth factor, e.g. 2x (default 1x)")
    parser.add_argument("--peak-to-mean", type=number_flag(1.0, 2.0), default=DEFAULT_PEAK_TO_MEAN,
                        help=f"without --trace: the assumed diurnal peak over mean (default {DEFAULT_PEAK_TO_MEAN})")
    parser.add_argument("--hardware", nargs="+", help="candidate hardware profiles (default: the scenario's "
                        "plan.hardware list, else its own hardware)")
    add_seeds_argument(parser, default="2", default_text="2")
    parser.add_argument("--requests", type=integer_flag(MIN_REQUESTS, MAX_REQUESTS),
                        help="the fewest requests per simulated run; each run covers a window "
                        "that follows its rate (default: the scenario's count, at most 2000)")
    parser.add_argument("--workers", type=WORKERS, help="parallel simulations (default: all cores)")
    parser.add_argument("--out", help="folder for report.html, report.md and the figures/ it links "
                        "(default runs/report-<name>); until "
                        "they are written, each finished simulation is kept in its runs.csv, so a rerun after Ctrl-C "
                        "(exit 130) or a full disk resumes")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:
    # Everything is checked before the first simulation, so bad input writes nothing.
    scenario = as_scenario(args.scenario)
    if args.growth is not None and args.trace is None:
        raise ConfigError("a growth factor scales a trace", key="--growth", value=args.growth,
                          allowed="--trace FILE --growth 2x, or --target-rate for a rate")
    if args.trace is not None:
        path = Path(args.trace)
        trace = load_trace(path)   # any format, detected
        traffic = traffic_from_trace(trace, 1.0 if args.growth is None else args.growth, str(path))
    else:
        rate = args.target_rate if args.target_rate is not None else scenario.workload.rate_per_s
        traffic = traffic_from_rate(rate, args.peak_to_mean)
    candidates(scenario, args.hardware)               # an unknown chip: exit 2 now
    seeds = parse_seeds(args.seeds, scenario)
    out = Path(args.out) if args.out else RUNS / f"report-{folder_name(scenario.name, 'name', scenario.path)}"
    paths = [out / name for name in FILES]
    refuse_to_replace(paths, args.overwrite)      # and checks the folder can be written
    command = "llmsim report " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    with keeping_runs(out / RUNS_JOURNAL, "report"):        # Ctrl-C or a full disk: resumable
        with Bar("report", "stage") as progress:
            report = ReportBuilder(scenario, traffic, hardware=args.hardware, seeds=seeds, requests=args.requests,
                                   workers=args.workers, command=command, progress=progress).build()
        texts = {"report.html": to_html(report), "report.md": to_markdown(report), **figure_files(report)}
        written = []
        try:
            for name, text in texts.items():
                written.append(write_file(out / name, functools.partial(_write_text, text=text)))
        except OSError:          # one failed: do not leave the others alone
            for path in written:
                path.unlink(missing_ok=True)
            raise
    print(f"wrote {out / 'report.html'}, {out / 'report.md'} and its figures in {out / FIGURES_FOLDER}")
    return 0


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
