"""A day of traffic through ``llmsim run``: CPU seconds and peak memory (max RSS) of 1,000,000
requests of ``scenarios/day-of-traffic-diurnal.yaml``, beside the previous tree's on the same machine
in the same run, and (``--day``, long: run it once) the whole day, 8.64 million requests.

The previous tree is checked out at ``--base`` (default: where this branch left main) into a
temporary git worktree and run by the same Python; each run is ``llmsim run SCENARIO --requests N
--force`` under ``/usr/bin/time -v`` (CPU: user + system seconds of the process; memory: its maximum
resident set). The targets: 1M requests under 1.2 GB, the day in under 10 CPU minutes and 2 GB.

    python benchmarks/bench_day.py            # 1M, this tree and the previous one
    python benchmarks/bench_day.py --day      # and the whole day, this tree
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIO = REPO / "scenarios" / "day-of-traffic-diurnal.yaml"
RUN = "import sys; from llmsim.cli.main import main; sys.exit(main())"


def measure(tree: Path, requests: int | None, out: Path) -> dict[str, float]:
    """CPU seconds, peak RSS (GB) and wall seconds of one ``llmsim run`` with ``tree``'s code."""
    command = ["/usr/bin/time", "-v", sys.executable, "-c", RUN, "run", str(SCENARIO), "--force",
               "--out", str(out), "--overwrite"] + (["--requests", str(requests)] if requests else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"llmsim run failed ({tree}):\n{done.stderr[-3000:]}")

    def field(name: str) -> float:
        return float(re.search(rf"{re.escape(name)}: ([\d.]+)", done.stderr).group(1))

    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr).group(1)
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.split(":"))))
    arrived = re.search(r"arrived ([\d,]+)", done.stdout)
    return {"cpu_s": field("User time (seconds)") + field("System time (seconds)"),
            "rss_gb": field("Maximum resident set size (kbytes)") * 1024 / 1e9, "wall_s": seconds,
            "requests": int(arrived.group(1).replace(",", "")) if arrived else 0}


def line(label: str, figures: dict[str, float]) -> str:
    return (f"{label:<34} {figures['requests']:>10,} requests  {figures['cpu_s']:8.1f} CPU s  "
            f"{figures['rss_gb']:6.2f} GB max RSS  {figures['wall_s']:8.1f} s wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--base", help="the previous tree's commit (default: git merge-base HEAD main)")
    parser.add_argument("--day", action="store_true", help="also the whole day (8.64M requests), this tree only")
    parser.add_argument("--no-previous", action="store_true", help="skip the previous tree")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="llmsim-bench-day-") as scratch:
        scratch = Path(scratch)
        print(line("this tree", measure(REPO, args.requests, scratch / "new")), flush=True)
        if not args.no_previous:
            base = args.base or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=REPO, check=True,
                                               capture_output=True, text=True).stdout.strip()
            previous = scratch / "previous"
            subprocess.run(["git", "worktree", "add", "--detach", str(previous), base], cwd=REPO, check=True,
                           capture_output=True)
            try:
                print(line(f"previous tree ({base[:10]})", measure(previous, args.requests, scratch / "old")),
                      flush=True)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(previous)], cwd=REPO, check=True)
        if args.day:
            print(line("this tree, the whole day", measure(REPO, None, scratch / "day")), flush=True)


if __name__ == "__main__":
    main()
