"""How fast the simulator runs, and how much memory it holds, against bare SimPy on the same machine.

The scenario: Llama-3.1-8B on one H100, chat-like lengths (lognormal prompts of mean 1024 and outputs
of mean 256 tokens), Poisson arrivals at 80% of what the replica can serve, 100,000 requests. Each
engine is measured at 80% of its own capacity, found first by the same simulator as the steady
throughput of a saturated run: the plain engine, and a colocated Llama-3.2-1B draft with static
k = 4 and with adaptive k (the 80/50 rule), Bernoulli acceptance alpha 0.7. Bare SimPy is the floor
of any SimPy model: one process per request, each waiting on one timeout.

Every measurement runs in its own Python process (this script, re-invoked with ``--child``), so each
peak RSS is that engine's alone; ``--engine-rounds N`` runs every engine (and both trees, with
``--baseline``) N times in alternating rounds and reports each one's median run, as one run's CPU time
varies by +-15% on a shared machine; ``--alternate ROUNDS`` also runs the three engines in rotated rounds
in one process (:func:`measure_alternating`), the steadier figure for speculative against plain (no peak
RSS). ``--requests N`` shortens the runs; ``--scale`` adds a 1,000,000-
request run of the plain engine (peak RSS, wall time) and the CPU time per request of 64 replicas against
one (``--replicas-only``: that alone), on the same requests at the same load per replica, alternating
in one process (:func:`measure_replicas`); ``--calls`` counts the Python calls per iteration of both
sides of that comparison instead (:func:`replica_calls`); ``--profile ENGINE`` prints the top
of a cProfile of one run (in CPU seconds) instead. Scenarios are written as YAML and read by ``llmsim.load_scenario``,
the public API, and each measurement is timed in wall seconds and in its process's CPU seconds.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import yaml

ENGINES = {
    "plain": None,
    "static-k4": {"draft": "Llama-3.2-1B", "policy": "static", "k": 4,
                  "acceptance": {"process": "bernoulli", "alpha": 0.7}},
    "adaptive": {"draft": "Llama-3.2-1B", "policy": "adaptive", "k": 4, "k_max": 8,
                 "acceptance": {"process": "bernoulli", "alpha": 0.7}},
}
SATURATED_RATE_PER_S = 100.0        # about 6x what one replica serves: the queue never empties
SATURATED_REQUESTS = 6000
WARM_UP_REQUESTS = 300


def scenario_yaml(engine: str, rate_per_s: float, requests: int, replicas: int = 1, warmup_s: float = 0.0) -> dict:
    scenario = {
        "name": f"bench-{engine}", "seed": 2026, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
        "deployment": {"replicas": replicas},
        "engine": {"max_model_len": 16384},
        "workload": {
            "arrival": {"process": "poisson", "rate": rate_per_s},
            "num_requests": requests,
            "prompt_tokens": {"distribution": "lognormal", "mean": 1024, "sigma": 1.0, "max": 8192},
            "output_tokens": {"distribution": "lognormal", "mean": 256, "sigma": 0.8, "max": 2048},
        },
        "simulation": {"warmup": f"{warmup_s} s"},
    }
    if ENGINES[engine]:
        scenario["speculation"] = ENGINES[engine]
    return scenario


def load(data: dict):
    import llmsim
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "scenario.yaml"
        path.write_text(yaml.safe_dump(data))
        return llmsim.load_scenario(path)


def capacity_requests_per_s(engine: str) -> float:
    """Steady throughput of a saturated replica: requests finished between the warm-up and the time
    90% of them had finished (until then the queue holds more than a full batch), per second."""
    import llmsim
    warmup_s = 10.0
    result = llmsim.simulate(load(scenario_yaml(engine, SATURATED_RATE_PER_S, SATURATED_REQUESTS)))
    finish_s = result.requests.loc[result.requests["status"] == "finished", "finish_s"].sort_values()
    until_s = float(finish_s.quantile(0.9))
    return float(((finish_s >= warmup_s) & (finish_s <= until_s)).sum()) / (until_s - warmup_s)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports kilobytes


def measure_engine(engine: str, rate_per_s: float, requests: int, replicas: int) -> dict:
    """One simulation; wall time of ``simulate`` and the process's peak RSS before and after it. A short
    run first pays for what happens once per process (lazy imports, compiled kernels)."""
    import llmsim
    llmsim.simulate(load(scenario_yaml(engine, rate_per_s, WARM_UP_REQUESTS, replicas)))
    scenario = load(scenario_yaml(engine, rate_per_s, requests, replicas))
    before = peak_rss_bytes()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = llmsim.simulate(scenario)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    return {"wall_s": wall_s, "cpu_s": cpu_s, "requests": requests, "iterations": len(result.iterations),
            "rss_before": before, "rss_peak": peak_rss_bytes()}


def measure_bare_simpy(requests: int) -> dict:
    """The floor: one SimPy process per request, each yielding one timeout."""
    import numpy as np
    import simpy
    delays = np.random.default_rng(2026).exponential(1.0, requests).cumsum().tolist()

    def request(env, delay):
        yield env.timeout(delay)

    env = simpy.Environment()
    before = peak_rss_bytes()
    start, start_cpu = time.perf_counter(), time.process_time()
    for delay in delays:
        env.process(request(env, delay))
    env.run()
    return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu, "requests": requests,
            "rss_before": before, "rss_peak": peak_rss_bytes()}


def child(args) -> None:
    if args.child == "bare-simpy":
        outcome = measure_bare_simpy(args.requests)
    elif args.child == "replicas":
        outcome = measure_replicas(args.requests, args.rate, args.replicas, args.rounds)
    elif args.child == "alternate":
        outcome = measure_alternating(args.requests, json.loads(args.rates), args.alternate)
    elif args.child.startswith("capacity:"):
        outcome = {"capacity": capacity_requests_per_s(args.child.split(":", 1)[1])}
    else:
        outcome = measure_engine(args.child, args.rate, args.requests, args.replicas)
    print(json.dumps(outcome))


def run_child(kind: str, requests: int = 0, rate: float = 0.0, replicas: int = 1, extra: list[str] = (),
              tree: str | None = None) -> dict:
    """This script in a fresh interpreter, so that its peak RSS is one measurement's alone; with ``tree``
    (a checkout of another commit), measuring that tree's llmsim instead of the one installed."""
    command = [sys.executable, __file__, "--child", kind, "--requests", str(requests), "--rate", repr(rate),
               "--replicas", str(replicas), *extra]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])])
        # an editable install finds its own checkout's profiles, which the other tree may not read
        env["LLMSIM_PROFILE_PATH"] = os.path.join(tree, "hardware_profiles")
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


def tree_commit(tree: str | None) -> str:
    """The commit of the llmsim a child measures (``tree``, or the one this interpreter imports), found
    without importing it: a child's peak RSS starts from its parent's on Linux (fork, then exec)."""
    source = Path(tree) / "llmsim" if tree else Path(importlib.util.find_spec("llmsim").origin).parent
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=source).stdout.strip() or f"unknown ({source})"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def per_s(row: dict, clock: str) -> float:
    """Requests per second of ``clock``: wall_s, or cpu_s (this process's own CPU time, which other
    processes on a shared machine disturb much less)."""
    return row["requests"] / row[clock]


def measure_engines(args, capacities: dict[str, float], trees: dict[str, str | None]) -> dict[str, dict[str, dict]]:
    """Every engine and bare SimPy, for each tree, in ``args.engine_rounds`` rounds that alternate trees and
    engines (so a busy spell on the shared machine falls on all of them); each one's row is that of its
    median CPU seconds (the lower middle one for an even count)."""
    runs: dict[str, dict[str, list[dict]]] = {name: {engine: [] for engine in (*ENGINES, BARE)} for name in trees}
    for _ in range(args.engine_rounds):
        for name, tree in trees.items():
            for engine in ENGINES:
                runs[name][engine].append(run_child(engine, args.requests, args.load * capacities[engine], tree=tree))
            runs[name][BARE].append(run_child("bare-simpy", args.requests))
    return {name: {engine: sorted(rows, key=lambda row: row["cpu_s"])[(len(rows) - 1) // 2]
                   for engine, rows in engines.items()} for name, engines in runs.items()}


BARE = "bare SimPy (1 timeout)"


def engine_figures(rows: dict[str, dict]) -> dict[str, float]:
    """The figures the targets are stated in (CPU seconds: other processes disturb them least)."""
    plain = rows["plain"]
    figures = {"plain / bare SimPy (requests per CPU s)": per_s(plain, "cpu_s") / per_s(rows[BARE], "cpu_s")}
    for engine in ("static-k4", "adaptive"):
        figures[f"{engine} / plain (requests per CPU s)"] = per_s(rows[engine], "cpu_s") / per_s(plain, "cpu_s")
    for engine in ENGINES:
        figures[f"{engine}: simulated requests per CPU s"] = per_s(rows[engine], "cpu_s")
        figures[f"{engine}: iterations (engine events) per CPU s"] = rows[engine]["iterations"] / rows[engine]["cpu_s"]
    figures["bare SimPy: requests (events) per CPU s"] = per_s(rows[BARE], "cpu_s")
    return figures


def report_engines(args, capacities: dict[str, float], rows: dict[str, dict]) -> None:
    print(f"{'':<22}{'capacity':>9}{'offered':>8}{'iterations':>11}{'wall s':>8}{'req/wall s':>11}{'req/CPU s':>10}"
          f"{'peak RSS':>9}{'growth':>8}{'per req':>9}")
    for engine, row in rows.items():
        grown = row["rss_peak"] - row["rss_before"]
        load = (f"{capacities[engine]:>9.2f}{args.load * capacities[engine]:>8.2f}{row['iterations']:>11,}"
                if engine in capacities else " " * 28)
        print(f"{engine:<22}{load}{row['wall_s']:>8.2f}{per_s(row, 'wall_s'):>11,.0f}{per_s(row, 'cpu_s'):>10,.0f}"
              f"{gigabytes(row['rss_peak']):>9}{gigabytes(grown):>8}{grown / row['requests']:>7,.0f} B")
    plain, bare = rows["plain"], rows[BARE]
    ratio = {clock: per_s(plain, clock) / per_s(bare, clock) for clock in ("wall_s", "cpu_s")}
    print(f"\nplain / bare SimPy: {ratio['wall_s']:.4f} per wall s, {ratio['cpu_s']:.4f} per CPU s (requests)")
    for engine in ("static-k4", "adaptive"):
        row = rows[engine]
        print(f"{engine} / plain: {per_s(row, 'wall_s') / per_s(plain, 'wall_s'):.2f} per wall s, "
              f"{per_s(row, 'cpu_s') / per_s(plain, 'cpu_s'):.2f} per CPU s (requests); "
              f"{row['rss_peak'] / plain['rss_peak']:.2f} (peak RSS)")


def report_comparison(figures: dict[str, dict[str, float]]) -> None:
    """Each figure of the previous tree and of this one, side by side."""
    (old_name, old), (new_name, new) = figures.items()
    print(f"\n{'figure':<52}{old_name:>16}{new_name:>16}{'new / old':>11}")
    for name in new:
        if name in old:
            print(f"{name:<52}{old[name]:>16,.3f}{new[name]:>16,.3f}{new[name] / old[name]:>11.2f}")


def report_scale(args, capacity: float, tree: str | None = None) -> dict[str, float]:
    big = run_child("plain", 1_000_000, args.load * capacity, tree=tree)
    print(f"\n1,000,000 requests, plain engine: {big['wall_s']:.1f} wall s, {big['cpu_s']:.1f} CPU s, "
          f"peak RSS {gigabytes(big['rss_peak'])} "
          f"({(big['rss_peak'] - big['rss_before']) / big['requests']:,.0f} B per request above the start)")
    return {"1,000,000 requests: CPU s": big["cpu_s"], **report_replicas(args, capacity, tree)}


def report_replicas(args, capacity: float, tree: str | None = None) -> dict[str, float]:
    """64 replicas against one on the same requests at the same load per replica (:func:`measure_replicas`)."""
    per_replica = args.per_replica
    outcome = run_child("replicas", per_replica, args.load * capacity, 64, ["--rounds", str(args.rounds)], tree=tree)
    one, many = outcome["one"], outcome["many"]
    print(f"\n64 replicas against one ({tree_commit(tree)}), {args.rounds} alternating rounds in one process "
          f"(CPU seconds), {per_replica:,} requests per replica at {args.load:.0%} of its capacity:")
    for name, rows in (("1 replica x 64 traces", one), ("64 replicas x 1 trace", many)):
        us = [1e6 * row["cpu_s"] / row["requests"] for row in rows]
        print(f"  {name}: {median(us):.1f} CPU us per request (rounds {', '.join(f'{u:.1f}' for u in us)}), "
              f"{rows[0]['iterations'] / rows[0]['requests']:.3f} iterations per request, "
              f"{median(us) * rows[0]['requests'] / rows[0]['iterations']:.2f} CPU us per iteration")
    per_request = [m["cpu_s"] / o["cpu_s"] for o, m in zip(one, many)]       # same requests on both sides
    per_iteration = [(m["cpu_s"] / m["iterations"]) / (o["cpu_s"] / o["iterations"]) for o, m in zip(one, many)]
    print(f"64 replicas / 1 replica, CPU per request: median {median(per_request):.2f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in per_request)}); per iteration: median {median(per_iteration):.2f}")
    return {"64 replicas / 1 replica (CPU per request)": median(per_request),
            "64 replicas: simulated requests per CPU s": median(m["requests"] / m["cpu_s"] for m in many)}


def measure_replicas(per_replica: int, rate_per_s: float, replicas: int, rounds: int) -> dict:
    """``replicas`` replicas against one, in this process, alternating, each side timed in CPU seconds.

    Both sides simulate the same requests at the same load per replica: ``replicas`` replicas
    get ``replicas`` times the arrival rate and ``replicas x per_replica`` requests; one replica
    serves ``replicas`` traces of ``per_replica`` requests (one per seed, run after run). So each
    replica's batches are as large on both sides and each pays its start and its drain (the last
    long outputs decoded in small batches) on as many requests, and the one-replica side is the
    mean of many traces, not one trace's luck (one 3,000-request trace ran 3.20 iterations per
    request where 16 seeds average 3.52 +- 0.06). Alternating rounds in one process share the
    machine's state; the median of the rounds' ratios is the figure.
    """
    import llmsim
    sides = {"one": [], "many": []}
    scenarios_of = replica_sides(per_replica, rate_per_s, replicas)
    for _ in range(rounds):
        for side, scenarios in scenarios_of.items():
            cpu_s, iterations = 0.0, 0
            for scenario in scenarios:
                start = time.process_time()
                result = llmsim.simulate(scenario)
                cpu_s += time.process_time() - start
                iterations += len(result.iterations)
                del result
            sides[side].append({"cpu_s": cpu_s, "requests": per_replica * replicas, "iterations": iterations})
    return sides


def replica_sides(per_replica: int, rate_per_s: float, replicas: int) -> dict[str, list]:
    """The scenarios of :func:`measure_replicas`' two sides, after a short run that pays for what happens
    once per process: ``one``, ``replicas`` one-replica traces (one per seed); ``many``, one run of
    ``replicas`` replicas."""
    import llmsim
    llmsim.simulate(load(scenario_yaml("plain", rate_per_s * replicas, WARM_UP_REQUESTS, replicas)))
    singles = []
    for index in range(replicas):
        data = scenario_yaml("plain", rate_per_s, per_replica)
        data["seed"] += index
        singles.append(load(data))
    return {"one": singles, "many": [load(scenario_yaml("plain", rate_per_s * replicas, per_replica * replicas,
                                                         replicas))]}


def replica_calls(per_replica: int, rate_per_s: float, replicas: int) -> None:
    """Python calls per iteration (cProfile's counts over the run's iterations) on both sides of
    :func:`measure_replicas`, for every function whose count differs by more than 0.05 between them,
    and in all: work that grows with the replicas per iteration or per arrival shows here."""
    import llmsim
    per_iteration = {}
    for side, scenarios in replica_sides(per_replica, rate_per_s, replicas).items():
        profiler, iterations = cProfile.Profile(), 0
        for scenario in scenarios:
            profiler.enable()
            result = llmsim.simulate(scenario)
            profiler.disable()
            iterations += len(result.iterations)
        calls = {pstats.func_std_string(key): row[1] for key, row in pstats.Stats(profiler).stats.items()}
        per_iteration[side] = {name: count / iterations for name, count in calls.items()}
    one, many = per_iteration["one"], per_iteration["many"]
    print(f"\nPython calls per iteration, {replicas} replicas x {per_replica:,} requests against one replica x "
          f"{replicas} traces:\n{'1 replica':>10}{f'{replicas} replicas':>14}  function")
    for name in sorted(set(one) | set(many), key=lambda name: many.get(name, 0) - one.get(name, 0), reverse=True):
        if abs(many.get(name, 0) - one.get(name, 0)) > 0.05:
            print(f"{one.get(name, 0):>10.3f}{many.get(name, 0):>14.3f}  {name}")
    print(f"{sum(one.values()):>10.2f}{sum(many.values()):>14.2f}  all")


def measure_alternating(requests: int, rates_per_s: dict[str, float], rounds: int) -> dict[str, list[float]]:
    """Every engine's CPU seconds in ``rounds`` rounds in this one process, the order rotated each round, so
    that a busy spell on a shared machine, and the process's warm state, fall on every engine alike."""
    import llmsim
    scenarios = {}
    for engine, rate_per_s in rates_per_s.items():
        llmsim.simulate(load(scenario_yaml(engine, rate_per_s, WARM_UP_REQUESTS)))
        scenarios[engine] = load(scenario_yaml(engine, rate_per_s, requests))
    cpu_s: dict[str, list[float]] = {engine: [] for engine in scenarios}
    order = list(scenarios)
    for index in range(rounds):
        for engine in order[index % len(order):] + order[:index % len(order)]:
            start = time.process_time()
            result = llmsim.simulate(scenarios[engine])
            cpu_s[engine].append(time.process_time() - start)
            del result
    return cpu_s


def report_alternating(args, capacities: dict[str, float], tree: str | None = None) -> dict[str, float]:
    """The speculative engines against plain from :func:`measure_alternating`: the median round's CPU seconds each."""
    rates = {engine: args.load * capacities[engine] for engine in ENGINES}
    cpu_s = run_child("alternate", args.requests, extra=["--rates", json.dumps(rates), "--alternate",
                                                          str(args.alternate)], tree=tree)
    plain = median(cpu_s["plain"])
    print(f"\n{args.alternate} rotated rounds in one process ({tree_commit(tree)}), {args.requests:,} requests each, "
          f"median CPU s: " + ", ".join(f"{engine} {median(runs):.3f}" for engine, runs in cpu_s.items()))
    figures = {}
    for engine in ("static-k4", "adaptive"):
        ratios = [p / e for p, e in zip(cpu_s["plain"], cpu_s[engine])]
        figures[f"{engine} / plain, one process (requests per CPU s)"] = plain / median(cpu_s[engine])
        print(f"{engine} / plain: {plain / median(cpu_s[engine]):.3f} per CPU s (requests); rounds "
              f"{', '.join(f'{r:.2f}' for r in ratios)}")
    return figures


def profile(args, capacity: float) -> None:
    import llmsim
    llmsim.simulate(load(scenario_yaml(args.profile, args.load * capacity, WARM_UP_REQUESTS)))
    scenario = load(scenario_yaml(args.profile, args.load * capacity, args.requests))
    profiler = cProfile.Profile(time.process_time)       # CPU seconds: other processes share the cores
    profiler.enable()
    llmsim.simulate(scenario)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of each engine's capacity (default 0.8)")
    parser.add_argument("--scale", action="store_true", help="also 1,000,000 requests, and 64 replicas against 1")
    parser.add_argument("--replicas-only", action="store_true",
                        help="only 64 replicas against 1 (with --scale's method), no other measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of 64 replicas against 1")
    parser.add_argument("--engine-rounds", type=int, default=1,
                        help="alternating rounds of every engine (and tree), each figure the median's (default 1)")
    parser.add_argument("--per-replica", type=int, default=5000,
                        help="requests per replica when comparing 64 replicas against 1 (default 5,000)")
    parser.add_argument("--calls", action="store_true",
                        help="only Python calls per iteration of 64 replicas against 1 (cProfile counts)")
    parser.add_argument("--profile", choices=list(ENGINES), help="print a cProfile of one engine's run instead")
    parser.add_argument("--baseline", metavar="TREE",
                        help="a checkout of the previous commit (git worktree add TREE COMMIT): its figures are "
                             "measured too, on the same workload, and printed beside this tree's")
    parser.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                        help="also the speculative engines against plain in ROUNDS rotated rounds in one process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rates", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    trees = {tree_commit(args.baseline): args.baseline, tree_commit(None): None} if args.baseline else {
        tree_commit(None): None}
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"commits {', '.join(trees)}; load average {os.getloadavg()[0]:.2f}")
    if args.profile:
        profile(args, run_child(f"capacity:{args.profile}")["capacity"])
        return
    if args.calls:
        replica_calls(args.per_replica, args.load * run_child("capacity:plain")["capacity"], 64)
        return
    # Both trees simulate the same workload: the offered load comes from this tree's capacities.
    capacities = {engine: run_child(f"capacity:{engine}")["capacity"] for engine in ENGINES}
    figures: dict[str, dict[str, float]] = {name: {} for name in trees}
    if not args.replicas_only:
        print(f"{args.requests:,} requests at {args.load:.0%} of each engine's capacity (req/s), median of "
              f"{args.engine_rounds} round(s)")
        for name, rows in measure_engines(args, capacities, trees).items():
            print(f"\n{name}:")
            report_engines(args, capacities, rows)
            figures[name].update(engine_figures(rows))
    if args.alternate:
        for name, tree in trees.items():
            figures[name].update(report_alternating(args, capacities, tree))
    if args.scale or args.replicas_only:
        for name, tree in trees.items():
            figures[name].update(report_replicas(args, capacities["plain"], tree) if args.replicas_only
                                 else report_scale(args, capacities["plain"], tree))
    if len(trees) == 2:
        report_comparison(figures)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f} (other processes share the cores: compare ratios)")


if __name__ == "__main__":
    main()
