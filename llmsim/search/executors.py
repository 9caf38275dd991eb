"""Where a sweep's points run: in this process, a local process pool, or a Dask cluster.

Each executor takes (point id, scenario) jobs and a top-level function (picklable, so a
worker process can call it) and yields (point id, outcome) as points finish, with a
progress bar. A worker that dies (killed, out of memory) fails only its own points;
Ctrl-C stops the running ones at once and drops the queued ones. Pool workers die with the
process that started them however it dies, SIGKILL included (:func:`_init_worker`), so a
killed sweep leaves no simulation running on.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from llmsim.config.policies import ExecutorKind
from llmsim.config.progress import Progress
from llmsim.errors import ConfigError
from llmsim.scenario.scenario import Scenario

PR_SET_PDEATHSIG = 1            # from <linux/prctl.h>
SCHEDULER_TIMEOUT_S = 10.0      # to reach a Dask scheduler by address before giving up (Dask's default: 30 s)


# What a pool costs and what a point's simulation is worth, for choosing the pool or this process
# (:func:`pool_workers`). A worker imports llmsim before its first point: 1.7-1.9 CPU s measured on
# the 2-core development machine. The resource guard's estimate of a point's events
# (:func:`llmsim.sim.resources.estimate_run`) runs at 40,000 events per CPU s on the shipped
# speculative 70B scenario and 130,000-140,000 on the chat and TP8 ones: the slowest is taken, so
# the estimate of a grid's work is high and the pool is chosen when in doubt.
WORKER_START_CPU_S = 2.0
EVENTS_PER_CPU_S = 40_000


def pool_workers(jobs: list[tuple[str, Scenario]], requested: int | None) -> tuple[int, str | None]:
    """How many pool processes a sweep of ``jobs`` starts (1: it runs in this process), and why when
    that is not what was asked. ``requested`` (``workers``) is obeyed; by default the pool gets the
    CPUs left idle (this process's own included: it waits while the pool works) and is started only
    when it can pay: when the grid's estimated work ``W`` exceeds ``start x n / (n - 1)`` for ``n``
    workers (``start``: one worker's start-up; serial takes ``W``, the pool ``start + W / n``)."""
    if requested is not None:
        return max(1, requested), None
    from llmsim.sim.resources import estimate_run

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    idle = min(cpus, len(jobs), max(1, int(cpus - load + 1)))
    if idle < 2:
        return 1, (f"{len(jobs)} points in this process: {cpus} CPU{'s' * (cpus > 1)} with a load of {load:.1f}, "
                   "none idle for a pool to use")
    work_s = sum(estimate_run(scenario).events for _, scenario in jobs) / EVENTS_PER_CPU_S
    if work_s <= WORKER_START_CPU_S * idle / (idle - 1):
        return 1, (f"{len(jobs)} points in this process: about {work_s:.1f} CPU s of simulation, less than "
                   f"starting a pool of {idle} workers saves")
    return idle, None


def execute(jobs: list[tuple[str, Scenario]], evaluate: Callable[[Scenario], dict], engine: ExecutorKind,
            workers: int | None, client, progress: Progress):
    """Yield (point_id, ``evaluate(scenario)``) as points finish; ``progress`` is told of every job
    (``add``) and advanced one step as each finishes. ``processes`` without ``workers`` runs the
    points in this process when a pool cannot pay (:func:`pool_workers`), and says so (``note``)."""
    if not jobs:
        return
    if engine is ExecutorKind.PROCESSES:
        workers, why = pool_workers(jobs, workers)
        if why is not None:
            progress.note(why)
    workers = max(1, workers or os.cpu_count() or 1)
    progress.add(len(jobs))
    if engine is ExecutorKind.SERIAL or (engine is ExecutorKind.PROCESSES and (workers == 1 or len(jobs) == 1)):
        for point_id, scenario in jobs:
            yield point_id, evaluate(scenario)
            progress.advance()
    elif engine is ExecutorKind.PROCESSES:
        pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), initializer=_init_worker,
                                   initargs=(os.getpid(),))
        pending = {pool.submit(evaluate, scenario): point_id for point_id, scenario in jobs}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    yield pending.pop(future), _outcome(future)
                    progress.advance()
        except BaseException:
            # Ctrl-C, or the caller stopped: drop the queued points and stop the running ones
            # at once (what finished has already been handed over).
            _terminate(pool)
            raise
        pool.shutdown()
    else:
        yield from _execute_dask(jobs, evaluate, workers, client, progress)


def error_text(error: BaseException) -> str:
    """An error as one line of text, for a row's ``error``."""
    return f"{type(error).__name__}: {error}".replace("\n", " ")


def _outcome(future) -> dict:
    """A finished future's metrics; a worker that died (killed, out of memory) fails only its points."""
    try:
        return future.result()
    except Exception as error:
        return {"error": error_text(error)}


def _init_worker(parent_pid: int) -> None:
    """A pool worker leaves Ctrl-C to its parent, which stops it (a simulation cut short is not a
    result), and dies with the parent.

    On Linux the kernel sends the worker SIGKILL when its parent exits (``PR_SET_PDEATHSIG``),
    at once and whatever the worker is doing; elsewhere a daemon thread checks every 0.2 s whether
    the worker has been orphaned. A parent gone before either was set up is caught by the
    ``getppid`` check that follows.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()       # the sweep, or a fork server started by it
    if not _kill_with_parent():
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="llmsim-parent-watch").start()
    if os.getppid() != parent or not _alive(parent_pid):
        os._exit(1)


def _kill_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(pool: ProcessPoolExecutor) -> None:
    processes = list((pool._processes or {}).values())    # no public handle before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


def _connect(client_class, address: str):
    """A client of the scheduler at ``address``; unreachable or malformed: ConfigError (exit 2)."""
    try:
        return client_class(address, timeout=SCHEDULER_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as error:
        raise ConfigError(f"cannot reach a Dask scheduler there within {SCHEDULER_TIMEOUT_S:g} s ({error})",
                          key="--scheduler", value=address,
                          allowed="the address of a running scheduler, e.g. tcp://host:8786, or no --scheduler "
                                  "for a local cluster") from None


def _execute_dask(jobs, evaluate, workers: int, client, progress: Progress):
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ConfigError("the dask engine needs the distributed extra", key="engine", value="dask",
                          allowed='processes, serial, or pip install "llmsim[distributed]"') from None
    own = client is None or isinstance(client, str)
    cluster = None
    if client is None:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    elif isinstance(client, str):          # a running scheduler's address
        client = _connect(Client, client)
    try:
        ids = [point_id for point_id, _ in jobs]
        futures = client.map(evaluate, [scenario for _, scenario in jobs], key=[f"llmsim-{i}" for i in ids],
                             pure=False)
        by_key = dict(zip((f.key for f in futures), ids))
        try:
            for future in as_completed(futures):
                yield by_key[future.key], _outcome(future)
                progress.advance()
        except BaseException:
            client.cancel(futures)
            raise
    finally:
        if own:
            client.close()
        if cluster is not None:
            cluster.close()
