"""``llmsim trace TRACE``: what a trace holds, and a synthetic workload fitted to it.

Prints the trace's size, span, mean rate, burstiness (the CV of the gaps between
arrivals), its rate per hour and the lognormal fitted to each length column; ``--out``
writes the fitted ``workload`` mapping as YAML (``--scale 2``: twice the traffic;
``--profile``: the hourly rates as a ``steps`` arrival profile instead of Gamma arrivals).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from llmsim.cli.outputs import OVERWRITE_HELP, refuse_to_replace, write_file
from llmsim.config.reader import Node
from llmsim.workload.trace_fit import PROFILE_BIN_S, fit_workload
from llmsim.workload.trace_formats import TIMED_FORMATS, read_trace
from llmsim.errors import ConfigError


def add_parser(sub) -> None:
    trace = sub.add_parser("trace", help="describe a request trace and fit a synthetic workload to it")
    trace.add_argument("path", help="a trace file (formats: " + ", ".join(TIMED_FORMATS) + ")")
    trace.add_argument("--format", default="auto", choices=("auto", *TIMED_FORMATS), help="default: detected")
    trace.add_argument("--bin", type=float, default=PROFILE_BIN_S, help="seconds per time-of-day bin (default 3600)")
    trace.add_argument("--scale", type=float, default=1.0, help="multiply the fitted rates (default 1)")
    trace.add_argument("--profile", action="store_true",
                       help="write the per-bin rates as a steps profile instead of Gamma arrivals")
    trace.add_argument("--out", help="write the fitted workload mapping (YAML) here")
    trace.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    trace.set_defaults(func=_cmd_trace)


def _cmd_trace(args) -> int:
    for key, value in (("--bin", args.bin), ("--scale", args.scale)):
        if not value > 0 or value == float("inf"):
            raise ConfigError("must be a positive number", key=key, value=value, allowed="a number > 0")
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    path = Path(args.path)
    if not path.is_file():
        raise ConfigError("file not found", file=str(path), has_value=False)
    trace = read_trace(path, Node({"path": str(path)}), "path", args.format)
    if len(trace) < 2:
        raise ConfigError("a trace of fewer than two requests has no rate to fit", file=str(path), has_value=False)
    fit = fit_workload(trace, args.bin)
    print(f"{trace.description}: {fit.requests:,} requests over {fit.span_s:,.1f} s")
    print(f"arrivals   mean rate {fit.rate_per_s:.4g}/s, gap CV {fit.gap_cv:.3g} (1 = Poisson, above 1 bursty)")
    rates = ", ".join(f"{r:.3g}" for r in fit.profile_rates_per_s[:48])
    more = " ..." if len(fit.profile_rates_per_s) > 48 else ""
    print(f"profile    requests/s per {args.bin:g} s bin: {rates}{more}")
    for name, length in (("prompt", fit.prompt), ("output", fit.output)):
        print(f"{name:10s} mean {length.observed_mean:,.1f} tokens, max {length.maximum:,}; lognormal fit "
              f"mean {length.mean:,.1f}, sigma {length.sigma:.3g}")
    if args.out:
        workload = {"workload": fit.to_workload(args.scale, args.profile)}
        write_file(Path(args.out), lambda p: p.write_text(yaml.safe_dump(workload, sort_keys=False)))
        print(f"\nwrote {args.out} (rates x{args.scale:g})")
    return 0
