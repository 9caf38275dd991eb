"""CPU seconds of ``recommend`` on each shipped scenario and of ``report`` on four chips, beside the
previous tree's, in one run on the same machine, and whether the answers match.

    python benchmarks/bench_search.py [--base COMMIT] [--rounds N] [--targets chat tp8 speculative report]
                                      [--parallel P] [--workers W] [--cpu-limit S]

A target is ``report``, one of the short names below, any shipped scenario by its file's stem
(``llama3-8b-h100-canary``), or ``all``: every shipped scenario (a scenario ``recommend`` refuses reports
its refusal). The previous tree is exported from ``--base`` (default: where this branch left main, ``git
merge-base HEAD main``) with ``git archive`` into a temporary folder and imported from there, its hardware
profiles through ``LLMSIM_PROFILE_PATH``; before the rounds each tree runs a small speculative ``recommend``
once, untimed (two seeds, 300 requests a run: the fluid scans, the windows' stops, plain and speculative
engines), so that neither tree's figures include compiling its numba kernels (cached next to their source, as
an installed tree's are after its first run; a 30-request simulation left the fluid scans' and the miss
watch's kernels to the first round of a fresh tree, 0.6-1.2 CPU s of the canary's). Each (tree, target,
round) runs in a child process; its CPU time is the child's user + system time, its worker processes
included (``os.wait4``). Rounds interleave the two trees; the figure is the median over rounds. ``--parallel``
runs that many children at once (CPU time, not wall time, is what is compared). The answer compared:
recommend's best setting and its goodput (with its 95% interval); report's recommended deployment (chip,
layout and replicas). A child that fails prints the end of its standard error; ``--cpu-limit`` stops a child
after that many CPU seconds (its figure is then shown as over the limit).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = {"chat": "scenarios/llama3-8b-h100-chat.yaml", "tp8": "scenarios/llama2-70b-8xh100-tp8.yaml",
             "speculative": "scenarios/llama3-70b-h100-speculative.yaml"}
SHIPPED = {path.stem: f"scenarios/{path.name}" for path in sorted((REPO / "scenarios").glob("*.yaml"))}
WARMUP = r'''
from llmsim.search.recommend import recommend
recommend("scenarios/llama3-70b-h100-speculative.yaml", workers=1, seeds=2, top=1, tolerance=0.5, requests=300)
'''
REPORT = ("scenarios/llama3-8b-h100-chat.yaml", 60.0, ["H100-SXM", "H200", "MI300X", "CS-3"])

CHILD = r'''
import json, sys
target, path, workers = sys.argv[1], sys.argv[2], (None if sys.argv[3] == "none" else int(sys.argv[3]))
if target == "report":
    from llmsim.report.build import ReportBuilder, traffic_from_rate
    rate, chips = float(sys.argv[4]), sys.argv[5].split(",")
    report = ReportBuilder(path, traffic_from_rate(rate), hardware=chips, workers=workers).build()
    deployed = {quantity: value for quantity, value in report.table("deployment").rows}
    answer = ", ".join(f"{quantity} {deployed[quantity]}" for quantity in ("chip", "layout", "replicas"))
    print(json.dumps({"answer": answer, "goodput": None, "ci95": None}))
else:
    from llmsim.errors import ConfigError
    from llmsim.search.recommend import recommend
    try:
        rec = recommend(path, workers=workers, drafts=True)
    except ConfigError as error:            # a scenario recommend does not take (no SLO, no one rate to vary)
        print(json.dumps({"answer": f"refused: {error.message}", "goodput": None, "ci95": None}))
        sys.exit(0)
    row = rec.table.iloc[0]
    print(json.dumps({"answer": rec.best.label, "goodput": float(row["max_rate_per_s"]),
                      "ci95": float(row["max_rate_per_s.ci95"])}))
'''


def environment(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "LLMSIM_PROFILE_PATH": str(tree / "hardware_profiles")}


def run_child(tree: Path, target: str, workers: str, cpu_limit_s: int | None = None) -> tuple[float, dict]:
    """One measurement: (CPU seconds of the child and its workers, its answer)."""
    if target == "report":
        args = [REPORT[0], workers, str(REPORT[1]), ",".join(REPORT[2])]
    else:
        args = [SCENARIOS.get(target) or SHIPPED[target], workers]
    limit = [] if cpu_limit_s is None else ["prlimit", f"--cpu={cpu_limit_s}"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([*limit, sys.executable, "-c", CHILD, target, *args], cwd=tree,
                                 env=environment(tree), stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().strip().splitlines()
        err.seek(0)
        errors = err.read().strip()
    if cpu_limit_s is not None and child.returncode < 0:
        return usage.ru_utime + usage.ru_stime, {"answer": f"stopped at the {cpu_limit_s} CPU s limit"}
    if child.returncode != 0 or not text:
        # The child's own error, so that a failure says why (its last lines: the traceback's end).
        tail = "\n".join(errors.splitlines()[-15:])
        print(f"  {target} on {tree} exited {child.returncode}:\n{tail}", file=sys.stderr, flush=True)
        return usage.ru_utime + usage.ru_stime, {"answer": f"failed (exit {child.returncode})"}
    return usage.ru_utime + usage.ru_stime, json.loads(text[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the previous tree's commit (default: git merge-base HEAD main)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--targets", nargs="+", default=["chat", "tp8", "speculative", "report"],
                        choices=[*SCENARIOS, *SHIPPED, "all", "report"])
    parser.add_argument("--cpu-limit", type=int, help="stop a child after this many CPU seconds")
    parser.add_argument("--parallel", type=int, default=1, help="children run at once")
    parser.add_argument("--workers", default="1", help="each search's worker processes ('none': all cores)")
    args = parser.parse_args()
    if "all" in args.targets:
        args.targets = [*SHIPPED, *(["report"] if "report" in args.targets else [])]
    base = args.base or subprocess.check_output(["git", "merge-base", "HEAD", "main"], cwd=REPO, text=True).strip()
    old = Path(tempfile.mkdtemp(prefix="bench-search-base-")) / "tree"
    old.mkdir()
    archive = subprocess.run(["git", "archive", base], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    trees = {"previous": old, "this": REPO}
    for tree in trees.values():
        subprocess.run([sys.executable, "-c", WARMUP], cwd=tree, env=environment(tree), check=True)
    jobs = [(r, target, name) for r in range(args.rounds) for target in args.targets for name in trees]
    started = time.perf_counter()
    try:
        def measured(job):
            cpu, answer = run_child(trees[job[2]], job[1], args.workers, args.cpu_limit)
            print(f"  round {job[0] + 1}, {job[1]}, {job[2]} tree: {cpu:.1f} CPU s, {answer['answer']}", flush=True)
            return job, (cpu, answer)

        with ThreadPoolExecutor(args.parallel) as pool:
            done = list(pool.map(measured, jobs))
    finally:
        shutil.rmtree(old.parent, ignore_errors=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; previous tree {base[:10]}; "
          f"{args.rounds} round(s), {args.workers} worker(s) per search; {time.perf_counter() - started:.0f} s wall")
    width = max(12, *map(len, args.targets))
    print(f"{'target':<{width}} {'previous CPU s':>14} {'this CPU s':>10}  answers")
    for target in args.targets:
        cpu = {name: statistics.median(c for (r, t, n), (c, _) in done if t == target and n == name) for name in trees}
        answers = {name: next(a for (r, t, n), (_, a) in done if t == target and n == name) for name in trees}
        same = answers["previous"]["answer"] == answers["this"]["answer"]
        print(f"{target:<{width}} {cpu['previous']:>14.1f} {cpu['this']:>10.1f}  {'same' if same else 'different'}")
        for name in trees:
            a = answers[name]
            goodput = "" if a.get("goodput") is None else f"; goodput {a['goodput']:.3g} +- {a['ci95']:.2g} req/s"
            print(f"    {name:<9} {a['answer']}{goodput}")


if __name__ == "__main__":
    main()
