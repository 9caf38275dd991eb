"""Time ``llmsim report`` on a shipped scenario with four candidate chips.

    python benchmarks/bench_report.py [--scenario S] [--target-rate R] [--hardware H ...] [--requests N]

Prints the wall time and CPU time of the whole report and of each stage, and where it wrote the
files (a temporary folder). The default is the chat scenario at 60 requests/s on H100-SXM, H200,
MI300X and CS-3 with the report's defaults (2 seeds, up to 2,000 requests per run, all cores).
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from llmsim.report.build import ReportBuilder, traffic_from_rate
from llmsim.report.render import to_html, to_markdown

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process and of its finished worker processes (each pool is joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios" / "llama3-8b-h100-chat.yaml"))
    parser.add_argument("--target-rate", type=float, default=60.0)
    parser.add_argument("--hardware", nargs="+", default=["H100-SXM", "H200", "MI300X", "CS-3"])
    parser.add_argument("--requests", type=int)
    parser.add_argument("--workers", type=int)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    started, (own_cpu, workers_cpu) = time.perf_counter(), cpu_seconds()
    builder = ReportBuilder(args.scenario, traffic_from_rate(args.target_rate), hardware=args.hardware,
                            requests=args.requests, workers=args.workers, command="benchmarks/bench_report.py")
    report = builder.build()
    out = Path(tempfile.mkdtemp(prefix="bench-report-"))
    (out / "report.html").write_text(to_html(report))
    (out / "report.md").write_text(to_markdown(report))
    wall = time.perf_counter() - started
    own_after, workers_after = cpu_seconds()
    own_cpu, workers_cpu = own_after - own_cpu, workers_after - workers_cpu
    print(f"machine: {os.cpu_count()} cores, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
          "(1-minute averages: other processes' share of the cores)")
    print(f"report of {Path(args.scenario).name} at {args.target_rate:g}/s on {', '.join(args.hardware)}: "
          f"{wall:.1f} s wall, {own_cpu + workers_cpu:.1f} CPU s ({own_cpu:.1f} in this process, "
          f"{workers_cpu:.1f} in worker processes; {builder.requests} requests per run, seeds {builder.seeds})")
    for stage, seconds in builder.stage_seconds.items():
        print(f"  {stage:12s} {seconds:6.1f} s")
    recommended = report.table("deployment").rows[0]
    print(f"recommended: {recommended[1]} {recommended[2]} x {recommended[3]} replicas; wrote {out}")


if __name__ == "__main__":
    main()
