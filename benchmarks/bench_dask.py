"""What a sweep costs per point on a Dask LocalCluster of 1, 2 and 4 workers, beside a local process
pool of as many workers and this process alone: CPU seconds per point (every worker's and this
process's) and wall seconds; a cluster's start-up and first-use costs (imports, compiled kernels:
paid once per worker, as by a long-lived cluster) are shown apart.

The grid is ``scenarios/grids/rate-k.yaml`` over ``scenarios/llama3-8b-h100-chat.yaml`` (16 points
of 800 requests; ``--requests`` changes the count). CPU seconds per point stay flat as workers are
added when scaling out wastes nothing; wall seconds fall only as far as idle cores allow (the
machine's load is printed). Run it with ``python benchmarks/bench_dask.py`` (needs the
``distributed`` extra).
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from pathlib import Path

import yaml

import llmsim

REPO = Path(__file__).resolve().parent.parent


def _cpu_s() -> float:
    """This process's CPU seconds and those of its children that have ended (a process pool's)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _worker_cpu_s() -> float:
    return time.process_time()


def _workers_cpu_s(client) -> float:
    return sum(client.run(_worker_cpu_s).values())


def dask(grid: dict, workers: int, args) -> tuple[float, float, int, float, float]:
    """(CPU s, wall s, points, CPU s of starting and warming the cluster, the workers' share of the
    CPU s) of the sweep on a fresh LocalCluster of ``workers`` processes (the scheduler and the
    client in this process: their share grows with wall time, heartbeats included). Warming: one small
    speculative point per worker first, so each worker has imported llmsim and compiled the
    speculative kernels (numba) before the sweep, as a long-lived cluster has; the sweep's CPU
    seconds are the steady cost of a point."""
    from distributed import Client, LocalCluster

    start_cpu = _cpu_s()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(workers)
        warm = {**grid, "speculation.k": [4], "workload.arrival.rate": [4.0 + i for i in range(workers)],
                "workload.num_requests": [20]}
        llmsim.sweep(args.scenario, warm, engine="dask", client=client)
        own, workers_before = _cpu_s(), _workers_cpu_s(client)
        start = time.perf_counter()
        rows = llmsim.sweep(args.scenario, grid, engine="dask", client=client)
        wall = time.perf_counter() - start
        worker_cpu = _workers_cpu_s(client) - workers_before
        return (_cpu_s() - own + worker_cpu, wall, _checked(rows), own + workers_before - start_cpu, worker_cpu)


def local(grid: dict, engine: str, workers: int, args) -> tuple[float, float, int, float]:
    """(CPU s, wall s, points, 0, 0) of the sweep in this process or on a local process pool (its
    workers' CPU counted once the pool has shut down)."""
    start_cpu, start = _cpu_s(), time.perf_counter()
    rows = llmsim.sweep(args.scenario, grid, engine=engine, workers=workers)
    return _cpu_s() - start_cpu, time.perf_counter() - start, _checked(rows), 0.0, 0.0


def _checked(rows) -> int:
    failed = rows[rows["error"] != ""]
    if len(failed):
        raise SystemExit(f"{len(failed)} points failed: {failed['error'].iloc[0]}")
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios/llama3-8b-h100-chat.yaml"))
    parser.add_argument("--grid", default=str(REPO / "scenarios/grids/rate-k.yaml"))
    parser.add_argument("--requests", type=int, default=800, help="requests per point (default 800)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    grid = yaml.safe_load(Path(args.grid).read_text())
    grid["workload.num_requests"] = [args.requests]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    # Warm-up: first-use costs (imports, compiled kernels) out of the way, as in a warmed cluster.
    local({**grid, "speculation.k": [4], "workload.arrival.rate": [4.0], "workload.num_requests": [20]}, "serial", 1,
          args)
    cpu, wall, points, _, _ = local(grid, "serial", 1, args)
    serial = cpu / points
    print(f"{'serial, this process':<26} {points} points: {serial:6.2f} CPU s/point  {wall:7.1f} s wall")
    for workers in args.workers:
        runs = [(f"dask LocalCluster x{workers}", dask(grid, workers, args))]
        if workers > 1:                     # one worker is this process (llmsim.sweep runs it serially)
            runs.append((f"process pool x{workers}", local(grid, "processes", workers, args)))
        for label, (cpu, wall, points, started, worker_cpu) in runs:
            print(f"{label:<26} {points} points: {cpu / points:6.2f} CPU s/point  {wall:7.1f} s wall  "
                  f"efficiency {serial / (cpu / points):4.2f} (serial CPU per point / this)"
                  + (f"; workers alone {worker_cpu / points:.2f} CPU s/point (efficiency "
                     f"{serial / (worker_cpu / points):.2f}); starting and warming the cluster took {started:.1f} "
                     "CPU s more" if started else ""), flush=True)


if __name__ == "__main__":
    main()
