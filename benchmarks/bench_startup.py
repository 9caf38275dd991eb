"""How long a user waits before anything happens: ``import llmsim``, ``llmsim --help`` and
``llmsim run --help`` (which loads what a run needs), each in a fresh interpreter.

Prints the median process CPU seconds (user + system) of ``N`` fresh processes per command
(default 7), beside the targets: ``import llmsim`` under 0.3 s and ``llmsim --help`` under 0.5 s.
Run ``python benchmarks/bench_startup.py [N]``.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys

COMMANDS = {
    "import llmsim": ["-c", "import llmsim"],
    "llmsim --help": ["-m", "llmsim.cli.main", "--help"],
    "llmsim run --help": ["-m", "llmsim.cli.main", "run", "--help"],
    "python (nothing imported)": ["-c", "pass"],
}
TARGETS_S = {"import llmsim": 0.3, "llmsim --help": 0.5}


def cpu_seconds(arguments: list[str]) -> float:
    """The CPU time of one fresh interpreter running ``arguments`` (its children's rusage)."""
    before = os.times()
    subprocess.run([sys.executable, *arguments], check=True, stdout=subprocess.DEVNULL)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main(rounds: int) -> None:
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"median of {rounds} fresh processes (CPU s)")
    for name, arguments in COMMANDS.items():
        median = statistics.median(cpu_seconds(arguments) for _ in range(rounds))
        target = TARGETS_S.get(name)
        verdict = "" if target is None else f"   target < {target} s: {'met' if median < target else 'NOT met'}"
        print(f"{name:28s} {median:6.3f} s{verdict}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
