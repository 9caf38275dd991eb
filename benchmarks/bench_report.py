"""Time ``llmsim report`` on a shipped scenario with four candidate chips, beside the previous tree's.

    python benchmarks/bench_report.py [--scenario S] [--target-rate R] [--hardware H ...] [--requests N]
                                      [--workers W] [--base COMMIT] [--rounds N]

Alone: prints the wall time and CPU time of the whole report and of each stage, and where it wrote the
files (a temporary folder). The default is the chat scenario at 60 requests/s on H100-SXM, H200,
MI300X and CS-3 with the report's defaults (2 seeds, up to 2,000 requests per run, all cores).

``--base COMMIT`` (``main``, a hash): the previous tree is checked out at COMMIT into a temporary ``git
worktree``, and each (round, tree) builds the report in a child process importing that tree; rounds
interleave the two trees. A child's CPU time is its user + system time, its worker processes included
(``os.wait4``); a stage's is the same counted around the stage. Printed: every round, the median and
range of each tree's CPU seconds, the median of each stage, and the report's answers (the recommended
deployment, each chip's cheapest layout, the settings, load, capacity, peak and sensitivity tables)
cell by cell: the cells that differ between the trees, or that they are the same.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tables that hold the report's answers, compared cell by cell between the trees.
ANSWERS = ("deployment", "candidates", "layouts", "settings", "load-points", "capacity", "peak", "sensitivity")

# Runs in a child process with the tree to measure first on sys.path; prints one JSON line.
CHILD = r'''
import json, resource, sys
from llmsim.report.build import STAGES, ReportBuilder, traffic_from_rate
scenario, rate, chips, requests, workers, tables = json.loads(sys.argv[1])

def cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

builder = ReportBuilder(scenario, traffic_from_rate(rate), hardware=chips, requests=requests, workers=workers,
                        command="benchmarks/bench_report.py")
stages = {}
for stage in STAGES:
    def timed(run=getattr(builder, "_" + stage), stage=stage):
        started = cpu()
        run()
        stages[stage] = cpu() - started
    setattr(builder, "_" + stage, timed)
report = builder.build()
found = {}
for key in tables:
    try:
        table = report.table(key)
    except KeyError:
        continue
    found[key] = {"columns": table.columns, "rows": table.rows}
print(json.dumps({"stages": stages, "tables": found}))
'''


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process and of its finished worker processes (each pool is joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def run_child(tree: Path, args: argparse.Namespace) -> tuple[float, dict]:
    """One report built by ``tree``'s code in a child process: (its CPU seconds, workers included; its JSON)."""
    spec = json.dumps([str(Path(args.scenario).resolve()), args.target_rate, args.hardware, args.requests,
                       args.workers, ANSWERS])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-c", CHILD, spec], cwd=tree, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        if code != 0 or not lines:
            raise SystemExit(f"the report failed in {tree} (exit {code}):\n{err.read()[-3000:]}")
    return usage.ru_utime + usage.ru_stime, json.loads(lines[-1])


def differences(old: dict, new: dict) -> list[str]:
    """The answer cells that differ between two trees' tables, as lines 'table / row / column: old -> new'."""
    lines = []
    for key in ANSWERS:
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            if a != b:
                lines.append(f"{key}: only in the {'previous' if b is None else 'new'} tree")
            continue
        if a["columns"] != b["columns"]:
            lines.append(f"{key}: columns {a['columns']} -> {b['columns']}")
            continue
        rows_a, rows_b = {r[0]: r for r in a["rows"]}, {r[0]: r for r in b["rows"]}
        for label in dict.fromkeys([*rows_a, *rows_b]):
            ra, rb = rows_a.get(label), rows_b.get(label)
            if ra is None or rb is None:
                lines.append(f"{key} / {label}: {'-' if ra is None else 'row'} -> {'-' if rb is None else 'row'}")
                continue
            for column, x, y in zip(a["columns"][1:], ra[1:], rb[1:]):
                if x != y:
                    lines.append(f"{key} / {label} / {column}: {x} -> {y}")
    return lines


def compare(args: argparse.Namespace) -> None:
    old = Path(tempfile.mkdtemp(prefix="bench-report-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.base], cwd=REPO, check=True,
                   capture_output=True)
    base = subprocess.check_output(["git", "rev-parse", args.base], cwd=REPO, text=True).strip()
    trees = {"previous": old, "this": REPO}
    runs: dict[str, list[tuple[float, dict]]] = {name: [] for name in trees}
    started, load = time.perf_counter(), os.getloadavg()[0]
    try:
        for round_index in range(args.rounds):
            for name, tree in trees.items():
                cpu, result = run_child(tree, args)
                runs[name].append((cpu, result))
                stages = ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in result["stages"].items())
                print(f"  round {round_index + 1}, {name} tree: {cpu:.1f} CPU s (load average "
                      f"{os.getloadavg()[0]:.1f}; {stages})", flush=True)
            changed = differences(runs["previous"][-1][1]["tables"], runs["this"][-1][1]["tables"])
            print(f"  round {round_index + 1}, answers: " + ("the same in every table compared" if not changed
                                                            else f"{len(changed)} cell(s) differ"), flush=True)
            for line in changed:
                print(f"    {line}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
          f"end; previous tree {base[:10]}; {args.rounds} round(s), workers {args.workers or 'default'}; "
          f"{time.perf_counter() - started:.0f} s wall")
    print(f"report of {Path(args.scenario).name} at {args.target_rate:g}/s on {', '.join(args.hardware)}")
    print(f"{'CPU s':<16} {'previous':>22} {'this':>22}")

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    print(f"{'whole report':<16} {cell([c for c, _ in runs['previous']]):>22} {cell([c for c, _ in runs['this']]):>22}")
    for stage in runs["this"][0][1]["stages"]:
        print(f"  {stage:<14} " + " ".join(f"{cell([r['stages'].get(stage, 0.0) for _, r in runs[name]]):>22}"
                                           for name in trees))
    same = all(not differences(old_run[1]["tables"], new_run[1]["tables"])
               for old_run, new_run in zip(runs["previous"], runs["this"]))
    print("answers: " + ("the same in every table compared, every round" if same else "differ (rounds above)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios" / "llama3-8b-h100-chat.yaml"))
    parser.add_argument("--target-rate", type=float, default=60.0)
    parser.add_argument("--hardware", nargs="+", default=["H100-SXM", "H200", "MI300X", "CS-3"])
    parser.add_argument("--requests", type=int)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--base", help="also build the report with this commit's tree and compare (e.g. main)")
    parser.add_argument("--rounds", type=int, default=1, help="with --base: rounds, each tree once per round")
    args = parser.parse_args()
    if args.base:
        compare(args)
        return
    from llmsim.report.build import ReportBuilder, traffic_from_rate
    from llmsim.report.render import to_html, to_markdown

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
    deployment = report.table("deployment")
    chip, layout, replicas = (deployment.cell(row, "recommended") for row in ("chip", "layout", "replicas"))
    print(f"recommended: {chip} {layout} x {replicas} replicas; wrote {out}")


if __name__ == "__main__":
    main()
