"""Property-based: generated scenarios, comparisons, grids, traces and flag sets never get a
traceback or a hang; each exits 0 with a valid result or 2 with one paragraph (tests/fuzz.py).

CI runs a bounded number of examples per kind with a fixed seed (derandomized, about 30 s in
all); ``benchmarks/fuzz_inputs.py`` runs 2,000 and reports what it found.
"""
from __future__ import annotations

import os
import resource
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz import KINDS, run_case

EXAMPLES = int(os.environ.get("LLMSIM_FUZZ_EXAMPLES", "8"))        # per kind (CI: about 20 s in all)
MAX_GROWTH_BYTES = 1 * 2**30       # peak memory a kind's cases may add to the test process


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # kB on Linux


@pytest.mark.parametrize("kind", list(KINDS))
def test_generated_input_exits_0_or_2_never_a_traceback_or_a_hang(kind):
    before = _peak_bytes()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=KINDS[kind]())
    def check(case):
        with tempfile.TemporaryDirectory(prefix="llmsim-fuzz-") as folder:
            run_case(case, Path(folder))

    check()
    assert _peak_bytes() - before < MAX_GROWTH_BYTES
