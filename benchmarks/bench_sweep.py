"""How fast sweeps run: sweep points per minute and simulated requests per wall second.

The shipped grid ``scenarios/grids/rate-k.yaml`` (draft length k in 0, 2, 4, 6 times four
arrival rates, 800 requests each, Llama-3.1-8B on one H100 with a colocated Llama-3.2-1B
draft) over ``scenarios/llama3-8b-h100-chat.yaml``, on a local process pool of
``--workers`` processes (default: every CPU), then the same points one at a time in this
process for the speed-up. Wall time includes starting the pool and validating every point.
Run it with ``python benchmarks/bench_sweep.py`` (``--no-serial`` skips the serial run,
``--engine dask`` measures a Dask LocalCluster instead of the process pool).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import llmsim

REPO = Path(__file__).resolve().parent.parent


def timed(engine: str, workers: int, args) -> tuple[float, int, int]:
    """(wall seconds, points, simulated requests) of one sweep."""
    start = time.perf_counter()
    rows = llmsim.sweep(args.scenario, args.grid, engine=engine, workers=workers)
    wall = time.perf_counter() - start
    failed = rows[rows["error"] != ""]
    if len(failed):
        raise SystemExit(f"{len(failed)} points failed: {failed['error'].iloc[0]}")
    return wall, len(rows), int(rows["requests.arrived"].sum())


def report(label: str, wall: float, points: int, requests: int) -> None:
    print(f"{label:<28} {points} points in {wall:6.1f} s = {60 * points / wall:6.1f} points/min, "
          f"{requests / wall:8,.0f} simulated requests/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios/llama3-8b-h100-chat.yaml"))
    parser.add_argument("--grid", default=str(REPO / "scenarios/grids/rate-k.yaml"))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--engine", choices=("processes", "dask"), default="processes")
    parser.add_argument("--no-serial", action="store_true")
    args = parser.parse_args()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    parallel = timed(args.engine, args.workers, args)
    report(f"{args.engine}, {args.workers} workers", *parallel)
    if not args.no_serial:
        serial = timed("serial", 1, args)
        report("serial, 1 process", *serial)
        print(f"speed-up {serial[0] / parallel[0]:.2f}x on {args.workers} workers")


if __name__ == "__main__":
    main()
