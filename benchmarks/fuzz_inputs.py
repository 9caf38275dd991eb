"""The long run of the property-based input suite: 2,000 generated cases, and what became of them.

The cases and the contract are those of ``tests/config/test_fuzz_inputs.py`` (``tests/fuzz.py``):
mutated scenarios, files that are not scenarios, comparisons, grids, traces and flag sets
drawn from the parser, each run through ``llmsim``'s ``main`` in this process with a time
budget. CI runs a few of each kind; this runs ``--cases`` in all (shared equally among the
kinds) with a fixed seed and prints, per kind, how many exited 0, how many were refused with
exit 2, how many broke the contract (a traceback, a hang, a wrong exit status or a result that
does not add up: each is printed), the slowest case and the process's peak memory.

    python benchmarks/fuzz_inputs.py [--cases 2000] [--seed 0]
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.fuzz import KINDS, run_case  # noqa: E402


def explore(kind: str, cases: int, seed_value: int) -> tuple[Counter, float, list[str]]:
    """Run ``cases`` cases of ``kind``: (outcome counts, slowest seconds, contract breaches)."""
    counts, breaches, slowest = Counter(), [], [0.0]

    @seed(seed_value)                                 # a fixed seed: the same cases every run
    @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              print_blob=False)
    @given(case=KINDS[kind]())
    def one(case):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="llmsim-fuzz-") as folder:
            try:
                outcome = run_case(case, Path(folder))
                counts[f"exit {outcome.status}"] += 1
            except BaseException as error:          # a breach: keep going, report it below
                counts["breach"] += 1
                breaches.append(f"{kind}: {case.argv} {list(case.files)}\n    "
                                + "".join(traceback.format_exception_only(type(error), error)).strip()[:600])
        slowest[0] = max(slowest[0], time.perf_counter() - start)

    one()
    return counts, slowest[0], breaches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    per_kind = max(1, args.cases // len(KINDS))
    print(f"{per_kind * len(KINDS):,} cases, {per_kind:,} per kind, seed {args.seed}")
    print(f"{'kind':12} {'exit 0':>7} {'exit 2':>7} {'other':>7} {'breach':>7} {'slowest s':>10} {'wall s':>8}")
    all_breaches = []
    for kind in KINDS:
        start = time.perf_counter()
        counts, slowest, breaches = explore(kind, per_kind, args.seed)
        other = sum(v for k, v in counts.items() if k not in ("exit 0", "exit 2", "breach"))
        print(f"{kind:12} {counts['exit 0']:7,} {counts['exit 2']:7,} {other:7,} {counts['breach']:7,} "
              f"{slowest:10.2f} {time.perf_counter() - start:8.1f}", flush=True)
        all_breaches += breaches
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak memory of the whole run: {peak_gb:.2f} GB")
    for breach in all_breaches:
        print(breach)
    return 1 if all_breaches else 0


if __name__ == "__main__":
    sys.exit(main())
