"""The sweep journal cannot lie: a corrupt line anywhere is dropped and its point simulated again,
one sweep at a time writes to a folder, and a killed sweep leaves no worker behind."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmsim.search.sweeps as sweeps
from llmsim import sweep
from llmsim.search.journal import CHECKSUM

from tests.helpers import BASE, REPO, make_scenario, merge

SMALL = {"workload": {"num_requests": 40}, "slo": {"ttft": "300 ms", "tpot": "40 ms"}}
GRID = {"workload.arrival.rate": [4.0, 8.0, 16.0]}


def small():
    return make_scenario(SMALL)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """An uninterrupted sweep's table and journal bytes."""
    out = tmp_path_factory.mktemp("journal")
    table = sweep(small(), GRID, out=out, workers=1)
    return table, (out / "results.csv").read_bytes()


def resweep(out: Path) -> tuple[pd.DataFrame, list[float]]:
    """The sweep again on ``out``: its table and the rates it simulated."""
    rates: list[float] = []
    real = sweeps.simulate_point

    def counted(scenario, stop_when_missed=None):
        rates.append(scenario.workload.arrival.rate_per_s)
        return real(scenario, stop_when_missed)

    with mock.patch.object(sweeps, "simulate_point", counted):
        table = sweep(small(), GRID, out=out, workers=1)
    return table, rates


def corrupt(data: bytes, line: int, kind: str, position: int, byte: int) -> bytes:
    """``data`` with one line damaged: a byte flipped, deleted or inserted, the line cut short
    (its newline kept), or the file torn there (the rest lost, as a crash mid-write leaves it)."""
    lines = data.split(b"\n")[:-1]
    target = lines[line]
    at = position * len(target) // 1000             # position: thousandths of the line
    if kind == "flip":
        target = target[:at] + bytes([target[at] ^ byte]) + target[at + 1:]
    elif kind == "delete":
        target = target[:at] + target[at + 1:]
    elif kind == "insert":
        target = target[:at] + bytes([byte]) + target[at:]
    elif kind == "cut":
        target = target[:at]
    else:                               # torn
        return b"\n".join(lines[:line] + [target[:at]])
    return b"\n".join(lines[:line] + [target] + lines[line + 1:]) + b"\n"


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=st.integers(0, 3), kind=st.sampled_from(["flip", "delete", "insert", "cut", "torn"]),
       position=st.integers(0, 999), byte=st.integers(1, 255))   # no st.floats: a library may set flush-to-zero
def test_a_corrupt_line_anywhere_is_detected_and_its_point_recomputed(uninterrupted, line, kind, position, byte):
    table, original = uninterrupted
    damaged = corrupt(original, line, kind, position, byte)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "results.csv").write_bytes(damaged)
        again, rates = resweep(Path(folder))
        # Every point whose line is not intact (and all of them, with the header damaged) is simulated
        # again, once; the others are read back; the table is the uninterrupted run's.
        lines, kept = original.split(b"\n")[:-1], set(damaged.split(b"\n"))
        header_intact = lines[0] in kept
        lost = {rate for rate, text in zip(GRID["workload.arrival.rate"], lines[1:])
                if not header_intact or text not in kept}
        assert sorted(rates) == sorted(lost)
        pd.testing.assert_frame_equal(again, table)
        journal = pd.read_csv(Path(folder) / "results.csv")
        assert len(journal) == 3 and journal["point_id"].is_unique


def test_a_journal_without_checksums_is_recomputed_not_trusted(tmp_path, uninterrupted):
    table, original = uninterrupted
    legacy = pd.read_csv(io.BytesIO(original)).drop(columns=CHECKSUM)
    legacy.to_csv(tmp_path / "results.csv", index=False)
    with pytest.warns(UserWarning, match="4 line"):
        again, rates = resweep(tmp_path)
    assert sorted(rates) == GRID["workload.arrival.rate"]
    pd.testing.assert_frame_equal(again, table)


SWEEP_SCRIPT = """
import os, sys, time
from pathlib import Path
import llmsim.search.sweeps as sweeps
from llmsim import sweep
from tests.helpers import make_scenario

folder, log, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
real = sweeps.simulate_point

def logged(scenario, stop_when_missed=None):
    with log.open("a") as handle:
        handle.write(f"{os.getpid()} {scenario.workload.arrival.rate_per_s}\\n")
    if mode == "wait":                      # hold the lock until the test says go
        while not (folder.parent / "go").exists():
            time.sleep(0.05)
    elif mode == "hang":                    # a worker busy for as long as anyone waits
        time.sleep(600)
    return real(scenario, stop_when_missed)

sweeps.simulate_point = logged
try:
    sweep(make_scenario({"workload": {"num_requests": 40}}), {"workload.arrival.rate": [4.0, 8.0, 16.0]},
          out=folder, workers=int(sys.argv[4]))
except Exception as error:
    print(error, file=sys.stderr)
    sys.exit(2)
"""


def start_sweep(tmp_path: Path, mode: str, workers: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SWEEP_SCRIPT, str(tmp_path / "out"), str(tmp_path / "log"),
                             mode, str(workers)], cwd=REPO, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_two_sweeps_on_one_folder_compute_each_point_once(tmp_path):
    """The second sweep finds the folder locked and stops at once (exit 2, naming the first's pid);
    after the first finishes, the same command has nothing left to compute."""
    first = start_sweep(tmp_path, "wait", 1)
    lock = tmp_path / "out" / "results.csv.lock"
    wait_for(lambda: (tmp_path / "log").exists(), 120, "the first sweep to start computing")
    assert lock.read_text().strip() == str(first.pid)
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(merge(BASE, {"workload": {"num_requests": 40}})))
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    command = [sys.executable, "-m", "llmsim.cli.main", "sweep", str(scenario), "--grid", str(grid),
               "--out", str(tmp_path / "out"), "--workers", "1"]
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and f"pid {first.pid}" in second.stderr, second.stderr
    (tmp_path / "go").touch()
    assert first.wait(timeout=300) == 0, first.stderr.read()
    computed = (tmp_path / "log").read_text().split()[1::2]
    assert sorted(map(float, computed)) == GRID["workload.arrival.rate"]          # each point once
    journal = (tmp_path / "out" / "results.csv").read_bytes()
    assert subprocess.run(command, cwd=REPO, capture_output=True, timeout=300).returncode == 0
    assert (tmp_path / "out" / "results.csv").read_bytes() == journal             # nothing recomputed


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent may be slow to reap it)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_sigkill_of_a_sweep_leaves_no_worker_alive(tmp_path):
    parent = start_sweep(tmp_path, "hang", 2)
    # Both workers have run their initializer once they are inside a point.
    wait_for(lambda: (tmp_path / "log").exists() and len((tmp_path / "log").read_text().splitlines()) >= 2,
             120, "two workers to start their points")
    workers = [int(line.split()[0]) for line in (tmp_path / "log").read_text().splitlines()]
    assert set(workers) <= set(children(parent.pid)) and all(map(running, workers))
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        # The kernel sends each worker SIGKILL while it tears the parent down (PR_SET_PDEATHSIG),
        # so the workers are gone within milliseconds; 30 s allows for a 2-core machine loaded by
        # other tests (without the fix they sleep on for 600 s).
        wait_for(lambda: not any(map(running, workers)), 30, f"workers {workers} to die with their parent")
    finally:
        for pid in filter(running, workers):        # a failed test leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
