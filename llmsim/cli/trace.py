"""``llmsim trace TRACE``: what a trace holds, and a synthetic workload fitted to it.

Prints the trace's size, span, mean rate, burstiness (the CV of the gaps between
arrivals), its rate per hour and the lognormal fitted to each length column; ``--out``
writes the fitted ``workload`` mapping as YAML (``--scale 2``: twice the traffic;
``--profile``: the hourly rates as a ``steps`` arrival profile instead of Gamma arrivals).
``--bin`` must leave at most ``MAX_PROFILE_BINS`` bins over the trace, and ``--scale`` rates
that a scenario takes (checked before anything is allocated or written); a trace whose
requests all arrive at one instant has no rate to fit.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from llmsim.cli.options import number_flag
from llmsim.cli.outputs import OVERWRITE_HELP, refuse_to_replace, write_file
from llmsim.config.limits import MAX_NUMBER, MAX_QUANTITY
from llmsim.config.reader import Node
from llmsim.workload.trace_fit import MAX_PROFILE_BINS, PROFILE_BIN_S, fit_workload, profile_bins
from llmsim.workload.trace_formats import TIMED_FORMATS, read_trace
from llmsim.errors import ConfigError


def configure_trace(trace) -> None:
    trace.add_argument("path", help="a trace file (formats: " + ", ".join(TIMED_FORMATS) + ")")
    trace.add_argument("--format", default="auto", choices=("auto", *TIMED_FORMATS), help="default: detected")
    trace.add_argument("--bin", type=number_flag(0.0, MAX_QUANTITY["duration"], exclusive_minimum=True),
                       default=PROFILE_BIN_S, help="seconds per time-of-day bin (default 3600; at most "
                                                   f"{MAX_PROFILE_BINS:,} bins over the trace)")
    trace.add_argument("--scale", type=number_flag(0.0, MAX_NUMBER, exclusive_minimum=True), default=1.0,
                       help="multiply the fitted rates (default 1; the rates written stay within what a "
                            "scenario takes)")
    trace.add_argument("--profile", action="store_true",
                       help="write the per-bin rates as a steps profile instead of Gamma arrivals")
    trace.add_argument("--out", help="write the fitted workload mapping (YAML) here")
    trace.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    trace.set_defaults(func=_cmd_trace)


def _cmd_trace(args) -> int:
    if args.out:
        refuse_to_replace([Path(args.out)], args.overwrite)
    path = Path(args.path)
    trace = read_trace(path, Node({"path": str(path)}), "path", args.format)
    if len(trace) < 2:
        raise ConfigError("a trace of fewer than two requests has no rate to fit", file=str(path), has_value=False)
    span_s = float(trace.arrival_s[-1] - trace.arrival_s[0])
    if span_s == 0:
        raise ConfigError(f"all {len(trace):,} requests arrive at the same time: there is no rate to fit",
                          file=str(path), has_value=False, allowed="a trace whose arrival times differ")
    if profile_bins(span_s, args.bin) > MAX_PROFILE_BINS:
        raise ConfigError(f"{span_s:g} s of trace in bins of {args.bin:g} s is more than {MAX_PROFILE_BINS:,} bins",
                          key="--bin", value=args.bin,
                          allowed=f"a bin of at least {span_s / MAX_PROFILE_BINS:.6g} s for this trace")
    fit = fit_workload(trace, args.bin)
    _check_scale(args.scale, fit)
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


def _check_scale(scale: float, fit) -> None:
    """The scaled rates must be ones a scenario takes: the mean at least the rate that brings the
    trace's requests within the longest simulated window, no rate above the largest rate."""
    low = fit.requests / MAX_QUANTITY["duration"] / fit.rate_per_s
    high = MAX_QUANTITY["rate"] / max(fit.rate_per_s, *fit.profile_rates_per_s)
    if not low <= scale <= high:
        raise ConfigError(f"scales the trace's mean rate of {fit.rate_per_s:.6g}/s to {scale * fit.rate_per_s:.6g}/s",
                          key="--scale", value=scale,
                          allowed=f"a factor from {low:.6g} to {high:.6g} for this trace (rates from "
                                  f"{fit.requests / MAX_QUANTITY['duration']:.3g}/s to "
                                  f"{MAX_QUANTITY['rate']:g}/s)")
